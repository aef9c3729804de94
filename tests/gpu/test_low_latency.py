"""Low-latency dispatch and combine on GPUs through the public ``deepep_cupy.Buffer`` API, against the NumPy
reference backend on fresh random data: formats, shapes, token-count edges, zero-copy, LogFMT, staging,
statistics, and bit-identical repeats.

Run on every rank:  mpirun -np 2 python -m pytest tests/gpu/test_low_latency.py -q
Hooks, overlap and CUDA graphs are in test_low_latency_hooks.py, silent peers and the RMA path in
test_low_latency_faults.py; the helpers all three share are in ll_common.py.
Skips without a GPU, without nvshmem4py, or with fewer than 2 ranks. Every test is collective: all ranks
run the same tests in the same order (data differs per rank), and a failed check on one rank fails the
test on every rank (the checks are gathered first), so the ranks never lose step. Kernel waits use a
30 s budget here, so a protocol bug shows up as an error instead of a hang.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from gpu_common import agree, bf16, bits, sync, to_dev, to_np
from ll_common import (
    E_BIG,
    E_SMALL,
    FRAMEWORKS,
    H_BIG,
    K_BIG,
    LL_MARKS,
    T_BIG,
    T_SMALL,
    dispatch_arrays,
    engine_paths,
    make_expert_out,
    routing,
    run_round,
    valid_hash,
    with_low_latency_buffer,
)

pytestmark = LL_MARKS
ENV = with_low_latency_buffer


# ------------------------------------------------------------------------------------------- tests
# Few distinct (hidden, top-k, format) combinations: each one is a kernel compile on a cold cache.
CASES = [
    # hidden, experts, top-k, fp8, round_scale, ue8m0
    (2048, 32, 8, False, False, False),
    (2048, 32, 8, True, False, False),
    (4096, 32, 8, True, True, False),
    (4096, 32, 8, True, True, True),
    (7168, E_BIG, K_BIG, False, False, False),
    (7168, E_BIG, K_BIG, True, False, False),
    (7168, E_BIG, K_BIG, True, True, True),
]


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}-e{c[1]}-k{c[2]}-{'fp8' if c[3] else 'bf16'}"
                         f"{'-round' if c[4] else ''}{'-ue8m0' if c[5] else ''}")
def test_matches_reference(env, fw, case):
    hidden, experts, k, fp8, round_scale, ue8m0 = case
    failures, _, _ = run_round(env, fw, seed=hash(case) % 1000 + len(fw), t_max=T_BIG, hidden=hidden, num_experts=experts,
                               k=k, fp8=fp8, round_scale=round_scale, ue8m0=ue8m0)
    agree(failures)


@pytest.mark.parametrize("n", [1, T_BIG])
def test_token_count_edges(env, n):
    failures, _, _ = run_round(env, FRAMEWORKS[0], seed=7 + n, t_max=T_BIG, hidden=4096, num_experts=32, k=8, n=n, fp8=True,
                               round_scale=True)
    agree(failures)


def test_uneven_tokens_and_tiny_topk(env):
    # Rank-dependent token counts, top-1, hidden not a multiple of 128 (BF16 only).
    rank = env["rank"]
    failures, _, _ = run_round(env, FRAMEWORKS[0], seed=3, t_max=T_SMALL, hidden=2056, num_experts=E_SMALL, k=1,
                               n=1 + (rank * 13) % T_SMALL)
    agree(failures)


def test_zero_copy_and_out(env):
    failures, _, _ = run_round(env, FRAMEWORKS[0], seed=12, t_max=T_BIG, hidden=H_BIG, num_experts=E_BIG, k=K_BIG,
                               fp8=True, zero_copy=True, out=True)
    agree(failures)


@pytest.mark.parametrize("hidden", [2048, 2176, H_BIG])  # 2176: 17 blocks, a one-block last wire segment
def test_logfmt(env, hidden):
    """Where per-rank partial sums apply, they carry the reference's LogFMT parts (nearly every value bit
    for bit); elsewhere rows per (token, expert), within LogFMT's tolerance."""
    experts = E_BIG if hidden == H_BIG else 32
    engine = env["buf"].runtime.low_latency
    partials = engine.rank_partials(engine.make_buffer_map(T_BIG, hidden, experts), K_BIG, True)
    failures, _, _ = run_round(env, FRAMEWORKS[0], seed=13, t_max=T_BIG, hidden=hidden, num_experts=experts, k=K_BIG,
                               fp8=True, logfmt=True, logfmt_exact=0.99 if partials else None)
    agree(failures)


