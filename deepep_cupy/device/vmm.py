"""Device memory that every rank of a group maps: one VMM allocation per rank, all of them mapped everywhere.

:class:`PeerMappedBuffer` allocates ``size`` bytes (rounded up to the allocation granularity) on this
rank's GPU with ``cuMemCreate``, shares it with the other ranks and maps every rank's allocation into
one virtual-address reservation of this process, so kernels can load and store any rank's buffer
through ``peer_ptrs[r]``.

Sharing, in order of preference:

* ``use_fabric=True``: ``CU_MEM_HANDLE_TYPE_FABRIC`` handles (multi-node NVLink; needs an IMEX channel).
  When fabric handles are refused (``CUDA_ERROR_NOT_PERMITTED`` / ``NOT_SUPPORTED``) this raises, unless
  ``fabric_fallback=True``, which warns and continues with file descriptors.
* POSIX file descriptors, passed with ``pidfd_getfd`` or a Unix socket (:mod:`.fd_share`).
* Legacy ``cudaIpcGetMemHandle`` on a ``cudaMalloc`` allocation, when VMM export is unavailable.

Every driver call goes through :func:`check`, which raises :class:`DeepEPError` naming the call and the
driver's error string. A failure part-way through set-up undoes what was done (on every rank, since the
outcome of each phase is agreed through the group). No multicast objects are ever created.
"""

from __future__ import annotations

import warnings

from ..errors import DeepEPError
from .fd_share import close_quietly, exchange_fds

__all__ = ["PeerMappedBuffer", "check", "VmmError"]


class VmmError(DeepEPError):
    """A driver call of the shared-buffer set-up failed."""

    def __init__(self, call: str, code, text: str) -> None:
        super().__init__(f"{call} failed: {text}")
        self.call = call
        self.code = code


def _driver():
    from cuda.bindings import driver

    return driver


def _error_text(code) -> str:
    driver = _driver()
    try:
        err, name = driver.cuGetErrorName(code)
        err2, desc = driver.cuGetErrorString(code)
        name = name.decode() if isinstance(name, bytes) else str(name)
        desc = desc.decode() if isinstance(desc, bytes) else str(desc)
        if err == driver.CUresult.CUDA_SUCCESS and err2 == driver.CUresult.CUDA_SUCCESS:
            return f"{name} ({desc})"
    except Exception:  # noqa: BLE001 - the code itself is still worth reporting
        pass
    return str(code)


