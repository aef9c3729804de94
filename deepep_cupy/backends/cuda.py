"""The GPU backend of ``Buffer``: makes the launch plans of each op for the caller's framework, and
owns the engines (NVLink buffer, NVSHMEM buffer) and the communication stream they share.

``Buffer`` asks for a plan once per (op, shapes, dtypes, flags, framework) and then only calls
``plan.run``; everything here besides ``run`` is off the hot path.
"""

from __future__ import annotations

from ..device import nvshmem
from ..device.agreement import Agreement
from ..device.gpus import current_device_id
from ..device.group import CommGroup
from ..device.kernel_errors import KernelErrorRecord
from ..device.streams import current_stream
from ..errors import DeepEPTimeoutError
from ..frameworks import frame_for, framework_of, is_torch_dtype, to_cupy
from ..ops import limits
from ..ops.internode import plans as internode_plans
from ..ops.internode.engine import InternodeEngine
from ..ops.intranode import plans as intranode_plans
from ..ops.intranode.engine import IntranodeEngine
from ..ops.layout import LayoutPlan
from ..ops.low_latency.engine import LowLatencyEngine
from ..ops.low_latency.plans import CombinePlan, DispatchPlan

__all__ = ["CudaBackend"]

# How long a new plan waits for the other ranks' half of its agreement check before going on without it.
_AGREEMENT_WAIT_S = 0.05


