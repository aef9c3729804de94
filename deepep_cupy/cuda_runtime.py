"""Runs Buffer operations on the GPU: converts arrays to CuPy views, arranges streams and events, and
calls the kernel launchers (``ops``) and engines that own the shared buffers."""

from __future__ import annotations

import numpy as np

from .event import EventOverlap
from .interop import BF16, FP8, TensorKind, from_cupy, kind_of, logical_dtype, to_cupy, to_storage_dtype
from .interop import BOOL as _BOOL
from .interop import F32 as _F32
from .interop import I32 as _I32
from .interop import I64 as _I64
from .runtime.device import current_device_id
from .runtime.streams import OpStreams, current_stream

__all__ = ["CudaRuntime"]


def _dev(obj):
    return None if obj is None else to_cupy(obj)


def _handle_to_device(handle):
    return None if handle is None else tuple(to_cupy(h) if hasattr(h, "shape") else h for h in handle)


def _handle_to_caller(handle, like: TensorKind):
    out = []
    for h in handle:
        if hasattr(h, "shape") and hasattr(h, "dtype"):
            out.append(from_cupy(h, np.dtype(h.dtype), like))
        else:
            out.append(h)
    return tuple(out)


class _OnCallerStream:
    """Stream choreography of a low-latency op without ``async_finish``: it runs on the caller's stream,
    so there is nothing to wait for afterwards (the ``OpStreams`` interface, trivially)."""

    def __init__(self, stream) -> None:
        self.comm = stream

    def finish(self) -> None:
        return None