@pytest.mark.parametrize("hidden", [2176, H_BIG])
def test_logfmt_per_expert_rows(env, hidden):
    """LogFMT rows per (token, expert) where partial sums would apply: within LogFMT's tolerance."""
    experts = E_BIG if hidden == H_BIG else 32
    failures, _, _ = engine_paths(env, lambda: run_round(
        env, FRAMEWORKS[0], seed=19, t_max=T_BIG, hidden=hidden, num_experts=experts, k=K_BIG, logfmt=True),
        staged=False, per_expert=True)
    agree(failures)


@pytest.mark.parametrize("fp8", [False, True])
def test_precast_staging(env, fp8):
    """Tokens cast once into the staging area, then copied over NVLink as one row per (token, expert)."""
    failures, _, _ = engine_paths(env, lambda: run_round(
        env, FRAMEWORKS[0], seed=17, t_max=T_BIG, hidden=H_BIG, num_experts=E_BIG, k=K_BIG, fp8=fp8,
        round_scale=fp8), staged=True, per_expert=True)
    agree(failures)


@pytest.mark.parametrize("fp8", [False, True])
def test_per_expert_rows(env, fp8):
    """One row per (token, expert) cast on the fly (the format used where per-rank messages do not fit),
    and a BF16 combine row per (token, expert) (where per-rank partial sums do not pay): the same bits."""
    failures, _, _ = engine_paths(env, lambda: run_round(
        env, FRAMEWORKS[0], seed=18, t_max=T_BIG, hidden=H_BIG, num_experts=E_BIG, k=K_BIG, fp8=fp8, stats=True),
        staged=False, per_expert=True)
    agree(failures)


def test_rank_messages_are_used(env):
    """The benchmark shape takes the per-(token, rank) format on NVLink (the other tests check its results)."""
    engine = env["buf"].runtime.low_latency
    buffer_map = engine.make_buffer_map(T_BIG, H_BIG, E_BIG)
    assert engine.rank_messages(buffer_map, K_BIG, True) == (all(engine.p2p_peers) and not engine.force_rma)


def test_rank_partials_are_used(env):
    """The benchmark shape's combine sends per-rank partial sums on NVLink: BF16 at 2 ranks, LogFMT at 2, 4
    and 8 (the other tests check their results; test_per_expert_rows and test_logfmt_per_expert_rows
    check the rows they replace)."""
    engine = env["buf"].runtime.low_latency
    buffer_map = engine.make_buffer_map(T_BIG, H_BIG, E_BIG)
    nvlink = all(engine.p2p_peers) and not engine.force_rma
    assert engine.rank_partials(buffer_map, K_BIG, False) == (nvlink and env["size"] == 2)
    assert engine.rank_partials(buffer_map, K_BIG, True) == (nvlink and env["size"] <= 8)


@pytest.mark.parametrize("logfmt", [False, True])
def test_partials_from_a_rebuilt_handle(env, logfmt):
    """A handle the caller rebuilt (a plain tuple) carries no row map from the dispatch: the partial-sum send
    then rebuilds the rows from the source info. Both frameworks; the other tests use the row map."""
    engine = env["buf"].runtime.low_latency
    partials = engine.rank_partials(engine.make_buffer_map(T_BIG, H_BIG, E_BIG), K_BIG, logfmt)
    for fw in FRAMEWORKS:
        failures, _, _ = run_round(env, fw, seed=23, t_max=T_BIG, hidden=H_BIG, num_experts=E_BIG, k=K_BIG,
                                   logfmt=logfmt, logfmt_exact=0.99 if logfmt and partials else None,
                                   rebuild_handle=True)
        agree(failures)


def test_partials_with_a_table_past_48_kib(env):
    """T=1024 at top-8 on 2 ranks: the partial-sum send's row table (~74 KB of dynamic shared memory) needs
    the function's opt-in past 48 KiB. The table is built for a rebuilt handle (no row map), and the row
    map is used from the dispatch's own handle."""
    buffer_map = env["buf"].runtime.low_latency.make_buffer_map(1024, 2048, 32)
    assert buffer_map.partial_table_bytes(8) > 48 * 1024
    for rebuild in (True, False):
        failures, _, _ = run_round(env, FRAMEWORKS[0], seed=21, t_max=1024, hidden=2048, num_experts=32, k=8,
                                   rebuild_handle=rebuild)
        agree(failures)


