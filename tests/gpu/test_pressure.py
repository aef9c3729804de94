"""Many short rounds through the public ``deepep_cupy.Buffer`` API, to shake out races and state leaks: every
round has fresh random data, runs twice on the same inputs (the two runs must be bit-identical, LogFMT
included: the kernels are deterministic) and is compared with the NumPy reference backend.

Run on every rank:  mpirun -np 2 python -m pytest tests/gpu/test_pressure.py -q
``DEEPEP_CUPY_SOAK=N`` multiplies the 200 rounds of each test by N for a longer soak;
``DEEPEP_CUPY_SEED`` changes the data. Low-latency rounds cycle through every mix of format (BF16, FP8,
FP8 + round_scale, FP8 + UE8M0), hooks, LogFMT, zero-copy and ``out=``, mostly at a small shape and every
twentieth round at DeepEP's (128 tokens, 7168, top-8 of 288); ``cumulative_local_expert_recv_stats`` must
hold exactly the sum of every dispatch's counts. Intranode rounds cycle through BF16 / FP8,
``num_worst_tokens`` and a cached re-dispatch. Skips like the other GPU tests; both tests together are
meant to take well under a minute on 2 x H200 at the default length.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time

import numpy as np
import pytest
from gpu_common import (
    BF16,
    FP8,
    MULTI_RANK_GPU,
    agree,
    bf16,
    bits,
    check,
    sync,
    to_dev,
    to_np,
    together,
    with_reference_buffer,
)
from ll_common import (
    E_BIG,
    FRAMEWORKS,
    H_BIG,
    K_BIG,
    NEEDS_NVSHMEM,
    T_BIG,
    combine_failures,
    dispatch_failures,
    make_expert_out,
    routing,
    valid_hash,
    valid_rows,
)

pytestmark = [*MULTI_RANK_GPU, pytest.mark.skipif(not FRAMEWORKS, reason="needs torch with CUDA or CuPy bfloat16")]

ROUNDS = 200 * max(1, int(os.environ.get("DEEPEP_CUPY_SOAK", "1")))
SEED = int(os.environ.get("DEEPEP_CUPY_SEED", "0"))
FW = FRAMEWORKS[0] if FRAMEWORKS else None
# Low latency: (T, hidden, experts, top-k); the small shape shares its kernels with test_low_latency.py.
LL_SMALL = (32, 2048, 32, 8)
LL_BIG = (T_BIG, H_BIG, E_BIG, K_BIG)
BIG_EVERY = 20
FORMATS = [dict(use_fp8=False), dict(use_fp8=True), dict(use_fp8=True, round_scale=True),
           dict(use_fp8=True, round_scale=True, use_ue8m0=True)]
# (dispatch format, hooks, logfmt, zero_copy, out): all 64 mixes, in a fixed shuffled order.
LL_MIXES = list(itertools.product(range(len(FORMATS)), (False, True), (False, True), (False, True), (False, True)))
LL_ORDER = np.random.default_rng(12345).permutation(len(LL_MIXES))
# Intranode: at most this many tokens per rank, hidden, experts, top-k.
NT_MAX, NT_HIDDEN, NT_EXPERTS, NT_TOPK = 256, 2048, 32, 4
NT_MIXES = list(itertools.product((False, True), (False, True), (False, True)))  # fp8, worst tokens, cached
# The env fixture's oracle and the ll / nvl fixtures' Buffers (conftest.py).
ENV = with_reference_buffer
LL_SHAPES = [LL_SMALL[:3], LL_BIG[:3]]
NVL_HIDDEN = NT_HIDDEN


def _fp8_ok() -> bool:
    """FP8 tokens need torch, or a CuPy that holds float8_e4m3fn arrays (else those rounds run in BF16)."""
    if FW != "cupy":
        return FW is not None
    from deepep_cupy.frameworks import cupy_holds

    return cupy_holds(FP8)


FP8_OK = _fp8_ok()


# ------------------------------------------------------------------------------------------- helpers
def _copy(dst, src) -> None:
    """Device-to-device copy of BF16 arrays in the test's framework."""
    if FW == "torch":
        dst.copy_(src)
    else:
        dst.view(np.uint16)[...] = src.view(np.uint16)


