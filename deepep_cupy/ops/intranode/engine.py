"""High-throughput intranode (NVLink) dispatch and combine: launchers and :class:`IntranodeEngine`.

Kernels (``cuda_src/intranode/``): ``notify_dispatch_kernel<R>`` (exchange counts, build the handle
matrices), ``dispatch_kernel<R, W, U>`` and ``combine_kernel<R, W, U>`` (move the rows). Compile-time
parameters are only what fixes loop bounds: ``R`` ranks, ``W`` warps per block, ``U`` 16-byte loads in
flight per lane. Everything else is a runtime argument.

Channels: ``C = config.num_sms // 2``; channel ``c`` is the token range ``[c * ceil(N/C), ...)`` of
every rank and gets one sender and one receiver block, so a kernel uses ``2 * C`` SMs. Cached dispatch
and combine use the channel count of the handle. Of the config, ``num_max_nvl_chunked_recv_tokens`` is
the ring capacity (slots per channel and peer); ``num_max_nvl_chunked_send_tokens`` is the ring-mode
dispatch's publish batch: a warp writes that many consecutive tokens of a ring, then publishes their slot
flags after one system-scope fence, and the receiver hands slots back in the same runs (clamped to
``min(32, ceil(cap / 2))``, see :func:`publish_batch`; 1 is the old one-release-per-token protocol). The
ring-mode combine publishes every token (:data:`COMBINE_PUBLISH_BATCH`).

Timeouts: every wait in the kernels gives up after ``timeout_s`` (``$DEEPEP_CUPY_TIMEOUT_S``, default
100 s) and leaves a record that the host turns into :class:`~deepep_cupy.errors.DeepEPTimeoutError`
(after the notify sync, at the start of the next op, or in :meth:`IntranodeEngine.check_errors`). After a
timeout the ranks are out of step: the engine refuses further ops; destroy the Buffer and create a new one.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np

from ...device.kernel_errors import KernelErrorRecord, timeout_seconds
from ...device.output_pool import OutputPool, default_pool_bytes
from ...device.streams import SideStreams
from ...device.vmm import PeerMappedBuffer
from ...jit import BuildSpec, load
from .. import kernel_names, limits
from ..headers import constant
from ..health import EngineHealth
from ..own_rows import MIN_ROWS as OWN_MIN_ROWS
from ..tunable import Tunable
from .args import combine_args, dispatch_args, notify_args, publish_batch
from .buffer_map import required_bytes
from .copy import DEFAULT_CHUNK_ROWS, combine_copy_spec, stream_writes_supported

__all__ = [
    "IntranodeEngine",
    "OP_NAMES",
    "notify_spec",
    "dispatch_spec",
    "combine_spec",
    "representative_builds",
    "notify_args",
    "dispatch_args",
    "combine_args",
    "publish_batch",
    "required_bytes",
]

# Defaults of the compile-time shape of the data kernels (see docs/design/intranode.md); the bench sweeps the
# alternatives.
DISPATCH_WARPS, DISPATCH_UNROLL = 16, 8
# Up to 2 ranks the dispatch loads 14 x 16 bytes per lane per round: a 7168-wide row then takes exactly one
# round (FP8) or two (BF16) instead of 1.75 / 3.5, which measured faster.
DISPATCH_UNROLL_FEW = 14
COMBINE_WARPS, COMBINE_UNROLL = 16, 8
# With more ranks the combine receiver keeps one accumulator per load in flight: fewer loads per lane,
# more warps (32 x 2 measured fastest of 32 x 2, 24 x 2 and 24 x 4 at 8 ranks).
COMBINE_WARPS_MANY, COMBINE_UNROLL_MANY = 32, 2


# Block shapes by rank count and SM count: rows (ranks up to, SMs up to, warps, unroll), None meaning no bound;
# the first row that covers a launch wins. SMs are those of the launch (2 x channels: config.num_sms for a
# dispatch without handle, the handle's for a cached dispatch and a combine). A shape measured best at few
# SMs goes above the catch-all rows; ``python -m deepep_cupy.tuning sms`` times the candidates (the figures are
# in docs/design/intranode.md). Few SMs, 2 ranks: with fewer blocks, more warps per block and fewer loads in flight
# per lane keep more rows moving (dispatch 24 x 6 at up to 12 SMs; combine 32 x 2 at 8 SMs, 24 x 4 at 12 and 16).
# The two modes of the combine are two kernels, each with its table. At 3 and 4 ranks the copy mode's sums keep
# 3 loads a lane in flight (32 x 3, although ptxas spills), faster at every SM count; the ring mode was slower
# with 3 loads and keeps 32 x 2. At 2 ranks the same shapes serve both; 8 ranks keep the general shapes.
DISPATCH_SHAPE_TABLE = (
    (2, 12, 24, 6),
    (2, None, DISPATCH_WARPS, DISPATCH_UNROLL_FEW),
    (None, None, DISPATCH_WARPS, DISPATCH_UNROLL),
)
_COMBINE_TWO_RANKS = (
    (2, 8, 32, 2),
    (2, 16, 24, 4),
    (2, None, COMBINE_WARPS, COMBINE_UNROLL),
)
COMBINE_SHAPE_TABLE = _COMBINE_TWO_RANKS + ((None, None, COMBINE_WARPS_MANY, COMBINE_UNROLL_MANY),)
COPY_COMBINE_SHAPE_TABLE = _COMBINE_TWO_RANKS + (
    (4, None, COMBINE_WARPS_MANY, 3),
    (None, None, COMBINE_WARPS_MANY, COMBINE_UNROLL_MANY),
)


# The direct dispatch fans each token out (loaded once, stored into every rank it goes to) on launches of at most
# this many SMs, where the SMs' loads and stores bound it; on more, where NVLink does, one copy a destination
# was a few percent ahead at 2 ranks. Above 2 ranks a token goes to more ranks and fan-out was faster at every
# SM count, so the bound applies to 2 ranks only (docs/design/intranode.md).
FAN_OUT_MAX_SMS = 12

# The ring-mode combine publishes every token, whatever the config's send chunk: a batch of 1 measured fastest
# (as in DeepEP's own sweep of the chunk), and the config's 9 much slower.
COMBINE_PUBLISH_BATCH = 1


def _covers(row, num_ranks: int, num_sms: int | None) -> bool:
    max_ranks, max_sms = row[0], row[1]
    # Without an SM count only the rows for any count apply (the shapes of the rank count alone).
    return (max_ranks is None or num_ranks <= max_ranks) and (max_sms is None or (num_sms is not None and
                                                                                  num_sms <= max_sms))


def shape_from(table, num_ranks: int, num_sms: int | None = None) -> tuple[int, int]:
    """``(warps, unroll)`` of the first row of ``table`` covering ``num_ranks`` ranks on ``num_sms`` SMs."""
    for row in table:
        if _covers(row, num_ranks, num_sms):
            return int(row[2]), int(row[3])
    raise ValueError(f"no block shape for {num_ranks} ranks on {num_sms} SMs")


def table_shapes(table, num_ranks: int) -> list[tuple[int, int]]:
    """Every ``(warps, unroll)`` that ``table`` gives ``num_ranks`` ranks at some SM count (the shipped builds)."""
    out: list[tuple[int, int]] = []
    for max_ranks, max_sms, warps, unroll in table:
        if max_ranks is not None and num_ranks > max_ranks:
            continue
        if (int(warps), int(unroll)) not in out:
            out.append((int(warps), int(unroll)))
        if max_sms is None:
            break  # the rows below are never reached at this rank count
    return out


def default_dispatch_shape(num_ranks: int, num_sms: int | None = None) -> tuple[int, int]:
    """``(warps, unroll)`` of the dispatch kernel for ``num_ranks`` ranks on ``num_sms`` SMs (None: any)."""
    return shape_from(DISPATCH_SHAPE_TABLE, num_ranks, num_sms)


def default_combine_shape(num_ranks: int, num_sms: int | None = None, copy: bool = False) -> tuple[int, int]:
    """``(warps, unroll)`` of the combine's ring-mode kernel (its copy-mode kernel with ``copy``) for ``num_ranks``
    ranks on ``num_sms`` SMs."""
    return shape_from(COPY_COMBINE_SHAPE_TABLE if copy else COMBINE_SHAPE_TABLE, num_ranks, num_sms)


# Op codes of the error record (OpCode in cuda_src/intranode/buffer_map.cuh) -> names used in error messages.
def _op(name: str) -> int:
    return constant("intranode/buffer_map.cuh", "kOp" + name)


OP_NOTIFY_ARRIVE, OP_NOTIFY_COUNTS = _op("NotifyArrive"), _op("NotifyCounts")
OP_DISPATCH_ARRIVE, OP_DISPATCH_SLOT = _op("DispatchArrive"), _op("DispatchSlot")
OP_DISPATCH_RECV, OP_DISPATCH_OVERFLOW = _op("DispatchRecv"), _op("DispatchOverflow")
OP_COMBINE_ARRIVE, OP_COMBINE_SLOT, OP_COMBINE_RECV = _op("CombineArrive"), _op("CombineSlot"), _op("CombineRecv")
OP_COMBINE_COPY_RECV, OP_COMBINE_COPY_DONE = _op("CombineCopyRecv"), _op("CombineCopyDone")
OP_NAMES = {
    OP_NOTIFY_ARRIVE: "dispatch (notify: waiting for the peer to start the same dispatch)",
    OP_NOTIFY_COUNTS: "dispatch (notify: waiting for the peer's token counts)",
    OP_DISPATCH_ARRIVE: "dispatch (sender: waiting for the peer to start the same dispatch)",
    OP_DISPATCH_SLOT: "dispatch (sender: waiting for the peer to free a ring slot)",
    OP_DISPATCH_RECV: "dispatch (receiver: waiting for tokens from the peer)",
    OP_DISPATCH_OVERFLOW: "dispatch (more tokens received than num_worst_tokens)",
    OP_COMBINE_ARRIVE: "combine (sender: waiting for the peer to start the same combine)",
    OP_COMBINE_SLOT: "combine (sender: waiting for the peer to free a ring slot)",
    OP_COMBINE_RECV: "combine (receiver: waiting for rows from the peer)",
    OP_COMBINE_COPY_RECV: "combine (copy mode: waiting for the peer's copies of rows)",
    OP_COMBINE_COPY_DONE: "combine (copy mode: waiting for the peer to finish reading its rows)",
}

_I32, _I64, _F32, _BOOL = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.bool_)


# ---------------------------------------------------------------------------------------------------- builds
_notify_name = kernel_names.intranode_notify
_dispatch_name = kernel_names.intranode_dispatch
_combine_name = kernel_names.intranode_combine


@functools.cache
def notify_spec(num_ranks: int) -> BuildSpec:
    return BuildSpec.make("intranode/notify.cu", name_expressions=[_notify_name(num_ranks)])


@functools.cache
def dispatch_spec(num_ranks: int, warps: int | None = None, unroll: int | None = None) -> BuildSpec:
    dw, du = default_dispatch_shape(num_ranks)
    warps, unroll = warps or dw, unroll or du
    return BuildSpec.make("intranode/dispatch.cu", name_expressions=[_dispatch_name(num_ranks, warps, unroll)])


@functools.cache
def combine_spec(num_ranks: int, warps: int | None = None, unroll: int | None = None,
                 ordered: bool = False) -> BuildSpec:
    dw, du = default_combine_shape(num_ranks)
    warps, unroll = warps or dw, unroll or du
    return BuildSpec.make("intranode/combine.cu",
                          name_expressions=[_combine_name(num_ranks, warps, unroll, ordered)])


def representative_builds() -> list[BuildSpec]:
    """The instantiations shipped by default: 1, 2, 4 and 8 ranks with every block shape of the shape tables."""

    out = []
    for r in (1, 2, 4, 8):
        out.append(notify_spec(r))
        out += [dispatch_spec(r, w, u) for w, u in table_shapes(DISPATCH_SHAPE_TABLE, r)]
        out += [combine_spec(r, w, u) for w, u in table_shapes(COMBINE_SHAPE_TABLE, r)]
        if r > 1:
            out += [combine_copy_spec(r, w, u) for w, u in table_shapes(COPY_COMBINE_SHAPE_TABLE, r)]
            out.append(combine_spec(r, ordered=True))  # V2's order, default shape (others compile at first use)
    out.append(combine_copy_spec(2, *default_combine_shape(2, copy=True), ordered=True))
    return out


def default_own_rows_warps(num_ranks: int, warps: int) -> int:
    """Warps of a dispatch sender block that copy this rank's own rows.

    With one peer, none: every sender warp pushes over NVLink and the receiver block does the local copy
    (faster than sharing it with the senders). With more peers, the warps left over once every peer has
    ``W // R`` of them (faster than none).
    """
    if num_ranks == 1:
        return warps
    return 0 if num_ranks == 2 else _leftover_warps(num_ranks, warps)


def default_recv_own_rows_warps(num_ranks: int, warps: int) -> int:
    """Warps of a dispatch receiver block that copy this rank's own rows: ``W / 2`` with one peer, else
    the warps left over once every peer has ``W // R`` of them (see :func:`default_own_rows_warps`)."""
    if num_ranks == 1:
        return 0
    return min(warps // 2, warps - 1) if num_ranks == 2 else _leftover_warps(num_ranks, warps)


def _leftover_warps(num_ranks: int, warps: int) -> int:
    share = max(1, warps // num_ranks)
    return max(1, min(warps - (num_ranks - 1) * share, warps - (num_ranks - 1)))


def _override(value, default: int) -> int:
    return default if value is None else int(value)


# ---------------------------------------------------------------------------------------------------- engine
class IntranodeEngine(EngineHealth, Tunable):
    """The NVL buffer of one rank and the intranode kernels that use it (collective to create).

    Arguments:
        group: process group (``rank``, ``size``, ``allgather_object``, ``barrier``) of at most 8 ranks on one
            NVLink domain.
        device_id: this rank's GPU.
        num_nvl_bytes: bytes of NVL buffer per rank (rounded up to the VMM granularity).
        use_fabric: share the buffer with fabric handles (multi-node NVLink) instead of file descriptors.
        num_output_bytes: bytes of output pool per rank (None: ``$DEEPEP_CUPY_OUTPUT_POOL_BYTES``, default
            1 GiB up to 4 ranks, 0 above; 0: none). Dispatch outputs that fit are allocated there and peers
            write them in place (deepep_cupy/device/output_pool.py); the smallest value of all ranks is used.

    Attributes (tuning: read them as attributes, change them between ops with :meth:`tune`, e.g.
    ``engine.tune(dispatch_warps=24, dispatch_unroll=6)``, which drops the plans made with the old values;
    all ranks must use the same values):
        timeout_s: wait budget of the kernels.
        dispatch_warps, dispatch_unroll, combine_warps, combine_unroll: block shapes (compile-time; None, the
            default: :func:`default_dispatch_shape` / :func:`default_combine_shape` for the launch's SM count).
        own_rows_warps: warps of a dispatch sender block that start on the own rows (None:
            :func:`default_own_rows_warps`).
        recv_own_rows_warps: warps of a dispatch receiver block that start on the own rows (None:
            :func:`default_recv_own_rows_warps`). The own-rows copy is shared by both groups.
        publish_batch: tokens per flag publish (None: ``config.num_max_nvl_chunked_send_tokens`` for a dispatch,
            :data:`COMBINE_PUBLISH_BATCH` for a combine).
        use_output_pool: allocate dispatch outputs from the output pool when they fit (the direct mode);
            False: always the ring mode with ordinary allocations.
        use_copy_combine: let a combine send rows home with the copy engines when it can (the copy mode,
            ops/intranode/copy.py); False: always the ring mode; None (default): as True (:meth:`copy_combine`).
        copy_chunk_rows: rows per copy (and per flag) of the copy mode's chunked turns.
        copy_rounds: rounds in which the copy mode's copies visit the homes, a count of equal parts of every block
            or a tuple of their relative sizes (``copy.copy_schedule``; None, the default: ``copy.default_rounds``
            for the copy kernel's SM count).
        copy_turn_waits: let each turn's first copy wait until the home's previous occupant has landed its rows
            there (``copy.turn_waits``); False: the copies go as soon as the stream reaches them.
        copy_whole_turns: copy each part whole in the turns before a round's last (``copy.copy_schedule``);
            False: in chunks in every turn.
        use_own_row_copies: let a cached dispatch copy this rank's own rows with device-to-device copies
            (ops/own_rows.py: the driver runs them on SMs outside the launch's count); None or False (default):
            the kernel's SMs copy them.
        own_copy_min_rows: fewest own rows for which it does (default ``own_rows.MIN_ROWS``).
        use_fan_out: let the direct dispatch load each token once and store it into every rank it goes to;
            False: one copy a destination; None (default): on at most :data:`FAN_OUT_MAX_SMS` SMs.

    The handle (all CuPy, the same values as the reference backend's):
        0 ``rank_prefix_matrix`` [R, R] int32: [i][r] = tokens rank r receives from ranks 0..i.
        1 ``channel_prefix_matrix`` [R, C] int32: [r][c] = tokens this rank sends to r in channels 0..c.
        2 ``recv_channel_prefix_matrix`` [R, C] int32: [s][c] = tokens this rank receives from s in channels
          before c (offset of channel c inside s's block of rows).
        3 ``recv_src_idx`` [rows] int32: source token index of every received row (-1 for padding rows).
        4 ``is_token_in_rank`` [N, R] bool (the caller's array).
        5 ``send_head`` [N, R] int32: position of token t among the rows rank r receives from this rank, -1
          if none.
    """

    #: Attributes plans are built from: changing one drops the plans made with the old value.
    TUNING = ("timeout_s", "dispatch_warps", "dispatch_unroll", "combine_warps", "combine_unroll", "own_rows_warps",
              "recv_own_rows_warps", "publish_batch", "use_output_pool", "use_copy_combine", "copy_chunk_rows",
              "copy_rounds", "copy_turn_waits", "copy_whole_turns", "use_own_row_copies", "use_fan_out")

    def __init__(self, group, device_id: int, num_nvl_bytes: int, *, use_fabric: bool = False,
                 num_output_bytes: int | None = None) -> None:
        import cupy


        limits.intranode_ranks(group.size)
        if num_nvl_bytes <= 0:
            raise ValueError(f"num_nvl_bytes must be positive, got {num_nvl_bytes}")
        self.group = group
        self.rank = group.rank
        self.num_ranks = group.size
        self.device_id = int(device_id)
        self.num_nvl_bytes = int(num_nvl_bytes)
        # None: the engine's choice (for the shapes, the shape tables' value for the launch's SM count:
        # dispatch_shape / combine_shape).
        self.tune(timeout_s=timeout_seconds(), dispatch_warps=None, dispatch_unroll=None, combine_warps=None,
                  combine_unroll=None, own_rows_warps=None, recv_own_rows_warps=None, publish_batch=None,
                  use_output_pool=True, use_copy_combine=None, copy_chunk_rows=DEFAULT_CHUNK_ROWS, copy_rounds=None,
                  copy_turn_waits=True, copy_whole_turns=True, use_own_row_copies=None, use_fan_out=None)
        self.copy_seq = 0  # copy-mode combines so far (the same on every rank: all run the same ops)
        # Tests turn it on at any size.
        self.own_copy_min_rows = OWN_MIN_ROWS
        self.own_copies = 0  # cached dispatches whose own rows device copies moved
        self.copy_supported = False
        self._side = SideStreams(self.device_id, 2)
        self.output_pool = None
        self.broken: str | None = None
        self._destroyed = False
        self._metas: dict = {}
        self.num_device_sms = int(cupy.cuda.Device(self.device_id).attributes["MultiProcessorCount"])
        self.buffer = None
        with cupy.cuda.Device(self.device_id):
            self.buffer = PeerMappedBuffer(group, self.device_id, self.num_nvl_bytes, use_fabric=use_fabric)
            try:
                self.bases = cupy.asarray(np.asarray(self.buffer.peer_ptrs, dtype=np.int64))
                # Control words and tags must start at 0 (VMM memory is not zeroed); nobody may write into a
                # peer's buffer before the peer has cleared it, hence the barrier.
                cupy.cuda.runtime.memset(self.buffer.local_ptr, 0, self.buffer.size)
                cupy.cuda.Device(self.device_id).synchronize()
                self.errors = KernelErrorRecord()
                # Per-channel work counters: runs of the dispatch's own-rows copy (direct mode: its items) and
                # of the combine's reduction claimed so far (0 between kernels; at most one channel per 2 SMs,
                # see limits.intranode_grid).
                self.work_claims = cupy.zeros(max(1, self.num_device_sms // 2), dtype=cupy.int32)
                # Every rank takes the smallest size asked for (the pool is collective, and 0 on one rank
                # means none anywhere).
                pool_bytes = default_pool_bytes(self.num_ranks) if num_output_bytes is None else int(num_output_bytes)
                mine = (pool_bytes, stream_writes_supported(self.device_id))
                every = group.allgather_object(mine) if self.num_ranks > 1 else [(0, False)]
                pool_bytes = min(int(v[0]) for v in every)
                self.copy_supported = all(v[1] for v in every)
                if pool_bytes > 0:
                    self.output_pool = OutputPool(group, self.device_id, pool_bytes, use_fabric=use_fabric)
                group.barrier()
            except BaseException:
                if self.output_pool is not None:
                    self.output_pool.close()
                    self.output_pool = None
                self.buffer.close()
                self.buffer = None
                raise

    # ------------------------------------------------------------------ helpers
    @property
    def timeout_ns(self) -> int:
        return max(1, int(self.timeout_s * 1e9))

    def copy_stream(self, index: int) -> int:
        """Side stream ``index`` for copy-engine work (0: copies, of the combine's copy mode or a dispatch's own
        rows; 1: the copy mode's flags; created on first use)."""
        return self._side.ptr(index)

    def local_buffer_view(self) -> tuple[int, int]:
        """``(pointer, bytes)`` of this rank's NVL buffer."""
        self.require_alive()
        return self.buffer.local_ptr, self.num_nvl_bytes

    def require_alive(self) -> None:
        if self._destroyed or self.buffer is None:
            raise RuntimeError("this intranode buffer was destroyed")

    kind, op_names, overflow_op = "intranode", OP_NAMES, OP_DISPATCH_OVERFLOW

    def batch(self, config) -> int:
        """Tokens per publish of a ring-mode dispatch: :attr:`publish_batch`, else the config's
        ``num_max_nvl_chunked_send_tokens``."""
        return self._checked_batch(self.publish_batch if self.publish_batch is not None
                                   else config.num_max_nvl_chunked_send_tokens)

    def combine_batch(self) -> int:
        """Tokens per publish of a ring-mode combine: :attr:`publish_batch`, else
        :data:`COMBINE_PUBLISH_BATCH`, whatever the config's send chunk (DeepEP's chunk sizes suit its
        kernels, not this one; the results are the same for any batch)."""
        return self._checked_batch(self.publish_batch if self.publish_batch is not None else COMBINE_PUBLISH_BATCH)

    @staticmethod
    def _checked_batch(batch) -> int:
        batch = int(batch)
        if batch <= 0:
            raise ValueError(f"the publish batch must be positive, got {batch}")
        return batch

    def own_rows_split(self, warps: int) -> tuple[int, int]:
        """``(sender-block, receiver-block)`` warps of a dispatch that start on this rank's own rows."""
        R = self.num_ranks
        if R == 1:
            return warps, 0
        send = default_own_rows_warps(R, warps) if self.own_rows_warps is None else int(self.own_rows_warps)
        recv = (default_recv_own_rows_warps(R, warps) if self.recv_own_rows_warps is None
                else int(self.recv_own_rows_warps))
        if not 0 <= send <= warps - (R - 1) or not 0 <= recv <= warps - (R - 1) or send + recv < 1:
            raise ValueError(f"own_rows_warps ({send}) and recv_own_rows_warps ({recv}) must each be in "
                             f"[0, {warps - (R - 1)}] for {R} ranks and {warps} warps, and not both 0")
        return send, recv

    def dispatch_shape(self, num_sms: int) -> tuple[int, int]:
        """``(warps, unroll)`` of a dispatch launched on ``num_sms`` SMs: the tuning attributes, where set."""
        warps, unroll = default_dispatch_shape(self.num_ranks, num_sms)
        return _override(self.dispatch_warps, warps), _override(self.dispatch_unroll, unroll)

    def own_row_copies(self) -> bool:
        """Whether a cached dispatch copies own rows with device-to-device copies (ops/own_rows.py): only when
        ``use_own_row_copies`` asks, since those copies take SMs beyond the launch's."""
        return bool(self.use_own_row_copies)

    def fan_out(self, num_sms: int) -> bool:
        """Whether a direct dispatch launched on ``num_sms`` SMs fans each token out to all its ranks: the tuning
        attribute where set, else above 2 ranks always and on 2 on at most :data:`FAN_OUT_MAX_SMS` SMs."""
        if self.use_fan_out is not None:
            return bool(self.use_fan_out)
        return self.num_ranks > 2 or num_sms <= FAN_OUT_MAX_SMS

    def copy_combine(self) -> bool:
        """Whether a combine may take the copy mode: the tuning attribute where set, else always.

        Since its turns wait for each other and its sums keep 3 loads a lane, the copy mode beat the ring mode at
        every rank and SM count measured (3 and 4 ranks). Above 4 ranks the output pool, and with it the copy mode,
        is off unless DEEPEP_CUPY_OUTPUT_POOL_BYTES turns it on."""
        if self.use_copy_combine is not None:
            return bool(self.use_copy_combine)
        return True

    def combine_shape(self, num_sms: int, copy: bool = False) -> tuple[int, int]:
        """``(warps, unroll)`` of a combine launched on ``num_sms`` SMs, of the copy mode's kernel with ``copy``
        (see :meth:`dispatch_shape`)."""
        warps, unroll = default_combine_shape(self.num_ranks, num_sms, copy)
        return _override(self.combine_warps, warps), _override(self.combine_unroll, unroll)

    def kernel(self, spec: BuildSpec, name: str):
        return load(spec).get_function(name)

    # ------------------------------------------------------------------ lifetime
    def destroy(self) -> None:
        """Wait for this device's work, then unmap and free the NVL buffer. Idempotent."""
        if self._destroyed:
            return
        self._destroyed = True
        import cupy

        pending = None
        try:
            cupy.cuda.Device(self.device_id).synchronize()
            pending = self.errors.peek() if getattr(self, "errors", None) is not None else None
        except Exception as exc:  # noqa: BLE001 - still release the memory
            warnings.warn(f"deepep_cupy: synchronising before releasing the NVL buffer failed: {exc}",
                          RuntimeWarning, stacklevel=2)
        if pending is not None:
            op = OP_NAMES.get(pending["op"], f"op {pending['op']}")
            warnings.warn(f"deepep_cupy: an unreported kernel error was pending at destroy: {op}, rank "
                          f"{pending['rank']}, peer {pending['peer']}", RuntimeWarning, stacklevel=2)
        buffer, self.buffer = self.buffer, None
        pool, self.output_pool = self.output_pool, None
        self.bases = self.work_claims = None
        if getattr(self, "_side", None) is not None:
            self._side.close()
        self._metas = {}
        if pool is not None:
            pool.close()
        if buffer is not None:
            buffer.close()
