"""Internode dispatch and combine on GPUs (several NVLink domains), through the public ``deepep_cupy.Buffer``
API, against the NumPy reference backend on fresh random data.

Run: ``DEEPEP_CUPY_NVL_RANKS=1 mpirun -np 2 python -m pytest tests/gpu/test_internode.py`` (two GPUs as two
domains of one: every token crosses NVSHMEM), or with 4 GPUs as 2 x 2 (``DEEPEP_CUPY_NVL_RANKS=2``), which
also forwards over NVLink. One rank per domain takes the kernels' L = 1 path (no NVLink hop), larger
domains the NVLink forwarding path; ``test_network_path`` runs either over NVSHMEM puts and signals. Every
test is collective: all ranks run the same tests in the same order with the same parameters (data differs
per rank). Kernel waits use a 30 s budget, so a protocol bug shows up as
``DeepEPTimeoutError`` instead of a hang.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time

import numpy as np
import pytest
from gpu_common import BF16, COMM, FP8, MULTI_RANK_GPU, bf16, bits, frameworks, to_dev, to_np
from normal_common import (
    cached_dispatch_round,
    check_combine,
    combine_round,
    digest,
    inputs,
    poison,
    routing,
    skip_unless_framework_holds,
)

pytestmark = MULTI_RANK_GPU

NUM_SMS = 24
TEST_TIMEOUT_S = 30.0


def _domain_size() -> int:
    return int(os.environ.get("DEEPEP_CUPY_NVL_RANKS", "1"))


@contextlib.contextmanager
def _with_buffers(state):
    """The module's Buffer over ``DEEPEP_CUPY_NVL_RANKS``-rank domains (its kernels' budget set on it) and the
    reference with the same domains and channels; ``state["L"]`` is the domain size."""
    from deepep_cupy.device.group import MPIGroup
    from deepep_cupy.ops.internode.plans import default_channels
    from deepep_cupy.reference.oracle import ReferenceOracle

    size, lsize = state["size"], _domain_size()
    if size % lsize or size // lsize < 2:
        pytest.fail(f"the internode tests need at least 2 domains: {size} ranks, DEEPEP_CUPY_NVL_RANKS={lsize}")
    state["L"] = lsize
    state["buf"] = _new_buffer(state["deepep_cupy"], size, lsize)
    # The GPU kernels run several channels per SM pair: the reference splits the tokens the same way.
    channels = default_channels(_cfg(state["deepep_cupy"]), lsize, size // lsize)
    state["ref"] = ReferenceOracle(MPIGroup(COMM), num_nvl_ranks=lsize, low_latency_mode=False, enable_shrink=False,
                                    num_channels=channels)
    try:
        yield
    finally:
        state["buf"].destroy()  # the last one: tests replace it


ENV = _with_buffers


def _new_buffer(deepep_cupy, size, lsize):
    cfg = _cfg(deepep_cupy, 512, 64)
    nvl = cfg.get_nvl_buffer_size_hint(7168 * 2, size)
    rdma = cfg.get_rdma_buffer_size_hint(7168 * 2, size, lsize)
    buf = deepep_cupy.Buffer(comm=COMM, num_nvl_bytes=max(nvl, 1 << 26), num_rdma_bytes=rdma, num_nvl_ranks=lsize,
                             explicitly_destroy=True)
    assert buf.runtime.internode is not None
    buf.runtime.internode.tune(timeout_s=TEST_TIMEOUT_S)
    return buf


def _cfg(deepep_cupy, nvl_recv=256, rdma_recv=32):
    return deepep_cupy.Config(NUM_SMS, min(8, nvl_recv - 1), nvl_recv, min(8, rdma_recv // 2), rdma_recv)


# ------------------------------------------------------------------------------------------- one round
def _layout(env, topk_dev, topk_np, num_experts):
    buf, ref = env["buf"], env["ref"]
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_dev, num_experts)
    r_rank, r_rdma, r_expert, r_in = ref.get_dispatch_layout(topk_np, num_experts)
    np.testing.assert_array_equal(to_np(per_rank), r_rank)
    np.testing.assert_array_equal(to_np(per_rdma), r_rdma)
    np.testing.assert_array_equal(to_np(per_expert), r_expert)
    np.testing.assert_array_equal(to_np(in_rank), r_in)
    return (per_rank, per_rdma, per_expert, in_rank), (r_rank, r_expert, r_in)


def _check_dispatch(ours, refs, *, fp8, worst, with_topk=True):
    recv, r_idx, r_w, counts, handle = ours
    rx, rs, ridx, rw, rlist, rhandle = refs
    num_recv = int(np.asarray(rhandle[6])[-1])
    recv_x = to_np(recv[0] if fp8 else recv)
    assert recv_x.shape[0] == (worst if worst else num_recv), (recv_x.shape, worst, num_recv)
    # Padding rows of recv_x are unspecified (as DeepEP's); everything else is compared whole.
    np.testing.assert_array_equal(bits(recv_x[:num_recv]), bits(rx[:num_recv]))
    if fp8:
        np.testing.assert_array_equal(to_np(recv[1])[:num_recv], rs[:num_recv])
    if with_topk:
        np.testing.assert_array_equal(to_np(r_idx), ridx)
        np.testing.assert_array_equal(to_np(r_w), rw)
        assert counts == rlist
    for k in range(10):
        np.testing.assert_array_equal(to_np(handle[k]), np.asarray(rhandle[k]), err_msg=f"handle[{k}]")
    return num_recv


def _round(env, fw, rng, *, n, hidden, num_experts, k, fp8=False, column_major=False, worst=0, align=1,
           bias=0, cached=True, nvl_recv=256, rdma_recv=32, with_topk=True):
    """Layout, dispatch, cached dispatch, combine: everything compared with the reference."""
    buf, ref = env["buf"], env["ref"]
    me, size = env["rank"], env["size"]
    topk, weights = routing(rng, n, num_experts, k, me, size)
    topk_dev, w_dev = to_dev(topk, fw, env), to_dev(weights, fw, env)
    (per_rank, per_rdma, per_expert, in_rank), (r_rank, r_expert, r_in) = _layout(env, topk_dev, topk, num_experts)
    x_np, s_np, x_dev = inputs(env, fw, rng, n, hidden, fp8, column_major)
    cfg = _cfg(env["deepep_cupy"], nvl_recv, rdma_recv)
    worst_rows = worst * n * size if worst else 0
    rows_guess = max(worst_rows, n * size)
    poison(env, fw, [rows_guess * hidden * (1 if fp8 else 2), rows_guess * k * 8, rows_guess * k * 4, rows_guess * 8])
    recv, r_idx, r_w, counts, handle, _ = buf.dispatch(
        x_dev, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_dev if with_topk else None,
        topk_weights=w_dev if with_topk else None, expert_alignment=align, num_worst_tokens=worst_rows, config=cfg)
    refs = ref.dispatch(x_np, s_np, handle=None, num_tokens_per_rank=r_rank, is_token_in_rank=r_in,
                        num_tokens_per_expert=r_expert, topk_idx=topk if with_topk else None,
                        topk_weights=weights if with_topk else None, expert_alignment=align,
                        num_worst_tokens=worst_rows)
    num_recv = _check_dispatch((recv, r_idx, r_w, counts, handle), refs, fp8=fp8, worst=worst_rows,
                               with_topk=with_topk)
    if worst_rows:
        assert counts == []

    if cached:
        c_handle = cached_dispatch_round(env, fw, rng, handle=handle, ref_handle=refs[5], n=n, hidden=hidden, fp8=fp8,
                                         column_major=column_major, align=align, num_recv=num_recv, cfg=cfg)
        assert c_handle is None
    combine_round(env, fw, rng, handle=handle, ref_handle=refs[5], n=n, hidden=hidden, k=k,
                  rows=worst_rows if worst_rows else num_recv, bias=bias, cfg=cfg)
    return num_recv


# ------------------------------------------------------------------------------------------- tests
SMALL = [
    # n, hidden, experts, k, extra
    (1, 2048, 16, 1, {}),
    (37, 4096, 32, 9, {"bias": 1}),
    (300, 7168, 64, 4, {"align": 128, "bias": 2}),
    (200, 4096, 32, 2, {"nvl_recv": 12, "rdma_recv": 8}),  # small rings: slots are reused many times
    (0, 2048, 16, 2, {}),
    (3, 2056, 16, 3, {"with_topk": False}),
    (129, 7168, 256, 8, {"fp8": True, "column_major": True}),
    (64, 2048, 32, 5, {"fp8": True}),
    (100, 4096, 32, 6, {"worst": 1}),
    (80, 7168, 64, 8, {"worst": 1, "fp8": True, "column_major": True}),
]


@pytest.mark.parametrize("fw", frameworks())
@pytest.mark.parametrize("n,hidden,experts,k,extra", SMALL)
def test_small_shapes(env, fw, n, hidden, experts, k, extra):
    skip_unless_framework_holds(fw, BF16, *((FP8,) if extra.get("fp8") else ()))
    rng = np.random.default_rng([n, hidden, k, env["rank"]])
    for _ in range(2):
        _round(env, fw, rng, n=n, hidden=hidden, num_experts=experts, k=k, **extra)


def test_zero_tokens_on_one_rank(env):
    rng = np.random.default_rng([5, env["rank"]])
    n = 0 if env["rank"] == 1 else 50
    _round(env, frameworks()[0], rng, n=n, hidden=2048, num_experts=16, k=3)


@pytest.mark.skipif(os.environ.get("DEEPEP_CUPY_SKIP_BIG") == "1", reason="DEEPEP_CUPY_SKIP_BIG=1")
@pytest.mark.parametrize("fp8", [False, True])
def test_deepep_workload(env, fp8):
    """4096 tokens x 7168, top-8 of 256: fresh data each repeat."""
    rng = np.random.default_rng([4096, int(fp8), env["rank"]])
    for _ in range(2):
        _round(env, frameworks()[0], rng, n=4096, hidden=7168, num_experts=256, k=8, fp8=fp8, column_major=fp8,
               bias=1, nvl_recv=512, rdma_recv=64)


def test_repeatable_hashes(env):
    """Twenty identical calls must produce identical bytes (a moving result is a race)."""
    buf, fw = env["buf"], "cupy"
    rng = np.random.default_rng([99, env["rank"]])
    n, hidden, experts, k = 1024, 7168, 256, 8
    topk, weights = routing(rng, n, experts, k, env["rank"], env["size"])
    x = to_dev(bf16(rng, (n, hidden)), fw, env)
    topk_dev, w_dev = to_dev(topk, fw, env), to_dev(weights, fw, env)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_dev, experts)
    cfg = _cfg(env["deepep_cupy"], 256, 32)
    digests = set()
    for _ in range(20):
        recv, idx, w, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_dev, topk_weights=w_dev, config=cfg)
        comb, comb_w, _ = buf.combine(recv, handle, topk_weights=w, config=cfg)
        digests.add(digest((recv, idx, w, comb, comb_w, *handle), counts))
    assert len(digests) == 1, f"{len(digests)} different results over 20 identical calls"


def _few_sms(env, monkeypatch, num_sms):
    """Run the ops on a Config of ``num_sms`` SMs (its own default channels a block) and check them against a
    reference run with as many channels (the handles' channel columns must match)."""
    from deepep_cupy.device.group import MPIGroup
    from deepep_cupy.ops.internode.plans import default_channels
    from deepep_cupy.reference.oracle import ReferenceOracle

    lsize, ndom = env["L"], env["size"] // env["L"]
    monkeypatch.setattr(sys.modules[__name__], "NUM_SMS", num_sms)
    monkeypatch.setitem(env, "ref", ReferenceOracle(
        MPIGroup(COMM), num_nvl_ranks=lsize, low_latency_mode=False, enable_shrink=False,
        num_channels=default_channels(_cfg(env["deepep_cupy"]), lsize, ndom)))


@pytest.mark.parametrize("num_sms", [NUM_SMS, 8])
def test_torch_cuda_graph_worst_tokens(env, monkeypatch, num_sms):
    """Dispatch with num_worst_tokens + combine captured in ``torch.cuda.graph``, replayed on fresh data; also on
    8 SMs, whose default blocks differ (1024 threads with one rank a domain)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("DEEPEP_CUPY_VALIDATE", "0")  # value checks sync the host: not allowed in a capture
    if num_sms != NUM_SMS:
        _few_sms(env, monkeypatch, num_sms)
    buf, ref = env["buf"], env["ref"]
    me, size, fw = env["rank"], env["size"], "torch"
    rng = np.random.default_rng([1234, me])
    n, hidden, experts, k = 300, 4096, 64, 8
    worst = n * size
    topk, weights = routing(rng, n, experts, k, me, size)
    x = to_dev(bf16(rng, (n, hidden)), fw, env)
    y = to_dev(bf16(rng, (worst, hidden)), fw, env)
    topk_dev, w_dev = to_dev(topk, fw, env), to_dev(weights, fw, env)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_dev, experts)
    cfg = _cfg(env["deepep_cupy"])

    def step():
        recv, idx, w, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_dev, topk_weights=w_dev, num_worst_tokens=worst,
            config=cfg)
        comb, comb_w, _ = buf.combine(y, handle, topk_weights=w, config=cfg)
        return recv, idx, w, handle, comb, comb_w

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture: compiles, makes the plans
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        x_np, y_np = bf16(rng, (n, hidden)), bf16(rng, (worst, hidden))
        x.copy_(to_dev(x_np, fw, env))
        y.copy_(to_dev(y_np, fw, env))
        graph.replay()
        torch.cuda.synchronize()
        recv, idx, w, handle, comb, comb_w = out
        refs = ref.dispatch(x_np, None, handle=None, num_tokens_per_rank=None, is_token_in_rank=to_np(in_rank),
                            num_tokens_per_expert=to_np(per_expert), topk_idx=topk, topk_weights=weights,
                            expert_alignment=1, num_worst_tokens=worst)
        _check_dispatch((recv, idx, w, [], handle), refs, fp8=False, worst=worst)
        r_comb = ref.combine(y_np, refs[5], topk_weights=to_np(w), bias_0=None, bias_1=None)
        check_combine((comb, comb_w), r_comb, n)
    buf.runtime.internode.check_errors()


def test_worst_tokens_overflow_is_a_named_error(env, monkeypatch):
    """Fewer num_worst_tokens rows than a rank receives: a DeepEPError on that rank at the next check."""
    from deepep_cupy.errors import DeepEPError

    fw = frameworks()[0]
    buf, me, size = env["buf"], env["rank"], env["size"]
    rng = np.random.default_rng([77, me])
    n, hidden, experts, k = 64, 2048, 16, 4
    topk, weights = routing(rng, n, experts, k, me, size)
    x, topk_dev, w_dev = to_dev(bf16(rng, (n, hidden)), fw, env), to_dev(topk, fw, env), to_dev(weights, fw, env)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_dev, experts)
    received = COMM.allreduce(to_np(in_rank).sum(axis=0))[me]
    worst = max(1, int(COMM.allreduce(received, op=_min_op())) // 2)
    buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                 num_tokens_per_expert=per_expert, topk_idx=topk_dev, topk_weights=w_dev, num_worst_tokens=worst,
                 config=_cfg(env["deepep_cupy"]))
    with pytest.raises(DeepEPError, match="num_worst_tokens"):
        buf.runtime.internode.check_errors()
    COMM.Barrier()
    _fresh_buffer(env)


def _min_op():
    from mpi4py import MPI

    return MPI.MIN


def _fresh_buffer(env):
    COMM.Barrier()
    env["buf"].destroy()
    env["buf"] = _new_buffer(env["deepep_cupy"], env["size"], env["L"])


def test_timeout_reports_and_recovers(env):
    """Rank 1 skips a dispatch: the others raise DeepEPTimeoutError within the budget; a new Buffer works."""
    from deepep_cupy.errors import DeepEPTimeoutError

    fw = frameworks()[0]
    buf, me = env["buf"], env["rank"]
    rng = np.random.default_rng([31, me])
    n, hidden, experts, k = 64, 2048, 16, 2
    topk, weights = routing(rng, n, experts, k, me, env["size"])
    x, topk_dev, w_dev = to_dev(bf16(rng, (n, hidden)), fw, env), to_dev(topk, fw, env), to_dev(weights, fw, env)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_dev, experts)
    buf.runtime.internode.tune(timeout_s=2.0)
    COMM.Barrier()
    if me != 1:
        t0 = time.time()
        with pytest.raises(DeepEPTimeoutError) as info:
            buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                         num_tokens_per_expert=per_expert, topk_idx=topk_dev, topk_weights=w_dev,
                         config=_cfg(env["deepep_cupy"]))
        assert time.time() - t0 < 60
        text = str(info.value)
        peer = re.search(r"peer (\d+)", text)
        assert "internode dispatch" in text and f"rank {me}" in text and peer, text
        # With one rank a domain every rank waits for rank 1 itself; in larger domains a rank may first time out
        # on a rank of its own domain that waits for rank 1 (its forwarder) and names that one.
        if env["L"] == 1:
            assert peer.group(1) == "1", text
        else:
            assert int(peer.group(1)) != me, text
    _fresh_buffer(env)
    _round(env, fw, rng, n=n, hidden=hidden, num_experts=experts, k=k)


@pytest.mark.parametrize("n,hidden,experts,k,extra", [SMALL[2], SMALL[3], SMALL[9]])
def test_network_path(env, monkeypatch, n, hidden, experts, k, extra):
    """Every row and signal through NVSHMEM puts (as to a peer on another host), not stores over NVLink."""
    monkeypatch.setenv("DEEPEP_CUPY_INTERNODE_FORCE_RMA", "1")
    _fresh_buffer(env)
    try:
        assert env["buf"].runtime.internode.force_rma
        rng = np.random.default_rng([n, hidden, k, env["rank"], 7])
        for _ in range(2):
            _round(env, frameworks()[0], rng, n=n, hidden=hidden, num_experts=experts, k=k, **extra)
    finally:
        monkeypatch.delenv("DEEPEP_CUPY_INTERNODE_FORCE_RMA")
        _fresh_buffer(env)


@pytest.mark.parametrize("sub", ["one", "most"])
def test_sub_channels_tuning(env, sub):
    """Other channel counts per block (the engine's compile-time sub_channels): same rows, and the handle of
    the reference run with as many channels; the default comes back for the tests after this one."""
    from deepep_cupy.device.group import MPIGroup
    from deepep_cupy.ops.internode import buffer_map as IL
    from deepep_cupy.ops.internode.plans import default_channels
    from deepep_cupy.reference.oracle import ReferenceOracle

    engine, lsize, ndom = env["buf"].runtime.internode, env["L"], env["size"] // env["L"]
    value = 1 if sub == "one" else IL.max_sub_channels(lsize, ndom)
    saved = env["ref"]
    engine.tune(sub_channels=value)
    try:
        channels = default_channels(_cfg(env["deepep_cupy"]), lsize, ndom, value)
        env["ref"] = ReferenceOracle(MPIGroup(COMM), num_nvl_ranks=lsize, low_latency_mode=False, enable_shrink=False,
                                     num_channels=channels)
        rng = np.random.default_rng([value, env["rank"], 11])
        for n, hidden, experts, k, extra in (SMALL[2], SMALL[6], SMALL[9]):
            _round(env, frameworks()[0], rng, n=n, hidden=hidden, num_experts=experts, k=k, **extra)
    finally:
        engine.tune(sub_channels=None)
        env["ref"] = saved


@pytest.mark.parametrize("num_sms", [8, 12])
def test_default_blocks_on_few_sms(env, monkeypatch, num_sms):
    """A config of few SMs takes its own default channels a block (1024-thread blocks with one rank a domain):
    same rows as the reference run with as many channels, small shapes and DeepEP's workload."""
    from deepep_cupy.ops.internode import buffer_map as IL

    lsize, ndom = env["L"], env["size"] // env["L"]
    _few_sms(env, monkeypatch, num_sms)
    used = env["buf"].runtime.internode.channels_per_block(num_sms)
    assert used == IL.sub_channels(lsize, ndom, num_sms)
    rng = np.random.default_rng([num_sms, env["rank"], 13])
    for n, hidden, experts, k, extra in (SMALL[2], SMALL[6], SMALL[9]):
        _round(env, frameworks()[0], rng, n=n, hidden=hidden, num_experts=experts, k=k, **extra)
    if os.environ.get("DEEPEP_CUPY_SKIP_BIG") != "1":
        _round(env, frameworks()[0], rng, n=4096, hidden=7168, num_experts=256, k=8, fp8=True,
               column_major=True, bias=1, nvl_recv=512, rdma_recv=64)


@pytest.mark.parametrize("copies", [True, False])
def test_own_rows_by_device_copies(env, copies):
    """With one rank a domain, asked to, device-to-device copies move this rank's own rows (ops/own_rows.py) in
    a dispatch that waits for its counts and in the cached one with its handle, while the sender warps write the
    rest of those rows' outputs; or the sender warps move them too (the default). Rows as few as one go to the
    copies here, so the small shapes take them (BF16 and FP8, both scale layouts); the results are the
    reference's either way."""
    from deepep_cupy.ops.own_rows import MIN_ROWS

    engine = env["buf"].runtime.internode
    engine.tune(use_own_row_copies=copies)
    engine.own_copy_min_rows = 1
    before = engine.own_copies
    shapes = (SMALL[1], SMALL[2], SMALL[6], SMALL[7])
    try:
        rng = np.random.default_rng([int(copies), env["rank"], 13])
        for n, hidden, experts, k, extra in shapes:
            _round(env, frameworks()[0], rng, n=n, hidden=hidden, num_experts=experts, k=k, **extra)
    finally:
        engine.tune(use_own_row_copies=None)
        engine.own_copy_min_rows = MIN_ROWS
    moved = engine.own_copies - before
    # Each round is a dispatch and a cached dispatch; a rank with no own token or too many runs keeps the SMs.
    if copies and env["L"] == 1:
        assert moved >= len(shapes), moved
    else:
        assert moved == 0, moved


@pytest.mark.parametrize("mode", ["pool", "ring", "mixed"])
def test_rows_in_place(env, mode):
    """Domains of more than one rank with an output pool: a receiver whose outputs lie in its pool has the
    forwarders write the rows there in place (dispatch_forward.cuh); "ring": every rank allocates outside
    the pool, so every row goes through the NVLink rings; "mixed": only even ranks allocate in their pool (as
    when the others' pools are full), so each forwarder serves some ranks in place and others through the
    ring in the same channel. The results are the reference's in every mode; with one rank a domain there
    is no pool and every mode is the same."""
    engine = env["buf"].runtime.internode
    use = {"pool": True, "ring": False, "mixed": env["rank"] % 2 == 0}[mode]
    engine.tune(use_output_pool=use)
    before = engine.pool_dispatches
    try:
        rng = np.random.default_rng([len(mode), env["rank"], 17])
        for n, hidden, experts, k, extra in (SMALL[2], SMALL[6], SMALL[9]):
            _round(env, frameworks()[0], rng, n=n, hidden=hidden, num_experts=experts, k=k, **extra)
    finally:
        engine.tune(use_output_pool=True)
    placed = engine.pool_dispatches - before
    if use and env["L"] > 1:
        assert engine.output_pool is not None, "no output pool with domains of more than one rank"
        assert placed > 0, placed
    else:
        assert placed == 0, placed
