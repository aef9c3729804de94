"""Low-latency (decoding) dispatch and combine over NVSHMEM: ``layout`` (the symmetric buffer's
regions), ``engine`` (buffer state and builds) and ``plans`` (the launch plans)."""
