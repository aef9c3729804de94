"""Low-latency dispatch and combine on GPUs through the public ``deepep_cupy.Buffer`` API, against the NumPy
reference backend on fresh random data.

Run on every rank:  mpirun -np 2 python -m pytest tests/gpu/test_low_latency.py -q
Skips without a GPU, without nvshmem4py, or with fewer than 2 ranks. Every test is collective: all ranks
run the same tests in the same order (data differs per rank), and a failed check on one rank fails the
test on every rank (the checks are gathered first), so the ranks never lose step. Kernel waits use a
30 s budget here (2 s in the timeout tests), so a protocol bug shows up as an error instead of a hang.
The whole file is meant to take well under 3 minutes on 2 x H200.
"""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pytest
from gpu_common import BF16, COMM, MULTI_RANK_GPU, bf16, bits, to_dev, to_np

from deepep_cupy.runtime.device import gpu_count


def _have_nvshmem4py() -> bool:
    try:
        import nvshmem.core  # noqa: F401
    except Exception:
        return False
    return True


pytestmark = [
    *MULTI_RANK_GPU,
    pytest.mark.skipif(not _have_nvshmem4py(), reason="needs nvshmem4py (pip install nvshmem4py-cu13)"),
]

TEST_TIMEOUT_S = "30"
SHORT_TIMEOUT_S = "2"
# The DeepEP workload (its tests/test_low_latency.py): 128 tokens, hidden 7168, top-8 of 288 experts.
T_BIG, H_BIG, E_BIG, K_BIG = 128, 7168, 288, 8
T_SMALL, H_SMALL, E_SMALL = 32, 2048, 16


# ------------------------------------------------------------------------------------------- helpers
def _frameworks():
    fws = []
    try:
        import torch

        if torch.cuda.is_available():
            fws.append("torch")
    except ImportError:
        pass
    from deepep_cupy.interop import _cupy_holds

    if _cupy_holds(BF16):
        fws.append("cupy")
    return fws


FRAMEWORKS = _frameworks()


def _agree(failures: list[str]) -> None:
    """Collective check: every rank raises if any rank collected a failure."""
    everything = COMM.allgather(failures)
    bad = [f"rank {r}: {msg}" for r, msgs in enumerate(everything) for msg in msgs]
    if bad:
        pytest.fail("\n".join(bad[:20]))


def _check(failures: list[str], what: str, fn) -> None:
    try:
        fn()
    except AssertionError as exc:
        failures.append(f"{what}: {str(exc)[:800]}")


def _sync():
    import cupy

    cupy.cuda.Device().synchronize()
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    except ImportError:
        pass


def _routing(rng, n, num_experts, k, masked_slots=10):
    scores = np.abs(rng.standard_normal((n, num_experts))).astype(np.float32) + 1
    topk = np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int64)
    for _ in range(min(masked_slots, n)):
        topk[rng.integers(n), rng.integers(k)] = -1
    weights = rng.random((n, k), dtype=np.float32)
    return topk, weights


def _expert_out(rng, counts, e_local, slab, hidden):
    """Expert outputs [E_local, R*T, H]: random rows where the dispatch put rows, zeros elsewhere (filling
    the whole slab would cost seconds for the DeepEP shape and is never read)."""
    out = np.zeros((e_local, slab, hidden), BF16)
    for i, c in enumerate(np.asarray(counts).tolist()):
        out[i, :c] = bf16(rng, (c, hidden), 0.5)
    return out


def _hint(t, h, e):
    import deepep_cupy

    return deepep_cupy.Buffer.get_low_latency_rdma_size_hint(t, h, COMM.Get_size(), e)


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def env():
    import cupy

    import deepep_cupy
    from deepep_cupy.reference.backend import ReferenceBackend
    from deepep_cupy.runtime.group import MPIGroup

    os.environ["DEEPEP_CUPY_TIMEOUT_S"] = TEST_TIMEOUT_S
    rank, size = COMM.Get_rank(), COMM.Get_size()
    dev = rank % gpu_count()
    cupy.cuda.Device(dev).use()
    if "torch" in FRAMEWORKS:
        import torch

        torch.cuda.set_device(dev)
    # The largest buffer first: NVSHMEM sizes its symmetric heap from the first request.
    num_bytes = max(_hint(T_BIG, H_BIG, E_BIG), _hint(T_BIG, 4096, 32), _hint(T_SMALL, H_SMALL, E_SMALL))
    buf = deepep_cupy.Buffer(comm=COMM, num_rdma_bytes=num_bytes, low_latency_mode=True, num_qps_per_rank=E_BIG // size,
                             explicitly_destroy=True)
    ref = ReferenceBackend(MPIGroup(COMM), num_nvl_ranks=size, low_latency_mode=True, enable_shrink=False)
    state = {"rank": rank, "size": size, "dev": dev, "deepep_cupy": deepep_cupy, "buf": buf, "ref": ref}
    yield state
    _sync()
    COMM.Barrier()
    buf.destroy()


