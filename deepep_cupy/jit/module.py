"""Loading compiled kernels into the current CUDA context (needs a GPU)."""

from __future__ import annotations

import threading
from typing import Any

from .cache import build
from .compiler import current_device_arch, device_for_build
from .sources import source_root
from .spec import BuildSpec, CompiledKernel

__all__ = ["Kernel", "LoadedModule", "load"]


class Kernel:
    """A ``cupy.RawKernel`` that also takes the stream to launch on.

    Call as ``kernel((grid,), (block,), (args...), shared_mem=0, stream=None)``; ``stream=None`` launches on
    CuPy's current stream. ``raw`` is the underlying ``cupy.RawKernel`` (attributes such as
    ``max_dynamic_shared_size_bytes`` are set there).
    """

    __slots__ = ("raw", "name")

    def __init__(self, raw: Any, name: str) -> None:
        self.raw = raw
        self.name = name

    def __call__(self, grid, block, args, *, shared_mem: int = 0, stream=None) -> None:
        if stream is None:
            self.raw(grid, block, args, shared_mem=shared_mem)
        else:
            with stream:
                self.raw(grid, block, args, shared_mem=shared_mem)

    def __getattr__(self, item: str) -> Any:
        return getattr(self.raw, item)

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"


class LoadedModule:
    """One cubin loaded on one device.

    Attributes:
        raw: the ``cupy.RawModule``.
        compiled: the :class:`CompiledKernel` it came from.
        device_id: the CUDA device it is loaded on.
    """

    def __init__(self, compiled: CompiledKernel, device_id: int, nvshmem: bool) -> None:
        import cupy

        self.compiled = compiled
        self.device_id = device_id
        self.raw = cupy.RawModule(path=str(compiled.cubin_path))
        self._functions: dict[str, Kernel] = {}
        self._lock = threading.Lock()
        if nvshmem:
            _nvshmem_module_init(self.raw, compiled)

    def get_function(self, name: str) -> Kernel:
        """The kernel for a name expression of the spec (``"layout_kernel<8>"``) or an ``extern "C"`` name."""
        fn = self._functions.get(name)
        if fn is None:
            with self._lock:
                fn = self._functions.get(name)
                if fn is None:
                    symbol = self.compiled.lowered_names.get(name, name)
                    fn = Kernel(self.raw.get_function(symbol), name)
                    self._functions[name] = fn
        return fn

    def __repr__(self) -> str:
        return f"LoadedModule({self.compiled.cubin_path}, device={self.device_id})"


def _nvshmem_module_init(raw: Any, compiled: CompiledKernel) -> None:
    try:
        import nvshmem.bindings as nvshmem_bindings
    except ImportError as exc:
        raise RuntimeError(
            "deepep_cupy: this kernel uses NVSHMEM but nvshmem4py is not installed "
            "(pip install nvshmem4py-cu13, or nvshmem4py-cu12 for CUDA 12)"
        ) from exc
    status = nvshmem_bindings.cumodule_init(int(raw.module.ptr))
    if status not in (None, 0):
        raise RuntimeError(
            f"deepep_cupy: nvshmemx_cumodule_init failed ({status}) for {compiled.cubin_path}; "
            "NVSHMEM must be initialised before NVSHMEM kernels are loaded"
        )


_modules_by_spec: dict[tuple, LoadedModule] = {}
_modules_by_key: dict[tuple[int, str], LoadedModule] = {}
_load_lock = threading.Lock()


def load(spec: BuildSpec) -> LoadedModule:
    """Build ``spec`` for the current device (or take it from the disk cache) and load it, once per device.

    Repeated calls with an equal spec on the same device return the same :class:`LoadedModule` with a
    dictionary lookup. For NVSHMEM specs, ``nvshmemx_cumodule_init`` runs once per loaded module, so
    NVSHMEM must be initialised first.
    """
    device_id = device_for_build()
    memo = (device_id, spec, source_root())
    module = _modules_by_spec.get(memo)
    if module is not None:
        return module
    with _load_lock:
        module = _modules_by_spec.get(memo)
        if module is not None:
            return module
        import cupy

        with cupy.cuda.Device(device_id):
            compiled = build(spec, current_device_arch())
            module = _modules_by_key.get((device_id, compiled.key))
            if module is None:
                module = LoadedModule(compiled, device_id, spec.nvshmem)
                _modules_by_key[(device_id, compiled.key)] = module
        _modules_by_spec[memo] = module
        return module
