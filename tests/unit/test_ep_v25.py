"""DeepEP 2.5's ``tests/ep/test_ep.py`` calls, in its order, on ``deepep_cupy.EPBuffer``: deferred epilogues (its
default) and not, the handle keeping the caller's ``topk_idx``; checked as in ``test_ep_v21.py``."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ep_v2_calls as C  # noqa: E402
import ep_v2_ref as R  # noqa: E402
from thread_group import run_ranks  # noqa: E402

import deepep_cupy  # noqa: E402

T, H, E, K = 12, 256, 8, 4


def _run(size, modes, *, defer, do_cpu_sync=True, seed=0):
    def rank(g):
        buffer = C.new_buffer(deepep_cupy.EPBuffer, g, num_tokens=T, hidden=H, backend="reference")
        try:
            for i, mode in enumerate(modes):
                C.run_mode(buffer, g, mode, seed=seed + i, num_tokens=T, hidden=H, num_experts=E * max(size // 2, 1),
                           num_topk=K, version="2.5", defer=defer, do_cpu_sync=do_cpu_sync)
        finally:
            buffer.destroy()
        return True

    assert all(run_ranks(size, rank, timeout=300))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_deferred_modes(size):
    """2.5's default enumeration (``--defer-epilogue 1``): 36 modes, every one asynchronous and deferred."""
    modes = list(C.modes("2.5", defer=True))
    assert len(modes) == 36
    _run(size, modes if size == 2 else modes[::3], defer=True, seed=size)


@pytest.mark.parametrize("size", [2, 4])
def test_modes_without_deferral(size):
    modes = list(C.modes("2.5", defer=False))
    assert len(modes) == 72
    _run(size, modes if size == 2 else modes[::4], defer=False, seed=10 + size)


def test_deferred_without_cpu_sync():
    _run(2, list(C.modes("2.5", defer=True))[::4], defer=True, do_cpu_sync=False, seed=40)


def test_deferred_results_come_once_and_bias_is_read_at_the_wait():
    """The wait returns the results once (a second wait returns None); a deferred combine reads the bias
    when waited on, so a bias written after the call counts."""
    def rank(g):
        buffer = C.new_buffer(deepep_cupy.EPBuffer, g, num_tokens=T, hidden=H, backend="reference")
        inp = R.rank_inputs(7, g.rank, num_tokens=T, hidden=H, num_experts=E, num_topk=K, num_bias=1)
        ev = buffer.dispatch(C.t(inp.x), topk_idx=C.t(inp.topk_idx), num_experts=E, async_with_compute_stream=True,
                             defer_epilogue=True)
        assert isinstance(ev, deepep_cupy.ep.EventOverlap)
        recv_x, _, recv_w, handle = ev.current_stream_wait()
        assert recv_w is None and ev.wait() is None
        x = recv_x.clone()
        bias = torch.zeros_like(C.t(inp.bias[0]))
        ev = buffer.combine(x, handle, bias=bias, async_with_compute_stream=True, defer_epilogue=True)
        bias.copy_(C.t(inp.bias[0]))
        combined, weights = ev.wait()
        plain, _, _ = buffer.combine(x, handle, bias=C.t(inp.bias[0]))
        assert weights is None and torch.equal(combined.view(torch.int16), plain.view(torch.int16))
        buffer.destroy()
        return True

    assert all(run_ranks(2, rank))


def test_handle_guards_topk_idx():
    """Reading ``handle.topk_idx`` after the caller modified that tensor in place raises."""
    def rank(g):
        buffer = C.new_buffer(deepep_cupy.EPBuffer, g, num_tokens=T, hidden=H, backend="reference")
        inp = R.rank_inputs(8, g.rank, num_tokens=T, hidden=H, num_experts=E, num_topk=K)
        topk_idx = C.t(inp.topk_idx)
        handle = buffer.dispatch(C.t(inp.x), topk_idx=topk_idx, num_experts=E)[3]
        assert handle.topk_idx is topk_idx
        topk_idx[0, 0] = -1
        with pytest.raises(RuntimeError, match="topk_idx"):
            handle.topk_idx  # noqa: B018
        buffer.destroy()
        return True

    assert all(run_ranks(2, rank))


def test_numpy_inputs():
    """NumPy arrays go through the same path: outputs are NumPy, the combine is V2's bit for bit."""
    def rank(g):
        buffer = deepep_cupy.EPBuffer(g, num_max_tokens_per_rank=T, hidden=H, backend="reference")
        inputs = [R.rank_inputs(9, r, num_tokens=T, hidden=H, num_experts=E, num_topk=K, num_bias=2)
                  for r in range(g.size)]
        mine = inputs[g.rank]
        recv_x, recv_topk_idx, recv_w, handle, _ = buffer.dispatch(mine.x, topk_idx=mine.topk_idx,
                                                                   topk_weights=mine.topk_weights, num_experts=E,
                                                                   do_expand=True, expert_alignment=4)
        assert isinstance(recv_x, np.ndarray) and recv_topk_idx is None and recv_w.ndim == 1
        rows = handle.recv_src_metadata[:, 2:]
        y = R.expert_outputs(handle.recv_src_metadata[:, 0].astype(np.int64), K, H, 9)
        x = np.zeros((handle.num_expanded_tokens, H), dtype=R.BF16)
        x[rows[rows >= 0]] = y[rows >= 0]
        combined, weights, _ = buffer.combine(x, handle, topk_weights=recv_w, bias=mine.bias)
        y_src = R.expert_outputs(g.rank * T + np.arange(len(mine.x)), K, H, 9)
        want = R.combined(y_src, mine.topk_idx, E // g.size, mine.bias, reduce_per_rank=True)
        assert np.array_equal(combined.view(np.uint16), want.view(np.uint16))
        assert np.array_equal(weights, mine.topk_weights)
        return True

    assert all(run_ranks(2, rank))