# ------------------------------------------------------------------------------------------- one round
def _dispatch_both(env, fw, x, topk, t_max, num_experts, *, fp8, round_scale=False, ue8m0=False, hook=False,
                   stats=False):
    """GPU and reference dispatch of the same data; returns (ours, refs) as NumPy, plus the GPU handle."""
    buf, ref = env["buf"], env["ref"]
    size = env["size"]
    e_local = num_experts // size
    kw = dict(use_fp8=fp8, round_scale=round_scale, use_ue8m0=ue8m0)
    cum = to_dev(np.zeros(e_local, np.int32), fw, env) if stats else None
    wait = to_dev(np.zeros(size, np.int64), fw, env) if stats else None
    recv, count, handle, _event, recv_hook = buf.low_latency_dispatch(
        to_dev(x, fw, env), to_dev(topk, fw, env), t_max, num_experts, cumulative_local_expert_recv_stats=cum,
        dispatch_wait_recv_cost_stats=wait, return_recv_hook=hook, **kw)
    if hook:
        assert recv_hook is not None
        recv_hook()
    else:
        assert recv_hook is None
    _sync()
    r_recv, r_count, r_handle, _ = ref.low_latency_dispatch(
        x, topk, num_max_dispatch_tokens_per_rank=t_max, num_experts=num_experts,
        cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None, return_recv_hook=False, **kw)
    ours = {"count": to_np(count), "src_info": to_np(handle[0]), "layout": to_np(handle[1])}
    refs = {"count": np.asarray(r_count), "src_info": np.asarray(r_handle[0]), "layout": np.asarray(r_handle[1])}
    if fp8:
        ours["x"], ours["scales"] = to_np(recv[0]), to_np(recv[1])
        refs["x"], refs["scales"] = r_recv
    else:
        ours["x"], refs["x"] = to_np(recv), r_recv
    if stats:
        ours["cum"], ours["wait"] = to_np(cum), to_np(wait)
    return ours, refs, handle, r_handle


def _dispatch_failures(ours, refs, *, fp8) -> list[str]:
    failures: list[str] = []
    _check(failures, "recv_count", lambda: np.testing.assert_array_equal(ours["count"], refs["count"]))
    _check(failures, "layout_range", lambda: np.testing.assert_array_equal(ours["layout"], refs["layout"]))
    _check(failures, "src_info", lambda: np.testing.assert_array_equal(ours["src_info"], refs["src_info"]))
    if failures:
        return failures
    for i, c in enumerate(refs["count"].tolist()):
        _check(failures, f"recv_x[{i}]",
               lambda i=i, c=c: np.testing.assert_array_equal(bits(ours["x"][i, :c]), bits(refs["x"][i, :c])))
        if fp8:
            _check(failures, f"scales[{i}]",
                   lambda i=i, c=c: np.testing.assert_array_equal(ours["scales"][i, :c], refs["scales"][i, :c]))
        if failures:
            break
    return failures


def _valid_hash(ours) -> str:
    h = hashlib.sha256()
    for i, c in enumerate(ours["count"].tolist()):
        h.update(bits(ours["x"][i, :c]).tobytes())
        if "scales" in ours:
            h.update(np.ascontiguousarray(ours["scales"][i, :c]).tobytes())
    h.update(ours["src_info"].tobytes())
    h.update(ours["layout"].tobytes())
    return h.hexdigest()


