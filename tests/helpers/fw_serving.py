"""SGLang's and vLLM's use of DeepEP, call for call, written here in our own words from reading their code:
SGLang's ``DeepEPBuffer`` sizing and its normal / low-latency dispatchers (``Buffer.capture()`` events,
``async_finish`` or receive hooks, FP8 with ``round_scale`` / ``use_ue8m0``, two dispatchers sharing one
Buffer, ``clean_low_latency_buffer`` on a mode switch); vLLM's high-throughput and low-latency
prepare/finalize (``Buffer(**kwargs)`` with ``explicitly_destroy=True``, keyword-only calls, the -1 remap of
received expert ids, ``out=`` combines, the fault-tolerance mask calls).

Experts scale their tokens by ``scales[e]`` and apply the top-k weights themselves where the framework does
(SGLang's normal mode, vLLM's high-throughput mode); the low-latency combine applies them. Results are
compared with the dense float64 oracle; received tokens bit for bit with what their sources sent.
"""

from __future__ import annotations

import math

import numpy as np
from fw_common import (
    bf16,
    close,
    dequant,
    expected_rows,
    expert_scales,
    fp8_pair,
    fp8_tokens,
    group_size,
    num_tokens,
    routing,
    same_rows,
    tensor,
    to_np,
    tokens,
    torch,
    weighted_sum,
)

t = torch()
NORMAL, LOW_LATENCY, AUTO = "normal", "low_latency", "auto"
#: Rank counts vLLM has recommended configs for.
VLLM_CONFIG_RANKS = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)


def _rank(group) -> int:
    return int(group.rank() if callable(group.rank) else group.rank)


class Inputs:
    """Every rank's tokens and routing for one round (rebuilt from the seed on each rank)."""

    def __init__(self, group, seed, *, hidden, num_experts, topk, n=None, skip_experts=()):
        self.me, self.size = _rank(group), group_size(group)
        self.hidden, self.num_experts, self.num_local = hidden, num_experts, num_experts // self.size
        sizes = [num_tokens(r) if n is None else n(r) for r in range(self.size)]
        self.all_x = [tokens(seed, r, sizes[r], hidden) for r in range(self.size)]
        routes = [routing(seed, r, sizes[r], num_experts, topk, skip_experts=skip_experts) for r in range(self.size)]
        self.all_idx = [i for i, _ in routes]
        self.all_w = [w for _, w in routes]
        self.scales = expert_scales(seed, num_experts)
        self.x, self.idx, self.w = self.all_x[self.me], self.all_idx[self.me], self.all_w[self.me]

    def local_scales(self):
        return self.scales[self.me * self.num_local:(self.me + 1) * self.num_local]


