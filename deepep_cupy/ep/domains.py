"""V2's module-level domain sizes, for a buffer or a process group."""

from __future__ import annotations

import os
import socket

from ..device.group import make_group
from .buffer import _EPBufferCore

__all__ = ["get_physical_domain_size", "get_logical_domain_size"]


def _physical(group) -> tuple:
    comm = make_group(None, group) if hasattr(group, "Get_size") else make_group(group)
    env = os.environ.get("DEEPEP_CUPY_NVL_RANKS")
    if env:
        nvl = int(env)
    else:
        hosts = comm.allgather_object(socket.gethostname())
        nvl = hosts.count(hosts[comm.rank])
    return comm.size // nvl, nvl


def get_physical_domain_size(group_or_buffer) -> tuple:
    """``(num_rdma_ranks, num_nvlink_ranks)`` of a V2 buffer, or of a group (collective: the ranks tell their
    hosts; ``$DEEPEP_CUPY_NVL_RANKS`` overrides the ranks per NVLink domain)."""
    if isinstance(group_or_buffer, _EPBufferCore):
        return group_or_buffer.get_physical_domain_size()
    return _physical(group_or_buffer)


def get_logical_domain_size(group_or_buffer, allow_hybrid_mode: bool = True) -> tuple:
    """``(num_scaleout_ranks, num_scaleup_ranks)``: the physical sizes in hybrid mode, else ``(1, num_ranks)``."""
    if isinstance(group_or_buffer, _EPBufferCore):
        return group_or_buffer.get_logical_domain_size()
    rdma, nvl = _physical(group_or_buffer)
    return (rdma, nvl) if allow_hybrid_mode else (1, rdma * nvl)
