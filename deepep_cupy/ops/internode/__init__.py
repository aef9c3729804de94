"""Internode (several NVLink domains) dispatch and combine: ``buffer_map`` (buffer and ring
offsets), ``engine`` (buffers, builds and argument lists) and ``plans`` (the launch plans)."""
