"""Internode normal dispatch and combine (several NVLink domains): builds, argument blocks, engine.

Kernels (``cuda_src/internode/``, design in ``docs/design/internode.md``): ``notify<L, D>`` (counts across
domains, handle entries 1, 2, 4, 6), ``dispatch<L, D>`` (rows over RDMA to the forwarders, over NVLink
to the destinations; entries 3, 5, 7, 8, 9) and ``combine<L, D>`` (sums inside the domain over NVLink,
partial sums over RDMA, sum across domains at the source). ``L`` ranks per domain and ``D`` domains are
template parameters, instantiated on first use; the rest are arguments. Offsets come from
:mod:`.buffer_map`; launch plans from :mod:`.plans`.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from ...device import nvshmem as nvshmem_runtime
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
from . import buffer_map as IL
from .args import combine_args, dispatch_args, notify_args

__all__ = ["InternodeEngine", "OP_NAMES", "notify_spec", "dispatch_spec", "representative_builds", "notify_args",
           "dispatch_args", "block_threads", "MAX_NVL_RANKS", "MAX_DOMAINS", "combine_spec", "combine_args",
           "combine_block_threads", "check_combine_shape", "num_blocks"]

MAX_NVL_RANKS = limits.INTERNODE_MAX_NVL_RANKS
MAX_DOMAINS = limits.INTERNODE_MAX_DOMAINS

# Op codes of the error record (OpCode in cuda_src/internode/buffer_map.cuh) -> names used in error messages.
def _op(name: str) -> int:
    return constant("internode/buffer_map.cuh", "kOp" + name)


OP_NOTIFY_RDMA, OP_NOTIFY_NVL = _op("NotifyRdma"), _op("NotifyNvl")
OP_DISPATCH_HEAD, OP_DISPATCH_TAIL = _op("DispatchHead"), _op("DispatchTail")
OP_DISPATCH_NVL_HEAD, OP_DISPATCH_NVL_TAIL = _op("DispatchNvlHead"), _op("DispatchNvlTail")
OP_DISPATCH_OVERFLOW = _op("DispatchOverflow")
OP_COMBINE_NVL_HEAD, OP_COMBINE_NVL_TAIL = _op("CombineNvlHead"), _op("CombineNvlTail")
OP_COMBINE_HEAD, OP_COMBINE_TAIL = _op("CombineHead"), _op("CombineTail")
OP_DISPATCH_HELPER, OP_COMBINE_PARTNER = _op("DispatchHelper"), _op("CombinePartner")
OP_NAMES = {
    OP_NOTIFY_RDMA: "internode dispatch (notify: waiting for a source domain's counts over RDMA)",
    OP_NOTIFY_NVL: "internode dispatch (notify: waiting for a forwarder of this domain)",
    OP_DISPATCH_HEAD: "internode dispatch (RDMA sender: waiting for the forwarder to free ring slots)",
    OP_DISPATCH_TAIL: "internode dispatch (forwarder: waiting for tokens over RDMA)",
    OP_DISPATCH_NVL_HEAD: "internode dispatch (forwarder: waiting for NVLink ring space)",
    OP_DISPATCH_NVL_TAIL: "internode dispatch (receiver: waiting for rows from the forwarder)",
    OP_DISPATCH_OVERFLOW: "internode dispatch (more tokens received than num_worst_tokens)",
    OP_COMBINE_NVL_HEAD: "internode combine (waiting for NVLink ring space at the forwarder)",
    OP_COMBINE_NVL_TAIL: "internode combine (forwarder: waiting for rows of a domain rank)",
    OP_COMBINE_HEAD: "internode combine (forwarder: waiting for the source to free ring slots)",
    OP_COMBINE_TAIL: "internode combine (waiting for a domain's partial sums)",
    OP_DISPATCH_HELPER: "internode dispatch (helper warp: waiting for its forwarder's word)",
    OP_COMBINE_PARTNER: "internode combine (forwarder: waiting for its partner warp's half rows)",
}


_check_shape = limits.internode_shape


@functools.cache
def notify_spec(num_nvl_ranks: int, num_domains: int) -> BuildSpec:
    _check_shape(num_nvl_ranks, num_domains)
    return BuildSpec.make("internode/notify.cu",
                          name_expressions=[kernel_names.internode_notify(num_nvl_ranks, num_domains)], nvshmem=True)


@functools.cache
def dispatch_spec(num_nvl_ranks: int, num_domains: int, sub_channels: int | None = None) -> BuildSpec:
    _check_shape(num_nvl_ranks, num_domains)
    sub = IL.channels_per_block(num_nvl_ranks, num_domains, sub_channels)
    return BuildSpec.make("internode/dispatch.cu",
                          name_expressions=[kernel_names.internode_dispatch(num_nvl_ranks, num_domains, sub)],
                          nvshmem=True)


def check_combine_shape(num_nvl_ranks: int, num_domains: int) -> None:
    """The combine runs one NVLink sender warp per (forwarder, source domain) so that no source domain's
    rows wait behind another's (see combine.cu): ``L * D`` warps, plus ``D + 1`` in the other block."""
    _check_shape(num_nvl_ranks, num_domains)
    if num_nvl_ranks * num_domains > 32 or num_domains + 1 > 32:
        raise ValueError(f"the internode combine supports at most 32 ranks and 31 domains, got "
                         f"{num_nvl_ranks} x {num_domains}")


