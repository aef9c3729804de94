"""Handles: the tuples a dispatch returns and later ops take back.

Their plan-key parts (:func:`handle_meta`, :func:`ll_handle_meta`), the classes that mark a handle an op
returned unchanged, and the host checks of the index values of a handle a caller built or
rebuilt (the GPU kernels index memory with them).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..frameworks import is_capturing, is_tensor, meta, to_numpy
from ..reference.normal import channel_prefix_matrix, send_head_matrix
from ..settings import values_enabled
from .plan import NOT_A_KEY

__all__ = ["cached_rows", "handle_meta", "ll_handle_meta", "OpHandle", "DispatchHandle", "LowLatencyHandle",
           "HANDLE_TYPES", "foreign_handle", "device_handle_values", "intranode_handle_values", "ll_handle_values"]


def handle_meta(handle):
    if handle is None:
        return None
    if not isinstance(handle, (tuple, list)) or len(handle) not in (6, 10):
        return NOT_A_KEY
    if isinstance(handle, DispatchHandle):
        # An op's own handle is immutable and its entries' metadata with it: worked out at its first use
        # (a cached dispatch, the combine and the backward calls reuse one handle).
        key = handle.__dict__.get("key")
        if key is None:
            key = handle.key = tuple(meta(h) for h in handle)
        return key
    return tuple(meta(h) for h in handle)


def cached_rows(handle):
    """Rows a cached dispatch with this normal ``handle`` returns: one per entry of its ``recv_src_idx``
    (the internode 10-tuple: ``recv_src_meta``), so with the handle of a ``num_worst_tokens`` dispatch that
    many rows, the ones past the received count unwritten (as DeepEP's). A size as the tensor has it
    (symbolic while torch.compile traces a row count known only at run time)."""
    return (handle[3] if len(handle) == 6 else handle[7]).shape[0]


def ll_handle_meta(handle):
    if type(handle) is LowLatencyHandle and handle.key is not None:
        return handle.key  # what the dispatch plan that made it computed once for all its handles
    if not isinstance(handle, HANDLE_TYPES) or len(handle) != 5:
        return NOT_A_KEY
    return (meta(handle[0]), meta(handle[1]), handle[2], handle[3], handle[4])


class OpHandle(tuple):
    """A handle exactly as one of this library's GPU ops returned it (a plain tuple to its users).

    Its entries were written by the kernels, so the index checks of handles given back to an op (which
    wait for the device) are for handles a caller built or rebuilt, which are plain tuples.
    """

    __slots__ = ()


class DispatchHandle(OpHandle):
    """A normal dispatch's handle as the op returned it, with the top-k width of that dispatch
    (``num_topk``: the columns of its ``topk_idx``, 0 without one), which a combine's ``topk_weights`` must
    have, and what the dispatch read back for the own-row copies of later dispatches with it (ops/own_rows.py):
    ``own_tokens``, this rank's column of ``is_token_in_rank`` (a NumPy bool array), and ``own_first_row``, the
    row of ``recv_x`` where this rank's own rows start; None where it did not. A tuple subclass cannot have
    slots, so the attributes live in a ``__dict__``."""

    def __new__(cls, entries, num_topk: int = 0, own_tokens=None, own_first_row: int | None = None):
        self = super().__new__(cls, entries)
        self.num_topk = num_topk
        self.own_tokens, self.own_first_row = own_tokens, own_first_row
        return self


class LowLatencyHandle:
    """A low-latency dispatch's handle: to its users the 5-tuple ``(src_info, layout_range, T, hidden,
    num_experts)`` (indexing, unpacking, ``len``), and also the dispatch's row map (``row_map``: the inverse
    of its source info, ``[R*T, E_local]`` int32, cuda_src/low_latency/indexing.cuh ``record_row``) for the
    partial-sum combine.

    A GPU dispatch makes it with :meth:`of_dispatch` over the one allocation that holds those tensors
    and the kernels' pointers into it (``ptrs``): the tensors themselves are cut from it only when
    something asks for them (a combine reads the pointers), which keeps three views off every call.

    ``owner``: the backend object (GPU engine or reference backend) of the Buffer whose dispatch made it;
    a combine of another Buffer refuses it (:func:`foreign_handle`): its rows, row map and sequence state
    belong to the other Buffer's buffers. ``key``: its part of a combine's plan key
    (:func:`ll_handle_meta`), the same for every handle of one dispatch plan, or None."""

    __slots__ = ("_entries", "_row_map", "_cut", "owner", "key", "ptrs")

    def __init__(self, entries, row_map=None, owner=None, key=None) -> None:
        self._entries = tuple(entries)
        self._row_map = row_map
        self._cut = None
        self.owner = owner
        self.key = key
        self.ptrs = None  # (src_info, layout_range, row_map or 0) device addresses, from of_dispatch

    @classmethod
    def of_dispatch(cls, frame, words, parts, sizes, ptrs, owner, key):
        """The handle over ``words`` (one allocation laid out as ``parts``, a ``SmallOutputs``): the source
        info is its part 1, the layout ranges part 2, the row map its last part where ``ptrs[2]`` is set;
        ``sizes`` is ``(T, hidden, num_experts)``."""
        self = cls.__new__(cls)
        self._entries = None
        self._row_map = None
        self._cut = (frame, words, parts, sizes)
        self.owner = owner
        self.key = key
        self.ptrs = ptrs
        return self

    @property
    def entries(self) -> tuple:
        """The 5-tuple, its tensors cut from the dispatch's allocation the first time."""
        return self._cut_entries() if self._entries is None else self._entries

    def _cut_entries(self) -> tuple:
        frame, words, parts, sizes = self._cut
        self._entries = (frame.part(words, parts, 1), frame.part(words, parts, 2), *sizes)
        if self.ptrs[2]:
            self._row_map = frame.part(words, parts, len(parts.views) - 1)
        self._cut = None
        return self._entries

    @property
    def row_map(self):
        if self._entries is None:
            self._cut_entries()
        return self._row_map

    def __getitem__(self, i):
        return self.entries[i]

    def __len__(self) -> int:
        return 5

    def __iter__(self):
        return iter(self.entries)

    def __eq__(self, other) -> bool:
        if isinstance(other, LowLatencyHandle):
            other = other.entries
        return self.entries == other if isinstance(other, tuple) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.entries)

    def __reduce__(self):
        return LowLatencyHandle, (self.entries, self.row_map, self.owner, self.key)

    def __repr__(self) -> str:
        return f"LowLatencyHandle{self.entries!r}"


