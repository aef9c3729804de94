"""Host side of the intranode path, on the CPU: NVL buffer map, size checks, kernel argument packing and
descriptor passing (the NumPy model of the kernels' index arithmetic is in test_intranode_model.py)."""

import os
import re
from pathlib import Path

import numpy as np
import pytest
from kernel_args import FakeArray, check_packing
from thread_group import run_ranks

from deepep_cupy.config import Config
from deepep_cupy.ops.intranode import args as intranode_args
from deepep_cupy.ops.intranode import buffer_map as L
from deepep_cupy.ops.intranode import engine as intranode
from deepep_cupy.reference import normal

CUDA_SRC = Path(__file__).resolve().parents[2] / "cuda_src" / "intranode"


# --------------------------------------------------------------------------------------- buffer map
@pytest.mark.parametrize("hidden_bytes,scales,topk", [(7168 * 2, 0, 8), (7168, 56, 8), (2048 * 2, 0, 1),
                                                      (16, 0, 0), (4096, 32, 9), (7168 * 2, 0, 32)])
def test_dispatch_slot_alignment(hidden_bytes, scales, topk):
    s = L.dispatch_slot(hidden_bytes, scales, topk)
    assert s.slot_bytes % 16 == 0
    for off in (s.scales_offset, s.topk_idx_offset, s.topk_weights_offset):
        assert off % 16 == 0
    assert s.scales_offset == L.HEADER_BYTES + hidden_bytes
    assert s.topk_idx_offset >= s.scales_offset + 4 * scales
    assert s.topk_weights_offset >= s.topk_idx_offset + 4 * topk
    assert s.slot_bytes >= s.topk_weights_offset + 4 * topk


