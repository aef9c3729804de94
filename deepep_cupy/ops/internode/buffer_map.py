"""Buffer maps of the internode normal kernels: pure arithmetic, shared by the launchers and the CPU tests.

Device side: ``cuda_src/internode/buffer_map.cuh`` (same regions, same order). ``L`` ranks per domain, ``D``
domains, ``C`` channels, ``Rt`` RDMA ring slots, ``Rn`` NVLink ring slots.

RDMA buffer (symmetric, ``num_rdma_bytes``)::

    [0, meta_bytes)             int32 meta[2][C*D][2L+2]   (half 0 staging, half 1 received)
    [ring_offset, end)          slots ring[2][C*D][Rt]

Signal allocation (symmetric, small, fixed for the engine's life)::

    uint64 tail[MAX_CHANNELS*D], head[MAX_CHANNELS*D], notify[D]; int32 records[2][D][record_stride] at record_offset

NVLink buffer (``num_nvl_bytes``, shared within the domain)::

    uint64 tail[MAX_CHANNELS*L], head[MAX_CHANNELS*L], notify_flag[L]       at 0
    int32 meta[C][L][D][2]                                                 at meta_offset
    slots ring[C*L][Rn]                                                    at ring_offset
    int32 records[L][record_stride]                                        at notify_offset

Slots have one fixed shape per hidden size, whatever the op (dispatch BF16/FP8, combine), so that
dispatch and combine lay out the rings identically: 16-byte header, ``2 * hidden`` data bytes, room for
128 scales, 128 top-k ids and 128 weights. The sizes fit DeepEP's hints
(``Config.get_rdma_buffer_size_hint`` / ``get_nvl_buffer_size_hint``), which reserve more per slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..headers import constant

__all__ = ["dispatch_channel_warps", "combine_channel_warps", "sub_channels", "max_sub_channels", "channels_per_block", "ring_sizes", "MAX_CHANNELS", "MAX_TOPK", "MAX_SCALES", "MAX_LOCAL_EXPERTS", "Slot", "RdmaBufferMap", "SignalMap",
           "NvlBufferMap", "align", "slot_for", "rdma_buffer_map", "signal_map", "nvl_buffer_map", "state_words",
           "REPLY_WORDS"]

MAX_CHANNELS = constant("internode/buffer_map.cuh", "kMaxChannels")
MAX_TOPK = 128
MAX_SCALES = 128
MAX_LOCAL_EXPERTS = 1024  # notify records are sized for this many experts per rank
HEADER_BYTES = constant("internode/buffer_map.cuh", "kSlotHeaderBytes")


def dispatch_channel_warps(num_nvl_ranks: int, num_domains: int) -> int:
    """Warps of one channel in a dispatch block (buffer_map.cuh)."""
    return max(num_domains, 2 * num_nvl_ranks)


def combine_channel_warps(num_nvl_ranks: int, num_domains: int) -> int:
    """Warps of one channel in a combine block (buffer_map.cuh): with one rank per domain there are no NVLink
    senders, and the ``D`` forwarders and the ``D`` reducers take one block each; with more, one block holds
    the NVLink senders and the reducers, the other the forwarders in pairs."""
    if num_nvl_ranks == 1:
        return num_domains
    return num_nvl_ranks * num_domains


def _channel_warps(num_nvl_ranks: int, num_domains: int) -> int:
    """Warps of one channel in the larger of a dispatch and a combine block."""
    return max(dispatch_channel_warps(num_nvl_ranks, num_domains), combine_channel_warps(num_nvl_ranks, num_domains))


def sub_channels(num_nvl_ranks: int, num_domains: int, num_sms: int | None = None) -> int:
    """Channels a block runs side by side by default: blocks of at most 768 threads (80 registers a thread)
    with one rank per domain, of at most 512 (128 registers) with more; with one rank per domain and a
    ``num_sms`` whose SM pairs can all run 1024-thread blocks of channels (``num_sms / 2 * S * D <=
    MAX_CHANNELS``, so up to 16 SMs at 2 domains and 4 domains alike), blocks of 1024 (64 registers a thread,
    where the kernels spill some). Each role of a channel is one warp moving one row at a time, so more
    channels keep more rows moving.

    These defaults measured fastest with ``python -m deepep_cupy.tuning internode`` (the figures are in
    docs/design/internode.md, Channels): 512 threads over 768 at 2 x 2; 1024 over 768 at 2 x 1 and 4 x 1 on
    few SMs, where on more SMs 1024 leave SMs unused (the channels stop at ``MAX_CHANNELS / D``).
    """
    warps = _channel_warps(num_nvl_ranks, num_domains)
    sub = max(1, (24 if num_nvl_ranks == 1 else 16) // warps)
    if num_nvl_ranks == 1 and num_sms is not None:
        wide = max(1, 32 // warps)
        if max(int(num_sms) // 2, 1) * wide <= MAX_CHANNELS // num_domains:
            sub = wide
    return sub


def max_sub_channels(num_nvl_ranks: int, num_domains: int) -> int:
    """Most channels a block may run (a tuning choice, not the default): blocks of at most 1024 threads. Above
    512 threads a thread gets at most 64 registers, so expect spills there (tools/kernel_resources.py)."""
    return max(1, 32 // _channel_warps(num_nvl_ranks, num_domains))


def channels_per_block(num_nvl_ranks: int, num_domains: int, sub: int | None = None,
                       num_sms: int | None = None) -> int:
    """``sub`` channels a block, checked against :func:`max_sub_channels`, or for None the default for
    ``num_sms`` (:func:`sub_channels`)."""
    if sub is None:
        return sub_channels(num_nvl_ranks, num_domains, num_sms)
    top = max_sub_channels(num_nvl_ranks, num_domains)
    if not 1 <= int(sub) <= top:
        raise ValueError(f"sub_channels must be 1..{top} for {num_nvl_ranks} ranks x {num_domains} domains "
                         f"(blocks of at most 1024 threads), got {sub}")
    return int(sub)


def ring_sizes(config, sub: int) -> tuple[int, int, int]:
    """``(rdma_cap, rdma_chunk, nvl_cap)`` per channel when a block runs ``sub`` channels: the config's rings
    are per SM pair, shared by its channels, so the buffers stay the size the config's hints give. The RDMA
    ring holds whole send chunks."""
    cap = max(2, int(config.num_max_rdma_chunked_recv_tokens) // sub)
    chunk = max(1, min(int(config.num_max_rdma_chunked_send_tokens), cap // 2))
    return cap // chunk * chunk, chunk, max(1, int(config.num_max_nvl_chunked_recv_tokens) // sub)


def align(value: int, alignment: int) -> int:
    return (int(value) + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Slot:
    hidden: int
    scales_offset: int
    topk_idx_offset: int
    topk_weights_offset: int
    slot_bytes: int


def slot_for(hidden: int) -> Slot:
    """The slot shape for rows of ``hidden`` elements (BF16 rows fill the data part, FP8 rows half of it)."""
    if hidden <= 0 or (2 * hidden) % 16:
        raise ValueError(f"hidden must be a positive multiple of 8, got {hidden}")
    scales = HEADER_BYTES + 2 * hidden
    ids = scales + 4 * MAX_SCALES
    weights = ids + 4 * MAX_TOPK
    return Slot(hidden, scales, ids, weights, align(weights + 4 * MAX_TOPK, 16))


@dataclass(frozen=True)
class RdmaBufferMap:
    num_nvl_ranks: int
    num_domains: int
    num_channels: int
    cap: int
    slot: Slot
    ring_offset: int
    end: int

    @property
    def meta_ints(self) -> int:
        return 2 * self.num_nvl_ranks + 2

    def meta(self, half: int, ring: int) -> int:
        return (half * self.num_channels * self.num_domains + ring) * self.meta_ints * 4

    def slot_start(self, half: int, ring: int, k: int) -> int:
        r = half * self.num_channels * self.num_domains + ring
        return self.ring_offset + (r * self.cap + k % self.cap) * self.slot.slot_bytes


def rdma_buffer_map(num_nvl_ranks: int, num_domains: int, num_channels: int, cap: int, slot: Slot) -> RdmaBufferMap:
    if not 1 <= num_channels <= MAX_CHANNELS:
        raise ValueError(f"internode kernels support 1..{MAX_CHANNELS} channels, got {num_channels}")
    meta = align(2 * num_channels * num_domains * (2 * num_nvl_ranks + 2) * 4, 128)
    end = meta + 2 * num_channels * num_domains * cap * slot.slot_bytes
    return RdmaBufferMap(num_nvl_ranks, num_domains, num_channels, cap, slot, meta, end)


@dataclass(frozen=True)
class SignalMap:
    tail_offset: int
    head_offset: int
    notify_offset: int
    record_offset: int
    record_stride: int
    end: int


def signal_map(num_nvl_ranks: int, num_domains: int) -> SignalMap:
    D, L = num_domains, num_nvl_ranks
    head = MAX_CHANNELS * D * 8
    notify = 2 * MAX_CHANNELS * D * 8
    record = align(notify + D * 8, 128)
    stride = align(L + L * MAX_LOCAL_EXPERTS + 1, 4)
    return SignalMap(0, head, notify, record, stride, record + 2 * D * stride * 4)


#: int64 words of a dispatch receiver's reply before its row bases (``kReplyWords`` in dispatch.cu).
REPLY_WORDS = constant("internode/dispatch.cu", "kReplyWords")


@dataclass(frozen=True)
class NvlBufferMap:
    meta_offset: int
    ring_offset: int
    notify_offset: int
    record_stride: int
    cap: int
    reply_offset: int
    end: int


def nvl_buffer_map(num_nvl_ranks: int, num_domains: int, num_channels: int, cap: int, slot: Slot,
                   num_local_experts: int) -> NvlBufferMap:
    """Offsets in a rank's NVLink buffer (buffer_map.cuh's header), then the dispatch receivers' replies to
    this rank as a forwarder, int64 ``[C][L][REPLY_WORDS + D]`` (rows in place, dispatch_forward.cuh)."""
    L, D, C = num_nvl_ranks, num_domains, num_channels
    meta = align((2 * MAX_CHANNELS * L + L) * 8, 128)
    ring = meta + align(C * L * D * 2 * 4, 128)
    notify = ring + C * L * cap * slot.slot_bytes
    stride = align(D + num_local_experts, 4)
    reply = align(notify + L * stride * 4, 128)
    return NvlBufferMap(meta, ring, notify, stride, cap, reply, reply + C * L * (REPLY_WORDS + D) * 8)


def state_words(num_nvl_ranks: int, num_domains: int) -> int:
    """int64 words of the persistent per-rank counters (``State`` in buffer_map.cuh)."""
    return 8 + 2 * MAX_CHANNELS * num_domains + 2 * MAX_CHANNELS * num_nvl_ranks
