"""Low-latency (decode) dispatch and combine over NVSHMEM: launchers and :class:`LowLatencyEngine`.

Kernels: ``cuda_src/low_latency/dispatch.cu`` and ``combine.cu`` (protocol and buffer map in
``cuda_src/low_latency/buffer_map.cuh``, offsets in :mod:`.buffer_map`). Compile-time parameters
are the hidden size, the top-k, the warp split (warps per group, groups per block) and the data format
(FP8 dispatch, LogFMT combine); everything else is a kernel argument.

Semantics are those of ``deepep_cupy.reference.low_latency`` (deterministic row order: per local
expert, rows grouped by source rank, this rank's own group first and the others cyclically after it,
each group in source token order). Rows of ``packed_recv_x`` and
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
        and copy the staged rows, instead of casting on the fly for every destination expert (rows sent
        per (token, expert) only). Always on when some peer is reached through puts.
    DEEPEP_CUPY_LL_PER_EXPERT=1: send one dispatch row per (token, expert) even where one message per
        (token, rank) applies (every rank reached by stores; see buffer_map.py), and one combine row
        per (token, expert) even where per-rank partial sums apply (:meth:`LowLatencyEngine.rank_partials`).
    DEEPEP_CUPY_LL_EARLY_RECV=1: in hook mode, queue each receive right after its send, behind a stream
        memory wait (no SMs) for every source's send count (cuda_src/low_latency/receipts.cuh count_send),
        so that it runs while the caller computes and its hook only orders the caller's stream after it.
        Every rank must set the same. Not under a CUDA-graph capture, with ``async_finish`` or with
        ``enable_shrink``; the host's watchdog (:mod:`deepep_cupy.device.stream_wait`) bounds each wait.
        Off by default: with a late peer it delayed unrelated work of this rank, most likely because a
        blocked wait holds the streams that share its hardware queue (docs/design/low_latency.md,
        "Measured and not adopted").
    ``LowLatencyEngine.staged`` and ``.per_expert`` hold the last two; a plan reads them when it is
    made, so a change applies to shapes not used before (or after the Buffer's plans are dropped).
"""

from __future__ import annotations

import functools
import os

from ...device import nvshmem as nvshmem_runtime
from ...device.kernel_errors import KernelErrorRecord, timeout_seconds
from ...device.stream_wait import WaitWatchdog, stream_waits_supported
from ...device.streams import SideStreams
from ...frameworks import BF16
from ...jit import BuildSpec, load
from .. import kernel_names, limits
from ..headers import constant
from .buffer_map import (
    MAX_EXPERTS,
    REGIONS,
    LowLatencyBufferMap,
)

__all__ = [
    "LowLatencyEngine",
    "OP_NAMES",
    "combine_spec",
    "dispatch_specs",
    "combine_specs",
    "dispatch_spec",
    "kernel_phases",
    "representative_builds",
    "timeout_ns",
    "warp_split",
]

_HEADER = "low_latency/buffer_map.cuh"
#: Op codes of cuda_src/low_latency/buffer_map.cuh, for error messages.
OP_NAMES = {constant(_HEADER, "kOpDispatchRecv"): "low_latency_dispatch (receive)",
            constant(_HEADER, "kOpCombineRecv"): "low_latency_combine (receive)",
            constant(_HEADER, "kOpCombineSend"): "low_latency_combine (send)",
            constant(_HEADER, "kOpDispatchSend"): "low_latency_dispatch (send)"}

#: The phases of a launch (the kernels' ``phases`` field).
PHASE_SEND = constant(_HEADER, "kPhaseSend")
PHASE_RECV = constant(_HEADER, "kPhaseRecv")
#: Threads of a staging block (the stage kernel's launch bounds).
STAGE_THREADS = constant("low_latency/dispatch.cu", "kStageThreads")
_WARPS_PER_BLOCK = 24


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


dispatch_kernel_name = kernel_names.ll_dispatch
stage_kernel_name = kernel_names.ll_stage
combine_kernel_name = kernel_names.ll_combine


