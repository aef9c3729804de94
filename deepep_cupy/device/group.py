"""One small interface over the process groups a caller may hand us (mpi4py or torch.distributed).

Everything the library needs from the group is here: rank, size, all-gather and all-to-all of picklable
objects, broadcast and barrier. None of them waits forever: each has a deadline of ``DEEPEP_CUPY_TIMEOUT_S``
seconds (:func:`deepep_cupy.device.kernel_errors.timeout_seconds`, default 100) and then raises
``DeepEPTimeoutError`` naming the op, this rank and the ranks that did not arrive.

How: on an mpi4py communicator the library sends point-to-point messages on a communicator of its own
(duplicated without blocking when the group is made), tagged with the number of the collective, so the k-th
collective of one rank only ever meets the k-th collective of the others; every message carries the name of
its op, so ranks that reach different ops at the same point get a ValueError instead of each other's data.
A torch.distributed gloo group does the same over ``isend``/``irecv``; other torch backends (NCCL) use
non-blocking ``all_gather`` calls polled against the deadline (which ranks are missing is then unknown).
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from abc import ABC, abstractmethod

from ..errors import DeepEPTimeoutError
from .kernel_errors import timeout_seconds

__all__ = ["CommGroup", "MPIGroup", "TorchGroup", "make_group", "group_size", "disagreement", "timeout_error",
           "comm_barrier"]


def group_size(group) -> int:
    """Ranks of a torch group, an mpi4py communicator or a group-like object (no collective)."""
    if hasattr(group, "Get_size"):  # mpi4py
        return int(group.Get_size())
    size = getattr(group, "size", None)
    if size is None:
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or an mpi4py communicator, "
                        f"got {type(group).__name__}")
    return int(size() if callable(size) else size)


_TAGS = 1 << 15  # MPI guarantees at least 32767 tags; one tag per collective in flight is plenty


def timeout_error(op: str, rank: int, missing, seconds: float) -> DeepEPTimeoutError:
    """The error of a wait that ran past ``seconds``; ``missing`` lists the ranks that did not arrive (None
    when the group cannot tell). The exception carries ``op``, ``rank`` and ``missing`` as attributes."""
    if missing:
        who = ("rank " if len(missing) == 1 else "ranks ") + ", ".join(str(r) for r in missing)
    else:
        who = "other ranks (which ones this group cannot tell)"
    exc = DeepEPTimeoutError(
        f"{op}: rank {rank} waited {seconds:g} s for {who}, which did not arrive (every rank must make the "
        f"same calls in the same order; DEEPEP_CUPY_TIMEOUT_S sets the wait)")
    exc.op, exc.rank, exc.missing = op, rank, list(missing) if missing else None
    return exc


def disagreement(op: str, name: str, values) -> ValueError:
    """The error raised on every rank when the ranks passed different ``values`` (one per rank) for ``name``."""
    per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
    return ValueError(f"{op}: the ranks disagree on {name} ({per_rank}); every rank must pass the same value")


def _out_of_step(op: str, rank: int, peer: int, peer_op: str) -> ValueError:
    return ValueError(f"{op}: rank {rank} met rank {peer} in {peer_op}: the ranks called the library's "
                      "collective operations in different orders (every rank must make the same calls in the "
                      "same order)")


def _caller() -> str:
    """Name of the first function outside this file on the stack (the op of an unnamed collective)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return "collective"
    return f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)})"


class _Clock:
    """The deadline of one wait, and the pause between polls: none at first, then a yield of the CPU (other
    ranks may share it), then sleeps that grow to a millisecond once the wait is long."""

    __slots__ = ("seconds", "begin", "deadline", "polls")

    def __init__(self) -> None:
        self.seconds = timeout_seconds()
        self.begin = time.monotonic()
        self.deadline = self.begin + self.seconds
        self.polls = 0

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def remaining(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)

    def pause(self) -> None:
        self.polls += 1
        if self.polls < 16:
            return
        waited = time.monotonic() - self.begin
        if waited < 0.01:
            os.sched_yield()
        else:
            time.sleep(min(1e-3, waited / 100))


