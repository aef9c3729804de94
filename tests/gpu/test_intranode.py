"""Intranode (NVLink) dispatch and combine on GPUs, through the public ``deepep_cupy.Buffer`` API, against the
NumPy reference backend on fresh random data.

Run on every rank:  mpirun -np 2 python -m pytest tests/gpu/test_intranode.py -q -x
Skips without a GPU or with fewer than 2 ranks. Every test is collective: all ranks run the same tests in
the same order with the same parameters (data differs per rank). The large DeepEP workload
(4096 x 7168, top-8 of 256) is ``test_deepep_workload`` (DEEPEP_CUPY_SKIP_BIG=1 skips it); the whole file
is meant to run in under 3 minutes on 2 x H200. Kernel waits use a 30 s budget here, so a protocol bug
shows up as DeepEPTimeoutError instead of a hang.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
from gpu_common import BF16, COMM, FP8, MULTI_RANK_GPU, bf16, bits, frameworks, to_dev, to_np
from normal_common import (
    cached_dispatch_round,
    check_combine,
    combine_round,
    digest,
    in_output_pool,
    inputs,
    output_pool,
    poison,
    routing,
    skip_unless_framework_holds,
)

from deepep_cupy.ops.own_rows import MAX_RUNS as OWN_MAX_RUNS
from deepep_cupy.ops.own_rows import MIN_ROWS as OWN_MIN_ROWS
from deepep_cupy.ops.own_rows import own_runs

pytestmark = MULTI_RANK_GPU

NUM_SMS = 24
NVL_BYTES = int(1e9)
TEST_TIMEOUT_S = 30.0
# Both dispatch modes are tested at every rank count (by default the output pool exists up to 2 ranks only).
os.environ.setdefault("DEEPEP_CUPY_OUTPUT_POOL_BYTES", str(1 << 30))


# ------------------------------------------------------------------------------------------- env
@contextlib.contextmanager
def _with_buffers(state):
    """The module's Buffer (its kernels' budget set on it) and the reference, with the channels of NUM_SMS."""
    from deepep_cupy.device.group import MPIGroup
    from deepep_cupy.reference.oracle import ReferenceOracle

    state["buf"] = _new_buffer(state["deepep_cupy"])
    state["ref"] = ReferenceOracle(MPIGroup(COMM), num_nvl_ranks=state["size"], low_latency_mode=False,
                                    enable_shrink=False, num_channels=NUM_SMS // 2)
    try:
        yield
    finally:
        state["buf"].destroy()  # the last one: tests replace it


ENV = _with_buffers


def _new_buffer(deepep_cupy):
    buf = deepep_cupy.Buffer(comm=COMM, num_nvl_bytes=NVL_BYTES, explicitly_destroy=True)
    buf.runtime.intranode.tune(timeout_s=TEST_TIMEOUT_S)
    return buf


def _cfg(env, recv=256, num_sms=NUM_SMS):
    return env["deepep_cupy"].Config(num_sms, min(8, recv - 1), recv)


# ------------------------------------------------------------------------------------------- data
# ------------------------------------------------------------------------------------------- one round
def _layout(env, topk_dev, topk_np, num_experts):
    buf, ref = env["buf"], env["ref"]
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_dev, num_experts)
    r_rank, _, r_expert, r_in = ref.get_dispatch_layout(topk_np, num_experts)
    np.testing.assert_array_equal(to_np(per_rank), r_rank)
    np.testing.assert_array_equal(to_np(per_expert), r_expert)
    np.testing.assert_array_equal(to_np(in_rank), r_in)
    assert per_rdma is None
    return (per_rank, per_expert, in_rank), (r_rank, r_expert, r_in)


def _check_dispatch(env, ours, refs, *, fp8, worst, with_topk=True):
    recv, r_idx, r_w, counts, handle = ours
    rx, rs, ridx, rw, rlist, rhandle = refs
    me, size = env["rank"], env["size"]
    num_recv = int(rhandle[0][size - 1, me])
    if fp8:
        recv_x, recv_s = to_np(recv[0]), to_np(recv[1])
        np.testing.assert_array_equal(recv_s[:num_recv], rs[:num_recv])
    else:
        recv_x = to_np(recv)
    rows = worst if worst else num_recv
    assert recv_x.shape[0] == rows, (recv_x.shape, rows)
    np.testing.assert_array_equal(bits(recv_x[:num_recv]), bits(rx[:num_recv]))
    if with_topk:
        np.testing.assert_array_equal(to_np(r_idx), ridx)
        np.testing.assert_array_equal(to_np(r_w), rw)
        assert counts == rlist
        for k in range(6):
            np.testing.assert_array_equal(to_np(handle[k]), rhandle[k], err_msg=f"handle[{k}]")
    return num_recv


def fit_experts(num_experts: int, size: int) -> int:
    """The expert counts written here divide by 2, 4 and 8 ranks; with another rank count (3 ranks on GPUs 0-2)
    the largest multiple of it below, so that every rank holds as many experts."""
    return num_experts - num_experts % size


def _round(env, fw, rng, *, n, hidden, num_experts, k, fp8=False, column_major=False, worst=0, align=1,
           only_rank0=False, bias=0, cached=True, recv=256, in_pool=None, num_sms=NUM_SMS, combine_sms=None):
    """Layout, dispatch, cached dispatch, combine: everything compared with the reference. ``in_pool``: whether
    the dispatch outputs must lie in the output pool (None: not checked)."""
    buf, ref = env["buf"], env["ref"]
    me, size = env["rank"], env["size"]
    num_experts = fit_experts(num_experts, size)
    topk, weights = routing(rng, n, num_experts, k, me, size, only_rank0)
    topk_dev, w_dev = to_dev(topk, fw, env), to_dev(weights, fw, env)
    (per_rank, per_expert, in_rank), (r_rank, r_expert, r_in) = _layout(env, topk_dev, topk, num_experts)
    x_np, s_np, x_dev = inputs(env, fw, rng, n, hidden, fp8, column_major)
    cfg = _cfg(env, recv, num_sms)
    combine_cfg = cfg if combine_sms is None else _cfg(env, recv, combine_sms)
    worst_rows = worst * n * size if worst else 0
    rows_guess = max(worst_rows, n * size)
    poison(env, fw, [rows_guess * hidden * (1 if fp8 else 2), rows_guess * k * 8, rows_guess * k * 4, rows_guess * 4])
    recv, r_idx, r_w, counts, handle, event = buf.dispatch(
        x_dev, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_dev, topk_weights=w_dev, expert_alignment=align, num_worst_tokens=worst_rows, config=cfg)
    refs = ref.dispatch(x_np, s_np, handle=None, num_tokens_per_rank=r_rank, is_token_in_rank=r_in,
                        num_tokens_per_expert=r_expert, topk_idx=topk, topk_weights=weights, expert_alignment=align,
                        num_worst_tokens=worst_rows)
    num_recv = _check_dispatch(env, (recv, r_idx, r_w, counts, handle), refs, fp8=fp8, worst=worst_rows)
    if in_pool is not None and (worst_rows or num_recv):
        for t in (*(recv if fp8 else (recv,)), r_idx, r_w, handle[3]):
            assert in_output_pool(env["buf"], t) == in_pool, "dispatch outputs are not where the mode puts them"
    if worst_rows:
        assert counts == []

    if cached:
        own_copies = None
        if in_pool is not None:  # the cached dispatch's own rows: copies or the kernel (own_rows.py)
            engine = env["buf"].runtime.intranode
            runs = own_runs(r_in[:, me])
            own_copies = (engine.own_row_copies() and not worst_rows and len(runs) <= OWN_MAX_RUNS
                          and sum(b - a for a, b in runs) >= engine.own_copy_min_rows)
        cached_dispatch_round(env, fw, rng, handle=handle, ref_handle=refs[5], n=n, hidden=hidden, fp8=fp8,
                              column_major=column_major, align=align, num_recv=num_recv, cfg=cfg,
                              own_copies=own_copies)
    # The combine's copy mode needs the counts the dispatch read back (none with num_worst_tokens).
    copy_mode = None if in_pool is None else (env["buf"].runtime.intranode.copy_combine()
                                              and not worst_rows)
    combine_round(env, fw, rng, handle=handle, ref_handle=refs[5], n=n, hidden=hidden, k=k,
                  rows=worst_rows if worst_rows else num_recv, bias=bias, cfg=combine_cfg, copy_mode=copy_mode)
    return num_recv


# ------------------------------------------------------------------------------------------- tests
SMALL = [
    # n, hidden, experts, k, extra
    (1, 2048, 16, 1, {}),
    (37, 4096, 32, 9, {"bias": 1}),
    (300, 7168, 64, 4, {"align": 128, "bias": 2}),
    (513, 2048, 24, 3, {"only_rank0": True}),
    (200, 4096, 32, 2, {"recv": 7}),  # tiny ring: slots are reused many times
    (0, 2048, 16, 2, {}),
    (129, 7168, 256, 8, {"fp8": True, "column_major": True}),
    (64, 2048, 32, 5, {"fp8": True}),
    (100, 4096, 32, 6, {"worst": 1}),
    (80, 7168, 64, 8, {"worst": 1, "fp8": True, "column_major": True}),
    # More than 64 scales and top-k above 32: the parts of a token the kernels do not hold in registers.
    (90, 12288, 64, 36, {"fp8": True, "column_major": True}),
    (45, 9216, 32, 4, {"fp8": True}),
]


@pytest.mark.parametrize("mode", ["direct", "fan-out", "ring"])
@pytest.mark.parametrize("fw", frameworks())
@pytest.mark.parametrize("n,hidden,experts,k,extra", SMALL)
def test_small_shapes(env, fw, n, hidden, experts, k, extra, mode):
    """Both dispatch modes: outputs in the output pool, written in place by every rank (direct, one copy a
    destination; fan-out, each token loaded once for all its ranks), or ordinary allocations filled through the
    rings (ring). The combine takes its copy mode with the first two (when the handle has the counts) and its
    ring mode with the last."""
    skip_unless_framework_holds(fw, BF16, *((FP8,) if extra.get("fp8") else ()))
    rng = np.random.default_rng([n, hidden, k, env["rank"]])
    engine = env["buf"].runtime.intranode
    assert engine.output_pool is not None, "the default Buffer has no output pool"
    assert engine.copy_supported, "the GPUs do not run 64-bit stream writes: no copy-mode combine"
    direct = mode != "ring"
    engine.tune(use_output_pool=direct, use_copy_combine=direct, use_own_row_copies=direct,
                use_fan_out=mode == "fan-out")
    engine.own_copy_min_rows = 1  # small shapes too: own rows by copies in the pool, the kernel in the rings
    try:
        for _ in range(2):
            _round(env, fw, rng, n=n, hidden=hidden, num_experts=experts, k=k, in_pool=direct, **extra)
    finally:
        engine.tune(use_output_pool=True, use_copy_combine=None, use_own_row_copies=None, use_fan_out=None)
        engine.own_copy_min_rows = OWN_MIN_ROWS


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("mode", ["direct", "ring"])
def test_few_sms(env, mode, fp8):
    """8 SMs (4 channels): the block shapes chosen for few SMs (engine.py's tables) in both modes of the dispatch
    and the combine, the own rows of the cached dispatch on the kernel's SMs (the default, own_rows.py);
    DeepEP's row width, fresh data each repeat. The second repeat's
    combine has a config of 24 SMs: the copy mode's sums then run on 24 SMs of a handle made on 8 (the ring
    mode keeps the handle's channels)."""
    from deepep_cupy.device.group import MPIGroup
    from deepep_cupy.reference.oracle import ReferenceOracle

    rng = np.random.default_rng([8, int(fp8), env["rank"]])
    engine = env["buf"].runtime.intranode
    ref = env["ref"]
    env["ref"] = ReferenceOracle(MPIGroup(COMM), num_nvl_ranks=env["size"], low_latency_mode=False,
                                 enable_shrink=False, num_channels=4)
    engine.tune(use_output_pool=mode == "direct", use_copy_combine=mode == "direct")
    try:
        assert engine.dispatch_shape(8) != engine.dispatch_shape(NUM_SMS) or env["size"] > 2
        for combine_sms in (None, 24):
            _round(env, frameworks()[0], rng, n=2048, hidden=7168, num_experts=64, k=8, fp8=fp8, column_major=fp8,
                   bias=1, recv=512, in_pool=mode == "direct", num_sms=8, combine_sms=combine_sms)
    finally:
        env["ref"] = ref
        engine.tune(use_output_pool=True, use_copy_combine=None)


def test_full_pool_on_one_rank_takes_the_ring_mode(env):
    """Rank 0's pool cannot hold the outputs: it allocates them normally, and every rank takes the ring mode
    for that call (the others' outputs are in their pools, filled by their own receivers); then direct again."""
    fw = frameworks()[0]
    pool = output_pool(env["buf"])
    rng = np.random.default_rng([77, env["rank"]])
    held = []
    if env["rank"] == 0:
        while (block := pool.alloc(1 << 20)) is not None:
            held.append(block)
        while (block := pool.alloc(256)) is not None:
            held.append(block)
    try:
        for _ in range(2):
            _round(env, fw, rng, n=700, hidden=4096, num_experts=32, k=4, in_pool=env["rank"] != 0)
    finally:
        held.clear()
    _round(env, fw, rng, n=700, hidden=4096, num_experts=32, k=4, in_pool=True)


def test_outputs_outlive_the_buffer(env):
    """Dispatch outputs from the output pool stay valid after the Buffer is destroyed (the pool is unmapped
    once the last of them is freed)."""
    fw = frameworks()[0]
    deepep_cupy = env["deepep_cupy"]
    buf = deepep_cupy.Buffer(comm=COMM, num_nvl_bytes=NVL_BYTES, explicitly_destroy=True)
    me, size = env["rank"], env["size"]
    rng = np.random.default_rng([78, me])
    n, hidden, experts, k = 333, 2048, 16, 3
    experts = fit_experts(experts, env["size"])
    topk, weights = routing(rng, n, experts, k, me, size)
    x_np = bf16(rng, (n, hidden))
    x, topk_dev, w_dev = to_dev(x_np, fw, env), to_dev(topk, fw, env), to_dev(weights, fw, env)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_dev, experts)
    recv, idx, w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_dev,
        topk_weights=w_dev, config=_cfg(env))
    assert in_output_pool(buf, recv)
    COMM.Barrier()
    buf.destroy()
    refs = env["ref"].dispatch(x_np, None, handle=None, num_tokens_per_rank=to_np(per_rank),
                               is_token_in_rank=to_np(in_rank), num_tokens_per_expert=to_np(per_expert),
                               topk_idx=topk, topk_weights=weights, expert_alignment=1, num_worst_tokens=0)
    _check_dispatch(env, (recv, idx, w, counts, handle), refs, fp8=False, worst=0)


