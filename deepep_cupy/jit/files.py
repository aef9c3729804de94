"""Files of the kernel cache and the tuning store: private modes, trusted owners, no symlinks, bounded locks.

A cache directory may be shared with other users (a path under ``/tmp``, a shared volume) or be created
under a permissive umask. So what is created here gets explicit modes (directories 0700, files 0600; the
umask can only take bits away, so the modes are set again with ``fchmod``), lock and temporary files are
opened with ``O_NOFOLLOW``, and what is read back is used only when it is a regular file (or directory)
owned by this user that neither group nor others may write. Waits for a lock are bounded by
``$DEEPEP_CUPY_CACHE_LOCK_TIMEOUT_S`` seconds (default 600: long enough for another process to compile
the kernel it is compiling) and end in :class:`~deepep_cupy.errors.DeepEPTimeoutError` naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import DeepEPTimeoutError
from ..settings import env_seconds

__all__ = [
    "LOCK_TIMEOUT_ENV",
    "DEFAULT_LOCK_TIMEOUT_S",
    "DIR_MODE",
    "FILE_MODE",
    "UntrustedFileError",
    "CacheTrustWarning",
    "current_owner",
    "distrust",
    "make_private_dirs",
    "make_private_temp_dir",
    "make_private_temp_file",
    "write_private_file",
    "read_trusted",
    "lock_timeout_s",
    "exclusive_lock",
]

LOCK_TIMEOUT_ENV = "DEEPEP_CUPY_CACHE_LOCK_TIMEOUT_S"
DEFAULT_LOCK_TIMEOUT_S = 600.0
DIR_MODE = 0o700
FILE_MODE = 0o600
_POLL_S = 0.05
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# flock errors that mean "this file system has no locks" rather than "someone holds it".
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class UntrustedFileError(RuntimeError):
    """A cache file or directory that must not be used: a symlink, not ours, or writable by others.

    Attributes:
        path: the file.
        reason: why, e.g. ``"is owned by uid 1000, not 0"``.
    """

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path} {reason}")
        self.path = Path(path)
        self.reason = reason


class CacheTrustWarning(RuntimeWarning):
    """A cached file was refused (tampered, damaged, planted by another user) and is rebuilt or skipped."""


def current_owner() -> int:
    """The uid files must belong to: this process's effective uid (the owner of what it creates)."""
    return os.geteuid()


def distrust(st: os.stat_result, *, directory: bool = False) -> str | None:
    """Why a file with this ``lstat``/``fstat`` result must not be trusted, or None when it may be."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    owner = current_owner()
    if st.st_uid != owner:
        return f"is owned by uid {st.st_uid}, not {owner}"
    if st.st_mode & 0o022:
        who = "group and others" if st.st_mode & 0o022 == 0o022 else "group" if st.st_mode & 0o020 else "others"
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _fix_dir_mode(path: Path) -> None:
    """Set a directory this process just created to 0700, through a descriptor (no symlink is followed)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC)
    try:
        if os.fstat(fd).st_uid == current_owner():
            os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)


def make_private_dirs(path: Path) -> None:
    """``mkdir -p path``: each directory created here is 0700; existing ones are left as they are."""
    missing = []
    probe = Path(path)
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            continue  # another process made it first (with these modes, if it runs this code)
        _fix_dir_mode(directory)
    if not Path(path).is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))


def make_private_temp_dir(parent: Path, prefix: str) -> Path:
    """A new directory in ``parent`` with mode 0700 whatever the umask."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    _fix_dir_mode(tmp)
    return tmp


def make_private_temp_file(parent: Path, prefix: str) -> tuple[int, Path]:
    """A new file in ``parent`` (``O_EXCL``, never through a symlink) with mode 0600: ``(fd, path)``."""
    fd, name = tempfile.mkstemp(prefix=prefix, dir=parent)  # mkstemp opens O_EXCL | O_NOFOLLOW
    os.fchmod(fd, FILE_MODE)
    return fd, Path(name)


def write_private_file(path: Path, data: bytes) -> None:
    """Create ``path`` (it must not exist, and a symlink there is not followed) with mode 0600 and ``data``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def read_trusted(path: Path) -> bytes:
    """The bytes of ``path`` when it is a regular file of ours that group and others cannot write.

    Raises:
        FileNotFoundError: there is no such file.
        UntrustedFileError: it is a symlink, not ours, not a regular file, or writable by others.
        OSError: it cannot be read.
    """
    fd = _open_trusted(path, os.O_RDONLY)
    try:
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def lock_timeout_s() -> float:
    """The longest wait for a cache lock: ``$DEEPEP_CUPY_CACHE_LOCK_TIMEOUT_S`` seconds (default 600).

    Raises:
        ValueError: the variable is set to something other than a finite positive number.
    """
    return env_seconds(LOCK_TIMEOUT_ENV, DEFAULT_LOCK_TIMEOUT_S)


def _open_trusted(path: Path, flags: int, mode: int = 0) -> int:
    """``os.open(path, flags)`` that never follows a symlink and refuses a file :func:`distrust` rejects."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedFileError(path, "is a symbolic link") from None
        raise
    try:
        reason = distrust(os.fstat(fd))
        if reason is not None:
            raise UntrustedFileError(path, reason)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_lock(path: Path) -> int:
    fd = _open_trusted(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def exclusive_lock(
    path: Path, timeout_s: float | None = None, ready: Callable[[], object] | None = None
) -> Iterator[object]:
    """Hold an exclusive ``flock`` on ``path`` (created 0600 when missing) for the ``with`` block.

    Arguments:
        path: the lock file; a symlink there is refused, never followed.
        timeout_s: the longest wait; None means :func:`lock_timeout_s`.
        ready: called between tries while another process holds the lock; when it returns something
            other than None (the other process finished the work), the wait ends without the lock.

    Yields:
        None when the lock is held (or the file system has no locks), else what ``ready`` returned.

    Raises:
        DeepEPTimeoutError: the lock stayed taken for ``timeout_s`` seconds.
        UntrustedFileError: ``path`` is a symlink, not ours, not a regular file, or writable by others.
        OSError: the lock file cannot be opened.
    """
    bound = lock_timeout_s() if timeout_s is None else float(timeout_s)
    fd = _open_lock(path)
    try:
        deadline = time.monotonic() + bound
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno in _NO_LOCKS:
                    break  # no locks here: go on unlocked (callers publish atomically)
                raise
            if ready is not None:
                value = ready()
                if value is not None:
                    yield value
                    return
            if time.monotonic() >= deadline:
                raise DeepEPTimeoutError(
                    f"deepep_cupy: could not lock {path} within {bound:g} s: another process holds it "
                    f"(raise ${LOCK_TIMEOUT_ENV}, or end the process that holds the lock)"
                )
            time.sleep(min(_POLL_S, max(deadline - time.monotonic(), 0.0)))
        yield None
    finally:
        os.close(fd)  # releases the lock
