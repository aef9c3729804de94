"""One small interface over the process groups a caller may hand us (mpi4py or torch.distributed).

Everything the library needs from the group is here: rank, size, all-gather and all-to-all of
picklable objects, broadcast and barrier. Host-side waits use the group's own collectives; a peer that
never arrives is caught by the launcher (``mpirun``/``torchrun``) or by the kernels' own timeouts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

__all__ = ["CommGroup", "MPIGroup", "TorchGroup", "make_group", "init_torch_distributed", "Agreement"]


class CommGroup(ABC):
    """Collectives over picklable Python objects, indexed by rank."""

    rank: int
    size: int

    @abstractmethod
    def allgather_object(self, obj) -> list: ...

    @abstractmethod
    def barrier(self) -> None: ...

    def alltoall_object(self, objs: list) -> list:
        """Element ``i`` of ``objs`` goes to rank ``i``; element ``i`` of the result came from rank ``i``."""
        if len(objs) != self.size:
            raise ValueError(f"alltoall_object needs {self.size} objects, got {len(objs)}")
        gathered = self.allgather_object(objs)
        return [gathered[src][self.rank] for src in range(self.size)]

    def bcast_object(self, obj, root: int = 0):
        return self.allgather_object(obj if self.rank == root else None)[root]

    def start_allgather_ints(self, values: list[int]):
        """Start gathering every rank's ``values`` (a short list of ints); returns a request whose
        ``test()`` gives the rows once every rank has joined, else None. Groups without a non-blocking
        collective complete it at once (blocking like ``allgather_object``)."""
        return _Done([list(v) for v in self.allgather_object(list(values))])


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
    """An ``mpi4py.MPI.Comm``."""

    def __init__(self, comm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        # Collective, like the Buffer construction this happens in.
        self._checks = comm.Dup() if hasattr(comm, "Dup") else None

    def allgather_object(self, obj) -> list:
        return self.comm.allgather(obj)

    def alltoall_object(self, objs: list) -> list:
        if len(objs) != self.size:
            raise ValueError(f"alltoall_object needs {self.size} objects, got {len(objs)}")
        return self.comm.alltoall(objs)

    def bcast_object(self, obj, root: int = 0):
        return self.comm.bcast(obj, root=root)

    def barrier(self) -> None:
        self.comm.Barrier()

    def start_allgather_ints(self, values: list[int]):
        # On a communicator of our own, so that a gather still in flight (a rank that has not made the same
        # call yet, or never will) can never be matched with the caller's collectives on ``comm``.
        import numpy as np

        if self._checks is None:
            raise RuntimeError("this MPI group was made without its checks communicator")
        send = np.asarray(values, dtype=np.int64)
        recv = np.empty((self.size, send.size), dtype=np.int64)
        return _MPIGather(self._checks.Iallgather(send, recv), recv)


class TorchGroup(CommGroup):
    """A ``torch.distributed.ProcessGroup`` (any backend that supports object collectives, gloo included)."""

    def __init__(self, group) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    def allgather_object(self, obj) -> list:
        out = [None] * self.size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)


def _is_group_like(obj) -> bool:
    """Objects that already speak this interface (in-process test groups, for instance) are used as they are."""
    return all(hasattr(obj, a) for a in ("rank", "size", "allgather_object", "alltoall_object", "barrier")) \
        and isinstance(obj.rank, int)


def make_group(group=None, comm=None) -> CommGroup:
    """Wrap whichever of ``group`` (torch) or ``comm`` (mpi4py) was given; an existing CommGroup passes through."""
    for candidate in (group, comm):
        if isinstance(candidate, CommGroup) or _is_group_like(candidate):
            return candidate
    if group is not None:
        if not (hasattr(group, "rank") and hasattr(group, "size")):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
        return TorchGroup(group)
    if comm is not None:
        if not hasattr(comm, "Get_rank"):
            raise TypeError(f"comm must be an mpi4py.MPI.Comm, got {type(comm).__name__}")
        return MPIGroup(comm)
    raise ValueError("Buffer needs a process group: pass group=<torch ProcessGroup> or comm=<mpi4py Comm>")


def init_torch_distributed(comm, backend: str = "gloo", **kwargs) -> None:
    """Start ``torch.distributed`` on the ranks of an mpi4py communicator within one host.

    Rank 0 picks a free loopback port and the others learn it through MPI; does nothing when torch.distributed
    is already initialised. Used by tests and benchmarks that compare against torch collectives.
    """
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size(), **kwargs)


class Agreement:
    """Checks, without waiting, that every rank passed equal ``fields`` (name -> int or bool) to ``op``.

    Started when a rank makes a plan for a new set of values; :meth:`poll` looks at the gather and, once
    every rank has joined, raises the same ``ValueError`` on every rank if they disagree. Nothing waits
    for a rank that never joins (a dead or masked rank must not stop the others; the kernels' own
    timeouts handle it).
    """

    def __init__(self, group: CommGroup, op: str, fields: dict) -> None:
        self.op = op
        self.names = list(fields)
        self.request = group.start_allgather_ints([int(fields[n]) for n in self.names])

    def poll(self) -> bool:
        """True once complete (raising on disagreement); False while some rank has not joined."""
        rows = self.request.test()
        if rows is None:
            return False
        for i, name in enumerate(self.names):
            seen = [row[i] for row in rows]
            if any(v != seen[0] for v in seen):
                per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(seen))
                raise ValueError(f"{self.op}: the ranks disagree on {name} ({per_rank}); every rank must pass "
                                 "the same value")
        return True

    def wait(self, seconds: float) -> bool:
        """Poll for up to ``seconds`` (ranks making the same call normally join within microseconds)."""
        import time

        deadline = time.monotonic() + seconds
        while not self.poll():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0001)
        return True