def test_zero_tokens_on_one_rank(env):
    rng = np.random.default_rng([5, env["rank"]])
    n = 0 if env["rank"] == 1 else 50
    _round(env, frameworks()[0], rng, n=n, hidden=2048, num_experts=16, k=3)


@pytest.mark.skipif(os.environ.get("DEEPEP_CUPY_SKIP_BIG") == "1", reason="DEEPEP_CUPY_SKIP_BIG=1")
@pytest.mark.parametrize("fp8", [False, True])
def test_deepep_workload(env, fp8):
    """4096 tokens x 7168, top-8 of 256, 24 SMs: fresh data each repeat (skip with DEEPEP_CUPY_SKIP_BIG=1)."""
    rng = np.random.default_rng([4096, int(fp8), env["rank"]])
    for _ in range(2 if fp8 else 3):
        _round(env, frameworks()[0], rng, n=4096, hidden=7168, num_experts=256, k=8, fp8=fp8, column_major=fp8,
               bias=1, recv=512, in_pool=True)


def test_repeatable_hashes(env):
    """Twenty identical calls must produce identical bytes (a moving result is a race)."""
    import cupy

    skip_unless_framework_holds("cupy", BF16)
    buf = env["buf"]
    fw = "cupy"
    rng = np.random.default_rng([99, env["rank"]])
    n, hidden, experts, k = 1024, 7168, 256, 8
    experts = fit_experts(experts, env["size"])
    topk, weights = routing(rng, n, experts, k, env["rank"], env["size"])
    x = to_dev(bf16(rng, (n, hidden)), fw, env)
    topk_dev, w_dev = to_dev(topk, fw, env), to_dev(weights, fw, env)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_dev, experts)
    cfg = _cfg(env, 64)
    digests = set()
    for _ in range(20):
        recv, idx, w, counts, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                       num_tokens_per_expert=per_expert, topk_idx=topk_dev,
                                                       topk_weights=w_dev, config=cfg)
        comb, comb_w, _ = buf.combine(recv, handle, topk_weights=w, config=cfg)
        digests.add(digest((recv, idx, w, comb, comb_w, *handle), counts))
    assert len(digests) == 1, f"{len(digests)} different results over 20 identical calls"
    # The per-channel work counters of dispatch and combine are back to 0 once their kernels are done.
    assert int(cupy.count_nonzero(buf.runtime.intranode.work_claims)) == 0


