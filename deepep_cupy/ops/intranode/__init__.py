"""Intranode (one NVLink domain) dispatch and combine: ``layout`` (buffer offsets), ``args`` (kernel
argument lists), ``engine`` (the NVLink buffer and the kernels' builds), ``copy`` (the combine's copy mode),
``own_rows`` (own rows through the copy engines) and ``plans`` (the launch plans)."""

__all__ = ["representative_builds"]


def representative_builds():
    """The build specs this family ships (see :func:`.engine.representative_builds`). Imported on call, so
    that the layout modules can be imported without the engine."""
    from .engine import representative_builds as builds

    return builds()
