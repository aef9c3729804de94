"""The GPU tools' own kernels still compile (NVRTC on the CPU, as every shipped kernel is checked)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the tools import CUDA packages inside main(), not at import
    return module


def test_mps_residency_kernel_compiles():
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    source = _tool("mps_residency")._SOURCE
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"mps_residency.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, 1, [b"--gpu-architecture=sm_90"])
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            pytest.fail(f"the residency probe does not compile:\n{log.decode(errors='replace')}")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_PTXAS_LOG = """\
ptxas info    : 79 bytes gmem
ptxas info    : Compiling entry function '_ZN11deepep_cupy9intranode8dispatchILi2ELi32ELi8EEEv' for 'sm_90'
ptxas info    : Function properties for _ZN11deepep_cupy9intranode8dispatchILi2ELi32ELi8EEEv
ptxas         .     512 bytes stack frame, 688 bytes spill stores, 1326 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 512 bytes cumulative stack size, 128 bytes smem
ptxas info    : Compile time = 852.097 ms
ptxas info    : Function properties for _ZN11deepep_cupy9intranode15dispatch_directILi2ELi32ELi8EEEb
ptxas         .     0 bytes stack frame, 52 bytes spill stores, 80 bytes spill loads
"""


def test_kernel_resources_reads_the_ptxas_report():
    tool = _tool("kernel_resources")
    got = tool.parse_ptxas(_PTXAS_LOG)
    assert got["registers"] == 64 and got["smem"] == 128
    assert list(got["functions"].values()) == [(512, 688, 1326), (0, 52, 80)]
    row = {"kind": "dispatch", "ranks": 2, "warps": 32, "unroll": 8, **got}
    line = tool.describe(row)
    assert "regs  64" in line and "688/1326 + 52/80" in line and line.endswith("launches")
    # 1024 threads fit at 64 registers a thread, not at 72; 768 threads at 80.
    assert tool.fits(64, 32) and not tool.fits(72, 32) and tool.fits(80, 24) and not tool.fits(88, 24)
    assert len(tool.variants([2], [16, 32], [4, 8], [2])) == 2 * 2 + 2 * 2 * 1
    # Internode kernels: L x D x channels a block; their relocatable builds print no smem, and NVSHMEM's
    # device functions are not the kernel's spills.
    assert tool._shapes("1x2x8,2X2x4") == [(1, 2, 8), (2, 2, 4)]
    log = ("ptxas info    : Function properties for _ZN11deepep_cupy9internode8dispatchILi1ELi2ELi16EEEv\n"
           "ptxas         .     120 bytes stack frame, 160 bytes spill stores, 260 bytes spill loads\n"
           "ptxas info    : Used 64 registers, used 1 barriers\n"
           "ptxas info    : Function properties for _Z14nvshmemi_fenceIL13threadgroup_t3EEviPii\n"
           "ptxas         .     8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n")
    got = tool.parse_ptxas(log)
    assert got["registers"] == 64 and got["smem"] is None
    line = tool.describe({"kind": "internode_dispatch", "ranks": 1, "warps": 2, "unroll": 16, **got})
    assert "1 x 2 S=16" in line and "160/260 " in line and line.endswith("launches")  # 1024 threads, 64 regs


def test_sm_sweep_arguments():
    tool = _tool("sm_sweep")
    args = tool.command_line().parse_args(["--num-sms", "8,12,24", "--dispatch-shapes", "32x8,16X14,32x8",
                                           "--ops", "bf16,combine"])
    assert args.num_sms == (8, 12, 24) and args.dispatch_shapes == ((32, 8), (16, 14))
    assert args.ops == ("bf16", "combine") and args.combine_shapes == tool.COMBINE_SHAPES
    for option, bad in (("--num-sms", "8,x"), ("--dispatch-shapes", "33x4"), ("--combine-shapes", "16"),
                        ("--ops", "bf16,nope")):
        with pytest.raises(SystemExit):
            tool.command_line().parse_args([option, bad])
    assert tool.shape_grid(((32, 8), (16, 14), (24, 4)), (16, 14)) == [(16, 14), (32, 8), (24, 4)]
    # --fan-out both: every dispatch shape both ways, one copy a destination first (the reference).
    assert tool.command_line().parse_args(["--fan-out", "both"]).fan_out == "both"
    shapes, default = tool.with_fan_out(((16, 8), (24, 6)), (24, 6), "both")
    assert default == (24, 6, False) and shapes == [(16, 8, False), (16, 8, True), (24, 6, False), (24, 6, True)]
    assert tool.shape_grid(shapes, default)[:2] == [(24, 6, False), (16, 8, False)]
    assert tool.with_fan_out(((16, 8),), (16, 8), None) == ([(16, 8, None)], (16, 8, None))
    assert tool._shape({"warps": 16, "unroll": 8, "fan_out": True}) == "16 x 8 fan-out"
    assert tool._shape({"warps": 16, "unroll": 8, "fan_out": None}) == tool._shape({"warps": 16, "unroll": 8})
    with pytest.raises(SystemExit):
        tool.command_line().parse_args(["--fan-out", "sometimes"])
    # The grid worth trying: warps 16 / 24 / 32 with dispatch unrolls 4, 6, 8, 14 and combine 2, 4, 8.
    assert {w for w, _ in tool.DISPATCH_SHAPES} == {16, 24, 32} == {w for w, _ in tool.COMBINE_SHAPES}
    assert {u for _, u in tool.DISPATCH_SHAPES} == {4, 6, 8, 14} and {u for _, u in tool.COMBINE_SHAPES} == {2, 4, 8}


class _Comm:
    def allgather(self, value):
        return [value]


class _Engine:
    def __init__(self):
        self.broken, self.copy_seq, self.own_copies = None, 0, 0
        self.combine_warps = self.combine_unroll = None

    def check_errors(self, stream):
        pass


def test_sm_sweep_checks_times_and_tabulates_every_shape():
    np = pytest.importorskip("numpy")
    tool = _tool("sm_sweep")
    engine, stream = _Engine(), type("Stream", (), {"synchronize": lambda self: None})()
    steps = tool.Steps(_Comm(), engine, budget=1e9, start=0.0)
    sweep = tool.Sweep(engine, stream, steps, rounds=3, say=lambda *a, **k: None, in_pool=lambda a: True)

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

    shapes = tool.shape_grid(((32, 4), (24, 8), (32, 8)), (16, 8))
    rows = sweep.run("combine BF16", 8, combine, ("combine_warps", "combine_unroll"), shapes, (16, 8), time_op, {})
    by_shape = {(r["warps"], r["unroll"]): r for r in rows}
    assert by_shape[(16, 8)]["us"] == 305.0 and by_shape[(16, 8)]["default"] and by_shape[(16, 8)]["mode"] == "copy"
    assert by_shape[(32, 4)]["us"] == 250.0 and by_shape[(32, 4)]["rounds_us"] == [250.0, 240.0, 260.0]
    assert by_shape[(24, 8)]["error"] == "rank 0: FAILED: RuntimeError: launch failed" and "us" not in by_shape[(24, 8)]
    assert by_shape[(32, 8)]["mismatch"] == "rank 0: differs from the default"
    assert (engine.combine_warps, engine.combine_unroll) == (None, None)  # the engine's defaults again
    table = tool.format_table(rows)
    assert "MISMATCH" in table and "FAILED" in table and "-18.0%" in table
    best = table.split("best shape per (op, SMs):")[1]
    assert "32 x 4" in best and "32 x 8" not in best  # a differing shape never wins
    assert "4 variants, 2 failed or differing" in table
    # Past the budget nothing more starts, and the rows say so.
    steps.budget = -1.0
    rows = sweep.run("combine BF16", 12, combine, ("combine_warps", "combine_unroll"), [(16, 8), (32, 4)], (16, 8),
                     time_op, {})
    assert steps.stopped.startswith("past the budget") and rows[1]["error"].startswith("skipped: past the budget")


def test_sm_sweep_fan_out_variants():
    """--fan-out both: each dispatch shape twice, the engine's use_fan_out set for each call and reset after."""
    np = pytest.importorskip("numpy")
    tool = _tool("sm_sweep")
    engine, stream = _Engine(), type("Stream", (), {"synchronize": lambda self: None})()
    engine.dispatch_warps = engine.dispatch_unroll = engine.use_fan_out = None
    sweep = tool.Sweep(engine, stream, tool.Steps(_Comm(), engine, budget=1e9, start=0.0), rounds=2,
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

    shapes, default = tool.with_fan_out(((16, 8), (24, 6)), (24, 6), "both")
    names = ("dispatch_warps", "dispatch_unroll", "use_fan_out")
    rows = sweep.run("dispatch FP8", 8, dispatch, names, tool.shape_grid(shapes, default), default, time_op, {})
    by = {(r["warps"], r["unroll"], r["fan_out"]): r for r in rows}
    assert len(rows) == 4 and by[(24, 6, False)]["default"] and by[(24, 6, True)]["us"] == 100.0
    assert by[(16, 8, True)]["mismatch"] == "rank 0: differs from the default" and "mismatch" not in by[(16, 8, False)]
    assert set(seen) == set(shapes) and (engine.dispatch_warps, engine.use_fan_out) == (None, None)
    assert "24 x 6 fan-out" in tool.format_table(rows)


def test_sm_sweep_copy_variants():
    """--copy-rounds / --copy-chunks: every combine shape with every value, the first values the reference; and
    --copy-combine sets the engine's choice of mode."""
    tool = _tool("sm_sweep")
    args = tool.command_line().parse_args(["--copy-rounds", "2,1", "--copy-chunks", "1024,2048", "--copy-combine", "off"])
    assert args.copy_combine == "off"
    names, variants, default = tool.copy_variants(((32, 3), (32, 2)), (32, 3), args)
    assert names == ("combine_warps", "combine_unroll", "copy_rounds", "copy_chunk_rows")
    assert default == (32, 3, 2, 1024) and len(variants) == 8 and variants[:2] == [(32, 3, 2, 1024), (32, 3, 2, 2048)]
    assert tool.shape_grid(variants, default)[0] == default
    plain = tool.command_line().parse_args([])
    assert tool.copy_variants(((16, 8),), (16, 8), plain) == (("combine_warps", "combine_unroll"), [(16, 8)], (16, 8))
    row = {"warps": 32, "unroll": 3, "copy_rounds": 2, "copy_chunk_rows": 2048}
    assert tool._shape(row) == "32 x 3 2 rounds 2048 rows"
    both = tool.command_line().parse_args(["--copy-turn-waits", "1,0", "--copy-combine", "both"])
    names, variants, default = tool.copy_variants(((32, 3),), (32, 3), both)
    assert names[2:] == ("copy_turn_waits", "use_copy_combine") and default == (32, 3, True, True)
    assert variants == [(32, 3, True, True), (32, 3, True, False), (32, 3, False, True), (32, 3, False, False)]
    assert tool._shape({"warps": 32, "unroll": 3, "copy_turn_waits": False, "use_copy_combine": False}) == \
        "32 x 3 no waits ring"
    with pytest.raises(SystemExit):
        tool.command_line().parse_args(["--copy-combine", "maybe"])


def _phase_codes() -> dict[str, int]:
    """PhaseCode's enumerators as the kernels' header defines them (each one more than the last unless given)."""
    import re

    text = (TOOLS.parent / "cuda_src" / "internode" / "layout.cuh").read_text()
    body = re.search(r"enum PhaseCode : int \{(.*?)\};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    codes, value = {}, None
    for item in (part.strip() for part in body.split(",")):
        if not item:
            continue
        name, _, given = item.partition("=")
        value = int(given) if given.strip() else value + 1
        codes[name.strip()] = value
    return codes


def test_wait_profile_names_every_phase_in_its_own_counter():
    tool = _tool("internode_waits")
    codes = _phase_codes()
    assert sorted(codes.values()) == sorted(tool.PHASES), "PHASES and PhaseCode in layout.cuh disagree"
    from deepep_cupy.ops.internode import engine

    # Counters are [32][2][3] by code - 400: no phase may share one with a wait kind or the role clock (431).
    taken = {code - 400 for code in engine.OP_NAMES} | {31}
    assert all(0 <= code - 400 < 31 and code - 400 not in taken for code in codes.values())
    import numpy as np

    values = np.zeros((32, 2, 3), dtype=np.uint64)
    values[31, 0] = (8_000, 2, 0)           # two sending warps, 4 us each
    values[413 - 400, 0] = (3_000, 6, 0)    # phase 413: 3 us over 6 laps
    values[403 - 400, 0] = (400, 1, 5)      # a wait kind: 1 short, 5 ready
    lines = tool.table(0, "dispatch", values, engine.OP_NAMES)
    assert lines[0].startswith("rank 0 dispatch") and "4.0 us a warp" in lines[0]
    assert any("6 laps" in line and "0.50 us a lap" in line and "row copied" in line for line in lines)
    assert any("1 short" in line and "5 ready" in line for line in lines)


def test_wait_profile_builds_compile(tmp_path, monkeypatch):
    """The diagnostics builds (DEEPEP_CUPY_WAIT_PROFILE=1: wait counters and phase clocks) of one shape."""
    pytest.importorskip("cuda.bindings.nvrtc")
    monkeypatch.setenv("DEEPEP_CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DEEPEP_CUPY_SOURCE_DIR", raising=False)
    from deepep_cupy.jit import build
    from deepep_cupy.ops.internode import engine, plans

    monkeypatch.setattr(engine, "dispatch_spec", engine.dispatch_spec)  # restored after the test
    monkeypatch.setattr(engine, "combine_spec", engine.combine_spec)
    monkeypatch.setattr(plans, "dispatch_spec", plans.dispatch_spec)
    monkeypatch.setattr(plans, "combine_spec", plans.combine_spec)
    tool = _tool("internode_waits")
    tool.use_profiled_builds()
    for spec in (engine.dispatch_spec(1, 2, 16), engine.combine_spec(1, 2, 16)):
        assert "DEEPEP_CUPY_WAIT_PROFILE" in spec.describe()
        compiled = build(spec, "sm_90")
        assert compiled.cubin_path.is_file() and compiled.cubin_path.stat().st_size > 0
