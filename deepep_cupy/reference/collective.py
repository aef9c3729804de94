"""The steps that keep the ranks of a reference-backend op in step when something goes wrong.

Every collective op of the reference backend (dispatch, combine and their low-latency versions) runs

1. :func:`start`: one small all-gather before any data moves. Each rank brings its op name, the values
   every rank must agree on (hidden size, expert count, dtype flags, ...), what its own checks found wrong
   (an exception, or None) and whatever the op needs to know about the others (token counts). Any rank's
   error is raised on every rank, naming that rank; a disagreement is a ``ValueError`` on every rank naming
   the argument and each rank's value. Nobody has sent data yet, so the next call starts clean.
2. the data exchange (``alltoall``);
3. :func:`finish`, for ops whose receivers can find a problem only in what arrived (a handle that names
   tokens the source does not have): a second small all-gather that raises any rank's finding everywhere.

So a bad argument on one rank gives every rank an error instead of leaving the others waiting in a
collective, and every collective of the group stays matched with the same collective on the other ranks.
The group's own deadline (``DEEPEP_CUPY_TIMEOUT_S``) covers a rank that never comes.
"""

from __future__ import annotations

from ..device.group import CommGroup, disagreement
from ..errors import DeepEPError

__all__ = ["allgather", "alltoall", "start", "finish", "is_agreed", "mark_agreed", "own_failure"]


def _named(group) -> bool:
    return isinstance(group, CommGroup)


def allgather(group, obj, op: str) -> list:
    """``group.allgather_object`` with the op named where the group takes a name (duck-typed test groups do not)."""
    return group.allgather_object(obj, op=op) if _named(group) else group.allgather_object(obj)


def alltoall(group, objs: list, op: str) -> list:
    return group.alltoall_object(objs, op=op) if _named(group) else group.alltoall_object(objs)


def mark_agreed(exc: BaseException) -> BaseException:
    """Mark an exception that every rank of the op raises (it needs no further exchange)."""
    exc.deepep_agreed = True
    return exc


def is_agreed(exc: BaseException) -> bool:
    return getattr(exc, "deepep_agreed", False)


def _describe(exc: BaseException | None):
    if exc is None:
        return None
    kind = type(exc).__name__ if isinstance(exc, (TypeError, ValueError)) else None
    text = str(exc) if kind else f"{type(exc).__name__}: {exc}"
    return kind, text


def _raise_failures(op: str, rows: list, local: BaseException | None, me: int) -> None:
    failures = [(r, row) for r, row in enumerate(rows) if row is not None]
    if not failures:
        return
    if local is not None:
        raise mark_agreed(local)
    (_, (kind, _)), shown = failures[0], failures[:4]
    text = "; ".join(f"rank {r}: {msg}" for r, (_, msg) in shown)
    if len(failures) > len(shown):
        text += f"; and {len(failures) - len(shown)} more ranks"
    cls = {"TypeError": TypeError, "ValueError": ValueError}.get(kind, DeepEPError)
    raise mark_agreed(cls(f"{op} failed on {'rank' if len(failures) == 1 else 'ranks'} "
                          f"{', '.join(str(r) for r, _ in failures)} (rank {me} raises it too): {text}"))


def start(group, op: str, *, fields: dict | None = None, error: BaseException | None = None, info=None) -> list:
    """The first exchange of ``op``: raise any rank's ``error`` and any disagreement on ``fields`` on every
    rank; otherwise return every rank's ``info`` (indexed by rank)."""
    row = (op, None if error is not None else (fields or {}), _describe(error), info)
    rows = allgather(group, row, f"{op} (arguments)")
    ops = [r[0] for r in rows]
    if any(o != op for o in ops):
        calls = ", ".join(f"rank {r}: {o}" for r, o in enumerate(ops))
        raise mark_agreed(ValueError(f"the ranks called different operations at the same point ({calls}); every "
                                     "rank must make the same calls in the same order"))
    _raise_failures(op, [r[2] for r in rows], error, group.rank)
    names = list(rows[0][1])
    for name in names:
        values = [r[1].get(name) for r in rows]
        if any(v != values[0] for v in values):
            raise mark_agreed(disagreement(op, name, values))
    return [r[3] for r in rows]


def finish(group, op: str, error: BaseException | None = None) -> None:
    """The last exchange of ``op``: raise on every rank what any rank found wrong in the data it received."""
    rows = allgather(group, _describe(error), f"{op} (result)")
    _raise_failures(op, rows, error, group.rank)


def own_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (raised on this rank before the op's first exchange) must be reported to the others:
    anything but an already agreed error and the group's own failures (a timeout: the others are not there)."""
    return not is_agreed(exc) and not isinstance(exc, DeepEPError)
