"""Backward formulas of the dispatch and combine ops, as MoE frameworks pair them: a dispatch's backward
combines the gradients of the received rows (and sums those of the received weights) back to the
tokens' ranks; a combine's backward dispatches the gradient of its output along the same handle.

Only compiled code differentiates through them (eager ``Buffer`` calls stay outside autograd, as
DeepEP's). Not differentiated: FP8 inputs, the weights a combine sums (``topk_weights``), and the
low-latency ops (decoding).
"""

from __future__ import annotations

import torch

from .common import buffer_of
from .normal import in_rank_index

__all__: list[str] = []


def _dispatch_setup(ctx, inputs, output) -> None:
    (bid, x, x_scales, _, _, is_token_in_rank, _, topk_idx, topk_weights, _, worst, config) = inputs
    first = 1 + (x_scales is not None) + (topk_idx is not None) + (topk_idx is not None and topk_weights is not None)
    buffer = buffer_of(bid)
    entries = list(output[first:first + (5 if in_rank_index(buffer) == 4 else 9)])
    entries.insert(in_rank_index(buffer), is_token_in_rank)
    ctx.bid, ctx.config = bid, list(config)
    ctx.recv_x = (output[0].shape, output[0].dtype, output[0].device)
    # Index of recv_topk_weights among the outputs, or None.
    ctx.weights_at = first - 1 if topk_idx is not None and topk_weights is not None else None
    if ctx.weights_at is not None:
        ctx.weights_shape = output[ctx.weights_at].shape
    ctx.save_for_backward(*entries)


def _dispatch_backward(ctx, grads):
    handle = list(ctx.saved_tensors)
    shape, dtype, device = ctx.recv_x
    grad_recv = grads[0] if grads[0] is not None else torch.zeros(shape, dtype=dtype, device=device)
    grad_w = None
    if ctx.weights_at is not None and ctx.needs_input_grad[8]:
        grad_w = grads[ctx.weights_at]
        grad_w = torch.zeros(ctx.weights_shape, dtype=torch.float32, device=device) if grad_w is None else \
            grad_w.contiguous()
    outs = torch.ops.deepep_cupy.combine(ctx.bid, grad_recv.contiguous(), handle, grad_w, None, None, ctx.config)
    return (None, outs[0], None, None, None, None, None, None, outs[1] if grad_w is not None else None, None,
            None, None)


def _combine_setup(ctx, inputs, output) -> None:
    bid, _, handle, _, bias_0, bias_1, config = inputs
    ctx.bid, ctx.config = bid, list(config)
    ctx.num_handle = len(handle)
    ctx.save_for_backward(*handle)


def _combine_backward(ctx, grads):
    grad = grads[0].contiguous()
    grad_x = torch.ops.deepep_cupy.cached_dispatch(ctx.bid, grad, None, list(ctx.saved_tensors), ctx.config)[0]
    bias_0 = grad if ctx.needs_input_grad[4] else None
    bias_1 = grad if ctx.needs_input_grad[5] else None
    return None, grad_x, [None] * ctx.num_handle, None, bias_0, bias_1, None


for _name in ("dispatch", "dispatch_host_wait"):
    torch.library.register_autograd(f"deepep_cupy::{_name}", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("deepep_cupy::combine", _combine_backward, setup_context=_combine_setup)
