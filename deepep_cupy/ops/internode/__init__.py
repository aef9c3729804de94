"""Internode (several NVLink domains) dispatch and combine: ``layout`` (buffer and ring offsets),
``engine`` (buffers, builds and argument lists) and ``plans`` (the launch plans)."""

__all__ = ["representative_builds"]


def representative_builds():
    """The build specs this family ships (see :func:`.engine.representative_builds`). Imported on call, so
    that the layout modules can be imported without the engine."""
    from .engine import representative_builds as builds

    return builds()
