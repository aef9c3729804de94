"""Intranode (one NVLink domain) dispatch and combine: ``buffer_map`` (buffer offsets), ``args``
(kernel argument lists), ``engine`` (the NVLink buffer and the kernels' builds), ``copy`` (the combine's
copy mode) and ``plans`` (the launch plans); own rows by device-to-device copies are ``ops/own_rows.py``,
shared with the internode dispatch."""
