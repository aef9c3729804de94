"""Buffer map of the low-latency symmetric buffer, and DeepEP's size hint for it.

The symmetric (NVSHMEM) buffer holds two identical halves, *buffer 0* and *buffer 1*: every
low-latency dispatch and every combine uses one half and the next call uses the other, so one call's
receive side may still be read while the next call's send side runs. Inside one half, at offsets that
are the same on every rank (which is what makes the addresses symmetric)::

    tags      uint32 [E]          one word per (receiver-side) slot: (sequence tag << 16) | count
    arrivals  uint64 [E]          put-with-signal counters (only the RMA path, see below)
    receipts  uint32 [R + 1]      word r: the sequence number of the last receive rank r finished on its
                                  copy of this half (written by rank r; a send to r waits for the one of
                                  the call before it on the half: cuda_src/low_latency/receipts.cuh);
                                  word R: the sources done sending the current call (hook mode with an
                                  early receive, receipts.cuh count_send)
    src_idx   int32  [E, T]       dispatch: source token index of each received row
    recv      bytes  [E, T, 2H]   received rows; dispatch reads it as [E_local, R, T], combine as [E, T]
    send      bytes  [E_local, R*T, 2H]
              combine: the rows to return (the zero-copy buffer); RMA path: staging for the puts.
              dispatch (RMA path only): [T] staged messages of 2H bytes.

Where every rank is reached by stores and :meth:`LowLatencyBufferMap.partials_fit` / ``partials_pay``
hold, a combine sends per-rank partial sums (``cuda_src/low_latency/combine_partials.cuh``): the rows
``[R][T]`` (float32 ``[H]``, or with LogFMT one LogFMT-10 row) at the start of ``recv``, then 16-byte
routes ``[R][T][K]``; each block of a source's grid leaves a completion word at the start of ``src_idx``,
``[R][grid]`` uint32 (the dispatch writes only token indices there, which never look like a tag).

Where every rank is reached by stores, the dispatch sends one message per (token, destination rank)
instead of one row per (token, expert) when :meth:`LowLatencyBufferMap.rank_messages_fit` (see
``cuda_src/low_latency/dispatch_ranks.cuh``): message ``j`` from source ``s`` sits at ``recv + (s*T + j)
* rank_message_bytes``, the per-(source, local expert) row counts in ``tags`` (word ``s*E_local + le``)
and the per-source completion words in ``arrivals`` (word ``s``, as uint32), regions the RMA path would
use otherwise.

A receive slot is ``2H`` bytes whatever the format: a BF16 row, an FP8 row followed by its float32
scales (``H + 4 * H/128`` bytes), or a LogFMT-10 row (``168`` bytes per 128 channels).

Both halves fit in the number of bytes DeepEP's ``Buffer.get_low_latency_rdma_size_hint`` returns
for the same arguments (checked by the unit tests for realistic shapes); :func:`rdma_size_hint`
reproduces that formula exactly so that code sized for DeepEP allocates the same amount here.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass

from ..headers import constant

__all__ = [
    "LOGFMT_BLOCK_BYTES",
    "LowLatencyBufferMap",
    "MAX_EXPERTS",
    "MAX_RANKS",
    "MAX_TOKENS",
    "MAX_TOPK",
    "dispatch_message_bytes",
    "combine_message_bytes",
    "rank_message_bytes",
    "rdma_size_hint",
]

#: Channels per FP8 scale and per LogFMT block.
BLOCK = constant("low_latency/buffer_map.cuh", "kChannelsPerBlock")
#: Wire bytes of one LogFMT-10 block (128 channels): 128 low code bytes, 128 x 2 high code bits, float32 lo and
#: step; two blocks form a 256-channel segment (cuda_src/low_latency/logfmt.cuh has the byte order).
LOGFMT_BLOCK_BYTES = 8 + 128 + 32
#: Token chunks of 32 are tracked in shared memory (kMaxTokenChunks in buffer_map.cuh).
MAX_TOKENS = constant("low_latency/buffer_map.cuh", "kMaxTokenChunks") * 32
#: Per-rank mask snapshot in shared memory (kMaxRanks in buffer_map.cuh).
MAX_RANKS = constant("low_latency/buffer_map.cuh", "kMaxRanks")
#: One "arrived" bit per expert in the combine's shared memory (kMaxExperts in buffer_map.cuh).
MAX_EXPERTS = constant("low_latency/buffer_map.cuh", "kMaxExperts")
#: A token's experts are awaited by the lanes of one warp in the combine.
MAX_TOPK = 32
#: Shared-memory table of the dispatch's grid-wide paths, in 4-byte words (kMaxHitWords in
#: dispatch_p2p.cuh).
MAX_HIT_WORDS = constant("low_latency/dispatch_p2p.cuh", "kMaxHitWords")

#: Dynamic shared memory the partial-sum combine's send table may take (the kernel's static arrays use
#: ~38 KiB of the 227 KiB an sm_90 block may have).
MAX_PARTIAL_TABLE_BYTES = 160 * 1024

#: The regions of one buffer half, in address order.
REGIONS = ("tags", "arrivals", "receipts", "src_idx", "recv", "send")

_ALIGN = 16
_BUFFER_ALIGN = 128


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def dispatch_message_bytes(hidden: int, use_fp8: bool) -> int:
    """Bytes a dispatch puts per row: BF16 data, or FP8 data plus float32 scales (16-byte multiple)."""
    if use_fp8:
        return _align(hidden + 4 * (hidden // BLOCK), _ALIGN)
    return 2 * hidden


def combine_message_bytes(hidden: int, use_logfmt: bool) -> int:
    """Bytes a combine puts per row: BF16 data, or LogFMT-10 blocks."""
    if use_logfmt:
        return (hidden // BLOCK) * LOGFMT_BLOCK_BYTES
    return 2 * hidden


def rank_message_bytes(hidden: int, topk: int, use_fp8: bool) -> int:
    """Bytes of one per-(token, rank) dispatch message: the row (FP8: and its scales), then a header of
    the token index and one word per top-k entry, in 16-byte units (RankMsg in dispatch_ranks.cuh)."""
    return dispatch_message_bytes(hidden, use_fp8) + 16 * ((1 + topk + 3) // 4)


def rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Exactly the byte count DeepEP's ``get_low_latency_rdma_size_hint`` returns for these arguments.

    DeepEP sizes two send buffers, two receive buffers and two signalling areas from its message sizes
    (a 16-byte header plus BF16 data, or FP8 data plus scales; combine: BF16 data plus 4 bytes per
    128 channels) and rounds the sum up past the next 128-byte boundary.
    """
    t, h, e = int(num_max_dispatch_tokens_per_rank), int(hidden), int(num_experts)
    num_scales = h // BLOCK
    dispatch_msg = 16 + max(h * 2, h + num_scales * 4)
    combine_msg = num_scales * 4 + h * 2
    send = max(t * dispatch_msg, e * t * combine_msg)
    recv = max(e * t * dispatch_msg, e * t * combine_msg)
    signal = _align(e * 4, 128)
    total = 2 * send + 2 * recv + 2 * signal
    return (total + 128) // 128 * 128


