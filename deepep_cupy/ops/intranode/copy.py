"""Copy mode of the intranode combine: rows go home through the copy engines, a kernel sums them.

The rows a rank received from home ``h`` in the dispatch are one contiguous block of the combine's input,
so instead of pushing them row by row from the SMs (the ring mode), a side stream copies each block into
``h``'s staging area (a fixed region at the end of ``h``'s output pool, mapped into every rank) in chunks
(:func:`chunk_sizes`), and after each chunk a second side stream stores into ``h``'s control words how
many of the block's rows have landed. The kernel (``cuda_src/intranode/combine_copy.cu``) runs at the same time on the communication
stream and sums each token as soon as the chunks holding its rows have landed. With several homes the blocks go in
turns, every rank into a different home at each turn, and each turn's first copy waits for the home's previous
occupant (:func:`turn_waits`).

Every rank must know every block's size on the host to issue the copies, which the dispatch that made the
handle read back with its one host wait (:attr:`IntranodeHandle.counts`). A combine takes the ring mode
when it does not have them (a handle from a dispatch with ``num_worst_tokens``, or one a caller rebuilt),
when some home's staging area is too small, or while its stream is being captured (a replayed graph would
repeat the flags' sequence numbers). All ranks decide from the same counts, so they take the same mode.
"""

from __future__ import annotations

import functools

import numpy as np

from ...device.launch import LaunchPlan
from ...device.streams import create_events, destroy_events
from ...jit import BuildSpec
from ..handles import DispatchHandle
from ..headers import constant
from ..kernel_names import intranode_combine_copy
from . import buffer_map as L
from .args import COMBINE_COPY

__all__ = ["DEFAULT_CHUNK_ROWS", "IntranodeHandle", "CopyCombine", "chunk_sizes", "combine_copy_spec", "copy_schedule",
           "default_rounds", "fits", "home_counts", "part_end", "part_rows", "round_weights", "staging_map",
           "stream_writes_supported", "turn_waits"]

#: A copy flag is (copy sequence << ROW_BITS) | rows copied so far.
ROW_BITS = constant("intranode/combine_copy.cu", "kCopyRowBits")
# Rows per copy: 512 and 1024 measured fastest, and 1024 issues fewer copies (less host time per call); 2048
# was slower.
DEFAULT_CHUNK_ROWS = 1024
# Rounds of turns (copy_schedule) by the copy kernel's SM count, ``(most SMs, rounds)`` with rounds a count of equal
# parts or their relative sizes, the first row that covers a launch wins; 1 above them. Where the sums are slow
# (few SMs), starting them after a part of the copies pays for the extra turns. The tokens of the last part are
# summed only once its last turn has landed, so a small last part ends the combine sooner: 6:3:1 at 8 SMs and 2:1
# at 12 measured fastest at 3 and 4 ranks; from 16 SMs one round did (docs/design/intranode.md).
ROUNDS_BY_SMS = ((8, (6, 3, 1)), (12, (2, 1)))
STAGING_ALIGN = 256
_MEMCPY_DEFAULT = 4


class IntranodeHandle(DispatchHandle):
    """An intranode dispatch's handle, which also keeps ``counts`` (the rank prefix matrix as nested tuples of
    ints, or None), read back in the dispatch's host wait, for the copy-mode combine; ``own_tokens`` and
    ``own_first_row`` as :class:`DispatchHandle`'s."""

    def __new__(cls, entries, counts=None, own_tokens=None, num_topk: int = 0, own_first_row: int | None = None):
        self = super().__new__(cls, entries, num_topk, own_tokens, own_first_row)
        self.counts = counts
        return self


@functools.cache
def combine_copy_spec(num_ranks: int, warps: int, unroll: int, ordered: bool = False) -> BuildSpec:
    return BuildSpec.make("intranode/combine_copy.cu",
                          name_expressions=[intranode_combine_copy(num_ranks, warps, unroll, ordered)])


def stream_writes_supported(device_id: int) -> bool:
    """Whether the device runs 64-bit stream memory operations (the copy mode's flags and turn waits)."""
    try:
        from cuda.bindings import driver

        attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
        err, value = driver.cuDeviceGetAttribute(attr, device_id)
        return int(err) == 0 and bool(value)
    except Exception:  # noqa: BLE001 - no driver: the copy mode is off
        return False


