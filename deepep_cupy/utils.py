"""The names of DeepEP's ``deep_ep.utils``: ``EventHandle``, ``EventOverlap`` and ``check_nvlink_connections``."""

from __future__ import annotations

from .device.gpus import current_device_id, gpu_count
from .device.group import group_size
from .event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]


def check_nvlink_connections(group) -> None:
    """Refuse a group that PCIe GPUs cannot serve: such cards are linked over NVLink in pairs at most.

    Nothing to check without a GPU or on GPUs that are not PCIe cards (SXM parts reach every peer through
    NVLink or NVSwitch). ``Buffer`` does not call this itself; it is here for code written against DeepEP.

    Arguments:
        group: the ``torch.distributed.ProcessGroup`` (or mpi4py communicator) the Buffer will use.

    Raises:
        ValueError: the GPUs are PCIe cards and the group has more than two ranks.
    """
    if gpu_count() == 0:
        return
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(current_device_id())["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    size = group_size(group)
    if "PCIE" in name.upper() and size > 2:
        raise ValueError(f"group has {size} ranks on PCIe GPUs ({name}), which are linked over NVLink in pairs "
                         "at most: use groups of at most 2 ranks")
