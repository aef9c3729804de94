"""Configs found by ``python -m deepep_cupy.tuning``: where they are stored and how the ``Buffer`` finds them.

One JSON file, ``tuned_configs.json`` in the kernel cache directory (``$DEEPEP_CUPY_CACHE_DIR`` or the
default, see :func:`deepep_cupy.jit.cache.cache_dir`), holds one entry per GPU model, rank count and hidden
size: the best dispatch and combine ``Config`` for each SM count the tuner tried, and the SM count it chose.

``Buffer.get_dispatch_config`` / ``get_combine_config`` may be called for every op, so a lookup must stay
cheap: the file is read once per process and every answer is remembered. Without the file a lookup costs
one ``stat`` the first time and touches no CUDA; the GPU model is asked for only when the file exists.
A process sees configs stored after its first lookup only after :func:`forget`.

The store is trusted like the kernel cache (:mod:`deepep_cupy.jit.files`): a file that is not ours, is
writable by group or others, or is a symlink is ignored with a warning; the directory is created 0700 and
the file 0600 whatever the umask; writers take a lock file (never through a symlink) for at most
``$DEEPEP_CUPY_CACHE_LOCK_TIMEOUT_S`` seconds, then raise ``DeepEPTimeoutError`` naming it.
"""

from __future__ import annotations

import contextlib
import json
import operator
import os
import time
import warnings
from pathlib import Path

from ..config import Config
from ..device.gpus import gpu_count
from ..jit.cache import cache_dir
from ..jit.files import (
    CacheTrustWarning,
    UntrustedFileError,
    exclusive_lock,
    make_private_dirs,
    make_private_temp_file,
    read_trusted,
)

__all__ = ["FORMAT", "STORE_NAME", "OPS", "store_path", "gpu_model", "tuned_config", "read_entries", "save_entry",
           "make_entry", "forget"]

FORMAT = 1
STORE_NAME = "tuned_configs.json"
OPS = ("dispatch", "combine")

# Entries of the current GPU model, loaded on the first lookup: {(num_ranks, hidden): entry} and, per rank
# count, the entry stored last (what a lookup without a hidden size gets). None until loaded.
_index: dict | None = None
_memo: dict = {}


def store_path() -> Path:
    """Where the tuned configs live: ``<kernel cache dir>/tuned_configs.json``."""

    return cache_dir() / STORE_NAME


def forget() -> None:
    """Drop what this process read from the store (the next lookup reads it again)."""
    global _index
    _index = None
    _memo.clear()


def gpu_model() -> str | None:
    """Name of the GPU this process uses (the current context's device, else the first visible one).

    None without a usable GPU. Goes through the driver API without creating a context.
    """

    if gpu_count() == 0:
        return None
    try:
        from cuda.bindings import driver

        ok = driver.CUresult.CUDA_SUCCESS
        err, dev = driver.cuCtxGetDevice()
        if err != ok:  # no current context yet: the first visible device
            err, dev = driver.cuDeviceGet(0)
            if err != ok:
                return None
        err, name = driver.cuDeviceGetName(256, dev)
        if err != ok:
            return None
        return bytes(name).split(b"\0", 1)[0].decode(errors="replace").strip() or None
    except Exception:
        return None


def _entry_key(gpu: str, num_ranks: int, hidden: int) -> str:
    return f"{gpu}|{int(num_ranks)}|{int(hidden)}"


def _valid_config(values) -> tuple | None:
    """The five ``Config`` fields as a tuple when they make a valid ``Config``, else None."""
    if not isinstance(values, (list, tuple)) or len(values) != 5:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return None
    try:
        Config(*values)
    except ValueError:
        return None
    return tuple(values)


def read_entries(path: Path | None = None) -> dict:
    """Every entry of the store, by key (empty when there is none); a damaged or untrusted file is named in
    a warning."""
    path = store_path() if path is None else path
    try:
        data = json.loads(read_trusted(path))
    except FileNotFoundError:
        return {}
    except UntrustedFileError as exc:
        warnings.warn(f"deepep_cupy: ignoring the tuned configs in {path}: it {exc.reason}; delete it or run "
                      "`python -m deepep_cupy.tuning` again", CacheTrustWarning, stacklevel=3)
        return {}
    except (OSError, ValueError) as exc:
        warnings.warn(f"deepep_cupy: ignoring the tuned configs in {path} ({exc}); delete the file or run "
                      "`python -m deepep_cupy.tuning` again", stacklevel=3)
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        warnings.warn(f"deepep_cupy: ignoring the tuned configs in {path} (written by another version); run "
                      "`python -m deepep_cupy.tuning` again", stacklevel=3)
        return {}
    return data["entries"]


def _load_index() -> dict:
    index: dict = {"by_key": {}, "latest": {}}
    path = store_path()
    try:
        exists = path.is_file()
    except OSError:
        exists = False
    if not exists:
        return index
    entries = read_entries(path)
    gpu = gpu_model() if entries else None
    if gpu is None:
        return index
    latest_time: dict = {}
    for entry in entries.values():
        if not isinstance(entry, dict) or entry.get("gpu") != gpu:
            continue
        try:
            key = (int(entry["num_ranks"]), int(entry["hidden"]))
            created = float(entry.get("created", 0))
        except (KeyError, TypeError, ValueError):
            continue
        index["by_key"][key] = entry
        if created >= latest_time.get(key[0], float("-inf")):
            latest_time[key[0]] = created
            index["latest"][key[0]] = entry
    return index