def _digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(bits(np.asarray(a))).tobytes())
    return h.hexdigest()


def _seeded(*keys):
    return np.random.default_rng([SEED, *keys])


# ------------------------------------------------------------------------------------------- low latency
class _LLShape:
    """Device state kept per low-latency shape across rounds: the expert-output slab (rows past the counts
    keep older rounds' values, which a correct combine never reads), the stats tensors and their expected
    values."""

    def __init__(self, env, shape):
        t, hidden, experts, _k = shape
        size = env["size"]
        self.shape, self.e_local = shape, experts // size
        self.slab = to_dev(np.zeros((self.e_local, size * t, hidden), BF16), FW, env)
        self.cum = to_dev(np.zeros(self.e_local, np.int32), FW, env)
        self.wait = to_dev(np.zeros(size, np.int64), FW, env)
        self.expected_cum = np.zeros(self.e_local, np.int64)
        self.last_wait = np.zeros(size, np.int64)

    def fill(self, env, expert_out, counts) -> None:
        for i, c in enumerate(np.asarray(counts).tolist()):
            if c:
                _copy(self.slab[i, :c], to_dev(expert_out[i, :c], FW, env))


def _ll_run(buf, env, state, x, topk, w, fmt, *, hook, logfmt, zero_copy, out):
    """One low-latency dispatch + combine on the GPU; results as NumPy (read before the next run, as two
    buffer halves hold at most two results)."""
    t, _hidden, experts, _k = state.shape
    x_d, topk_d, w_d = (to_dev(a, FW, env) for a in (x, topk, w))
    recv, count, handle, _event, recv_hook = buf.low_latency_dispatch(
        x_d, topk_d, t, experts, cumulative_local_expert_recv_stats=state.cum,
        dispatch_wait_recv_cost_stats=state.wait, return_recv_hook=hook, **fmt)
    if hook:
        recv_hook()
    sync()
    got = {"count": to_np(count), "src_info": to_np(handle[0]), "layout": to_np(handle[1])}
    if fmt["use_fp8"]:
        got["x"], got["scales"] = valid_rows(recv[0], got["count"]), valid_rows(recv[1], got["count"])
    else:
        got["x"] = valid_rows(recv, got["count"])
    src = state.slab
    if zero_copy:
        src = buf.get_next_low_latency_combine_buffer(handle)
        _copy(src, state.slab)
    out_d = to_dev(np.full((x.shape[0], x.shape[1]), np.nan, BF16), FW, env) if out else None
    combined, _event, recv_hook = buf.low_latency_combine(src, topk_d, w_d, handle, use_logfmt=logfmt,
                                                          zero_copy=zero_copy, return_recv_hook=hook, out=out_d)
    if hook:
        recv_hook()
    sync()
    got["combined"] = to_np(combined)
    return got


