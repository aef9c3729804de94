"""What the kernels refuse from a call's arguments alone: pure functions of those arguments.

Buffer sizes (the NVLink and NVSHMEM bytes a config, hidden size and top-k need), token, expert, rank and
top-k limits, and the launch limits (channels, SMs) of each family. The GPU engines and plans call these
functions when they make a plan (or an engine), and the reference backend calls the same ones with the
same arguments, so code written and tested without a GPU is refused where its first GPU run would be,
with the same exception and message.

The GPU's SM count is the one limit that is not an argument: the high-throughput kernels need every block
resident at once, one per SM. The functions that check it take ``num_device_sms``; the reference backend
passes None, which skips that check alone (it cannot know which GPU the code will run on).
"""

from __future__ import annotations

import contextlib

from .internode import buffer_map as IL
from .intranode import buffer_map as L
from .low_latency import buffer_map as LL

__all__ = [
    "LAYOUT_MAX_TOPK", "LAYOUT_MAX_COUNT_WORDS", "INTERNODE_MAX_NVL_RANKS", "INTERNODE_MAX_DOMAINS",
    "buffer_sizes", "intranode_ranks", "internode_shape", "low_latency_buffer", "normal_buffers",
    "internode_buffers", "layout_args", "nvl_cap", "intranode_channels", "intranode_grid", "nvl_size",
    "intranode_dispatch", "intranode_combine", "default_channels", "internode_grid", "internode_sizes",
    "internode_dispatch", "internode_combine", "low_latency_buffer_map",
]

#: Top-k of the layout kernel (one instantiation per value).
LAYOUT_MAX_TOPK = 128
#: The layout kernel counts experts, ranks and RDMA ranks in dynamic shared memory, one int32 each.
LAYOUT_MAX_COUNT_WORDS = 48 * 1024
#: Internode: one byte of source-meta bits used, one forwarder warp per local rank.
INTERNODE_MAX_NVL_RANKS = 8
#: Internode: one lane per domain.
INTERNODE_MAX_DOMAINS = 32