Sequence.register(LowLatencyHandle)
#: What a handle given back to an op may be: the tuples the ops return, a caller's tuple or list.
HANDLE_TYPES = (tuple, list, LowLatencyHandle)


def foreign_handle() -> ValueError:
    """The error of a low-latency combine given a handle another Buffer's dispatch returned."""
    return ValueError("handle was returned by another Buffer's low_latency_dispatch; low_latency_combine takes "
                      "a handle from a low_latency_dispatch of the same Buffer")


# Handles recently checked, by id, with a reference that keeps the id from being reused; a handle is
# normally used by one combine and a few cached dispatches right after the dispatch that made it.
_CHECKED: dict = {}
_CHECKED_MAX = 4


def _bad(name: str, what: str) -> ValueError:
    return ValueError(f"{name} {what}: the handle is not one dispatch returned (or was modified)")


def intranode_handle_values(h, rank: int, num_ranks: int) -> None:
    """Index checks of the intranode 6-tuple, as NumPy arrays ``h``, for this ``rank``; each entry must be
    what the dispatch derived (the GPU kernels index memory with them)."""

    rp, cp, rcp, src, in_rank, head = (np.asarray(a) for a in h)
    in_rank = in_rank.astype(bool)
    rows = src.shape[0]
    if (rp < 0).any() or (np.diff(rp.astype(np.int64), axis=0) < 0).any():
        raise _bad("handle[0] (rank_prefix_matrix)", "must be non-negative and non-decreasing down each column")
    ends = rp[:, rank].astype(np.int64)
    if ends[-1] > rows:
        raise _bad("handle[0] (rank_prefix_matrix)", f"says rank {rank} received {int(ends[-1])} rows, more than "
                   f"the {rows} rows of handle[3] (recv_src_idx)")
    c = cp.shape[1]
    if not np.array_equal(cp, channel_prefix_matrix(in_rank, c)):
        raise _bad("handle[1] (channel_prefix_matrix)", "does not count the tokens of handle[4] (is_token_in_rank) "
                   "per channel")
    if not np.array_equal(head, send_head_matrix(in_rank)):
        bad = int(np.count_nonzero(head != send_head_matrix(in_rank)))
        raise _bad("handle[5] (send_head)", f"has {bad} entries that are not -1 where handle[4] is False and the "
                   "token's position among those sent to the rank where it is True")
    got = np.diff(np.concatenate([[0], ends]))  # rows received from each source
    rcp = rcp.astype(np.int64)
    if (rcp[:, 0] != 0).any() or (np.diff(rcp, axis=1) < 0).any() or (rcp[:, -1] > got).any():
        raise _bad("handle[2] (recv_channel_prefix_matrix)", "must start at 0 and rise along each row to at most the "
                   "rows received from that rank (handle[0])")
    received = src[:ends[-1]].astype(np.int64)
    if received.size and received.min() < 0:
        raise _bad("handle[3] (recv_src_idx)", "holds negative token indices among the received rows")
    # Rows of one source come in its token order: indices rise strictly within each source's block.
    rising = np.diff(received) > 0
    starts = ends[:-1][(ends[:-1] > 0) & (ends[:-1] < ends[-1])] - 1  # the steps from one block to the next
    rising[starts] = True
    if not rising.all():
        raise _bad("handle[3] (recv_src_idx)", "must rise strictly within the rows of each source rank")


