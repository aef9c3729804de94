"""The high-throughput ops as torch custom ops: layout, dispatch (with ``num_worst_tokens``, or with an
unbacked row count), cached dispatch and combine, each of dispatch and combine the other's backward.

The handle travels as its tensors: the dispatch op returns every entry but ``is_token_in_rank`` (the
caller's input, which an op may not return) and the traced code puts that input back in its place. The
handle's sizes come from the static parameters: ``C`` channels (the backend's choice for the config),
``num_worst_tokens`` rows, or an unbacked row count for a dispatch that waits for its counts on the host
(that dispatch cannot be in a CUDA graph; it is tagged so that inductor leaves it out of one).
"""

from __future__ import annotations

import functools

import torch

from ..ops.handles import OpHandle, cached_rows
from .common import (
    NO_EVENT,
    TORCH_DTYPES,
    buffer_id,
    buffer_of,
    config_list,
    config_of,
    define,
    dispatch_outputs,
    fresh,
    handle_entry,
    no_event,
    pack,
    remember_handle,
    run_config,
    unpack,
    word_layout,
)

__all__ = ["get_dispatch_layout", "dispatch", "combine"]

_I32, _I64, _U8 = torch.int32, torch.int64, torch.uint8


def _resolved(buffer, config, which: str) -> tuple:
    """The config's values, the Buffer's default for ``which`` when None (what an eager call would use)."""
    if config is None:
        return _default_config(buffer._compiled_op_key, which)
    return tuple(config_list(config))


@torch.compiler.assume_constant_result
def _default_config(key: str, which: str) -> tuple:
    """The default config's values for the Buffer of ``key`` (its op id as text), baked into the graph.
    Only constants go in: torch 2.11 refuses a Buffer argument here ("not a constant"), and the default
    (tuning tables, files) is no code to trace."""
    buffer = buffer_of(int(key))
    config = buffer.get_dispatch_config(buffer.group_size) if which == "dispatch" else \
        buffer.get_combine_config(buffer.group_size)
    return tuple(config_list(config))


def _domains(buffer) -> tuple[int, int]:
    """``(ranks per NVLink domain, domains)``; one domain: the intranode 6-tuple handle."""
    return buffer.num_nvl_ranks, buffer.group_size // buffer.num_nvl_ranks


def _channels(buffer, config) -> int:
    """Channels the handle's prefix matrices have: the reference backend's fixed count, else the kernels'
    for the config (one per SM pair; internode: as ``internode.plans.default_channels``)."""
    oracle = getattr(buffer.runtime, "oracle", None)
    if oracle is not None:
        return int(oracle.num_channels)
    local, domains = _domains(buffer)
    if domains == 1:
        return int(config.num_sms) // 2
    from ..ops.internode.plans import default_channels

    engine = getattr(buffer.runtime, "internode", None)
    sub = engine.channels_per_block(config.num_sms) if engine is not None else None
    return default_channels(config, local, domains, sub)


def in_rank_index(buffer) -> int:
    """Where a handle holds ``is_token_in_rank``: 4 in the intranode 6-tuple, 0 in the internode 10-tuple."""
    return 4 if _domains(buffer)[1] == 1 else 0


def _handle_specs(buffer, config, num_tokens, rows, nvl_rows) -> list:
    """``(shape, dtype)`` of the handle's entries other than ``is_token_in_rank``, in handle order."""
    num_ranks = buffer.group_size
    local, domains = _domains(buffer)
    c = _channels(buffer, config)
    if domains == 1:
        return [((num_ranks, num_ranks), _I32), ((num_ranks, c), _I32), ((num_ranks, c), _I32), ((rows,), _I32),
                ((num_tokens, num_ranks), _I32)]
    return [((domains, c), _I32), ((num_ranks, c), _I32), ((domains, c), _I32), ((domains,), _I32),
            ((num_ranks, c), _I32), ((num_ranks,), _I32), ((rows, 8), _U8), ((num_tokens, domains), _I32),
            ((nvl_rows, local), _I32)]


