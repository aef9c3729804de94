"""The public API surface: names, Config and size hints, argument validation, framework round trips.

Multi-rank cases run as threads (``thread_group``) on the reference backend."""

import ml_dtypes
import numpy as np
import pytest
from thread_group import run_ranks

import deepep_cupy as deep_ep
from deepep_cupy import Buffer, Config

BF16, FP8 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn


def test_exports_match_deepep():
    for name in ("Buffer", "Config", "EventOverlap", "topk_idx_t"):
        assert hasattr(deep_ep, name)
    for name in ("set_num_sms", "get_dispatch_config", "get_combine_config", "get_low_latency_rdma_size_hint",
                 "capture", "is_sm90_compiled", "get_comm_stream", "get_local_buffer_tensor", "get_dispatch_layout",
                 "dispatch", "combine", "internode_dispatch", "internode_combine", "clean_low_latency_buffer",
                 "low_latency_dispatch", "low_latency_combine", "low_latency_update_mask_buffer",
                 "low_latency_query_mask_buffer", "low_latency_clean_mask_buffer",
                 "get_next_low_latency_combine_buffer", "destroy"):
        assert callable(getattr(Buffer, name)), name


def _nvl_hint_by_hand(num_sms, recv_tokens, hidden_bytes, num_ranks):
    # Written out term by term: control ints, then per ring slot: data, source meta (8 B),
    # 128 int64 top-k ids, 128 float weights, 128 float scales.
    channels, nvl, rdma = num_sms // 2, min(num_ranks, 8), max(num_ranks // 8, 1)
    slots = channels * nvl * recv_tokens
    total = channels * nvl * (2 * rdma + 3) * 4 + slots * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4)
    return -(-total // 128) * 128


@pytest.mark.parametrize("num_sms,recv,hidden,ranks", [(20, 256, 7168 * 2, 8), (24, 256, 4096 * 2, 2),
                                                      (20, 288, 7168 * 2, 16), (16, 128, 2048, 4)])
def test_nvl_size_hint(num_sms, recv, hidden, ranks):
    cfg = Config(num_sms, 6, recv, 6, 128)
    assert cfg.get_nvl_buffer_size_hint(hidden, ranks) == _nvl_hint_by_hand(num_sms, recv, hidden, ranks)


def test_rdma_size_hint_zero_within_a_node_and_positive_across():
    cfg = Config(20, 6, 256, 6, 128)
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 16) > 0


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="num_sms"):
        Config(0)
    with pytest.raises(ValueError, match="num_max_nvl_chunked_send_tokens"):
        Config(20, 256, 256)


def test_recommended_configs_and_num_sms():
    old = Buffer.num_sms
    try:
        Buffer.set_num_sms(24)
        cfg = Buffer.get_dispatch_config(2)
        assert (cfg.num_sms, cfg.num_max_nvl_chunked_recv_tokens) == (24, 256)
        assert Buffer.get_combine_config(8).num_max_nvl_chunked_send_tokens == 1
        assert Buffer.get_combine_config(16).num_max_nvl_chunked_send_tokens == 4
        assert Buffer.get_dispatch_config(6).num_sms == 24  # any rank count gets a config
        with pytest.raises(ValueError, match="even"):
            Buffer.set_num_sms(7)
    finally:
        Buffer.num_sms = old


def test_buffer_needs_a_group():
    with pytest.raises(ValueError, match="group"):
        Buffer()
    with pytest.raises(TypeError, match="comm"):
        Buffer(comm=object())


def _single(fn, **kw):
    return run_ranks(1, lambda g: fn(Buffer(comm=g, backend="reference", **kw)))[0]


def routing(rng, n, k, num_experts):
    return np.stack([rng.choice(num_experts, k, replace=False) for _ in range(n)]).astype(np.int64) \
        if n else np.zeros((0, k), np.int64)


def test_layout_validation_names_the_argument():
    def body(buf):
        with pytest.raises(TypeError, match="topk_idx"):
            buf.get_dispatch_layout(np.zeros((4, 2), np.int32), 8)
        with pytest.raises(ValueError, match="topk_idx"):
            buf.get_dispatch_layout(np.full((4, 2), 8, np.int64), 8)
        with pytest.raises(ValueError, match="topk_idx"):
            buf.get_dispatch_layout(np.full((4, 2), -2, np.int64), 8)
        with pytest.raises(ValueError, match="num_experts"):
            buf.get_dispatch_layout(np.zeros((4, 2), np.int64), 0)
        with pytest.raises(ValueError, match="topk_idx"):
            buf.get_dispatch_layout(np.zeros((4,), np.int64), 8)
    _single(body)


def test_dispatch_validation():
    def body(buf):
        rng = np.random.default_rng(0)
        idx = routing(rng, 6, 2, 8)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 8)
        x = rng.standard_normal((6, 64)).astype(BF16)
        kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        with pytest.raises(TypeError, match="x"):
            buf.dispatch(x.astype(np.float32), **kw)
        with pytest.raises(ValueError, match="multiple of 8"):
            buf.dispatch(rng.standard_normal((6, 60)).astype(BF16), **kw)
        with pytest.raises(ValueError, match="multiple of 128"):
            buf.dispatch((np.zeros((6, 64), FP8), np.ones((6, 0), np.float32)), **kw)
        with pytest.raises(ValueError, match=r"x\[1\]"):
            buf.dispatch((np.zeros((6, 128), FP8), np.ones((6, 2), np.float32)), **kw)
        with pytest.raises(ValueError, match="is_token_in_rank"):
            buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank[:3],
                         num_tokens_per_expert=per_expert)
        with pytest.raises(ValueError, match="together"):
            buf.dispatch(x, topk_idx=idx, **kw)
        with pytest.raises(ValueError, match="expert_alignment"):
            buf.dispatch(x, expert_alignment=0, **kw)
    _single(body)


