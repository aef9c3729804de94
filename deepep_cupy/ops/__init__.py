"""Kernel launchers, one module per op family.

Each module builds its kernels through :mod:`deepep_cupy.jit` and may define ``representative_builds()``
returning the :class:`~deepep_cupy.jit.BuildSpec` instantiations it ships; the CPU test suite compiles
all of them for sm_90 (and sm_80 where NVSHMEM is not needed).
"""
