"""What the framework call-pattern tests share: random per-rank inputs every rank can rebuild, the dense oracle,
and the checks.

The scenarios (``fw_megatron.py``, ``fw_serving.py``) run on every rank with a process group (thread ranks
in tests/unit, gloo groups under mpiexec in tests/mpi, CUDA tensors in tests/gpu). Rank ``r``'s inputs come
from seeds ``[seed, r, ...]``, so a rank rebuilds any other rank's inputs to know what it must receive; the
oracle of a token's combined output needs only that token's own inputs (float64, dense).
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np

#: Tokens per rank by rank index (modulo its length): different on every rank, none on one of four.
SIZES = (24, 9, 0, 31)


def torch():
    import torch as t

    return t


@contextlib.contextmanager
def deep_ep_alias():
    """``import deep_ep`` gives deepep_cupy inside the block, as ``as_deep_ep()`` makes it (undone at exit
    unless the alias was already in place); yields the ``deep_ep`` module. The process-wide SM count that
    frameworks set (``Buffer.set_num_sms``) is restored at exit too."""
    import deepep_cupy
    from deepep_cupy import alias

    before = (list(sys.meta_path), alias._requested, sys.modules.get("deep_ep"))
    module = deepep_cupy.as_deep_ep()
    sms = (module.Buffer.num_sms, module.Buffer._num_sms_set)
    try:
        yield module
    finally:
        module.Buffer.num_sms, module.Buffer._num_sms_set = sms
        if before[2] is None:
            sys.meta_path[:] = before[0]
            alias._requested = before[1]
            for name in [n for n in sys.modules if n == "deep_ep" or n.startswith("deep_ep.")]:
                del sys.modules[name]


def group_size(group) -> int:
    """Ranks of a torch ProcessGroup (``size()``) or of an in-process test group (``size``)."""
    size = group.size
    return int(size() if callable(size) else size)


def num_tokens(rank: int) -> int:
    return SIZES[rank % len(SIZES)]


def rng(seed: int, rank: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, rank, stream])


def tokens(seed: int, rank: int, n: int, hidden: int) -> np.ndarray:
    """Random float32 tokens, exactly representable in bf16 (never all zero)."""
    x = rng(seed, rank, 0).standard_normal((n, hidden)).astype(np.float32)
    return bf16_round(x)


def bf16_round(a: np.ndarray) -> np.ndarray:
    t = torch()
    return t.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(t.bfloat16).float().numpy()


def routing(seed: int, rank: int, n: int, num_experts: int, k: int, *, skip_experts=(), holes: bool = True):
    """Distinct experts per token (never those in ``skip_experts``), float32 weights in [0.1, 1.1), and about
    a fifth of the slots set to -1 (``holes``)."""
    g = rng(seed, rank, 1)
    scores = g.random((n, num_experts)) + 0.1
    scores[:, list(skip_experts)] = 0
    idx = np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int64)
    weights = (g.random((n, k)) + 0.1).astype(np.float32)
    if holes and n:
        idx[g.random((n, k)) < 0.2] = -1
    return idx, weights


def expert_scales(seed: int, num_experts: int) -> np.ndarray:
    """Expert ``e`` multiplies its tokens by ``scales[e]`` (the same table on every rank)."""
    return 0.5 + rng(seed, 10_000, 2).random(num_experts)


def weighted_sum(x: np.ndarray, idx: np.ndarray, weights: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The dense MoE output of each token: ``sum_k w_k * scales[e_k] * x`` over its valid slots (float64)."""
    factor = np.where(idx >= 0, weights.astype(np.float64) * scales[np.maximum(idx, 0)], 0.0).sum(axis=1)
    return x.astype(np.float64) * factor[:, None]


