"""NVSHMEM for the low-latency kernels: process-wide initialisation through nvshmem4py and symmetric
allocations.

NVSHMEM is initialised once per process, by unique id: rank 0 of the group creates the id, the group
broadcasts its 128 bytes, and every rank calls ``nvshmem.core.init(..., initializer_method="uid")``.
The group must span the same processes as every later group that uses NVSHMEM in this process
(NVSHMEM has one world). Environment variables that configure NVSHMEM are set before the first
initialisation (see :func:`nvshmem_environment`); values the user already exported are kept, except
``NVSHMEM_DISABLE_NVLS=1``, which is always set (NVLink multicast is never used).

Each :class:`SymmetricAllocation` is one ``nvshmem_malloc`` (collective); freeing it is collective too.
NVSHMEM stays initialised after the last allocation is freed, so the next Buffer in the same process
starts without another bootstrap; :func:`finalize` shuts it down explicitly (collective), and a new
allocation that needs a larger symmetric heap than the one NVSHMEM was started with re-initialises it
when nothing is allocated.

Lost ranks. A collective NVSHMEM call (free, finalize) waits for every PE, forever. So the process
remembers when a rank of NVSHMEM's world was lost (:func:`mark_peers_lost`: a ``Buffer.destroy()`` whose
barrier timed out) and then makes no collective NVSHMEM call any more: frees are skipped, the memory stays
allocated until the process ends, and a new allocation is refused. At interpreter exit NVSHMEM is
finalized only after a bounded barrier (``DEEPEP_CUPY_TIMEOUT_S``) on a communicator of the library's own,
made at initialisation, shows that every rank is there to finalize too; otherwise the finalize is skipped
with a one-line warning on stderr naming the missing ranks.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading

from ..errors import DeepEPError, DeepEPTimeoutError
from .group import CommGroup
from .kernel_errors import timeout_seconds

__all__ = [
    "SymmetricAllocation",
    "acquire",
    "finalize",
    "heap_bytes_for",
    "is_initialized",
    "mark_peers_lost",
    "nvshmem_environment",
    "peers_lost",
    "settle_setup",
]

_MISSING = ("deepep_cupy: the low-latency kernels need nvshmem4py: pip install nvshmem4py-cu13 (or -cu12 for "
            "CUDA 12)")
_MIB = 1 << 20
#: Headroom on top of the requested buffer for NVSHMEM's own symmetric objects (teams, barriers).
_HEAP_SLACK = 256 * _MIB
#: NVSHMEM maps the symmetric heap in chunks of this size (NVSHMEM_CUMEM_GRANULARITY).
_GRANULARITY = 512 * _MIB

_lock = threading.RLock()
_state = {"initialized": False, "rank": None, "size": None, "device": None, "heap": 0, "live": 0, "own_heap": False,
          # Ranks known to be gone (None: none; [] : some, which ones unknown). Set once, never cleared: a
          # collective with a rank that is gone never returns, for as long as this process lives.
          "lost": None,
          # The communicator of the exit barrier, made at the first initialisation (when every rank is there).
          "exit_group": None}


def _modules():
    try:
        import nvshmem.bindings as bindings
        import nvshmem.core as core
    except ImportError as exc:
        raise RuntimeError(_MISSING) from exc
    return core, bindings


def heap_bytes_for(num_bytes: int) -> int:
    """Symmetric heap size to request for one buffer of ``num_bytes``: the buffer plus slack, rounded up
    to NVSHMEM's mapping granularity."""
    need = int(num_bytes) + _HEAP_SLACK
    return (need + _GRANULARITY - 1) // _GRANULARITY * _GRANULARITY


def nvshmem_environment(environ, num_bytes: int, *, allow_nvlink: bool, num_qps_per_rank: int,
                        allow_mnnvl: bool) -> dict[str, str]:
    """The NVSHMEM variables to set before initialisation, given the current environment ``environ``.

    Only variables absent from ``environ`` are returned, except ``NVSHMEM_DISABLE_NVLS`` which is always
    ``1``. Pure function (the unit tests call it).
    """
    wanted = {
        # RC queue pairs per peer and their depth, used by the InfiniBand GPU-initiated transport.
        "NVSHMEM_IBGDA_NUM_RC_PER_PE": str(int(num_qps_per_rank)),
        "NVSHMEM_QP_DEPTH": "1024",
        "NVSHMEM_CUMEM_GRANULARITY": str(_GRANULARITY),
        "NVSHMEM_SYMMETRIC_SIZE": str(heap_bytes_for(num_bytes)),
    }
    if not allow_nvlink:
        wanted["NVSHMEM_DISABLE_P2P"] = "1"
    if not allow_mnnvl:
        wanted["NVSHMEM_DISABLE_MNNVL"] = "1"
    out = {k: v for k, v in wanted.items() if k not in environ}
    if environ.get("NVSHMEM_DISABLE_NVLS") != "1":
        out["NVSHMEM_DISABLE_NVLS"] = "1"
    return out


