"""Low-latency (decode) dispatch and combine over NVSHMEM: launchers and :class:`LowLatencyEngine`.

Kernels: ``cuda_src/low_latency/dispatch.cu`` and ``combine.cu`` (protocol and layout in
``cuda_src/low_latency/layout.cuh``, offsets in :mod:`.low_latency_layout`). Compile-time parameters
are the hidden size, the top-k, the warp split (warps per group, groups per block) and the data format
(FP8 dispatch, LogFMT combine); everything else is a kernel argument.

Semantics are those of ``deepep_cupy.reference.low_latency`` (deterministic row order: per local
expert, rows grouped by source rank, each group in source token order). Rows of ``packed_recv_x`` and
of the scales past ``packed_recv_count`` are left as they were (like DeepEP); their ``src_info`` is -1.

Wait-time statistics are in nanoseconds of the GPU global timer (``%globaltimer``), measured from the
start of the receive phase until the peer's data had arrived.

Environment:
    DEEPEP_CUPY_TIMEOUT_S: budget of every wait inside the kernels (default 100 s). A wait that runs out
        masks the peer (``enable_shrink=True``) or records a timeout that the next call raises as
        :class:`deepep_cupy.errors.DeepEPTimeoutError`.
    DEEPEP_CUPY_LL_FORCE_RMA=1: use NVSHMEM puts even to peers reachable by loads and stores (exercises
        the network code path on one node).
    DEEPEP_CUPY_LL_STAGE=1: cast each token to FP8 once into the symmetric staging area (one extra kernel)
        and copy the staged rows, instead of casting on the fly for every destination expert. Always on
        when some peer is reached through puts. ``LowLatencyEngine.staged`` may also be changed between
        calls.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from ..jit import BuildSpec, load
from ..runtime.kernel_errors import timeout_seconds
from .low_latency_layout import (
    MAX_EXPERTS,
    MAX_RANKS,
    MAX_TOKENS,
    MAX_TOPK,
    REGIONS,
    LowLatencyLayout,
    rdma_size_hint,
)

__all__ = [
    "LowLatencyEngine",
    "OP_NAMES",
    "combine_spec",
    "dispatch_spec",
    "representative_builds",
    "timeout_ns",
    "warp_split",
]

#: Op codes of cuda_src/low_latency/layout.cuh, for error messages.
OP_NAMES = {201: "low_latency_dispatch (receive)", 202: "low_latency_combine (receive)"}

_PHASE_SEND = 1
_PHASE_RECV = 2
_STAGE_THREADS = 256
_WARPS_PER_BLOCK = 24
_NULL = np.uint64(0)


# --------------------------------------------------------------------------------------------------
# build specs


def warp_split(num_experts: int, num_sms: int) -> tuple[int, int, int]:
    """``(warps_per_group, groups_per_block, blocks)`` for ``num_experts`` work units on ``num_sms`` SMs.

    One warp group per unit; enough groups per block that one block per SM covers all units (at most 4,
    beyond that groups loop over units), and 24 warps per block in total (768 threads leave 80 registers
    per thread, enough to avoid spills in the FP8 cast). Never more blocks than SMs: every block must be
    resident, since blocks wait for each other through the peers.
    """
    num_experts, num_sms = int(num_experts), max(int(num_sms), 1)
    groups = min(4, max(1, -(-num_experts // num_sms)))
    warps = _WARPS_PER_BLOCK // groups
    blocks = min(-(-num_experts // groups), num_sms)
    return warps, groups, max(blocks, 1)


def _b(flag: bool) -> str:
    return "true" if flag else "false"


def dispatch_kernel_name(hidden: int, topk: int, warps: int, groups: int, use_fp8: bool) -> str:
    return f"ll_dispatch_kernel<{hidden}, {topk}, {warps}, {groups}, {_b(use_fp8)}>"


def stage_kernel_name(hidden: int, use_fp8: bool) -> str:
    return f"ll_dispatch_stage_kernel<{hidden}, {_b(use_fp8)}>"


def combine_kernel_name(hidden: int, topk: int, warps: int, groups: int, use_logfmt: bool) -> str:
    return f"ll_combine_kernel<{hidden}, {topk}, {warps}, {groups}, {_b(use_logfmt)}>"


@functools.cache
def dispatch_spec(hidden: int, topk: int, warps: int, groups: int, use_fp8: bool) -> BuildSpec:
    """Dispatch kernel and its staging kernel for one shape (one module)."""
    return BuildSpec.make("low_latency/dispatch.cu",
                          name_expressions=[dispatch_kernel_name(hidden, topk, warps, groups, use_fp8),
                                            stage_kernel_name(hidden, use_fp8)],
                          nvshmem=True)


@functools.cache
def combine_spec(hidden: int, topk: int, warps: int, groups: int, use_logfmt: bool) -> BuildSpec:
    return BuildSpec.make("low_latency/combine.cu",
                          name_expressions=[combine_kernel_name(hidden, topk, warps, groups, use_logfmt)],
                          nvshmem=True)


def representative_builds() -> list[BuildSpec]:
    """The benchmark shape (7168 hidden, top-8, 288 experts on 132 SMs) in every format, and small odd
    shapes (hidden 128 and 2056, top-1 and top-32, one group per block and four)."""
    w, g, _ = warp_split(288, 132)
    w1, g1, _ = warp_split(8, 132)
    w4, g4, _ = warp_split(1024, 132)
    return [
        dispatch_spec(7168, 8, w, g, True),
        dispatch_spec(7168, 8, w, g, False),
        combine_spec(7168, 8, w, g, False),
        combine_spec(7168, 8, w, g, True),
        dispatch_spec(128, 1, w1, g1, True),
        dispatch_spec(2056, 32, w4, g4, False),
        combine_spec(128, 32, w1, g1, True),
        combine_spec(2056, 1, w4, g4, False),
    ]


def timeout_ns() -> int:
    """Kernel wait budget in nanoseconds (``runtime.kernel_errors.timeout_seconds``)."""
    return int(timeout_seconds() * 1e9)


# --------------------------------------------------------------------------------------------------
# argument checks (host only; never touch device data)


def _ptr(arr) -> np.uint64:
    return _NULL if arr is None else np.uint64(arr.data.ptr)


def _require(cond: bool, message, exc=ValueError) -> None:
    """Raise ``exc`` unless ``cond``; ``message`` is a string or, to keep formatting off the hot path, a
    function returning one."""
    if not cond:
        raise exc(message() if callable(message) else message)


def _contiguous(arr, name: str):
    import cupy

    _require(isinstance(arr, cupy.ndarray), lambda: f"{name} must be a CuPy array, got {type(arr).__name__}",
             TypeError)
    if not arr.flags.c_contiguous:
        arr = cupy.ascontiguousarray(arr)
    return arr


class _Hook:
    """Launches a receive phase once; later calls do nothing."""

    def __init__(self, launch) -> None:
        self._launch = launch

    def __call__(self) -> None:
        launch, self._launch = self._launch, None
        if launch is not None:
            launch()


# --------------------------------------------------------------------------------------------------
# engine


class LowLatencyEngine:
    """Owns the symmetric buffer and the device state of the low-latency kernels for one Buffer.

    Constructing and destroying it are collective over ``group``; so are ``dispatch``, ``combine`` and
    ``clean`` (every rank calls them in the same order with the same sizes).

    Arguments:
        group: a :class:`deepep_cupy.runtime.group.CommGroup`.
        device_id: the CUDA device of this rank.
        num_rdma_bytes: symmetric buffer size (at least :func:`rdma_size_hint` for the shapes used).
        allow_nvlink: use loads and stores over NVLink for peers NVSHMEM reaches that way.
        num_qps_per_rank: queue pairs per peer for the InfiniBand transport.
        allow_mnnvl: allow multi-node NVLink.
        enable_shrink: mask peers that time out instead of reporting an error.
    """

    def __init__(self, group, device_id: int, num_rdma_bytes: int, *, allow_nvlink: bool, num_qps_per_rank: int,
                 allow_mnnvl: bool, enable_shrink: bool) -> None:
        import cupy

        from ..runtime import nvshmem as nvshmem_runtime
        from ..runtime.kernel_errors import KernelErrorRecord

        self.group = group
        self.rank = int(group.rank)
        self.num_ranks = int(group.size)
        self.device_id = int(device_id)
        self.enable_shrink = bool(enable_shrink)
        _require(0 < self.num_ranks <= MAX_RANKS, lambda: f"low-latency mode supports up to {MAX_RANKS} ranks")
        _require(int(num_rdma_bytes) > 0, "low-latency mode needs num_rdma_bytes > 0 "
                                          "(see Buffer.get_low_latency_rdma_size_hint)")
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.force_rma = os.environ.get("DEEPEP_CUPY_LL_FORCE_RMA", "0") == "1"
        with cupy.cuda.Device(self.device_id):
            self.num_sms = int(cupy.cuda.Device(self.device_id).attributes["MultiProcessorCount"])
            self._sym = nvshmem_runtime.acquire(group, self.device_id, self.num_rdma_bytes, allow_nvlink=allow_nvlink,
                                                num_qps_per_rank=num_qps_per_rank, allow_mnnvl=allow_mnnvl)
            try:
                # Peers reachable by loads and stores get direct stores; any other peer needs staging.
                self.p2p_peers = [self._sym.peer_ptr(pe) != 0 for pe in range(self.num_ranks)]
                self.staged = (self.force_rma or not all(self.p2p_peers)
                               or os.environ.get("DEEPEP_CUPY_LL_STAGE", "0") == "1")
                self.errors = KernelErrorRecord()
                self.mask = cupy.zeros(self.num_ranks, dtype=cupy.int32)
                # Per buffer half: send sequence, its readers, receive sequence, its readers.
                self._seq = cupy.zeros((2, 4), dtype=cupy.uint32)
                self._arrival_base = None  # uint64 [2, E]
                self._ready = None  # uint32 [2, E]
                self._layout: LowLatencyLayout | None = None
                self._kernel_cache: dict[tuple, tuple] = {}
                self._idx = 0
                self._sym.array.fill(0)
                cupy.cuda.Device(self.device_id).synchronize()
            except BaseException:
                self._sym.free()
                raise
        self.group.barrier()

    # ------------------------------------------------------------------ buffer state
    def local_buffer_view(self) -> tuple[int, int]:
        """``(device pointer, bytes)`` of this rank's symmetric buffer."""
        return self._sym.ptr, self._sym.nbytes

    def _prepare(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> LowLatencyLayout:
        """The layout for these sizes; a change of sizes cleans the buffer first (collective)."""
        current = self._layout
        if (current is not None and current.num_max_dispatch_tokens_per_rank == num_max_dispatch_tokens_per_rank
                and current.hidden == hidden and current.num_experts == num_experts):
            return current
        layout = LowLatencyLayout(int(num_max_dispatch_tokens_per_rank), int(hidden), self.num_ranks,
                                  int(num_experts))
        _require(layout.num_experts <= MAX_EXPERTS, lambda: f"low-latency mode supports up to {MAX_EXPERTS} experts")
        _require(layout.num_max_dispatch_tokens_per_rank <= MAX_TOKENS,
                 lambda: f"num_max_dispatch_tokens_per_rank must be at most {MAX_TOKENS}")
        if not layout.fits(self.num_rdma_bytes):
            raise ValueError(
                f"num_rdma_bytes={self.num_rdma_bytes} is too small for low-latency T={layout.num_max_dispatch_tokens_per_rank}, "
                f"hidden={layout.hidden}, {self.num_ranks} ranks, {layout.num_experts} experts: need "
                f"{layout.total_bytes} (Buffer.get_low_latency_rdma_size_hint gives "
                f"{rdma_size_hint(layout.num_max_dispatch_tokens_per_rank, layout.hidden, self.num_ranks, layout.num_experts)})")
        if self._layout is not None:
            self._clean_all()
        self._allocate_state(layout.num_experts)
        self._use_layout(layout)
        return layout

    def _use_layout(self, layout: LowLatencyLayout) -> None:
        self._layout = layout
        # Kernel arguments of each half's regions, computed once per layout (they are on every launch).
        self._addrs = tuple({name: np.uint64(self._sym.ptr + layout.region(b, name)) for name in REGIONS}
                            for b in (0, 1))

    def _allocate_state(self, num_experts: int) -> None:
        import cupy

        with cupy.cuda.Device(self.device_id):
            self._arrival_base = cupy.zeros((2, num_experts), dtype=cupy.uint64)
            self._ready = cupy.zeros((2, num_experts), dtype=cupy.uint32)
            self._seq.fill(0)
            cupy.cuda.Device(self.device_id).synchronize()
        # One view per buffer half, made once: indexing a CuPy array costs microseconds on every launch.
        self._seq_halves = (self._seq[0], self._seq[1])
        self._base_halves = (self._arrival_base[0], self._arrival_base[1])
        self._ready_halves = (self._ready[0], self._ready[1])

    def _kernels(self, op: str, hidden: int, topk: int, num_experts: int, flag: bool):
        """``(warps, groups, blocks, kernel, stage kernel or None)`` of ``op`` for these sizes, looked up
        once per shape (``flag``: FP8 for the dispatch, LogFMT for the combine)."""
        key = (op, hidden, topk, num_experts, flag, self.num_sms)
        found = self._kernel_cache.get(key)
        if found is None:
            warps, groups, blocks = warp_split(num_experts, self.num_sms)
            if op == "dispatch":
                module = load(dispatch_spec(hidden, topk, warps, groups, flag))
                kernel = module.get_function(dispatch_kernel_name(hidden, topk, warps, groups, flag))
                stage = module.get_function(stage_kernel_name(hidden, flag))
            else:
                kernel = load(combine_spec(hidden, topk, warps, groups, flag)).get_function(
                    combine_kernel_name(hidden, topk, warps, groups, flag))
                stage = None
            found = self._kernel_cache[key] = (warps, groups, blocks, kernel, stage)
        return found

    def _clean_all(self) -> None:
        """Zero the whole symmetric buffer and the sequence state on every rank (collective, synchronous)."""
        import cupy

        with cupy.cuda.Device(self.device_id):
            cupy.cuda.Device(self.device_id).synchronize()
            self.group.barrier()  # no peer kernel still writes into our buffer
            self._sym.array.fill(0)
            self._seq.fill(0)
            if self._arrival_base is not None:
                self._arrival_base.fill(0)
                self._ready.fill(0)
            cupy.cuda.Device(self.device_id).synchronize()
            self.group.barrier()  # nobody sends before everyone is clean
        self._idx = 0

    def _sym_addr(self, layout: LowLatencyLayout, buffer_idx: int, region: str) -> np.uint64:
        if layout is not self._layout:
            raise RuntimeError("low-latency layout changed under a launch")
        return self._addrs[buffer_idx][region]

    def _next_buffer(self) -> int:
        b = self._idx
        self._idx ^= 1
        return b

    def check_errors(self) -> None:
        """Raise DeepEPTimeoutError if a kernel recorded a timeout since the last check."""
        self.errors.check(OP_NAMES)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x, topk_idx, *, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
                 use_ue8m0, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, return_recv_hook,
                 stream):
        """Send each token to the ranks of its experts and pack what arrives per local expert.

        Arguments:
            x: ``[N, H]`` uint16 (BF16 bits), C-contiguous.
            topk_idx: ``[N, K]`` int64, ``-1`` for none; a token must not name one expert twice.
            num_max_dispatch_tokens_per_rank: ``T >= N``, the same on every rank.
            num_experts: ``E``, a multiple of the rank count.
            use_fp8, round_scale, use_ue8m0: FP8 e4m3 with per-128-channel scales, rounded up to powers
                of two, stored as packed exponents (``use_ue8m0`` implies ``round_scale``).
            cumulative_local_expert_recv_stats: optional int32 ``[E_local]``, received counts are added.
            dispatch_wait_recv_cost_stats: optional int64 ``[R]``, wait nanoseconds per source are added.
            return_recv_hook: launch only the send phase; the returned hook launches the receive phase.
            stream: CuPy stream to launch on.

        Returns:
            ``(recv_x, recv_scales or None, recv_count, handle, hook or None)``: ``recv_x`` uint8 (FP8) or
            uint16 ``[E_local, R*T, H]``; scales float32 ``[E_local, R*T, H/128]`` or, with UE8M0, int32
            ``[E_local, R*T, ceil(H/512)]``, column-major in the last two dims; ``recv_count`` int32
            ``[E_local]``; ``handle = (src_info, layout_range, T, H, E)``.
        """
        import cupy

        self.check_errors()
        x = _contiguous(x, "x")
        topk_idx = _contiguous(topk_idx, "topk_idx")
        _require(x.ndim == 2 and x.dtype == cupy.uint16,
                 lambda: f"x must be [N, H] BF16 bits (uint16), got {x.dtype} {x.shape}", TypeError)
        _require(topk_idx.ndim == 2 and topk_idx.dtype == cupy.int64 and topk_idx.shape[0] == x.shape[0],
                 lambda: f"topk_idx must be int64 [N, K] with N = {x.shape[0]}, got {topk_idx.dtype} {topk_idx.shape}")
        num_tokens, hidden = int(x.shape[0]), int(x.shape[1])
        topk = int(topk_idx.shape[1])
        t_max, num_experts = int(num_max_dispatch_tokens_per_rank), int(num_experts)
        use_ue8m0 = bool(use_ue8m0) and bool(use_fp8)
        round_scale = (bool(round_scale) or use_ue8m0) and bool(use_fp8)
        _require(num_tokens <= t_max, lambda: f"{num_tokens} tokens exceed num_max_dispatch_tokens_per_rank={t_max}")
        _require(1 <= topk <= MAX_TOPK, lambda: f"low-latency top-k must be in [1, {MAX_TOPK}], got {topk}")
        _require(num_experts % self.num_ranks == 0,
                 lambda: f"num_experts={num_experts} not divisible by {self.num_ranks} ranks")
        _require(hidden % 8 == 0, lambda: f"hidden={hidden} must be a multiple of 8")
        _require(not use_fp8 or hidden % 128 == 0, lambda: f"FP8 dispatch needs hidden % 128 == 0, got {hidden}")
        layout = self._prepare(t_max, hidden, num_experts)
        b = self._next_buffer()

        e_local = num_experts // self.num_ranks
        slab = self.num_ranks * t_max
        with stream:
            recv_x = cupy.empty((e_local, slab, hidden), dtype=cupy.uint8 if use_fp8 else cupy.uint16)
            scales = scales_out = None
            if use_fp8:
                if use_ue8m0:
                    scales = cupy.empty((e_local, -(-hidden // 512), slab), dtype=cupy.int32)
                else:
                    scales = cupy.empty((e_local, hidden // 128, slab), dtype=cupy.float32)
                scales_out = scales.transpose(0, 2, 1)
            recv_count = cupy.empty((e_local,), dtype=cupy.int32)
            src_info = cupy.empty((e_local, slab), dtype=cupy.int32)
            layout_range = cupy.empty((e_local, self.num_ranks), dtype=cupy.int64)

        warps, groups, blocks, kernel, stage = self._kernels("dispatch", hidden, topk, num_experts, bool(use_fp8))
        if self.staged and num_tokens > 0:
            stage_blocks = max(1, min(-(-num_tokens // (_STAGE_THREADS // 32)), self.num_sms))
            stage((stage_blocks,), (_STAGE_THREADS,),
                  (x, np.int32(num_tokens), self._sym_addr(layout, b, "send"), np.int32(round_scale)), stream=stream)
        if cumulative_local_expert_recv_stats is not None:
            _require(cumulative_local_expert_recv_stats.dtype == cupy.int32
                     and cumulative_local_expert_recv_stats.size == e_local,
                     lambda: f"cumulative_local_expert_recv_stats must be int32 [{e_local}]", TypeError)
        if dispatch_wait_recv_cost_stats is not None:
            _require(dispatch_wait_recv_cost_stats.dtype == cupy.int64
                     and dispatch_wait_recv_cost_stats.size == self.num_ranks,
                     lambda: f"dispatch_wait_recv_cost_stats must be int64 [{self.num_ranks}]", TypeError)

        seq, base = self._seq_halves[b], self._base_halves[b]

        def launch(phases: int) -> None:
            kernel((blocks,), (warps * groups * 32,), (
                x, topk_idx, np.int32(num_tokens), np.int32(t_max), np.int32(num_experts), np.int32(self.num_ranks),
                np.int32(self.rank),
                self._sym_addr(layout, b, "tags"), self._sym_addr(layout, b, "arrivals"),
                self._sym_addr(layout, b, "src_idx"), self._sym_addr(layout, b, "recv"),
                self._sym_addr(layout, b, "send"),
                seq, base, self.mask,
                recv_x, _ptr(scales) if not use_ue8m0 else _NULL, _ptr(scales) if use_ue8m0 else _NULL,
                recv_count, src_info, layout_range,
                _ptr(cumulative_local_expert_recv_stats), _ptr(dispatch_wait_recv_cost_stats),
                np.int32(phases), np.int32(self.staged), np.int32(self.force_rma), np.int32(round_scale),
                np.int32(use_ue8m0), np.int32(self.enable_shrink), np.int64(timeout_ns()),
                np.uint64(self.errors.ptr)), stream=stream)

        handle = (src_info, layout_range, t_max, hidden, num_experts)
        if return_recv_hook:
            launch(_PHASE_SEND)
            hook = _Hook(lambda: launch(_PHASE_RECV))
        else:
            launch(_PHASE_SEND | _PHASE_RECV)
            hook = None
        return recv_x, scales_out, recv_count, handle, hook

    # ------------------------------------------------------------------ combine
    def combine(self, x, topk_idx, topk_weights, handle, *, use_logfmt, zero_copy, return_recv_hook, out,
                combine_wait_recv_cost_stats, stream):
        """Return expert outputs to their tokens' ranks and reduce them with the top-k weights.

        Arguments:
            x: ``[E_local, R*T, H]`` uint16 (BF16 bits) expert outputs at the rows of ``handle``; ignored
                with ``zero_copy`` (the rows were written into :meth:`get_next_combine_buffer`).
            topk_idx, topk_weights: ``[N, K]`` int64 / float32, the routing given to the dispatch.
            handle: from :meth:`dispatch`.
            use_logfmt: send LogFMT-10 instead of BF16 (needs ``H % 128 == 0``).
            return_recv_hook: launch only the send phase; the hook launches the reduction.
            out: optional uint16 ``[N, H]`` to write into.
            combine_wait_recv_cost_stats: optional int64 ``[R]``, wait nanoseconds per expert owner added.
            stream: CuPy stream.

        Returns:
            ``(combined_x [N, H] uint16, hook or None)``.
        """
        import cupy

        self.check_errors()
        src_info, layout_range, t_max, hidden, num_experts = handle
        t_max, hidden, num_experts = int(t_max), int(hidden), int(num_experts)
        topk_idx = _contiguous(topk_idx, "topk_idx")
        topk_weights = _contiguous(topk_weights, "topk_weights")
        src_info = _contiguous(src_info, "src_info")
        layout_range = _contiguous(layout_range, "layout_range")
        _require(topk_idx.ndim == 2 and topk_idx.dtype == cupy.int64, "topk_idx must be int64 [N, K]", TypeError)
        _require(topk_weights.dtype == cupy.float32 and topk_weights.shape == topk_idx.shape,
                 lambda: f"topk_weights must be float32 {topk_idx.shape}, got {topk_weights.dtype} {topk_weights.shape}",
                 TypeError)
        num_tokens, topk = int(topk_idx.shape[0]), int(topk_idx.shape[1])
        e_local = num_experts // self.num_ranks
        slab = self.num_ranks * t_max
        _require(num_tokens <= t_max, lambda: f"{num_tokens} tokens exceed num_max_dispatch_tokens_per_rank={t_max}")
        _require(1 <= topk <= MAX_TOPK, lambda: f"low-latency top-k must be in [1, {MAX_TOPK}], got {topk}")
        _require(not use_logfmt or hidden % 128 == 0, lambda: f"LogFMT combine needs hidden % 128 == 0, got {hidden}")
        _require(src_info.shape == (e_local, slab) and src_info.dtype == cupy.int32,
                 "handle[0] (src_info) does not match the handle's sizes")
        _require(layout_range.shape == (e_local, self.num_ranks) and layout_range.dtype == cupy.int64,
                 "handle[1] (layout_range) does not match the handle's sizes")
        layout = self._prepare(t_max, hidden, num_experts)
        b = self._next_buffer()
        if zero_copy:
            x_arg = self._sym_addr(layout, b, "send")
        else:
            x = _contiguous(x, "x")
            _require(x.shape == (e_local, slab, hidden) and x.dtype == cupy.uint16,
                     lambda: f"x must be uint16 [{e_local}, {slab}, {hidden}], got {x.dtype} {x.shape}", TypeError)
            x_arg = x
        with stream:
            if out is None:
                out = cupy.empty((num_tokens, hidden), dtype=cupy.uint16)
            else:
                _require(isinstance(out, cupy.ndarray) and out.shape == (num_tokens, hidden)
                         and out.dtype == cupy.uint16 and out.flags.c_contiguous,
                         lambda: f"out must be a C-contiguous uint16 [{num_tokens}, {hidden}] array", TypeError)
        if combine_wait_recv_cost_stats is not None:
            _require(combine_wait_recv_cost_stats.dtype == cupy.int64
                     and combine_wait_recv_cost_stats.size == self.num_ranks,
                     lambda: f"combine_wait_recv_cost_stats must be int64 [{self.num_ranks}]", TypeError)

        warps, groups, blocks, kernel, _ = self._kernels("combine", hidden, topk, num_experts, bool(use_logfmt))
        seq, base, ready = self._seq_halves[b], self._base_halves[b], self._ready_halves[b]

        def launch(phases: int) -> None:
            kernel((blocks,), (warps * groups * 32,), (
                x_arg, src_info, layout_range, topk_idx, topk_weights,
                np.int32(num_tokens), np.int32(t_max), np.int32(num_experts), np.int32(self.num_ranks),
                np.int32(self.rank),
                self._sym_addr(layout, b, "tags"), self._sym_addr(layout, b, "arrivals"),
                self._sym_addr(layout, b, "recv"), self._sym_addr(layout, b, "send"),
                seq, base, ready, self.mask, out, _ptr(combine_wait_recv_cost_stats),
                np.int32(phases), np.int32(bool(zero_copy)), np.int32(self.force_rma),
                np.int32(self.enable_shrink), np.int64(timeout_ns()), np.uint64(self.errors.ptr)), stream=stream)

        if return_recv_hook:
            launch(_PHASE_SEND)
            return out, _Hook(lambda: launch(_PHASE_RECV))
        launch(_PHASE_SEND | _PHASE_RECV)
        return out, None

    def get_next_combine_buffer(self, handle):
        """uint16 ``[E_local, R*T, H]`` view of the send area the next combine sends from (zero-copy)."""
        import cupy

        _, _, t_max, hidden, num_experts = handle
        layout = self._prepare(int(t_max), int(hidden), int(num_experts))
        e_local = layout.num_experts // self.num_ranks
        slab = self.num_ranks * layout.num_max_dispatch_tokens_per_rank
        offset = layout.region(self._idx, "send")
        mem = cupy.cuda.UnownedMemory(self._sym.ptr, self._sym.nbytes, self._sym)
        return cupy.ndarray((e_local, slab, layout.hidden), dtype=cupy.uint16,
                            memptr=cupy.cuda.MemoryPointer(mem, offset))

    def clean(self, num_max_dispatch_tokens_per_rank, hidden, num_experts, stream=None) -> None:
        """Zero the buffer and the completion state on every rank (collective; synchronises the device)."""
        layout = LowLatencyLayout(int(num_max_dispatch_tokens_per_rank), int(hidden), self.num_ranks,
                                  int(num_experts))
        if not layout.fits(self.num_rdma_bytes):
            self._prepare(layout.num_max_dispatch_tokens_per_rank, layout.hidden, layout.num_experts)  # raises
        if stream is not None:
            stream.synchronize()
        self._clean_all()
        if layout != self._layout:
            self._allocate_state(layout.num_experts)
            self._use_layout(layout)

    # ------------------------------------------------------------------ masking
    def update_mask(self, rank: int, mask: bool) -> None:
        _require(0 <= int(rank) < self.num_ranks, lambda: f"rank {rank} out of range [0, {self.num_ranks})")
        self.mask[int(rank)] = 1 if mask else 0

    def query_mask(self, out) -> None:
        """Write 1 for masked ranks and 0 for the others into ``out`` (int32 ``[R]``)."""
        out[...] = (self.mask != 0).astype(out.dtype)

    def clean_mask(self) -> None:
        self.mask.fill(0)

    # ------------------------------------------------------------------ lifetime
    def destroy(self) -> None:
        """Free the symmetric buffer (collective)."""
        import cupy

        sym, self._sym = getattr(self, "_sym", None), None
        if sym is None:
            return
        with cupy.cuda.Device(self.device_id):
            cupy.cuda.Device(self.device_id).synchronize()
            sym.free()