def test_combine_slot():
    s = L.combine_slot(7168 * 2, 8)
    assert s.topk_weights_offset == 16 + 7168 * 2 and s.slot_bytes == 16 + 7168 * 2 + 32
    with pytest.raises(ValueError):
        L.combine_slot(7168 * 2 + 2, 8)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_buffer_regions_disjoint(ranks):
    slot = L.dispatch_slot(7168, 56, 8)
    bmap = L.buffer_map(ranks, 12, 7, slot)
    ctrl = L.ctrl_bytes(ranks)
    assert ctrl >= 8 * (2 * ranks + 2) and ctrl % 128 == 0
    assert bmap.ring_offset == ctrl
    # Rings tile [ring_offset, free_offset) exactly, free words tile [free_offset, end).
    starts = sorted(bmap.ring_start(c, s) for c in range(12) for s in range(ranks))
    assert starts[0] == bmap.ring_offset
    assert all(b - a == 7 * slot.slot_bytes for a, b in zip(starts, starts[1:], strict=False))
    assert starts[-1] + 7 * slot.slot_bytes == bmap.free_offset
    assert bmap.free_word(11, ranks - 1, 6) + 8 == bmap.end
    assert bmap.slot_start(3, ranks - 1, 2) % 16 == 0 and bmap.free_offset % 8 == 0
    off, stride, end = L.notify_map(ranks, 12, 32)
    assert off == ctrl and stride % 4 == 0 and stride >= ranks + 12 + 32 and end == off + ranks * stride * 4


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("num_sms,recv", [(24, 256), (24, 512), (20, 256), (2, 1), (132, 64)])
@pytest.mark.parametrize("hidden", [2048, 4096, 7168])
def test_needs_fit_in_deepep_hint(ranks, num_sms, recv, hidden):
    """Whatever Config.get_nvl_buffer_size_hint(hidden * 2, R) allows, BF16 and FP8 dispatch and combine fit."""
    cfg = Config(num_sms=num_sms, num_max_nvl_chunked_send_tokens=min(6, recv - 1) or 1,
                 num_max_nvl_chunked_recv_tokens=recv) if recv > 1 else None
    if cfg is None:
        cfg = Config(num_sms=num_sms, num_max_nvl_chunked_send_tokens=1, num_max_nvl_chunked_recv_tokens=2)
        recv = 2
    hint = cfg.get_nvl_buffer_size_hint(hidden * 2, ranks)
    channels = num_sms // 2
    for slot in (L.dispatch_slot(hidden * 2, 0, 32), L.dispatch_slot(hidden, hidden // 128, 32),
                 L.combine_slot(hidden * 2, 32)):
        bmap = L.buffer_map(ranks, channels, recv, slot)
        notify_end = L.notify_map(ranks, channels, 256 // ranks)[2]
        assert intranode.required_bytes(bmap, notify_end) <= hint


def test_split_warps_covers_every_warp():
    for warps in (16, 24, 32):
        for groups in range(1, 8):
            seen = {}
            for w in range(warps):
                g, i, n = L.split_warps(w, warps, groups)
                assert 0 <= g < groups and 0 <= i < n
                seen.setdefault(g, []).append((i, n))
            assert sorted(seen) == list(range(groups))
            for members in seen.values():
                n = members[0][1]
                assert sorted(i for i, _ in members) == list(range(n)) and all(m == n for _, m in members)
            sizes = [seen[g][0][1] for g in range(groups)]
            assert max(sizes) - min(sizes) <= 1 and sum(sizes) == warps


def test_channel_bounds_match_reference():
    for n in (0, 1, 5, 4096, 4097):
        for c in (1, 3, 12):
            ends = normal.channel_bounds(n, c)
            for ch in range(c):
                b, e = L.channel_bounds(n, c, ch)
                assert e == ends[ch] and b == (ends[ch - 1] if ch else 0)


def test_default_own_rows_warps():
    assert intranode.default_own_rows_warps(1, 24) == 24
    assert intranode.default_recv_own_rows_warps(1, 24) == 0
    assert intranode.default_own_rows_warps(2, 16) == 0 and intranode.default_recv_own_rows_warps(2, 16) == 8
    assert intranode.default_own_rows_warps(8, 16) == 2 and intranode.default_recv_own_rows_warps(8, 16) == 2
    for w in (16, 24, 32):
        for r in range(2, 9):
            s, rs = intranode.default_own_rows_warps(r, w), intranode.default_recv_own_rows_warps(r, w)
            assert 0 <= s <= w - (r - 1) and 0 <= rs <= w - (r - 1) and s + rs >= 1


def test_block_shapes_by_rank_and_sm_count(monkeypatch):
    # The shipped tables: at 2 ranks, shapes of their own up to 12 SMs (dispatch) and 16 (combine, both modes);
    # at 3 and 4 ranks the copy mode's 32 x 3 at every SM count; else the same shape at every SM count (16 x 8
    # dispatch, 32 x 2 combine).
    for sms in (None, 8, 12, 24, 132):
        assert intranode.default_dispatch_shape(2, sms) == ((24, 6) if sms is not None and sms <= 12 else (16, 14))
        assert intranode.default_dispatch_shape(8, sms) == (16, 8)
        for copy in (False, True):
            assert intranode.default_combine_shape(8, sms, copy) == (32, 2)
        for r in (3, 4):
            assert intranode.default_combine_shape(r, sms) == (32, 2)
            assert intranode.default_combine_shape(r, sms, copy=True) == (32, 3)
    for copy in (False, True):
        assert [intranode.default_combine_shape(2, sms, copy) for sms in (4, 8, 10, 16, 24, None)] == \
            [(32, 2), (32, 2), (24, 4), (24, 4), (16, 8), (16, 8)]
    assert intranode.default_dispatch_shape(4, 8) == (16, 8)
    # A table with rows for few SMs: the first row covering (ranks, SMs) wins; without an SM count, only
    # the rows for any count apply.
    table = ((2, 8, 32, 8), (2, None, 16, 14), (None, 12, 24, 6), (None, None, 16, 8))
    monkeypatch.setattr(intranode, "DISPATCH_SHAPE_TABLE", table)
    assert intranode.default_dispatch_shape(2, 8) == (32, 8) and intranode.default_dispatch_shape(1, 4) == (32, 8)
    assert intranode.default_dispatch_shape(2, 10) == intranode.default_dispatch_shape(2) == (16, 14)
    assert intranode.default_dispatch_shape(4, 12) == (24, 6) and intranode.default_dispatch_shape(8, 8) == (24, 6)
    assert intranode.default_dispatch_shape(4, 24) == intranode.default_dispatch_shape(4) == (16, 8)
    assert intranode.table_shapes(table, 2) == [(32, 8), (16, 14)]
    assert intranode.table_shapes(table, 8) == [(24, 6), (16, 8)]
    builds = intranode.representative_builds()
    assert intranode.dispatch_spec(2, 32, 8) in builds and intranode.dispatch_spec(4, 24, 6) in builds
    assert intranode.dispatch_spec(4, 32, 8) not in builds
    assert intranode.combine_copy_spec(4, 32, 3) in builds and intranode.combine_copy_spec(4, 32, 2) not in builds
    assert intranode.combine_spec(4, 32, 2) in builds and intranode.combine_spec(4, 32, 3) not in builds
    # The engine takes the table's shape for the launch's SM count unless a tuning attribute is set.
    engine = object.__new__(intranode.IntranodeEngine)
    engine.num_ranks = 2
    engine.tune(dispatch_warps=None, dispatch_unroll=None, combine_warps=None, combine_unroll=None)
    assert engine.dispatch_shape(8) == (32, 8) and engine.dispatch_shape(24) == (16, 14)
    engine.tune(dispatch_unroll=4)
    assert engine.dispatch_shape(8) == (32, 4)
    engine.tune(combine_warps=24)
    assert engine.combine_shape(24) == (24, 8) and engine.combine_shape(8) == (24, 2)
    engine.num_ranks = 4
    engine.tune(combine_warps=None)
    assert engine.combine_shape(8) == (32, 2) and engine.combine_shape(8, copy=True) == (32, 3)


def test_copy_combine_by_default():
    """The combine's copy mode wherever it can run, at every rank and SM count; the tuning attribute
    overrides."""
    engine = object.__new__(intranode.IntranodeEngine)
    engine.tune(use_copy_combine=None)
    for ranks in (1, 2, 4, 8):
        engine.num_ranks = ranks
        assert engine.copy_combine(), ranks
    engine.num_ranks = 2
    engine.tune(use_copy_combine=False)
    assert not engine.copy_combine()
    engine.num_ranks = 4
    engine.tune(use_copy_combine=True)
    assert engine.copy_combine()


def test_fan_out_by_rank_and_sm_count():
    """The direct dispatch's fan-out items by default: above 2 ranks on every launch, at up to 2 ranks on at
    most FAN_OUT_MAX_SMS SMs (where NVLink does not bound it); the tuning attribute overrides."""
    engine = object.__new__(intranode.IntranodeEngine)
    engine.tune(use_fan_out=None)
    counts = (2, 8, 12, 16, 24, 132)
    for ranks in (1, 2, 4, 8):
        engine.num_ranks = ranks
        got = [engine.fan_out(sms) for sms in counts]
        assert got == [ranks > 2 or sms <= intranode.FAN_OUT_MAX_SMS for sms in counts], ranks
    engine.num_ranks = 4
    engine.tune(use_fan_out=False)
    assert not engine.fan_out(8)
    engine.num_ranks = 2
    engine.tune(use_fan_out=True)
    assert engine.fan_out(132)


@pytest.mark.parametrize("cap", [1, 2, 3, 4, 7, 64, 256, 512])
@pytest.mark.parametrize("send", [1, 2, 6, 8, 24, 32, 100])
def test_publish_batch_never_deadlocks(cap, send):
    """A sender blocked on the free word of index i needs the receiver run holding i - cap to end before
    the sender run holding i starts: runs of B consecutive indices (aligned in dispatch, any B within
    combine's token runs), so B <= ceil(cap / 2) is enough for both; and one lane per flag (B <= 32)."""
    b = intranode.publish_batch(send, cap)
    assert 1 <= b <= min(send, 32)
    assert b <= (cap + 1) // 2 or b == 1
    # Worst case for unaligned runs: receiver run ends at (i - cap) + b - 1, sender run starts at i - b + 1.
    for i in range(cap, cap + 4 * b + 3):
        assert (i - cap) + b - 1 < i - b + 1
        # Aligned (dispatch): the receiver run of i - cap ends before the sender run of i starts.
        assert ((i - cap) // b) * b + b - 1 < (i // b) * b


def _simulate_claimed_combine(rng, num_tokens, cap, b, send_warps, recv_warps, present_prob):
    """One channel and one peer of the combine, as the kernels order it: sender warps push ring indices in runs
    of b (run k to warp k % send_warps; index i >= cap waits for the free word of i - cap; a run is
    published at its end); reducing warps claim runs of b tokens in order, holding the next claim while
    they reduce the current run (wait for its flags, then free the slots the sender will reuse), and sender
    warps join once their pushes are done. Warps move in random order; returns False on a deadlock."""
    present = rng.random(num_tokens) < present_prob
    index_of = np.cumsum(present) - 1  # ring index of each present token
    n = int(present.sum())
    published, freed = np.zeros(n, bool), np.zeros(n, bool)
    send_runs = [list(range(k * b, min(n, k * b + b))) for k in range(-(-n // b))]
    senders = [{"runs": send_runs[w::send_warps], "pos": 0, "written": []} for w in range(send_warps)]
    counter = [0]

    def claim():
        counter[0] += 1
        return counter[0] - 1

    reducers = [{"cur": None, "next": None} for _ in range(recv_warps)]
    done_runs = set()
    num_runs = -(-num_tokens // b)

    def reduce_step(r):
        if r["cur"] is None:
            r["cur"], r["next"] = claim(), claim()
        run = r["cur"]
        if run >= num_runs:
            return False
        idx = [int(index_of[t]) for t in range(run * b, min(num_tokens, run * b + b)) if present[t]]
        if not all(published[i] for i in idx):
            return False
        for i in idx:
            if i + cap < n:
                freed[i] = True
        done_runs.add(run)
        r["cur"], r["next"] = r["next"], claim()
        return True

    def send_step(s):
        if s["pos"] >= len(s["runs"]):
            return False
        run = s["runs"][s["pos"]]
        i = run[len(s["written"])]
        if i >= cap and not freed[i - cap]:
            return False
        s["written"].append(i)
        if len(s["written"]) == len(run):
            published[run] = True
            s["pos"], s["written"] = s["pos"] + 1, []
        return True

    joined = [{"cur": None, "next": None} for _ in range(send_warps)]
    while len(done_runs) < num_runs:
        movers = [lambda r=r: reduce_step(r) for r in reducers]
        movers += [lambda s=s: send_step(s) for s in senders]
        movers += [lambda j=j, s=s: s["pos"] >= len(s["runs"]) and reduce_step(j)
                   for j, s in zip(joined, senders, strict=True)]
        progressed = False
        for k in rng.permutation(len(movers)):
            if movers[k]():
                progressed = True
                break
        if not progressed:
            return False
    return True


@pytest.mark.parametrize("cap", [2, 3, 8, 64])
@pytest.mark.parametrize("send", [1, 4, 32])
def test_claimed_combine_runs_never_deadlock(cap, send):
    """The combine's reduction runs are claimed from a counter, one held ahead, by the receiver block and by
    sender warps whose pushes are done: with B = publish_batch (<= ceil(cap / 2)) no schedule deadlocks."""
    rng = np.random.default_rng([cap, send])
    b = intranode.publish_batch(send, cap)
    for _ in range(12):
        assert _simulate_claimed_combine(rng, int(rng.integers(1, 120)), cap, b, int(rng.integers(1, 4)),
                                         int(rng.integers(1, 5)), float(rng.uniform(0.3, 1.0)))


def test_claimed_combine_model_can_deadlock():
    """The model above is able to fail: with runs longer than the ring (B > cap) it finds the deadlock."""
    rng = np.random.default_rng(3)
    assert not all(_simulate_claimed_combine(rng, 64, 2, 4, 1, 1, 1.0) for _ in range(5))


def test_publish_batch_args():
    a = FakeArray()
    bmap = L.buffer_map(2, 12, 8, L.combine_slot(7168 * 2, 8))
    d = intranode.combine_args(
        x=a, topk_weights=a, num_topk=8, bias_0=None, bias_1=None, rank_prefix_matrix=a, channel_prefix_matrix=a,
        recv_channel_prefix_matrix=a, send_head=a, num_tokens=4096, hidden_int4=896, combined_x=a,
        combined_topk_weights=a, bases=a, buffer_map=bmap, err_ptr=7, timeout_ns=1, rank=1, batch=24)
    assert d["publish_batch"] == 4


@pytest.mark.parametrize("tuned", [None, 3])
def test_combine_batch_ignores_the_config(tuned):
    """The ring combine's publish batch is the engine's (COMBINE_PUBLISH_BATCH, or the tuning attribute), never
    the config's send chunk; the dispatch's follows the config unless the attribute is set."""
    from types import SimpleNamespace

    Engine = intranode.IntranodeEngine
    engine = SimpleNamespace(publish_batch=tuned, _checked_batch=Engine._checked_batch)
    cfg = Config(24, 9, 256)
    assert Engine.combine_batch(engine) == (intranode.COMBINE_PUBLISH_BATCH if tuned is None else tuned)
    assert Engine.batch(engine, cfg) == (9 if tuned is None else tuned)
    engine.publish_batch = 0
    with pytest.raises(ValueError, match="publish batch"):
        Engine.combine_batch(engine)


# ------------------------------------------------------------------------------------------- argument packing
def test_notify_args_fill_the_struct():
    a = FakeArray()
    packed = intranode.notify_args(is_token_in_rank=a, num_tokens=5, num_channels=3, num_tokens_per_expert=a,
                                   num_local_experts=4, expert_alignment=1, rank_prefix_matrix=a,
                                   channel_prefix_matrix=a, recv_channel_prefix_matrix=a, meta=a, bases=a,
                                   notify_offset=128, notify_stride=12, err_ptr=1234, timeout_ns=10**9, rank=1)
    check_packing(intranode_args.NOTIFY, packed)


def test_dispatch_args_fill_the_struct():
    a = FakeArray()
    bmap = L.buffer_map(2, 12, 256, L.dispatch_slot(7168, 56, 8))
    packed = intranode.dispatch_args(
        x=a, x_scales=None, scale_token_stride=0, scale_block_stride=0, num_scales=0, topk_idx=a, topk_weights=None,
        num_topk=8, num_local_experts=128, is_token_in_rank=a, num_tokens=4096, hidden_int4=448,
        rank_prefix_matrix=a, channel_prefix_matrix=a, recv_channel_prefix_matrix=a, recv_x=a, recv_x_scales=None,
        recv_topk_idx=a, recv_topk_weights=None, recv_src_idx=a, send_head=a, num_out_rows=10, num_worst_tokens=0,
        bases=a, buffer_map=bmap, num_own_rows_warps=12, err_ptr=99, timeout_ns=1, rank=0)
    check_packing(intranode_args.DISPATCH, packed)
    d = packed
    assert d["slot_bytes"] == bmap.slot.slot_bytes and d["ring_offset"] == bmap.ring_offset
    assert d["free_offset"] == bmap.free_offset and d["x_scales"] == 0 and d["done_offset"] == bmap.end


def test_combine_args_fill_the_struct():
    a = FakeArray()
    bmap = L.buffer_map(2, 12, 256, L.combine_slot(7168 * 2, 8))
    packed = intranode.combine_args(
        x=a, topk_weights=a, num_topk=8, bias_0=None, bias_1=a, rank_prefix_matrix=a, channel_prefix_matrix=a,
        recv_channel_prefix_matrix=a, send_head=a, num_tokens=4096, hidden_int4=896, combined_x=a,
        combined_topk_weights=a, bases=a, buffer_map=bmap, err_ptr=7, timeout_ns=1, rank=1)
    check_packing(intranode_args.COMBINE, packed)


def test_op_codes_match_header():
    text = (CUDA_SRC / "buffer_map.cuh").read_text()
    codes = {name: int(v) for name, v in re.findall(r"kOp(\w+) = (\d+)", text)}
    assert codes["NotifyArrive"] == intranode.OP_NOTIFY_ARRIVE
    assert codes["DispatchOverflow"] == intranode.OP_DISPATCH_OVERFLOW
    assert codes["CombineRecv"] == intranode.OP_COMBINE_RECV
    assert set(codes.values()) == set(intranode.OP_NAMES)


# ------------------------------------------------------------------------------------------- fd passing
@pytest.mark.parametrize("method", ["auto", "socket"])
def test_exchange_fds(method):
    from deepep_cupy.device.fd_share import exchange_fds

    def body(group):
        r, w = os.pipe()
        os.close(w)
        try:
            got = exchange_fds(group, r, method=method)
            inodes = [None if fd is None else os.fstat(fd).st_ino for fd in got]
            mine = group.allgather_object(os.fstat(r).st_ino)
            for fd in got:
                if fd is not None:
                    os.close(fd)
            group.barrier()
            return inodes, mine
        finally:
            os.close(r)

    for rank, (inodes, mine) in enumerate(run_ranks(3, body)):
        assert inodes[rank] is None
        assert all(inodes[p] == mine[p] for p in range(3) if p != rank)


# ------------------------------------------------------------------------------------------- compile
def test_tuning_variants_compile_sm90():
    from deepep_cupy.jit import build

    for spec in (intranode.dispatch_spec(2, 16, 8), intranode.dispatch_spec(2, 32, 2),
                 intranode.dispatch_spec(2, 16, 14), intranode.combine_spec(2, 16, 4),
                 intranode.combine_spec(3, 24, 2), intranode.combine_spec(2, 24, 4),
                 intranode.dispatch_spec(2, 32, 8), intranode.combine_copy_spec(2, 32, 4)):
        build(spec, arch="sm_90")
