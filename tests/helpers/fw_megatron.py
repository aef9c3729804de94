"""Megatron-Core's use of DeepEP, call for call (``megatron/core/transformer/moe/fused_a2a.py`` and the flex
token dispatcher): ``Buffer.set_num_sms``, ``get_buffer`` sizing from the recommended configs, the autograd
functions whose forward is layout -> dispatch with the router's probabilities and whose backward is a cached
dispatch / a combine of the gradients, ``EventOverlap(EventHandle())`` as the previous event, ``async_finish``
and ``allocate_on_comm_stream`` together. Written here in our own words from reading that code.

Experts: expert ``e`` scales its tokens by ``scales[e]``; a received token's output is the sum over its local
experts weighted by the received probabilities (what permute -> experts -> unpermute computes). The loss is
``sum(out * g)`` for a random ``g``; outputs and the gradients of ``x`` and of the router probabilities are
compared with autograd over the dense float64 computation.
"""

from __future__ import annotations

import numpy as np
from fw_common import (
    bf16,
    close,
    expected_rows,
    expert_scales,
    group_size,
    num_tokens,
    rng,
    routing,
    tensor,
    to_np,
    tokens,
    torch,
)

t = torch()


class BufferCache:
    """``fused_a2a.get_buffer`` with its module-global buffer (one object per rank: thread ranks share modules)."""

    def __init__(self, deep_ep) -> None:
        self.deep_ep = deep_ep
        self.buffer = None

    def get_buffer(self, group, hidden_bytes: int):
        Buffer = self.deep_ep.Buffer
        size = group_size(group)
        num_nvl_bytes, num_rdma_bytes = 0, 0
        for config in (Buffer.get_dispatch_config(size), Buffer.get_combine_config(size)):
            num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, size), num_nvl_bytes)
            num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, size), num_rdma_bytes)
        if (self.buffer is None or self.buffer.group != group or self.buffer.num_nvl_bytes < num_nvl_bytes
                or self.buffer.num_rdma_bytes < num_rdma_bytes):
            self.buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes)
        return self.buffer


def hidden_bytes(x) -> int:
    return x.size(1) * max(x.element_size(), 2)


def _previous_event(async_finish: bool):
    from deep_ep.utils import EventHandle, EventOverlap

    return EventOverlap(EventHandle()) if async_finish else None


