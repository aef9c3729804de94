"""DeepEP 2.1's ``tests/elastic/test_ep.py`` calls, in its order, on ``deepep_cupy.ElasticBuffer`` (thread ranks,
torch CPU tensors, the reference backend), checked against an independent NumPy statement of V2's semantics
(``tests/helpers/ep_v2_ref.py``; the call sequence is ``tests/helpers/ep_v2_calls.py``)."""

import pytest

torch = pytest.importorskip("torch")

import ep_v2_calls as C  # noqa: E402
from thread_group import run_ranks  # noqa: E402

import deepep_cupy  # noqa: E402

T, H, E, K = 12, 256, 8, 4
MODES = list(C.modes("2.1"))


def _run(size, modes, *, num_topk=K, num_experts=None, do_cpu_sync=True, seed=0, check=None, **buffer_kw):
    def rank(g):
        buffer = C.new_buffer(deepep_cupy.ElasticBuffer, g, num_tokens=T, hidden=H, backend="reference",
                              **buffer_kw)
        try:
            for i, mode in enumerate(modes):
                C.run_mode(buffer, g, mode, seed=seed + i, num_tokens=T, hidden=H, num_experts=num_experts or E * max(size // 2, 1),
                           num_topk=num_topk, version="2.1", do_cpu_sync=do_cpu_sync)
            if check is not None:
                check(buffer)
        finally:
            buffer.destroy()
        return True

    assert all(run_ranks(size, rank, timeout=300))


def test_all_modes_two_ranks():
    """Every one of 2.1's 144 modes: handle copy, alignment 128/1, FP8/BF16, 0-2 biases, the event triples."""
    assert len(MODES) == 144
    _run(2, MODES)


@pytest.mark.parametrize("size", [1, 4])
def test_modes_one_and_four_ranks(size):
    _run(size, MODES[::5], seed=100)


@pytest.mark.parametrize("size", [2, 4])
def test_without_cpu_sync(size):
    """``do_cpu_sync=False``: outputs at their bounds, the valid extent told by the handle's prefix sums."""
    _run(size, MODES[::7], do_cpu_sync=False, seed=200)


@pytest.mark.parametrize("size", [2, 4])
def test_without_multiple_reduction(size):
    """``allow_multiple_reduction=False``: the expanded combine adds each (token, expert) row on its own."""
    _run(size, MODES[::9], allow_multiple_reduction=False, seed=300)


def test_wide_topk_takes_several_combines():
    """Top-10 on a buffer sized for 8 slots per combine: V1's combine runs twice, the sum stays V2's."""
    _run(2, MODES[::11], num_topk=10, num_experts=16, seed=400,
         check=lambda buffer: buffer._slots == {(H, 10): 8})
