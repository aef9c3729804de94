"""The sweeps of ``python -m deepep_cupy.tuning sms`` and ``... internode`` without a GPU: their command lines,
the variants and settings they time, the checked and interleaved runs of the variants (on a stand-in engine) and
the tables they print."""

import sys
from types import SimpleNamespace

import pytest

from deepep_cupy.device import gpus
from deepep_cupy.tuning import cli, internode, sms, variants


# ---------------------------------------------------------------------------------------------------------- sms
def test_sms_arguments():
    args = sms.parse_args(["--num-sms", "8,12,24", "--dispatch-shapes", "32x8,16X14,32x8", "--ops", "bf16,combine"])
    assert args.num_sms == (8, 12, 24) and args.dispatch_shapes == ((32, 8), (16, 14))
    assert args.ops == ("bf16", "combine") and args.combine_shapes == sms.COMBINE_SHAPES
    plain = sms.parse_args([])
    assert plain.num_sms == (8, 12, 24) and plain.ops == tuple(sms.OPS) and plain.rounds == 3
    assert (plain.fan_out, plain.copy_combine, plain.copy_rounds, plain.copy_chunks) == (None, None, None, None)
    # The help text's defaults parse back to the defaults.
    assert sms.parse_shapes(sms._shapes_text(sms.DISPATCH_SHAPES)) == sms.DISPATCH_SHAPES
    for option, bad in (("--num-sms", "8,x"), ("--dispatch-shapes", "33x4"), ("--combine-shapes", "16"),
                        ("--ops", "bf16,nope"), ("--fan-out", "sometimes"), ("--copy-combine", "maybe"),
                        ("--copy-rounds", "2,0"), ("--copy-rounds", "6:x"), ("--copy-chunks", "-1"),
                        ("--rounds", "0"), ("--tokens", "0")):
        with pytest.raises(SystemExit):
            sms.parse_args([option, bad])
    assert sms.parse_args(["--copy-rounds", "6:3:1,2,2"]).copy_rounds == ((6, 3, 1), 2)


def test_sms_dropped_the_one_off_options():
    """Options that no table or constant of the engines came from are not offered."""
    for option in ("--own-rows", "--copy-turn-waits", "--copy-whole-turns"):
        with pytest.raises(SystemExit):
            sms.parse_args([option, "1"])


def test_sms_shape_grid_and_fan_out():
    assert sms.shape_grid(((32, 8), (16, 14), (24, 4)), (16, 14)) == [(16, 14), (32, 8), (24, 4)]
    assert sms.shape_grid(((32, 8),), (24, 6)) == [(24, 6), (32, 8)]  # the default is timed even when not listed
    # --fan-out both: every dispatch shape both ways, one copy a destination first (the reference).
    shapes, default = sms.with_fan_out(((16, 8), (24, 6)), (24, 6), "both")
    assert default == (24, 6, False) and shapes == [(16, 8, False), (16, 8, True), (24, 6, False), (24, 6, True)]
    assert sms.shape_grid(shapes, default)[:2] == [(24, 6, False), (16, 8, False)]
    assert sms.with_fan_out(((16, 8),), (16, 8), None) == ([(16, 8, None)], (16, 8, None))
    assert variants.label({"warps": 16, "unroll": 8, "fan_out": True}) == "16 x 8 fan-out"
    assert variants.label({"warps": 16, "unroll": 8, "fan_out": None}) == variants.label({"warps": 16, "unroll": 8})
    # The grid worth trying: warps 16 / 24 / 32 with dispatch unrolls 4, 6, 8, 14 and combine 2, 4, 8.
    assert {w for w, _ in sms.DISPATCH_SHAPES} == {16, 24, 32} == {w for w, _ in sms.COMBINE_SHAPES}
    assert {u for _, u in sms.DISPATCH_SHAPES} == {4, 6, 8, 14} and {u for _, u in sms.COMBINE_SHAPES} == {2, 4, 8}


def test_sms_copy_variants():
    """--copy-rounds / --copy-chunks: every combine shape with every value, the first values the reference; and
    --copy-combine both: either mode."""
    args = sms.parse_args(["--copy-rounds", "2,1", "--copy-chunks", "1024,2048", "--copy-combine", "off"])
    names, got, default = sms.copy_variants(((32, 3), (32, 2)), (32, 3), args)
    assert names == ("combine_warps", "combine_unroll", "copy_rounds", "copy_chunk_rows")
    assert default == (32, 3, 2, 1024) and len(got) == 8 and got[:2] == [(32, 3, 2, 1024), (32, 3, 2, 2048)]
    assert sms.shape_grid(got, default)[0] == default
    plain = sms.parse_args([])
    assert sms.copy_variants(((16, 8),), (16, 8), plain) == (("combine_warps", "combine_unroll"), [(16, 8)], (16, 8))
    assert variants.label({"warps": 32, "unroll": 3, "copy_rounds": 2, "copy_chunk_rows": 2048}) == \
        "32 x 3 2 rounds 2048 rows"
    assert variants.label({"warps": 32, "unroll": 3, "copy_rounds": (6, 3, 1)}) == "32 x 3 6:3:1 parts"
    both = sms.parse_args(["--copy-rounds", "6:3:1", "--copy-combine", "both"])
    names, got, default = sms.copy_variants(((32, 3),), (32, 3), both)
    assert names[2:] == ("copy_rounds", "use_copy_combine") and default == (32, 3, (6, 3, 1), True)
    assert got == [(32, 3, (6, 3, 1), True), (32, 3, (6, 3, 1), False)]
    assert variants.label({"warps": 32, "unroll": 3, "use_copy_combine": False}) == "32 x 3 ring"


