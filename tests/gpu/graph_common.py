"""What the torch CUDA-graph test files share: the skip marks, the capture recipe, poisoning and checks.

How each graph is made and used, as DeepEP users do it:
  * one eager call of the same shapes first, on a side stream (torch's warm-up recipe), then the capture
    with ``torch.cuda.graph(g)`` in its default mode (torch captures on its own side stream); a capture
    that fails fails the test on every rank (callers wrap it in ``together``);
  * before every replay, fresh inputs are copied (``.copy_()``) into the captured input tensors and the
    outputs are poisoned (NaN / all-ones bits / 0x5A5A5A5A), so that anything a replay fails to write shows.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from gpu_common import MULTI_RANK_GPU, bits, check, to_dev, torch_cuda

#: The marks of a graph test: GPUs, two or more MPI ranks, torch with CUDA (never skipped where it has CUDA).
GRAPH_MARKS = [*MULTI_RANK_GPU, pytest.mark.skipif(not torch_cuda(), reason="needs torch with CUDA")]
REPLAYS = 10


def to_torch(arr, env):
    return to_dev(arr, "torch", env)


def seeded(name: str, rank: int):
    return np.random.default_rng([zlib.crc32(name.encode()), rank])


def poison(*tensors) -> None:
    """Overwrite outputs a replay must rewrite with values no result has."""
    import torch

    for t in tensors:
        if t is None:
            continue
        if t.dtype == torch.bool:
            t.fill_(True)
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(0x5A5A5A5A)
        elif t.dtype == torch.float32:
            t.fill_(float("nan"))
        elif t.element_size() == 2:
            t.view(torch.int16).fill_(-1)  # bf16 0xFFFF: NaN
        else:
            t.view(torch.uint8).fill_(0xFF)  # e4m3 0xFF: NaN


def warm_up(fn) -> None:
    """One eager call on a side stream, as torch's capture recipe does before a capture."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture(phases):
    """Each phase captured into a graph of its own with ``torch.cuda.graph`` in its default mode."""
    import torch

    graphs = []
    for phase in phases:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            phase()
        graphs.append(g)
    return graphs


def replay_all(graphs) -> None:
    import torch

    for g in graphs:
        g.replay()
    torch.cuda.synchronize()


def same(failures, what, got, want) -> None:
    check(failures, what, lambda: np.testing.assert_array_equal(bits(got), bits(want)))


def call(failures, what, fn, *args, **kwargs) -> None:
    """``fn(*args, **kwargs)``, an AssertionError recorded in ``failures``."""
    check(failures, what, lambda: fn(*args, **kwargs))