def kernel_phases(hook: bool) -> tuple[int, ...]:
    """The phases of the kernels a plan launches: both at once, or with a receive hook the send part, then
    the receive part, each a module holding only its own phase's code (fewer instructions to fetch in a
    launch that only receives) under the kernel name the other part has too."""
    return (kernel_names.LL_SEND, kernel_names.LL_RECV) if hook else (kernel_names.LL_BOTH,)


@functools.cache
def dispatch_spec(hidden: int, topk: int, warps: int, groups: int, use_fp8: bool, phases: int = kernel_names.LL_BOTH,
                  rank_msgs_only: bool = False) -> BuildSpec:
    """One module of the dispatch for one shape: its kernel with the ``phases`` compiled in (with
    ``rank_msgs_only``, only the per-rank message format), and where it sends, the staging kernel."""
    names = [dispatch_kernel_name(hidden, topk, warps, groups, use_fp8)]
    if phases & kernel_names.LL_SEND:
        names.append(stage_kernel_name(hidden, use_fp8))
    return BuildSpec.make("low_latency/dispatch.cu", name_expressions=names, nvshmem=True,
                          defines={"DEEPEP_CUPY_LL_PHASES": phases, "DEEPEP_CUPY_LL_RANK_MSGS_ONLY": rank_msgs_only})


def dispatch_specs(hidden: int, topk: int, warps: int, groups: int, use_fp8: bool, hook: bool = False,
                   rank_msgs: bool = False) -> list[BuildSpec]:
    """The dispatch modules a plan launches, in ``kernel_phases(hook)`` order; a hook's receive part holds
    only the per-rank message path where the host chose that format (``rank_msgs``)."""
    return [dispatch_spec(hidden, topk, warps, groups, use_fp8, p, rank_msgs and p == kernel_names.LL_RECV)
            for p in kernel_phases(hook)]


@functools.cache
def combine_spec(hidden: int, topk: int, warps: int, groups: int, use_logfmt: bool, partials: bool = False,
                 phases: int = kernel_names.LL_BOTH) -> BuildSpec:
    """One module of the combine for one shape, with the ``phases`` compiled in; ``partials``: the per-rank
    partial-sum path."""
    return BuildSpec.make("low_latency/combine.cu",
                          name_expressions=[combine_kernel_name(hidden, topk, warps, groups, use_logfmt, partials)],
                          nvshmem=True, defines={"DEEPEP_CUPY_LL_PHASES": phases})


def combine_specs(hidden: int, topk: int, warps: int, groups: int, use_logfmt: bool, partials: bool = False,
                  hook: bool = False) -> list[BuildSpec]:
    """The combine modules a plan launches, in ``kernel_phases(hook)`` order."""
    return [combine_spec(hidden, topk, warps, groups, use_logfmt, partials, p) for p in kernel_phases(hook)]


def representative_builds() -> list[BuildSpec]:
    """The benchmark shape (7168 hidden, top-8, 288 experts on 132 SMs) in every format, and small odd
    shapes (hidden 128, 2056 and 2176 (a one-block last LogFMT segment), top-1 and top-32, one group per
    block and four)."""
    w, g, _ = warp_split(288, 132)
    w1, g1, _ = warp_split(8, 132)
    w4, g4, _ = warp_split(1024, 132)
    return [
        *dispatch_specs(7168, 8, w, g, True),
        *dispatch_specs(7168, 8, w, g, True, hook=True, rank_msgs=True),
        *dispatch_specs(7168, 8, w, g, False),
        *combine_specs(7168, 8, w, g, False, hook=True),
        *combine_specs(7168, 8, w, g, True, hook=True),
        *combine_specs(7168, 8, w, g, False),
        *combine_specs(7168, 8, w, g, False, True),
        *combine_specs(7168, 8, w, g, True),
        *combine_specs(7168, 8, w, g, True, True),
        *combine_specs(2176, 8, w, g, True, True),
        *dispatch_specs(128, 1, w1, g1, True),
        *dispatch_specs(2056, 32, w4, g4, False),
        *combine_specs(128, 32, w1, g1, True),
        *combine_specs(2056, 1, w4, g4, False),
    ]


