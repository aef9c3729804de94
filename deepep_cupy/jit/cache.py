"""On-disk cubin cache and :func:`build`.

Files: ``<cache_dir>/<key[:2]>/<key>/kernel.cubin`` + ``meta.json``. An entry is written into a temporary
directory under the cache root and renamed into place in one step, so readers never see half an entry.
A miss takes the entry's lock file first: the ranks of a node that need the same kernel wait for the one
compiling it instead of compiling it each (where the file system has no locks they all compile, and the
first rename wins). A wait longer than ``$DEEPEP_CUPY_CACHE_LOCK_TIMEOUT_S`` seconds (default 600) raises
:class:`~deepep_cupy.errors.DeepEPTimeoutError` naming the lock file.

Nothing read back is trusted on its size alone: an entry is used only when its directory and files are
ours and writable by nobody else, ``meta.json`` matches the digest stored in it and names the key and
spec being built, and the cubin matches the SHA-256 in ``meta.json``. Anything else is rebuilt, with one
:class:`~deepep_cupy.jit.files.CacheTrustWarning` per process naming the entry (``$DEEPEP_CUPY_JIT_DEBUG``
reports every one). Directories are created 0700 and files 0600 whatever the umask.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
import warnings
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
from .files import (
    CacheTrustWarning,
    UntrustedFileError,
    current_owner,
    distrust,
    exclusive_lock,
    make_private_dirs,
    make_private_temp_dir,
    read_trusted,
    write_private_file,
)
from .sources import source_digests, source_root
from .spec import BuildSpec, CompiledKernel

__all__ = [
    "JIT_FORMAT_VERSION",
    "CACHE_DIR_ENV",
    "DEBUG_ENV",
    "cache_dir",
    "cache_key",
    "build",
    "build_with_status",
    "check_entry",
    "entry_for",
]

# Bump when the entry's files or anything the key does not see (e.g. how options are built) changes.
JIT_FORMAT_VERSION = 2
CACHE_DIR_ENV = "DEEPEP_CUPY_CACHE_DIR"
DEBUG_ENV = "DEEPEP_CUPY_JIT_DEBUG"
_CUBIN = "kernel.cubin"
_META = "meta.json"
_STALE_TMP_S = 24 * 3600
_warned = False  # one refusal warning per process; the rest go to the debug output


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


def _include_placeholders(tc) -> dict[str, str]:
    """``{-I option: placeholder}`` for the toolkit include directories whose content the key identifies by
    version (which directory holds which header is the toolkit's own layout); a directory stays as it is
    where a version was not found."""
    found = {}
    if tc.versions.get("cudart") and tc.versions.get("cccl"):
        found.update({f"-I{d}": f"-I<cuda_include_{i}>" for i, d in enumerate(tc.cuda_include_dirs)})
    if tc.nvshmem_include_dir and tc.versions.get("nvshmem", "unknown") != "unknown":
        found[f"-I{tc.nvshmem_include_dir}"] = "-I<nvshmem_include>"
    return found


def cache_key(spec: BuildSpec, arch: str, root: Path, options: list[str]) -> str:
    """SHA-256 over everything that can change the cubin.

    Absolute paths are replaced by placeholders where the key identifies their content otherwise: the
    source root (every included project header is hashed) and the toolkit's include directories (their
    versions are in the key). So two checkouts with the same sources share entries, and a cache filled on
    a build machine without a GPU (``python -m deepep_cupy.jit precompile``) serves an install of the same
    versions under another path.
    """
    tc = toolchain()
    root_text, includes = str(root), _include_placeholders(tc)
    material = {
        "format": JIT_FORMAT_VERSION,
        "source": spec.source,
        "defines": [list(d) for d in spec.defines],
        "name_expressions": list(spec.name_expressions),
        "nvshmem": spec.nvshmem,
        "arch": arch,
        "options": [includes.get(o) or o.replace(root_text, "<cuda_src>") for o in options],
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


def _claims(spec: BuildSpec, arch: str, key: str) -> dict:
    """What an entry's ``meta.json`` must say it was built from."""
    return {
        "format": JIT_FORMAT_VERSION,
        "key": key,
        "source": spec.source,
        "defines": [list(d) for d in spec.defines],
        "name_expressions": list(spec.name_expressions),
        "nvshmem": spec.nvshmem,
        "arch": arch,
    }


