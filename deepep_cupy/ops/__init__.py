"""The op families and what their plans share.

``layout`` (the dispatch layout), ``intranode`` (one NVLink domain), ``internode`` (several domains:
RDMA between them, NVLink within) and ``low_latency`` (decoding) each build their kernels through
:mod:`deepep_cupy.jit` and export ``representative_builds()``: the :class:`~deepep_cupy.jit.BuildSpec`
instantiations they ship, which the CPU test suite and ``python -m deepep_cupy.jit precompile``
compile. Shared by the families: :mod:`.plan` (plan keys, the high-throughput plan base),
:mod:`.handles`, :mod:`.health` (error state of the engines) and :mod:`.kernel_names`.
"""

#: The op families, as ``deepep_cupy.ops.<name>`` modules that export ``representative_builds()``.
FAMILIES = ("layout", "intranode", "internode", "low_latency")
