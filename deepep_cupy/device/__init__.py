"""Process groups, device memory shared between ranks, NVSHMEM, streams and events."""
