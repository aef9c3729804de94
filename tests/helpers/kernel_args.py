"""What the host-side argument tests share: a kernel's parameter list read from its CUDA source, and the
check that a plan's packed argument list names and types those parameters in order (the lists are written
by hand; a kernel signature change must show up on the CPU, not as garbage on a GPU)."""

import re
from pathlib import Path

import numpy as np
import pytest


def kernel_params(path: Path, kernel: str) -> list[tuple[str, str]]:
    """``(type, name)`` of every parameter of ``__global__ ... kernel(...)`` in ``path``, in order (line
    comments dropped first: they hold shapes with commas; ``__restrict__`` dropped from the types)."""
    text = re.sub(r"//[^\n]*", "", path.read_text())
    # The kernel's definition: its name followed by "(" after the last __global__ before it.
    match = re.search(r"__global__[^;{]*?\b" + re.escape(kernel) + r"\(", text, re.S)
    assert match is not None, f"no __global__ {kernel}( in {path}"
    depth, start = 1, match.end()
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            break
    out = []
    for p in text[start:i].split(","):
        p = re.sub(r"\s+", " ", p.replace("__restrict__", "")).strip()
        name = re.findall(r"[A-Za-z_]\w*$", p)[0]
        out.append((p[: -len(name)].strip(), name))
    return out


class FakeArray:
    """Stands in for a device array in argument lists."""


def check_packing(params, packed):
    """``packed`` (``(name, value)`` pairs) names ``params`` in order, each value of its C type: pointers
    as np.uint64 (or a FakeArray), ``int`` as np.int32, ``long long`` as np.int64."""
    assert [n for _, n in params] == [n for n, _ in packed]
    for (ctype, name), (_, value) in zip(params, packed, strict=True):
        if "*" in ctype:
            assert isinstance(value, (np.uint64, FakeArray)), (name, type(value))
        elif ctype == "int":
            assert isinstance(value, np.int32), (name, type(value))
        elif ctype == "long long":
            assert isinstance(value, np.int64), (name, type(value))
        else:
            pytest.fail(f"unexpected parameter type {ctype!r} for {name}")