def test_async_finish_and_previous_event(env):
    fw = frameworks()[0]
    buf = env["buf"]
    rng = np.random.default_rng([7, env["rank"]])
    n, hidden, experts, k = 256, 4096, 64, 4
    experts = fit_experts(experts, env["size"])
    topk, weights = routing(rng, n, experts, k, env["rank"], env["size"])
    x_np = bf16(rng, (n, hidden))
    x, topk_dev, w_dev = to_dev(x_np, fw, env), to_dev(topk, fw, env), to_dev(weights, fw, env)
    (per_rank, per_expert, in_rank), (r_rank, r_expert, r_in) = _layout(env, topk_dev, topk, experts)
    prev = buf.capture()
    recv, idx, w, counts, handle, event = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_dev,
        topk_weights=w_dev, config=_cfg(env), previous_event=prev, async_finish=True, allocate_on_comm_stream=True)
    event.current_stream_wait()
    refs = env["ref"].dispatch(x_np, None, handle=None, num_tokens_per_rank=r_rank, is_token_in_rank=r_in,
                               num_tokens_per_expert=r_expert, topk_idx=topk, topk_weights=weights,
                               expert_alignment=1, num_worst_tokens=0)
    _check_dispatch(env, (recv, idx, w, counts, handle), refs, fp8=False, worst=0)
    comb, comb_w, event = buf.combine(recv, handle, topk_weights=w, config=_cfg(env), previous_event=buf.capture(),
                                      async_finish=True)
    event.current_stream_wait()
    r_comb = env["ref"].combine(refs[0], refs[5], topk_weights=refs[3], bias_0=None, bias_1=None)
    check_combine((comb, comb_w), r_comb, n)


