"""Internode (several NVLink domains) dispatch and combine: ``layout`` (buffer and ring offsets),
``engine`` (buffers, builds and argument lists) and ``plans`` (the launch plans)."""

from .engine import representative_builds

__all__ = ["representative_builds"]