def _ll_round(buf, env, states, r) -> list[str]:
    rank, ref = env["rank"], env["ref"]
    shape = LL_BIG if r % BIG_EVERY == BIG_EVERY - 1 else LL_SMALL
    t, hidden, experts, k = shape
    fmt_i, hook, logfmt, zero_copy, out = LL_MIXES[LL_ORDER[r % len(LL_MIXES)]]
    fmt = FORMATS[fmt_i]
    fp8 = fmt["use_fp8"]
    tag = f"round {r} ({'big' if shape == LL_BIG else 'small'}, {fmt}, hook={hook}, logfmt={logfmt}, " \
          f"zero_copy={zero_copy}, out={out})"
    rng = _seeded(1, r, rank)
    n = int(rng.integers(1, t + 1))
    x = bf16(rng, (n, hidden))
    topk, w = routing(rng, n, experts, k, empty_tokens=1)
    r_recv, r_count, r_handle, _e, _h = ref.low_latency_dispatch(x, topk, t, experts, **fmt)
    want = {"count": np.asarray(r_count), "src_info": np.asarray(r_handle[0]), "layout": np.asarray(r_handle[1])}
    if fp8:
        want["x"], want["scales"] = np.asarray(r_recv[0]), np.asarray(r_recv[1])
    else:
        want["x"] = np.asarray(r_recv)
    state = states.get(shape)
    if state is None:
        state = states[shape] = _LLShape(env, shape)
    expert_out = make_expert_out(rng, want["count"], state.e_local, env["size"] * t, hidden)
    want["combined"] = np.asarray(ref.low_latency_combine(expert_out, topk, w, r_handle, use_logfmt=logfmt)[0])

    def gpu():
        state.fill(env, expert_out, want["count"])
        runs = [_ll_run(buf, env, state, x, topk, w, fmt, hook=hook, logfmt=logfmt, zero_copy=zero_copy, out=out)
                for _ in range(2)]
        return runs, to_np(state.cum), to_np(state.wait)

    (first, second), cum, wait = together(gpu)
    failures = [f"{tag}: {m}" for m in dispatch_failures(first, want, fp8=fp8)]
    failures += [f"{tag}: {m}" for m in combine_failures(first["combined"], want["combined"], logfmt=logfmt)]
    if valid_hash(first) != valid_hash(second):
        failures += [f"{tag}: the two runs differ: {m}" for m in dispatch_failures(second, first, fp8=fp8)]
    if _digest(first["combined"]) != _digest(second["combined"]):
        failures.append(f"{tag}: the two runs' combined_x differ")
    state.expected_cum += 2 * want["count"]
    check(failures, f"{tag}: cumulative_local_expert_recv_stats",
          lambda: np.testing.assert_array_equal(cum, state.expected_cum))
    if (wait < state.last_wait).any():
        failures.append(f"{tag}: dispatch_wait_recv_cost_stats went down: {state.last_wait.tolist()} -> "
                        f"{wait.tolist()}")
    state.last_wait = wait
    return failures


@NEEDS_NVSHMEM
def test_low_latency_rounds(env, ll):
    """ROUNDS low-latency rounds through every flag mix, each run twice and compared with the reference."""
    start = time.time()
    states: dict = {}
    for r in range(ROUNDS):
        agree(_ll_round(ll, env, states, r))
    if env["rank"] == 0:
        print(f"\n{ROUNDS} low-latency rounds in {time.time() - start:.1f} s", flush=True)