def _dispatch_specs(buffer, config, x, x_scales, num_tokens_per_expert, topk_idx, topk_weights, worst, rows,
                    nvl_rows) -> list:
    """``(shape, dtype, on the host)`` of the dispatch op's outputs."""
    specs = [((rows, x.shape[1]), x.dtype, False)]
    if x_scales is not None:
        specs.append(((rows, *x_scales.shape[1:]), torch.float32, False))
    if topk_idx is not None:
        specs.append(((rows, topk_idx.shape[1]), _I64, False))
        if topk_weights is not None:
            specs.append(((rows, topk_idx.shape[1]), torch.float32, False))
    specs += [(shape, dtype, False) for shape, dtype in _handle_specs(buffer, config, x.shape[0], rows, nvl_rows)]
    if worst == 0:  # received tokens per local expert, read back on the host
        specs.append(((num_tokens_per_expert.shape[0] // buffer.group_size,), _I64, True))
    return specs


# Dispatch calls whose outputs were found to be what the fake implementation says, by everything that
# decides their shapes and dtypes: the check runs once per such call, not on every one.
_CHECKED: set = set()


def _check_outputs(op: str, outs: list, specs: list) -> None:
    """The real outputs against what the fake implementation said (a mismatch would corrupt the graph)."""
    for i, (t, (shape, dtype, _)) in enumerate(zip(outs, specs, strict=True)):
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise RuntimeError(f"deepep_cupy::{op} output {i} is {tuple(t.shape)} {t.dtype}, but the traced graph "
                               f"expects {tuple(shape)} {dtype}")


def _remember(buffer, handle) -> None:
    """Mark a GPU handle as an op's own (its class and host-side attributes come back in ``_handle``; not
    its cached plan-key part, which belongs to its own entries). Only :func:`_handle` on the GPU reads it."""
    if buffer.backend == "cuda" and isinstance(handle, OpHandle):
        attrs = {k: v for k, v in getattr(handle, "__dict__", {}).items() if k != "key"}
        remember_handle(handle[1], ("normal", type(handle), attrs))


def _handle(buffer, entries: list):
    """The handle tuple from its tensors: on the GPU the class a dispatch returns (host-side attributes,
    no index checks) when they are an op's own, else a plain tuple (checked like a caller's)."""
    handle = tuple(entries)
    if buffer.backend != "cuda":
        return handle
    found = handle_entry(entries[1])
    if found is None or found[0] != "normal":
        return handle
    _, cls, attrs = found
    own = tuple.__new__(cls, handle)
    if attrs:  # an OpHandle has no attributes (nor a __dict__)
        own.__dict__.update(attrs)
    return own


# ---------------------------------------------------------------------------------------------------- layout
def layout_parts(num_ranks, num_experts, num_tokens, num_rdma_ranks) -> tuple:
    """Where the GPU layout plan cuts its outputs from one allocation (``LayoutPlan`` in ops/layout.py):
    per rank, per expert, the token -> rank map, and per RDMA rank last when there are several
    (:func:`common.word_layout`)."""
    specs = [((num_ranks,), "int32"), ((num_experts,), "int32"), ((num_tokens, num_ranks), "bool")]
    if num_rdma_ranks > 1:
        specs.append(((num_rdma_ranks,), "int32"))
    return word_layout(specs)


_layout_parts = functools.cache(layout_parts)  # the real op's sizes are ints


@define("layout", integer_inputs=True)  # topk_idx
def layout(bid: int, topk_idx: torch.Tensor, num_experts: int) -> list[torch.Tensor]:
    """On the GPU the plan's one allocation (the traced code cuts the outputs from it), else the outputs:
    per rank, per expert, the token -> rank map, per RDMA rank with several. All new tensors."""
    buffer = buffer_of(bid)
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    parts = [per_rank, per_expert, in_rank] if per_rdma is None else [per_rank, per_expert, in_rank, per_rdma]
    if buffer.backend != "cuda":
        return parts
    return [pack(parts, _layout_parts(buffer.group_size, num_experts, topk_idx.shape[0], _domains(buffer)[1]))]


@layout.register_fake
def _(bid, topk_idx, num_experts):
    buffer = buffer_of(bid)
    parts, words = layout_parts(buffer.group_size, num_experts, topk_idx.shape[0], _domains(buffer)[1])
    if buffer.backend == "cuda":
        return [topk_idx.new_empty((words,), dtype=_I32)]
    return [topk_idx.new_empty(shape, dtype=TORCH_DTYPES[kind]) for shape, kind, _, _ in parts]


def get_dispatch_layout(buffer, topk_idx, num_experts: int, previous_event=None, async_finish: bool = False,
                        allocate_on_comm_stream: bool = False):
    """``Buffer.get_dispatch_layout`` while dynamo traces (the event is empty)."""
    no_event(previous_event)
    num_experts = int(num_experts)
    outs = torch.ops.deepep_cupy.layout(buffer_id(buffer), topk_idx, num_experts)
    if buffer.backend == "cuda":
        outs = unpack(outs[0], layout_parts(buffer.group_size, num_experts, topk_idx.shape[0], _domains(buffer)[1]))
    per_rdma = outs[3] if len(outs) == 4 else None
    return outs[0], per_rdma, outs[1], outs[2], NO_EVENT


# ---------------------------------------------------------------------------------------------------- dispatch
def _dispatch(bid: int, x: torch.Tensor, x_scales: torch.Tensor | None, num_tokens_per_rank: torch.Tensor | None,
              num_tokens_per_rdma_rank: torch.Tensor | None, is_token_in_rank: torch.Tensor,
              num_tokens_per_expert: torch.Tensor, topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None,
              expert_alignment: int, num_worst_tokens: int, config: list[int]) -> list[torch.Tensor]:
    """The dispatch ops' implementation: with ``num_worst_tokens`` fixed sizes and no host wait (CUDA graphs
    may hold it), without it the received counts read back on the host."""
    buffer = buffer_of(bid)
    cfg = run_config(config)
    with dispatch_outputs(x):  # in the output pool as an eager call, except where CUDA-graph trees run it
        recv, recv_topk_idx, recv_topk_weights, counts, handle, _ = buffer.dispatch(
            x if x_scales is None else (x, x_scales), None, num_tokens_per_rank, num_tokens_per_rdma_rank,
            is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
            cfg)
    outs = list(recv) if x_scales is not None else [recv]
    outs += [t for t in (recv_topk_idx, recv_topk_weights) if t is not None]
    skip = 4 if len(handle) == 6 else 0  # is_token_in_rank: the caller's input (in_rank_index)
    outs += [t for i, t in enumerate(handle) if i != skip]
    if num_worst_tokens == 0:
        outs.append(torch.tensor(counts, dtype=_I64))
    nvl_rows = handle[9].shape[0] if len(handle) == 10 else 0
    rows = outs[0].shape[0]
    key = (bid, x.shape, x.dtype, None if x_scales is None else x_scales.shape, num_tokens_per_expert.shape,
           None if topk_idx is None else topk_idx.shape, topk_weights is None, num_worst_tokens, tuple(config), rows,
           nvl_rows)
    if key not in _CHECKED:
        _check_outputs("dispatch", outs, _dispatch_specs(buffer, cfg, x, x_scales, num_tokens_per_expert, topk_idx,
                                                         topk_weights, num_worst_tokens, rows, nvl_rows))
        if len(_CHECKED) < 1024:
            _CHECKED.add(key)
    _remember(buffer, handle)
    return fresh(outs, [x, x_scales, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                        num_tokens_per_expert, topk_idx, topk_weights])


def _dispatch_fake(bid, x, x_scales, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                   num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config):
    buffer = buffer_of(bid)
    rows = nvl_rows = num_worst_tokens
    if num_worst_tokens == 0:  # the received rows are known once the counts came back to the host
        ctx = torch.library.get_ctx()
        rows = ctx.new_dynamic_size()
        nvl_rows = ctx.new_dynamic_size() if _domains(buffer)[1] > 1 else 0  # forwarded rows (internode)
    specs = _dispatch_specs(buffer, config_of(config), x, x_scales, num_tokens_per_expert, topk_idx, topk_weights,
                            num_worst_tokens, rows, nvl_rows)
    return [x.new_empty(shape, dtype=dtype, device="cpu" if host else None) for shape, dtype, host in specs]


dispatch_op = define("dispatch")(_dispatch)
dispatch_op.register_fake(_dispatch_fake)
# The same op without num_worst_tokens waits for the received counts on the host: tagged so that inductor
# keeps it out of CUDA graphs.
_HOST_WAIT = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)
dispatch_host_wait = define("dispatch_host_wait", tags=_HOST_WAIT)(_dispatch)
dispatch_host_wait.register_fake(_dispatch_fake)


@define("cached_dispatch")
def cached_dispatch(bid: int, x: torch.Tensor, x_scales: torch.Tensor | None, handle: list[torch.Tensor],
                    config: list[int]) -> list[torch.Tensor]:
    buffer = buffer_of(bid)
    with dispatch_outputs(x):  # as in _dispatch
        recv = buffer.dispatch(x if x_scales is None else (x, x_scales), _handle(buffer, handle),
                               config=run_config(config))[0]
    outs = list(recv) if x_scales is not None else [recv]
    return fresh(outs, [x, x_scales, *handle])


@cached_dispatch.register_fake
def _(bid, x, x_scales, handle, config):
    rows = cached_rows(handle)
    outs = [x.new_empty((rows, x.shape[1]))]
    if x_scales is not None:
        outs.append(x_scales.new_empty((rows, *x_scales.shape[1:]), dtype=torch.float32))
    return outs


def dispatch(buffer, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
             num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment: int = 1,
             num_worst_tokens: int = 0, config=None, previous_event=None, async_finish: bool = False,
             allocate_on_comm_stream: bool = False):
    """``Buffer.dispatch`` while dynamo traces (the event is empty). Without ``num_worst_tokens`` the row
    count is unbacked and the per-expert list needs ``torch._dynamo.config.capture_scalar_outputs``."""
    no_event(previous_event)
    bid = buffer_id(buffer)
    data, scales = x if isinstance(x, (tuple, list)) else (x, None)
    cfg = list(_resolved(buffer, config, "dispatch"))
    if handle is not None:
        outs = torch.ops.deepep_cupy.cached_dispatch(bid, data, scales, list(handle), cfg)
        return (outs[0] if scales is None else (outs[0], outs[1])), None, None, None, None, NO_EVENT
    if is_token_in_rank is None or num_tokens_per_expert is None:
        raise ValueError("a dispatch without handle needs is_token_in_rank and num_tokens_per_expert")
    worst = int(num_worst_tokens)
    outs = _dispatch_fn(bid, data, scales, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                        num_tokens_per_expert, topk_idx, topk_weights, int(expert_alignment), worst, cfg)
    recv, i = (outs[0], 1) if scales is None else ((outs[0], outs[1]), 2)
    recv_topk_idx = recv_topk_weights = None
    if topk_idx is not None:
        recv_topk_idx, i = outs[i], i + 1
        if topk_weights is not None:
            recv_topk_weights, i = outs[i], i + 1
    entries = list(outs[i:i + (5 if in_rank_index(buffer) == 4 else 9)])
    entries.insert(in_rank_index(buffer), is_token_in_rank)
    counts = [] if worst > 0 else outs[-1].tolist()
    return recv, recv_topk_idx, recv_topk_weights, counts, tuple(entries), NO_EVENT


# ---------------------------------------------------------------------------------------------------- combine
@define("combine")
def combine_op(bid: int, x: torch.Tensor, handle: list[torch.Tensor], topk_weights: torch.Tensor | None,
               bias_0: torch.Tensor | None, bias_1: torch.Tensor | None, config: list[int]) -> list[torch.Tensor]:
    buffer = buffer_of(bid)
    bias = bias_0 if bias_1 is None else (bias_0, bias_1)
    combined, combined_w, _ = buffer.combine(x, _handle(buffer, handle), topk_weights, bias, run_config(config))
    outs = [combined] if topk_weights is None else [combined, combined_w]
    return fresh(outs, [x, *handle, topk_weights, bias_0, bias_1])


@combine_op.register_fake
def _(bid, x, handle, topk_weights, bias_0, bias_1, config):
    num_tokens = handle[in_rank_index(buffer_of(bid))].shape[0]
    outs = [x.new_empty((num_tokens, x.shape[1]))]
    if topk_weights is not None:
        outs.append(topk_weights.new_empty((num_tokens, topk_weights.shape[1])))
    return outs


def combine(buffer, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
            async_finish: bool = False, allocate_on_comm_stream: bool = False):
    """``Buffer.combine`` while dynamo traces (the event is empty)."""
    no_event(previous_event)
    bias_0, bias_1 = bias if isinstance(bias, (tuple, list)) else (bias, None)
    outs = _combine_fn(buffer_id(buffer), x, list(handle), topk_weights, bias_0, bias_1,
                       list(_resolved(buffer, config, "combine")))
    return outs[0], (outs[1] if topk_weights is not None else None), NO_EVENT


def _dispatch_fn(*args):
    worst = args[10]
    return (torch.ops.deepep_cupy.dispatch if worst > 0 else torch.ops.deepep_cupy.dispatch_host_wait)(*args)


def _combine_fn(*args):
    return torch.ops.deepep_cupy.combine(*args)


# ------------------------------------------------------------------------------------------------ backward
# Backward formulas of the dispatch and combine ops, as MoE frameworks pair them: a dispatch's backward
# combines the gradients of the received rows (and sums those of the received weights) back to the
# tokens' ranks; a combine's backward dispatches the gradient of its output along the same handle.
#
# Only compiled code differentiates through them (eager ``Buffer`` calls stay outside autograd, as
# DeepEP's). Not differentiated: FP8 inputs, the weights a combine sums (``topk_weights``), and the
# low-latency ops (decoding).


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


for _op in (dispatch_op, dispatch_host_wait):
    _op.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)
combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)