def partial_factors(got: np.ndarray, x: np.ndarray, idx: np.ndarray, weights: np.ndarray, scales: np.ndarray,
                    num_local: int, size: int) -> str:
    """For a combine whose tokens are ``x`` times a factor (``weighted_sum``): which part of each wrong token's
    factor the result holds. A line per wrong token (the first four): the factor found, the whole one, and
    the part from each rank's experts, so that a missing rank (a receive that read before a peer's data
    landed) shows as the factor of the other ranks alone."""
    x64, got64 = x.astype(np.float64), np.asarray(got, np.float64)
    owner = rank_of_expert(idx, num_local)
    terms = np.where(idx >= 0, weights.astype(np.float64) * scales[np.maximum(idx, 0)], 0.0)
    lines = []
    for t in np.flatnonzero(np.abs(got64 - x64 * terms.sum(axis=1)[:, None]).max(axis=1) > 0.05 * np.abs(x64).max())[:4]:
        j = int(np.argmax(np.abs(x64[t])))
        found = got64[t, j] / x64[t, j] if x64[t, j] else float("nan")
        parts = ", ".join(f"rank {r} {terms[t][owner[t] == r].sum():.4f}" for r in range(size))
        lines.append(f"token {int(t)}: factor {found:.4f}, want {terms[t].sum():.4f} ({parts})")
    return "; ".join(lines)


def rank_of_expert(idx: np.ndarray, num_local: int) -> np.ndarray:
    return np.where(idx >= 0, idx // num_local, -1)


def expected_rows(all_x, all_idx, me: int, num_local: int) -> np.ndarray:
    """What a normal dispatch brings to rank ``me``: every source's tokens with an expert there, by source
    rank, in token order."""
    rows = [x[(rank_of_expert(idx, num_local) == me).any(axis=1)] for x, idx in zip(all_x, all_idx, strict=True)]
    return np.concatenate(rows) if rows else np.zeros((0, 0), np.float32)


def to_np(t) -> np.ndarray:
    """A torch tensor (any device, bf16 included) as float32 NumPy (int tensors keep their dtype)."""
    tt = torch()
    t = t.detach().cpu()
    if t.dtype in (tt.bfloat16, tt.float16, tt.float8_e4m3fn):
        t = t.float()
    return t.numpy()


def close(got, want, what: str, rtol: float = 2e-2, atol: float = 2e-3) -> None:
    """bf16 results against the float64 oracle: within ``rtol`` of each value plus ``atol`` of the largest
    (a few bf16 roundings on the way; values near zero come from sums that cancel)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    if want.size == 0:
        return
    tol = rtol * np.abs(want) + atol * np.abs(want).max()
    bad = np.abs(got - want) > tol
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} values off, e.g. {got[bad][:4]} "
                           f"against {want[bad][:4]}")


def same_rows(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal as multisets of rows (bit for bit): for layouts whose row order is the library's choice."""
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"

    def order(a):
        return a[np.lexsort(a.reshape(a.shape[0], -1).T[::-1])] if a.shape[0] else a

    np.testing.assert_array_equal(order(got), order(want), err_msg=what)


def fp8_tokens(x: np.ndarray, *, round_scale: bool = False, use_ue8m0: bool = False):
    """The per-128-channel e4m3 cast of ``x`` as DeepEP does it: ``(q as float32, scales float32)``."""
    from deepep_cupy.reference import quant

    q, s = quant.fp8_cast_per_128(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
    return q.astype(np.float32), s


def dequant(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    n, h = q.shape
    return (q.reshape(n, h // 128, 128) * scales[..., None]).reshape(n, h)


def fp8_pair(x: np.ndarray, device, *, column_major: bool = False):
    """The FP8 ``x`` argument of a normal dispatch: ``(e4m3 [N, H], float32 scales [N, H/128])`` tensors."""
    t = torch()
    q, s = fp8_tokens(x)
    data = t.from_numpy(q).to(t.float8_e4m3fn).to(device)
    scales = t.from_numpy(s).to(device)
    if column_major:
        scales = scales.t().contiguous().t()
    return data, scales


def bf16(a: np.ndarray, device):
    t = torch()
    return t.from_numpy(np.ascontiguousarray(a, np.float32)).to(t.bfloat16).to(device)


def tensor(a: np.ndarray, device):
    return torch().from_numpy(np.ascontiguousarray(a)).to(device)
