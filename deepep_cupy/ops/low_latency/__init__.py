"""Low-latency (decoding) dispatch and combine over NVSHMEM: ``buffer_map`` (the symmetric
buffer's regions), ``engine`` (buffer state and builds) and ``plans`` (the launch plans)."""
