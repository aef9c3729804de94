"""The steps the ``compiled`` suite runs each way, their random inputs, and the exact comparison of results.

Every step function returns a tuple of tensors (what a caller would read); the checks compare them bit
for bit, only where the op defines them (received rows of a slab, rows past a ``num_worst_tokens``
dispatch's padding are left out), and the loss, a sum, within a stated tolerance.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["Differs", "decode_step", "decode_inputs", "decode_differences", "training_forward", "training_inputs",
           "training_differences", "training_autograd", "combine_function", "LOSS_RTOL"]

#: The loss is a float32 sum over tokens x hidden terms; compiled code sums in another order (inductor
#: splits the reduction differently), so it is compared within this share of the sum of |terms|.
#: Everything else is compared bit for bit.
LOSS_RTOL = 1e-5


class Differs(RuntimeError):
    """A compiled (or custom-op) step gave other results than the eager Buffer calls on the same data."""


# ---------------------------------------------------------------------------------------------------- inputs
def _routing(gen, n: int, num_experts: int, topk: int, device):
    """Distinct experts per token (top-k of random scores), 2 % of the slots masked with -1, float32 weights."""
    scores = torch.rand((n, num_experts), generator=gen, device=device)
    idx = scores.topk(topk, dim=1).indices.to(torch.int64)
    idx = idx.masked_fill(torch.rand((n, topk), generator=gen, device=device) < 0.02, -1)
    return idx, torch.rand((n, topk), generator=gen, device=device)


def _bf16(gen, shape, device, scale=0.5):
    return (torch.randn(shape, generator=gen, device=device) * scale).to(torch.bfloat16)


def decode_inputs(gen, device, tokens, hidden, num_experts, topk, num_ranks, t_max):
    """``(x, topk_idx, topk_weights, expert_out)``; ``expert_out`` is what the local experts send back
    (``[E_local, R * T, H]``), random as the decode step of the ``host`` suite has it."""
    x = _bf16(gen, (tokens, hidden), device)
    idx, w = _routing(gen, tokens, num_experts, topk, device)
    y = _bf16(gen, (num_experts // num_ranks, num_ranks * t_max, hidden), device, 0.1)
    return x, idx, w, y


def training_inputs(gen, device, tokens, hidden, num_experts, topk):
    """``(x, topk_idx, topk_weights, probe)``; the loss is ``<combined, probe>``."""
    x = _bf16(gen, (tokens, hidden), device)
    idx, w = _routing(gen, tokens, num_experts, topk, device)
    return x, idx, w, torch.randn((tokens, hidden), generator=gen, device=device)


# ---------------------------------------------------------------------------------------------------- steps
def decode_step(dispatch, combine, t_max: int, num_experts: int):
    """DeepEP's decode step: FP8 low-latency dispatch, then the combine of the experts' outputs.
    ``dispatch`` and ``combine`` take the Buffer methods' arguments (the methods, or the custom-op
    functions of :mod:`deepep_cupy.custom_ops.low_latency` bound to the Buffer)."""
    def step(x, idx, w, expert_out):
        (recv, scales), count, handle, _, _ = dispatch(x, idx, t_max, num_experts, use_fp8=True)
        combined, _, _ = combine(expert_out, idx, w, handle)
        return recv, scales, count, handle[0], handle[1], combined

    return step


def training_forward(layout, dispatch, combine, num_experts: int, num_worst_tokens: int):
    """A training step's forward and loss: layout, fixed-size dispatch, an element-wise stand-in for the
    experts, combine. The stand-in is one float32 product rounded to BF16 (any backend rounds it the same
    way) by the row's largest received weight (a max: exact in any order), so everything but the loss's
    sum can be compared bit for bit, backward included."""
    def forward(x, idx, w, probe):
        per_rank, per_rdma, per_expert, in_rank, _ = layout(idx, num_experts)
        recv, recv_idx, recv_w, _, handle, _ = dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, num_worst_tokens=num_worst_tokens)
        y = (recv.float() * recv_w.amax(dim=-1, keepdim=True)).to(torch.bfloat16)
        combined, _, _ = combine(y, handle)
        loss = (combined.float() * probe).sum()
        return loss, recv, recv_idx, recv_w, handle[0], combined

    return forward


def combine_function(buf):
    """``combine`` as an ``autograd.Function`` (``apply(y, handle)``), as frameworks wrap it for eager
    training: its backward is the cached dispatch of the gradient along the handle."""
    class Combine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, handle):
            ctx.handle = handle
            return buf.combine(y, handle)[0]

        @staticmethod
        def backward(ctx, grad):
            return buf.dispatch(grad.contiguous(), handle=ctx.handle)[0], None

    return Combine


def training_autograd(buf, num_experts: int, num_worst_tokens: int):
    """The same forward written as frameworks wrap DeepEP for eager training: ``autograd.Function``s
    around the Buffer calls (a dispatch's backward is a combine, a combine's a cached dispatch)."""
    class Dispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, idx, w, keep):
            per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
            recv, recv_idx, recv_w, _, handle, _ = buf.dispatch(
                x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, num_worst_tokens=num_worst_tokens)
            ctx.handle = keep["handle"] = handle
            ctx.mark_non_differentiable(recv_idx, recv_w)
            return recv, recv_idx, recv_w

        @staticmethod
        def backward(ctx, grad_recv, *_):
            return buf.combine(grad_recv.contiguous(), ctx.handle)[0], None, None, None

    Combine = combine_function(buf)

    def layout(idx, num_experts):  # the Function does both calls: the layout is its input here
        return None, None, None, None, None

    def dispatch(x, topk_idx, topk_weights, keep, **_):
        return (*Dispatch.apply(x, topk_idx, topk_weights, keep), None, keep["handle"], None)

    def combine(y, handle):
        return Combine.apply(y, handle), None, None

    def forward(x, idx, w, probe):
        keep: dict = {}
        inner = training_forward(layout, functools.partial(dispatch, keep=keep), combine, num_experts,
                                 num_worst_tokens)
        return inner(x, idx, w, probe)

    return forward


# ---------------------------------------------------------------------------------------------------- checks
def _bits(t):
    """The tensor's bytes (NaN payloads and signed zeros included)."""
    t = t.contiguous()
    return (t.reshape(1) if t.dim() == 0 else t).view(torch.uint8)


