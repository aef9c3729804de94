"""SGLang's and vLLM's calls (``fw_serving.py``) on thread ranks with torch CPU tensors, through ``import deep_ep``.

The same scenarios run under mpiexec on gloo groups (tests/mpi/test_frameworks_mpi.py) and on GPUs
(tests/gpu/test_frameworks.py).
"""

import pytest

torch = pytest.importorskip("torch")

import fw_serving as S  # noqa: E402
from fw_common import deep_ep_alias  # noqa: E402
from thread_group import run_ranks  # noqa: E402

H_NORMAL, H_LL, E, K, T = 256, 512, 16, 4, 32


@pytest.fixture
def deep_ep():
    with deep_ep_alias() as module:
        yield module


def _inputs(g, seed, hidden, **kw):
    return S.Inputs(g, seed, hidden=hidden, num_experts=E, topk=K, **kw)


# ------------------------------------------------------------------------------------------- SGLang
def test_sglang_imports(deep_ep):
    from deep_ep import Buffer, Config

    assert Buffer is deep_ep.Buffer and Config is deep_ep.Config


@pytest.mark.parametrize("param_bytes", [1, 2])
@pytest.mark.parametrize("mode", [S.NORMAL, S.LOW_LATENCY, S.AUTO])
def test_sglang_buffer_sizing(deep_ep, mode, param_bytes):
    """SGLang's sizes are what the Buffer gets: ``num_nvl_bytes`` the larger of the recommended dispatch and
    combine configs' NVLink hints for rows of ``hidden * param_bytes`` bytes (normal and auto modes, else 0),
    ``num_rdma_bytes`` the low-latency hint (low-latency and auto modes; the configs' RDMA hint is 0 on one
    NVLink domain). They suffice: a normal round at that hidden size (FP8 rows where sized for one byte)
    and a low-latency round of T tokens on every rank go through. Below them the ops refuse with a
    ValueError naming the size: a normal dispatch with a 4 KiB NVLink buffer (naming SGLang's hint, and a
    need no larger than it), a low-latency dispatch with one byte less than the hint (which it names as the
    need); a part SGLang sized 0 refuses its ops."""
    import re

    Buffer = deep_ep.Buffer
    normal, low_latency = mode in (S.NORMAL, S.AUTO), mode in (S.LOW_LATENCY, S.AUTO)
    fp8 = param_bytes == 1

    def rank(g):
        dispatch_config, combine_config = Buffer.get_dispatch_config(g.size), Buffer.get_combine_config(g.size)
        hints = [c.get_nvl_buffer_size_hint(H_LL * param_bytes, g.size) for c in (dispatch_config, combine_config)]
        nvl_hint, ll_hint = max(hints), Buffer.get_low_latency_rdma_size_hint(T, H_LL, g.size, E)
        assert nvl_hint > 0 and ll_hint > 0
        assert [c.get_rdma_buffer_size_hint(H_LL * param_bytes, g.size) for c in (dispatch_config, combine_config)] \
            == [0, 0]
        buffer = S.sglang_buffer(deep_ep, g, mode, hidden=H_LL, num_experts=E, param_bytes=param_bytes,
                                 num_max_dispatch_tokens_per_rank=T)
        assert (buffer.num_nvl_bytes, buffer.num_rdma_bytes) == (nvl_hint if normal else 0,
                                                                 ll_hint if low_latency else 0)
        if normal:
            S.sglang_normal_round(deep_ep, buffer, _inputs(g, 1, H_LL), "cpu", fp8=fp8)
            if low_latency:
                buffer.clean_low_latency_buffer(T, H_LL, E)
        else:
            with pytest.raises(RuntimeError, match="num_nvl_bytes > 0"):
                S.sglang_normal_round(deep_ep, buffer, _inputs(g, 1, H_LL), "cpu", fp8=fp8)
        full = _inputs(g, 2, H_LL, n=lambda r: T)
        if low_latency:
            S.sglang_low_latency_round(deep_ep, buffer, full, "cpu", num_max_dispatch_tokens_per_rank=T)
        else:
            with pytest.raises(RuntimeError, match="low_latency_mode=True"):
                S.sglang_low_latency_round(deep_ep, buffer, full, "cpu", num_max_dispatch_tokens_per_rank=T)
        if normal:
            small = Buffer(g, 4096, buffer.num_rdma_bytes, low_latency_mode=low_latency)
            with pytest.raises(ValueError, match=re.escape(
                    f"num_nvl_bytes=4096 (Config.get_nvl_buffer_size_hint gives {hints[0]})")) as refused:
                S.sglang_normal_round(deep_ep, small, _inputs(g, 1, H_LL), "cpu", fp8=fp8)
            need = int(re.search(r"dispatch needs (\d+) bytes", str(refused.value)).group(1))
            assert 4096 < need <= nvl_hint, f"need {need}, SGLang's size {nvl_hint}"
        if low_latency:
            small = Buffer(g, buffer.num_nvl_bytes, ll_hint - 1, low_latency_mode=True)
            with pytest.raises(ValueError, match=re.escape(f"num_rdma_bytes={ll_hint - 1} is too small")
                               + f".* need {ll_hint} "):
                S.sglang_low_latency_round(deep_ep, small, full, "cpu", num_max_dispatch_tokens_per_rank=T)

    run_ranks(2, rank)