# ---------------------------------------------------------------------------------------------------- Buffer
def buffer_sizes(num_ranks: int, num_nvl_ranks: int, num_nvl_bytes: int, num_rdma_bytes: int,
                 low_latency_mode: bool) -> None:
    """The refusals of the ``Buffer`` constructor, in the order the GPU backend makes its engines: the
    NVLink engine of one domain, the low-latency (NVSHMEM) engine, the internode engine."""
    spans = num_nvl_ranks < num_ranks
    if num_nvl_bytes > 0 and not spans:
        intranode_ranks(num_ranks)
    if low_latency_mode or num_rdma_bytes > 0:
        low_latency_buffer(num_ranks, num_rdma_bytes)
    if spans and num_nvl_bytes > 0 and num_rdma_bytes > 0:
        internode_shape(num_nvl_ranks, num_ranks // num_nvl_ranks)


def intranode_ranks(num_ranks: int) -> None:
    if num_ranks > L.MAX_RANKS:
        raise ValueError(f"intranode kernels support up to {L.MAX_RANKS} ranks per NVLink domain, got {num_ranks}")


def internode_shape(num_nvl_ranks: int, num_domains: int) -> None:
    if not 1 <= num_nvl_ranks <= INTERNODE_MAX_NVL_RANKS:
        raise ValueError(f"internode kernels support 1..{INTERNODE_MAX_NVL_RANKS} ranks per domain, got "
                         f"{num_nvl_ranks}")
    if not 2 <= num_domains <= INTERNODE_MAX_DOMAINS:
        raise ValueError(f"internode kernels need 2..{INTERNODE_MAX_DOMAINS} domains, got {num_domains}")


def low_latency_buffer(num_ranks: int, num_rdma_bytes: int) -> None:
    if not 0 < num_ranks <= LL.MAX_RANKS:
        raise ValueError(f"low-latency mode supports up to {LL.MAX_RANKS} ranks, got {num_ranks}")
    if num_rdma_bytes <= 0:
        raise ValueError("low-latency mode needs num_rdma_bytes > 0 (see Buffer.get_low_latency_rdma_size_hint)")


def internode_buffers(op: str, num_ranks: int, num_nvl_ranks: int, num_nvl_bytes: int, num_rdma_bytes: int) -> None:
    """A group of several NVLink domains has the internode buffers only with both sizes positive."""
    if num_nvl_ranks < num_ranks and (num_nvl_bytes <= 0 or num_rdma_bytes <= 0):
        raise RuntimeError(f"{op}: this Buffer spans {num_ranks // num_nvl_ranks} NVLink domains and has no "
                           "internode buffers: create it with num_nvl_bytes > 0 and num_rdma_bytes > 0 "
                           "(Config.get_nvl_buffer_size_hint / get_rdma_buffer_size_hint)")


def normal_buffers(op: str, num_ranks: int, num_nvl_ranks: int, num_nvl_bytes: int, num_rdma_bytes: int) -> None:
    """The high-throughput ops need the NVLink buffer (and across domains the NVSHMEM one too)."""
    internode_buffers(op, num_ranks, num_nvl_ranks, num_nvl_bytes, num_rdma_bytes)
    if num_nvl_bytes <= 0:
        raise RuntimeError(f"{op}: this Buffer has no NVLink buffer: create it with num_nvl_bytes > 0 "
                           "(Config.get_nvl_buffer_size_hint)")


# ---------------------------------------------------------------------------------------------------- layout
def layout_args(num_tokens: int, num_topk: int, num_experts: int, num_ranks: int, num_nvl_ranks: int) -> int:
    """``get_dispatch_layout``'s kernel limits; returns the words of shared memory it counts in."""
    if not 1 <= num_topk <= LAYOUT_MAX_TOPK:
        raise ValueError(f"top-k must be between 1 and {LAYOUT_MAX_TOPK}, got {num_topk}")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by num_ranks ({num_ranks})")
    has_rdma = num_nvl_ranks < num_ranks
    if has_rdma and num_ranks % num_nvl_ranks:
        raise ValueError(f"num_ranks ({num_ranks}) must be a multiple of num_nvl_ranks ({num_nvl_ranks})")
    if num_tokens * num_topk >= 2**31:
        raise ValueError(f"too many tokens for the layout kernel: {num_tokens} x top-{num_topk}")
    rdma_words = num_ranks // num_nvl_ranks if has_rdma else 0
    words = num_experts + num_ranks + rdma_words
    if words > LAYOUT_MAX_COUNT_WORDS:
        raise ValueError(f"num_experts + num_ranks ({num_experts} + {num_ranks}) is too large for the layout "
                         f"kernel: at most {LAYOUT_MAX_COUNT_WORDS - num_ranks - rdma_words} experts here")
    return words


# ---------------------------------------------------------------------------------------------------- intranode
def _row_bytes(hidden: int, itemsize: int) -> int:
    row = hidden * itemsize
    if row <= 0 or row % 16:
        raise ValueError(f"a token row must be a positive multiple of 16 bytes (8 bf16 / 16 fp8 elements), got "
                         f"{hidden} x {itemsize} bytes")
    return row


def nvl_cap(config) -> int:
    cap = int(config.num_max_nvl_chunked_recv_tokens)
    if cap <= 0:
        raise ValueError(f"config.num_max_nvl_chunked_recv_tokens must be positive, got {cap}")
    return cap


def intranode_grid(num_channels: int, num_device_sms: int | None) -> None:
    """Senders and receivers wait for each other, so all ``2 * C`` blocks must be resident at once."""
    if num_device_sms is not None and 2 * num_channels > num_device_sms:
        raise ValueError(f"{num_channels} channels need {2 * num_channels} SMs, but the GPU has {num_device_sms}; "
                         "lower config.num_sms")


def intranode_channels(config, num_device_sms: int | None) -> int:
    """Channels of a dispatch without handle: one sender and one receiver SM each."""
    num_sms = int(config.num_sms)
    if num_sms < 2 or num_sms % 2:
        raise ValueError(f"config.num_sms must be an even number >= 2 (one sender and one receiver SM per "
                         f"channel), got {num_sms}")
    intranode_grid(num_sms // 2, num_device_sms)
    return num_sms // 2


def nvl_size(what: str, need: int, num_nvl_bytes: int, config, hidden_bytes: int, num_ranks: int) -> None:
    if need > num_nvl_bytes:
        hint = None
        with contextlib.suppress(Exception):
            hint = config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)
        extra = f" (Config.get_nvl_buffer_size_hint gives {hint})" if hint else ""
        raise ValueError(f"{what} needs {need} bytes of NVL buffer for this config and hidden size, but the "
                         f"Buffer has num_nvl_bytes={num_nvl_bytes}{extra}; create the Buffer with at "
                         f"least {need} bytes or use fewer SMs / a smaller num_max_nvl_chunked_recv_tokens")


def intranode_dispatch(num_ranks: int, num_nvl_bytes: int, config, *, num_tokens: int, hidden: int, fp8: bool,
                       num_scales: int, num_topk: int, num_local_experts: int, handle_channels: int | None,
                       num_device_sms: int | None):
    """An intranode dispatch's limits (``handle_channels``: the cached handle's channel count, None without
    handle). Returns ``(num_channels, ring capacity, buffer map, notify map or None)``."""
    hidden_bytes = _row_bytes(hidden, 1 if fp8 else 2)
    cap = nvl_cap(config)
    if handle_channels is not None:
        num_channels = int(handle_channels)
        intranode_grid(num_channels, num_device_sms)
    else:
        num_channels = intranode_channels(config, num_device_sms)
    buffer_map = L.buffer_map(num_ranks, num_channels, cap, L.dispatch_slot(hidden_bytes, num_scales, num_topk))
    notify = None if handle_channels is not None else L.notify_map(num_ranks, num_channels, num_local_experts)
    need = L.required_bytes(buffer_map, 0 if notify is None else notify[2], dispatch=True)
    nvl_size("dispatch", need, num_nvl_bytes, config, hidden_bytes, num_ranks)
    shared = L.direct_shared_bytes(num_ranks, num_tokens, num_channels)
    if shared > L.MAX_DIRECT_SHARED:
        raise ValueError(f"dispatch of {num_tokens} tokens over {num_channels} channels needs {shared} bytes "
                         f"of shared memory per block (at most {L.MAX_DIRECT_SHARED}); use more SMs "
                         "(config.num_sms) or fewer tokens per call")
    return num_channels, cap, buffer_map, notify


def intranode_combine(num_ranks: int, num_nvl_bytes: int, config, *, hidden: int, num_topk: int,
                      handle_channels: int, num_device_sms: int | None):
    """An intranode combine's limits; returns ``(ring capacity, buffer map)``."""
    hidden_bytes = _row_bytes(hidden, 2)
    intranode_grid(handle_channels, num_device_sms)
    cap = nvl_cap(config)
    buffer_map = L.buffer_map(num_ranks, handle_channels, cap, L.combine_slot(hidden_bytes, num_topk))
    nvl_size("combine", L.required_bytes(buffer_map), num_nvl_bytes, config, hidden_bytes, num_ranks)
    return cap, buffer_map


# ---------------------------------------------------------------------------------------------------- internode
def default_channels(config, num_nvl_ranks: int, num_domains: int, sub: int | None = None) -> int:
    """Channels of an internode dispatch without handle: ``sub`` (default ``sub_channels`` for its SMs) per SM pair of
    ``config.num_sms``, as many as the combine's progress words allow (``C * D <= MAX_CHANNELS``)."""
    pairs = max(int(config.num_sms) // 2, 1)
    sub = IL.channels_per_block(num_nvl_ranks, num_domains, sub, config.num_sms)
    return max(1, min(pairs * sub, IL.MAX_CHANNELS // num_domains))


def internode_grid(num_channels: int, num_nvl_ranks: int, num_domains: int, num_device_sms: int | None,
                   sub: int | None = None) -> int:
    """Blocks of a launch for ``num_channels`` channels, ``sub`` (default ``sub_channels``) a block. Senders,
    forwarders and receivers wait for each other, so every block must be resident at once: one per SM."""
    if not 1 <= num_channels <= IL.MAX_CHANNELS:
        raise ValueError(f"internode ops support 1..{IL.MAX_CHANNELS} channels, got {num_channels}")
    sub = IL.channels_per_block(num_nvl_ranks, num_domains, sub)
    blocks = 2 * ((num_channels + sub - 1) // sub)
    if num_device_sms is not None and blocks > num_device_sms:
        raise ValueError(f"{num_channels} channels need {blocks} SMs, but the GPU has {num_device_sms}; "
                         "lower config.num_sms")
    return blocks


def internode_sizes(num_nvl_bytes: int, num_rdma_bytes: int, rdma: IL.RdmaBufferMap, nvl: IL.NvlBufferMap) -> None:
    """The buffer maps must fit the buffers the Buffer was created with."""
    if rdma.end > num_rdma_bytes:
        raise ValueError(f"internode ops need {rdma.end} bytes of RDMA buffer for this config and hidden size, "
                         f"the Buffer has num_rdma_bytes={num_rdma_bytes} (Config.get_rdma_buffer_size_hint)")
    if nvl.end > num_nvl_bytes:
        raise ValueError(f"internode ops need {nvl.end} bytes of NVLink buffer for this config and hidden size, "
                         f"the Buffer has num_nvl_bytes={num_nvl_bytes} (Config.get_nvl_buffer_size_hint)")


def internode_dispatch(num_nvl_ranks: int, num_domains: int, num_nvl_bytes: int, num_rdma_bytes: int, config, *,
                       hidden: int, fp8: bool, num_scales: int, num_topk: int, num_local_experts: int,
                       handle_channels: int | None, num_device_sms: int | None, sub: int | None = None):
    """An internode dispatch's limits, ``sub`` channels a block (default ``sub_channels``). Returns
    ``(num_channels, grid, rdma buffer map, nvl buffer map, rdma chunk)``."""
    _row_bytes(hidden, 1 if fp8 else 2)
    L_, D = num_nvl_ranks, num_domains
    sub = IL.channels_per_block(L_, D, sub, config.num_sms)
    num_channels = int(handle_channels) if handle_channels is not None else default_channels(config, L_, D, sub)
    grid = internode_grid(num_channels, L_, D, num_device_sms, sub)
    if num_topk > IL.MAX_TOPK or num_scales > IL.MAX_SCALES:
        raise ValueError(f"internode rows carry at most {IL.MAX_TOPK} top-k entries and {IL.MAX_SCALES} scales")
    if num_local_experts > IL.MAX_LOCAL_EXPERTS:
        raise ValueError(f"internode notify supports up to {IL.MAX_LOCAL_EXPERTS} experts per rank")
    slot = IL.slot_for(hidden)
    rdma_cap, chunk, nvl_cap_ = IL.ring_sizes(config, sub)
    rdma = IL.rdma_buffer_map(L_, D, num_channels, rdma_cap, slot)
    nvl = IL.nvl_buffer_map(L_, D, num_channels, nvl_cap_, slot, num_local_experts)
    internode_sizes(num_nvl_bytes, num_rdma_bytes, rdma, nvl)
    return num_channels, grid, rdma, nvl, chunk


def internode_combine(num_nvl_ranks: int, num_domains: int, num_nvl_bytes: int, num_rdma_bytes: int, config, *,
                      hidden: int, num_topk: int, handle_channels: int, num_device_sms: int | None,
                      sub: int | None = None):
    """An internode combine's limits. The NVLink ring of each (channel, domain rank -> forwarder) is split
    into one sub-ring per source domain, so the config's NVLink ring needs at least ``D`` slots, and its
    progress words are those of ring ``c * D + d``: ``C * D`` must not exceed ``MAX_CHANNELS``. Returns
    ``(grid, rdma buffer map, nvl buffer map, rdma chunk)``."""
    _row_bytes(hidden, 2)
    L_, D = num_nvl_ranks, num_domains
    sub = IL.channels_per_block(L_, D, sub, config.num_sms)
    grid = internode_grid(handle_channels, L_, D, num_device_sms, sub)
    if num_topk > IL.MAX_TOPK:
        raise ValueError(f"internode rows carry at most {IL.MAX_TOPK} top-k weights")
    if handle_channels * D > IL.MAX_CHANNELS:
        raise ValueError(f"the internode combine needs channels x domains <= {IL.MAX_CHANNELS}, got "
                         f"{handle_channels} x {D}")
    slot = IL.slot_for(hidden)
    rdma_cap, chunk, nvl_cap_ = IL.ring_sizes(config, sub)
    rdma = IL.rdma_buffer_map(L_, D, handle_channels, rdma_cap, slot)
    nvl = IL.nvl_buffer_map(L_, D, handle_channels, nvl_cap_, slot, 0)
    if L_ > 1 and nvl.cap < D:  # one rank per domain has no NVLink stage
        raise ValueError(f"the internode combine needs at least {D} NVLink ring slots per channel (one per "
                         f"domain), got {nvl.cap}: config.num_max_nvl_chunked_recv_tokens must be at least "
                         f"{D * sub} ({sub} channels share an SM pair's ring)")
    internode_sizes(num_nvl_bytes, num_rdma_bytes, rdma, nvl)
    return grid, rdma, nvl, chunk


# ---------------------------------------------------------------------------------------------------- low latency
def low_latency_buffer_map(num_ranks: int, num_rdma_bytes: int, num_max_dispatch_tokens_per_rank: int, hidden: int,
                           num_experts: int) -> LL.LowLatencyBufferMap:
    """The symmetric buffer's map for these sizes, checked against the kernels' limits and the buffer:
    ``num_rdma_bytes`` must hold the buffer map and be at least DeepEP's size hint (what the Buffer promises
    to accept), for every low-latency op alike."""
    bmap = LL.LowLatencyBufferMap(int(num_max_dispatch_tokens_per_rank), int(hidden), num_ranks, int(num_experts))
    t, h, e = bmap.num_max_dispatch_tokens_per_rank, bmap.hidden, bmap.num_experts
    if e > LL.MAX_EXPERTS:
        raise ValueError(f"low-latency mode supports up to {LL.MAX_EXPERTS} experts, got {e}")
    if t > LL.MAX_TOKENS:
        raise ValueError(f"num_max_dispatch_tokens_per_rank must be at most {LL.MAX_TOKENS}, got {t}")
    need = max(LL.rdma_size_hint(t, h, num_ranks, e), bmap.total_bytes)
    if num_rdma_bytes < need:
        raise ValueError(f"num_rdma_bytes={num_rdma_bytes} is too small for the low-latency kernels with T={t}, "
                         f"hidden={h}, {num_ranks} ranks, {e} experts: need {need} "
                         "(Buffer.get_low_latency_rdma_size_hint)")
    return bmap