# ------------------------------------------------------------------------------------------- intranode
def _fp8_tokens(rng, n, hidden):
    """Random finite e4m3 bytes and per-128-channel scales."""
    raw = rng.integers(0, 0x7F, size=(n, hidden), dtype=np.uint8) | (rng.integers(0, 2, (n, hidden), dtype=np.uint8) << 7)
    return raw.view(FP8), rng.random((n, hidden // 128), dtype=np.float32) + 0.5


def _nt_results(recv, recv_idx, recv_w, counts, handle, cached, combined, combined_w, num_recv, fp8):
    if fp8:
        data = {"recv_x": to_np(recv[0])[:num_recv], "recv_scales": to_np(recv[1])[:num_recv]}
    else:
        data = {"recv_x": to_np(recv)[:num_recv]}
    data.update({"recv_idx": to_np(recv_idx), "recv_w": to_np(recv_w), "counts": np.asarray(counts, np.int64),
                 "combined": to_np(combined), "combined_w": to_np(combined_w)})
    data.update({f"handle[{i}]": to_np(h) for i, h in enumerate(handle)})
    if cached is not None:
        data["cached_x"] = to_np(cached[0] if fp8 else cached)[:num_recv]
        if fp8:
            data["cached_scales"] = to_np(cached[1])[:num_recv]
    return data


def _nt_round(nvl, env, r) -> list[str]:
    buf, dcfg, ccfg = nvl
    rank, size, ref = env["rank"], env["size"], env["ref"]
    fp8, worst_on, cached = NT_MIXES[r % len(NT_MIXES)]
    fp8 = fp8 and FP8_OK
    tag = f"round {r} (fp8={fp8}, num_worst_tokens={worst_on}, cached={cached})"
    rng = _seeded(2, r, rank)
    n = int(rng.integers(0, NT_MAX + 1))
    worst = NT_MAX * size if worst_on else 0
    topk, w = routing(rng, n, NT_EXPERTS, NT_TOPK, masked_slots=20, empty_tokens=2)
    x = _fp8_tokens(rng, n, NT_HIDDEN) if fp8 else bf16(rng, (n, NT_HIDDEN))
    x2 = (_fp8_tokens(rng, n, NT_HIDDEN) if fp8 else bf16(rng, (n, NT_HIDDEN))) if cached else None

    r_rank, _rdma, r_expert, r_in, _e = ref.get_dispatch_layout(topk, NT_EXPERTS)
    r_recv, r_idx, r_w, r_counts, r_handle, _e = ref.dispatch(
        x, num_tokens_per_rank=r_rank, is_token_in_rank=r_in, num_tokens_per_expert=r_expert, topk_idx=topk,
        topk_weights=w, num_worst_tokens=worst, config=dcfg)
    r_cached = ref.dispatch(x2, handle=r_handle, config=dcfg)[0] if cached else None
    num_recv = int(np.asarray(r_handle[0])[size - 1, rank])
    rows = worst if worst else num_recv
    y = bf16(rng, (rows, NT_HIDDEN), 0.5)
    r_comb, r_comb_w, _e = ref.combine(y, r_handle, topk_weights=r_w, config=ccfg)
    want = _nt_results(r_recv, r_idx, r_w, r_counts, r_handle, r_cached, r_comb, r_comb_w, num_recv, fp8)

    def dev(a):
        return tuple(to_dev(v, FW, env) for v in a) if isinstance(a, tuple) else to_dev(a, FW, env)

    def run():
        topk_d = dev(topk)
        per_rank, _rdma, per_expert, in_rank, _e = buf.get_dispatch_layout(topk_d, NT_EXPERTS)
        recv, recv_idx, recv_w, counts, handle, _e = buf.dispatch(
            dev(x), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_d, topk_weights=dev(w), num_worst_tokens=worst, config=dcfg)
        again = buf.dispatch(dev(x2), handle=handle, config=dcfg)[0] if cached else None
        combined, combined_w, _e = buf.combine(dev(y), handle, topk_weights=recv_w, config=ccfg)
        sync()
        return _nt_results(recv, recv_idx, recv_w, counts, handle, again, combined, combined_w, num_recv, fp8)

    first, second = together(lambda: [run() for _ in range(2)])
    failures = []
    for key, value in want.items():
        if key == "combined":
            a, b = first[key].astype(np.float32), value.astype(np.float32)
            check(failures, f"{tag}: combined_x",
                  lambda a=a, b=b: np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2))
            exact = float(np.mean(bits(first[key]) == bits(value))) if value.size else 1.0
            if exact <= 0.999:
                failures.append(f"{tag}: only {exact:.4%} of combined_x is bit-identical to the reference")
        elif key == "combined_w":
            check(failures, f"{tag}: combined_topk_weights",
                  lambda v=value: np.testing.assert_allclose(first["combined_w"], v, rtol=1e-6, atol=1e-6))
        else:
            check(failures, f"{tag}: {key}",
                  lambda k=key, v=value: np.testing.assert_array_equal(bits(first[k]), bits(v)))
    if _digest(*first.values()) != _digest(*second.values()):
        failures += [f"{tag}: the two runs differ in {k}" for k in first
                     if _digest(first[k]) != _digest(second[k])]
    return failures


def test_intranode_rounds(env, nvl):
    """ROUNDS intranode layout + dispatch (+ cached dispatch) + combine rounds, each run twice and compared
    with the reference."""
    start = time.time()
    for r in range(ROUNDS):
        agree(_nt_round(nvl, env, r))
    if env["rank"] == 0:
        print(f"\n{ROUNDS} intranode rounds in {time.time() - start:.1f} s", flush=True)