def check(call: str, result):
    """Unpack a ``cuda.bindings.driver`` result tuple; raise :class:`VmmError` unless it is CUDA_SUCCESS."""
    driver = _driver()
    if isinstance(result, tuple):
        code, rest = result[0], result[1:]
    else:
        code, rest = result, ()
    if code != driver.CUresult.CUDA_SUCCESS:
        raise VmmError(call, code, _error_text(code))
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def _runtime_check(call: str, fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # CuPy raises CUDARuntimeError with the name in the text
        raise DeepEPError(f"{call} failed: {exc}") from exc


def _agree(group, error: str, what: str) -> None:
    """Collective: raise on every rank when any rank reported an error for this phase."""
    errors = group.allgather_object(error)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        text = "; ".join(f"rank {r}: {e}" for r, e in bad)
        raise DeepEPError(f"{what} failed: {text}")


def _is_refusal(exc: BaseException) -> bool:
    if not isinstance(exc, VmmError):
        return False
    driver = _driver()
    return exc.code in (driver.CUresult.CUDA_ERROR_NOT_PERMITTED, driver.CUresult.CUDA_ERROR_NOT_SUPPORTED,
                        driver.CUresult.CUDA_ERROR_INVALID_VALUE)


class PeerMappedBuffer:
    """``size`` bytes of device memory per rank, mapped into every rank of ``group`` (collective).

    Attributes:
        size: bytes per rank actually allocated (``size`` rounded up to the granularity).
        local_ptr: this rank's allocation.
        peer_ptrs: every rank's allocation as mapped here, indexed by rank (``peer_ptrs[rank] == local_ptr``).
        mode: ``"fabric"``, ``"posix_fd"`` or ``"cuda_ipc"``.
    """

    def __init__(self, group, device_id: int, size: int, *, use_fabric: bool = False,
                 fabric_fallback: bool = False) -> None:
        if size <= 0:
            raise ValueError(f"PeerMappedBuffer size must be positive, got {size}")
        self.group = group
        self.rank = group.rank
        self.num_ranks = group.size
        self.device_id = int(device_id)
        self.requested_size = int(size)
        self.size = 0
        self.local_ptr = 0
        self.peer_ptrs: list[int] = []
        self.mode = ""
        # Resources, released in reverse order by close().
        self._own_handle = None
        self._own_fd: int | None = None
        self._imported_handles: list = []
        self._va = 0
        self._va_size = 0
        self._mapped: list[tuple[int, int]] = []
        self._ipc_ptr = 0
        self._ipc_opened: list[int] = []
        self._closed = False

        import cupy

        # Make the device current and its primary context exist before the raw driver calls.
        cupy.cuda.Device(self.device_id).use()
        cupy.cuda.Device(self.device_id).synchronize()

        want_fabric = bool(use_fabric)
        try:
            if want_fabric:
                try:
                    self._setup_vmm(fabric=True)
                    return
                except DeepEPError as exc:
                    self._release_all()
                    if not fabric_fallback:
                        raise DeepEPError(
                            f"use_fabric=True but fabric memory handles are not usable here ({exc}). Fabric handles "
                            "need multi-node NVLink with an IMEX channel granted to this process; create the Buffer "
                            "with use_fabric=False for a single host") from exc
                    warnings.warn(f"deepep_cupy: fabric handles unavailable ({exc}); sharing the NVLink buffer "
                                  "through file descriptors instead", RuntimeWarning, stacklevel=3)
            try:
                self._setup_vmm(fabric=False)
                return
            except (DeepEPError, OSError) as exc:  # OSError: descriptors could not be passed
                self._release_all()
                vmm_error = exc
            warnings.warn(f"deepep_cupy: VMM sharing failed ({vmm_error}); falling back to legacy CUDA IPC handles",
                          RuntimeWarning, stacklevel=3)
            self._setup_legacy_ipc()
        except BaseException:
            self._release_all()
            raise

    # ------------------------------------------------------------------ set-up paths
    def _prop(self, fabric: bool):
        driver = _driver()
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device_id
        kind = driver.CUmemAllocationHandleType
        prop.requestedHandleTypes = kind.CU_MEM_HANDLE_TYPE_FABRIC if fabric else kind.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return prop

    def _setup_vmm(self, fabric: bool) -> None:
        driver = _driver()
        kind = driver.CUmemAllocationHandleType
        handle_type = kind.CU_MEM_HANDLE_TYPE_FABRIC if fabric else kind.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        group, rank, nranks = self.group, self.rank, self.num_ranks

        # Phase 1 (local): create and export.
        error, exported, gran = "", None, 0
        try:
            prop = self._prop(fabric)
            flags = driver.CUmemAllocationGranularity_flags
            gran_min = int(check("cuMemGetAllocationGranularity",
                                 driver.cuMemGetAllocationGranularity(prop, flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
            gran_rec = int(check("cuMemGetAllocationGranularity",
                                 driver.cuMemGetAllocationGranularity(prop, flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
            gran = max(gran_min, gran_rec, 1)
            if gran % gran_min:
                gran = gran_min
            size = -(-self.requested_size // gran) * gran
            self._own_handle = check("cuMemCreate", driver.cuMemCreate(size, prop, 0))
            self.size = size
            raw = check("cuMemExportToShareableHandle",
                        driver.cuMemExportToShareableHandle(self._own_handle, handle_type, 0))
            if fabric:
                exported = bytes(raw.data)
            else:
                self._own_fd = int(raw)
                exported = self._own_fd
        except DeepEPError as exc:
            error = str(exc)
            if fabric and _is_refusal(exc):
                error = f"fabric handles refused: {exc}"
        sizes = group.allgather_object((error, self.size, gran))
        bad = [(r, e) for r, (e, _, _) in enumerate(sizes) if e]
        if bad:
            raise DeepEPError("creating the NVLink buffer failed: " + "; ".join(f"rank {r}: {e}" for r, e in bad))
        if len({s for _, s, _ in sizes}) != 1:
            raise DeepEPError(f"ranks rounded the NVLink buffer to different sizes: {[s for _, s, _ in sizes]}")

        # Phase 2: move the handles.
        if fabric:
            payloads = group.allgather_object(exported)
            peer_fds = None
        else:
            payloads = None
            peer_fds = exchange_fds(group, self._own_fd)  # collective; raises on every rank alike

        # Phase 3 (local): import, reserve one range, map every rank, grant access.
        error = ""
        try:
            handles = []
            for peer in range(nranks):
                if peer == rank:
                    handles.append(self._own_handle)
                    continue
                if fabric:
                    fh = driver.CUmemFabricHandle()
                    fh.data = payloads[peer]
                    imported = check("cuMemImportFromShareableHandle", driver.cuMemImportFromShareableHandle(fh, handle_type))
                else:
                    fd = peer_fds[peer]
                    try:
                        imported = check("cuMemImportFromShareableHandle",
                                         driver.cuMemImportFromShareableHandle(fd, handle_type))
                    finally:
                        close_quietly(fd)  # the imported handle keeps the memory alive
                        peer_fds[peer] = None
                self._imported_handles.append(imported)
                handles.append(imported)
            total = self.size * nranks
            self._va = int(check("cuMemAddressReserve", driver.cuMemAddressReserve(total, gran, 0, 0)))
            self._va_size = total
            for peer, handle in enumerate(handles):
                ptr = self._va + peer * self.size
                check("cuMemMap", driver.cuMemMap(ptr, self.size, 0, handle, 0))
                self._mapped.append((ptr, self.size))
            desc = driver.CUmemAccessDesc()
            desc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = self.device_id
            desc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            check("cuMemSetAccess", driver.cuMemSetAccess(self._va, total, [desc], 1))
        except DeepEPError as exc:
            error = str(exc)
        finally:
            for fd in peer_fds or []:
                close_quietly(fd)
        _agree(group, error, "mapping the peers' NVLink buffers")
        self.peer_ptrs = [self._va + peer * self.size for peer in range(nranks)]
        self.local_ptr = self.peer_ptrs[rank]
        self.mode = "fabric" if fabric else "posix_fd"

    def _setup_legacy_ipc(self) -> None:
        import cupy

        runtime = cupy.cuda.runtime
        group, rank, nranks = self.group, self.rank, self.num_ranks
        error, handle = "", None
        try:
            self.size = -(-self.requested_size // (2 << 20)) * (2 << 20)
            self._ipc_ptr = int(_runtime_check("cudaMalloc", runtime.malloc, self.size))
            handle = bytes(_runtime_check("cudaIpcGetMemHandle", runtime.ipcGetMemHandle, self._ipc_ptr))
        except DeepEPError as exc:
            error = str(exc)
        handles = group.allgather_object((error, handle))
        bad = [(r, e) for r, (e, _) in enumerate(handles) if e]
        if bad:
            raise DeepEPError("legacy CUDA IPC set-up failed: " + "; ".join(f"rank {r}: {e}" for r, e in bad))
        error = ""
        ptrs = [0] * nranks
        try:
            flag = runtime.cudaIpcMemLazyEnablePeerAccess
            for peer in range(nranks):
                if peer == rank:
                    ptrs[peer] = self._ipc_ptr
                    continue
                ptr = int(_runtime_check("cudaIpcOpenMemHandle", runtime.ipcOpenMemHandle, handles[peer][1], flag))
                self._ipc_opened.append(ptr)
                ptrs[peer] = ptr
        except DeepEPError as exc:
            error = str(exc)
        _agree(group, error, "opening the peers' CUDA IPC handles")
        self.peer_ptrs = ptrs
        self.local_ptr = self._ipc_ptr
        self.mode = "cuda_ipc"

    # ------------------------------------------------------------------ teardown
    def _release_all(self) -> None:
        """Undo whatever set-up did, in reverse order; keeps going past errors and reports the first."""
        first: BaseException | None = None

        def attempt(thunk) -> None:
            nonlocal first
            try:
                thunk()
            except BaseException as exc:  # noqa: BLE001 - keep releasing the rest
                if first is None:
                    first = exc

        if self._mapped or self._va or self._imported_handles or self._own_handle is not None:
            driver = _driver()
            for ptr, size in reversed(self._mapped):
                attempt(lambda p=ptr, n=size: check("cuMemUnmap", driver.cuMemUnmap(p, n)))
            self._mapped = []
            if self._va:
                attempt(lambda: check("cuMemAddressFree", driver.cuMemAddressFree(self._va, self._va_size)))
            self._va, self._va_size = 0, 0
            for handle in self._imported_handles:
                attempt(lambda h=handle: check("cuMemRelease", driver.cuMemRelease(h)))
            self._imported_handles = []
            if self._own_handle is not None:
                attempt(lambda: check("cuMemRelease", driver.cuMemRelease(self._own_handle)))
            self._own_handle = None
        close_quietly(self._own_fd)
        self._own_fd = None
        if self._ipc_opened or self._ipc_ptr:
            import cupy

            runtime = cupy.cuda.runtime
            for ptr in self._ipc_opened:
                attempt(lambda p=ptr: _runtime_check("cudaIpcCloseMemHandle", runtime.ipcCloseMemHandle, p))
            self._ipc_opened = []
            if self._ipc_ptr:
                attempt(lambda: _runtime_check("cudaFree", runtime.free, self._ipc_ptr))
            self._ipc_ptr = 0
        self.peer_ptrs = []
        self.local_ptr = 0
        if first is not None:
            raise DeepEPError(f"releasing the NVLink buffer failed: {first}") from first

    def close(self) -> None:
        """Unmap every peer, release the allocations and the reservation, close descriptors. Idempotent.

        The caller must make sure no kernel still uses the buffer (synchronise first); peers may close
        in any order, since each rank's physical memory lives until every mapping of it is gone.
        """
        if self._closed:
            return
        self._closed = True
        self._release_all()

    def __enter__(self) -> PeerMappedBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"PeerMappedBuffer(rank={self.rank}/{self.num_ranks}, size={self.size}, mode={self.mode!r}, "
                f"local_ptr=0x{self.local_ptr:x})")