@pytest.mark.parametrize("logfmt,hook", [(False, False), (False, True), (True, True)])
def test_combine_reports_a_bad_expert_id(env, logfmt, hook):
    """A top-k id out of range given to the combine (the dispatch had valid ones) is found by the kernel, with
    no host sync on the call, and raised by the next call as a ValueError naming topk_idx; the call after
    that works. Fused and with a receive hook (at 2 ranks the partial-sum path, which checks the ids in its
    send part)."""
    buf, rank, size = env["buf"], env["rank"], env["size"]
    fw = FRAMEWORKS[0]
    rng = np.random.default_rng(41 + rank)
    x = bf16(rng, (T_BIG, H_BIG))
    topk, w = routing(rng, T_BIG, E_BIG, K_BIG)
    _recv, count, handle, _e, _h = buf.low_latency_dispatch(to_dev(x, fw, env), to_dev(topk, fw, env), T_BIG, E_BIG,
                                                            use_fp8=False)
    sync()
    expert_out = make_expert_out(rng, to_np(count), E_BIG // size, size * T_BIG, H_BIG)
    bad = topk.copy()
    bad[rng.integers(T_BIG), rng.integers(K_BIG)] = E_BIG + 7 * rank
    _out, _ev, recv_hook = buf.low_latency_combine(to_dev(expert_out, fw, env), to_dev(bad, fw, env),
                                                   to_dev(w, fw, env), handle, use_logfmt=logfmt,
                                                   return_recv_hook=hook)
    if hook:
        recv_hook()
    sync()
    failures = []
    try:
        buf.low_latency_dispatch(to_dev(x, fw, env), to_dev(topk, fw, env), T_BIG, E_BIG, use_fp8=False)
        sync()
        failures.append("no ValueError at the call after a combine with a bad expert id")
    except ValueError as exc:
        if "topk_idx" not in str(exc) or str(E_BIG + 7 * rank) not in str(exc):
            failures.append(f"the error does not name topk_idx and the value: {exc}")
    _recv, count, _handle, _e, _h = buf.low_latency_dispatch(to_dev(x, fw, env), to_dev(topk, fw, env), T_BIG, E_BIG,
                                                             use_fp8=False)
    sync()
    if int(to_np(count).sum()) <= 0:
        failures.append("the dispatch after the error received nothing")
    agree(failures)


def test_stats(env):
    failures, _, _ = run_round(env, FRAMEWORKS[0], seed=14, t_max=T_BIG, hidden=H_BIG, num_experts=E_BIG, k=K_BIG,
                               fp8=True, stats=True)
    agree(failures)


def test_repeats_are_bit_identical(env):
    """Twenty dispatch + combine rounds of the same inputs: identical hashes (a moving result is a race)."""
    buf, rank, size = env["buf"], env["rank"], env["size"]
    fw = FRAMEWORKS[0]
    rng = np.random.default_rng(16 + rank)
    x = bf16(rng, (T_BIG, H_BIG))
    topk, w = routing(rng, T_BIG, E_BIG, K_BIG)
    x_dev, topk_dev, w_dev = (to_dev(a, fw, env) for a in (x, topk, w))
    _, count, _, _, _ = buf.low_latency_dispatch(x_dev, topk_dev, T_BIG, E_BIG, use_fp8=True)
    expert_out = make_expert_out(rng, to_np(count), E_BIG // size, size * T_BIG, H_BIG)
    eo_dev = to_dev(expert_out, fw, env)
    d_hashes, c_hashes = set(), set()
    for _ in range(20):
        recv, count, handle, _e, _h = buf.low_latency_dispatch(x_dev, topk_dev, T_BIG, E_BIG, use_fp8=True)
        combined, _e, _h = buf.low_latency_combine(eo_dev, topk_dev, w_dev, handle)
        sync()
        d_hashes.add(valid_hash(dispatch_arrays(recv, count, handle)))
        c_hashes.add(hashlib.sha256(bits(to_np(combined)).tobytes()).hexdigest())
    failures = []
    if len(d_hashes) != 1:
        failures.append(f"dispatch results differ across repeats: {len(d_hashes)} distinct hashes")
    if len(c_hashes) != 1:
        failures.append(f"combine results differ across repeats: {len(c_hashes)} distinct hashes")
    agree(failures)