def ll_handle_values(h, num_ranks: int) -> None:
    """Index checks of a low-latency handle ``(src_info, layout_range, T, hidden, num_experts)`` with its
    tensors as NumPy arrays: row ranges inside the ``R * T`` rows of each local expert, not overlapping, and
    every row's source token in ``[0, T)``."""
    src_info, layout_range = np.asarray(h[0]), np.asarray(h[1]).astype(np.int64)
    t = int(h[2])
    slab = num_ranks * t
    begin, count = layout_range >> 32, layout_range & 0xFFFFFFFF
    if (begin < 0).any() or (count > t).any() or (begin + count > slab).any():
        raise _bad("handle[1] (layout_range)", f"has row ranges outside [0, {slab}) or longer than T={t}")
    # By begin, then count: an empty range may share its begin with the range that follows it.
    order = np.argsort(begin * (slab + 1) + count, axis=1, kind="stable")
    b, n = np.take_along_axis(begin, order, 1), np.take_along_axis(count, order, 1)
    if (b[:, 1:] < b[:, :-1] + n[:, :-1]).any():
        raise _bad("handle[1] (layout_range)", "has overlapping row ranges within a local expert")
    # Rows inside some range: +1 where a range starts, -1 where it ends, running sum > 0.
    edges = np.zeros((begin.shape[0], slab + 1), np.int64)
    experts = np.repeat(np.arange(begin.shape[0]), begin.shape[1])
    np.add.at(edges, (experts, begin.ravel()), 1)
    np.add.at(edges, (experts, (begin + count).ravel()), -1)
    tokens = src_info[np.cumsum(edges, axis=1)[:, :slab] > 0]
    if tokens.size and (tokens.min() < 0 or tokens.max() >= t):
        raise _bad("handle[0] (src_info)", f"names source tokens outside [0, {t}) (T) in received rows")


def device_handle_values(buffer, handle) -> None:
    """The index checks of a GPU ``handle`` given to ``buffer``'s op, once per handle, when validation is on,
    no CUDA graph is being captured (the host copy waits for the device) and the handle is not one an op
    returned as it was (:class:`OpHandle`, :class:`LowLatencyHandle`: eager steps pay no wait for their
    own). Internode handles are left to their own checks. Raises ``ValueError`` naming the entry."""
    if isinstance(handle, (OpHandle, LowLatencyHandle)) or not values_enabled() or not is_tensor(handle[0]) or len(handle) not in (5, 6):
        return  # an op's own handle, unchanged: the kernels wrote it
    key = (id(handle), buffer.rank, buffer.group_size)
    if key in _CHECKED or is_capturing(handle[0]):
        return
    # The dispatch that made the handle may still run on the communication stream (async_finish).
    stream = getattr(buffer.runtime, "comm_stream", None)
    if stream is not None:
        stream.synchronize()
    if len(handle) == 6:
        intranode_handle_values([to_numpy(a) for a in handle], buffer.rank, buffer.group_size)
    else:
        ll_handle_values((to_numpy(handle[0]), to_numpy(handle[1]), handle[2]), buffer.group_size)
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.pop(next(iter(_CHECKED)))
    _CHECKED[key] = handle