@pytest.mark.parametrize("size,fp8,column_major,alignment,json_config", [
    (2, False, False, 1, False), (4, False, False, 128, True), (2, True, False, 1, True), (4, True, True, 128, False)])
def test_sglang_normal(deep_ep, size, fp8, column_major, alignment, json_config):
    config = deep_ep.Config(**{"num_sms": 24, "num_max_nvl_chunked_send_tokens": 8,
                               "num_max_nvl_chunked_recv_tokens": 256, "num_max_rdma_chunked_send_tokens": 6,
                               "num_max_rdma_chunked_recv_tokens": 128}) if json_config else None

    def rank(g):
        buffer = S.sglang_buffer(deep_ep, g, S.NORMAL, hidden=H_NORMAL, num_experts=E, param_bytes=1 if fp8 else 2)
        for seed in (1, 2):  # the second round reuses the plans of the first
            S.sglang_normal_round(deep_ep, buffer, _inputs(g, seed, H_NORMAL, skip_experts=range(E - E // size, E)
                                                           if seed == 2 else ()), "cpu", fp8=fp8,
                                  column_major=column_major, alignment=alignment, config=config)

    run_ranks(size, rank)


def test_sglang_normal_ue8m0_packed_scales(deep_ep):
    """SGLang's DeepGEMM UE8M0 path: FP8 tokens with their scales' exponents packed four to an int32 word,
    column-major ``[N, H/512]``; the received words are bit for bit the sent ones, in the received rows'
    order, and stay int32."""
    import numpy as np
    import torch
    from fw_common import expected_rows

    def rank(g):
        buffer = S.sglang_buffer(deep_ep, g, S.NORMAL, hidden=H_LL, num_experts=E, param_bytes=1)
        inp = _inputs(g, 3, H_LL)
        words = [np.random.default_rng(1000 + r).integers(-2**31, 2**31, (len(x), H_LL // 512)).astype(np.int32)
                 for r, x in enumerate(inp.all_x)]
        x = S.fp8_pair(inp.x, "cpu")[0]
        packed = torch.from_numpy(words[inp.me]).t().contiguous().t()
        layout = buffer.get_dispatch_layout(S.tensor(inp.idx, "cpu"), E)
        recv = buffer.dispatch((x, packed), topk_idx=S.tensor(inp.idx, "cpu"), topk_weights=S.tensor(inp.w, "cpu"),
                               num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1],
                               is_token_in_rank=layout[3], num_tokens_per_expert=layout[2], expert_alignment=128)[0]
        assert recv[1].dtype == torch.int32
        want = expected_rows(words, inp.all_idx, inp.me, inp.num_local).reshape(-1, H_LL // 512)
        np.testing.assert_array_equal(recv[1].numpy(), want, err_msg="received packed scales")

    run_ranks(2, rank)


@pytest.mark.parametrize("size,hook,fp8,round_scale,use_ue8m0,zero_copy", [
    (2, True, False, False, False, False), (2, False, True, False, False, True), (4, True, True, True, False, False),
    (4, False, True, True, True, False), (2, True, True, True, True, True)])
def test_sglang_low_latency(deep_ep, size, hook, fp8, round_scale, use_ue8m0, zero_copy):
    def rank(g):
        buffer = S.sglang_buffer(deep_ep, g, S.LOW_LATENCY, hidden=H_LL, num_experts=E,
                                 num_max_dispatch_tokens_per_rank=T)
        for seed in (1, 2):
            S.sglang_low_latency_round(deep_ep, buffer, _inputs(g, seed, H_LL), "cpu",
                                       num_max_dispatch_tokens_per_rank=T, hook=hook, fp8=fp8,
                                       round_scale=round_scale, use_ue8m0=use_ue8m0, zero_copy=zero_copy)

    run_ranks(size, rank)


@pytest.mark.parametrize("size", [2, 4])
def test_sglang_auto_mode_switch(deep_ep, size):
    """AUTO: prefill batches take the normal kernels, decode batches the low-latency ones, with
    ``clean_low_latency_buffer`` when switching from normal to low latency."""
    def rank(g):
        buffer = S.sglang_buffer(deep_ep, g, S.AUTO, hidden=H_LL, num_experts=E, num_max_dispatch_tokens_per_rank=T)
        for seed in (1, 2):
            S.sglang_normal_round(deep_ep, buffer, _inputs(g, seed, H_LL), "cpu")
            buffer.clean_low_latency_buffer(T, H_LL, E)
            S.sglang_low_latency_round(deep_ep, buffer, _inputs(g, seed + 10, H_LL), "cpu",
                                       num_max_dispatch_tokens_per_rank=T)

    run_ranks(size, rank)


@pytest.mark.parametrize("size", [2, 4])
def test_sglang_two_batch_overlap(deep_ep, size):
    def rank(g):
        buffer = S.sglang_buffer(deep_ep, g, S.LOW_LATENCY, hidden=H_LL, num_experts=E,
                                 num_max_dispatch_tokens_per_rank=T)
        S.sglang_two_batch_overlap(deep_ep, buffer, _inputs(g, 1, H_LL), _inputs(g, 2, H_LL), "cpu",
                                   num_max_dispatch_tokens_per_rank=T)

    run_ranks(size, rank)


# ------------------------------------------------------------------------------------------- vLLM
def test_vllm_imports(deep_ep):
    import importlib.util

    import deep_ep as module

    # vLLM finds the module and takes V1's names; V2's stand beside them (frameworks that look for
    # ElasticBuffer take their V2 path).
    assert importlib.util.find_spec("deep_ep") is not None
    assert module.Buffer is deep_ep.Buffer and hasattr(module, "ElasticBuffer") and hasattr(module, "EPBuffer")

    def annotated(x) -> module.Config | None:  # vLLM's annotations are evaluated when the function is made
        return None

    assert module.EventOverlap is deep_ep.EventOverlap and annotated(None) is None


@pytest.mark.parametrize("size,do_async,dbo,fp8", [(2, True, False, False), (4, False, False, True),
                                                   (2, True, True, False), (4, True, True, True)])
def test_vllm_high_throughput(deep_ep, size, do_async, dbo, fp8):
    def rank(g):
        buffer = S.vllm_ht_buffer(deep_ep, g)
        # The second round leaves the last rank without tokens to receive.
        for seed, skip in ((1, ()), (2, range(E - E // size, E))):
            S.vllm_ht_round(deep_ep, buffer, _inputs(g, seed, H_NORMAL, skip_experts=skip), "cpu",
                            do_async=do_async, dbo=dbo, fp8=fp8)
        buffer.destroy()
        with pytest.raises(RuntimeError, match="destroyed"):
            buffer.get_dispatch_layout(topk_idx=S.tensor(S.routing(0, 0, 2, E, K)[0], "cpu"), num_experts=E)

    run_ranks(size, rank)


@pytest.mark.parametrize("size,fp8,do_async", [(2, False, False), (4, True, True), (2, True, False)])
def test_vllm_low_latency(deep_ep, size, fp8, do_async):
    def rank(g):
        buffer = S.vllm_ll_buffer(deep_ep, g, hidden=H_LL, num_experts=E, max_tokens=T)
        for seed in (1, 2):
            S.vllm_ll_round(deep_ep, buffer, _inputs(g, seed, H_LL), "cpu", max_tokens=T, fp8=fp8,
                            do_async=do_async, seed=seed)
        buffer.destroy()

    run_ranks(size, rank)


def test_vllm_fault_tolerance_calls(deep_ep):
    def rank(g):
        buffer = S.vllm_ll_buffer(deep_ep, g, hidden=H_LL, num_experts=E, max_tokens=T, enable_shrink=True)
        S.vllm_fault_tolerance_calls(buffer, "cpu")
        S.vllm_ll_round(deep_ep, buffer, _inputs(g, 5, H_LL), "cpu", max_tokens=T)
        buffer.destroy()

    run_ranks(4, rank)


# ------------------------------------------------------------------------------------------- DeepEP's own checks
def _layout_args(buffer, inp):
    idx = S.tensor(inp.idx, "cpu")
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    return dict(topk_idx=idx, topk_weights=S.tensor(inp.w, "cpu"), num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


def test_bad_arguments_raise_naming_them(deep_ep):
    def rank(g):
        normal = S.sglang_buffer(deep_ep, g, S.NORMAL, hidden=H_NORMAL, num_experts=E)
        inp = _inputs(g, 1, H_NORMAL, n=lambda r: 8)
        x = S.bf16(inp.x, "cpu")
        args = _layout_args(normal, inp)
        with pytest.raises(TypeError, match="topk_weights"):
            normal.dispatch(x, **dict(args, topk_weights=args["topk_weights"].half()))
        with pytest.raises(ValueError, match="x"):
            normal.dispatch(S.bf16(S.tokens(1, g.rank, 8, 2 * H_NORMAL), "cpu")[:, ::2], **args)
        ll = S.sglang_buffer(deep_ep, g, S.LOW_LATENCY, hidden=H_LL, num_experts=E, num_max_dispatch_tokens_per_rank=4)
        inp = _inputs(g, 2, H_LL, n=lambda r: 8)
        with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
            ll.low_latency_dispatch(S.bf16(inp.x, "cpu"), S.tensor(inp.idx, "cpu"), 4, E)
        with pytest.raises(TypeError, match="topk_idx"):
            ll.low_latency_dispatch(S.bf16(inp.x, "cpu"), S.tensor(inp.idx, "cpu").int(), 8, E)
        with pytest.raises(ValueError, match="hidden"):
            ll.low_latency_dispatch(S.bf16(inp.x[:, :136], "cpu"), S.tensor(inp.idx, "cpu"), 8, E, use_fp8=True)
        with pytest.raises(ValueError, match="even"):
            deep_ep.Buffer.set_num_sms(7)

    run_ranks(2, rank)


@pytest.mark.xfail(strict=True, reason="DeepEP refuses allocate_on_comm_stream without previous_event and "
                   "async_finish; deepep_cupy accepts it")
def test_allocate_on_comm_stream_needs_previous_event_and_async(deep_ep):
    def rank(g):
        buffer = S.sglang_buffer(deep_ep, g, S.NORMAL, hidden=H_NORMAL, num_experts=E)
        inp = _inputs(g, 1, H_NORMAL, n=lambda r: 8)
        with pytest.raises(ValueError, match="allocate_on_comm_stream"):
            buffer.get_dispatch_layout(S.tensor(inp.idx, "cpu"), E, allocate_on_comm_stream=True)

    run_ranks(2, rank)


@pytest.mark.xfail(strict=True, reason="DeepEP refuses async_finish together with return_recv_hook; "
                   "deepep_cupy accepts it")
def test_low_latency_async_and_hook_exclusive(deep_ep):
    def rank(g):
        buffer = S.sglang_buffer(deep_ep, g, S.LOW_LATENCY, hidden=H_LL, num_experts=E,
                                 num_max_dispatch_tokens_per_rank=T)
        inp = _inputs(g, 1, H_LL)
        with pytest.raises(ValueError, match="return_recv_hook"):
            buffer.low_latency_dispatch(S.bf16(inp.x, "cpu"), S.tensor(inp.idx, "cpu"), T, E, async_finish=True,
                                        return_recv_hook=True)

    run_ranks(2, rank)


def test_low_latency_stats_tensors(deep_ep):
    """Receive counts accumulate per local expert (int32 [E_l]); wait times are int64 [num_ranks]."""
    def rank(g):
        buffer = S.sglang_buffer(deep_ep, g, S.LOW_LATENCY, hidden=H_LL, num_experts=E,
                                 num_max_dispatch_tokens_per_rank=T)
        cumulative = torch.zeros(E // g.size, dtype=torch.int32)
        wait = torch.zeros(g.size, dtype=torch.int64)
        total = torch.zeros(E // g.size, dtype=torch.int32)
        for seed in (1, 2):
            inp = _inputs(g, seed, H_LL)
            _, count, _, _, _ = buffer.low_latency_dispatch(
                S.bf16(inp.x, "cpu"), S.tensor(inp.idx, "cpu"), T, E, cumulative_local_expert_recv_stats=cumulative,
                dispatch_wait_recv_cost_stats=wait, use_fp8=False)
            total += count
        assert cumulative.tolist() == total.tolist() and total.sum() > 0 and (wait >= 0).all()

    run_ranks(2, rank)
