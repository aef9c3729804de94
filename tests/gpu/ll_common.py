"""What the low-latency GPU test files share: marks, the workload shapes, the ``env`` of the modules that
test the engine itself, and one dispatch + combine round compared with the NumPy reference backend.

Imported by test_low_latency*.py, test_handle_values.py, test_pressure.py and test_torch_graphs*.py (pytest
puts this folder on ``sys.path``). Every helper that runs a kernel or the reference is collective: all ranks
call it in the same order with the same shapes (data differs per rank).
"""

from __future__ import annotations

import contextlib
import hashlib

import numpy as np
import pytest
from gpu_common import (
    BF16,
    COMM,
    MULTI_RANK_GPU,
    bf16,
    bits,
    check,
    collective_buffer,
    frameworks,
    sync,
    to_dev,
    to_np,
    with_wait_budget,
)
from reference_cases import ll_combine, ll_dispatch


def have_nvshmem4py() -> bool:
    try:
        import nvshmem.core  # noqa: F401
    except Exception:
        return False
    return True


NEEDS_NVSHMEM = pytest.mark.skipif(not have_nvshmem4py(), reason="needs nvshmem4py (pip install nvshmem4py-cu13)")
#: The marks of a low-latency test: GPUs, two or more MPI ranks, nvshmem4py.
LL_MARKS = [*MULTI_RANK_GPU, NEEDS_NVSHMEM]

#: The kernels' wait budget of the tests where a peer stays silent on purpose.
SHORT_TIMEOUT_S = "2"
# The DeepEP workload (its tests/test_low_latency.py): 128 tokens, hidden 7168, top-8 of 288 experts.
T_BIG, H_BIG, E_BIG, K_BIG = 128, 7168, 288, 8
T_SMALL, H_SMALL, E_SMALL = 32, 2048, 16
#: The frameworks of the low-latency tests: every case of theirs has BF16 tokens.
FRAMEWORKS = frameworks(BF16)


# ------------------------------------------------------------------------------------------- helpers
def routing(rng, n, num_experts, k, masked_slots=10, empty_tokens=0):
    """Top-k of random scores (distinct experts per token), ``masked_slots`` random slots set to -1, and
    ``empty_tokens`` random tokens that select no expert at all; plus float32 weights."""
    scores = np.abs(rng.standard_normal((n, num_experts))).astype(np.float32) + 1
    topk = np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int64)
    for _ in range(min(masked_slots, n)):
        topk[rng.integers(n), rng.integers(k)] = -1
    weights = rng.random((n, k), dtype=np.float32)
    if empty_tokens and n:
        topk[rng.choice(n, min(empty_tokens, n), replace=False)] = -1
    return topk, weights


def make_expert_out(rng, counts, e_local, slab, hidden):
    """Expert outputs [E_local, R*T, H]: random rows where the dispatch put rows, zeros elsewhere (filling
    the whole slab would cost seconds for the DeepEP shape and is never read)."""
    out = np.zeros((e_local, slab, hidden), BF16)
    for i, c in enumerate(np.asarray(counts).tolist()):
        out[i, :c] = bf16(rng, (c, hidden), 0.5)
    return out


def hint(t, h, e):
    import deepep_cupy

    return deepep_cupy.Buffer.get_low_latency_rdma_size_hint(t, h, COMM.Get_size(), e)


def reference_oracle(*, enable_shrink=False):
    """The NumPy reference backend in low-latency mode over the MPI world (collective)."""
    from deepep_cupy.device.group import MPIGroup
    from deepep_cupy.reference.oracle import ReferenceOracle

    return ReferenceOracle(MPIGroup(COMM), num_nvl_ranks=COMM.Get_size(), low_latency_mode=True,
                           enable_shrink=enable_shrink)


