"""Normal-mode (intranode) ops in CUDA graphs captured with ``torch.cuda.graph`` through the public
``deepep_cupy.Buffer`` API (torch tensors only): get_dispatch_layout alone; layout + dispatch with
``num_worst_tokens`` + combine; a cached dispatch + combine with the handle of an eager dispatch. Every
replay, on fresh random inputs, is compared with the NumPy reference backend and with an eager run of
the same calls on the same inputs.

Run on every rank:  mpirun -np 2 python -m pytest tests/gpu/test_torch_graphs_intranode.py -q
Skips without a GPU, with fewer than 2 ranks, or when torch has no CUDA. Same conventions as
test_torch_graphs.py; the capture recipe is in graph_common.py.
"""

from __future__ import annotations

import numpy as np
from gpu_common import agree, bf16, bits, to_np, together, with_reference_buffer
from graph_common import (
    GRAPH_MARKS,
    REPLAYS,
    call,
    capture,
    poison,
    replay_all,
    same,
    seeded,
    to_torch,
    warm_up,
)
from ll_common import routing

pytestmark = GRAPH_MARKS
# 512 tokens (fewer on the other ranks), hidden 2048, top-4 of 32 experts.
N_NT, H_NT, E_NT, K_NT = 512, 2048, 32, 4
ENV = with_reference_buffer
NVL_HIDDEN = H_NT


# ------------------------------------------------------------------------------------------- helpers
def _combine_close(got, want, what: str) -> None:
    """Normal-mode combine against the reference, as test_intranode.py compares it."""
    a, b = got.astype(np.float32), want.astype(np.float32)
    np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2, err_msg=what)
    exact = float(np.mean(bits(got) == bits(want))) if got.size else 1.0
    assert exact > 0.999, f"{what}: only {exact:.4%} of the values are bit-identical to the reference"


