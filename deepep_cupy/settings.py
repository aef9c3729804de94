"""Reading the library's numeric environment variables: every setting is checked where it is read, and a
bad value is a ``ValueError`` naming the variable, never a silent default."""

from __future__ import annotations

import math
import os

__all__ = ["env_seconds", "values_enabled"]


def values_enabled() -> bool:
    """Whether to check index *values* (costs a device reduction and a sync on the GPU path).

    On by default; ``DEEPEP_CUPY_VALIDATE=0`` turns it off for production and benchmarks.
    """
    return os.environ.get("DEEPEP_CUPY_VALIDATE", "1") != "0"


def env_seconds(name: str, default: float, maximum: float = math.inf) -> float:
    """``$name`` as seconds: ``default`` when unset or empty, else a finite positive number of at most
    ``maximum`` seconds.

    Raises:
        ValueError: the variable holds anything else (``inf``, ``nan``, 0, a negative number, text).
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= maximum or not math.isfinite(seconds):  # the first test is false for NaN
        bound = "" if math.isinf(maximum) else f" (at most {maximum:g})"
        raise ValueError(f"{name} must be a finite positive number of seconds{bound}, got {text!r}")
    return seconds