@functools.cache
def combine_spec(num_nvl_ranks: int, num_domains: int, sub_channels: int | None = None) -> BuildSpec:
    check_combine_shape(num_nvl_ranks, num_domains)
    sub = IL.channels_per_block(num_nvl_ranks, num_domains, sub_channels)
    return BuildSpec.make("internode/combine.cu",
                          name_expressions=[kernel_names.internode_combine(num_nvl_ranks, num_domains, sub)],
                          nvshmem=True)


def representative_builds() -> list[BuildSpec]:
    """2 GPUs as 2 domains of 1 (the first GPU test; its blocks on few SMs too), 2 x 2, 2 x 4, and 2 to 4 hosts
    of 8."""
    out = []
    for lsize, ndom in ((1, 2), (2, 2), (4, 2), (8, 2), (8, 4)):
        out += [notify_spec(lsize, ndom), dispatch_spec(lsize, ndom), combine_spec(lsize, ndom)]
    few = IL.sub_channels(1, 2, 8)
    out += [dispatch_spec(1, 2, few), combine_spec(1, 2, few)]
    return out


def block_threads(num_nvl_ranks: int, num_domains: int, sub_channels: int | None = None) -> int:
    """Threads of a dispatch block: ``sub_channels`` channels of one warp per domain (senders) or two per
    local rank (forwarders and receivers), whichever is more; the kernel's ``__launch_bounds__`` says the same."""
    return (32 * IL.dispatch_channel_warps(num_nvl_ranks, num_domains)
            * IL.channels_per_block(num_nvl_ranks, num_domains, sub_channels))


def combine_block_threads(num_nvl_ranks: int, num_domains: int, sub_channels: int | None = None) -> int:
    """Threads of a combine block: ``sub_channels`` channels of ``L * D`` warps (NVLink senders and reducers,
    or forwarders in pairs), or with one rank per domain of ``D`` (forwarders, or reducers)."""
    return (32 * IL.combine_channel_warps(num_nvl_ranks, num_domains)
            * IL.channels_per_block(num_nvl_ranks, num_domains, sub_channels))


def num_blocks(num_channels: int, num_nvl_ranks: int, num_domains: int, sub_channels: int | None = None) -> int:
    """Blocks of one kind (senders or receivers) for ``num_channels`` channels."""
    sub = IL.channels_per_block(num_nvl_ranks, num_domains, sub_channels)
    return (int(num_channels) + sub - 1) // sub


class _DomainView:
    """The ranks of this rank's NVLink domain as a group for :class:`~deepep_cupy.device.vmm.PeerMappedBuffer`
    (which only gathers): every rank of the parent group takes part, each keeps its domain's entries."""

    def __init__(self, group, num_nvl_ranks: int) -> None:
        self.parent, self.size = group, num_nvl_ranks
        self.rank = group.rank % num_nvl_ranks
        self._first = group.rank - self.rank

    def allgather_object(self, obj, op=None):
        return group_slice(self.parent.allgather_object(obj), self._first, self.size)


def group_slice(values: list, first: int, size: int) -> list:
    return list(values[first:first + size])