# ------------------------------------------------------------------------------------------- env
@contextlib.contextmanager
def with_low_latency_buffer(state):
    """``ENV`` of the modules that test the low-latency engine itself: the kernels' wait budget at the
    suite's, ``state["buf"]`` a low-latency Buffer sized for every shape used here and ``state["ref"]`` the
    NumPy reference backend."""
    # The largest buffer first: NVSHMEM sizes its symmetric heap from the first request.
    num_bytes = max(hint(T_BIG, H_BIG, E_BIG), hint(T_BIG, 4096, 32), hint(T_SMALL, H_SMALL, E_SMALL))
    with with_wait_budget(state), collective_buffer(num_rdma_bytes=num_bytes, low_latency_mode=True,
                                                    num_qps_per_rank=E_BIG // state["size"]) as buf:
        state["buf"], state["ref"] = buf, reference_oracle()
        yield


def engine_paths(env, run, **paths):
    """Run ``run()`` with engine path attributes set (staged, per_expert), on plans made for them; the
    Buffer's plans are dropped before and after, since a plan keeps the paths it was made with."""
    buf = env["buf"]
    engine = buf.runtime.low_latency
    saved = {name: getattr(engine, name) for name in paths}
    buf._ll_dispatch_plans.clear()
    buf._ll_combine_plans.clear()
    try:
        for name, value in paths.items():
            setattr(engine, name, value)
        return run()
    finally:
        for name, value in saved.items():
            setattr(engine, name, value)
        buf._ll_dispatch_plans.clear()
        buf._ll_combine_plans.clear()


# ------------------------------------------------------------------------------------------- one round
def dispatch_both(env, fw, x, topk, t_max, num_experts, *, fp8, round_scale=False, ue8m0=False, hook=False,
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
    sync()
    r_recv, r_count, r_handle, _ = ll_dispatch(ref, x, topk, num_experts, num_max_dispatch_tokens_per_rank=t_max, **kw)
    ours, refs = dispatch_arrays(recv, count, handle), dispatch_arrays(r_recv, r_count, r_handle)
    if stats:
        ours["cum"], ours["wait"] = to_np(cum), to_np(wait)
    return ours, refs, handle, r_handle


def dispatch_arrays(recv, count, handle) -> dict:
    """A low-latency dispatch's outputs (the GPU's or the reference's) as NumPy, keyed as dispatch_failures
    compares them: ``recv`` is the received rows, or ``(rows, scales)`` in FP8."""
    out = {"count": to_np(count), "src_info": to_np(handle[0]), "layout": to_np(handle[1])}
    if isinstance(recv, (tuple, list)):
        out["x"], out["scales"] = to_np(recv[0]), to_np(recv[1])
    else:
        out["x"] = to_np(recv)
    return out


def dispatch_failures(ours, refs, *, fp8) -> list[str]:
    failures: list[str] = []
    check(failures, "recv_count", lambda: np.testing.assert_array_equal(ours["count"], refs["count"]))
    check(failures, "layout_range", lambda: np.testing.assert_array_equal(ours["layout"], refs["layout"]))
    check(failures, "src_info", lambda: np.testing.assert_array_equal(ours["src_info"], refs["src_info"]))
    if failures:
        return failures
    for i, c in enumerate(refs["count"].tolist()):
        check(failures, f"recv_x[{i}]",
              lambda i=i, c=c: np.testing.assert_array_equal(bits(ours["x"][i, :c]), bits(refs["x"][i, :c])))
        if fp8:
            check(failures, f"scales[{i}]",
                  lambda i=i, c=c: np.testing.assert_array_equal(ours["scales"][i, :c], refs["scales"][i, :c]))
        if failures:
            break
    return failures


def valid_hash(ours) -> str:
    h = hashlib.sha256()
    for i, c in enumerate(ours["count"].tolist()):
        h.update(bits(ours["x"][i, :c]).tobytes())
        if "scales" in ours:
            h.update(np.ascontiguousarray(ours["scales"][i, :c]).tobytes())
    h.update(ours["src_info"].tobytes())
    h.update(ours["layout"].tobytes())
    return h.hexdigest()


def combine_both(env, fw, expert_out, topk, weights, handle, r_handle, *, logfmt=False, zero_copy=False, hook=False,
                 out=False):
    buf, ref = env["buf"], env["ref"]
    if zero_copy:
        target = buf.get_next_low_latency_combine_buffer(handle)
        from deepep_cupy.frameworks import copy_into

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
    sync()
    r_combined, _ = ll_combine(ref, expert_out, topk, weights, r_handle, use_logfmt=logfmt)
    return to_np(combined), np.asarray(r_combined)


def combine_failures(ours, refs, *, logfmt, logfmt_exact=None, expert_out=None, topk=None, weights=None) -> list[str]:
    """BF16: bit for bit. LogFMT: within its tolerance and, with ``logfmt_exact``, at least that share of the
    values bit for bit (the partial-sum path encodes the reference's parts; the SFU log2 / exp2 move a
    rare value by one code or one bf16 step, while per-expert rows or a plain sum match ~30% of values)."""
    failures: list[str] = []
    if not logfmt:
        check(failures, "combined_x", lambda: np.testing.assert_array_equal(bits(ours), bits(refs)))
        return failures
    if logfmt_exact is not None:
        def exact():
            share = float(np.mean(bits(ours) == bits(refs))) if refs.size else 1.0
            assert share >= logfmt_exact, f"{share:.4f} of the values bit for bit, want >= {logfmt_exact}"

        check(failures, "combined_x (logfmt, bits)", exact)

    def close():
        # LogFMT-10 keeps about 2**(step/2) relative error per value; allow a few percent of the magnitude
        # of the weighted sum of absolute values (the reference may round a value one code apart).
        a, b = ours.astype(np.float32), refs.astype(np.float32)
        scale = np.abs(b).max(axis=1, keepdims=True) + 1e-3
        err = np.abs(a - b) / scale
        assert float(err.max(initial=0.0)) < 0.05, f"max relative error {float(err.max()):.4f}"

    check(failures, "combined_x (logfmt)", close)
    return failures


def run_round(env, fw, *, seed, t_max, hidden, num_experts, k, n=None, fp8=False, round_scale=False, ue8m0=False,
              logfmt=False, logfmt_exact=None, hook=False, zero_copy=False, out=False, stats=False,
              rebuild_handle=False):
    """One dispatch + combine against the reference; ``rebuild_handle`` gives the combine the handle as a plain
    tuple, as a caller that rebuilt it would (it then carries no row map from the dispatch)."""
    rank, size = env["rank"], env["size"]
    rng = np.random.default_rng(seed * 1000 + rank)
    if n is None:
        n = int(rng.integers(1, t_max + 1))
    x = bf16(rng, (n, hidden))
    topk, weights = routing(rng, n, num_experts, k)
    ours, refs, handle, r_handle = dispatch_both(env, fw, x, topk, t_max, num_experts, fp8=fp8,
                                                 round_scale=round_scale, ue8m0=ue8m0, hook=hook, stats=stats)
    failures = dispatch_failures(ours, refs, fp8=fp8)
    e_local = num_experts // size
    expert_out = make_expert_out(rng, refs["count"], e_local, size * t_max, hidden)
    if rebuild_handle:
        handle = tuple(handle)
    got, want = combine_both(env, fw, expert_out, topk, weights, handle, r_handle, logfmt=logfmt,
                             zero_copy=zero_copy, hook=hook, out=out)
    failures += combine_failures(got, want, logfmt=logfmt, logfmt_exact=logfmt_exact)
    if stats:
        cum, wait = ours["cum"], ours["wait"]
        check(failures, "cumulative stats", lambda: np.testing.assert_array_equal(cum, refs["count"]))
        if (wait < 0).any():
            failures.append(f"negative wait times: {wait.tolist()}")
    return failures, ours, got


def small_data(rank, seed):
    rng = np.random.default_rng(seed + rank)
    n = T_SMALL
    x = bf16(rng, (n, H_SMALL))
    topk, w = routing(rng, n, E_SMALL, 8, masked_slots=0)
    expert_out = bf16(rng, (E_SMALL // COMM.Get_size(), COMM.Get_size() * T_SMALL, H_SMALL), 0.5)
    return x, topk, w, expert_out


def ref_round(env, x, topk, w, expert_out_fn):
    """Reference dispatch + combine of one round (collective). expert_out_fn(counts) makes the expert outputs."""
    ref = env["ref"]
    r_recv, r_count, r_handle, _ = ll_dispatch(ref, x, topk, E_BIG, num_max_dispatch_tokens_per_rank=T_BIG,
                                               use_fp8=True)
    expert_out = expert_out_fn(np.asarray(r_count))
    r_combined, _ = ll_combine(ref, expert_out, topk, w, r_handle)
    return dispatch_arrays(r_recv, r_count, r_handle), expert_out, np.asarray(r_combined)


def kernel_error(env) -> list[str]:
    """A timeout recorded by a kernel that no later call has raised yet (graph replays never check)."""
    from deepep_cupy.errors import DeepEPTimeoutError

    try:
        env["buf"].runtime.low_latency.check_errors()
    except DeepEPTimeoutError as exc:
        return [f"kernel timeout: {exc}"]
    return []


def valid_rows(recv, count_np):
    """``recv`` ([E_local, R*T, ...] on the device) as NumPy, cut after the most rows any expert holds:
    only rows below the counts are ever compared, and copying the whole slab to the host costs time."""
    m = int(np.clip(np.max(count_np, initial=0), 0, recv.shape[1]))
    return to_np(recv[:, :m])