class FusedDispatch(t.autograd.Function):
    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, group, cache, async_finish=False,
                allocate_on_comm_stream=False):
        previous_event = _previous_event(async_finish)
        buffer = cache.get_buffer(group, hidden_bytes(x))
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
         event) = buffer.get_dispatch_layout(token_indices, num_experts, previous_event=previous_event,
                                             async_finish=async_finish,
                                             allocate_on_comm_stream=allocate_on_comm_stream)
        (recv_x, recv_token_indices, recv_token_probs, num_recv_tokens_per_expert_list, handle,
         after_event) = buffer.dispatch(x, topk_idx=token_indices, topk_weights=token_probs,
                                        num_tokens_per_rank=num_tokens_per_rank,
                                        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                                        is_token_in_rank=is_token_in_rank,
                                        num_tokens_per_expert=num_tokens_per_expert, previous_event=event,
                                        async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after_event.current_stream_wait()
        ctx.group, ctx.cache, ctx.handle = group, cache, handle
        ctx.async_finish, ctx.allocate_on_comm_stream = async_finish, allocate_on_comm_stream
        tokens_per_expert = t.tensor(num_recv_tokens_per_expert_list)
        return recv_x, recv_token_indices, recv_token_probs, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_output, grad_token_indices, grad_token_probs, grad_tokens_per_expert, grad_handle):
        buffer = ctx.cache.get_buffer(ctx.group, hidden_bytes(grad_output))
        previous_event = _previous_event(ctx.async_finish)
        grad_x, grad_token_probs, after_event = buffer.combine(
            grad_output.contiguous(), ctx.handle, topk_weights=grad_token_probs.float(),
            previous_event=previous_event, async_finish=ctx.async_finish,
            allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        if ctx.async_finish:
            after_event.current_stream_wait()
        return grad_x, None, grad_token_probs, None, None, None, None, None


class FusedCombine(t.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, handle, cache, async_finish=False, allocate_on_comm_stream=False):
        previous_event = _previous_event(async_finish)
        buffer = cache.get_buffer(group, hidden_bytes(x))
        combined_x, combined_weights, after_event = buffer.combine(
            x, handle=handle, async_finish=async_finish, previous_event=previous_event,
            allocate_on_comm_stream=allocate_on_comm_stream)
        assert combined_weights is None, "a combine without topk_weights returns None for them"
        if async_finish:
            after_event.current_stream_wait()
        ctx.handle, ctx.group, ctx.cache = handle, group, cache
        ctx.async_finish, ctx.allocate_on_comm_stream = async_finish, allocate_on_comm_stream
        return combined_x

    @staticmethod
    def backward(ctx, grad_output):
        buffer = ctx.cache.get_buffer(ctx.group, hidden_bytes(grad_output))
        previous_event = _previous_event(ctx.async_finish)
        grad_x, topk_idx, topk_weights, counts, handle, after_event = buffer.dispatch(
            grad_output.contiguous(), handle=ctx.handle, previous_event=previous_event,
            async_finish=ctx.async_finish, allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        assert (topk_idx, topk_weights, counts, handle) == (None,) * 4, "a cached dispatch returns Nones"
        if ctx.async_finish:
            after_event.current_stream_wait()
        return grad_x, None, None, None, None, None


# ------------------------------------------------------------------------------------------- one micro-batch
def router_probs(seed: int, rank: int, num_experts: int, topk: int, skip_experts=()) -> np.ndarray:
    """Router output ``[N, E]`` float32: ``topk`` nonzero probabilities per token, some dropped to 0 (capacity)."""
    n = num_tokens(rank)
    idx, weights = routing(seed, rank, n, num_experts, topk, skip_experts=skip_experts)
    probs = np.zeros((n, num_experts), np.float32)
    rows = np.nonzero(idx >= 0)
    probs[rows[0], idx[rows]] = weights[rows]
    return probs


class MicroBatch:
    """One micro-batch of the flex dispatcher on one rank: inputs, dispatch, experts, combine, checks."""

    def __init__(self, group, cache, *, seed, hidden, num_experts, topk, async_finish, device, skip_last_rank):
        self.group, self.cache, self.device = group, cache, device
        self.me, self.size = int(group.rank() if callable(group.rank) else group.rank), group_size(group)
        self.seed, self.num_experts, self.topk, self.async_finish = seed, num_experts, topk, async_finish
        self.num_local = num_experts // self.size
        skip = range(num_experts - self.num_local, num_experts) if skip_last_rank else ()
        self.all_x = [tokens(seed, r, num_tokens(r), hidden) for r in range(self.size)]
        self.all_probs = [router_probs(seed, r, num_experts, topk, skip) for r in range(self.size)]
        self.scales = expert_scales(seed, num_experts)
        self.g = rng(seed, self.me, 3).standard_normal((num_tokens(self.me), hidden)).astype(np.float32)
        self.x = bf16(self.all_x[self.me], device).requires_grad_()
        self.probs = tensor(self.all_probs[self.me], device).requires_grad_()

    def dispatch(self):
        token_probs, token_indices = t.topk(self.probs, self.topk, dim=-1)
        token_indices = token_indices.masked_fill(token_probs == 0, -1)
        self.token_indices = token_indices
        (self.recv_x, self.recv_idx, self.recv_probs, self.tokens_per_expert, self.handle) = FusedDispatch.apply(
            self.x, token_indices, token_probs, self.num_experts, self.group, self.cache, self.async_finish,
            self.async_finish)

    def experts_and_combine(self):
        assert self.recv_probs.dtype == t.float32
        mask = self.recv_idx != -1
        rows = t.nonzero(mask)[:, 0]
        cols = self.recv_idx[mask]
        probs_map = t.zeros(self.recv_x.shape[0], self.num_local, dtype=t.float32, device=self.device)
        probs_map = probs_map.index_put((rows, cols), self.recv_probs[mask])
        local = self.scales[self.me * self.num_local:(self.me + 1) * self.num_local]
        factor = probs_map @ tensor(local.astype(np.float32), self.device)
        out = (self.recv_x.float() * factor[:, None]).to(t.bfloat16)
        self.counts = t.bincount(cols.cpu(), minlength=self.num_local)
        self.combined = FusedCombine.apply(out, self.group, self.handle, self.cache, self.async_finish,
                                           self.async_finish)
        self.loss = (self.combined.float() * tensor(self.g, self.device)).sum()

    def backward(self):
        self.loss.backward()

    def check(self):
        want_rows = expected_rows(self.all_x, [self._indices(r) for r in range(self.size)], self.me, self.num_local)
        np.testing.assert_array_equal(to_np(self.recv_x), want_rows.reshape(-1, self.x.shape[1]),
                                      err_msg="received tokens")
        assert self.tokens_per_expert.tolist() == self.counts.tolist(), "tokens_per_expert against recv_topk_idx"
        po = t.from_numpy(self.all_probs[self.me].astype(np.float64)).requires_grad_()
        xo = t.from_numpy(self.all_x[self.me].astype(np.float64)).requires_grad_()
        token_probs, token_indices = t.topk(po, self.topk, dim=-1)
        picked = t.from_numpy(self.scales)[token_indices] * token_probs * (token_probs != 0)
        out = xo * picked.sum(dim=1)[:, None]
        (out * t.from_numpy(self.g.astype(np.float64))).sum().backward()
        close(to_np(self.combined), out.detach().numpy(), "combined output")
        close(to_np(self.x.grad), xo.grad.numpy(), "gradient of x")
        close(to_np(self.probs.grad), po.grad.numpy(), "gradient of the router probabilities")

    def results(self) -> dict:
        """What this rank computed, as NumPy (for comparing two backends)."""
        return {"recv_x": to_np(self.recv_x), "combined": to_np(self.combined), "x.grad": to_np(self.x.grad),
                "probs.grad": to_np(self.probs.grad)}

    def _indices(self, rank):
        probs = t.from_numpy(self.all_probs[rank])
        values, idx = t.topk(probs, self.topk, dim=-1)
        return idx.masked_fill(values == 0, -1).numpy()


def train_step(deep_ep, group, *, seed, device="cpu", hidden=256, num_experts=16, topk=4, async_finish=False,
               skip_last_rank=False):
    """Megatron's set-up and one forward + backward of the flex dispatcher; raises AssertionError on a mismatch.
    Returns the micro-batch (its ``cache`` holds the Buffer)."""
    deep_ep.Buffer.set_num_sms(20)
    cache = BufferCache(deep_ep)
    mb = MicroBatch(group, cache, seed=seed, hidden=hidden, num_experts=num_experts, topk=topk,
                    async_finish=async_finish, device=device, skip_last_rank=skip_last_rank)
    mb.dispatch()
    mb.experts_and_combine()
    mb.backward()
    mb.check()
    return mb


def interleaved_micro_batches(deep_ep, group, *, seed, device="cpu", hidden=256, num_experts=16, topk=4,
                              async_finish=True):
    """The combined-1F1B order of overlapped expert-parallel communication: micro-batch 2's dispatch runs
    between micro-batch 1's forward and backward, so two handles live on one Buffer."""
    cache = BufferCache(deep_ep)
    kw = dict(hidden=hidden, num_experts=num_experts, topk=topk, async_finish=async_finish, device=device,
              skip_last_rank=False)
    first, second = MicroBatch(group, cache, seed=seed, **kw), MicroBatch(group, cache, seed=seed + 1, **kw)
    first.dispatch()
    first.experts_and_combine()
    second.dispatch()
    first.backward()
    second.experts_and_combine()
    second.backward()
    first.check()
    second.check()


def get_buffer_reuse(deep_ep, group, hidden=256):
    """``get_buffer`` keeps its Buffer while it is big enough for the same group, and rebuilds a bigger one."""
    cache = BufferCache(deep_ep)
    size = group_size(group)
    x = t.zeros(1, hidden, dtype=t.bfloat16)
    first = cache.get_buffer(group, hidden_bytes(x))
    want = max(c.get_nvl_buffer_size_hint(hidden * 2, size)
               for c in (deep_ep.Buffer.get_dispatch_config(size), deep_ep.Buffer.get_combine_config(size)))
    assert first.group is group and first.num_nvl_bytes == want and first.num_rdma_bytes == 0
    assert cache.get_buffer(group, hidden_bytes(x)) is first
    bigger = cache.get_buffer(group, hidden_bytes(t.zeros(1, 2 * hidden, dtype=t.bfloat16)))
    assert bigger is not first and bigger.num_nvl_bytes > want
    return cache