def test_cuda_graph_worst_tokens(env, monkeypatch):
    """Dispatch (num_worst_tokens) + combine captured in a CUDA graph, replayed on fresh data in place."""
    import cupy

    skip_unless_framework_holds("cupy", BF16)
    monkeypatch.setenv("DEEPEP_CUPY_VALIDATE", "0")  # value checks sync the host: not allowed in a capture
    buf, ref = env["buf"], env["ref"]
    me, size = env["rank"], env["size"]
    rng = np.random.default_rng([1234, me])
    n, hidden, experts, k = 300, 4096, 64, 8
    experts = fit_experts(experts, env["size"])
    worst = n * size
    fw = "cupy"
    topk, weights = routing(rng, n, experts, k, me, size)
    x_np = bf16(rng, (n, hidden))
    y_np = bf16(rng, (worst, hidden))
    x, topk_dev, w_dev, y = (to_dev(a, fw, env) for a in (x_np, topk, weights, y_np))
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_dev, experts)
    cfg = _cfg(env)
    stream = cupy.cuda.Stream(non_blocking=True)

    def step():
        recv, idx, w, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_dev, topk_weights=w_dev, num_worst_tokens=worst, config=cfg)
        comb, comb_w, _ = buf.combine(y, handle, topk_weights=w, config=cfg)
        return recv, idx, w, counts, handle, comb, comb_w

    with stream:
        step()  # warm-up outside the capture: compiles, fills the memory pool
        stream.synchronize()
        stream.begin_capture()
        out = step()
        graph = stream.end_capture()
    for _ in range(3):
        x_np = bf16(rng, (n, hidden))
        y_np = bf16(rng, (worst, hidden))
        with stream:  # in place, as raw bits: the graph holds these pointers
            x.view(cupy.uint16)[...] = cupy.asarray(x_np.view(np.uint16))
            y.view(cupy.uint16)[...] = cupy.asarray(y_np.view(np.uint16))
        graph.launch(stream)
        stream.synchronize()
        recv, idx, w, counts, handle, comb, comb_w = out
        refs = ref.dispatch(x_np, None, handle=None, num_tokens_per_rank=None, is_token_in_rank=to_np(in_rank),
                            num_tokens_per_expert=to_np(per_expert), topk_idx=topk, topk_weights=weights,
                            expert_alignment=1, num_worst_tokens=worst)
        _check_dispatch(env, (recv, idx, w, [], handle), refs, fp8=False, worst=worst)
        r_comb = ref.combine(y_np, refs[5], topk_weights=to_np(w), bias_0=None, bias_1=None)
        check_combine((comb, comb_w), r_comb, n)
    buf.runtime.intranode.check_errors()


