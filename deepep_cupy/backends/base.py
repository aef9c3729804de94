"""What ``Buffer`` asks of a backend: the contract :class:`~.cuda.CudaBackend` and
:class:`~.reference.ReferenceBackend` both fulfil.

A ``plan_*`` method is called once per new plan key (see :mod:`deepep_cupy.ops.plan`) after the
argument checks, and returns an object whose ``run`` the ``Buffer`` then calls on every call with that
key; everything else is off the hot path.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Backend", "Plan"]


class Plan(Protocol):
    """A prepared op: ``run`` takes the call's tensors and returns DeepEP's result tuple."""

    def run(self, *args, **kwargs): ...


@runtime_checkable
class Backend(Protocol):
    #: Agreement checks across ranks still in flight; the Buffer polls them while the list is not empty.
    pending_agreements: list
    #: Set by the Buffer: called when a change of engine tuning makes the normal ops' plans stale.
    plans_invalidated: object

    def poll_agreements(self) -> None:
        """Finish the agreement checks in flight; raise the first disagreement found."""

    def report_failure(self, op: str, exc: BaseException) -> None:
        """``exc`` was raised on this rank before ``op`` reached the other ranks: make them raise it too
        where the op starts with a host exchange."""

    def require_internode(self, op: str) -> None:
        """Raise if ``op`` needs internode buffers this backend was not created with."""

    def get_comm_stream(self, torch_stream: bool): ...

    def local_buffer_tensor(self, dtype, size, offset: int, use_rdma_buffer: bool): ...

    def plan_layout(self, topk_idx, num_experts: int, *, async_finish: bool,
                    allocate_on_comm_stream: bool) -> Plan: ...

    def plan_dispatch(self, x, x_scales, *, handle, num_tokens_per_expert, topk_idx, topk_weights,
                      expert_alignment: int, num_worst_tokens: int, config, async_finish: bool,
                      allocate_on_comm_stream: bool) -> Plan: ...

    def plan_combine(self, x, handle, *, topk_weights, bias_0, bias_1, config, async_finish: bool,
                     allocate_on_comm_stream: bool, order_topk_idx=None, num_local_experts: int = 1) -> Plan: ...

    def plan_low_latency_dispatch(self, x, topk_idx, *, num_max_dispatch_tokens_per_rank: int,
                                  num_experts: int, dispatch_wait_recv_cost_stats, use_fp8: bool,
                                  round_scale: bool, use_ue8m0: bool, async_finish: bool,
                                  return_recv_hook: bool) -> Plan: ...

    def plan_low_latency_combine(self, x, topk_idx, handle, *, use_logfmt: bool, zero_copy: bool,
                                 combine_wait_recv_cost_stats, async_finish: bool,
                                 return_recv_hook: bool) -> Plan: ...

    def get_next_low_latency_combine_buffer(self, handle): ...

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None: ...

    def low_latency_update_mask_buffer(self, rank: int, mask: bool) -> None: ...

    def low_latency_query_mask_buffer(self, mask_status) -> None: ...

    def low_latency_clean_mask_buffer(self) -> None: ...

    def destroy(self) -> None:
        """Release everything (collective on the GPU backend, local on the reference one)."""

    def release_local(self) -> None:
        """Release what needs no peer (the destructor's path)."""