def _parse_size(text: str) -> int:
    """NVSHMEM size syntax: an integer with an optional k/m/g/t suffix (powers of 1024)."""
    s = text.strip().lower()
    scale = 1
    if s and s[-1] in "kmgt":
        scale = 1024 ** ("kmgt".index(s[-1]) + 1)
        s = s[:-1]
    if s.endswith("b"):
        s = s[:-1]
    return int(float(s) * scale)


def is_initialized() -> bool:
    return bool(_state["initialized"])


def _init(group, device_id: int) -> None:
    import numpy as np
    from cuda.core import Device

    core, bindings = _modules()
    device = Device(device_id)
    device.set_current()
    if group.rank == 0:
        uid = core.get_unique_id()
        payload = bytes(uid._data.view(np.uint8))
    else:
        uid = core.get_unique_id(empty=True)
        payload = None
    payload = group.bcast_object(payload, root=0)
    if _state["exit_group"] is None:
        # Made now, while every rank is making the same call: at exit it must not depend on a group the
        # user may have closed by then (``Buffer.destroy`` closes the Buffer's).
        _state["exit_group"] = _own_group(group)
    if group.rank != 0:
        uid._data.view(np.uint8)[:] = np.frombuffer(payload, dtype=np.uint8)
    core.init(device=device, uid=uid, rank=group.rank, nranks=group.size, initializer_method="uid")
    if int(bindings.my_pe()) != group.rank or int(bindings.n_pes()) != group.size:
        raise RuntimeError(f"deepep_cupy: NVSHMEM reports PE {bindings.my_pe()} of {bindings.n_pes()}, "
                           f"expected rank {group.rank} of {group.size}")
    heap = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
    _state.update(initialized=True, rank=group.rank, size=group.size, device=device_id,
                  heap=_parse_size(heap) if heap else 1 << 30)
    if not _state.get("exit_hook"):
        # NVSHMEM left running at interpreter exit crashes in its own teardown (transport threads,
        # CUDA already gone); Python's exit hooks run before the C library's, so finalize here.
        atexit.register(_finalize_at_exit)
        _state["exit_hook"] = True


def _own_group(group):
    """A group over the same ranks that this module owns (collective); the group itself when it makes
    nothing of its own (``twin`` absent)."""
    twin = getattr(group, "twin", None)
    return twin() if twin is not None else group


@contextlib.contextmanager
def _locked(op: str):
    """This process's NVSHMEM calls run one at a time; waiting for another thread's is bounded by
    ``DEEPEP_CUPY_TIMEOUT_S`` (that thread may be stuck in a collective call whose peers never come)."""
    seconds = timeout_seconds()
    if not _lock.acquire(timeout=seconds):
        raise DeepEPTimeoutError(f"{op}: waited {seconds:g} s for another thread's NVSHMEM call in this process "
                                 "(initialisation, allocation, free or finalize), which did not return")
    try:
        yield
    finally:
        _lock.release()


def _who(ranks) -> str:
    if not ranks:
        return "some ranks (which ones is unknown)"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def mark_peers_lost(group, missing) -> None:
    """Remember that the ranks ``missing`` of ``group`` (None: unknown ones) stopped answering, when
    ``group`` is NVSHMEM's world (same rank and size). From then on this process makes no collective
    NVSHMEM call: frees are skipped, new allocations are refused, and NVSHMEM is not finalized at exit."""
    if not _state["initialized"] or (_state["rank"], _state["size"]) != (group.rank, group.size):
        return  # another group's ranks: the exit barrier finds out by itself whether NVSHMEM's are all there
    lost = set(_state["lost"] or ()) | {int(r) for r in (missing or ())}
    _state["lost"] = sorted(lost)


def peers_lost():
    """The ranks this process knows to be gone (a list, empty when which ones is unknown), or None."""
    lost = _state["lost"]
    return None if lost is None else list(lost)