def _meta_digest(meta: dict) -> str:
    """SHA-256 of every field but ``digest``; it covers ``cubin_sha256``, so it vouches for the cubin too."""
    body = {k: v for k, v in meta.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_entry(entry: Path, claims: dict) -> tuple[dict | None, str | None]:
    """Verify a cache entry before anything of it is used.

    Arguments:
        entry: the entry directory.
        claims: what it must have been built from (see ``_claims``: key, spec fields, arch, format).

    Returns:
        ``(meta, None)`` for an entry that passed every check, ``(None, None)`` when there is no entry,
        ``(None, reason)`` when there is one that must not be used (reason says why, for a message).
    """
    try:
        reason = distrust(os.lstat(entry), directory=True)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"cannot be read ({exc})"
    if reason is not None:
        return None, reason
    try:
        meta_bytes = read_trusted(entry / _META)
        cubin = read_trusted(entry / _CUBIN)
    except UntrustedFileError as exc:
        return None, f"has a file that {exc.reason}: {exc.path.name}"
    except FileNotFoundError as exc:
        return None, f"is incomplete ({Path(exc.filename or '').name or 'a file'} is missing)"
    except OSError as exc:
        return None, f"cannot be read ({exc})"
    try:
        meta = json.loads(meta_bytes)
    except ValueError:
        return None, f"has a damaged {_META}"
    if not isinstance(meta, dict) or meta.get("digest") != _meta_digest(meta):
        return None, f"has a {_META} that does not match its digest (edited or damaged)"
    wrong = sorted(k for k, v in claims.items() if meta.get(k) != v)
    if wrong:
        return None, f"was built from something else ({', '.join(wrong)} differ)"
    if len(cubin) == 0 or meta.get("cubin_size") != len(cubin) \
            or meta.get("cubin_sha256") != hashlib.sha256(cubin).hexdigest():
        return None, f"has a {_CUBIN} that does not match the SHA-256 in {_META} (altered or damaged)"
    names = meta.get("lowered_names")
    if not isinstance(names, dict) or sorted(names) != sorted(claims["name_expressions"]) \
            or not all(isinstance(v, str) and v for v in names.values()):
        return None, "lists other kernels than it was built for"
    return meta, None


def entry_for(spec: BuildSpec, arch: str) -> tuple[Path, dict, list[str], str]:
    """Where ``spec`` built for ``arch`` lives: ``(entry, claims, options, key)`` (no file is touched)."""
    root = source_root()
    options = compile_options(spec, arch, root)
    key = cache_key(spec, arch, root, options)
    return cache_dir() / key[:2] / key, _claims(spec, arch, key), options, key


def _report_refusal(message: str, quiet: bool) -> None:
    global _warned
    if _debug():
        print(f"deepep_cupy: {message}", file=sys.stderr, flush=True)
    if quiet or _warned:
        return
    _warned = True
    warnings.warn(
        f"deepep_cupy: {message} (later refusals in this process are reported only with ${DEBUG_ENV}=1)",
        CacheTrustWarning,
        stacklevel=4,
    )


def _remove_stale_tmp(root: Path) -> None:
    now = time.time()
    owner = current_owner()
    try:
        for child in root.iterdir():
            if not child.name.startswith(".tmp-"):
                continue
            st = child.lstat()
            if st.st_uid == owner and now - st.st_mtime > _STALE_TMP_S:
                shutil.rmtree(child, ignore_errors=True)
    except OSError:
        pass


def _publish(entry: Path, cubin: bytes, meta: dict, claims: dict) -> dict:
    """Atomically place a new entry; returns the metadata of whichever verified entry ends up in place."""
    root = entry.parent.parent
    try:
        make_private_dirs(entry.parent)
        tmp = make_private_temp_dir(root, f".tmp-{entry.name[:16]}-")
    except OSError as exc:
        raise RuntimeError(
            f"deepep_cupy: cannot write to the kernel cache {root} ({exc}); set ${CACHE_DIR_ENV} to a writable "
            "directory"
        ) from exc
    try:
        write_private_file(tmp / _CUBIN, cubin)
        write_private_file(tmp / _META, json.dumps(meta, indent=1, sort_keys=True).encode())
        try:
            os.rename(tmp, entry)
            return meta
        except OSError:
            pass  # the target exists: another process won, or it is one that must not be used
        winner, _ = check_entry(entry, claims)
        if winner is not None:
            return winner
        # A refused entry in the way: move it aside (atomic), then retry once.
        trash = make_private_temp_dir(root, f".tmp-trash-{entry.name[:16]}-")
        try:
            os.rename(entry, trash / "old")
        except OSError:
            pass
        shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, entry)
            return meta
        except OSError:
            winner, _ = check_entry(entry, claims)
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
    """Compile ``spec`` for ``arch`` (default: the current device), or reuse the verified cached cubin.

    Arguments:
        spec: what to compile.
        arch: ``"sm_90"`` etc.; None means CuPy's current device (needs a GPU).

    Returns:
        CompiledKernel with the cubin path, the mangled names of ``spec.name_expressions``, the key and
        whether it came from the cache.

    Raises:
        CompileError: NVRTC or nvJitLink rejected the source (the log and source lines are in the message).
        DeepEPTimeoutError: another process held the entry's lock longer than the lock bound.
        RuntimeError: no GPU while ``arch`` is None, or the cache directory is unusable.
    """
    return build_with_status(spec, arch)[0]