def _combine_both(env, fw, expert_out, topk, weights, handle, r_handle, *, logfmt=False, zero_copy=False, hook=False,
                  out=False):
    buf, ref = env["buf"], env["ref"]
    if zero_copy:
        target = buf.get_next_low_latency_combine_buffer(handle)
        from deepep_cupy.interop import copy_into

        copy_into(target, expert_out)
        x_dev = target
    else:
        x_dev = to_dev(expert_out, fw, env)
    out_dev = to_dev(np.zeros((topk.shape[0], expert_out.shape[2]), BF16), fw, env) if out else None
    combined, _event, recv_hook = buf.low_latency_combine(x_dev, to_dev(topk, fw, env), to_dev(weights, fw, env),
                                                          handle, use_logfmt=logfmt, zero_copy=zero_copy,
                                                          return_recv_hook=hook, out=out_dev)
    if hook:
        recv_hook()
    if out:
        assert combined is out_dev
    _sync()
    r_combined, _ = ref.low_latency_combine(expert_out, topk, weights, r_handle, use_logfmt=logfmt, zero_copy=False,
                                            return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None)
    return to_np(combined), np.asarray(r_combined)


def _combine_failures(ours, refs, *, logfmt, expert_out=None, topk=None, weights=None) -> list[str]:
    failures: list[str] = []
    if not logfmt:
        _check(failures, "combined_x", lambda: np.testing.assert_array_equal(bits(ours), bits(refs)))
        return failures

    def close():
        # LogFMT-10 keeps about 2**(step/2) relative error per value; allow a few percent of the magnitude
        # of the weighted sum of absolute values (the reference may round a value one code apart).
        a, b = ours.astype(np.float32), refs.astype(np.float32)
        scale = np.abs(b).max(axis=1, keepdims=True) + 1e-3
        err = np.abs(a - b) / scale
        assert float(err.max(initial=0.0)) < 0.05, f"max relative error {float(err.max()):.4f}"

    _check(failures, "combined_x (logfmt)", close)
    return failures


def _round(env, fw, *, seed, t_max, hidden, num_experts, k, n=None, fp8=False, round_scale=False, ue8m0=False,
           logfmt=False, hook=False, zero_copy=False, out=False, stats=False):
    rank, size = env["rank"], env["size"]
    rng = np.random.default_rng(seed * 1000 + rank)
    if n is None:
        n = int(rng.integers(1, t_max + 1))
    x = bf16(rng, (n, hidden))
    topk, weights = _routing(rng, n, num_experts, k)
    ours, refs, handle, r_handle = _dispatch_both(env, fw, x, topk, t_max, num_experts, fp8=fp8,
                                                  round_scale=round_scale, ue8m0=ue8m0, hook=hook, stats=stats)
    failures = _dispatch_failures(ours, refs, fp8=fp8)
    e_local = num_experts // size
    expert_out = _expert_out(rng, refs["count"], e_local, size * t_max, hidden)
    got, want = _combine_both(env, fw, expert_out, topk, weights, handle, r_handle, logfmt=logfmt,
                              zero_copy=zero_copy, hook=hook, out=out)
    failures += _combine_failures(got, want, logfmt=logfmt)
    if stats:
        cum, wait = ours["cum"], ours["wait"]
        _check(failures, "cumulative stats", lambda: np.testing.assert_array_equal(cum, refs["count"]))
        if (wait < 0).any():
            failures.append(f"negative wait times: {wait.tolist()}")
    return failures, ours, got


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
    failures, _, _ = _round(env, fw, seed=hash(case) % 1000 + len(fw), t_max=T_BIG, hidden=hidden, num_experts=experts,
                            k=k, fp8=fp8, round_scale=round_scale, ue8m0=ue8m0)
    _agree(failures)


@pytest.mark.parametrize("n", [1, T_BIG])
def test_token_count_edges(env, n):
    failures, _, _ = _round(env, FRAMEWORKS[0], seed=7 + n, t_max=T_BIG, hidden=4096, num_experts=32, k=8, n=n, fp8=True,
                            round_scale=True)
    _agree(failures)


def test_uneven_tokens_and_tiny_topk(env):
    # Rank-dependent token counts, top-1, hidden not a multiple of 128 (BF16 only).
    rank = env["rank"]
    failures, _, _ = _round(env, FRAMEWORKS[0], seed=3, t_max=T_SMALL, hidden=2056, num_experts=E_SMALL, k=1,
                            n=1 + (rank * 13) % T_SMALL)
    _agree(failures)


@pytest.mark.parametrize("fp8", [False, True])
def test_hook_mode(env, fp8):
    failures, _, _ = _round(env, FRAMEWORKS[-1], seed=11, t_max=T_BIG, hidden=H_BIG, num_experts=E_BIG, k=K_BIG,
                            fp8=fp8, hook=True)
    _agree(failures)