def _nt_tokens(rank):
    return N_NT - (32 * rank) % (N_NT // 2)  # token counts differ between ranks


def test_layout_graph(env, nvl):
    """get_dispatch_layout captured alone, replayed on fresh routing: equal to the reference and to an eager
    call (purely local: no peer involved)."""
    import torch

    buf = nvl[0]
    rank = env["rank"]
    n = _nt_tokens(rank)
    rng = seeded("layout", rank)
    topk = routing(rng, n, E_NT, K_NT, masked_slots=40, empty_tokens=3)[0]
    st = {"topk": to_torch(topk, env)}

    def layout(s):
        per_rank, per_rdma, per_expert, in_rank, _e = buf.get_dispatch_layout(s["topk"], E_NT)
        s.update(per_rank=per_rank, per_rdma=per_rdma, per_expert=per_expert, in_rank=in_rank)

    together(lambda: warm_up(lambda: layout(dict(st))))
    graphs = together(lambda: capture([lambda: layout(st)]))
    failures = []
    for replay in range(REPLAYS):
        topk = routing(rng, n, E_NT, K_NT, masked_slots=40, empty_tokens=3)[0]
        r_rank, r_rdma, r_expert, r_in, _e = env["ref"].get_dispatch_layout(topk, E_NT)

        def gpu(topk=topk):
            st["topk"].copy_(to_torch(topk, env))
            poison(st["per_rank"], st["per_expert"], st["in_rank"])
            replay_all(graphs)
            eager = {"topk": st["topk"]}
            layout(eager)
            torch.cuda.synchronize()
            return ([to_np(st[k]) for k in ("per_rank", "per_expert", "in_rank")],
                    [to_np(eager[k]) for k in ("per_rank", "per_expert", "in_rank")], st["per_rdma"])

        got, eager, per_rdma = together(gpu)
        if per_rdma is not None or r_rdma is not None:
            failures.append(f"replay {replay}: num_tokens_per_rdma_rank is not None within one node")
        for name, g, e, r in zip(("per_rank", "per_expert", "in_rank"), got, eager, (r_rank, r_expert, r_in),
                                 strict=True):
            same(failures, f"replay {replay}: {name} vs reference", g, r)
            same(failures, f"replay {replay}: {name} vs eager", g, e)
    graphs.clear()
    torch.cuda.synchronize()
    agree(failures)


def test_worst_tokens_dispatch_combine_graph(env, nvl):
    """Layout, dispatch with num_worst_tokens (fixed-size outputs, no host sync) and combine in one graph,
    replayed on fresh routing, tokens and expert outputs: equal to the reference (combine as
    test_intranode.py compares it) and bit for bit to an eager run of the same three calls."""
    import torch

    buf, dcfg, ccfg = nvl
    rank, size, ref = env["rank"], env["size"], env["ref"]
    n = _nt_tokens(rank)
    worst = N_NT * size  # no rank can receive more
    rng = seeded("worst-tokens", rank)

    def fresh():
        topk, w = routing(rng, n, E_NT, K_NT, masked_slots=40, empty_tokens=3)
        return topk, w, bf16(rng, (n, H_NT)), bf16(rng, (worst, H_NT), 0.5)

    def state(topk, w, x, y):
        return {"topk": to_torch(topk, env), "w": to_torch(w, env), "x": to_torch(x, env), "y": to_torch(y, env)}

    def step(s):
        per_rank, _rdma, per_expert, in_rank, _e = buf.get_dispatch_layout(s["topk"], E_NT)
        recv_x, recv_idx, recv_w, counts, handle, _e = buf.dispatch(
            s["x"], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=s["topk"], topk_weights=s["w"], num_worst_tokens=worst, config=dcfg)
        combined, combined_w, _e = buf.combine(s["y"], handle, topk_weights=recv_w, config=ccfg)
        s.update(per_rank=per_rank, per_expert=per_expert, in_rank=in_rank, recv_x=recv_x, recv_idx=recv_idx,
                 recv_w=recv_w, counts=counts, handle=handle, combined=combined, combined_w=combined_w)

    names = ("per_rank", "per_expert", "in_rank", "recv_x", "recv_idx", "recv_w", "combined", "combined_w")

    def results(s):
        out = {k: to_np(s[k]) for k in names}
        out.update({f"handle[{i}]": to_np(h) for i, h in enumerate(s["handle"])})
        out["counts"] = s["counts"]
        return out

    together(lambda: warm_up(lambda: step(state(*fresh()))))
    st = state(*fresh())
    graphs = together(lambda: capture([lambda: step(st)]))
    failures = []
    for replay in range(REPLAYS):
        topk, w, x, y = fresh()
        r_rank, _rdma, r_expert, r_in, _e = ref.get_dispatch_layout(topk, E_NT)
        r_x, r_idx, r_w, r_counts, r_handle, _e = ref.dispatch(
            x, num_tokens_per_rank=r_rank, is_token_in_rank=r_in, num_tokens_per_expert=r_expert, topk_idx=topk,
            topk_weights=w, num_worst_tokens=worst, config=dcfg)
        r_comb, r_comb_w, _e = ref.combine(y, r_handle, topk_weights=r_w, config=ccfg)
        num_recv = int(np.asarray(r_handle[0])[size - 1, rank])

        def gpu(topk=topk, w=w, x=x, y=y):
            for key, arr in (("topk", topk), ("w", w), ("x", x), ("y", y)):
                st[key].copy_(to_torch(arr, env))
            poison(*(st[k] for k in names), *st["handle"])
            replay_all(graphs)
            got = results(st)
            eager = state(topk, w, x, y)
            step(eager)
            torch.cuda.synchronize()
            return got, results(eager)

        got, eager = together(gpu)
        tag = f"replay {replay}"
        want = {"per_rank": r_rank, "per_expert": r_expert, "in_rank": r_in, "recv_idx": r_idx, "recv_w": r_w}
        want.update({f"handle[{i}]": np.asarray(h) for i, h in enumerate(r_handle)})
        for key, value in want.items():
            same(failures, f"{tag}: {key} vs reference", got[key], np.asarray(value))
        if got["recv_x"].shape[0] != worst:
            failures.append(f"{tag}: recv_x has {got['recv_x'].shape[0]} rows, not num_worst_tokens={worst}")
        same(failures, f"{tag}: recv_x vs reference", got["recv_x"][:num_recv], np.asarray(r_x)[:num_recv])
        call(failures, f"{tag}: combined_x vs reference", _combine_close, got["combined"], np.asarray(r_comb),
             "combined_x")
        call(failures, f"{tag}: combined_topk_weights vs reference", np.testing.assert_allclose, got["combined_w"],
             np.asarray(r_comb_w), rtol=1e-6, atol=1e-6)
        if got["counts"] != [] or eager["counts"] != [] or r_counts != []:
            failures.append(f"{tag}: the per-expert list is not [] with num_worst_tokens")
        got["recv_x"], eager["recv_x"] = got["recv_x"][:num_recv], eager["recv_x"][:num_recv]
        for key in (*names, *(f"handle[{i}]" for i in range(6))):
            same(failures, f"{tag}: {key} vs eager", got[key], eager[key])
    graphs.clear()
    torch.cuda.synchronize()
    agree(failures)


def test_cached_dispatch_combine_graph(env, nvl):
    """A cached dispatch (the handle of an eager dispatch) and a combine with that handle, weights and a
    bias, in one graph, replayed on fresh tokens, expert outputs, weights and biases: equal to the
    reference and bit for bit to an eager run of the same two calls."""
    import torch

    buf, dcfg, ccfg = nvl
    rank, size, ref = env["rank"], env["size"], env["ref"]
    n = _nt_tokens(rank)
    rng = seeded("cached", rank)
    topk, w = routing(rng, n, E_NT, K_NT, masked_slots=40, empty_tokens=3)
    x = bf16(rng, (n, H_NT))
    r_rank, _rdma, r_expert, r_in, _e = ref.get_dispatch_layout(topk, E_NT)
    r_handle = ref.dispatch(x, num_tokens_per_rank=r_rank, is_token_in_rank=r_in, num_tokens_per_expert=r_expert,
                            topk_idx=topk, topk_weights=w, config=dcfg)[4]
    num_recv = int(np.asarray(r_handle[0])[size - 1, rank])

    def first_dispatch():
        topk_t = to_torch(topk, env)
        per_rank, _rdma, per_expert, in_rank, _e = buf.get_dispatch_layout(topk_t, E_NT)
        return buf.dispatch(to_torch(x, env), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=topk_t, topk_weights=to_torch(w, env), config=dcfg)[4]

    handle = together(first_dispatch)
    failures = []
    for i in range(6):
        same(failures, f"eager dispatch: handle[{i}] vs reference", to_np(handle[i]), np.asarray(r_handle[i]))
    agree(failures)

    def fresh():
        return (bf16(rng, (n, H_NT)), bf16(rng, (num_recv, H_NT), 0.5), rng.random((num_recv, K_NT), dtype=np.float32),
                bf16(rng, (n, H_NT)))

    def state(x, y, yw, bias):
        return {"x": to_torch(x, env), "y": to_torch(y, env), "yw": to_torch(yw, env), "bias": to_torch(bias, env)}

    def step(s):
        recv_x, _i, _w, _c, _h, _e = buf.dispatch(s["x"], handle=handle, config=dcfg)
        combined, combined_w, _e = buf.combine(s["y"], handle, topk_weights=s["yw"], bias=s["bias"], config=ccfg)
        s.update(recv_x=recv_x, combined=combined, combined_w=combined_w)

    names = ("recv_x", "combined", "combined_w")
    together(lambda: warm_up(lambda: step(state(*fresh()))))
    st = state(*fresh())
    graphs = together(lambda: capture([lambda: step(st)]))
    for replay in range(REPLAYS):
        x, y, yw, bias = fresh()
        r_x = np.asarray(ref.dispatch(x, handle=r_handle, config=dcfg)[0])
        r_comb, r_comb_w, _e = ref.combine(y, r_handle, topk_weights=yw, bias=bias, config=ccfg)

        def gpu(x=x, y=y, yw=yw, bias=bias):
            for key, arr in (("x", x), ("y", y), ("yw", yw), ("bias", bias)):
                st[key].copy_(to_torch(arr, env))
            poison(*(st[k] for k in names))
            replay_all(graphs)
            got = {k: to_np(st[k]) for k in names}
            eager = state(x, y, yw, bias)
            step(eager)
            torch.cuda.synchronize()
            return got, {k: to_np(eager[k]) for k in names}

        got, eager = together(gpu)
        tag = f"replay {replay}"
        same(failures, f"{tag}: recv_x vs reference", got["recv_x"], r_x)
        call(failures, f"{tag}: combined_x vs reference", _combine_close, got["combined"], np.asarray(r_comb),
             "combined_x")
        call(failures, f"{tag}: combined_topk_weights vs reference", np.testing.assert_allclose, got["combined_w"],
             np.asarray(r_comb_w), rtol=1e-6, atol=1e-6)
        for key in names:
            same(failures, f"{tag}: {key} vs eager", got[key], eager[key])
    graphs.clear()
    torch.cuda.synchronize()
    agree(failures)