class CudaBackend:
    """The ``Buffer.runtime`` on a GPU. Collective to construct and to destroy."""

    def __init__(self, group, *, num_nvl_bytes, num_rdma_bytes, num_nvl_ranks, low_latency_mode,
                 num_qps_per_rank, allow_nvlink, allow_mnnvl, use_fabric, enable_shrink, **_reference_only):
        # What the engines would refuse, before any of them allocates (the reference backend makes the same
        # check, so a CPU run refuses these sizes too).
        limits.buffer_sizes(group.size, num_nvl_ranks, num_nvl_bytes, num_rdma_bytes, low_latency_mode)
        import cupy

        self.group = group
        self.num_ranks = group.size
        self.rank = group.rank
        self.num_nvl_ranks = num_nvl_ranks
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.device_id = current_device_id()
        cupy.cuda.Device(self.device_id).use()
        self.comm_stream = cupy.cuda.Stream(non_blocking=True)
        self.intranode = None
        self.internode = None
        self.low_latency = None
        self._layout_errors = None
        self._agreed: set = set()
        self.pending_agreements: list = []
        self.spans_domains = num_nvl_ranks < self.num_ranks
        try:
            if num_nvl_bytes > 0 and not self.spans_domains:
                self.intranode = IntranodeEngine(group, self.device_id, num_nvl_bytes, use_fabric=use_fabric)
                self.intranode.on_tuning_change = self._tuning_changed
            if low_latency_mode or num_rdma_bytes > 0:
                self.low_latency = LowLatencyEngine(group, self.device_id, num_rdma_bytes,
                                                    allow_nvlink=allow_nvlink, num_qps_per_rank=num_qps_per_rank,
                                                    allow_mnnvl=allow_mnnvl, enable_shrink=enable_shrink)
            if self.spans_domains and num_nvl_bytes > 0 and num_rdma_bytes > 0:
                # One NVSHMEM buffer for both modes, as DeepEP's (the low-latency engine made it).
                self.internode = InternodeEngine(group, self.device_id, num_nvl_ranks, num_nvl_bytes, num_rdma_bytes,
                                                 rdma=self.low_latency.symmetric_buffer)
                self.internode.on_tuning_change = self._tuning_changed
        except BaseException:
            self.release_local()
            raise

    # ------------------------------------------------------------------ helpers
    #: Called with no arguments when the intranode or internode engine's ``tune`` changed its tuning (the
    #: Buffer drops its plans of the normal ops).
    plans_invalidated = None

    def _tuning_changed(self) -> None:
        if self.plans_invalidated is not None:
            self.plans_invalidated()

    def report_failure(self, op: str, exc: BaseException) -> None:
        """Nothing to do: a rank that fails before its launch leaves its peers' kernels to time out with an
        error naming it (the GPU path has no host exchange to join)."""

    def require_internode(self, op: str) -> None:
        limits.internode_buffers(op, self.num_ranks, self.num_nvl_ranks, self.num_nvl_bytes, self.num_rdma_bytes)

    def _engine(self, name: str):
        engine = getattr(self, name)
        if engine is None:
            need = "num_nvl_bytes > 0" if name == "intranode" else "low_latency_mode=True and num_rdma_bytes > 0"
            raise RuntimeError(f"this Buffer has no {name} buffer: create it with {need}")
        return engine

    def _normal_ops(self, op: str):
        """``(engine, plans module)`` of the high-throughput ops: the internode kernels when the group spans
        several NVLink domains, the intranode ones otherwise."""
        limits.normal_buffers(op, self.num_ranks, self.num_nvl_ranks, self.num_nvl_bytes, self.num_rdma_bytes)
        if self.spans_domains:
            return self.internode, internode_plans
        return self.intranode, intranode_plans

    def frame(self, obj):
        """The framework adapter for a caller's tensor (torch or CuPy on this device)."""
        framework = framework_of(obj)
        if framework == "torch":
            device = obj.get_device()
            if device != self.device_id:
                raise ValueError(f"tensors must be on cuda:{self.device_id} (this Buffer's device), got "
                                 f"{'the CPU' if device < 0 else f'cuda:{device}'}")
        elif framework == "cupy":
            if obj.data.device_id != self.device_id:
                raise ValueError(f"arrays must be on device {self.device_id} (this Buffer's device), got "
                                 f"{obj.data.device_id}")
        else:
            raise TypeError(f"expected a torch tensor or CuPy array, got {type(obj).__name__}")
        return frame_for(framework, self.device_id)

    def agree(self, op: str, **fields) -> None:
        """Check that every rank passes the same ``fields`` to ``op``, once per distinct set of values.

        Plans also depend on per-rank sizes (token counts), so a new plan is not new on every rank; these
        fields must be equal everywhere, so ranks that agree start the same checks in the same order. The
        check waits a little for the others (they normally arrive at once), then goes on: a rank that
        never comes (masked, dead) must not stop this one, and an unfinished check is looked at again by
        every later call (:meth:`poll_agreements`), which raises a disagreement on every rank.
        """
        key = (op, tuple(fields.items()))
        if key in self._agreed:
            return
        check = Agreement(self.group, op, fields)
        self._agreed.add(key)
        try:
            done = check.wait(_AGREEMENT_WAIT_S)
        except ValueError:
            self._agreed.discard(key)  # every rank saw the same rows: all of them check again next time
            raise
        if not done:
            self.pending_agreements.append(check)

    def poll_agreements(self) -> None:
        """Finish the agreement checks still in flight; raise the first disagreement found."""
        pending = self.pending_agreements
        for check in list(pending):
            if check.poll():
                pending.remove(check)

    @property
    def layout_errors(self):
        """The error record of the layout kernels (made at first use)."""
        if self._layout_errors is None:
            self._layout_errors = KernelErrorRecord()
        return self._layout_errors

    def get_comm_stream(self, torch_stream: bool):
        if torch_stream:
            import torch

            return torch.cuda.ExternalStream(self.comm_stream.ptr, device=torch.device("cuda", self.device_id))
        return self.comm_stream

    def local_buffer_tensor(self, dtype, size, offset, use_rdma_buffer):
        import numpy as np

        engine = self._engine("low_latency") if use_rdma_buffer else self._normal_ops("get_local_buffer_tensor")[0]
        ptr, nbytes = engine.local_buffer_view()
        is_torch = is_torch_dtype(dtype)
        if is_torch:
            import torch

            itemsize = torch.empty(0, dtype=dtype).element_size()
        else:
            itemsize = np.dtype(dtype).itemsize
        count = nbytes // itemsize - offset
        numel = count if size is None else int(np.prod(tuple(size)))
        if count < 0 or numel > count:
            raise ValueError(f"{numel} elements at offset {offset} do not fit the {nbytes}-byte buffer")
        shape = (numel,) if size is None else tuple(size)
        start = ptr + offset * itemsize
        if is_torch:
            raw = frame_for("torch", self.device_id).wrap(start, (numel * itemsize,), np.dtype(np.uint8), owner=engine)
            return raw.view(dtype).view(shape)
        import cupy

        mem = cupy.cuda.UnownedMemory(start, numel * itemsize, engine, self.device_id)
        return cupy.ndarray(shape, np.dtype(dtype), cupy.cuda.MemoryPointer(mem, 0))

    # ------------------------------------------------------------------ plans: high-throughput ops
    def plan_layout(self, topk_idx, num_experts, *, async_finish, allocate_on_comm_stream):
        return LayoutPlan(self.frame(topk_idx), num_tokens=int(topk_idx.shape[0]), num_topk=int(topk_idx.shape[1]),
                          num_experts=num_experts, num_ranks=self.num_ranks, num_nvl_ranks=self.num_nvl_ranks,
                          rank=self.rank, errors=self.layout_errors, comm_stream=self.comm_stream.ptr,
                          async_finish=async_finish)

    def plan_dispatch(self, x, x_scales, *, handle, num_tokens_per_expert, topk_idx, topk_weights,
                      expert_alignment, num_worst_tokens, config, async_finish, allocate_on_comm_stream):
        engine, plans = self._normal_ops("dispatch")
        plan = plans.DispatchPlan(engine, self.frame(x), x, x_scales, handle=handle,
                                  num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
                                  topk_weights=topk_weights, expert_alignment=expert_alignment,
                                  num_worst_tokens=num_worst_tokens, config=config,
                                  comm_stream=self.comm_stream.ptr, async_finish=async_finish)
        self.agree("dispatch", hidden_bytes=plan.hidden_bytes, num_scales=plan.num_scales, num_topk=plan.num_topk,
                   num_channels=plan.num_channels, ring_capacity=plan.cap, cached=handle is not None)
        return plan

    def plan_combine(self, x, handle, *, topk_weights, bias_0, bias_1, config, async_finish,
                     allocate_on_comm_stream, order_topk_idx=None, num_local_experts=1):
        engine, plans = self._normal_ops("combine")
        # V2's summation order: the intranode kernels only (across NVLink domains the V2 layer sums in its
        # own epilogue).
        order = {} if order_topk_idx is None else dict(order_topk_idx=order_topk_idx,
                                                       num_local_experts=num_local_experts)
        plan = plans.CombinePlan(engine, self.frame(x), x, handle, topk_weights=topk_weights, bias_0=bias_0,
                                 bias_1=bias_1, config=config, comm_stream=self.comm_stream.ptr,
                                 async_finish=async_finish, **order)
        self.agree("combine", hidden=int(x.shape[1]), num_topk=plan.num_topk, num_channels=plan.num_channels,
                   ring_capacity=plan.cap)
        return plan

    # ------------------------------------------------------------------ plans: low-latency ops
    def plan_low_latency_dispatch(self, x, topk_idx, *, num_max_dispatch_tokens_per_rank, num_experts,
                                  dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish,
                                  return_recv_hook):
        engine = self._engine("low_latency")
        hidden = int(x.shape[1])
        buffer_map = engine.make_buffer_map(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self.agree("low_latency_dispatch", num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                   hidden=hidden, num_experts=num_experts, use_fp8=use_fp8)
        wait_row = dispatch_wait_recv_cost_stats is not None and dispatch_wait_recv_cost_stats.ndim == 2
        return DispatchPlan(engine, self.frame(x), buffer_map, num_tokens=int(x.shape[0]),
                            topk=int(topk_idx.shape[1]), use_fp8=use_fp8, round_scale=round_scale,
                            use_ue8m0=use_ue8m0, return_recv_hook=return_recv_hook, wait_stats_row=int(wait_row),
                            async_finish=async_finish, comm_stream=self.comm_stream.ptr)

    def plan_low_latency_combine(self, x, topk_idx, handle, *, use_logfmt, zero_copy, combine_wait_recv_cost_stats,
                                 async_finish, return_recv_hook):
        engine = self._engine("low_latency")
        t_max, hidden, num_experts = int(handle[2]), int(handle[3]), int(handle[4])
        buffer_map = engine.make_buffer_map(t_max, hidden, num_experts)
        self.agree("low_latency_combine", num_max_dispatch_tokens_per_rank=t_max, hidden=hidden,
                   num_experts=num_experts, use_logfmt=use_logfmt)
        stats = combine_wait_recv_cost_stats
        wait_row = stats is not None and stats.ndim == 2
        return CombinePlan(engine, self.frame(topk_idx), buffer_map, num_tokens=int(topk_idx.shape[0]),
                           topk=int(topk_idx.shape[1]), use_logfmt=use_logfmt, zero_copy=zero_copy,
                           return_recv_hook=return_recv_hook, wait_stats_row=int(wait_row),
                           async_finish=async_finish, comm_stream=self.comm_stream.ptr)

    def get_next_low_latency_combine_buffer(self, handle):
        engine = self._engine("low_latency")
        buffer_map = engine.make_buffer_map(int(handle[2]), int(handle[3]), int(handle[4]))
        return engine.combine_buffer_view(self.frame(handle[0]), buffer_map, engine.peek_next_buffer())

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        engine = self._engine("low_latency")
        engine.make_buffer_map(num_max_dispatch_tokens_per_rank, hidden, num_experts)  # the limits, before any wait
        stream = current_stream(None, self.device_id)
        engine.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts, stream=stream)

    def low_latency_update_mask_buffer(self, rank, mask):
        self._engine("low_latency").update_mask(rank, mask)

    def low_latency_query_mask_buffer(self, mask_status):
        self._engine("low_latency").query_mask(to_cupy(mask_status))

    def low_latency_clean_mask_buffer(self):
        self._engine("low_latency").clean_mask()

    # ------------------------------------------------------------------ lifetime
    def destroy(self):
        """A barrier (no peer may still write into this rank's buffers), then the release. The barrier waits at
        most ``DEEPEP_CUPY_TIMEOUT_S``; when a rank does not come (dead, or masked and gone) the buffers that
        need no peer are released, the NVSHMEM memory stays allocated (its free is collective and would never
        return), and the barrier's ``DeepEPTimeoutError`` names the missing ranks; NVSHMEM then remembers them
        as lost (``device/nvshmem.py``), so that neither a later free nor the interpreter's exit waits for them."""

        everyone = False
        try:
            if isinstance(self.group, CommGroup):
                self.group.barrier(op="Buffer.destroy")
            else:
                self.group.barrier()
            everyone = True
        except DeepEPTimeoutError as exc:
            # Ranks that did not come may never make another NVSHMEM call: from now on this process makes no
            # collective NVSHMEM call (free, finalize at exit), which would wait for them forever.

            nvshmem.mark_peers_lost(self.group, getattr(exc, "missing", None))
            raise
        finally:
            try:
                if not everyone:
                    # Freeing NVSHMEM memory is collective: with a rank missing it would never return.
                    self.low_latency = None
                    if self.internode is not None:
                        self.internode.forget_symmetric_memory()
                self.release_local()
            finally:
                close = getattr(self.group, "close", None)
                if close is not None:
                    close()

    def release_local(self):
        for name in ("intranode", "internode", "low_latency"):  # internode before the memory it shares
            engine = getattr(self, name, None)
            if engine is not None:
                setattr(self, name, None)
                engine.destroy()
