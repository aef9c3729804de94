"""Intranode (one NVLink domain) dispatch and combine: ``layout`` (buffer offsets), ``args`` (kernel
argument lists), ``engine`` (the NVLink buffer and the kernels' builds), ``copy`` (the combine's copy mode),
``own_rows`` (own rows through the copy engines) and ``plans`` (the launch plans)."""