class CommGroup(ABC):
    """Collectives over picklable Python objects, indexed by rank, each bounded by the timeout.

    ``op`` names the operation in errors (default: the calling function). Groups that exchange messages
    point to point implement :meth:`_exchange`; the collectives here are built on it.
    """

    rank: int
    size: int

    @abstractmethod
    def _exchange(self, sends: dict, expect, op: str) -> dict:
        """Send ``sends[peer]`` (bytes) to each peer and receive one message from each rank in ``expect``;
        returns ``{peer: bytes}``. Raises ``DeepEPTimeoutError`` naming the peers that did not arrive."""

    def _unpack(self, got: dict, op: str) -> dict:
        out = {}
        for peer, data in got.items():
            peer_op, obj = pickle.loads(data)
            if peer_op != op:
                raise _out_of_step(op, self.rank, peer, peer_op)
            out[peer] = obj
        return out

    def allgather_object(self, obj, op: str | None = None) -> list:
        op = op or _caller()
        peers = [p for p in range(self.size) if p != self.rank]
        data = pickle.dumps((op, obj), protocol=pickle.HIGHEST_PROTOCOL)
        got = self._unpack(self._exchange({p: data for p in peers}, peers, op), op)
        got[self.rank] = obj
        return [got[r] for r in range(self.size)]

    def alltoall_object(self, objs: list, op: str | None = None) -> list:
        """Element ``i`` of ``objs`` goes to rank ``i``; element ``i`` of the result came from rank ``i``."""
        if len(objs) != self.size:
            raise ValueError(f"alltoall_object needs {self.size} objects, got {len(objs)}")
        op = op or _caller()
        peers = [p for p in range(self.size) if p != self.rank]
        sends = {p: pickle.dumps((op, objs[p]), protocol=pickle.HIGHEST_PROTOCOL) for p in peers}
        got = self._unpack(self._exchange(sends, peers, op), op)
        got[self.rank] = objs[self.rank]
        return [got[r] for r in range(self.size)]

    def bcast_object(self, obj, root: int = 0, op: str | None = None):
        op = op or _caller()
        if self.rank == root:
            data = pickle.dumps((op, obj), protocol=pickle.HIGHEST_PROTOCOL)
            self._exchange({p: data for p in range(self.size) if p != root}, [], op)
            return obj
        return self._unpack(self._exchange({}, [root], op), op)[root]

    def barrier(self, op: str | None = None) -> None:
        """Wait until every rank has arrived."""
        op = op or _caller()
        peers = [p for p in range(self.size) if p != self.rank]
        data = pickle.dumps((op, None))
        self._unpack(self._exchange({p: data for p in peers}, peers, op), op)

    def start_allgather_ints(self, values: list[int]):
        """Start gathering every rank's ``values`` (a short list of ints); returns a request whose
        ``test()`` gives the rows once every rank has joined, else None. Groups without a non-blocking
        collective complete it at once (bounded like ``allgather_object``)."""
        return _Done([list(v) for v in self.allgather_object(list(values), op="agreement check")])

    def close(self) -> None:  # noqa: B027 - most groups make nothing of their own
        """Release what the group made for itself (no collective)."""

    def twin(self) -> CommGroup:
        """A group over the same ranks whose messages never meet this one's (collective: every rank makes
        it at the same point). Used for the exit barrier, which must outlive the Buffer's group."""
        return self

    def usable(self) -> bool:
        """Whether collectives can still run (False once the underlying MPI or torch world is shut down)."""
        return True


class _Done:
    __slots__ = ("rows",)

    def __init__(self, rows) -> None:
        self.rows = rows

    def test(self):
        return self.rows


class _MPIGather:
    """An ``Iallgather`` in flight: ``test()`` returns the rows once complete, else None."""

    __slots__ = ("request", "recv", "rows")

    def __init__(self, request, recv) -> None:
        self.request, self.recv, self.rows = request, recv, None

    def test(self):
        if self.rows is None and self.request.Test():
            self.rows = self.recv.tolist()
        return self.rows