def test_low_latency_validation():
    def body(buf):
        x = np.ones((5, 256), BF16)
        idx = np.zeros((5, 2), np.int64)
        with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
            buf.low_latency_dispatch(x, idx, 4, 8)
        with pytest.raises(ValueError, match="round_scale"):
            buf.low_latency_dispatch(x, idx, 8, 8, use_ue8m0=True)
        with pytest.raises(ValueError, match="multiple of 128"):
            buf.low_latency_dispatch(np.ones((5, 200), BF16), idx, 8, 8)
        with pytest.raises(ValueError, match="cumulative_local_expert_recv_stats"):
            buf.low_latency_dispatch(x, idx, 8, 8, cumulative_local_expert_recv_stats=np.zeros(3, np.int32))
    _single(body, low_latency_mode=True, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(8, 256, 1, 8))


def test_low_latency_needs_the_mode():
    def body(buf):
        with pytest.raises(RuntimeError, match="low_latency_mode"):
            buf.low_latency_dispatch(np.ones((1, 128), BF16), np.zeros((1, 1), np.int64), 4, 8)
    _single(body)


@pytest.mark.parametrize("num_ranks", [1, 2, 3])
def test_round_trip_leaves_inputs_untouched(num_ranks):
    hidden, num_experts, k = 128, 4 * num_ranks, 2

    def body(group):
        rng = np.random.default_rng(10 + group.rank)
        n = 7 + group.rank
        idx = routing(rng, n, k, num_experts)
        idx[0, 1] = -1
        x = rng.integers(-8, 8, size=(n, hidden)).astype(BF16)
        w = rng.random((n, k)).astype(np.float32)
        keep = (x.copy(), idx.copy(), w.copy())
        nvl_bytes = Buffer.get_dispatch_config(num_ranks).get_nvl_buffer_size_hint(hidden * 2, num_ranks)
        buf = Buffer(comm=group, backend="reference", num_nvl_bytes=nvl_bytes)
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
        assert per_rdma is None
        recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w)
        event.current_stream_wait()
        assert recv_x.dtype == BF16 and recv_idx.dtype == np.int64 and recv_w.dtype == np.float32
        assert isinstance(counts, list) and len(counts) == num_experts // num_ranks
        combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        visits = in_rank.sum(axis=1).astype(np.float32)
        np.testing.assert_array_equal(combined.astype(np.float32), x.astype(np.float32) * visits[:, None])
        for a, b in zip(keep, (x, idx, w), strict=True):
            np.testing.assert_array_equal(a, b)
        return True

    assert all(run_ranks(num_ranks, body))


def test_torch_tensors_come_back_as_torch():
    torch = pytest.importorskip("torch")

    def body(group):
        buf = Buffer(comm=group, backend="reference", num_nvl_bytes=Config().get_nvl_buffer_size_hint(128, 2))
        gen = torch.Generator().manual_seed(3 + group.rank)
        idx = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(5)])
        x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 8)
        assert isinstance(per_rank, torch.Tensor) and per_rank.dtype == torch.int32
        assert in_rank.dtype == torch.bool
        recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert)
        assert recv_x.dtype == torch.bfloat16
        combined, _, _ = buf.combine(recv_x, handle)
        visits = in_rank.sum(dim=1, keepdim=True).float()
        assert torch.equal(combined.float(), (x.float() * visits).to(torch.bfloat16).float())
        return True

    assert all(run_ranks(2, body))


def test_interop_keeps_column_major_layout():
    torch = pytest.importorskip("torch")
    from deepep_cupy.frameworks import TensorKind, from_numpy, to_numpy

    base = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    colmajor = base.transpose(0, 2, 1)
    t = from_numpy(colmajor, TensorKind("torch", None))
    assert tuple(t.shape) == colmajor.shape and t.stride() == (12, 1, 4)
    np.testing.assert_array_equal(to_numpy(t), colmajor)
    b = from_numpy(np.arange(6, dtype=np.float32).astype(BF16), TensorKind("torch", None))
    assert b.dtype == torch.bfloat16 and to_numpy(b).dtype == BF16


def test_cached_dispatch_returns_the_handles_rows():
    """With the handle of a num_worst_tokens dispatch a cached dispatch returns that many rows, as the
    kernels do: the received ones first, zeros after them on this backend (the GPU leaves them unwritten)."""
    from deepep_cupy.ops.handles import cached_rows

    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 128)).astype(BF16)
    topk = routing(rng, 8, 2, 4)
    worst = 24

    def run(b):
        per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(topk, 4)
        recv, _, _, _, handle, _ = b.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert, topk_idx=topk,
                                              topk_weights=rng.random((8, 2)).astype(np.float32),
                                              num_worst_tokens=worst)
        return recv, handle, b.dispatch(x, handle=handle)[0]

    recv, handle, again = _single(run, num_nvl_bytes=Config().get_nvl_buffer_size_hint(256, 1))
    assert recv.shape[0] == worst == cached_rows(handle) and again.shape == (worst, 128)
    np.testing.assert_array_equal(again[:8].astype(np.float32), x.astype(np.float32))
    assert not again[8:].astype(np.float32).any()