class InternodeEngine(EngineHealth, Tunable):
    """RDMA buffer, signal words, NVLink buffer and persistent counters of one rank (collective to create).

    Arguments:
        group: all ranks (``rank``, ``size``, ``allgather_object``, ``barrier``).
        num_nvl_ranks: ranks per NVLink domain (``L``); ``D = size // L`` must be at least 2.
        num_nvl_bytes, num_rdma_bytes: buffer sizes per rank.
        rdma: an existing symmetric allocation of at least ``num_rdma_bytes`` to use as the RDMA buffer (the
            low-latency engine's: the two modes share it, as in DeepEP, so a low-latency op after internode
            ops needs ``clean_low_latency_buffer`` first); None allocates one.

    Attributes (tuning: read them as attributes, change them between ops with :meth:`tune`, e.g.
    ``engine.tune(sub_channels=8)``, which drops the plans made with the old values; all ranks must use the
    same value):
        timeout_s: wait budget of the kernels.
        sub_channels: channels a block runs side by side, in dispatch and combine alike (compile-time; None,
            the default: ``buffer_map.sub_channels`` for the config's SMs, blocks of at most 768 threads with
            one rank per domain (1024 on few SMs), 512 with more; up to ``buffer_map.max_sub_channels``, 1024
            threads). A dispatch without handle makes ``num_sms / 2 * sub_channels`` channels; the config's
            rings per SM pair are split between them (``ring_sizes``).
            A handle keeps its channel count whatever the value later.
        use_own_row_copies: with one rank per domain, let a dispatch copy this rank's own rows with
            device-to-device copies (ops/own_rows.py; the driver runs them on SMs outside the launch's count)
            where it knows them (a dispatch that waited for its counts, or a cached one with such a dispatch's
            handle; not while the stream is being captured); None or False (default): the sender warps copy
            them (:meth:`own_row_copies`).
        own_copy_min_rows: fewest own rows for which it does (default ``own_rows.MIN_ROWS``).
        use_output_pool: with domains of more than one rank and an output pool, allocate a dispatch's outputs
            from the pool when they fit, so the forwarders write the rows in place (dispatch_forward.cuh).

    The output pool (domains of more than one rank): ``$DEEPEP_CUPY_OUTPUT_POOL_BYTES`` per rank, mapped into
    every rank of the domain (``device/output_pool.py``; by default 1 GiB up to 4 ranks a domain, as
    intranode), the smallest value of all ranks.
    """

    kind, op_names, overflow_op = "internode", OP_NAMES, OP_DISPATCH_OVERFLOW

    #: Attributes plans are built from: changing one drops the plans made with the old value.
    TUNING = ("timeout_s", "sub_channels", "use_own_row_copies", "use_output_pool")

    def own_row_copies(self) -> bool:
        """Whether a dispatch's own rows go through device-to-device copies (ops/own_rows.py): only when
        ``use_own_row_copies`` asks, and only with one rank per domain (the sender warps write them straight
        into the outputs, ``send_own`` in dispatch.cu; with more, they cross the NVLink forwarder like
        everyone's). Those warps share the SM with the warps that push the rows for the other domains: with 2
        domains the copies took 12-29% off the dispatch at 24-8 SMs (docs/design/internode.md), but
        the driver runs them on SMs outside the launch's count, so they are off by default. With 4 domains a
        rank's own tokens of DeepEP's routing make more than ``own_rows.MAX_RUNS`` runs, so the SMs keep them."""
        return self.num_nvl_ranks == 1 and bool(self.use_own_row_copies)

    def copy_stream(self, index: int) -> int:
        """The side stream of the own-row copies (``index`` 0)."""
        return self._side.ptr(index)

    def channels_per_block(self, num_sms: int | None = None) -> int:
        """The ``sub_channels`` of the next plans on ``num_sms`` SMs: the tuning attribute, checked, or the
        default (``buffer_map.sub_channels``)."""
        return IL.channels_per_block(self.num_nvl_ranks, self.num_domains, self.sub_channels, num_sms)

    def __init__(self, group, device_id: int, num_nvl_ranks: int, num_nvl_bytes: int, num_rdma_bytes: int,
                 rdma=None) -> None:
        import cupy

        if group.size % num_nvl_ranks:
            raise ValueError(f"group size {group.size} is not a multiple of num_nvl_ranks {num_nvl_ranks}")
        self.group, self.rank, self.num_ranks = group, group.rank, group.size
        self.num_nvl_ranks, self.num_domains = int(num_nvl_ranks), group.size // int(num_nvl_ranks)
        _check_shape(self.num_nvl_ranks, self.num_domains)
        self.device_id = int(device_id)
        self.num_device_sms = int(cupy.cuda.Device(self.device_id).attributes["MultiProcessorCount"])
        self.num_nvl_bytes, self.num_rdma_bytes = int(num_nvl_bytes), int(num_rdma_bytes)
        if self.num_nvl_bytes <= 0 or self.num_rdma_bytes <= 0:
            raise ValueError("internode ops need num_nvl_bytes > 0 and num_rdma_bytes > 0 "
                             "(Config.get_nvl_buffer_size_hint / get_rdma_buffer_size_hint)")
        self.tune(timeout_s=timeout_seconds(), sub_channels=None, use_own_row_copies=None, use_output_pool=True)
        self.own_copy_min_rows = OWN_MIN_ROWS
        self.own_copies = 0  # dispatches whose own rows device copies moved
        self.output_pool = None
        self.pool_dispatches = 0  # dispatches whose outputs lay in the output pool
        self._side = SideStreams(self.device_id, 1)
        # NVSHMEM puts and signals even to peers reachable by stores: runs the network path on one host.
        self.force_rma = os.environ.get("DEEPEP_CUPY_INTERNODE_FORCE_RMA", "0") == "1"
        self.signals = IL.signal_map(self.num_nvl_ranks, self.num_domains)
        self._own_rdma = rdma is None
        self._rdma = self._sig = self.nvl = None
        try:
            with cupy.cuda.Device(self.device_id):
                if rdma is None:
                    rdma = nvshmem_runtime.acquire(group, self.device_id, self.num_rdma_bytes)
                elif rdma.nbytes < self.num_rdma_bytes:
                    raise ValueError(f"the shared RDMA buffer has {rdma.nbytes} bytes, {self.num_rdma_bytes} needed")
                self._rdma = rdma
                self._sig = nvshmem_runtime.acquire(group, self.device_id, self.signals.end)
                failure = None
                try:
                    self.nvl = PeerMappedBuffer(_DomainView(group, self.num_nvl_ranks), self.device_id,
                                                self.num_nvl_bytes)
                    self.nvl_bases = cupy.asarray(np.asarray(self.nvl.peer_ptrs, dtype=np.int64))
                    self.state = cupy.zeros(IL.state_words(self.num_nvl_ranks, self.num_domains), dtype=cupy.int64)
                    self._sig.array.fill(0)
                    cupy.cuda.runtime.memset(self.nvl.local_ptr, 0, self.nvl.size)
                    self.errors = KernelErrorRecord()
                    cupy.cuda.Device(self.device_id).synchronize()
                except BaseException as exc:
                    failure = exc
                # Every rank learns whether every set-up worked before the collective frees below (see the
                # low-latency engine); on success this is the barrier: nobody signals a peer before the peer
                # has cleared its words.
                owned = [self._sig] + ([self._rdma] if self._own_rdma else [])
                nvshmem_runtime.settle_setup(group, failure, "internode buffer set-up", owned)
                self._make_output_pool(group)
        except BaseException:
            self.destroy()
            raise
        self.geometry = None

    def _make_output_pool(self, group) -> None:
        """The output pool of domains of more than one rank (collective): every rank takes the smallest size
        asked for, so all agree on whether the receivers reply (0 on one rank means none anywhere)."""
        if self.num_nvl_ranks == 1:
            return
        every = group.allgather_object(default_pool_bytes(self.num_nvl_ranks))
        pool_bytes = min(int(v) for v in every)
        if pool_bytes > 0:
            self.output_pool = OutputPool(_DomainView(group, self.num_nvl_ranks), self.device_id, pool_bytes,
                                          staging=False)

    @property
    def rdma_ptr(self) -> int:
        return self._rdma.ptr

    @property
    def sig_ptr(self) -> int:
        return self._sig.ptr

    @property
    def timeout_ns(self) -> int:
        return max(1, int(self.timeout_s * 1e9))

    def kernel(self, spec: BuildSpec, name: str):
        return load(spec).get_function(name)

    def use_geometry(self, key: tuple) -> None:
        """Ring offsets depend on (hidden, channels, ring sizes): before an op with other offsets, wait
        until every rank finished its earlier ops (collective, synchronous), so no late reader sees
        memory laid out anew. The counters stay valid: every op drains the rings it uses."""
        import cupy

        if self.geometry is not None and self.geometry != key:
            cupy.cuda.Device(self.device_id).synchronize()
            self.group.barrier()
        self.geometry = key

    def local_buffer_view(self) -> tuple[int, int]:
        """``(pointer, bytes)`` of this rank's NVLink buffer."""
        self.require_alive()
        return self.nvl.local_ptr, self.num_nvl_bytes

    def forget_symmetric_memory(self) -> None:
        """Drop the NVSHMEM allocations without freeing them (the free is collective; used when a rank is gone)."""
        self._sig = self._rdma = None

    def destroy(self) -> None:
        """Wait for this device's work, then release the signal words, the NVLink buffer and (when this
        engine made it) the RDMA buffer. Idempotent."""
        import cupy

        if self._destroyed:
            return
        self._destroyed = True
        with cupy.cuda.Device(self.device_id):
            try:
                cupy.cuda.Device(self.device_id).synchronize()
            finally:
                for name, owned in (("_sig", True), ("_rdma", self._own_rdma)):
                    alloc = getattr(self, name, None)
                    setattr(self, name, None)
                    if alloc is not None and owned:
                        alloc.free()
                if getattr(self, "nvl", None) is not None:
                    self.nvl.close()
                    self.nvl = None
                pool, self.output_pool = getattr(self, "output_pool", None), None
                if pool is not None:
                    pool.close()
                if getattr(self, "_side", None) is not None:
                    self._side.close()