def test_zero_copy_and_out(env):
    failures, _, _ = _round(env, FRAMEWORKS[0], seed=12, t_max=T_BIG, hidden=H_BIG, num_experts=E_BIG, k=K_BIG,
                            fp8=True, zero_copy=True, out=True)
    _agree(failures)


@pytest.mark.parametrize("hidden", [2048, H_BIG])
def test_logfmt(env, hidden):
    experts = E_BIG if hidden == H_BIG else 32
    failures, _, _ = _round(env, FRAMEWORKS[0], seed=13, t_max=T_BIG, hidden=hidden, num_experts=experts, k=K_BIG,
                            fp8=True, logfmt=True)
    _agree(failures)


@pytest.mark.parametrize("fp8", [False, True])
def test_precast_staging(env, fp8):
    """Tokens cast once into the staging area, then copied over NVLink (engine.staged)."""
    engine = env["buf"].runtime.low_latency
    saved, engine.staged = engine.staged, True
    try:
        failures, _, _ = _round(env, FRAMEWORKS[0], seed=17, t_max=T_BIG, hidden=H_BIG, num_experts=E_BIG, k=K_BIG,
                                fp8=fp8, round_scale=fp8)
    finally:
        engine.staged = saved
    _agree(failures)


def test_stats(env):
    failures, _, _ = _round(env, FRAMEWORKS[0], seed=14, t_max=T_BIG, hidden=H_BIG, num_experts=E_BIG, k=K_BIG,
                            fp8=True, stats=True)
    _agree(failures)


