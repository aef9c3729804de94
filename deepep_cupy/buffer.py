"""The public ``Buffer``: DeepEP V1's API over a GPU backend or the NumPy reference backend.

This layer validates arguments, converts tensors to what the chosen backend consumes, and returns
results in the caller's framework. The work itself lives in ``cuda_runtime`` (kernels) and
``reference`` (NumPy oracle).
"""

from __future__ import annotations

import os
import socket

from . import validate as check
from .config import Config, low_latency_rdma_size_hint
from .event import EventOverlap
from .interop import BF16, FP8, shape_of
from .interop import BOOL as _BOOL
from .interop import F32 as _F32
from .interop import I32 as _I32
from .interop import I64 as _I64
from .runtime.device import gpu_count
from .runtime.group import make_group

__all__ = ["Buffer"]


# Recommended configs per rank count; other counts use the nearest entry. Ring capacities follow DeepEP's
# tables (so buffers sized from them fit); the send chunks are tuned for our kernels on 2, 4 and 8 x H200
# (combine: one release per token, 837 us against 1062 us at 4 tokens on 4 ranks; dispatch: 4 tokens).
_DISPATCH_CONFIGS = {2: (4, 256, 6, 128), 4: (4, 256, 6, 128), 8: (4, 256, 6, 128), 16: (36, 288, 20, 128),
                     24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 64: (32, 288, 8, 128),
                     128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
_COMBINE_CONFIGS = {2: (1, 256, 6, 128), 4: (1, 256, 6, 128), 8: (1, 256, 6, 128), 16: (4, 288, 12, 128),
                    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 64: (1, 288, 8, 128),
                    128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def _pick_config(table: dict, num_ranks: int) -> Config:
    key = min(table, key=lambda k: (abs(k - num_ranks), k))
    return Config(Buffer.num_sms, *table[key])


def _choose_backend(requested: str | None) -> str:
    choice = (requested or os.environ.get("DEEPEP_CUPY_BACKEND", "auto")).lower()
    if choice not in ("auto", "cuda", "reference"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'reference', got {choice!r}")
    if choice == "auto":
        return "cuda" if gpu_count() > 0 else "reference"
    if choice == "cuda" and gpu_count() == 0:
        raise RuntimeError("backend='cuda' was requested but no CUDA GPU is visible")
    return choice


class Buffer:
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

    num_sms: int = 20

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm=None, *, backend: str | None = None, num_nvl_ranks: int | None = None) -> None:
        """Create the buffers; collective over the group.

        Arguments:
            group: a ``torch.distributed.ProcessGroup`` (or None when ``comm`` is given).
            num_nvl_bytes: bytes of NVLink-shared memory per rank for the high-throughput kernels.
            num_rdma_bytes: bytes of NVSHMEM symmetric memory per rank (internode and low-latency kernels).
            low_latency_mode: enable the low-latency kernels.
            num_qps_per_rank: RDMA queue pairs per peer for NVSHMEM transports that use them.
            allow_nvlink_for_low_latency_mode: let low-latency kernels store over NVLink to peers that
                are reachable that way (otherwise every transfer goes through the NVSHMEM network transport).
            allow_mnnvl: allow multi-node NVLink in NVSHMEM.
            use_fabric: share NVLink buffers as fabric handles (multi-node NVLink) instead of file descriptors.
            explicitly_destroy: resources are released only by ``destroy()``, never by the destructor.
            enable_shrink: a rank that stops answering is masked instead of failing the low-latency kernels.
            comm: an ``mpi4py.MPI.Comm`` used when ``group`` is None.
            backend: 'cuda', 'reference' or None (``$DEEPEP_CUPY_BACKEND``, default: the GPU when one is visible).
            num_nvl_ranks: ranks per NVLink domain; default ``$DEEPEP_CUPY_NVL_RANKS`` or the ranks on this host.
        """
        self._group = make_group(group, comm)
        self.group = group if group is not None else comm
        self.rank = self._group.rank
        self.group_size = self._group.size
        self.num_nvl_bytes = check.nonneg_int("num_nvl_bytes", num_nvl_bytes)
        self.num_rdma_bytes = check.nonneg_int("num_rdma_bytes", num_rdma_bytes)
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)
        self.num_qps_per_rank = check.positive_int("num_qps_per_rank", num_qps_per_rank)
        self.num_nvl_ranks = self._nvl_domain_size(num_nvl_ranks)
        self.backend = _choose_backend(backend)
        self._destroyed = False
        if self.backend == "reference":
            from .reference_runtime import ReferenceRuntime

            self.runtime = ReferenceRuntime(self._group, num_nvl_ranks=self.num_nvl_ranks,
                                            low_latency_mode=self.low_latency_mode,
                                            enable_shrink=self.enable_shrink,
                                            num_channels=max(self.num_sms // 2, 1))
        else:
            from .cuda_runtime import CudaRuntime

            self.runtime = CudaRuntime(self._group, num_nvl_bytes=self.num_nvl_bytes,
                                       num_rdma_bytes=self.num_rdma_bytes, num_nvl_ranks=self.num_nvl_ranks,
                                       low_latency_mode=self.low_latency_mode,
                                       num_qps_per_rank=self.num_qps_per_rank,
                                       allow_nvlink=bool(allow_nvlink_for_low_latency_mode),
                                       allow_mnnvl=bool(allow_mnnvl), use_fabric=bool(use_fabric),
                                       enable_shrink=self.enable_shrink)

    def _nvl_domain_size(self, requested: int | None) -> int:
        env = os.environ.get("DEEPEP_CUPY_NVL_RANKS")
        if requested is None and env:
            requested = int(env)
        if requested is None:
            hosts = self._group.allgather_object(socket.gethostname())
            requested = hosts.count(hosts[self.rank])
        requested = check.positive_int("num_nvl_ranks", requested)
        if self.group_size % requested != 0:
            raise ValueError(f"num_nvl_ranks ({requested}) must divide the group size ({self.group_size})")
        return requested

    # ------------------------------------------------------------------ static helpers
    @staticmethod
    def is_sm90_compiled() -> bool:
        """Kernels are compiled at first use for the GPU at hand, so SM90 support is always there."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SMs the high-throughput kernels use (even: one sender and one receiver SM per channel)."""
        check.positive_int("new_num_sms", new_num_sms)
        if new_num_sms % 2 != 0:
            raise ValueError(f"new_num_sms must be even, got {new_num_sms}")
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A recommended dispatch ``Config`` for ``num_ranks`` ranks."""
        return _pick_config(_DISPATCH_CONFIGS, check.positive_int("num_ranks", num_ranks))

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """A recommended combine ``Config`` for ``num_ranks`` ranks."""
        return _pick_config(_COMBINE_CONFIGS, check.positive_int("num_ranks", num_ranks))

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
            check.positive_int(name, v)
        return low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the caller's current stream (torch's when torch uses CUDA, else CuPy's)."""
        if gpu_count() == 0:
            return EventOverlap(None)
        from .runtime.device import current_device_id
        from .runtime.streams import DeviceEvent, current_stream

        dev = current_device_id()
        return EventOverlap(DeviceEvent(current_stream(None, dev), None, dev))

    # ------------------------------------------------------------------ plumbing
    def _alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this Buffer was destroyed")

    @property
    def _num_rdma_ranks(self) -> int:
        return self.group_size // self.num_nvl_ranks

    def _num_experts_ok(self, num_experts) -> int:
        num_experts = check.positive_int("num_experts", num_experts)
        if num_experts % self.group_size != 0:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the number of ranks "
                             f"({self.group_size})")
        return num_experts

    def get_comm_stream(self):
        """The communication stream (torch stream for torch groups, CuPy stream otherwise); None on the reference backend."""
        self._alive()
        return self.runtime.get_comm_stream(torch_stream=self.group is not None and not hasattr(self.group, "Get_rank"))

    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False):
        """A view of this rank's raw NVLink (or NVSHMEM, with ``use_rdma_buffer``) buffer.

        Arguments:
            dtype: element type (a torch dtype returns a torch tensor, a NumPy/ml_dtypes dtype a CuPy array).
            size: optional shape of the slice, in elements.
            offset: first element of the slice.
            use_rdma_buffer: view the NVSHMEM buffer instead of the NVLink one.
        """
        self._alive()
        return self.runtime.local_buffer_tensor(dtype, size, check.nonneg_int("offset", offset), use_rdma_buffer)

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
        self._alive()
        num_experts = self._num_experts_ok(num_experts)
        check.tensor("topk_idx", topk_idx, dtype=_I64, ndim=2)
        check.topk_values("topk_idx", topk_idx, num_experts)
        return self.runtime.get_dispatch_layout(topk_idx, num_experts, previous_event=previous_event,
                                                async_finish=async_finish,
                                                allocate_on_comm_stream=allocate_on_comm_stream)

    def _check_x(self, x):
        """Split BF16 ``x`` or the FP8 tuple ``(x_e4m3, scales)``; return (x, scales, num_tokens, hidden)."""
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise ValueError("an FP8 x must be a tuple (x_e4m3 [N, H], scales [N, H/128])")
            data, scales = x
            n, h = check.tensor("x[0]", data, dtype=FP8, ndim=2)
            if h % 128 != 0:
                raise ValueError(f"FP8 hidden size must be a multiple of 128, got {h}")
            check.tensor("x[1]", scales, dtype=_F32, shape=(n, h // 128), contiguous=False)
            return data, scales, n, h
        n, h = check.tensor("x", x, dtype=BF16, ndim=2)
        if h % 8 != 0:
            raise ValueError(f"BF16 hidden size must be a multiple of 8, got {h}")
        return x, None, n, h

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
            handle: routing for ``combine`` and cached dispatches; ``handle[0]`` is the `[num_ranks, num_ranks]`
                prefix matrix (entry [i][r]: tokens rank r receives from ranks 0..i).
            event: an ``EventOverlap``.
        """
        self._alive()
        config = self.get_dispatch_config(self.group_size) if config is None else config
        if self._num_rdma_ranks > 1:
            return self.internode_dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                           is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                           expert_alignment, num_worst_tokens, config, previous_event,
                                           async_finish, allocate_on_comm_stream)
        return self._dispatch(x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                              topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                              previous_event, async_finish, allocate_on_comm_stream)

    def _dispatch(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                  topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
                  allocate_on_comm_stream):
        data, scales, n, hidden = self._check_x(x)
        expert_alignment = check.positive_int("expert_alignment", expert_alignment)
        num_worst_tokens = check.nonneg_int("num_worst_tokens", num_worst_tokens)
        if not isinstance(config, Config):
            raise TypeError(f"config must be a deepep_cupy.Config, got {type(config).__name__}")
        r = self.group_size
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle given) takes no topk_idx/topk_weights")
            check.handle(handle, 6, "dispatch")
            check.tensor("handle[4] (is_token_in_rank)", handle[4], dtype=_BOOL, shape=(n, r))
        else:
            check.tensor("num_tokens_per_rank", num_tokens_per_rank, dtype=_I32, shape=(r,))
            check.tensor("is_token_in_rank", is_token_in_rank, dtype=_BOOL, shape=(n, r))
            if num_tokens_per_expert is None:
                raise ValueError("num_tokens_per_expert is required (from get_dispatch_layout)")
            (e,) = check.tensor("num_tokens_per_expert", num_tokens_per_expert, dtype=_I32, ndim=1)
            self._num_experts_ok(e)
            if (topk_idx is None) != (topk_weights is None):
                raise ValueError("topk_idx and topk_weights must be given together")
            if topk_idx is not None:
                _, k = check.tensor("topk_idx", topk_idx, dtype=_I64, ndim=2)
                if shape_of(topk_idx)[0] != n:
                    raise ValueError(f"topk_idx must have {n} rows like x, got {shape_of(topk_idx)[0]}")
                check.tensor("topk_weights", topk_weights, dtype=_F32, shape=(n, k))
                check.topk_values("topk_idx", topk_idx, e)
        return self.runtime.dispatch(
            data, scales, handle=handle, num_tokens_per_rank=num_tokens_per_rank,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
            topk_weights=topk_weights, expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
            config=config, previous_event=previous_event, async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)

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
        self._alive()
        config = self.get_combine_config(self.group_size) if config is None else config
        if self._num_rdma_ranks > 1:
            return self.internode_combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                          allocate_on_comm_stream)
        return self._combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                             allocate_on_comm_stream)

    def _combine(self, x, handle, topk_weights, bias, config, previous_event, async_finish,
                 allocate_on_comm_stream):
        check.handle(handle, 6, "dispatch")
        m, hidden = check.tensor("x", x, dtype=BF16, ndim=2)
        if hidden % 8 != 0:
            raise ValueError(f"BF16 hidden size must be a multiple of 8, got {hidden}")
        if not isinstance(config, Config):
            raise TypeError(f"config must be a deepep_cupy.Config, got {type(config).__name__}")
        num_recv = shape_of(handle[3])[0]
        if m < num_recv:
            raise ValueError(f"x has {m} rows but the handle describes {num_recv} received tokens")
        if topk_weights is not None:
            check.tensor("topk_weights", topk_weights, dtype=_F32, ndim=2)
            if shape_of(topk_weights)[0] != m:
                raise ValueError(f"topk_weights must have {m} rows like x, got {shape_of(topk_weights)[0]}")
        n = shape_of(handle[4])[0]
        bias_0, bias_1 = (bias if isinstance(bias, (tuple, list)) else (bias, None))
        if isinstance(bias, (tuple, list)) and len(bias) != 2:
            raise ValueError("bias must be one tensor or a tuple of two")
        check.optional_tensor("bias[0]", bias_0, dtype=BF16, shape=(n, hidden))
        check.optional_tensor("bias[1]", bias_1, dtype=BF16, shape=(n, hidden))
        return self.runtime.combine(x, handle, topk_weights=topk_weights, bias_0=bias_0, bias_1=bias_1,
                                    config=config, previous_event=previous_event, async_finish=async_finish,
                                    allocate_on_comm_stream=allocate_on_comm_stream)

    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                           is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                           previous_event: EventOverlap | None = None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False):
        """Dispatch across NVLink domains (RDMA between nodes, NVLink within); see ``dispatch``.

        ``dispatch`` calls this by itself when the group spans more than one NVLink domain.
        """
        self._alive()
        if num_tokens_per_rdma_rank is not None:
            check.tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, dtype=_I32,
                         shape=(self._num_rdma_ranks,))
        config = self.get_dispatch_config(self.group_size) if config is None else config
        self.runtime.require_internode("internode_dispatch")
        return self._dispatch(x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                              topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                              previous_event, async_finish, allocate_on_comm_stream)

    def internode_combine(self, x, handle, topk_weights=None, bias=None, config: Config | None = None,
                          previous_event: EventOverlap | None = None, async_finish: bool = False,
                          allocate_on_comm_stream: bool = False):
        """Combine across NVLink domains; see ``combine``."""
        self._alive()
        config = self.get_combine_config(self.group_size) if config is None else config
        self.runtime.require_internode("internode_combine")
        return self._combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                             allocate_on_comm_stream)

    # ------------------------------------------------------------------ low-latency ops
    def _ll_required(self, op: str) -> None:
        if not self.low_latency_mode:
            raise RuntimeError(f"{op} needs a Buffer created with low_latency_mode=True")

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Re-zero what the low-latency kernels expect zeroed (needed after normal kernels used the buffer).

        Arguments:
            num_max_dispatch_tokens_per_rank: as for ``low_latency_dispatch``.
            hidden: hidden size.
            num_experts: total experts.
        """
        self._alive()
        self._ll_required("clean_low_latency_buffer")
        check.positive_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
        check.positive_int("hidden", hidden)
        self._num_experts_ok(num_experts)
        self.runtime.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """Low-latency dispatch for decoding: every (token, expert) pair goes straight to the expert's rank.

        Two result buffers alternate, so at most two dispatch/combine results may be held at once.

        Arguments:
            x: `[num_tokens, hidden]` bf16, ``num_tokens <= num_max_dispatch_tokens_per_rank``.
            topk_idx: `[num_tokens, num_topk]` int64, -1 for none.
            num_max_dispatch_tokens_per_rank: T, same on every rank.
            num_experts: total experts.
            cumulative_local_expert_recv_stats: optional `[num_local_experts]` int32, received counts are added.
            dispatch_wait_recv_cost_stats: optional `[num_ranks]` (or `[num_ranks, num_ranks]`, this rank's row)
                int64, wait time per source rank is added (nanoseconds).
            use_fp8: cast to FP8 e4m3 with one float32 scale per 128 channels (amax / 448).
            round_scale: round scales up to powers of two.
            use_ue8m0: pack power-of-two scales as 8-bit exponents, 4 per int32 (needs ``round_scale``).
            async_finish: do not make the current stream wait; wait on the returned event instead.
            return_recv_hook: only issue the sends; calling the returned hook receives.

        Returns:
            recv_x: `[num_local_experts, num_ranks * T, hidden]` bf16, or with FP8 a tuple of the e4m3 data
                and scales `[num_local_experts, num_ranks * T, hidden // 128]` float32 (UE8M0: int32,
                `hidden // 512`), scales column-major in their last two dimensions. Rows of each expert are
                grouped by source rank in rank order, in source token order within a source.
            recv_count: `[num_local_experts]` int32 valid rows per expert.
            handle: `(src_info, layout_range, T, hidden, num_experts)` for ``low_latency_combine``.
            event: an ``EventOverlap``.
            hook: receive function with ``return_recv_hook``, else None.
        """
        self._alive()
        self._ll_required("low_latency_dispatch")
        t = check.positive_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
        num_experts = self._num_experts_ok(num_experts)
        n, hidden = check.tensor("x", x, dtype=BF16, ndim=2)
        if n > t:
            raise ValueError(f"x has {n} tokens, more than num_max_dispatch_tokens_per_rank={t}")
        if hidden % (128 if use_fp8 else 8) != 0:
            raise ValueError(f"hidden must be a multiple of {128 if use_fp8 else 8}, got {hidden}")
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0 requires round_scale=True")
        if use_ue8m0 and hidden % 512 != 0:
            raise ValueError(f"use_ue8m0 needs hidden to be a multiple of 512, got {hidden}")
        check.tensor("topk_idx", topk_idx, dtype=_I64, shape=(n, None))
        check.topk_values("topk_idx", topk_idx, num_experts)
        e_local = num_experts // self.group_size
        check.optional_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                              dtype=_I32, shape=(e_local,))
        self._check_wait_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats)
        self._check_ll_size(t, hidden, num_experts)
        return self.runtime.low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank=t, num_experts=num_experts,
            cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats, use_fp8=bool(use_fp8),
            round_scale=bool(round_scale), use_ue8m0=bool(use_ue8m0), async_finish=async_finish,
            return_recv_hook=bool(return_recv_hook))

    def _check_wait_stats(self, name, stats) -> None:
        if stats is None:
            return
        s = check.tensor(name, stats, dtype=_I64)
        r = self.group_size
        if s not in ((r,), (r, r)):
            raise ValueError(f"{name} must have shape [{r}] or [{r}, {r}], got {list(s)}")

    def _check_ll_size(self, t: int, hidden: int, num_experts: int) -> None:
        if self.backend != "cuda":
            return
        need = low_latency_rdma_size_hint(t, hidden, self.group_size, num_experts)
        if self.num_rdma_bytes < need:
            raise ValueError(f"num_rdma_bytes={self.num_rdma_bytes} is too small for T={t}, hidden={hidden}, "
                             f"{num_experts} experts: need {need} (Buffer.get_low_latency_rdma_size_hint)")

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, combine_wait_recv_cost_stats=None):
        """Low-latency combine: bring expert outputs back and reduce them **with** the top-k weights.

        Arguments:
            x: `[num_local_experts, num_ranks * T, hidden]` bf16 expert outputs in the dispatch layout.
            topk_idx: `[num_tokens, num_topk]` int64, the routing given to ``low_latency_dispatch``.
            topk_weights: `[num_tokens, num_topk]` float32.
            handle: from ``low_latency_dispatch``.
            use_logfmt: send a 10-bit logarithmic format per 128 channels (less traffic, ~1% error).
            zero_copy: ``x`` was already written into ``get_next_low_latency_combine_buffer(handle)``.
            async_finish, return_recv_hook: as for ``low_latency_dispatch``.
            out: optional `[num_tokens, hidden]` bf16 output written in place and returned.
            combine_wait_recv_cost_stats: like ``dispatch_wait_recv_cost_stats``.

        Returns:
            combined_x: `[num_tokens, hidden]` bf16, the weighted sum over each token's valid experts.
            event: an ``EventOverlap``.
            hook: receive function with ``return_recv_hook``, else None.
        """
        self._alive()
        self._ll_required("low_latency_combine")
        check.handle(handle, 5, "low_latency_dispatch")
        t, hidden, num_experts = int(handle[2]), int(handle[3]), int(handle[4])
        e_local = num_experts // self.group_size
        check.tensor("x", x, dtype=BF16, shape=(e_local, self.group_size * t, hidden))
        n, k = check.tensor("topk_idx", topk_idx, dtype=_I64, ndim=2)
        check.tensor("topk_weights", topk_weights, dtype=_F32, shape=(n, k))
        check.topk_values("topk_idx", topk_idx, num_experts)
        check.optional_tensor("out", out, dtype=BF16, shape=(n, hidden))
        self._check_wait_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats)
        return self.runtime.low_latency_combine(
            x, topk_idx, topk_weights, handle, use_logfmt=bool(use_logfmt), zero_copy=bool(zero_copy),
            async_finish=async_finish, return_recv_hook=bool(return_recv_hook), out=out,
            combine_wait_recv_cost_stats=combine_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle):
        """The buffer the next ``low_latency_combine(..., zero_copy=True)`` sends from:
        `[num_local_experts, num_ranks * T, hidden]` bf16, for the caller to fill."""
        self._alive()
        self._ll_required("get_next_low_latency_combine_buffer")
        check.handle(handle, 5, "low_latency_dispatch")
        return self.runtime.get_next_low_latency_combine_buffer(handle)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask a rank: masked ranks neither send nor receive in low-latency ops."""
        self._alive()
        self._shrink_required("low_latency_update_mask_buffer")
        rank_to_mask = check.nonneg_int("rank_to_mask", rank_to_mask)
        if rank_to_mask >= self.group_size:
            raise ValueError(f"rank_to_mask must be below {self.group_size}, got {rank_to_mask}")
        self.runtime.low_latency_update_mask_buffer(rank_to_mask, bool(mask))

    def low_latency_query_mask_buffer(self, mask_status) -> None:
        """Write 1 for masked ranks and 0 for the others into ``mask_status`` (`[num_ranks]` int32)."""
        self._alive()
        self._shrink_required("low_latency_query_mask_buffer")
        check.tensor("mask_status", mask_status, dtype=_I32, shape=(self.group_size,))
        self.runtime.low_latency_query_mask_buffer(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank."""
        self._alive()
        self._shrink_required("low_latency_clean_mask_buffer")
        self.runtime.low_latency_clean_mask_buffer()

    def _shrink_required(self, op: str) -> None:
        if not self.enable_shrink:
            raise RuntimeError(f"{op} needs a Buffer created with enable_shrink=True")

    # ------------------------------------------------------------------ lifetime
    def destroy(self) -> None:
        """Release every resource (collective). Required when ``explicitly_destroy=True``."""
        if self._destroyed:
            return
        self._destroyed = True
        self.runtime.destroy()

    def __del__(self) -> None:
        if getattr(self, "explicitly_destroy", True) or getattr(self, "_destroyed", True):
            return
        try:
            self.runtime.release_local()
        except Exception:
            pass
