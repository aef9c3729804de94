"""On-disk cubin cache and :func:`build`.

Layout: ``<cache_dir>/<key[:2]>/<key>/kernel.cubin`` + ``meta.json``. An entry is written into a temporary
directory under the cache root and renamed into place in one step, so readers never see half an entry.
A miss takes the entry's lock file first: the ranks of a node that need the same kernel wait for the one
compiling it instead of compiling it each (where locks do not work they all compile, and the first
rename wins). The warm path is one ``stat`` and one small JSON read, with no compiler call or lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .compiler import (
    CompileError,
    compile_cubin,
    compile_options,
    current_device_arch,
    normalize_arch,
    nvjitlink_version,
    nvrtc_version,
    toolchain,
)
from .sources import source_digests, source_root
from .spec import BuildSpec, CompiledKernel

__all__ = ["JIT_FORMAT_VERSION", "CACHE_DIR_ENV", "DEBUG_ENV", "cache_dir", "cache_key", "build"]

# Bump when the entry layout or anything the key does not see (e.g. how options are built) changes.
JIT_FORMAT_VERSION = 1
CACHE_DIR_ENV = "DEEPEP_CUPY_CACHE_DIR"
DEBUG_ENV = "DEEPEP_CUPY_JIT_DEBUG"
_CUBIN = "kernel.cubin"
_META = "meta.json"
_STALE_TMP_S = 24 * 3600
_LOCK_WAIT_S = 600.0  # longest wait for another process compiling the same kernel


def cache_dir() -> Path:
    """``$DEEPEP_CUPY_CACHE_DIR``, else ``$XDG_CACHE_HOME/deepep_cupy``, else ``~/.cache/deepep_cupy``."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "deepep_cupy"


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def cache_key(spec: BuildSpec, arch: str, root: Path, options: list[str]) -> str:
    """SHA-256 over everything that can change the cubin.

    The source root's absolute path is replaced by a placeholder: two checkouts with the same sources
    share entries, while the content of every included project header is hashed.
    """
    tc = toolchain()
    root_text = str(root)
    material = {
        "format": JIT_FORMAT_VERSION,
        "source": spec.source,
        "defines": [list(d) for d in spec.defines],
        "name_expressions": list(spec.name_expressions),
        "nvshmem": spec.nvshmem,
        "arch": arch,
        "options": [o.replace(root_text, "<cuda_src>") for o in options],
        "files": source_digests(spec.source, root),
        "nvrtc": nvrtc_version(),
        "toolkit": {k: v for k, v in sorted(tc.versions.items()) if not k.startswith("nvshmem")},
    }
    if spec.nvshmem:
        material["nvjitlink"] = nvjitlink_version()
        material["nvshmem_versions"] = {
            k: v for k, v in sorted(tc.versions.items()) if k.startswith("nvshmem")
        }
    blob = json.dumps(material, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def _read_entry(entry: Path) -> dict | None:
    """The entry's metadata when the entry is complete, else None (missing or corrupt)."""
    try:
        with open(entry / _META, encoding="utf-8") as f:
            meta = json.load(f)
        size = os.stat(entry / _CUBIN).st_size
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("cubin_size") != size or size == 0:
        return None
    if not isinstance(meta.get("lowered_names"), dict):
        return None
    return meta


def _remove_stale_tmp(root: Path) -> None:
    now = time.time()
    try:
        for child in root.iterdir():
            if child.name.startswith(".tmp-") and now - child.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(child, ignore_errors=True)
    except OSError:
        pass


def _publish(entry: Path, cubin: bytes, meta: dict) -> dict:
    """Atomically place a new entry; returns the metadata of whichever entry ends up in place."""
    root = entry.parent.parent
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name[:16]}-", dir=root))
    except OSError as exc:
        raise RuntimeError(
            f"deepep_cupy: cannot write to the kernel cache {root} ({exc}); set ${CACHE_DIR_ENV} to a writable "
            "directory"
        ) from exc
    try:
        (tmp / _CUBIN).write_bytes(cubin)
        with open(tmp / _META, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
        try:
            os.rename(tmp, entry)
            return meta
        except OSError:
            pass  # the target exists: another process won, or it is corrupt
        winner = _read_entry(entry)
        if winner is not None:
            return winner
        # Corrupt entry in the way: move it aside (atomic), then retry once.
        trash = Path(tempfile.mkdtemp(prefix=f".tmp-trash-{entry.name[:16]}-", dir=root))
        try:
            os.rename(entry, trash / "old")
        except OSError:
            pass
        shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, entry)
            return meta
        except OSError:
            winner = _read_entry(entry)
            if winner is not None:
                return winner
            raise
    except OSError as exc:
        raise RuntimeError(
            f"deepep_cupy: could not write the kernel cache entry {entry} ({exc}); delete that directory "
            f"(or set ${CACHE_DIR_ENV} to another place) and retry"
        ) from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def build(spec: BuildSpec, arch: str | None = None) -> CompiledKernel:
    """Compile ``spec`` for ``arch`` (default: the current device), or reuse the cached cubin.

    Arguments:
        spec: what to compile.
        arch: ``"sm_90"`` etc.; None means CuPy's current device (needs a GPU).

    Returns:
        CompiledKernel with the cubin path, the mangled names of ``spec.name_expressions``, the key and
        whether it came from the cache.

    Raises:
        CompileError: NVRTC or nvJitLink rejected the source (the log and source lines are in the message).
        RuntimeError: no GPU while ``arch`` is None, or the cache directory is unusable.
    """
    if not isinstance(spec, BuildSpec):
        raise TypeError(f"build() needs a BuildSpec, got {type(spec).__name__}")
    arch = current_device_arch() if arch is None else normalize_arch(arch)
    root = source_root()
    options = compile_options(spec, arch, root)
    key = cache_key(spec, arch, root, options)
    entry = cache_dir() / key[:2] / key
    meta = _read_entry(entry)
    if _debug():
        state = "hit" if meta is not None else "miss"
        print(
            f"deepep_cupy: {spec.describe()} for {arch}: cache {state} at {entry}\n  options: {' '.join(options)}",
            file=sys.stderr,
            flush=True,
        )
    if meta is not None:
        return CompiledKernel(entry / _CUBIN, dict(meta["lowered_names"]), key, True)

    with _compile_lock(entry) as meta:
        if meta is not None:  # another process compiled it while this one waited
            return CompiledKernel(entry / _CUBIN, dict(meta["lowered_names"]), key, True)
        return _compile_and_publish(spec, arch, root, options, key, entry)


