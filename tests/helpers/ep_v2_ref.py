"""An independent NumPy statement of DeepEP V2's dispatch and combine semantics, for tests of ``deepep_cupy.ep``.

Every rank can compute every rank's inputs (they come from seeds), so the expectations need no exchange.
Semantics (direct mode; hybrid mode across scale-up domains adds the combine's per-domain level):

* dispatch: rank ``me`` receives, once, each token of each source rank with at least one expert in
  ``[me * L, (me + 1) * L)``; a row's ``src_token_global_idx`` is ``src_rank * M + token``; its top-k ids
  are local (``e - me * L``) or -1; the count per local expert is the number of (token, k) hits.
* combine: float32 throughout; first the BF16 sum of each rank's slots of a token placed at that rank's
  highest slot (when the caller reduced per rank), then ``bias_0 + bias_1`` (or 0) plus every slot in
  ascending order, rounded to BF16.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


@dataclass
class RankInputs:
    x: np.ndarray  # [T, H] bf16
    topk_idx: np.ndarray  # [T, K] int64, -1 for masked
    topk_weights: np.ndarray  # [T, K] float32, 0 where masked
    fp8: tuple | None  # (data [T, H] e4m3, scales [T, H / 128] float32)
    bias: tuple  # 0, 1 or 2 [T, H] bf16 tensors


def rank_inputs(seed: int, rank: int, *, num_tokens: int, hidden: int, num_experts: int, num_topk: int,
                num_bias: int = 0, masked_ratio: float = 0.2) -> RankInputs:
    rng = np.random.default_rng([seed, rank])
    t = max(1, num_tokens - rank)
    x = rng.standard_normal((t, hidden), dtype=np.float32).astype(BF16)
    scores = rng.random((t, num_experts))
    topk = np.argsort(-scores, axis=1)[:, :num_topk].astype(np.int64)  # distinct experts per token
    weights = rng.random((t, num_topk), dtype=np.float32) + np.float32(0.5)
    masked = rng.random((t, num_topk)) < masked_ratio
    topk[masked] = -1
    weights[masked] = 0
    bias = tuple((rng.standard_normal((t, hidden), dtype=np.float32)
                  * np.exp2(rng.integers(-12, 13, (t, hidden))).astype(np.float32)).astype(BF16)
                 for _ in range(num_bias))
    return RankInputs(x, topk, weights, per_token_fp8(x) if hidden % 128 == 0 else None, bias)


def per_token_fp8(x: np.ndarray) -> tuple:
    """E4M3 data and float32 scales (max magnitude / 448 per 128 channels)."""
    t, h = x.shape
    blocks = x.astype(np.float32).reshape(t, h // 128, 128)
    scales = np.maximum(np.abs(blocks).max(axis=2), np.float32(1e-4)) / np.float32(448)
    data = (blocks / scales[:, :, None]).reshape(t, h).astype(FP8)
    return data, scales.astype(np.float32)


@dataclass
class Received:
    src_global: np.ndarray  # [n] int64, ascending
    x: np.ndarray  # [n, H] bf16
    fp8: tuple | None
    topk_idx: np.ndarray  # [n, K] local ids or -1
    topk_weights: np.ndarray  # [n, K] sender's weights
    per_source: np.ndarray  # [R] rows from each source rank
    per_expert: np.ndarray  # [L] (token, k) hits per local expert


def received(inputs: list, me: int, num_experts: int, num_max_tokens: int) -> Received:
    nranks = len(inputs)
    e_local = num_experts // nranks
    g, xs, f8d, f8s, idx, w, per_source = [], [], [], [], [], [], []
    for src, inp in enumerate(inputs):
        owner = np.where(inp.topk_idx >= 0, inp.topk_idx // e_local, -1)
        tokens = np.nonzero((owner == me).any(axis=1))[0]
        per_source.append(len(tokens))
        g.append(src * num_max_tokens + tokens)
        xs.append(inp.x[tokens])
        if inp.fp8 is not None:
            f8d.append(inp.fp8[0][tokens])
            f8s.append(inp.fp8[1][tokens])
        local = inp.topk_idx[tokens]
        idx.append(np.where(owner[tokens] == me, local - me * e_local, -1))
        w.append(inp.topk_weights[tokens])
    topk = np.concatenate(idx)
    per_expert = np.array([(topk == e).sum() for e in range(e_local)], dtype=np.int64)
    fp8 = (np.concatenate(f8d), np.concatenate(f8s)) if f8d else None
    return Received(np.concatenate(g), np.concatenate(xs), fp8, topk, np.concatenate(w), np.array(per_source),
                    per_expert)


def expert_outputs(src_global: np.ndarray, num_topk: int, hidden: int, seed: int) -> np.ndarray:
    """`[n, K, H]` bf16: the output "expert j computed" for token ``src_global`` at slot j (a pure function
    of the token's global index, so source and expert ranks agree)."""
    s = (src_global.astype(np.float64)[:, None, None] * num_topk + np.arange(num_topk)[None, :, None])
    h = np.arange(hidden)[None, None, :]
    # Magnitudes spread over 2^-12 .. 2^12, so that float32 sums round and their order shows in the result.
    scale = np.exp2(((s * 7 + h * 3).astype(np.int64) % 25 - 12).astype(np.float64))
    return (np.sin(s * 0.7311 + h * 0.0173 + seed * 0.1) * scale).astype(np.float32).astype(BF16)


def rank_sum(y: np.ndarray, local: np.ndarray) -> np.ndarray:
    """BF16 `[n, H]`: float32 sum over the slots with ``local >= 0``, in slot order."""
    acc = np.zeros((y.shape[0], y.shape[2]), dtype=np.float32)
    for j in range(y.shape[1]):
        acc += np.where((local[:, j] >= 0)[:, None], y[:, j].astype(np.float32), np.float32(0))
    return acc.astype(BF16)


def _grouped(terms: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Each token's terms of one group (-1: none) summed in float32 in slot order, as BF16 at the group's
    highest slot; zero at the group's other slots."""
    t, _, h = terms.shape
    reduced = np.zeros_like(terms)
    for tok in range(t):
        for grp in np.unique(groups[tok]):
            members = np.nonzero(groups[tok] == grp)[0]
            acc = np.zeros(h, dtype=np.float32)
            for j in members:
                acc += terms[tok, j].astype(np.float32)
            reduced[tok, members[-1]] = acc.astype(BF16)
    return reduced


def combined(y: np.ndarray, topk_idx: np.ndarray, e_local: int, bias: tuple, reduce_per_rank: bool,
             experts_per_domain: int | None = None) -> np.ndarray:
    """V2's combine of `[T, K, H]` bf16 contributions (zero where ``topk_idx`` is -1). With
    ``experts_per_domain`` (hybrid mode across scale-up domains, after the per-rank sums) each domain's sums
    are added first, in slot order, and rounded to BF16 at the domain's highest slot."""
    t, k, h = y.shape
    terms = np.where((topk_idx >= 0)[:, :, None], y.astype(np.float32), np.float32(0)).astype(BF16)
    if reduce_per_rank:
        terms = _grouped(terms, np.where(topk_idx >= 0, topk_idx // e_local, -1))
    if experts_per_domain:
        terms = _grouped(terms, np.where(topk_idx >= 0, topk_idx // experts_per_domain, -1))
    acc = np.zeros((t, h), dtype=np.float32)
    if bias:
        acc = bias[0].astype(np.float32)
        if len(bias) == 2:
            acc = acc + bias[1].astype(np.float32)
    for j in range(k):
        acc = acc + terms[:, j].astype(np.float32)
    return acc.astype(BF16)


def align(v, a):
    return (v + a - 1) // a * a
