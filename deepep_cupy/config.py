"""Tuning configuration of the high-throughput kernels and the buffer size hints derived from it."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .ops.low_latency.buffer_map import rdma_size_hint

__all__ = ["Config", "NUM_MAX_NVL_PEERS", "low_latency_rdma_size_hint"]

# Ranks per NVLink domain that the size formulas assume (DeepEP's constant, kept for identical hints).
NUM_MAX_NVL_PEERS = 8
# Upper bounds the hints reserve room for, per token, in the ring buffers.
_MAX_TOPK = 128
_MAX_SCALES = 128
# Bytes of per-token source metadata carried across RDMA (source node index + NVLink bitmask).
_SOURCE_META_BYTES = 8
# Control word (one int4) each RDMA ring slot carries besides the token.
_RDMA_SLOT_CONTROL_BYTES = 16


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _slot_bytes(hidden_bytes: int) -> int:
    """Bytes one ring slot reserves: the token, its source metadata, top-k ids (int64) and weights, scales."""
    return hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * 8 + _MAX_TOPK * 4 + _MAX_SCALES * 4


@dataclass
class Config:
    """How many SMs and how large chunks the high-throughput kernels use.

    Arguments:
        num_sms: SMs given to a dispatch/combine kernel; half send, half receive, so one channel is two SMs.
        num_max_nvl_chunked_send_tokens: tokens a sender moves over NVLink before publishing progress.
        num_max_nvl_chunked_recv_tokens: capacity, in tokens, of each channel's NVLink receive ring.
        num_max_rdma_chunked_send_tokens: like the NVLink value, for the RDMA stage of internode kernels.
        num_max_rdma_chunked_recv_tokens: like the NVLink value, for the RDMA stage of internode kernels.
    """

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def key(self) -> tuple:
        """The five values as a tuple (what a plan made with this config depends on)."""
        return (self.num_sms, self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens,
                self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens)

    def __post_init__(self) -> None:
        for name in ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                     "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Config.{name} must be a positive int, got {value!r}")
        if self.num_max_nvl_chunked_send_tokens >= self.num_max_nvl_chunked_recv_tokens:
            raise ValueError("Config.num_max_nvl_chunked_send_tokens must be smaller than "
                             "num_max_nvl_chunked_recv_tokens")
        # The RDMA ring holds whole send chunks, so its capacity is rounded up to a multiple of them.
        self.num_max_rdma_chunked_recv_tokens = _align(self.num_max_rdma_chunked_recv_tokens,
                                                       self.num_max_rdma_chunked_send_tokens)
        if self.num_max_rdma_chunked_send_tokens > self.num_max_rdma_chunked_recv_tokens // 2:
            raise ValueError("Config.num_max_rdma_chunked_send_tokens must be at most half of "
                             "num_max_rdma_chunked_recv_tokens")

    @property
    def num_channels(self) -> int:
        return max(self.num_sms // 2, 1)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink buffer the high-throughput kernels need for tokens of ``hidden_bytes`` bytes."""
        if num_ranks <= 0:
            raise ValueError(f"num_ranks must be positive, got {num_ranks}")
        if not (num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0):
            raise ValueError(f"num_ranks must be below {NUM_MAX_NVL_PEERS} or a multiple of it, got {num_ranks}")
        num_rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        num_nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = self.num_channels * num_nvl_ranks * self.num_max_nvl_chunked_recv_tokens
        control = self.num_channels * num_nvl_ranks * (2 * num_rdma_ranks + 3) * 4
        return _align(control + slots * _slot_bytes(hidden_bytes), 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, num_nvl_ranks: int | None = None) -> int:
        """Bytes of RDMA (NVSHMEM) buffer the internode kernels need; 0 when every rank shares one NVLink domain.

        ``num_nvl_ranks`` is the NVLink-domain size; None means DeepEP's 8, for which the value is DeepEP
        V1's byte for byte (0 up to 8 ranks). Per channel and source domain: the control words (for each
        domain rank a start and an end prefix, plus the domain's two prefixes, for dispatch and combine)
        and two rings (dispatch, combine) of ``num_max_rdma_chunked_recv_tokens`` slots, each slot holding
        the token, its source metadata, room for 128 top-k ids (int64) and weights, 128 scales, and one
        16-byte control word; rounded up to 128 bytes.
        """
        if num_ranks <= 0:
            raise ValueError(f"num_ranks must be positive, got {num_ranks}")
        if num_nvl_ranks is None:
            if num_ranks <= NUM_MAX_NVL_PEERS:
                return 0
            num_nvl_ranks = NUM_MAX_NVL_PEERS
        elif isinstance(num_nvl_ranks, bool) or not isinstance(num_nvl_ranks, int) or num_nvl_ranks <= 0:
            raise ValueError(f"num_nvl_ranks must be a positive int, got {num_nvl_ranks!r}")
        if num_ranks % num_nvl_ranks:
            raise ValueError(f"num_ranks ({num_ranks}) must be a multiple of the NVLink-domain size ({num_nvl_ranks})")
        num_rdma_ranks = num_ranks // num_nvl_ranks
        if num_rdma_ranks == 1:
            return 0
        if self.num_sms % 2:
            raise ValueError(f"internode kernels need an even Config.num_sms, got {self.num_sms}")
        slots = self.num_channels * num_rdma_ranks * self.num_max_rdma_chunked_recv_tokens * 2
        control = self.num_channels * num_rdma_ranks * (num_nvl_ranks * 2 + 2) * 2 * 4
        return _align(control + slots * (_slot_bytes(hidden_bytes) + _RDMA_SLOT_CONTROL_BYTES), 128)


@functools.lru_cache(maxsize=64)
def low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                               num_experts: int) -> int:
    """Bytes of symmetric buffer the low-latency kernels need (same value DeepEP reports).

    Cached: every low-latency dispatch checks the buffer against it."""

    return rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