# ------------------------------------------------------------------------------------------- SGLang
def sglang_buffer(deep_ep, group, mode, *, hidden, num_experts, param_bytes=2, num_max_dispatch_tokens_per_rank=128):
    """``DeepEPBuffer.get_deepep_buffer``: sizes from the recommended configs and the low-latency hint."""
    Buffer = deep_ep.Buffer
    size = group_size(group)
    hidden_bytes = hidden * param_bytes
    num_nvl_bytes, num_rdma_bytes = 0, 0
    if mode in (NORMAL, AUTO):
        for config in (Buffer.get_dispatch_config(size), Buffer.get_combine_config(size)):
            num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, size), num_nvl_bytes)
            num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, size), num_rdma_bytes)
    if mode in (LOW_LATENCY, AUTO):
        assert num_experts % size == 0
        num_rdma_bytes = max(Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, size,
                                                                   num_experts), num_rdma_bytes)
    num_qps_per_rank = {NORMAL: Buffer.num_sms, LOW_LATENCY: num_experts // size,
                        AUTO: max(Buffer.num_sms, num_experts // size)}[mode]
    buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=mode != NORMAL,
                    num_qps_per_rank=num_qps_per_rank, allow_mnnvl=True)
    assert buffer.group_size == size and buffer.low_latency_mode == (mode != NORMAL)
    return buffer


def sglang_normal_round(deep_ep, buffer, inp: Inputs, device, *, fp8=False, column_major=False, alignment=1,
                        config=None):
    """Prefill: ``dispatch_a``/``dispatch_b`` and ``combine_a``/``combine_b`` with ``async_finish=True``."""
    Buffer = deep_ep.Buffer
    topk_ids = tensor(inp.idx, device).to(t.int64)
    topk_weights = tensor(inp.w, device)
    x = fp8_pair(inp.x, device, column_major=column_major) if fp8 else bf16(inp.x, device)
    previous_event = Buffer.capture()
    (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
     previous_event) = buffer.get_dispatch_layout(topk_ids, inp.num_experts, previous_event=previous_event,
                                                  async_finish=True,
                                                  allocate_on_comm_stream=previous_event is not None)
    (recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, handle,
     event) = buffer.dispatch(x, topk_idx=topk_ids, topk_weights=topk_weights,
                              num_tokens_per_rank=num_tokens_per_rank,
                              num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                              num_tokens_per_expert=num_tokens_per_expert, previous_event=previous_event,
                              async_finish=True, allocate_on_comm_stream=True, expert_alignment=alignment,
                              config=config)
    event.current_stream_wait()
    # Received tokens: bit for bit what the sources sent, in source order.
    want = expected_rows(inp.all_x, inp.all_idx, inp.me, inp.num_local).reshape(-1, inp.hidden)
    if fp8:
        q, s = fp8_tokens(want)
        np.testing.assert_array_equal(to_np(recv_x[0]), q, err_msg="received e4m3 tokens")
        np.testing.assert_array_equal(to_np(recv_x[1]), s, err_msg="received scales")
        got = dequant(q, s)
    else:
        np.testing.assert_array_equal(to_np(recv_x), want, err_msg="received tokens")
        got = want
    ids, w = to_np(recv_topk_ids), to_np(recv_topk_weights)
    counts = [int((ids == e).sum()) for e in range(inp.num_local)]
    assert num_recv_tokens_per_expert == [math.ceil(c / alignment) * alignment for c in counts]
    # Experts: weights applied by the runner, so the combine only sums.
    out = bf16(weighted_sum(got, ids, w, inp.local_scales()), device)
    previous_event = Buffer.capture()
    combined, _, event = buffer.combine(out, handle, async_finish=True, previous_event=previous_event,
                                        allocate_on_comm_stream=True, config=config)
    event.current_stream_wait()
    source = dequant(*fp8_tokens(inp.x)) if fp8 else inp.x
    close(to_np(combined), weighted_sum(source, inp.idx, inp.w, inp.scales), "normal combine")
    return {"recv_x": to_np(recv_x[0] if fp8 else recv_x), "combined": to_np(combined)}


def _ll_expert(recv, count, inp: Inputs, *, fp8, use_ue8m0, hidden):
    """Expert outputs ``[E_l, R*T, H]`` (valid rows only, the rest zero) and the count of valid rows per expert.

    Only the valid rows are dequantized: the rows past an expert's count are poison, and scaling them would
    overflow."""
    from deepep_cupy.reference import quant

    data = to_np(recv[0] if fp8 else recv)
    scales = to_np(recv[1]) if fp8 else None
    counts = to_np(count).tolist()
    out = np.zeros(data.shape, np.float32)
    for e, c in enumerate(counts):
        rows = data[e, :c].astype(np.float32)
        if fp8:
            s = scales[e, :c]
            if use_ue8m0:
                s = quant.ue8m0_to_scale(quant.unpack_ue8m0(s, hidden // 128))
            rows = (rows.reshape(c, hidden // 128, 128) * s[..., None]).reshape(c, hidden)
        out[e, :c] = rows * inp.local_scales()[e]
    return out, counts


def check_ll_dispatch(recv, count, inp: Inputs, *, fp8, round_scale=False, use_ue8m0=False):
    """Per local expert: the valid rows are exactly the tokens routed to it (any order), FP8 cast as DeepEP does."""
    counts = to_np(count).tolist()
    for e in range(inp.num_local):
        expert = inp.me * inp.num_local + e
        want = np.concatenate([x[(idx == expert).any(axis=1)] for x, idx in zip(inp.all_x, inp.all_idx, strict=True)])
        assert counts[e] == want.shape[0], f"expert {e}: {counts[e]} rows, want {want.shape[0]}"
        if not fp8:
            same_rows(to_np(recv)[e, :counts[e]], want, f"expert {e} rows")
            continue
        q, s = fp8_tokens(want, round_scale=round_scale, use_ue8m0=use_ue8m0)
        got_scales = to_np(recv[1])[e, :counts[e]]
        if use_ue8m0:
            from deepep_cupy.reference import quant

            assert got_scales.dtype == np.int32 and got_scales.shape[-1] == inp.hidden // 512
            got_scales = quant.ue8m0_to_scale(quant.unpack_ue8m0(got_scales, inp.hidden // 128))
        elif round_scale:
            assert np.all(np.log2(got_scales) == np.round(np.log2(got_scales))), "rounded scales are powers of 2"
        same_rows(np.hstack([to_np(recv[0])[e, :counts[e]], got_scales]), np.hstack([q, s]), f"expert {e} FP8 rows")


def sglang_low_latency_round(deep_ep, buffer, inp: Inputs, device, *, num_max_dispatch_tokens_per_rank, hook=True,
                             fp8=False, round_scale=False, use_ue8m0=False, zero_copy=False):
    """Decode: ``low_latency_dispatch`` positional 4 then keywords, ``hook()`` or the event; combine all keyword."""
    t_max = num_max_dispatch_tokens_per_rank
    topk_ids, topk_weights = tensor(inp.idx, device), tensor(inp.w, device)
    x = bf16(inp.x, device)
    expected_m = (x.shape[0] * buffer.group_size * inp.idx.shape[1] + inp.num_experts) // inp.num_experts
    assert expected_m >= 0
    extra = dict(round_scale=round_scale, use_ue8m0=use_ue8m0) if fp8 else {}
    recv, packed_recv_count, handle, event, recv_hook = buffer.low_latency_dispatch(
        x, topk_ids, t_max, inp.num_experts, use_fp8=fp8, async_finish=not hook, return_recv_hook=hook, **extra)
    if hook:
        assert event.event is None and recv_hook is not None
        recv_hook()
    else:
        assert recv_hook is None
        event.current_stream_wait()
    check_ll_dispatch(recv, packed_recv_count, inp, fp8=fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
    out, _ = _ll_expert(recv, packed_recv_count, inp, fp8=fp8, use_ue8m0=use_ue8m0, hidden=inp.hidden)
    expert_out = bf16(out, device)
    if zero_copy:
        staged = buffer.get_next_low_latency_combine_buffer(handle)
        staged.copy_(expert_out)
        expert_out = staged
    combined, event, recv_hook = buffer.low_latency_combine(
        x=expert_out, topk_idx=topk_ids, topk_weights=topk_weights, handle=handle, zero_copy=zero_copy,
        async_finish=not hook, return_recv_hook=hook)
    recv_hook() if hook else event.current_stream_wait()
    source = dequant(*fp8_tokens(inp.x, round_scale=round_scale, use_ue8m0=use_ue8m0)) if fp8 else inp.x
    close(to_np(combined), weighted_sum(source, inp.idx, inp.w, inp.scales), "low-latency combine")
    return {"combined": to_np(combined)}


def sglang_two_batch_overlap(deep_ep, buffer, a: Inputs, b: Inputs, device, *, num_max_dispatch_tokens_per_rank):
    """Two dispatchers on one Buffer (two-batch overlap): A's and B's sends and receives interleaved, so two
    low-latency ops are outstanding at once."""
    t_max, rounds = num_max_dispatch_tokens_per_rank, {}

    def dispatch(name, inp):
        recv, count, handle, _, hook = buffer.low_latency_dispatch(
            bf16(inp.x, device), tensor(inp.idx, device), t_max, inp.num_experts, use_fp8=False,
            async_finish=False, return_recv_hook=True)
        rounds[name] = [inp, recv, count, handle]
        return hook

    def combine(name):
        inp, recv, count, handle = rounds[name]
        out, _ = _ll_expert(recv, count, inp, fp8=False, use_ue8m0=False, hidden=inp.hidden)
        combined, _, hook = buffer.low_latency_combine(
            x=bf16(out, device), topk_idx=tensor(inp.idx, device), topk_weights=tensor(inp.w, device),
            handle=handle, async_finish=False, return_recv_hook=True)
        rounds[name].append(combined)
        return hook

    hook_a = dispatch("a", a)
    hook_a()
    hook_b = dispatch("b", b)
    hook_combine_a = combine("a")
    hook_b()
    hook_combine_a()
    combine("b")()
    for inp, recv, count, _, combined in rounds.values():
        check_ll_dispatch(recv, count, inp, fp8=False)
        close(to_np(combined), weighted_sum(inp.x, inp.idx, inp.w, inp.scales), "overlapped combine")
    return {name: to_np(r[-1]) for name, r in rounds.items()}


# ------------------------------------------------------------------------------------------- vLLM
def vllm_ht_buffer(deep_ep, group):
    deep_ep.Buffer.set_num_sms(20)
    kwargs = dict(group=group, num_nvl_bytes=1024 << 20, num_rdma_bytes=0, low_latency_mode=False,
                  num_qps_per_rank=1, explicitly_destroy=True)
    return deep_ep.Buffer(**kwargs)


def vllm_ht_round(deep_ep, buffer, inp: Inputs, device, *, do_async=True, dbo=False, fp8=False):
    """``DeepEPHTPrepareAndFinalize``: prepare (layout + dispatch, all keyword) and finalize (combine into a
    preallocated output)."""
    Buffer, size = deep_ep.Buffer, buffer.group_size
    previous_event = buffer.capture() if dbo else None
    topk_ids, topk_weights = tensor(inp.idx, device), tensor(inp.w, device)
    (num_tokens_per_rank, num_tokens_per_rdma_rank, dispatch_expert_num_tokens, is_token_in_rank,
     event) = buffer.get_dispatch_layout(topk_idx=topk_ids, num_experts=inp.num_experts,
                                         previous_event=previous_event, async_finish=False,
                                         allocate_on_comm_stream=False)
    token_data = fp8_pair(inp.x, device) if fp8 else bf16(inp.x, device)
    config = Buffer.get_dispatch_config(size) if size in VLLM_CONFIG_RANKS else None
    (expert_x, expert_topk_ids, expert_topk_weights, expert_num_tokens_per_expert_list, handle,
     event) = buffer.dispatch(x=token_data, handle=None, num_tokens_per_rank=num_tokens_per_rank,
                              num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                              num_tokens_per_expert=dispatch_expert_num_tokens, topk_idx=topk_ids,
                              topk_weights=topk_weights, expert_alignment=1, config=config,
                              previous_event=previous_event, async_finish=do_async and not dbo,
                              allocate_on_comm_stream=False)
    if not (do_async and not dbo):
        assert event.event is None, "a synchronous op returns no event"
    if event.event is not None:
        event.current_stream_wait()
    rank_offset = inp.me * inp.num_local
    expert_topk_ids = t.where(expert_topk_ids == -1, inp.num_experts - 1 if rank_offset == 0 else 0,
                              expert_topk_ids + rank_offset)
    expert_tokens = t.tensor(expert_num_tokens_per_expert_list, device=device)
    received = dequant(to_np(expert_x[0]), to_np(expert_x[1])) if fp8 else to_np(expert_x)
    if expert_x[0].numel() if fp8 else expert_x.numel():
        ids = to_np(expert_topk_ids)
        local = np.where((ids >= rank_offset) & (ids < rank_offset + inp.num_local), ids - rank_offset, -1)
        assert to_np(expert_tokens).tolist() == [int((local == e).sum()) for e in range(inp.num_local)]
        out = weighted_sum(received, local, to_np(expert_topk_weights), inp.local_scales())
    else:
        out = np.zeros((0, inp.hidden))
    output = t.empty(inp.x.shape, dtype=t.bfloat16, device=device)
    config = Buffer.get_combine_config(size) if size in VLLM_CONFIG_RANKS else None
    combined_x, _, event = buffer.combine(x=bf16(out, device), handle=handle, topk_weights=None, config=config,
                                          previous_event=previous_event, async_finish=do_async and not dbo,
                                          allocate_on_comm_stream=False)
    if event.event is not None:
        event.current_stream_wait()
    output.copy_(combined_x, non_blocking=True)
    source = dequant(*fp8_tokens(inp.x)) if fp8 else inp.x
    close(to_np(output), weighted_sum(source, inp.idx, inp.w, inp.scales), "high-throughput finalize")
    return {"output": to_np(output)}


def vllm_ll_buffer(deep_ep, group, *, hidden, num_experts, max_tokens, enable_shrink=False):
    size = group_size(group)
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=max_tokens, hidden=hidden, num_ranks=size, num_experts=num_experts)
    assert num_rdma_bytes == deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, size, num_experts)
    return deep_ep.Buffer(group=group, num_nvl_bytes=1024 << 20, num_rdma_bytes=num_rdma_bytes,
                          low_latency_mode=True, num_qps_per_rank=num_experts // size,
                          allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=True,
                          enable_shrink=enable_shrink)


def vllm_ll_round(deep_ep, buffer, inp: Inputs, device, *, max_tokens, fp8=False, do_async=False, seed=0):
    """``DeepEPLLPrepareAndFinalize``: ids through an expert-placement table, dispatch with a receive hook called
    at once, combine with ``out=`` (a receive hook when asynchronous)."""
    placement = np.random.default_rng([seed, 77]).permutation(inp.num_experts)
    physical = [np.where(i >= 0, placement[np.maximum(i, 0)], -1) for i in inp.all_idx]
    inp.all_idx, inp.idx = physical, physical[inp.me]
    logical = tensor(np.where(inp.idx >= 0, np.argsort(placement)[np.maximum(inp.idx, 0)], -1), device)
    table = tensor(np.append(placement, -1), device)
    ids = table[logical]  # -1 picks the table's last entry, -1
    a1 = bf16(inp.x, device)
    expert_x, expert_num_tokens, handle, _, hook = buffer.low_latency_dispatch(
        a1, ids, max_tokens, inp.num_experts, use_fp8=fp8, round_scale=False, use_ue8m0=False, async_finish=False,
        return_recv_hook=True)
    hook()
    if fp8:
        assert expert_x[0].is_contiguous()
        expert_x[1].contiguous()
    check_ll_dispatch(expert_x, expert_num_tokens, inp, fp8=fp8)
    out, _ = _ll_expert(expert_x, expert_num_tokens, inp, fp8=fp8, use_ue8m0=False, hidden=inp.hidden)
    output = t.empty(inp.x.shape, dtype=t.bfloat16, device=device)
    combined_x, _, recv_hook = buffer.low_latency_combine(bf16(out, device), ids, tensor(inp.w, device), handle,
                                                          async_finish=False, zero_copy=False,
                                                          return_recv_hook=do_async, out=output)
    assert combined_x is output
    assert (recv_hook is not None) == do_async
    if recv_hook is not None:
        recv_hook()
    source = dequant(*fp8_tokens(inp.x)) if fp8 else inp.x
    close(to_np(output), weighted_sum(source, inp.idx, inp.w, inp.scales), "low-latency finalize")
    return {"output": to_np(output)}


def vllm_fault_tolerance_calls(buffer, device):
    """The mask calls of vLLM's elastic expert parallelism (a Buffer with ``enable_shrink=True``)."""
    size = buffer.group_size
    mask = t.zeros(size, dtype=t.int32, device=device)
    buffer.low_latency_query_mask_buffer(mask)
    assert to_np(mask).tolist() == [0] * size
    if buffer.backend == "cuda":  # the reference backend has no raw buffer
        raw = buffer.get_local_buffer_tensor(dtype=t.int8, use_rdma_buffer=True)
        assert raw.numel() >= buffer.num_rdma_bytes
    victim = size - 1  # every rank masks the same rank, as after a failure
    buffer.low_latency_update_mask_buffer(victim, True)
    buffer.low_latency_query_mask_buffer(mask)
    assert to_np(mask).tolist() == [int(r == victim) for r in range(size)]
    buffer.low_latency_clean_mask_buffer()
    buffer.low_latency_query_mask_buffer(mask)
    assert to_np(mask).tolist() == [0] * size
