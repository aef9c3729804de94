"""JIT compilation of the CUDA kernels: NVRTC (+ nvJitLink for NVSHMEM), an on-disk cubin cache, loading.

Typical use in an op launcher::

    name = "deepep_cupy::layout::count_tokens<8, 8>"
    spec = BuildSpec.make("layout/count_tokens.cu", name_expressions=[name])
    kernel = load(spec).get_function(name)
    kernel((blocks,), (threads,), (arg0, arg1, ...), stream=stream)

:func:`build` compiles without a GPU when given an ``arch``; :func:`load` needs one.
``python -m deepep_cupy.jit precompile`` fills the cache ahead of time (see :mod:`deepep_cupy.jit.precompile`).
"""

from .cache import build, cache_dir
from .compiler import CompileError
from .files import CacheTrustWarning
from .module import Kernel, LoadedModule, load
from .sources import source_root, use_source_root
from .spec import BuildSpec, CompiledKernel

__all__ = [
    "BuildSpec",
    "CacheTrustWarning",
    "CompiledKernel",
    "CompileError",
    "Kernel",
    "LoadedModule",
    "build",
    "cache_dir",
    "load",
    "source_root",
    "use_source_root",
]
