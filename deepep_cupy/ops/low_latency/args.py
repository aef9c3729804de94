"""The low-latency kernels' parameter structs (``cuda_src/low_latency/args.cuh``, read once at import): the
plans (:mod:`deepep_cupy.ops.low_latency.plans`) give a value for every field by name, and a
:class:`~deepep_cupy.device.launch.LaunchPlan` refuses a missing or unknown one."""

from __future__ import annotations

from ..headers import kernel_struct

__all__ = ["DISPATCH", "STAGE", "COMBINE", "KERNEL_STRUCTS"]

_HEADER = "low_latency/args.cuh"
DISPATCH = kernel_struct(_HEADER, "DispatchArgs")
STAGE = kernel_struct(_HEADER, "StageArgs")
COMBINE = kernel_struct(_HEADER, "CombineArgs")
#: Every kernel of the family -> its parameter struct.
KERNEL_STRUCTS = {"dispatch": DISPATCH, "stage": STAGE, "combine": COMBINE}