@contextlib.contextmanager
def _compile_lock(entry: Path):
    """Hold the entry's lock file while compiling, so that the ranks of a node compile a kernel once.

    Yields the entry's metadata when it appeared while waiting (nothing left to do), else None. The
    lock is advisory and best effort: where the file system refuses it, or another process holds it
    longer than ``_LOCK_WAIT_S``, this process compiles on its own (the atomic publish keeps that safe).
    """
    lock_path = entry.parent / f".lock-{entry.name}"
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield None
        return
    try:
        deadline = time.monotonic() + _LOCK_WAIT_S
        locked = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                meta = _read_entry(entry)
                if meta is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            except OSError:
                meta = None
                break
        yield _read_entry(entry) if locked or meta is not None else None
    finally:
        os.close(fd)  # releases the lock


def _compile_and_publish(spec: BuildSpec, arch: str, root: Path, options: list[str], key: str,
                         entry: Path) -> CompiledKernel:
    corrupt = entry.exists()
    params = spec.params()
    print(
        f"deepep_cupy: compiling {spec.source} for {arch}{f' ({params})' if params else ''} ...",
        end="",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    try:
        result = compile_cubin(spec, arch, root, options)
    except CompileError:
        print(" failed", file=sys.stderr, flush=True)
        raise
    print(f" done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    meta = {
        "format": JIT_FORMAT_VERSION,
        "key": key,
        "source": spec.source,
        "defines": [list(d) for d in spec.defines],
        "name_expressions": list(spec.name_expressions),
        "nvshmem": spec.nvshmem,
        "arch": arch,
        "options": options,
        "lowered_names": result.lowered_names,
        "cubin_size": len(result.cubin),
        "cubin_sha256": hashlib.sha256(result.cubin).hexdigest(),
        "compile_s": round(result.compile_s, 3),
        "link_s": round(result.link_s, 3),
        "log": result.log,
        "created": time.time(),
    }
    _remove_stale_tmp(cache_dir())
    final = _publish(entry, result.cubin, meta)
    if _read_entry(entry) is None:
        raise RuntimeError(
            f"deepep_cupy: the kernel cache entry {entry} is unreadable"
            f"{' after rebuilding a corrupt copy' if corrupt else ''}; delete that directory and retry"
        )
    return CompiledKernel(entry / _CUBIN, dict(final["lowered_names"]), key, False)