def build_with_status(
    spec: BuildSpec, arch: str | None = None, *, quiet: bool = False
) -> tuple[CompiledKernel, str | None]:
    """:func:`build`, also saying why an entry that was in the cache was refused (None when none was).

    ``quiet`` leaves out the compile progress on stderr and the refusal warning (the caller reports).
    """
    if not isinstance(spec, BuildSpec):
        raise TypeError(f"build() needs a BuildSpec, got {type(spec).__name__}")
    arch = current_device_arch() if arch is None else normalize_arch(arch)
    entry, claims, options, key = entry_for(spec, arch)
    meta, refused = check_entry(entry, claims)
    if _debug():
        state = "hit" if meta is not None else "refused" if refused else "miss"
        print(
            f"deepep_cupy: {spec.describe()} for {arch}: cache {state} at {entry}\n  options: {' '.join(options)}",
            file=sys.stderr,
            flush=True,
        )
    if meta is not None:
        return CompiledKernel(entry / _CUBIN, dict(meta["lowered_names"]), key, True), None
    if refused is not None:
        _report_refusal(f"not using the cached kernel {entry}: it {refused}; rebuilding it", quiet)

    try:
        make_private_dirs(entry.parent)
    except OSError:
        pass  # _publish reports an unusable cache directory
    lock_path = entry.parent / f".lock-{entry.name}"
    with contextlib.ExitStack() as stack:
        try:
            waited = stack.enter_context(exclusive_lock(lock_path, ready=lambda: check_entry(entry, claims)[0]))
        except UntrustedFileError as exc:
            # Without the lock the ranks may compile the same kernel each; the atomic publish keeps that safe.
            _report_refusal(f"not using the lock file {lock_path}: it {exc.reason}; compiling without it", quiet)
            waited = None
        except OSError:
            waited = None  # no lock file here (e.g. a read-only directory): _publish says what is wrong
        if waited is None:  # holding the lock, or none to hold: the entry may have appeared meanwhile
            waited, _ = check_entry(entry, claims)
        if waited is not None:
            return CompiledKernel(entry / _CUBIN, dict(waited["lowered_names"]), key, True), refused
        return _compile_and_publish(spec, arch, options, entry, claims, quiet), refused


def _compile_and_publish(spec: BuildSpec, arch: str, options: list[str], entry: Path, claims: dict,
                         quiet: bool) -> CompiledKernel:
    params = spec.params()
    if not quiet:
        print(
            f"deepep_cupy: compiling {spec.source} for {arch}{f' ({params})' if params else ''} ...",
            end="",
            file=sys.stderr,
            flush=True,
        )
    start = time.perf_counter()
    try:
        result = compile_cubin(spec, arch, source_root(), options)
    except CompileError:
        if not quiet:
            print(" failed", file=sys.stderr, flush=True)
        raise
    if not quiet:
        print(f" done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    meta = {
        **claims,
        "options": options,
        "lowered_names": result.lowered_names,
        "cubin_size": len(result.cubin),
        "cubin_sha256": hashlib.sha256(result.cubin).hexdigest(),
        "compile_s": round(result.compile_s, 3),
        "link_s": round(result.link_s, 3),
        "log": result.log,
        "created": time.time(),
    }
    meta["digest"] = _meta_digest(meta)
    _remove_stale_tmp(cache_dir())
    _publish(entry, result.cubin, meta, claims)
    final, reason = check_entry(entry, claims)
    if final is None:
        raise RuntimeError(
            f"deepep_cupy: the kernel cache entry {entry} fails its checks right after it was written "
            f"({reason or 'it is missing'}); delete that directory (or set ${CACHE_DIR_ENV} to a directory "
            "only you can write) and retry"
        )
    return CompiledKernel(entry / _CUBIN, dict(final["lowered_names"]), claims["key"], False)
