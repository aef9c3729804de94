"""The op families and what their plans share.

``layout`` (the dispatch layout), ``intranode`` (one NVLink domain), ``internode`` (several domains:
RDMA between them, NVLink within) and ``low_latency`` (decoding) each build their kernels through
:mod:`deepep_cupy.jit`; the module :data:`BUILD_MODULES` names for a family exports
``representative_builds()``: the :class:`~deepep_cupy.jit.BuildSpec` instantiations it ships, which the CPU
test suite and ``python -m deepep_cupy.jit precompile`` compile. :mod:`.limits` holds every refusal the GPU
path makes from arguments alone, which the reference backend makes too. Shared by the families: :mod:`.plan` (plan keys, the high-throughput plan base),
:mod:`.handles`, :mod:`.health` (error state of the engines), :mod:`.tunable` (their tuning attributes,
changed through ``tune``) and :mod:`.kernel_names`.
"""

#: The op families.
FAMILIES = ("layout", "intranode", "internode", "low_latency")
#: Per family, the module whose ``representative_builds()`` lists the kernels it ships.
BUILD_MODULES = {"layout": "deepep_cupy.ops.layout", "intranode": "deepep_cupy.ops.intranode.engine",
                 "internode": "deepep_cupy.ops.internode.engine", "low_latency": "deepep_cupy.ops.low_latency.engine"}
