"""Buffer map of the intranode NVL buffer: pure arithmetic, shared by the launchers and the CPU tests.

The device side of this map is described in ``cuda_src/intranode/buffer_map.cuh``; every offset the kernels
use comes from here and is passed to them as an argument.

Per rank, for ``R`` ranks and ``C`` channels::

    [0, ctrl_bytes)                     control words (uint64): arrive[R], notify_flag[R], local_seq, done_count,
                                        dest[R] (8 words each: where rank s's direct-dispatch outputs are),
                                        copy_flag[R], copy_done[R] (the combine's copy mode)
    [ring_offset, free_offset)          C * R rings of ``cap`` slots of ``slot_bytes`` (ring (c, s) = from rank s)
    [free_offset, end)                  C * R * cap uint64 "slot free" words (word (c, d, k): from rank d)
    [ring_offset, ring_offset + R * notify_stride * 4)   notify records (notify kernel only; overlaps the rings)

A dispatch also has R x 2C done words right after the free words (word (s, b): block b of rank s has
written everything it sends; used by the direct mode, see ``cuda_src/intranode/dispatch_direct.cuh``).

Dispatch slot: 16-byte header (uint64 flag, int32 source token), hidden bytes, scales (4 bytes each),
top-k ids (int32), top-k weights (float32), each part starting 16-byte aligned. Combine slot: header,
hidden bytes, top-k weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..headers import constant

__all__ = [
    "HEADER_BYTES",
    "MAX_DIRECT_SHARED",
    "MAX_RANKS",
    "Slot",
    "IntranodeBufferMap",
    "align",
    "ctrl_bytes",
    "copy_flag_offset",
    "dispatch_slot",
    "combine_slot",
    "buffer_map",
    "required_bytes",
    "direct_shared_bytes",
    "notify_map",
    "channel_bounds",
    "split_warps",
]

#: Bytes of a ring slot's header (kSlotHeaderBytes).
HEADER_BYTES = constant("intranode/buffer_map.cuh", "kSlotHeaderBytes")
MAX_RANKS = 8
#: Most dynamic shared memory a dispatch block may use for its chunk masks (sm_90 allows 227 KiB).
MAX_DIRECT_SHARED = 200 * 1024


def align(value: int, alignment: int) -> int:
    return (int(value) + alignment - 1) // alignment * alignment


def ctrl_bytes(num_ranks: int) -> int:
    """Bytes of the fixed control area: 2R + 2 uint64 words, R dest entries of 8 words, then the copy mode's
    R copy flags and R copy-done words of the combine, rounded up to 128 bytes."""
    return align(8 * (2 * num_ranks + 2) + 64 * num_ranks + 16 * num_ranks, 128)


def copy_flag_offset(num_ranks: int, src: int) -> int:
    """Byte offset of ``copy_flag[src]`` in a rank's control words (``Ctrl::copy_flag`` in buffer_map.cuh)."""
    return 8 * (10 * num_ranks + 2 + src)


@dataclass(frozen=True)
class Slot:
    """Byte offsets inside one ring slot; ``slot_bytes`` is a multiple of 16."""

    hidden_bytes: int
    num_scales: int
    num_topk: int
    scales_offset: int
    topk_idx_offset: int
    topk_weights_offset: int
    slot_bytes: int


def dispatch_slot(hidden_bytes: int, num_scales: int, num_topk: int) -> Slot:
    if hidden_bytes <= 0 or hidden_bytes % 16:
        raise ValueError(f"a token row must be a positive multiple of 16 bytes, got {hidden_bytes}")
    off = HEADER_BYTES + hidden_bytes
    scales = off
    off += align(4 * num_scales, 16)
    topk_idx = off
    off += align(4 * num_topk, 16)
    topk_weights = off
    off += align(4 * num_topk, 16)
    return Slot(hidden_bytes, num_scales, num_topk, scales, topk_idx, topk_weights, off)


