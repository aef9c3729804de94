"""Exceptions raised by deepep_cupy.

Argument problems raise the built-in ``ValueError`` / ``TypeError`` before any kernel runs; failures of
the communication itself raise the types below.
"""

__all__ = ["DeepEPError", "DeepEPTimeoutError"]


class DeepEPError(RuntimeError):
    """A communication operation failed (driver error, peer setup, backend unavailable)."""


class DeepEPTimeoutError(DeepEPError):
    """A wait inside a kernel or on the host ran past its budget; the message names op, rank and peer."""
