"""The public ``Buffer``: DeepEP V1's API over a GPU backend or the NumPy reference backend.

This layer validates arguments, converts tensors to what the chosen backend consumes, and returns
results in the caller's framework. The work itself lives in the backends (``backends/cuda.py``: kernels;
``backends/reference.py``: the NumPy oracle of ``reference/``).
"""

from __future__ import annotations

from . import checks
from .buffer_low_latency import LowLatencyOps
from .config import Config, low_latency_rdma_size_hint
from .custom_ops import tracing_check
from .event import EventHandle, EventOverlap
from .frameworks import I32, I64, meta, shape_of
from .ops.handles import device_handle_values, handle_meta
from .ops.plan import config_key, lookup, store
from .tuning import tuned_config

__all__ = ["Buffer"]

# torch.compile: True only while dynamo traces a call (then the call goes to deepep_cupy.custom_ops's custom ops).
_compiling = tracing_check(globals())


# Recommended configs per rank count; other counts use the nearest entry. Ring capacities follow DeepEP's
# tables (so buffers sized from them fit); the send chunks are our kernels' fastest at 2, 4 and 8 ranks: the
# combine releases each token on its own (a quarter faster than four at a time at 4 ranks), the dispatch 4.
_DISPATCH_CONFIGS = {2: (4, 256, 6, 128), 4: (4, 256, 6, 128), 8: (4, 256, 6, 128), 16: (36, 288, 20, 128),
                     24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 64: (32, 288, 8, 128),
                     128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
_COMBINE_CONFIGS = {2: (1, 256, 6, 128), 4: (1, 256, 6, 128), 8: (1, 256, 6, 128), 16: (4, 288, 12, 128),
                    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 64: (1, 288, 8, 128),
                    128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def _pick_config(table: dict, num_ranks: int, hidden: int | None = None) -> Config:
    # Configs stored by `python -m deepep_cupy.tuning` for this GPU model and rank count come first; after
    # set_num_sms, the ones tuned at that SM count.
    tuned = tuned_config("dispatch" if table is _DISPATCH_CONFIGS else "combine", num_ranks, hidden,
                         Buffer.num_sms if Buffer._num_sms_set else None)
    if tuned is not None:
        return tuned
    key = min(table, key=lambda k: (abs(k - num_ranks), k))
    return Config(Buffer.num_sms, *table[key])


class Buffer(LowLatencyOps):
    """Communication buffers for expert-parallel MoE: dispatch tokens to the ranks holding their experts
    and combine the expert outputs back.

    Three families of kernels, as in DeepEP: high-throughput intranode (NVLink), high-throughput
    internode (RDMA + NVLink) and low-latency (NVSHMEM, for decoding). Without a GPU every operation
    runs on the NumPy reference backend with the same semantics.

    Attributes:
        num_sms: SMs the high-throughput kernels use (class-wide, see ``set_num_sms``).
        rank: this process's rank in the group.
        group_size: number of ranks.
        group: the process group or communicator given.
        num_nvl_bytes: size of the NVLink buffer.
        num_rdma_bytes: size of the NVSHMEM (RDMA / low-latency) buffer.
        num_nvl_ranks: ranks per NVLink domain (GPUs per host unless overridden).
        backend: 'cuda' or 'reference'.
    """

    # ------------------------------------------------------------------ static helpers
    @staticmethod
    def is_sm90_compiled() -> bool:
        """Kernels are compiled at first use for the GPU at hand, so SM90 support is always there."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SMs the high-throughput kernels use (even: one sender and one receiver SM per channel)."""
        checks.positive_int("new_num_sms", new_num_sms)
        if new_num_sms % 2 != 0:
            raise ValueError(f"new_num_sms must be even, got {new_num_sms}")
        Buffer.num_sms = int(new_num_sms)
        Buffer._num_sms_set = True

    @staticmethod
    def get_dispatch_config(num_ranks: int, hidden: int | None = None) -> Config:
        """A recommended dispatch ``Config`` for ``num_ranks`` ranks.

        The one ``python -m deepep_cupy.tuning`` stored for this GPU model, ``num_ranks`` and ``hidden`` (None:
        the hidden size tuned last) when there is one, else the built-in recommendation.
        """
        return _pick_config(_DISPATCH_CONFIGS, checks.positive_int("num_ranks", num_ranks), hidden)

    @staticmethod
    def get_combine_config(num_ranks: int, hidden: int | None = None) -> Config:
        """A recommended combine ``Config`` for ``num_ranks`` ranks (tuned or built-in, as ``get_dispatch_config``)."""
        return _pick_config(_COMBINE_CONFIGS, checks.positive_int("num_ranks", num_ranks), hidden)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Minimum ``num_rdma_bytes`` for the low-latency kernels (sized for BF16, two buffers).

        Arguments:
            num_max_dispatch_tokens_per_rank: most tokens any rank dispatches at once (same on all ranks).
            hidden: hidden size.
            num_ranks: ranks in the group.
            num_experts: total experts.
        """
        for name, v in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                        ("hidden", hidden), ("num_ranks", num_ranks), ("num_experts", num_experts)):
            checks.positive_int(name, v)
        return low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the caller's current stream (torch's when torch uses CUDA, else CuPy's);
        without a GPU, or inside a compiled region (whose ops run in stream order), one with nothing to wait
        for."""
        if _compiling():
            return EventOverlap(None)
        return EventOverlap(EventHandle())

    def _default_config(self, table: dict) -> Config:
        key = (id(table), Buffer.num_sms)
        config = self._default_configs.get(key)
        if config is None:
            config = self._default_configs[key] = _pick_config(table, self.group_size)
        return config

    # ------------------------------------------------------------------ high-throughput ops
    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Count what each rank, node and expert receives, from the top-k routing.

        Arguments:
            topk_idx: `[num_tokens, num_topk]` int64 (``topk_idx_t``): expert chosen by each token, -1 for none.
            num_experts: total experts.
            previous_event: event the kernel waits for before starting.
            async_finish: do not make the current stream wait; wait on the returned event instead.
            allocate_on_comm_stream: allocate outputs on the communication stream.

        Returns:
            num_tokens_per_rank: `[num_ranks]` int32, tokens sent to each rank.
            num_tokens_per_rdma_rank: `[num_rdma_ranks]` int32, tokens sent to each node; None within one node.
            num_tokens_per_expert: `[num_experts]` int32, tokens sent to each expert.
            is_token_in_rank: `[num_tokens, num_ranks]` bool, whether a token goes to a rank.
            event: an ``EventOverlap`` (meaningful with ``async_finish``).
        """
        if _compiling():  # torch.compile
            from .custom_ops import normal as traced
            return traced.get_dispatch_layout(self, topk_idx, num_experts, previous_event)
        with self._frames.layout:
            # The type too: 8.0 == 8, and a float must not find the plan an int made (its checks refuse it).
            key = (meta(topk_idx), num_experts, type(num_experts), async_finish, allocate_on_comm_stream)
            plan = lookup(self._layout_plans, key)
            if plan is None:
                num_experts = checks.num_experts_ok(num_experts, self.group_size)
                checks.tensor("topk_idx", topk_idx, dtype=I64, ndim=2)
                plan = store(self._layout_plans, key, self.runtime.plan_layout(
                    topk_idx, num_experts, async_finish=bool(async_finish),
                    allocate_on_comm_stream=bool(allocate_on_comm_stream)))
            if self._host_values:
                checks.topk_values("topk_idx", topk_idx, num_experts)
            return plan.run(topk_idx, previous_event)

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token to every rank that holds one of its experts.

        Arguments:
            x: `[num_tokens, hidden]` bf16, or a tuple `(x_e4m3 [num_tokens, hidden], scales
                [num_tokens, hidden // 128] float32)` for FP8 (scales may be column-major). NumPy/CuPy
                callers use ``ml_dtypes.bfloat16`` / ``ml_dtypes.float8_e4m3fn``.
            handle: a handle from an earlier dispatch: repeat its routing (cached mode, no top-k).
            num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert: from
                ``get_dispatch_layout``.
            topk_idx: `[num_tokens, num_topk]` int64 expert ids (-1 for none); optional.
            topk_weights: `[num_tokens, num_topk]` float32 weights; given together with ``topk_idx``.
            expert_alignment: round each local expert's received count up to a multiple of this.
            num_worst_tokens: when > 0, outputs have this many rows and no CPU sync happens (graph-capturable).
            config: tuning; default ``get_dispatch_config(group_size)``.
            previous_event, async_finish, allocate_on_comm_stream: stream control as in ``get_dispatch_layout``.

        Returns:
            recv_x: received tokens (a tuple with received scales for FP8), grouped by source rank in rank
                order and in source token order within a source.
            recv_topk_idx: `[num_recv, num_topk]` int64, expert ids local to this rank, -1 for other ranks' experts.
            recv_topk_weights: `[num_recv, num_topk]` float32, 0 where ``recv_topk_idx`` is -1.
            num_recv_tokens_per_expert_list: list of received tokens per local expert (aligned); empty with
                ``num_worst_tokens``.
            handle: routing for ``combine`` and cached dispatches. Within one NVLink domain DeepEP's 6-tuple:
                ``handle[0]`` is the `[num_ranks, num_ranks]` prefix matrix (entry [i][r]: tokens rank r receives
                from ranks 0..i). Across several domains DeepEP's 10-tuple (``reference/internode.py``):
                ``handle[0]`` is ``is_token_in_rank``, ``handle[-4]`` the `[num_ranks]` prefix sum of the tokens
                received from each rank.
            event: an ``EventOverlap``.
        """
        if _compiling():  # torch.compile
            from .custom_ops import normal as traced
            return traced.dispatch(self, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                   num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                   num_worst_tokens, config, previous_event)
        with self._frames.dispatch:
            if self._num_rdma_ranks > 1:
                self._internode_ready("internode_dispatch", num_tokens_per_rdma_rank)
            if config is None:
                config = self._default_config(_DISPATCH_CONFIGS)
            return self._dispatch(x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                  topk_weights, expert_alignment, num_worst_tokens, config, previous_event,
                                  async_finish, allocate_on_comm_stream)

    def _dispatch(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                  topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
                  allocate_on_comm_stream):
        scales = None
        if type(x) is tuple and len(x) == 2:  # FP8 (DeepEP's type); a list is refused by the checks
            x, scales = x
        key = (meta(x), meta(scales), handle_meta(handle), meta(num_tokens_per_rank), meta(is_token_in_rank),
               meta(num_tokens_per_expert), meta(topk_idx), meta(topk_weights), expert_alignment, num_worst_tokens,
               config_key(config), async_finish, allocate_on_comm_stream)
        plan = lookup(self._dispatch_plans, key)
        if plan is None:
            plan = self._new_dispatch_plan(key, x if scales is None else (x, scales), handle, num_tokens_per_rank,
                                           is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                           expert_alignment, num_worst_tokens, config, async_finish,
                                           allocate_on_comm_stream)
        if handle is not None and self.backend == "cuda":
            device_handle_values(self, handle)
        if self._host_values and topk_idx is not None:
            checks.topk_values("topk_idx", topk_idx, shape_of(num_tokens_per_expert)[0],
                              bound="the length of num_tokens_per_expert, which needs one entry per expert")
        return plan.run(x, scales, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                        topk_weights, previous_event)

    def _new_dispatch_plan(self, key, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                           topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, async_finish,
                           allocate_on_comm_stream):
        checks.dispatch_args(self.group_size, x, handle, num_tokens_per_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                             config, num_rdma_ranks=self._num_rdma_ranks)
        data, scales = (x if isinstance(x, (tuple, list)) else (x, None))
        plan = self.runtime.plan_dispatch(
            data, scales, handle=handle, num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
            topk_weights=topk_weights, expert_alignment=int(expert_alignment),
            num_worst_tokens=int(num_worst_tokens), config=config, async_finish=bool(async_finish),
            allocate_on_comm_stream=bool(allocate_on_comm_stream))
        return store(self._dispatch_plans, key, plan)

    def combine(self, x, handle, topk_weights=None, bias=None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Send expert outputs back to the tokens' ranks and **sum** them (no weights applied).

        Arguments:
            x: `[num_recv_tokens, hidden]` bf16, rows in the order ``dispatch`` returned them.
            handle: the handle returned by ``dispatch``.
            topk_weights: optional `[num_recv_tokens, num_topk]` float32, summed the same way.
            bias: optional `[num_tokens, hidden]` bf16 tensor, or a tuple of two, added to the result.
            config, previous_event, async_finish, allocate_on_comm_stream: as in ``dispatch``.

        Returns:
            combined_x: `[num_tokens, hidden]` bf16 sums.
            combined_topk_weights: `[num_tokens, num_topk]` float32 sums, or None.
            event: an ``EventOverlap``.
        """
        if _compiling():  # torch.compile
            from .custom_ops import normal as traced
            return traced.combine(self, x, handle, topk_weights, bias, config, previous_event)
        with self._frames.combine:
            if self._num_rdma_ranks > 1:
                self._internode_ready("internode_combine")
            return self._combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                 allocate_on_comm_stream)

    def _combine(self, x, handle, topk_weights, bias, config, previous_event, async_finish,
                 allocate_on_comm_stream, order_topk_idx=None, num_local_experts: int = 1):
        """``combine``'s work; ``order_topk_idx`` (the V2 layer's, within one NVLink domain): the source tokens'
        top-k, to sum each token's rows in V2's order (``reference.normal.combine``) instead of rank order."""
        if config is None:
            config = self._default_config(_COMBINE_CONFIGS)
        if type(bias) is tuple or type(bias) is list:
            bias_0, bias_1 = checks.split_bias(bias)
        else:
            bias_0, bias_1 = bias, None
        key = (meta(x), handle_meta(handle), meta(topk_weights), meta(bias_0), meta(bias_1), config_key(config),
               async_finish, allocate_on_comm_stream, meta(order_topk_idx), num_local_experts)
        plan = lookup(self._combine_plans, key)
        if plan is None:
            checks.combine_args(self.group_size, x, handle, topk_weights, bias, config,
                                num_rdma_ranks=self._num_rdma_ranks)
            plan = store(self._combine_plans, key, self.runtime.plan_combine(
                x, handle, topk_weights=topk_weights, bias_0=bias_0, bias_1=bias_1, config=config,
                async_finish=bool(async_finish), allocate_on_comm_stream=bool(allocate_on_comm_stream),
                order_topk_idx=order_topk_idx, num_local_experts=num_local_experts))
        if self.backend == "cuda":
            device_handle_values(self, handle)
        if order_topk_idx is None:
            return plan.run(x, handle, topk_weights, bias_0, bias_1, previous_event)
        return plan.run(x, handle, topk_weights, bias_0, bias_1, previous_event, order_topk_idx)

    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                           is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                           previous_event: EventOverlap | None = None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False):
        """Dispatch across NVLink domains (RDMA between nodes, NVLink within); see ``dispatch``.

        ``dispatch`` calls this by itself when the group spans more than one NVLink domain.
        """
        if _compiling():  # torch.compile
            from .custom_ops import normal as traced
            return traced.dispatch(self, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                   num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                   num_worst_tokens, config, previous_event)
        with self._frames.dispatch:
            self._internode_ready("internode_dispatch", num_tokens_per_rdma_rank)
            if config is None:
                config = self._default_config(_DISPATCH_CONFIGS)
            return self._dispatch(x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                  topk_weights, expert_alignment, num_worst_tokens, config, previous_event,
                                  async_finish, allocate_on_comm_stream)

    def internode_combine(self, x, handle, topk_weights=None, bias=None, config: Config | None = None,
                          previous_event: EventOverlap | None = None, async_finish: bool = False,
                          allocate_on_comm_stream: bool = False):
        """Combine across NVLink domains; see ``combine``."""
        if _compiling():  # torch.compile
            from .custom_ops import normal as traced
            return traced.combine(self, x, handle, topk_weights, bias, config, previous_event)
        with self._frames.combine:
            self._internode_ready("internode_combine")
            return self._combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                 allocate_on_comm_stream)

    def _internode_ready(self, op: str, num_tokens_per_rdma_rank=None) -> None:
        """What an op across NVLink domains needs before its plan: the internode buffers, and the per-domain
        counts (when given) of one entry per domain."""
        if num_tokens_per_rdma_rank is not None:
            checks.tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, dtype=I32,
                          shape=(self._num_rdma_ranks,))
        self.runtime.require_internode(op)