def _small_call(env, seed):
    """A small dispatch's inputs on this rank: ``(fw, buf, rank, rng, n, hidden, experts, k, x, layout kwargs)``."""
    fw, buf, me = frameworks()[0], env["buf"], env["rank"]
    rng = np.random.default_rng([seed, me])
    n, hidden, experts, k = 64, 2048, 16, 2
    experts = fit_experts(experts, env["size"])
    topk, weights = routing(rng, n, experts, k, me, env["size"])
    x, topk_dev, w_dev = to_dev(bf16(rng, (n, hidden)), fw, env), to_dev(topk, fw, env), to_dev(weights, fw, env)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_dev, experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_dev, topk_weights=w_dev)
    return fw, buf, me, rng, n, hidden, experts, k, x, layout


def _times_out_then_recovers(env, small, call, what, **round_kw):
    """Every rank but 1 runs ``call()``: it must raise DeepEPTimeoutError within the budget, naming ``what``,
    the rank and peer 1. Then a new Buffer works."""
    import time

    from deepep_cupy.errors import DeepEPTimeoutError

    fw, buf, me, rng, n, hidden, experts, k, _, _ = small
    buf.runtime.intranode.tune(timeout_s=2.0)
    COMM.Barrier()
    if me != 1:
        t0 = time.time()
        with pytest.raises(DeepEPTimeoutError) as info:
            call()
        assert time.time() - t0 < 60
        text = str(info.value)
        assert what in text and f"rank {me}" in text and "peer 1" in text, text
    COMM.Barrier()
    buf.destroy()
    env["buf"] = _new_buffer(env["deepep_cupy"])
    _round(env, fw, rng, n=n, hidden=hidden, num_experts=experts, k=k, **round_kw)