def combine_slot(hidden_bytes: int, num_topk: int) -> Slot:
    if hidden_bytes <= 0 or hidden_bytes % 16:
        raise ValueError(f"a token row must be a positive multiple of 16 bytes, got {hidden_bytes}")
    off = HEADER_BYTES + hidden_bytes
    weights = off
    off += align(4 * num_topk, 16)
    return Slot(hidden_bytes, 0, num_topk, weights, weights, weights, off)


@dataclass(frozen=True)
class IntranodeBufferMap:
    num_ranks: int
    num_channels: int
    cap: int
    slot: Slot
    ring_offset: int
    free_offset: int
    end: int

    def ring_start(self, channel: int, src: int) -> int:
        """Offset of slot 0 of ring (channel, src) in the receiver's buffer."""
        return self.ring_offset + (channel * self.num_ranks + src) * self.cap * self.slot.slot_bytes

    def slot_start(self, channel: int, src: int, slot: int) -> int:
        return self.ring_start(channel, src) + slot * self.slot.slot_bytes

    def free_word(self, channel: int, dst: int, slot: int) -> int:
        """Offset of the "slot free" word (channel, dst, slot) in the sender's buffer."""
        return self.free_offset + ((channel * self.num_ranks + dst) * self.cap + slot) * 8


def buffer_map(num_ranks: int, num_channels: int, cap: int, slot: Slot) -> IntranodeBufferMap:
    if not 1 <= num_ranks <= MAX_RANKS:
        raise ValueError(f"intranode kernels support 1..{MAX_RANKS} ranks, got {num_ranks}")
    if num_channels <= 0:
        raise ValueError(f"need at least one channel, got {num_channels}")
    if cap <= 0:
        raise ValueError(f"ring capacity must be positive, got {cap}")
    ring_offset = ctrl_bytes(num_ranks)
    free_offset = ring_offset + num_channels * num_ranks * cap * slot.slot_bytes
    end = free_offset + num_channels * num_ranks * cap * 8
    return IntranodeBufferMap(num_ranks, num_channels, cap, slot, ring_offset, free_offset, end)


def required_bytes(bmap: IntranodeBufferMap, notify_end: int = 0, *, dispatch: bool = False) -> int:
    """NVL buffer bytes of a call; a dispatch also has its done words after the free words."""
    end = bmap.end + (8 * bmap.num_ranks * 2 * bmap.num_channels if dispatch else 0)
    return max(end, notify_end)


def direct_shared_bytes(num_ranks: int, num_tokens: int, num_channels: int) -> int:
    """Dynamic shared memory of a direct dispatch block: a mask and a prefix count per 32-token chunk of
    a channel and destination."""
    per_channel = -(-num_tokens // num_channels)
    return 8 * num_ranks * max(1, -(-per_channel // 32))


def notify_map(num_ranks: int, num_channels: int, num_local_experts: int) -> tuple[int, int, int]:
    """``(notify_offset, notify_stride_ints, end)`` of the notify records."""
    stride = align(num_ranks + num_channels + num_local_experts, 4)
    offset = ctrl_bytes(num_ranks)
    return offset, stride, offset + num_ranks * stride * 4


def channel_bounds(num_tokens: int, num_channels: int, channel: int) -> tuple[int, int]:
    """Token range of a channel, as the kernels compute it (contiguous ranges of ceil(N / C) tokens)."""
    per = -(-num_tokens // num_channels)
    begin = min(per * channel, num_tokens)
    return begin, min(begin + per, num_tokens)


def split_warps(warp: int, num_warps: int, groups: int) -> tuple[int, int, int]:
    """Python twin of the kernels' split_warps: ``(group, index in group, group size)``."""
    base, extra = divmod(num_warps, groups)
    big = extra * (base + 1)
    if warp < big:
        return warp // (base + 1), warp % (base + 1), base + 1
    return extra + (warp - big) // base, (warp - big) % base, base