class MPIGroup(CommGroup):
    """An ``mpi4py.MPI.Comm``. The library's messages travel on a duplicate of it, made at construction."""

    def __init__(self, comm) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._seq = 0
        # Requests of exchanges that timed out, with their buffers: MPI may still read or write them.
        self._abandoned: list = []
        clock = _Clock()  # first: a bad DEEPEP_CUPY_TIMEOUT_S must not leave a duplicate behind
        own, request = comm.Idup()
        while not request.Test():
            if clock.expired():
                self._abandoned.append((own, request))
                raise timeout_error("Buffer (duplicating the communicator)", self.rank, None, clock.seconds)
            clock.pause()
        self._own = own

    def _exchange(self, sends: dict, expect, op: str) -> dict:
        MPI, comm = self._mpi, self._own
        if comm is None:
            raise RuntimeError(f"{op}: this group was closed")
        tag = self._seq % _TAGS
        self._seq += 1
        requests = [comm.Isend([data, MPI.BYTE], dest=p, tag=tag) for p, data in sends.items()]
        waiting = list(expect)
        got = {}
        status = MPI.Status()
        clock = _Clock()
        while True:
            for p in list(waiting):
                message = comm.Improbe(source=p, tag=tag, status=status)
                if message is not None:
                    buf = bytearray(status.Get_count(MPI.BYTE))
                    message.Recv([buf, MPI.BYTE])
                    got[p] = buf
                    waiting.remove(p)
            if not waiting and (not requests or MPI.Request.Testall(requests)):
                return got
            if clock.expired():
                unsent = [p for p, r in zip(sends, requests, strict=True) if not r.Test()]
                self._abandoned.append((requests, sends))
                raise timeout_error(op, self.rank, sorted(set(waiting) | set(unsent)), clock.seconds)
            clock.pause()

    def start_allgather_ints(self, values: list[int]):
        # A collective on the library's own communicator, so that a gather still in flight (a rank that has
        # not made the same call yet, or never will) can never be matched with the caller's collectives;
        # point-to-point messages never match collectives.
        import numpy as np

        send = np.asarray(values, dtype=np.int64)
        recv = np.empty((self.size, send.size), dtype=np.int64)
        return _MPIGather(self._own.Iallgather(send, recv), recv)

    def twin(self) -> MPIGroup:
        return MPIGroup(self.comm)

    def usable(self) -> bool:
        return self._own is not None and not self._mpi.Is_finalized()

    def close(self) -> None:
        """Free the library's communicator, unless an exchange on it timed out (a late peer's messages must
        not meet a later communicator that reuses its context)."""
        own, self._own = self._own, None
        if own is not None and not self._abandoned and not self._mpi.Is_finalized():
            own.Free()


_TORCH_GROUPS: dict = {}  # process group -> [number of TorchGroup objects made over it]


