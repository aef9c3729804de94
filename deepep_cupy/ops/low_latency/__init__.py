"""Low-latency (decoding) dispatch and combine over NVSHMEM: ``layout`` (the symmetric buffer's
regions), ``engine`` (buffer state and builds) and ``plans`` (the launch plans)."""

__all__ = ["representative_builds"]


def representative_builds():
    """The build specs this family ships (see :func:`.engine.representative_builds`). Imported on call, so
    that the layout modules can be imported without the engine."""
    from .engine import representative_builds as builds

    return builds()