class _Comm:
    def allgather(self, value):
        return [value]


class _Engine:
    def __init__(self):
        self.broken, self.copy_seq, self.own_copies = None, 0, 0
        self.combine_warps = self.combine_unroll = None
        self.tuned = []  # the settings of every tune call

    def tune(self, **settings):
        self.tuned.append(settings)
        self.__dict__.update(settings)

    def check_errors(self, stream):
        pass


_STREAM = SimpleNamespace(synchronize=lambda: None)


def test_variants_are_checked_timed_and_tabulated():
    np = pytest.importorskip("numpy")
    engine = _Engine()
    steps = variants.Steps(_Comm(), engine, budget=1e9, start=0.0)
    sweep = variants.Sweep(engine, _STREAM, steps, rounds=3, say=lambda *a, **k: None, in_pool=lambda a: True)

    def combine():
        shape = (engine.combine_warps, engine.combine_unroll)
        if shape == (24, 8):
            raise RuntimeError("launch failed\nmore lines")
        engine.copy_seq += 1
        out = np.arange(64, dtype=np.uint16)
        if shape == (32, 8):
            out[3] ^= 1  # one bit off
        return out, np.ones(8, dtype=np.float32)

    times = {(16, 8): [300.0, 310.0, 305.0], (32, 4): [250.0, 240.0, 260.0], (32, 8): [200.0] * 3}

    def time_op(fn, stream, **timing):
        fn()
        return times[(engine.combine_warps, engine.combine_unroll)].pop(0)

    names = ("combine_warps", "combine_unroll")
    shapes = sms.shape_grid(((32, 4), (24, 8), (32, 8)), (16, 8))
    rows = sweep.run("combine BF16", 8, combine, names, shapes, (16, 8), time_op, {})
    by_shape = {(r["warps"], r["unroll"]): r for r in rows}
    assert by_shape[(16, 8)]["us"] == 305.0 and by_shape[(16, 8)]["default"] and by_shape[(16, 8)]["mode"] == "copy"
    assert by_shape[(32, 4)]["us"] == 250.0 and by_shape[(32, 4)]["rounds_us"] == [250.0, 240.0, 260.0]
    assert by_shape[(24, 8)]["error"] == "rank 0: FAILED: RuntimeError: launch failed" and "us" not in by_shape[(24, 8)]
    assert by_shape[(32, 8)]["mismatch"] == "rank 0: differs from the default"
    assert (engine.combine_warps, engine.combine_unroll) == (None, None)  # the engine's defaults again
    # Every variant is set through the engine's tune (which drops plans made with other values), names and all.
    assert engine.tuned[-1] == {"combine_warps": None, "combine_unroll": None}
    assert {"combine_warps": 32, "combine_unroll": 4} in engine.tuned
    table = variants.format_table(rows)
    assert "MISMATCH" in table and "FAILED" in table and "-18.0%" in table
    best = table.split("best shape per (op, SMs):")[1]
    assert "32 x 4" in best and "32 x 8" not in best  # a differing shape never wins
    assert "4 variants, 2 failed or differing" in table
    # Past the budget nothing more starts, and the rows say so.
    steps.budget = -1.0
    rows = sweep.run("combine BF16", 12, combine, names, [(16, 8), (32, 4)], (16, 8), time_op, {})
    assert steps.stopped.startswith("past the budget") and rows[1]["error"].startswith("skipped: past the budget")


def test_fan_out_variants_set_the_engine_and_reset_it():
    np = pytest.importorskip("numpy")
    engine = _Engine()
    engine.tune(dispatch_warps=None, dispatch_unroll=None, use_fan_out=None)
    sweep = variants.Sweep(engine, _STREAM, variants.Steps(_Comm(), engine, budget=1e9, start=0.0), rounds=2,
                           say=lambda *a, **k: None, in_pool=lambda a: True)
    seen = []

    def dispatch():
        seen.append((engine.dispatch_warps, engine.dispatch_unroll, engine.use_fan_out))
        out = np.arange(32, dtype=np.uint16)
        if engine.use_fan_out and engine.dispatch_unroll == 8:
            out[0] ^= 1  # fan-out at 16 x 8 writes one bit wrong
        return out, None

    def time_op(fn, stream, **timing):
        fn()
        return 100.0 if engine.use_fan_out else 120.0

    shapes, default = sms.with_fan_out(((16, 8), (24, 6)), (24, 6), "both")
    names = ("dispatch_warps", "dispatch_unroll", "use_fan_out")
    rows = sweep.run("dispatch FP8", 8, dispatch, names, sms.shape_grid(shapes, default), default, time_op, {})
    by = {(r["warps"], r["unroll"], r["fan_out"]): r for r in rows}
    assert len(rows) == 4 and by[(24, 6, False)]["default"] and by[(24, 6, True)]["us"] == 100.0
    assert by[(16, 8, True)]["mismatch"] == "rank 0: differs from the default" and "mismatch" not in by[(16, 8, False)]
    assert by[(24, 6, True)]["mode"] == "direct"
    assert set(seen) == set(shapes) and (engine.dispatch_warps, engine.use_fan_out) == (None, None)
    assert "24 x 6 fan-out" in variants.format_table(rows)


