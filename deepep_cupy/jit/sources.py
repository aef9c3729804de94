"""Where the CUDA sources live, and which files one source pulls in.

The kernel sources ship inside the wheel as ``deepep_cupy/cuda_src`` and sit at ``<repo>/cuda_src`` in a
source checkout. ``$DEEPEP_CUPY_SOURCE_DIR`` or :func:`use_source_root` point the JIT at another tree
(tests use this to edit headers without touching the package).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["SOURCE_DIR_ENV", "source_root", "packaged_source_root", "use_source_root", "source_digests"]

SOURCE_DIR_ENV = "DEEPEP_CUPY_SOURCE_DIR"

_PACKAGE_DIR = Path(__file__).resolve().parent.parent
_override_lock = threading.Lock()
_override: Path | None = None

# Only quoted includes are ours; <...> includes come from the CUDA/NVSHMEM toolkits, whose versions are
# part of the cache key instead.
_INCLUDE_RE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"\n]+)"', re.MULTILINE)


def source_root() -> Path:
    """The directory that holds the ``.cu``/``.cuh`` sources.

    Order: :func:`use_source_root` override, ``$DEEPEP_CUPY_SOURCE_DIR``, ``deepep_cupy/cuda_src`` (installed
    wheel), ``<repo>/cuda_src`` (source tree or editable install).
    """
    if _override is not None:
        return _override
    env = os.environ.get(SOURCE_DIR_ENV)
    if env:
        return Path(env).resolve()
    return _packaged_root()


def packaged_source_root() -> Path:
    """The sources shipped with this package, whatever :func:`source_root` points the JIT at: the host's
    description of the kernels' parameter structs (:mod:`deepep_cupy.ops.headers`) is read from these, since
    it belongs to the host code of the same release."""
    return _packaged_root()


@functools.cache
def _packaged_root() -> Path:
    for candidate in (_PACKAGE_DIR / "cuda_src", _PACKAGE_DIR.parent / "cuda_src"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"deepep_cupy: CUDA sources not found in {_PACKAGE_DIR / 'cuda_src'} or {_PACKAGE_DIR.parent / 'cuda_src'}; "
        f"set ${SOURCE_DIR_ENV} to the cuda_src directory"
    )


@contextlib.contextmanager
def use_source_root(path: str | os.PathLike) -> Iterator[Path]:
    """Compile from ``path`` instead of the packaged sources inside the ``with`` block (process-wide)."""
    global _override
    new = Path(path).resolve()
    with _override_lock:
        old, _override = _override, new
    try:
        yield new
    finally:
        with _override_lock:
            _override = old


def _resolve_include(name: str, including_dir: Path, root: Path) -> Path | None:
    # Same search order as the compiler: next to the including file first, then the -I<root> directory.
    for base in (including_dir, root):
        candidate = base / name
        if candidate.is_file():
            return candidate
    return None


def source_digests(source: str, root: Path | None = None) -> dict[str, str]:
    """SHA-256 of ``source`` and of every file it includes with ``#include "..."``, transitively.

    Returns ``{path relative to root (or absolute when outside it): hex digest}``. Quoted includes that
    resolve to no file (toolkit headers written with quotes) are skipped. Raises FileNotFoundError when
    ``source`` itself is missing.
    """
    root = source_root() if root is None else root
    top = root / source
    if not top.is_file():
        raise FileNotFoundError(f"deepep_cupy: kernel source {top} does not exist")
    digests: dict[str, str] = {}
    pending = [top.resolve()]
    seen: set[Path] = set()
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        data = path.read_bytes()
        try:
            label = path.relative_to(root.resolve()).as_posix()
        except ValueError:
            label = str(path)
        digests[label] = hashlib.sha256(data).hexdigest()
        for match in _INCLUDE_RE.finditer(data):
            found = _resolve_include(match.group(1).decode(), path.parent, root)
            if found is not None:
                pending.append(found.resolve())
    return dict(sorted(digests.items()))