class CudaRuntime:
    """The ``Buffer.runtime`` on a GPU. Collective to construct and to destroy."""

    def __init__(self, group, *, num_nvl_bytes, num_rdma_bytes, num_nvl_ranks, low_latency_mode,
                 num_qps_per_rank, allow_nvlink, allow_mnnvl, use_fabric, enable_shrink):
        import cupy

        self.group = group
        self.num_ranks = group.size
        self.rank = group.rank
        self.num_nvl_ranks = num_nvl_ranks
        self.device_id = current_device_id()
        cupy.cuda.Device(self.device_id).use()
        self.comm_stream = cupy.cuda.Stream(non_blocking=True)
        self.intranode = None
        self.low_latency = None
        try:
            if num_nvl_bytes > 0:
                from .ops.intranode import IntranodeEngine

                self.intranode = IntranodeEngine(group, self.device_id, num_nvl_bytes, use_fabric=use_fabric)
            if low_latency_mode or num_rdma_bytes > 0:
                from .ops.low_latency import LowLatencyEngine

                self.low_latency = LowLatencyEngine(group, self.device_id, num_rdma_bytes,
                                                    allow_nvlink=allow_nvlink, num_qps_per_rank=num_qps_per_rank,
                                                    allow_mnnvl=allow_mnnvl, enable_shrink=enable_shrink)
        except BaseException:
            self.release_local()
            raise

    # ------------------------------------------------------------------ helpers
    def require_internode(self, op: str) -> None:
        raise NotImplementedError(
            f"{op}: the GPU backend runs one NVLink domain per group; this group spans "
            f"{self.num_ranks // self.num_nvl_ranks} domains. Use backend='reference' or a group within one domain.")

    def _engine(self, name: str):
        engine = getattr(self, name)
        if engine is None:
            need = "num_nvl_bytes > 0" if name == "intranode" else "low_latency_mode=True and num_rdma_bytes > 0"
            raise RuntimeError(f"this Buffer has no {name} buffer: create it with {need}")
        return engine

    def _streams(self, like: TensorKind, previous_event, async_finish, allocate_on_comm_stream) -> OpStreams:
        return OpStreams(self.comm_stream, like.framework, self.device_id, previous_event, async_finish,
                         allocate_on_comm_stream)

    def get_comm_stream(self, torch_stream: bool):
        if torch_stream:
            import torch

            return torch.cuda.ExternalStream(self.comm_stream.ptr, device=torch.device("cuda", self.device_id))
        return self.comm_stream

    def local_buffer_tensor(self, dtype, size, offset, use_rdma_buffer):
        import cupy

        engine = self._engine("low_latency" if use_rdma_buffer else "intranode")
        ptr, nbytes = engine.local_buffer_view()
        is_torch = type(dtype).__module__.startswith("torch")
        if is_torch:
            import torch

            itemsize = torch.empty(0, dtype=dtype).element_size()
        else:
            itemsize = np.dtype(dtype).itemsize
        count = nbytes // itemsize - offset
        numel = count if size is None else int(np.prod(tuple(size)))
        if count < 0 or numel > count:
            raise ValueError(f"{numel} elements at offset {offset} do not fit the {nbytes}-byte buffer")
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, self)
        raw = cupy.ndarray((numel * itemsize,), cupy.uint8, cupy.cuda.MemoryPointer(mem, offset * itemsize))
        shape = (numel,) if size is None else tuple(size)
        if is_torch:
            import torch

            return torch.from_dlpack(raw).view(dtype).view(shape)
        return from_cupy(raw.view(to_storage_dtype(dtype)), np.dtype(dtype), TensorKind("cupy", self.device_id)).reshape(shape)

    # ------------------------------------------------------------------ high-throughput ops
    def get_dispatch_layout(self, topk_idx, num_experts, *, previous_event, async_finish, allocate_on_comm_stream):
        from .ops.layout import get_dispatch_layout

        like = kind_of(topk_idx)
        streams = self._streams(like, previous_event, async_finish, allocate_on_comm_stream)
        with streams.alloc:
            outs = get_dispatch_layout(to_cupy(topk_idx), num_experts, self.num_ranks, self.num_nvl_ranks,
                                       stream=streams.comm)
        event = streams.finish()
        per_rank, per_rdma, per_expert, in_rank = outs
        return (from_cupy(per_rank, _I32, like), from_cupy(per_rdma, _I32, like),
                from_cupy(per_expert, _I32, like), from_cupy(in_rank, _BOOL, like), EventOverlap(event))

    def dispatch(self, x, x_scales, *, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                 topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, previous_event,
                 async_finish, allocate_on_comm_stream):
        engine = self._engine("intranode")
        like = kind_of(x)
        x_dtype = logical_dtype(x)
        streams = self._streams(like, previous_event, async_finish, allocate_on_comm_stream)
        with streams.alloc:
            recv_x, recv_scales, recv_topk_idx, recv_topk_weights, counts, new_handle = engine.dispatch(
                to_cupy(x), _dev(x_scales), handle=_handle_to_device(handle),
                num_tokens_per_rank=_dev(num_tokens_per_rank), is_token_in_rank=_dev(is_token_in_rank),
                num_tokens_per_expert=_dev(num_tokens_per_expert), topk_idx=_dev(topk_idx),
                topk_weights=_dev(topk_weights), expert_alignment=expert_alignment,
                num_worst_tokens=num_worst_tokens, config=config, stream=streams.comm)
        event = EventOverlap(streams.finish())
        recv = from_cupy(recv_x, x_dtype, like)
        if x_scales is not None:
            recv = (recv, from_cupy(recv_scales, _F32, like))
        if handle is not None:
            return recv, None, None, None, None, event
        return (recv, from_cupy(recv_topk_idx, _I64, like), from_cupy(recv_topk_weights, _F32, like),
                counts, _handle_to_caller(new_handle, like), event)

    def combine(self, x, handle, *, topk_weights, bias_0, bias_1, config, previous_event, async_finish,
                allocate_on_comm_stream):
        engine = self._engine("intranode")
        like = kind_of(x)
        streams = self._streams(like, previous_event, async_finish, allocate_on_comm_stream)
        with streams.alloc:
            combined, weights = engine.combine(to_cupy(x), _handle_to_device(handle), topk_weights=_dev(topk_weights),
                                               bias_0=_dev(bias_0), bias_1=_dev(bias_1), config=config,
                                               stream=streams.comm)
        event = EventOverlap(streams.finish())
        return from_cupy(combined, logical_dtype(x), like), from_cupy(weights, _F32, like), event

    # ------------------------------------------------------------------ low-latency ops
    def _ll_streams(self, like, async_finish):
        """Low-latency kernels run on the caller's stream, or on the comm stream with ``async_finish``."""
        if async_finish:
            return self._streams(like, None, True, False)
        return _OnCallerStream(current_stream(like.framework, self.device_id))

    def low_latency_dispatch(self, x, topk_idx, *, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                             round_scale, use_ue8m0, async_finish, return_recv_hook):
        engine = self._engine("low_latency")
        like = kind_of(x)
        streams = self._ll_streams(like, async_finish)
        stream = streams.comm
        with stream:
            recv_x, recv_scales, recv_count, handle, hook = engine.dispatch(
                to_cupy(x), to_cupy(topk_idx), num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                num_experts=num_experts, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                cumulative_local_expert_recv_stats=_dev(cumulative_local_expert_recv_stats),
                dispatch_wait_recv_cost_stats=self._wait_row(dispatch_wait_recv_cost_stats),
                return_recv_hook=return_recv_hook, stream=stream)
        event = EventOverlap(streams.finish())
        if use_fp8:
            scale_dtype = _I32 if use_ue8m0 else _F32
            recv = (from_cupy(recv_x, FP8, like), from_cupy(recv_scales, scale_dtype, like))
        else:
            recv = from_cupy(recv_x, logical_dtype(x), like)
        return recv, from_cupy(recv_count, _I32, like), _handle_to_caller(handle, like), event, hook

    def _wait_row(self, stats):
        if stats is None:
            return None
        arr = to_cupy(stats)
        return arr[self.rank] if arr.ndim == 2 else arr

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, *, use_logfmt, zero_copy, async_finish,
                            return_recv_hook, out, combine_wait_recv_cost_stats):
        engine = self._engine("low_latency")
        like = kind_of(x)
        streams = self._ll_streams(like, async_finish)
        stream = streams.comm
        with stream:
            combined, hook = engine.combine(
                to_cupy(x), to_cupy(topk_idx), to_cupy(topk_weights), _handle_to_device(handle),
                use_logfmt=use_logfmt, zero_copy=zero_copy, return_recv_hook=return_recv_hook, out=_dev(out),
                combine_wait_recv_cost_stats=self._wait_row(combine_wait_recv_cost_stats), stream=stream)
        event = EventOverlap(streams.finish())
        result = out if out is not None else from_cupy(combined, logical_dtype(x), like)
        return result, event, hook

    def get_next_low_latency_combine_buffer(self, handle):
        engine = self._engine("low_latency")
        like = kind_of(handle[0])
        return from_cupy(engine.get_next_combine_buffer(_handle_to_device(handle)), BF16, like)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        engine = self._engine("low_latency")
        engine.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts,
                     stream=current_stream(None, self.device_id))

    def low_latency_update_mask_buffer(self, rank, mask):
        self._engine("low_latency").update_mask(rank, mask)

    def low_latency_query_mask_buffer(self, mask_status):
        self._engine("low_latency").query_mask(to_cupy(mask_status))

    def low_latency_clean_mask_buffer(self):
        self._engine("low_latency").clean_mask()

    # ------------------------------------------------------------------ lifetime
    def destroy(self):
        self.group.barrier()
        self.release_local()

    def release_local(self):
        for name in ("intranode", "low_latency"):
            engine = getattr(self, name, None)
            if engine is not None:
                setattr(self, name, None)
                engine.destroy()

