"""Checks that every rank passed equal values to an op, without waiting for any of them (:class:`Agreement`).

A rank starts one when it makes a plan for a new set of values, as a non-blocking all-gather on the group's
own communicator (:meth:`~deepep_cupy.device.group.CommGroup.start_allgather_ints`); the backend polls it on
later calls and raises the same ``ValueError`` on every rank if the ranks disagree.
"""

from __future__ import annotations

import time

from .group import CommGroup, disagreement

__all__ = ["Agreement"]


class Agreement:
    """Checks, without waiting, that every rank passed equal ``fields`` (name -> int or bool) to ``op``.

    Started when a rank makes a plan for a new set of values; :meth:`poll` looks at the gather and, once
    every rank has joined, raises the same ``ValueError`` on every rank if they disagree. Nothing waits
    for a rank that never joins (a dead or masked rank must not stop the others; the kernels' own
    timeouts handle it).
    """

    def __init__(self, group: CommGroup, op: str, fields: dict) -> None:
        self.op = op
        self.names = list(fields)
        self.request = group.start_allgather_ints([int(fields[n]) for n in self.names])

    def poll(self) -> bool:
        """True once complete (raising on disagreement); False while some rank has not joined."""
        rows = self.request.test()
        if rows is None:
            return False
        for i, name in enumerate(self.names):
            seen = [row[i] for row in rows]
            if any(v != seen[0] for v in seen):
                raise disagreement(self.op, name, seen)
        return True

    def wait(self, seconds: float) -> bool:
        """Poll for up to ``seconds`` (ranks making the same call normally join within microseconds)."""
        deadline = time.monotonic() + seconds
        while not self.poll():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0001)
        return True
