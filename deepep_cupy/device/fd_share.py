"""Passing file descriptors between the processes of a group (one host).

Two ways, tried in this order by :func:`exchange_fds`:

1. ``pidfd_open`` + ``pidfd_getfd`` (Linux >= 5.6): every rank publishes ``(pid, fd)`` through the group and
   duplicates its peers' descriptors straight out of their fd tables. Needs ptrace-attach permission
   over the peer (same user, and Yama ``ptrace_scope`` 0, or a capability); it fails with ``EPERM``
   otherwise.
2. A Unix-domain socket in the abstract namespace with ``SCM_RIGHTS``: every rank listens on a name
   derived from a random token that rank 0 draws and the group shares, serves its descriptor to each
   peer that connects (checking the peer's pid with ``SO_PEERCRED``), and connects to every peer to
   receive theirs.

All ranks take the same path: whether pidfd worked everywhere is agreed through the group first.
"""

from __future__ import annotations

import array
import ctypes
import errno
import os
import secrets
import socket
import struct
import threading

__all__ = ["FdShareError", "exchange_fds", "pidfd_getfd", "close_quietly"]

_SYS_PIDFD_OPEN = 434
_SYS_PIDFD_GETFD = 438
_SOCKET_TIMEOUT_S = 60.0


class FdShareError(OSError):
    """A descriptor could not be passed between two ranks."""


def close_quietly(fd: int | None) -> None:
    if fd is None or fd < 0:
        return
    try:
        os.close(fd)
    except OSError:
        pass


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def pidfd_getfd(pid: int, fd: int) -> int:
    """Duplicate descriptor ``fd`` of process ``pid`` into this process; raises ``OSError`` on failure."""
    pidfd = -1
    if hasattr(os, "pidfd_open"):
        pidfd = os.pidfd_open(pid)
    else:
        libc = _libc()
        pidfd = libc.syscall(ctypes.c_long(_SYS_PIDFD_OPEN), ctypes.c_int(pid), ctypes.c_uint(0))
        if pidfd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_open({pid}): {os.strerror(err)}")
    try:
        libc = _libc()
        got = libc.syscall(ctypes.c_long(_SYS_PIDFD_GETFD), ctypes.c_int(pidfd), ctypes.c_int(fd), ctypes.c_uint(0))
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd(pid={pid}, fd={fd}): {os.strerror(err)}")
        return int(got)
    finally:
        os.close(pidfd)


def _socket_name(token: str, rank: int) -> bytes:
    # Leading NUL: Linux abstract namespace, nothing on the file system to clean up.
    return b"\0deepep_cupy-fd-" + token.encode() + b"-" + str(rank).encode()


def _peer_pid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _, _ = struct.unpack("3i", creds)
    return pid


def _recv_fd(conn: socket.socket) -> tuple[bytes, list[int]]:
    """One message byte and the descriptors that came with it, close-on-exec from the start (a child this
    process starts must not inherit a peer's buffer). ``socket.recv_fds`` does not pass its flags on
    (CPython 3.11), hence ``recvmsg``."""
    item = array.array("i").itemsize
    msg, ancdata, _, _ = conn.recvmsg(1, socket.CMSG_SPACE(item), socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % item])
    return msg, list(fds)


def _exchange_by_socket(group, my_fd: int, pids: list[int]) -> list[int | None]:
    rank, size = group.rank, group.size
    token = group.allgather_object(secrets.token_hex(12) if rank == 0 else None)[0]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    received: list[int | None] = [None] * size
    server_error: list[BaseException] = []
    try:
        try:
            listener.bind(_socket_name(token, rank))
            listener.listen(max(size, 1))
            listener.settimeout(_SOCKET_TIMEOUT_S)
            failed = ""
        except OSError as exc:
            failed = f"rank {rank}: {exc}"
        # A rank whose socket failed still joins this exchange, so every rank learns it here and raises the
        # same error (rather than that rank leaving for the next exchange while the others wait in this one).
        bound = group.allgather_object(failed)
        if any(bound):
            raise FdShareError(errno.EADDRINUSE, "a rank could not open its descriptor socket ("
                               + "; ".join(b for b in bound if b) + ")")

        allowed = {pids[p] for p in range(size) if p != rank}

        def serve() -> None:
            try:
                served = 0
                while served < size - 1:
                    conn, _ = listener.accept()
                    with conn:
                        conn.settimeout(_SOCKET_TIMEOUT_S)
                        if _peer_pid(conn) not in allowed:
                            continue  # a stranger found the name: give it nothing
                        socket.send_fds(conn, [b"F"], [my_fd])
                        conn.recv(1)  # wait until the peer holds its copy
                        served += 1
            except BaseException as exc:  # surfaced by the main thread
                server_error.append(exc)

        server = threading.Thread(target=serve, name="deepep_cupy-fd-server", daemon=True)
        server.start()
        try:
            for step in range(1, size):
                peer = (rank + step) % size
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                    conn.settimeout(_SOCKET_TIMEOUT_S)
                    conn.connect(_socket_name(token, peer))
                    if _peer_pid(conn) != pids[peer]:
                        raise FdShareError(errno.EPERM, f"descriptor socket of rank {peer} is held by another process")
                    msg, fds = _recv_fd(conn)
                    if msg != b"F" or len(fds) != 1:
                        for fd in fds:
                            close_quietly(fd)
                        raise FdShareError(errno.EPROTO, f"rank {peer} sent no descriptor")
                    received[peer] = fds[0]
                    conn.sendall(b"A")
        finally:
            server.join(_SOCKET_TIMEOUT_S)
        if server_error:
            raise FdShareError(errno.EPROTO, f"serving the descriptor failed: {server_error[0]!r}")
        if server.is_alive():
            raise FdShareError(errno.ETIMEDOUT, "peers did not collect the descriptor in time")
        return received
    except BaseException:
        for fd in received:
            close_quietly(fd)
        raise
    finally:
        listener.close()


def exchange_fds(group, my_fd: int, method: str = "auto") -> list[int | None]:
    """Collective: return a descriptor in this process for every peer's ``my_fd`` (None at own rank).

    ``method`` is ``"auto"`` (pidfd_getfd, then the socket fallback) or ``"socket"`` (skip pidfd; used by
    tests). The caller owns (and must close) the returned descriptors. Raises :class:`FdShareError` on
    every rank when any rank could not get its peers' descriptors.
    """
    if method not in ("auto", "socket"):
        raise ValueError(f"method must be 'auto' or 'socket', got {method!r}")
    rank, size = group.rank, group.size
    infos = group.allgather_object((os.getpid(), int(my_fd)))
    pids = [int(p) for p, _ in infos]
    got: list[int | None] = [None] * size
    failure = "" if method == "auto" else "pidfd skipped"
    try:
        for peer in range(size):
            if peer != rank and method == "auto":
                got[peer] = pidfd_getfd(pids[peer], int(infos[peer][1]))
    except OSError as exc:
        failure = str(exc)
        for fd in got:
            close_quietly(fd)
        got = [None] * size
    failures = group.allgather_object(failure)
    if not any(failures):
        return got
    for fd in got:
        close_quietly(fd)
    try:
        result = _exchange_by_socket(group, my_fd, pids)
        error = ""
    except BaseException as exc:
        result, error = None, repr(exc)
    errors = group.allgather_object(error)
    if any(errors):
        for fd in result or []:
            close_quietly(fd)
        first = next(e for e in errors if e)
        raise FdShareError(errno.EPROTO, f"could not share descriptors between ranks: pidfd_getfd failed "
                           f"({next(f for f in failures if f)}) and the socket fallback failed ({first})")
    return result