@dataclass(frozen=True)
class LowLatencyBufferMap:
    """Offsets of one low-latency buffer configuration (all in bytes from the symmetric base).

    Arguments:
        num_max_dispatch_tokens_per_rank: ``T``.
        hidden: ``H``.
        num_ranks: ``R``.
        num_experts: ``E`` (a multiple of ``R``).
    """

    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_ranks: int
    num_experts: int

    def __post_init__(self) -> None:
        t, h, r, e = self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_ranks, self.num_experts
        if t <= 0 or h <= 0 or r <= 0 or e <= 0:
            raise ValueError(f"low-latency buffer map needs positive sizes, got T={t}, H={h}, R={r}, E={e}")
        if e % r:
            raise ValueError(f"num_experts={e} is not a multiple of the number of ranks {r}")
        if h % 8:
            raise ValueError(f"hidden={h} must be a multiple of 8")

    # ---- sizes
    @property
    def slot_bytes(self) -> int:
        """Bytes of one receive slot (and of one staged row): ``2 * hidden``."""
        return 2 * self.hidden

    @property
    def tags_bytes(self) -> int:
        return 4 * self.num_experts

    @property
    def arrivals_bytes(self) -> int:
        return 8 * self.num_experts

    @property
    def receipts_bytes(self) -> int:
        return 4 * (self.num_ranks + 1)

    @property
    def sent_offset(self) -> int:
        """Byte offset of the send count (word R) inside the receipts region."""
        return 4 * self.num_ranks

    @property
    def src_idx_bytes(self) -> int:
        return 4 * self.num_experts * self.num_max_dispatch_tokens_per_rank

    @property
    def recv_bytes(self) -> int:
        return self.num_experts * self.num_max_dispatch_tokens_per_rank * self.slot_bytes

    @property
    def send_bytes(self) -> int:
        # E >= R >= 1 rows per token for the combine always cover the T staged dispatch messages.
        return self.num_experts * self.num_max_dispatch_tokens_per_rank * self.slot_bytes

    # ---- offsets inside one half
    @property
    def tags_offset(self) -> int:
        return 0

    @property
    def arrivals_offset(self) -> int:
        return _align(self.tags_offset + self.tags_bytes, _ALIGN)

    @property
    def receipts_offset(self) -> int:
        return _align(self.arrivals_offset + self.arrivals_bytes, _ALIGN)

    # The data regions start on 128-byte lines (a warp's 512-byte access to a row then spans 4 lines, not 5)
    # wherever the two halves still fit DeepEP's size hint so aligned, that is for all but the smallest shapes.
    @functools.cached_property
    def _data_layout(self) -> tuple[int, int, int, int]:
        """``(src_idx, recv, send)`` offsets in a half and the half's bytes, worked out once."""
        t, h, r, e = self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_ranks, self.num_experts
        for align in (_BUFFER_ALIGN, _ALIGN):
            src_idx = _align(self.receipts_offset + self.receipts_bytes, align)
            recv = _align(src_idx + self.src_idx_bytes, align)
            send = _align(recv + self.recv_bytes, align)
            half = _align(send + self.send_bytes, _BUFFER_ALIGN)
            if 2 * half <= rdma_size_hint(t, h, r, e):
                break
        return src_idx, recv, send, half

    @property
    def src_idx_offset(self) -> int:
        return self._data_layout[0]

    @property
    def recv_offset(self) -> int:
        return self._data_layout[1]

    @property
    def send_offset(self) -> int:
        return self._data_layout[2]

    @property
    def half_bytes(self) -> int:
        """Bytes of one of the two halves (128-byte multiple)."""
        return self._data_layout[3]

    @property
    def total_bytes(self) -> int:
        """Bytes of symmetric memory the two halves need."""
        return 2 * self.half_bytes

    def half_base(self, buffer_idx: int) -> int:
        if buffer_idx not in (0, 1):
            raise ValueError(f"buffer index must be 0 or 1, got {buffer_idx}")
        return buffer_idx * self.half_bytes

    def region(self, buffer_idx: int, name: str) -> int:
        """Byte offset from the symmetric base of region ``name`` (one of :data:`REGIONS`) in half
        ``buffer_idx``."""
        base = self.half_base(buffer_idx)
        offsets = {"tags": self.tags_offset, "arrivals": self.arrivals_offset, "receipts": self.receipts_offset,
                   "src_idx": self.src_idx_offset, "recv": self.recv_offset, "send": self.send_offset}
        if name not in offsets:
            raise KeyError(f"unknown low-latency buffer region {name!r}")
        return base + offsets[name]

    def signal_span(self, buffer_idx: int) -> tuple[int, int]:
        """``(offset, bytes)`` of the tags, arrival counters and receipts of one half (what cleaning zeroes)."""
        return self.region(buffer_idx, "tags"), self.src_idx_offset

    def rank_messages_fit(self, topk: int, use_fp8: bool) -> bool:
        """Whether the per-(token, rank) dispatch format applies to these sizes: top-k <= 32, the
        sender's bitmaps (one per expert and one per rank, ``ceil(T/32)`` words each) and the receiver's
        tables fit the shared table, at least two experts per rank (else a token never shares a message
        between experts) and ``R*T`` messages fit the receive region."""
        t, h, r, e = self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_ranks, self.num_experts
        chunks = -(-t // 32)
        return (0 < topk <= MAX_TOPK and e // r >= 2 and (e + r) * chunks <= MAX_HIT_WORDS
                and 2 * r + 1 + e + e // r <= MAX_HIT_WORDS
                and r * t * rank_message_bytes(h, topk, use_fp8) <= self.recv_bytes
                and 4 * r <= self.arrivals_bytes and 4 * e <= self.tags_bytes)

    def partial_table_bytes(self, topk: int) -> int:
        """Dynamic shared memory of the partial-sum combine's send: a count and ``topk`` rows per
        (source, token)."""
        return 4 * self.num_ranks * self.num_max_dispatch_tokens_per_rank * (int(topk) + 1)

    def partial_row_bytes(self, use_logfmt: bool) -> int:
        """Bytes of one per-(token, rank) partial sum: float32, or LogFMT-10 of its BF16 rounding padded to
        16 bytes (kPartialRowBytes in combine_partials.cuh)."""
        return _align(combine_message_bytes(self.hidden, True), _ALIGN) if use_logfmt else 4 * self.hidden

    def partials_fit(self, topk: int, use_logfmt: bool = False, grid: int = 1) -> bool:
        """Whether the per-rank partial-sum combine applies to these sizes (combine_partials.cuh): top-k
        <= 32, the rows ``[R][T]`` and the routes ``[R][T][K]`` (16 bytes each) fit the receive region,
        the completion words of ``grid`` blocks per rank fit the source-index region, a row of the send's
        table packs (local expert << 16) | row, a row of ``x`` has a 32-bit index, and the table fits
        shared memory next to the kernel's own arrays."""
        t, r, e = self.num_max_dispatch_tokens_per_rank, self.num_ranks, self.num_experts
        row = self.partial_row_bytes(use_logfmt)
        return (0 < topk <= MAX_TOPK and r * t <= 1 << 16 and e // r < 1 << 16 and e * t < 1 << 31
                and r * t * (row + 16 * topk) <= self.recv_bytes and 4 * r * int(grid) <= self.src_idx_bytes
                and self.partial_table_bytes(topk) <= MAX_PARTIAL_TABLE_BYTES)

    def partials_pay(self, topk: int, use_logfmt: bool = False) -> bool:
        """Whether one partial row per (token, rank) is expected to carry at most two thirds of the bytes of
        one row per (token, expert). With top-``k`` ids drawn uniformly without repeats, a token reaches
        ``R * (1 - C(E - E_local, k) / C(E, k))`` ranks. A float32 partial is twice a BF16 row, so BF16
        pays at 3 or more experts per rank reached (top-8 of 288: 4 on 2 ranks, 2.2 on 4, 1.5 on 8); a
        LogFMT partial is as long as a LogFMT row, so LogFMT pays at 1.5 or more (and decodes R rows per
        token instead of K)."""
        r, e = self.num_ranks, self.num_experts
        k = min(int(topk), e)
        miss = 1.0
        for i in range(k):  # C(E - E_local, k) / C(E, k), one factor per pick
            miss *= max(0.0, (e - e // r - i) / (e - i))
        reached = r * (1.0 - miss)
        ratio = self.partial_row_bytes(use_logfmt) / combine_message_bytes(self.hidden, use_logfmt)
        return reached > 0 and 3.0 * ratio * reached <= 2.0 * k

    def fits(self, num_bytes: int) -> bool:
        return self.total_bytes <= int(num_bytes)