class TorchGroup(CommGroup):
    """A ``torch.distributed.ProcessGroup`` (any backend that supports object collectives, gloo included)."""

    def __init__(self, group) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self._seq = 0
        self._abandoned: list = []
        self._p2p = "gloo" in str(dist.get_backend(group)).lower()
        self._global = [dist.get_global_rank(group, r) for r in range(self.size)] if self._p2p else None
        # Tags of this object's messages: its own range per process group (groups are made in the same order
        # on every rank, like the Buffers that make them), so a message one of them left behind after a
        # timeout never meets another's receive.
        self._tag_base = (_TORCH_GROUPS.setdefault(group, [0])[0] % 1024) << 20
        _TORCH_GROUPS[group][0] += 1

    def twin(self) -> TorchGroup:
        return TorchGroup(self.group)  # its own tag range: made on every rank in the same order

    def usable(self) -> bool:
        return bool(self._dist.is_initialized())

    def _wait(self, works: dict, clock: _Clock, op: str) -> None:
        """Wait for ``{peer: work}`` until the deadline; raise naming the peers whose work did not finish."""
        from datetime import timedelta

        missing = []
        for peer, work in works.items():
            if work is None:  # could not even be posted (see post in _exchange)
                missing.append(peer)
                continue
            budget = clock.remaining() if not missing else 0.0
            try:
                work.wait(timeout=timedelta(seconds=max(budget, 0.001)))
            except RuntimeError:
                missing.append(peer)
        if missing:
            self._abandoned.append(works)
            raise timeout_error(op, self.rank, sorted(missing), clock.seconds)

    def _exchange(self, sends: dict, expect, op: str) -> dict:
        torch, dist = self._torch, self._dist
        base = self._tag_base | (2 * self._seq) % (1 << 20)
        self._seq += 1
        clock = _Clock()
        keep = []

        def post(fn, tensor, peer, tag):
            keep.append(tensor)
            try:
                return fn(tensor, self._global[peer], group=self.group, tag=tag)
            except RuntimeError:  # gloo refuses at once when the peer's process is gone: a missing rank
                return None

        # First the sizes (their arrival tells who is there), then the bytes.
        sizes = {p: torch.tensor([len(data)], dtype=torch.int64) for p, data in sends.items()}
        sent = {p: post(dist.isend, sizes[p], p, base) for p in sends}
        lengths = {p: torch.zeros(1, dtype=torch.int64) for p in expect}
        recvs = {p: post(dist.irecv, lengths[p], p, base) for p in expect}
        self._wait(recvs, clock, op)
        self._wait(sent, clock, op)
        payloads = {p: torch.frombuffer(bytearray(data), dtype=torch.uint8) for p, data in sends.items()}
        sent = {p: post(dist.isend, payloads[p], p, base + 1) for p in sends if len(sends[p])}
        bufs = {p: torch.empty(int(lengths[p][0]), dtype=torch.uint8) for p in expect}
        recvs = {p: post(dist.irecv, bufs[p], p, base + 1) for p in expect if bufs[p].numel()}
        self._wait(recvs, clock, op)
        self._wait(sent, clock, op)
        return {p: bufs[p].numpy().tobytes() for p in expect}

    def allgather_object(self, obj, op: str | None = None) -> list:
        if self._p2p:
            return super().allgather_object(obj, op=op or _caller())
        return self._gather(obj, op or _caller())

    def alltoall_object(self, objs: list, op: str | None = None) -> list:
        if self._p2p:
            return super().alltoall_object(objs, op=op or _caller())
        if len(objs) != self.size:
            raise ValueError(f"alltoall_object needs {self.size} objects, got {len(objs)}")
        gathered = self._gather(objs, op or _caller())
        return [gathered[src][self.rank] for src in range(self.size)]

    def bcast_object(self, obj, root: int = 0, op: str | None = None):
        if self._p2p:
            return super().bcast_object(obj, root, op=op or _caller())
        return self._gather(obj if self.rank == root else None, op or _caller())[root]

    def barrier(self, op: str | None = None) -> None:
        if self._p2p:
            return super().barrier(op=op or _caller())
        self._gather(None, op or _caller())

    def _gather(self, obj, op: str) -> list:
        """All-gather through non-blocking collectives polled against the deadline (NCCL and other backends
        without the point-to-point path): sizes first, then the padded bytes, on the current CUDA device."""
        torch, dist = self._torch, self._dist
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        data = pickle.dumps((op, obj), protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        sizes = [torch.zeros_like(size) for _ in range(self.size)]
        self._poll(dist.all_gather(sizes, size, group=self.group, async_op=True), op, (sizes, size))
        lengths = [int(s.item()) for s in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(padded.device)
        outs = [torch.empty_like(padded) for _ in range(self.size)]
        self._poll(dist.all_gather(outs, padded, group=self.group, async_op=True), op, (outs, padded))
        got = {r: outs[r][:lengths[r]].cpu().numpy().tobytes() for r in range(self.size)}
        return [v for _, v in sorted(self._unpack(got, op).items())]

    def _poll(self, work, op: str, keep) -> None:
        clock = _Clock()
        while not work.is_completed():
            if clock.expired():
                self._abandoned.append((work, keep))
                raise timeout_error(op, self.rank, None, clock.seconds)
            clock.pause()
        work.wait()


def _is_group_like(obj) -> bool:
    """Objects that already speak this interface (in-process test groups, for instance) are used as they are."""
    return all(hasattr(obj, a) for a in ("rank", "size", "allgather_object", "alltoall_object", "barrier")) \
        and isinstance(obj.rank, int)


def _is_mpi_comm(obj) -> bool:
    return hasattr(obj, "Get_rank") and hasattr(obj, "Idup")


def make_group(group=None, comm=None) -> CommGroup:
    """Wrap whichever of ``group`` (torch) or ``comm`` (mpi4py) was given; an existing CommGroup passes through."""
    for candidate in (group, comm):
        if isinstance(candidate, CommGroup) or _is_group_like(candidate):
            return candidate
    if group is not None:
        if _is_mpi_comm(group):  # Buffer(MPI.COMM_WORLD, ...): DeepEP's first positional argument is a torch group
            raise TypeError(f"group must be a torch.distributed.ProcessGroup, got an mpi4py communicator "
                            f"({type(group).__name__}); pass it as comm=, e.g. Buffer(comm=MPI.COMM_WORLD, ...)")
        if not (callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None))):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
        return TorchGroup(group)
    if comm is not None:
        if not _is_mpi_comm(comm):
            raise TypeError(f"comm must be an mpi4py.MPI.Comm, got {type(comm).__name__}")
        return MPIGroup(comm)
    raise ValueError("Buffer needs a process group: pass group=<torch ProcessGroup> or comm=<mpi4py Comm>")


_COMM_GROUPS: dict = {}  # id(mpi4py communicator) -> MPIGroup over it, for comm_barrier


def comm_barrier(comm, op: str) -> None:
    """A barrier over an mpi4py communicator that ends in ``DeepEPTimeoutError`` (naming ``op`` and the ranks
    that did not arrive) after ``DEEPEP_CUPY_TIMEOUT_S``, instead of ``comm.Barrier()``'s wait without end: for
    tools that hold a bare communicator (benchmarks, the tuner). The library's group over ``comm`` is made at
    the first call, which every rank makes at the same point, and kept for later ones."""
    group = _COMM_GROUPS.get(id(comm))
    if group is None or group.comm is not comm:
        group = _COMM_GROUPS[id(comm)] = MPIGroup(comm)
    group.barrier(op=op)