def home_counts(rank_prefix) -> list[list[int]]:
    """``cnt[h][q]``: rows rank ``q`` received from home ``h`` (what ``q`` sends back to ``h`` in a combine),
    from the rank prefix matrix (``[i][r]`` = rows rank ``r`` receives from ranks ``0..i``)."""
    R = len(rank_prefix)
    return [[int(rank_prefix[h][q]) - (int(rank_prefix[h - 1][q]) if h > 0 else 0) for q in range(R)]
            for h in range(R)]


def staging_map(cnt, home: int, hidden_bytes: int, num_topk: int) -> tuple[list[int], int, int]:
    """Staging area of ``home``: ``(first row of every source's slot (0 for the home itself), byte offset of
    the weights slots, bytes used)``."""
    first, rows = [], 0
    for q in range(len(cnt)):
        first.append(rows if q != home else 0)
        if q != home:
            rows += cnt[home][q]
    weights_offset = L.align(rows * hidden_bytes, STAGING_ALIGN)
    return first, weights_offset, weights_offset + rows * num_topk * 4


def chunk_sizes(n: int, chunk_rows: int) -> list[int]:
    """Rows per copy of an ``n``-row block: ``chunk_rows`` each, tapered to a quarter and a half of it at both
    ends (a block of at most ``chunk_rows`` rows is one copy, one of at most 1.5 ``chunk_rows`` two). Each copy
    costs a few microseconds of its own, so chunks are large in the middle; small first chunks let the sums
    start early and small last ones leave little to sum after the last lands."""
    if n <= 0:
        return []
    q, h = max(1, chunk_rows // 4), max(1, chunk_rows // 2)
    if n <= chunk_rows:
        return [n]
    if n <= 2 * (q + h):
        return [n // 2, n - n // 2]
    middle = n - 2 * (q + h)
    return [q, h] + [chunk_rows] * (middle // chunk_rows) + ([middle % chunk_rows] if middle % chunk_rows else []) + [h, q]


def default_rounds(num_ranks: int, num_sms: int) -> int | tuple[int, ...]:
    """Rounds of turns of a copy-mode combine whose sums run on ``num_sms`` SMs (a count, or the parts' relative
    sizes): :data:`ROUNDS_BY_SMS` with more than 2 ranks (with one home there are no turns to cut), else 1."""
    if num_ranks > 2:
        for max_sms, rounds in ROUNDS_BY_SMS:
            if num_sms <= max_sms:
                return rounds
    return 1


def round_weights(rounds) -> tuple[int, ...]:
    """The parts of a home's block as relative sizes: ``rounds`` equal ones for an int, else ``rounds`` itself
    (positive ints, one a round)."""
    weights = (1,) * int(rounds) if isinstance(rounds, (int, np.integer)) else tuple(int(w) for w in rounds)
    if not weights or min(weights) < 1:
        raise ValueError(f"rounds must be at least 1, or weights of at least 1 each, got {rounds!r}")
    return weights


def part_end(rows: int, k: int, rounds) -> int:
    """Rows of a home's block (``rows`` of them) that its first ``k + 1`` parts hold (``rounds``: a count of
    equal parts or their relative sizes, :func:`round_weights`)."""
    weights = round_weights(rounds)
    return rows * sum(weights[:k + 1]) // sum(weights)


def part_rows(rows: int, k: int, rounds) -> int:
    """Rows of part ``k`` alone of a home's block of ``rows`` rows (:func:`part_end`)."""
    return part_end(rows, k, rounds) - (part_end(rows, k - 1, rounds) if k > 0 else 0)


def copy_schedule(cnt, me: int, hidden_bytes: int, num_topk: int, chunk_rows: int, rounds=1,
                  whole_turns: bool = True):
    """What rank ``me`` copies, in issue order: ``[(home, kind, dst byte offset in home's staging area, src
    row of x, rows, rows of the block copied once this one lands)]`` with ``kind`` "w" (the block's top-k
    weights, all at once, first) or "x" (a chunk of rows, followed by its flag).

    Each home's block is cut into ``rounds`` parts of about equal rows, or of the relative sizes ``rounds`` gives
    (:func:`round_weights`);
    in every round the homes take their turns in the order ``me + 1, me + 2, ...``, so at each turn every rank
    copies into a different home. Fewer rounds keep a copy engine on one destination longer, where it moves
    about half as much again as when consecutive copies alternate between destinations. More rounds let every
    home's sums start earlier: a token is summed once the parts holding its rows from every source have landed.

    A part goes in chunks (``chunk_sizes``) in the round's last turn only, or in every turn when ``whole_turns``
    is False; in the earlier turns it is one copy. A home's sums wait for the part of the round's last turn
    anyway (at 4 ranks 90% of the tokens have a row from every source), so only that part's flags let them
    start sooner, and every copy costs the engine time of its own (whole blocks copied measurably faster than
    chunks of 1024 rows)."""
    num_rounds = len(round_weights(rounds))
    R = len(cnt)
    homes = [(me + i) % R for i in range(1, R)]
    out, parts = [], {}
    for h in homes:
        first, weights_offset, _ = staging_map(cnt, h, hidden_bytes, num_topk)
        src = sum(cnt[q][me] for q in range(h))  # rows me received from ranks before h
        n = cnt[h][me]
        if n and num_topk:
            out.append((h, "w", weights_offset + first[me] * num_topk * 4, src, n, 0))
        parts[h], done = [], 0
        chunked = h == homes[-1] or not whole_turns  # this home's turn is each round's last
        for k in range(num_rounds):
            part, end = [], part_end(n, k, rounds)
            for size in chunk_sizes(end - done, chunk_rows) if chunked else [end - done] * (end > done):
                part.append((h, "x", (first[me] + done) * hidden_bytes, src + done, size, done + size))
                done += size
            parts[h].append(part)
    for k in range(num_rounds):
        for h in homes:
            out += parts[h][k]
    return out


def turn_waits(cnt, me: int, rounds, schedule) -> dict[int, tuple[int, int, int]]:
    """Where rank ``me``'s copies wait: ``{index in schedule: (home, source, rows)}``, the first copy of every
    turn after the first waiting until ``source``, the rank that last copied rows into the same home in an
    earlier turn, has landed ``rows`` rows there (its copy flag in the home's control words).

    In turn ``g`` (``g = k (R - 1) + i - 1`` for round ``k``, offset ``i``) rank ``p`` copies into ``p + i``, so
    no two ranks share a home while they keep in step. Unsynchronised, a rank that ran ahead started its next turn
    into a home still being filled by the rank behind it, and both copies went at half speed. Where the previous turn's rank copies no rows into the home (an empty part), the wait goes
    to the turn before it, and so on; a turn whose occupant before it is ``me`` (two ranks), or that has none,
    waits for nothing."""
    R, weights = len(cnt), round_weights(rounds)
    out, seen = {}, set()
    for idx, (home, kind, _dst, _src, size, done) in enumerate(schedule):
        n = cnt[home][me]
        if kind != "x" or n == 0:
            continue
        k = next(k for k in range(len(weights)) if done - size < part_end(n, k, weights))  # the chunk's part
        if (home, k) in seen:
            continue  # not the turn's first copy
        seen.add((home, k))
        g = k * (R - 1) + (home - me) % R - 1
        for prev in range(g - 1, -1, -1):  # the latest earlier turn that put rows into this home
            k_prev, i_prev = divmod(prev, R - 1)
            source = (home - i_prev - 1) % R
            if source == me:
                break  # with one home, me itself: the stream keeps that order
            if part_rows(cnt[home][source], k_prev, weights):
                out[idx] = (home, source, part_end(cnt[home][source], k_prev, weights))
                break
    return out


def fits(cnt, hidden_bytes: int, num_topk: int, staging_bytes: int) -> bool:
    """True when every home's staging area holds what it receives."""
    return all(staging_map(cnt, h, hidden_bytes, num_topk)[2] <= staging_bytes for h in range(len(cnt)))


def combine_copy_args(*, x, topk_weights, num_topk, bias_0, bias_1, rank_prefix_matrix, send_head, num_tokens,
                      hidden_int4, combined_x, combined_topk_weights, bases, staging, weights_offset, copy_seq,
                      err_ptr, timeout_ns, rank, order_topk_idx=0, order_num_topk=0, num_local_experts=1) -> dict:
    """Values of ``CombineCopyArgs`` (integers: pointers; the order fields as in ``args.combine_args``)."""
    return dict(x=x, topk_weights=topk_weights, num_topk=num_topk, bias_0=bias_0, bias_1=bias_1,
                rank_prefix_matrix=rank_prefix_matrix, send_head=send_head, num_tokens=num_tokens,
                hidden_int4=hidden_int4, combined_x=combined_x, combined_topk_weights=combined_topk_weights,
                order_topk_idx=order_topk_idx, order_num_topk=order_num_topk, num_local_experts=num_local_experts,
                bases=bases, staging=staging, weights_offset=weights_offset, copy_seq=copy_seq, err=err_ptr,
                timeout_ns=timeout_ns, rank=rank)


class CopyCombine:
    """The copy-mode combine of one :class:`~deepep_cupy.ops.intranode.plans.CombinePlan` (same shapes)."""

    def __init__(self, engine, *, hidden: int, num_tokens: int, num_topk: int, num_sms: int,
                 comm_stream: int, order_num_topk: int = 0, num_local_experts: int = 1) -> None:
        import cupy

        self.engine, self.comm_stream = engine, comm_stream
        self.hidden_bytes, self.num_topk = hidden * 2, num_topk
        self.chunk_rows = int(engine.copy_chunk_rows)
        self.rounds = round_weights(default_rounds(engine.num_ranks, num_sms) if engine.copy_rounds is None
                                    else engine.copy_rounds)
        self.gated = bool(engine.copy_turn_waits)
        self.whole_turns = bool(engine.copy_whole_turns)
        if self.chunk_rows <= 0:
            raise ValueError(f"copy_chunk_rows must be positive, got {self.chunk_rows}")
        pool = engine.output_pool
        self.staging_ptrs, self.staging_bytes = pool.staging_ptrs, pool.staging_bytes
        R, me = engine.num_ranks, engine.rank
        self.flag_ptrs = [int(p) + L.copy_flag_offset(R, me) for p in engine.buffer.peer_ptrs]
        warps, unroll = engine.combine_shape(num_sms, copy=True)
        ordered = order_num_topk > 0
        kernel = engine.kernel(combine_copy_spec(R, warps, unroll, ordered),
                               intranode_combine_copy(R, warps, unroll, ordered))
        named = combine_copy_args(
            x=0, topk_weights=0, num_topk=num_topk, bias_0=0, bias_1=0, rank_prefix_matrix=0, send_head=0,
            num_tokens=num_tokens, hidden_int4=self.hidden_bytes // 16, combined_x=0, combined_topk_weights=0,
            bases=engine.bases, staging=self.staging_ptrs[me], weights_offset=0, copy_seq=0,
            err_ptr=engine.errors.ptr, timeout_ns=engine.timeout_ns, rank=me, order_num_topk=order_num_topk,
            num_local_experts=num_local_experts)
        self.plan = LaunchPlan(kernel, num_sms, warps * 32, COMBINE_COPY, named)
        self.slots = tuple(self.plan.slot(n) for n in (
            "x", "topk_weights", "bias_0", "bias_1", "rank_prefix_matrix", "send_head", "combined_x",
            "combined_topk_weights", "weights_offset", "copy_seq", "order_topk_idx"))
        rt = cupy.cuda.runtime
        self._rt = rt
        # start, copies done, flags done; then one per chunk (made as schedules need them).
        self.events = create_events(rt, 3)
        self.side, self.flag_side = engine.copy_stream(0), engine.copy_stream(1)
        from cuda.bindings import driver

        self._write, self._wait_value = driver.cuStreamWriteValue64, driver.cuStreamWaitValue64
        self._flag_handle, self._side_handle = driver.CUstream(self.flag_side), driver.CUstream(self.side)
        self._peer_ptrs = [int(p) for p in engine.buffer.peer_ptrs]
        self._counts = self._prepared = None

    def prepare(self, counts):
        """The schedule and this rank's weights offset for ``counts``, or None when the copy mode does not
        fit them (the last counts' result is kept: a cached dispatch loop reuses one handle)."""
        if counts is self._counts:
            return self._prepared
        cnt = home_counts(counts)
        me = self.engine.rank
        prepared = None
        if fits(cnt, self.hidden_bytes, self.num_topk, self.staging_bytes):
            schedule = copy_schedule(cnt, me, self.hidden_bytes, self.num_topk, self.chunk_rows, self.rounds,
                                     self.whole_turns)
            R = len(cnt)
            waits = {} if not self.gated else {
                i: (self._peer_ptrs[home] + L.copy_flag_offset(R, source), rows)
                for i, (home, source, rows) in turn_waits(cnt, me, self.rounds, schedule).items()}
            prepared = (schedule, staging_map(cnt, me, self.hidden_bytes, self.num_topk)[1], waits)
        self._counts, self._prepared = counts, prepared
        return prepared

    def run(self, prepared, x, handle, topk_weights, bias_0, bias_1, combined, combined_w, ptr,
            order_topk_idx=None) -> None:
        """Queue the sums on the communication stream and the copies on the side stream; the communication
        stream then waits for the copies (they read ``x``). The kernel goes first: a copy may wait for a peer's
        flag (turn_waits), and on a wait that runs out the kernel raises every flag of its own, so that no peer's
        copies wait for it any longer (combine_copy.cu)."""
        engine, rt, comm, side, flag_side = self.engine, self._rt, self.comm_stream, self.side, self.flag_side
        schedule, weights_offset, waits = prepared
        engine.copy_seq += 1
        seq = engine.copy_seq
        events = self.events
        if len(events) < 3 + len(schedule):
            events += create_events(rt, 3 + len(schedule) - len(events))
        rt.eventRecord(events[0], comm)
        rt.streamWaitEvent(side, events[0], 0)
        xp = ptr(x)
        wp = ptr(topk_weights) if topk_weights is not None else 0
        s_x, s_w, s_b0, s_b1, s_rank, s_head, s_out, s_out_w, s_woff, s_seq, s_order = self.slots
        s_order.value = 0 if order_topk_idx is None else ptr(order_topk_idx)
        s_x.value = xp
        s_w.value = wp
        s_b0.value = 0 if bias_0 is None else ptr(bias_0)
        s_b1.value = 0 if bias_1 is None else ptr(bias_1)
        s_rank.value = ptr(handle[0])
        s_head.value = ptr(handle[5])
        s_out.value = ptr(combined)
        s_out_w.value = 0 if combined_w is None else ptr(combined_w)
        s_woff.value = weights_offset
        s_seq.value = seq
        self.plan.launch(comm)
        hb, wb = self.hidden_bytes, self.num_topk * 4
        staging, flags, write, copy = self.staging_ptrs, self.flag_ptrs, self._write, rt.memcpyAsync
        record, wait, flag_handle = rt.eventRecord, rt.streamWaitEvent, self._flag_handle
        # The flags go on a second stream, each after an event that follows its chunk: a flag write on the
        # copy stream itself would hold the next copy until the write is done (~3 us per chunk).
        for i, (home, kind, dst, src, n, done) in enumerate(schedule):
            if kind == "w":
                if wp:
                    copy(staging[home] + dst, wp + src * wb, n * wb, _MEMCPY_DEFAULT, side)
                continue
            gate = waits.get(i)
            if gate is not None:  # the home's previous occupant has landed its rows (GEQ: flags only grow)
                err, = self._wait_value(self._side_handle, gate[0], (seq << ROW_BITS) | gate[1], 0)
                if int(err):
                    raise RuntimeError(f"combine (copy mode): cuStreamWaitValue64 failed with {err!r}")
            copy(staging[home] + dst, xp + src * hb, n * hb, _MEMCPY_DEFAULT, side)
            record(events[3 + i], side)
            wait(flag_side, events[3 + i], 0)
            err, = write(flag_handle, flags[home], (seq << ROW_BITS) | done, 0)
            if int(err):
                raise RuntimeError(f"combine (copy mode): cuStreamWriteValue64 failed with {err!r}")
        record(events[1], side)
        wait(comm, events[1], 0)
        record(events[2], flag_side)
        wait(comm, events[2], 0)

    def __del__(self) -> None:
        destroy_events(self)