def test_timeout_reports_and_recovers(env):
    """Rank 1 skips a dispatch: rank 0 raises DeepEPTimeoutError within the budget; a new Buffer works."""
    small = _small_call(env, 31)
    buf, x, layout = small[1], small[8], small[9]
    _times_out_then_recovers(env, small, lambda: buf.dispatch(x, **layout, config=_cfg(env)), "dispatch")


def test_copy_combine_timeout_reports_and_recovers(env):
    """Rank 1 skips a copy-mode combine: rank 0's kernel gives up waiting for rank 1's copies and the error
    names the op, rank 0 and peer 1; a new Buffer works."""
    small = _small_call(env, 32)
    buf, x, layout = small[1], small[8], small[9]
    engine = buf.runtime.intranode
    engine.tune(use_copy_combine=True)  # above 2 ranks the default takes it only on handles of few SMs
    recv, _, recv_w, _, handle, _ = buf.dispatch(x, **layout, config=_cfg(env))

    def combine():
        copies = engine.copy_seq
        try:
            buf.combine(recv, handle, topk_weights=recv_w, config=_cfg(env))
            engine.check_errors()
        finally:
            assert engine.copy_seq == copies + 1, "the combine did not take the copy mode"

    _times_out_then_recovers(env, small, combine, "combine (copy mode", in_pool=True)
