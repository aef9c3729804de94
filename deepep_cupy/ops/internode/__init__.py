"""Internode (several NVLink domains) dispatch and combine: ``layout`` (buffer and ring offsets),
``engine`` (buffers, builds and argument lists) and ``plans`` (the launch plans)."""