def _same(got, want) -> bool:
    return got.shape == want.shape and got.dtype == want.dtype and torch.equal(_bits(got), _bits(want))


def decode_differences(got, want) -> list[str]:
    """What differs between two decode steps' outputs: counts, layout ranges and the combined tokens
    whole; received rows, scales and source info only in each expert's first ``count`` slots (the rest
    of a slab is never written)."""
    names = ("recv_x", "scales", "count", "src_info", "layout_range", "combined")
    if not _same(got[2], want[2]):
        return ["count"]
    valid = torch.arange(want[0].shape[1], device=want[2].device)[None, :] < want[2][:, None]
    out = []
    for i, name in enumerate(names):
        a, b = (got[i][valid], want[i][valid]) if i in (0, 1, 3) else (got[i], want[i])
        if not _same(a, b):
            out.append(name)
    return out


def training_differences(got, want, grad_got, grad_want, probe, rank: int, intranode: bool) -> list[str]:
    """What differs between two training steps: the received rows (as many as the eager handle's
    ``rank_prefix_matrix`` says arrived; intranode handles only, the first entry of an internode handle
    does not say), the combined tokens and the gradient bit for bit, the loss within ``LOSS_RTOL`` of the
    sum of its terms' magnitudes."""
    loss, want_loss = float(got[0]), float(want[0])
    out = []
    scale = float((want[5].float() * probe).abs().sum())
    if not abs(loss - want_loss) <= LOSS_RTOL * scale:  # also catches NaN
        out.append(f"loss ({loss:.9g} vs {want_loss:.9g})")
    if intranode:
        rows = int(want[4][-1, rank])
        for name, i in (("recv_x", 1), ("recv_topk_idx", 2), ("recv_topk_weights", 3)):
            if not _same(got[i][:rows], want[i][:rows]):
                out.append(name)
        if not _same(got[4], want[4]):
            out.append("rank_prefix_matrix")
    if not _same(got[5], want[5]):
        out.append("combined")
    if not _same(grad_got, grad_want):
        out.append("grad x")
    return out