def _agree_to_finalize(op: str):
    """Every rank calls this before the collective finalize. Returns None when all of them arrived within
    ``DEEPEP_CUPY_TIMEOUT_S`` (finalizing is safe), else the ranks that did not (remembered as lost).

    With no usable group (torch.distributed already shut down by the user, MPI finalized) nothing can be
    checked: None, and the finalize goes ahead as it would without this check.
    """
    if _state["lost"] is not None:
        return list(_state["lost"])
    group = _state["exit_group"]
    usable = getattr(group, "usable", None)
    if group is None or (usable is not None and not usable()):
        return None

    try:
        if isinstance(group, CommGroup):
            group.barrier(op=op)
        else:
            group.barrier()
        return None
    except DeepEPTimeoutError as exc:
        lost = list(exc.missing or [])
    except Exception:  # noqa: BLE001 - a peer that is gone may show up as a broken connection
        lost = []
    _state["lost"] = lost
    return list(lost)


def _warn(message: str) -> None:
    try:
        print(f"deepep_cupy: {message}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - stderr may already be closed at exit
        pass


def _finalize_at_exit() -> None:
    try:
        budget = timeout_seconds()
    except ValueError:  # a malformed DEEPEP_CUPY_TIMEOUT_S: the barrier below reports it as a failure
        budget = 100.0
    # A thread that still holds the lock (stuck in an allocation) must not keep the process from ending.
    if not _lock.acquire(timeout=budget):
        _warn("NVSHMEM not finalized at exit: another thread is still inside an NVSHMEM call")
        return
    try:
        if not _state["initialized"]:
            return
        lost = _agree_to_finalize("NVSHMEM finalize at exit")
        if lost is not None:
            _warn(f"NVSHMEM not finalized at exit: {_who(lost)} of {_state['size']} did not arrive (gone or "
                  f"masked); its finalize waits for every rank. The operating system frees the memory.")
            return
        try:
            _finalize_locked()
        except Exception:  # noqa: BLE001 - nothing useful can be raised at exit
            pass
    finally:
        _lock.release()


def _finalize_locked() -> None:
    if not _state["initialized"]:
        return
    core, _ = _modules()
    core.finalize()
    _state.update(initialized=False, rank=None, size=None, device=None, heap=0)


def finalize() -> None:
    """Shut NVSHMEM down (collective over the processes that initialised it). Frees nothing that is
    still allocated: call it after every Buffer using NVSHMEM was destroyed. Bounded: raises
    ``RuntimeError`` naming the ranks that are gone (or did not arrive within ``DEEPEP_CUPY_TIMEOUT_S``)
    instead of waiting for them."""
    with _locked("nvshmem.finalize"):
        if _state["live"]:
            raise RuntimeError(f"deepep_cupy: {_state['live']} NVSHMEM allocation(s) still alive; destroy the "
                               "Buffers first")
        if not _state["initialized"]:
            return
        lost = _agree_to_finalize("nvshmem.finalize")
        if lost is not None:
            raise RuntimeError(f"deepep_cupy: NVSHMEM cannot be finalized: {_who(lost)} of {_state['size']} "
                               "did not arrive, and its finalize waits for every rank")
        _finalize_locked()


class SymmetricAllocation:
    """``nbytes`` of symmetric memory (same offsets on every PE).

    Attributes:
        ptr: this PE's device address.
        nbytes: size in bytes.
        array: a CuPy ``uint8`` view of the whole allocation.
    """

    def __init__(self, ptr: int, nbytes: int) -> None:
        import cupy

        self.ptr = int(ptr)
        self.nbytes = int(nbytes)
        mem = cupy.cuda.UnownedMemory(self.ptr, self.nbytes, self)
        self.array = cupy.ndarray((self.nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        self._freed = False

    def peer_ptr(self, pe: int, offset: int = 0) -> int:
        """Address through which this GPU loads and stores ``pe``'s copy (0 when ``pe`` is not reachable
        by loads and stores, e.g. over the network or with NVSHMEM_DISABLE_P2P)."""
        _, bindings = _modules()
        return int(bindings.ptr(self.ptr + int(offset), int(pe)))

    def free(self) -> None:
        """Collective: every PE frees its allocations in the same order."""
        with _locked("nvshmem_free"):
            if self._freed:
                return
            if _state["lost"] is None and _state["initialized"]:
                _, bindings = _modules()
                bindings.free(self.ptr)
            # else: a rank is gone (the collective free would never return) or NVSHMEM was already shut
            # down at exit (its heap went with it): the memory stays with the process.
            self._freed = True
            self.array = None
            _state["live"] -= 1


def settle_setup(group, error: BaseException | None, op: str, allocations) -> None:
    """Agree across the ranks on a set-up step that holds the symmetric ``allocations`` (this rank's
    ``error``, or None when its part worked) before anything collective is freed or waited for.

    One bounded exchange (``DEEPEP_CUPY_TIMEOUT_S``): when every rank's part worked it returns (and served as
    a barrier). When some rank failed, every rank frees ``allocations`` (all of them are here, so the
    collective frees return) and raises: a failed rank its own error, the others ``DeepEPError`` naming the
    failed ranks and their errors. When a rank does not answer, nothing is freed (a collective free would
    wait for it for ever): NVSHMEM remembers it as lost (:func:`mark_peers_lost`), the allocations stay with
    the process, and the exchange's error is raised.
    """
    mine = None if error is None else f"{type(error).__name__}: {error}"
    try:
        words = group.allgather_object(mine, op=op) if isinstance(group, CommGroup) else group.allgather_object(mine)
    except BaseException as exc:
        mark_peers_lost(group, getattr(exc, "missing", None))
        raise exc from error
    failed = [(r, w) for r, w in enumerate(words) if w is not None]
    if not failed:
        return
    for alloc in allocations:
        alloc.free()
    if error is not None:
        raise error
    raise DeepEPError(f"{op}: " + "; ".join(f"rank {r} failed ({w})" for r, w in failed)
                      + "; the symmetric memory was freed on every rank")


def acquire(group, device_id: int, num_bytes: int, *, allow_nvlink: bool = True, num_qps_per_rank: int = 24,
            allow_mnnvl: bool = False) -> SymmetricAllocation:
    """Initialise NVSHMEM if needed and allocate ``num_bytes`` of symmetric memory. Collective."""
    num_bytes = int(num_bytes)
    if num_bytes <= 0:
        raise ValueError(f"symmetric allocation needs a positive size, got {num_bytes}")
    _modules()
    with _locked("nvshmem_malloc"):
        if _state["lost"] is not None:
            raise RuntimeError(
                f"deepep_cupy: NVSHMEM lost {_who(_state['lost'])} of {_state['size']} in this process (a "
                "destroy() timed out); it cannot allocate or re-initialise without them. Low-latency and "
                "internode Buffers need new processes; intranode Buffers over the survivors still work")
        if _state["initialized"]:
            if (_state["rank"], _state["size"]) != (group.rank, group.size):
                raise RuntimeError(
                    f"deepep_cupy: NVSHMEM is initialised for rank {_state['rank']} of {_state['size']}, but this "
                    f"group is rank {group.rank} of {group.size}; NVSHMEM has one world per process")
            if _state["device"] != device_id:
                raise RuntimeError(f"deepep_cupy: NVSHMEM is bound to device {_state['device']}, not {device_id}")
            if _state["own_heap"] and _state["live"] == 0 and num_bytes + _HEAP_SLACK > _state["heap"]:
                # Nothing allocated and the heap we sized is too small: start over with a larger one.
                _finalize_locked()
                os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(heap_bytes_for(num_bytes))
        if not _state["initialized"]:
            changes = nvshmem_environment(os.environ, num_bytes, allow_nvlink=allow_nvlink,
                                          num_qps_per_rank=num_qps_per_rank, allow_mnnvl=allow_mnnvl)
            if "NVSHMEM_SYMMETRIC_SIZE" in changes:
                _state["own_heap"] = True
            os.environ.update(changes)
            _init(group, device_id)
        _, bindings = _modules()
        from cuda.core import Device

        Device(device_id).set_current()
        ptr = int(bindings.malloc(num_bytes))
        if ptr == 0:
            raise MemoryError(
                f"deepep_cupy: nvshmem_malloc({num_bytes}) failed: the symmetric heap "
                f"(NVSHMEM_SYMMETRIC_SIZE={os.environ.get('NVSHMEM_SYMMETRIC_SIZE', 'default')}) is too small; "
                f"set NVSHMEM_SYMMETRIC_SIZE to at least {heap_bytes_for(num_bytes)} before the first Buffer")
        _state["live"] += 1
        return SymmetricAllocation(ptr, num_bytes)