def timeout_ns() -> int:
    """Kernel wait budget in nanoseconds (``runtime.kernel_errors.timeout_seconds``)."""
    return int(timeout_seconds() * 1e9)


def _require(cond: bool, message, exc=ValueError) -> None:
    """Raise ``exc`` unless ``cond``; ``message`` is a string or, to keep formatting off the hot path, a
    function returning one."""
    if not cond:
        raise exc(message() if callable(message) else message)


# --------------------------------------------------------------------------------------------------
# engine


class LowLatencyEngine:
    """Owns the symmetric buffer and the device state of the low-latency kernels for one Buffer.

    Constructing and destroying it are collective over ``group``; so is every dispatch and combine (every
    rank calls them in the same order with the same sizes). The launches themselves are made by the
    plans of :mod:`.plans`; the engine holds what they share: the buffer halves, the
    sequence state, the peer mask, the error record and the loaded kernels.

    Arguments:
        group: a :class:`deepep_cupy.device.group.CommGroup`.
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


        self.group = group
        self.rank = int(group.rank)
        self.num_ranks = int(group.size)
        self.device_id = int(device_id)
        self.enable_shrink = bool(enable_shrink)
        limits.low_latency_buffer(self.num_ranks, int(num_rdma_bytes))
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.force_rma = os.environ.get("DEEPEP_CUPY_LL_FORCE_RMA", "0") == "1"
        with cupy.cuda.Device(self.device_id):
            self.num_sms = int(cupy.cuda.Device(self.device_id).attributes["MultiProcessorCount"])
            self._sym = nvshmem_runtime.acquire(group, self.device_id, self.num_rdma_bytes, allow_nvlink=allow_nvlink,
                                                num_qps_per_rank=num_qps_per_rank, allow_mnnvl=allow_mnnvl)
            failure = None
            try:
                # Peers reachable by loads and stores get direct stores; any other peer needs staging.
                self.p2p_peers = [self._sym.peer_ptr(pe) != 0 for pe in range(self.num_ranks)]
                self.staged = (self.force_rma or not all(self.p2p_peers)
                               or os.environ.get("DEEPEP_CUPY_LL_STAGE", "0") == "1")
                self.per_expert = os.environ.get("DEEPEP_CUPY_LL_PER_EXPERT", "0") == "1"
                self.early_receive = (os.environ.get("DEEPEP_CUPY_LL_EARLY_RECV", "0") == "1" and not self.enable_shrink
                                      and stream_waits_supported())
                # Per buffer half, the stream of its hook-mode send and early receive; then the watchdog's.
                self.hook_streams = SideStreams(self.device_id, 3)
                self._watchdog = None
                self.errors = KernelErrorRecord()
                self.mask = cupy.zeros(self.num_ranks, dtype=cupy.int32)
                # Per buffer half: send sequence, its readers, receive sequence, its readers, then the
                # count of combine blocks done sending in the current launch (reset by the last of them),
                # the same count for the dispatch, and two spare words. The per-expert arrival bases and
                # ready words are sized for the most experts any buffer map may have, so their addresses
                # never change and plans may keep them.
                self._seq = cupy.zeros((2, 8), dtype=cupy.uint32)
                self._arrival_base = cupy.zeros((2, MAX_EXPERTS), dtype=cupy.uint64)
                self._ready = cupy.zeros((2, MAX_EXPERTS), dtype=cupy.uint32)
                self.state_ptrs = tuple(
                    {"seq": self._seq.data.ptr + 32 * b, "base": self._arrival_base.data.ptr + 8 * MAX_EXPERTS * b,
                     "ready": self._ready.data.ptr + 4 * MAX_EXPERTS * b, "mask": self.mask.data.ptr}
                    for b in (0, 1))
                self._buffer_map: LowLatencyBufferMap | None = None
                self._buffer_maps: dict[tuple, LowLatencyBufferMap] = {}
                self._kernel_cache: dict[tuple, tuple] = {}
                self._views: dict = {}
                self._idx = 0
                self._sym.array.fill(0)
                cupy.cuda.Device(self.device_id).synchronize()
            except BaseException as exc:
                failure = exc
            # Every rank learns whether every set-up worked before anything collective happens: a rank that
            # failed must not free the buffer (collective) while the others wait in a barrier, nor they in it
            # while it frees. On success this is the barrier (nobody writes into a peer before the peer has
            # cleared); on a failure anywhere every rank frees the buffer and raises a named error.
            nvshmem_runtime.settle_setup(self.group, failure, "low-latency buffer set-up", [self._sym])

    # ------------------------------------------------------------------ buffer state
    @property
    def symmetric_buffer(self):
        """The NVSHMEM allocation (the internode engine shares it)."""
        return self._sym

    def local_buffer_view(self) -> tuple[int, int]:
        """``(device pointer, bytes)`` of this rank's symmetric buffer."""
        return self._sym.ptr, self._sym.nbytes

    @property
    def buffer_map(self) -> LowLatencyBufferMap | None:
        return self._buffer_map

    def make_buffer_map(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                        num_experts: int) -> LowLatencyBufferMap:
        """The buffer map for these sizes, checked against the limits and the buffer size. One object per
        sizes, so plans compare buffer maps by identity on the hot path."""
        key = (int(num_max_dispatch_tokens_per_rank), int(hidden), int(num_experts))
        buffer_map = self._buffer_maps.get(key)
        if buffer_map is None:
            buffer_map = self._buffer_maps[key] = self._new_buffer_map(*key)
        return buffer_map

    def _new_buffer_map(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                        num_experts: int) -> LowLatencyBufferMap:
        return limits.low_latency_buffer_map(self.num_ranks, self.num_rdma_bytes,
                                             num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def use_buffer_map(self, buffer_map: LowLatencyBufferMap) -> None:
        """Make ``buffer_map`` current; a change of sizes cleans the buffer first (collective,
        synchronous)."""
        if self._buffer_map is buffer_map:
            return
        if self._buffer_map is not None and self._buffer_map != buffer_map:
            self._clean_all()
        self._buffer_map = buffer_map

    def region_addresses(self, buffer_map: LowLatencyBufferMap) -> tuple[dict, dict]:
        """Per buffer half, the absolute address of every region of ``buffer_map``."""
        return tuple({name: self._sym.ptr + buffer_map.region(b, name) for name in REGIONS} for b in (0, 1))

    def rank_messages(self, buffer_map: LowLatencyBufferMap, topk: int, use_fp8: bool) -> bool:
        """Whether a dispatch of these sizes sends one message per (token, rank): every rank reached by
        stores (as on every rank of an NVLink domain), not forced to puts or to per-expert rows, and the
        buffer map's tables fit."""
        return self._stores_everywhere() and buffer_map.rank_messages_fit(topk, use_fp8)

    def rank_partials(self, buffer_map: LowLatencyBufferMap, topk: int, use_logfmt: bool,
                      hook: bool = False) -> bool:
        """Whether a combine of these sizes sends per-rank partial sums (combine_partials.cuh): not in hook
        mode, every rank reached by stores, not forced to puts or per-expert rows, the buffer map's regions
        and the send's shared table fit, and a token is expected to pick enough experts of a rank it reaches
        (``LowLatencyBufferMap.partials_pay``) that one partial row beats its per-expert rows. The same
        decision on every rank (every rank passes the same ``return_recv_hook``).

        A hook-mode combine sends per-expert rows: the expert side can sum a token's rows only with the
        owner's routes and weights, which the owner's own combine send writes, so a partial-sum send
        waits for every peer to reach its combine, and a late peer's delay would be added to this rank's
        send instead of being hidden behind the compute before the hook."""
        return (not hook and self._stores_everywhere()
                and buffer_map.partials_fit(topk, use_logfmt, self.num_sms)
                and buffer_map.partials_pay(topk, use_logfmt))

    def _stores_everywhere(self) -> bool:
        """Every rank reached by stores, and neither puts nor per-expert rows forced: the condition of the
        per-rank formats (what the engine knows; the buffer map says whether they fit)."""
        return all(self.p2p_peers) and not self.force_rma and not self.per_expert

    def watchdog(self) -> WaitWatchdog:
        """The watchdog of this engine's stream waits (started at the first early receive)."""
        if self._watchdog is None:
            self._watchdog = WaitWatchdog(self.hook_streams.ptr(2), timeout_seconds())
        return self._watchdog

    def next_buffer(self) -> int:
        b = self._idx
        self._idx ^= 1
        return b

    def kernels(self, op: str, hidden: int, topk: int, num_experts: int, flag: bool, partials: bool = False,
                hook: bool = False):
        """``(warps, groups, blocks, kernels, stage kernel or None)`` of ``op`` for these sizes, looked up
        once per shape (``flag``: FP8 for the dispatch, LogFMT for the combine; ``partials``: the
        combine's per-rank partial-sum path, or the dispatch's per-rank message format).
        ``kernels``: one per entry of ``kernel_phases(hook)``."""
        key = (op, hidden, topk, num_experts, flag, partials, hook, self.num_sms)
        found = self._kernel_cache.get(key)
        if found is None:
            warps, groups, blocks = warp_split(num_experts, self.num_sms)
            if op == "dispatch":
                specs = dispatch_specs(hidden, topk, warps, groups, flag, hook, partials)
            else:
                specs = combine_specs(hidden, topk, warps, groups, flag, partials, hook)
            modules = [load(spec) for spec in specs]
            # Every module's first name is the op's kernel (one name for all the phase parts); the first
            # module of a dispatch (its send part) also holds the staging kernel.
            kernels = tuple(m.get_function(spec.name_expressions[0]) for m, spec in zip(modules, specs, strict=True))
            stage = modules[0].get_function(specs[0].name_expressions[1]) if op == "dispatch" else None
            found = self._kernel_cache[key] = (warps, groups, blocks, kernels, stage)
        return found

    def _clean_all(self) -> None:
        """Zero the whole symmetric buffer and the sequence state on every rank (collective, synchronous)."""
        import cupy

        with cupy.cuda.Device(self.device_id):
            cupy.cuda.Device(self.device_id).synchronize()
            self.group.barrier()  # no peer kernel still writes into our buffer
            self._sym.array.fill(0)
            self._seq.fill(0)
            self._arrival_base.fill(0)
            self._ready.fill(0)
            cupy.cuda.Device(self.device_id).synchronize()
            self.group.barrier()  # nobody sends before everyone is clean
        self._idx = 0

    def check_errors(self) -> None:
        """Raise what a kernel recorded since the last check: a timeout, or a bad expert id."""
        if self.errors.flag_word():
            self.errors.check(OP_NAMES)

    def combine_buffer_view(self, frame, buffer_map: LowLatencyBufferMap, buffer_idx: int):
        """The ``[E_local, R*T, H]`` bf16 send area of half ``buffer_idx`` in ``frame``'s framework (one view
        per half, buffer map and framework, made once: the zero-copy path asks for it every step)."""
        key = (frame.framework, buffer_map, buffer_idx)
        view = self._views.get(key)
        if view is None:
            e_local = buffer_map.num_experts // self.num_ranks
            shape = (e_local, self.num_ranks * buffer_map.num_max_dispatch_tokens_per_rank, buffer_map.hidden)
            view = frame.wrap(self._sym.ptr + buffer_map.region(buffer_idx, "send"), shape, BF16,
                              owner=self._sym)
            self._views[key] = view
        return view

    def peek_next_buffer(self) -> int:
        return self._idx

    def clean(self, num_max_dispatch_tokens_per_rank, hidden, num_experts, stream=None) -> None:
        """Zero the buffer and the completion state on every rank (collective; synchronises the device)."""
        buffer_map = self.make_buffer_map(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if stream is not None:
            stream.synchronize()
        self._clean_all()
        self._buffer_map = buffer_map

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
        self._views = {}
        if sym is None:
            return
        with cupy.cuda.Device(self.device_id):
            cupy.cuda.Device(self.device_id).synchronize()  # a stuck stream wait: the watchdog releases it
            watchdog, self._watchdog = self._watchdog, None
            if watchdog is not None:
                watchdog.close()
            self.hook_streams.close()
            sym.free()