def _find(op: str, num_ranks: int, hidden: int | None, num_sms: int | None) -> tuple | None:
    global _index
    if _index is None:
        _index = _load_index()
    if hidden is None:
        entry = _index["latest"].get(num_ranks)
    else:
        try:
            value = -1 if isinstance(hidden, bool) else operator.index(hidden)
        except TypeError:
            value = -1
        if value <= 0:
            raise ValueError(f"hidden must be a positive int or None, got {hidden!r}")
        entry = _index["by_key"].get((num_ranks, value))
    if entry is None:
        return None
    by_sms = entry.get("by_sms")
    if not isinstance(by_sms, dict):
        return None
    chosen = by_sms.get(str(entry.get("num_sms") if num_sms is None else int(num_sms)))
    if not isinstance(chosen, dict):
        return None
    return _valid_config(chosen.get(op))


def tuned_config(op: str, num_ranks: int, hidden: int | None = None, num_sms: int | None = None) -> Config | None:
    """The stored ``op`` ('dispatch' or 'combine') config for this GPU model and rank count, or None.

    Arguments:
        op: 'dispatch' or 'combine'.
        num_ranks: ranks in the group.
        hidden: the hidden size it was tuned for; None takes the hidden size tuned last for this rank count.
        num_sms: None for the SM count the tuner chose; an SM count for the chunk sizes tuned at that count
            (None when the tuner did not try it).

    Returns:
        A new ``Config`` (callers may change it), or None when nothing fits.
    """
    key = (op, num_ranks, hidden, num_sms)
    try:
        values = _memo[key]
    except KeyError:
        values = _memo[key] = _find(op, num_ranks, hidden, num_sms)
    return None if values is None else Config(*values)


def make_entry(gpu: str, num_ranks: int, hidden: int, num_sms: int, by_sms: dict, **extra) -> dict:
    """An entry for :func:`save_entry`.

    Arguments:
        gpu: GPU model (:func:`gpu_model`).
        num_ranks, hidden: what it was tuned for.
        num_sms: the SM count chosen (a key of ``by_sms``).
        by_sms: ``{sms: {"dispatch": Config, "combine": Config, ...timings}}``.
        extra: more fields kept as they are (workload, timings of the built-in configs).
    """
    if num_sms not in by_sms:
        raise ValueError(f"the chosen SM count {num_sms} is not among the SM counts tuned ({sorted(by_sms)})")
    table = {}
    for sms, point in by_sms.items():
        row = dict(point)
        for op in OPS:
            cfg = point[op]
            row[op] = [cfg.num_sms, cfg.num_max_nvl_chunked_send_tokens, cfg.num_max_nvl_chunked_recv_tokens,
                       cfg.num_max_rdma_chunked_send_tokens, cfg.num_max_rdma_chunked_recv_tokens]
        table[str(int(sms))] = row
    return {"gpu": gpu, "num_ranks": int(num_ranks), "hidden": int(hidden), "num_sms": int(num_sms),
            "created": time.time(), "by_sms": table, **extra}


@contextlib.contextmanager
def _locked(path: Path):
    # Two tuners finishing together would otherwise each write the file without the other's entry.
    lock_path = path.parent / f".lock-{path.name}"
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(exclusive_lock(lock_path))
        except UntrustedFileError as exc:
            # Saving unlocked risks losing a concurrent tuner's entry; losing this tuner's run is worse.
            warnings.warn(f"deepep_cupy: not using the lock file {lock_path}: it {exc.reason}; saving without "
                          "it", CacheTrustWarning, stacklevel=4)
        yield


def save_entry(entry: dict, path: Path | None = None) -> Path:
    """Add ``entry`` to the store (replacing one for the same GPU model, ranks and hidden size).

    The file is replaced in one rename, so a process reading it never sees half of it.

    Raises:
        DeepEPTimeoutError: another process held the store's lock longer than the lock bound.
        RuntimeError: the store's directory is not writable.
    """
    path = store_path() if path is None else path
    try:
        make_private_dirs(path.parent)
        with _locked(path):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a damaged or untrusted file is replaced, not reported
                entries = dict(read_entries(path))
            entries[_entry_key(entry["gpu"], entry["num_ranks"], entry["hidden"])] = entry
            fd, tmp = make_private_temp_file(path.parent, f".tmp-{path.name}-")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({"format": FORMAT, "entries": entries}, f, indent=1, sort_keys=True)
                os.replace(tmp, path)
            finally:
                if os.path.lexists(tmp):
                    os.unlink(tmp)
    except OSError as exc:
        raise RuntimeError(f"deepep_cupy: cannot write the tuned configs to {path} ({exc}); set "
                           "$DEEPEP_CUPY_CACHE_DIR to a writable directory") from exc
    forget()
    return path