def test_two_dispatches_in_flight(env):
    """Two hooked dispatches (both buffer halves), received afterwards, then both combines."""
    buf, ref, rank, size = env["buf"], env["ref"], env["rank"], env["size"]
    fw = FRAMEWORKS[0]
    rng = np.random.default_rng(15 + rank)
    data = []
    for _ in range(2):
        n = int(rng.integers(1, T_BIG + 1))
        x = bf16(rng, (n, H_BIG))
        topk, w = _routing(rng, n, E_BIG, K_BIG)
        data.append((x, topk, w))
    results = []
    for x, topk, _ in data:
        recv, count, handle, _e, hook = buf.low_latency_dispatch(to_dev(x, fw, env), to_dev(topk, fw, env), T_BIG,
                                                                 E_BIG, use_fp8=True, return_recv_hook=True)
        results.append((recv, count, handle, hook))
    for r in results:
        r[3]()
    _sync()
    COMM.Barrier()
    failures = []
    refs = []
    for (x, topk, _), (recv, count, handle, _) in zip(data, results, strict=True):
        r_recv, r_count, r_handle, _ = ref.low_latency_dispatch(
            x, topk, num_max_dispatch_tokens_per_rank=T_BIG, num_experts=E_BIG, use_fp8=True, round_scale=False,
            use_ue8m0=False, cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
            return_recv_hook=False)
        ours = {"count": to_np(count), "src_info": to_np(handle[0]), "layout": to_np(handle[1]),
                "x": to_np(recv[0]), "scales": to_np(recv[1])}
        theirs = {"count": r_count, "src_info": r_handle[0], "layout": r_handle[1], "x": r_recv[0], "scales": r_recv[1]}
        failures += _dispatch_failures(ours, theirs, fp8=True)
        refs.append((r_handle, r_count))
    for (_x, topk, w), (_, _, handle, _), (r_handle, r_count) in zip(data, results, refs, strict=True):
        expert_out = _expert_out(rng, r_count, E_BIG // size, size * T_BIG, H_BIG)
        got, want = _combine_both(env, fw, expert_out, topk, w, handle, r_handle)
        failures += _combine_failures(got, want, logfmt=False)
    _agree(failures)


def test_repeats_are_bit_identical(env):
    """Twenty dispatch + combine rounds of the same inputs: identical hashes (a moving result is a race)."""
    buf, rank, size = env["buf"], env["rank"], env["size"]
    fw = FRAMEWORKS[0]
    rng = np.random.default_rng(16 + rank)
    x = bf16(rng, (T_BIG, H_BIG))
    topk, w = _routing(rng, T_BIG, E_BIG, K_BIG)
    x_dev, topk_dev, w_dev = (to_dev(a, fw, env) for a in (x, topk, w))
    _, count, _, _, _ = buf.low_latency_dispatch(x_dev, topk_dev, T_BIG, E_BIG, use_fp8=True)
    expert_out = _expert_out(rng, to_np(count), E_BIG // size, size * T_BIG, H_BIG)
    eo_dev = to_dev(expert_out, fw, env)
    d_hashes, c_hashes = set(), set()
    for _ in range(20):
        recv, count, handle, _e, _h = buf.low_latency_dispatch(x_dev, topk_dev, T_BIG, E_BIG, use_fp8=True)
        combined, _e, _h = buf.low_latency_combine(eo_dev, topk_dev, w_dev, handle)
        _sync()
        ours = {"count": to_np(count), "src_info": to_np(handle[0]), "layout": to_np(handle[1]),
                "x": to_np(recv[0]), "scales": to_np(recv[1])}
        d_hashes.add(_valid_hash(ours))
        c_hashes.add(hashlib.sha256(bits(to_np(combined)).tobytes()).hexdigest())
    failures = []
    if len(d_hashes) != 1:
        failures.append(f"dispatch results differ across repeats: {len(d_hashes)} distinct hashes")
    if len(c_hashes) != 1:
        failures.append(f"combine results differ across repeats: {len(c_hashes)} distinct hashes")
    _agree(failures)


def test_rma_path(env, monkeypatch):
    """NVSHMEM puts, fences and signals instead of NVLink stores (DEEPEP_CUPY_LL_FORCE_RMA=1)."""
    import deepep_cupy
    from deepep_cupy.reference.backend import ReferenceBackend
    from deepep_cupy.runtime.group import MPIGroup

    monkeypatch.setenv("DEEPEP_CUPY_LL_FORCE_RMA", "1")
    buf = deepep_cupy.Buffer(comm=COMM, num_rdma_bytes=_hint(T_SMALL, H_SMALL, E_SMALL), low_latency_mode=True,
                             explicitly_destroy=True)
    monkeypatch.delenv("DEEPEP_CUPY_LL_FORCE_RMA")
    local = dict(env, buf=buf, ref=ReferenceBackend(MPIGroup(COMM), num_nvl_ranks=env["size"], low_latency_mode=True,
                                                    enable_shrink=False))
    failures = []
    try:
        assert buf.runtime.low_latency.staged
        for i, (fp8, logfmt, zero_copy) in enumerate([(False, False, False), (True, True, False), (True, False, True),
                                                      (True, True, True)]):
            f, _, _ = _round(local, FRAMEWORKS[0], seed=20 + i, t_max=T_SMALL, hidden=H_SMALL, num_experts=E_SMALL,
                             k=8, fp8=fp8, logfmt=logfmt, zero_copy=zero_copy)
            failures += [f"fp8={fp8} logfmt={logfmt} zero_copy={zero_copy}: {m}" for m in f]
    finally:
        _sync()
        COMM.Barrier()
        buf.destroy()
    _agree(failures)


def _small_data(rank, seed):
    rng = np.random.default_rng(seed + rank)
    n = T_SMALL
    x = bf16(rng, (n, H_SMALL))
    topk, w = _routing(rng, n, E_SMALL, 8, masked_slots=0)
    expert_out = bf16(rng, (E_SMALL // COMM.Get_size(), COMM.Get_size() * T_SMALL, H_SMALL), 0.5)
    return x, topk, w, expert_out


def test_shrink_masks_a_silent_rank(env, monkeypatch):
    """The last rank stops calling; the others finish with it masked and match the reference with that mask."""
    import deepep_cupy
    from deepep_cupy.reference.backend import ReferenceBackend
    from deepep_cupy.runtime.group import MPIGroup

    rank, size = env["rank"], env["size"]
    silent = size - 1
    monkeypatch.setenv("DEEPEP_CUPY_TIMEOUT_S", SHORT_TIMEOUT_S)
    buf = deepep_cupy.Buffer(comm=COMM, num_rdma_bytes=_hint(T_SMALL, H_SMALL, E_SMALL), low_latency_mode=True,
                             enable_shrink=True, explicitly_destroy=True)
    ref = ReferenceBackend(MPIGroup(COMM), num_nvl_ranks=size, low_latency_mode=True, enable_shrink=True)
    fw = FRAMEWORKS[0]
    x, topk, w, expert_out = _small_data(rank, 30)
    failures = []
    try:
        if rank != silent:
            t0 = time.time()
            recv, count, handle, _e, _h = buf.low_latency_dispatch(to_dev(x, fw, env), to_dev(topk, fw, env),
                                                                   T_SMALL, E_SMALL, use_fp8=False)
            _sync()
            first = time.time() - t0
            status = to_dev(np.zeros(size, np.int32), fw, env)
            buf.low_latency_query_mask_buffer(status)
            expected_mask = np.zeros(size, np.int32)
            expected_mask[silent] = 1
            _check(failures, "mask after timeout", lambda: np.testing.assert_array_equal(to_np(status), expected_mask))
            combined, _e, _h = buf.low_latency_combine(to_dev(expert_out, fw, env), to_dev(topk, fw, env),
                                                       to_dev(w, fw, env), handle)
            t1 = time.time()
            buf.low_latency_dispatch(to_dev(x, fw, env), to_dev(topk, fw, env), T_SMALL, E_SMALL, use_fp8=False)
            _sync()
            again = time.time() - t1
            if again > 1.0:
                failures.append(f"dispatch after masking still waited {again:.1f} s (first call {first:.1f} s)")
            ours = {"count": to_np(count), "src_info": to_np(handle[0]), "layout": to_np(handle[1]),
                    "x": to_np(recv)}
        # The reference exchange involves every rank; each view masks the silent rank (itself, for it).
        ref.low_latency_update_mask_buffer(silent, True)
        r_recv, r_count, r_handle, _ = ref.low_latency_dispatch(
            x, topk, num_max_dispatch_tokens_per_rank=T_SMALL, num_experts=E_SMALL, use_fp8=False, round_scale=False,
            use_ue8m0=False, cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
            return_recv_hook=False)
        r_combined, _ = ref.low_latency_combine(expert_out, topk, w, r_handle, use_logfmt=False, zero_copy=False,
                                                return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None)
        if rank != silent:
            theirs = {"count": r_count, "src_info": r_handle[0], "layout": r_handle[1], "x": r_recv}
            failures += _dispatch_failures(ours, theirs, fp8=False)
            failures += _combine_failures(to_np(combined), np.asarray(r_combined), logfmt=False)
            buf.low_latency_clean_mask_buffer()
            status = to_dev(np.ones(size, np.int32), fw, env)
            buf.low_latency_query_mask_buffer(status)
            _check(failures, "mask after clean", lambda: np.testing.assert_array_equal(to_np(status), 0))
            buf.low_latency_update_mask_buffer(silent, True)
            buf.low_latency_query_mask_buffer(status)
            _check(failures, "mask after update", lambda: np.testing.assert_array_equal(to_np(status)[silent], 1))
    finally:
        _sync()
        COMM.Barrier()
        buf.destroy()
    _agree(failures)


def test_timeout_without_shrink_raises(env, monkeypatch):
    """Without enable_shrink a silent peer ends the wait with DeepEPTimeoutError (at the next call)."""
    import deepep_cupy
    from deepep_cupy.errors import DeepEPTimeoutError

    rank, size = env["rank"], env["size"]
    silent = size - 1
    monkeypatch.setenv("DEEPEP_CUPY_TIMEOUT_S", SHORT_TIMEOUT_S)
    buf = deepep_cupy.Buffer(comm=COMM, num_rdma_bytes=_hint(T_SMALL, H_SMALL, E_SMALL), low_latency_mode=True,
                             explicitly_destroy=True)
    fw = FRAMEWORKS[0]
    x, topk, _w, _eo = _small_data(rank, 40)
    failures = []
    try:
        if rank != silent:
            buf.low_latency_dispatch(to_dev(x, fw, env), to_dev(topk, fw, env), T_SMALL, E_SMALL, use_fp8=False)
            _sync()
            try:
                buf.low_latency_dispatch(to_dev(x, fw, env), to_dev(topk, fw, env), T_SMALL, E_SMALL, use_fp8=False)
                _sync()
                failures.append("no DeepEPTimeoutError after a peer stayed silent")
            except DeepEPTimeoutError as exc:
                if f"peer {silent}" not in str(exc):
                    failures.append(f"timeout message does not name the peer: {exc}")
    finally:
        _sync()
        COMM.Barrier()
        buf.destroy()
    _agree(failures)


def _ref_round(env, x, topk, w, expert_out_fn):
    """Reference dispatch + combine of one round (collective). expert_out_fn(counts) makes the expert outputs."""
    ref = env["ref"]
    r_recv, r_count, r_handle, _ = ref.low_latency_dispatch(
        x, topk, num_max_dispatch_tokens_per_rank=T_BIG, num_experts=E_BIG, use_fp8=True, round_scale=False,
        use_ue8m0=False, cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
        return_recv_hook=False)
    expert_out = expert_out_fn(np.asarray(r_count))
    r_combined, _ = ref.low_latency_combine(expert_out, topk, w, r_handle, use_logfmt=False, zero_copy=False,
                                            return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None)
    theirs = {"count": r_count, "src_info": r_handle[0], "layout": r_handle[1], "x": r_recv[0], "scales": r_recv[1]}
    return theirs, expert_out, np.asarray(r_combined)


def _kernel_error(env) -> list[str]:
    """A timeout recorded by a kernel that no later call has raised yet (graph replays never check)."""
    from deepep_cupy.errors import DeepEPTimeoutError

    try:
        env["buf"].runtime.low_latency.check_errors()
    except DeepEPTimeoutError as exc:
        return [f"kernel timeout: {exc}"]
    return []


def test_back_to_back_rounds(env):
    """Four dispatch + combine rounds of different data queued with no host synchronisation in between (both
    buffer halves in flight, the peer possibly a round ahead), then all results checked."""
    buf, rank, size = env["buf"], env["rank"], env["size"]
    fw = FRAMEWORKS[0]
    rng = np.random.default_rng(60 + rank)
    rounds = []
    for _ in range(4):
        x = bf16(rng, (T_BIG, H_BIG))
        topk, w = _routing(rng, T_BIG, E_BIG, K_BIG)
        theirs, expert_out, r_combined = _ref_round(
            env, x, topk, w, lambda c: _expert_out(rng, c, E_BIG // size, size * T_BIG, H_BIG))
        rounds.append(((to_dev(x, fw, env), to_dev(topk, fw, env), to_dev(w, fw, env),
                        to_dev(expert_out, fw, env)), theirs, r_combined))
    _sync()
    COMM.Barrier()
    outs = []
    for (x_d, topk_d, w_d, eo_d), _, _ in rounds:
        recv, count, handle, _e, _h = buf.low_latency_dispatch(x_d, topk_d, T_BIG, E_BIG, use_fp8=True)
        combined, _e, _h = buf.low_latency_combine(eo_d, topk_d, w_d, handle)
        outs.append((recv, count, handle, combined))
    _sync()
    failures = _kernel_error(env)
    for i, ((recv, count, handle, combined), (_, theirs, r_combined)) in enumerate(zip(outs, rounds, strict=True)):
        ours = {"count": to_np(count), "src_info": to_np(handle[0]), "layout": to_np(handle[1]),
                "x": to_np(recv[0]), "scales": to_np(recv[1])}
        failures += [f"round {i}: {m}" for m in _dispatch_failures(ours, theirs, fp8=True)]
        failures += [f"round {i}: {m}" for m in _combine_failures(to_np(combined), r_combined, logfmt=False)]
    _agree(failures)


def test_fused_vs_hook_timing(env, record_property):
    """Not a benchmark and asserts nothing: prints the GPU time of a fused dispatch / combine next to the sum
    of its hook parts. A fused op much slower than its parts means the receive phase disturbs the sends
    (the symptom of spinning waits); the numbers land in the test log and the junit properties."""
    import cupy

    buf, rank, size = env["buf"], env["rank"], env["size"]
    fw = FRAMEWORKS[0]
    rng = np.random.default_rng(70 + rank)
    x_d = to_dev(bf16(rng, (T_BIG, H_BIG)), fw, env)
    topk, w = _routing(rng, T_BIG, E_BIG, K_BIG)
    topk_d, w_d = to_dev(topk, fw, env), to_dev(w, fw, env)
    _, count, handle, _e, _h = buf.low_latency_dispatch(x_d, topk_d, T_BIG, E_BIG, use_fp8=True)
    eo_d = to_dev(_expert_out(rng, to_np(count), E_BIG // size, size * T_BIG, H_BIG), fw, env)
    stream = cupy.cuda.get_current_stream()

    def timed(fn, reps=10):
        _sync()
        COMM.Barrier()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(reps):
            fn()
        end.record(stream)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) * 1e3 / reps

    def hooked_dispatch():
        buf.low_latency_dispatch(x_d, topk_d, T_BIG, E_BIG, use_fp8=True, return_recv_hook=True)[4]()

    def hooked_combine():
        buf.low_latency_combine(eo_d, topk_d, w_d, handle, return_recv_hook=True)[2]()

    for _ in range(2):  # warm-up
        timed(lambda: buf.low_latency_dispatch(x_d, topk_d, T_BIG, E_BIG, use_fp8=True), 2)
        timed(lambda: buf.low_latency_combine(eo_d, topk_d, w_d, handle), 2)
        timed(hooked_dispatch, 2)
        timed(hooked_combine, 2)
    got = {
        "dispatch_fused_us": timed(lambda: buf.low_latency_dispatch(x_d, topk_d, T_BIG, E_BIG, use_fp8=True)),
        "dispatch_hook_pair_us": timed(hooked_dispatch),
        "combine_fused_us": timed(lambda: buf.low_latency_combine(eo_d, topk_d, w_d, handle)),
        "combine_hook_pair_us": timed(hooked_combine),
    }
    _sync()
    for k, v in got.items():
        record_property(f"rank{rank}_{k}", round(v, 1))
    print(f"\n[rank {rank}] fused vs hook parts (us, includes launch gaps of the hook pair): "
          + ", ".join(f"{k}={v:.1f}" for k, v in got.items()), flush=True)
    _agree(_kernel_error(env))


def test_cuda_graph(env, monkeypatch):
    """Dispatch + combine captured once into a CUDA graph (after one eager warm-up), then replayed six times,
    each time on fresh inputs copied into the captured arrays: every replay matches the reference, and no
    kernel recorded a timeout (graph replays never raise one by themselves)."""
    import cupy

    from deepep_cupy.interop import copy_into

    if "cupy" not in FRAMEWORKS:
        pytest.skip("needs CuPy bfloat16 arrays")
    monkeypatch.setenv("DEEPEP_CUPY_VALIDATE", "0")
    buf, rank, size = env["buf"], env["rank"], env["size"]
    rng = np.random.default_rng(50 + rank)

    def fresh():
        x = bf16(rng, (T_BIG, H_BIG))
        topk, w = _routing(rng, T_BIG, E_BIG, K_BIG)
        theirs, expert_out, r_combined = _ref_round(
            env, x, topk, w, lambda c: _expert_out(rng, c, E_BIG // size, size * T_BIG, H_BIG))
        return x, topk, w, expert_out, theirs, r_combined

    x, topk, w, expert_out, _, _ = fresh()
    x_dev, topk_dev, w_dev, eo_dev = (to_dev(a, "cupy", env) for a in (x, topk, w, expert_out))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        _, _, handle, _e, _h = buf.low_latency_dispatch(x_dev, topk_dev, T_BIG, E_BIG, use_fp8=True)
        buf.low_latency_combine(eo_dev, topk_dev, w_dev, handle)
    stream.synchronize()
    graph, error = None, None
    try:
        with stream:
            stream.begin_capture()
            try:
                recv, count, handle, _e, _h = buf.low_latency_dispatch(x_dev, topk_dev, T_BIG, E_BIG, use_fp8=True)
                combined, _e, _h = buf.low_latency_combine(eo_dev, topk_dev, w_dev, handle)
            finally:
                graph = stream.end_capture()
    except Exception as exc:  # capture not possible here: skip on every rank together
        error = f"{type(exc).__name__}: {exc}"
    errors = COMM.allgather(error)
    if any(errors):
        pytest.skip(f"stream capture failed: {[e for e in errors if e]}")
    failures = []
    for replay in range(6):
        x, topk, w, expert_out, theirs, r_combined = fresh()
        with stream:  # in place: the graph holds these pointers
            copy_into(x_dev, x)
            copy_into(topk_dev, topk)
            copy_into(w_dev, w)
            copy_into(eo_dev, expert_out)
            graph.launch(stream)
        stream.synchronize()
        failures += [f"replay {replay}: {m}" for m in _kernel_error(env)]
        ours = {"count": to_np(count), "src_info": to_np(handle[0]), "layout": to_np(handle[1]),
                "x": to_np(recv[0]), "scales": to_np(recv[1])}
        failures += [f"replay {replay}: {m}" for m in _dispatch_failures(ours, theirs, fp8=True)]
        failures += [f"replay {replay}: {m}" for m in _combine_failures(to_np(combined), r_combined, logfmt=False)]
    # Back to back, no host work in between: the last replay's results must still be right.
    for _ in range(4):
        graph.launch(stream)
    stream.synchronize()
    failures += [f"4 replays back to back: {m}" for m in _kernel_error(env)]
    failures += [f"4 replays back to back: {m}"
                 for m in _combine_failures(to_np(combined), r_combined, logfmt=False)]
    _agree(failures)