def test_a_broken_engine_stops_the_sweep():
    engine = _Engine()
    steps = variants.Steps(_Comm(), engine, budget=1e9, start=0.0)

    def fail():
        engine.broken = "timed out"
        raise RuntimeError("kernel wait timed out")

    value, shared = steps(fail)
    assert value is None and shared == [(None, "FAILED: RuntimeError: kernel wait timed out")]
    assert steps.stopped == "an engine is unusable after a kernel failure" and steps(lambda: 1) is None


# ---------------------------------------------------------------------------------------------------- internode
def test_internode_arguments():
    args = internode.parse_args(["--num-sms", "12", "--sub-channels", "8,4,8", "--rdma-recv", "256,128"])
    assert args.num_sms == (12,) and args.sub_channels == (8, 4) and args.rdma_recv == (256, 128)
    plain = internode.parse_args([])
    assert plain.num_sms == (8, 12, 24) and plain.sub_channels is None and plain.iters == 30
    assert (plain.rdma_recv, plain.rdma_send) == ((internode.BENCH_CONFIG[3],), (internode.BENCH_CONFIG[2],))
    for option, bad in (("--sub-channels", "0"), ("--rdma-send", "x"), ("--num-sms", ""), ("--iters", "0"),
                        ("--warmup", "-1")):
        with pytest.raises(SystemExit):
            internode.parse_args([option, bad])
    for option in ("--copied-own-rows", "--ring-rows"):  # one-off settings, no default came from them
        with pytest.raises(SystemExit):
            internode.parse_args([option])


def test_internode_settings_put_the_reference_first():
    from deepep_cupy.ops.internode import buffer_map as IL

    lsize, ndom = 1, 2
    args = internode.parse_args(["--num-sms", "8,24", "--rdma-recv", "128,256", "--rdma-send", "16,128"])
    todo = internode.settings(args, lsize, ndom)
    top = IL.max_sub_channels(lsize, ndom)
    for sms_count in (8, 24):
        mine = [s for s in todo if s[0] == sms_count]
        assert mine[0] == (sms_count, None, 128, 16)  # the reference: default channels, the benchmark's rings
        default = IL.sub_channels(lsize, ndom, sms_count)
        subs = {s[1] for s in mine[1:]}
        assert subs == {min(2, top), min(4, top), default, top}
        assert all(send < recv for _, _, recv, send in mine)  # a chunk of a whole ring is left out
        assert (sms_count, default, 128, 16) not in mine  # the reference is not timed twice
        assert len(mine) == len(set(mine))
    pinned = internode.settings(internode.parse_args(["--num-sms", "8", "--sub-channels", f"2,{top + 1}"]), lsize, ndom)
    assert pinned == [(8, None, 128, 16), (8, 2, 128, 16)]  # more channels than a block takes are left out


def test_internode_config_and_table_row():
    cfg = internode.config(12, 256, 8)
    assert (cfg.num_sms, cfg.num_max_nvl_chunked_send_tokens, cfg.num_max_nvl_chunked_recv_tokens,
            cfg.num_max_rdma_chunked_send_tokens, cfg.num_max_rdma_chunked_recv_tokens) == (12, 8, 512, 8, 256)
    row = (12, "16*", 96, 128, 16, 8, 8, "-", {"bf16": 300.0, "fp8": 150.0, "combine": 400.0}, "reference")
    naive = {"naive NCCL dispatch": 1000.0, "naive NCCL combine": 800.0}
    line = internode.format_row(row, naive)
    assert line.split() == ["12", "16*", "96", "128", "16", "8", "8", "-", "300.0", "150.0", "400.0", "0.30",
                            "0.50", "0.50", "reference"]
    assert internode.format_row(row, {}).split()[11] == "-"  # no naive time: no ratio


# ---------------------------------------------------------------------------------------------------- no mpi4py
@pytest.mark.parametrize("argv, prog", [(["sms"], "python -m deepep_cupy.tuning sms"),
                                        (["internode"], "python -m deepep_cupy.tuning internode"),
                                        (["--hidden", "4096"], "python -m deepep_cupy.tuning")])
def test_with_a_gpu_but_no_mpi4py_one_line(monkeypatch, argv, prog):
    monkeypatch.setattr(gpus, "no_gpu_reason", lambda: None)  # a usable GPU, whatever this machine has
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # `import mpi4py` raises ImportError
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == f'{prog}: needs mpi4py (pip install "deepep_cupy[mpi]") and a launch under mpirun'
