"""Low-latency ops in CUDA graphs captured with ``torch.cuda.graph`` through the public ``deepep_cupy.Buffer``
API (torch tensors only), replayed on fresh random inputs; every replay is compared with the NumPy
reference backend and, where the graph holds a whole dispatch + combine pair, with an eager pair on the
same inputs.

Run on every rank:  mpirun -np 2 python -m pytest tests/gpu/test_torch_graphs.py -q
Skips without a GPU, with fewer than 2 ranks, when torch has no CUDA, or without nvshmem4py. Every test
is collective: the ranks run the same ops, captures and replays in the same order, and failures are
gathered on every rank. The capture recipe is in graph_common.py; intranode graphs are in
test_torch_graphs_intranode.py.

Buffer halves: low-latency buffers alternate between two halves and a capture bakes in the half in use.
``clean_low_latency_buffer`` starts each test from half 0 on every rank. A graph holding a dispatch and
its combine (the usual decode-step graph) uses both halves like an eager pair, so eager pairs may run
between its replays. A graph holding a single op reuses one half at every replay; it is compared with
the reference only, and every replay is complete on every rank before the next starts (the host waits
for the GPU, then the reference's collective exchange). Shapes never change while a graph is alive.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_common import BF16, agree, bf16, to_np, together, with_reference_buffer
from graph_common import GRAPH_MARKS, REPLAYS, capture, poison, replay_all, same, seeded, to_torch, warm_up
from ll_common import (
    E_BIG,
    H_BIG,
    K_BIG,
    NEEDS_NVSHMEM,
    T_BIG,
    combine_failures,
    dispatch_failures,
    routing,
    valid_rows,
)

pytestmark = GRAPH_MARKS
# Low-latency flag sweep: a few tokens; (2048, top-8, 32 experts) shares its kernels with test_low_latency.py.
T_LL, H_LL, E_LL, K_LL = 32, 2048, 32, 8
ENV = with_reference_buffer
LL_SHAPES = [(T_BIG, H_BIG, E_BIG), (T_LL, H_LL, E_LL)]


# ------------------------------------------------------------------------------------------- low latency
def _ll_phases(buf, st, t_max, num_experts, dflags, cflags, hooks):
    """One dispatch + combine as a list of phases (each run eagerly, or captured into a graph of its own).

    ``hooks``: "fused" (no hooks, one phase), "one_graph" (both hooks called in the same phase), "split"
    (dispatch send | dispatch receive + combine send | combine receive: three phases).
    """
    hook = hooks != "fused"

    def dispatch():
        recv, count, handle, _event, recv_hook = buf.low_latency_dispatch(
            st["x"], st["topk"], t_max, num_experts, cumulative_local_expert_recv_stats=st.get("cum"),
            dispatch_wait_recv_cost_stats=st.get("wait"), return_recv_hook=hook, **dflags)
        st.update(recv=recv, count=count, handle=handle, d_hook=recv_hook)

    def combine():
        src = st["eo"]
        if cflags.get("zero_copy"):
            src = buf.get_next_low_latency_combine_buffer(st["handle"])
            src.copy_(st["eo"])
        combined, _event, recv_hook = buf.low_latency_combine(
            src, st["topk"], st["w"], st["handle"], use_logfmt=cflags.get("use_logfmt", False),
            zero_copy=cflags.get("zero_copy", False), return_recv_hook=hook, out=st.get("out"))
        st.update(combined=combined, c_hook=recv_hook)

    if hooks == "fused":
        return [lambda: (dispatch(), combine())]
    if hooks == "one_graph":
        return [lambda: (dispatch(), st["d_hook"](), combine(), st["c_hook"]())]
    return [dispatch, lambda: (st["d_hook"](), combine()), lambda: st["c_hook"]()]


def _ll_outputs(st):
    recv = st["recv"] if isinstance(st["recv"], (tuple, list)) else (st["recv"],)
    return (*recv, st["count"], st["handle"][0], st["handle"][1], st.get("combined"))


def _ll_numpy(st, fp8):
    out = {"count": to_np(st["count"]), "src_info": to_np(st["handle"][0]), "layout": to_np(st["handle"][1])}
    if fp8:
        out["x"], out["scales"] = valid_rows(st["recv"][0], out["count"]), valid_rows(st["recv"][1], out["count"])
    else:
        out["x"] = valid_rows(st["recv"], out["count"])
    if st.get("combined") is not None:
        out["combined"] = to_np(st["combined"])
    for key in ("cum", "wait"):
        if st.get(key) is not None:
            out[key] = to_np(st[key])
    return out


def _ll_reference(ref, x, topk, w, expert_out, t_max, num_experts, dflags, logfmt):
    """Reference dispatch (and combine when ``expert_out`` is given: an array, or a function of the
    reference dispatch's results); collective. Returns the results as NumPy and the reference handle."""
    r_recv, r_count, r_handle, _event, _hook = ref.low_latency_dispatch(x, topk, t_max, num_experts, **dflags)
    want = {"count": np.asarray(r_count), "src_info": np.asarray(r_handle[0]), "layout": np.asarray(r_handle[1])}
    if dflags["use_fp8"]:
        want["x"], want["scales"] = np.asarray(r_recv[0]), np.asarray(r_recv[1])
    else:
        want["x"] = np.asarray(r_recv)
    if expert_out is not None:
        eo = expert_out(want) if callable(expert_out) else expert_out
        want["combined"] = np.asarray(ref.low_latency_combine(eo, topk, w, r_handle, use_logfmt=logfmt)[0])
    return want, r_handle


def _ll_compare(tag, got, want, *, fp8, logfmt) -> list[str]:
    """Dispatch results exactly; the combine exactly, or within LogFMT's tolerance when ``logfmt``."""
    failures = [f"{tag}: {m}" for m in dispatch_failures(got, want, fp8=fp8)]
    if "combined" in want:
        failures += [f"{tag}: {m}" for m in combine_failures(got["combined"], want["combined"], logfmt=logfmt)]
    return failures


LL_CASES = [
    # id, dispatch flags, combine flags, hooks, stats tensors
    ("bf16", dict(use_fp8=False), dict(), "fused", False),
    ("fp8-zero_copy", dict(use_fp8=True), dict(zero_copy=True), "fused", False),
    ("fp8_round-out", dict(use_fp8=True, round_scale=True), dict(out=True), "fused", False),
    ("fp8_round_ue8m0-logfmt", dict(use_fp8=True, round_scale=True, use_ue8m0=True), dict(use_logfmt=True), "fused",
     False),
    ("bf16-hooks_one_graph-out", dict(use_fp8=False), dict(out=True), "one_graph", False),
    ("fp8-hooks_three_graphs-zero_copy", dict(use_fp8=True), dict(zero_copy=True), "split", False),
    ("fp8_round-stats-logfmt_zero_copy_out", dict(use_fp8=True, round_scale=True),
     dict(use_logfmt=True, zero_copy=True, out=True), "fused", True),
    ("fp8_ue8m0-stats-hooks_three_graphs-logfmt", dict(use_fp8=True, round_scale=True, use_ue8m0=True),
     dict(use_logfmt=True), "split", True),
]


@NEEDS_NVSHMEM
@pytest.mark.parametrize("case", LL_CASES, ids=[c[0] for c in LL_CASES])
def test_ll_dispatch_combine_graph(env, ll, case):
    """A low-latency dispatch + combine captured (in one graph, or in three with the hooks), replayed ten
    times: every replay matches an eager pair on the same inputs bit for bit and the reference (LogFMT
    within its tolerance); the stats tensors captured in the graph accumulate every replay's counts."""
    import torch

    name, dflags, cflags, hooks, stats = case
    rank, size, ref = env["rank"], env["size"], env["ref"]
    fp8, logfmt = dflags["use_fp8"], cflags.get("use_logfmt", False)
    e_local = E_LL // size
    n = T_LL - (5 * rank) % (T_LL // 2)  # token counts differ between ranks
    rng = seeded(name, rank)

    def fresh():
        x = bf16(rng, (n, H_LL))
        topk, w = routing(rng, n, E_LL, K_LL, empty_tokens=2)
        return x, topk, w, bf16(rng, (e_local, size * T_LL, H_LL), 0.5)

    def state(x, topk, w, eo):
        st = {"x": to_torch(x, env), "topk": to_torch(topk, env), "w": to_torch(w, env), "eo": to_torch(eo, env)}
        if cflags.get("out"):
            st["out"] = to_torch(np.zeros((n, H_LL), BF16), env)
        if stats:
            st["cum"] = to_torch(np.zeros(e_local, np.int32), env)
            st["wait"] = to_torch(np.zeros(size, np.int64), env)
        return st

    def phases(st):
        return _ll_phases(ll, st, T_LL, E_LL, dflags, cflags, hooks)

    ll.clean_low_latency_buffer(T_LL, H_LL, E_LL)  # every rank on half 0
    warm = state(*fresh())
    together(lambda: warm_up(lambda: [p() for p in phases(warm)]))
    st = state(*fresh())
    graphs = together(lambda: capture(phases(st)))
    failures = []
    total = np.zeros(e_local, np.int64)
    last_wait = np.zeros(size, np.int64)
    for replay in range(REPLAYS):
        x, topk, w, eo = fresh()
        want, _ = _ll_reference(ref, x, topk, w, eo, T_LL, E_LL, dflags, logfmt)

        def gpu(x=x, topk=topk, w=w, eo=eo):
            for key, arr in (("x", x), ("topk", topk), ("w", w), ("eo", eo)):
                st[key].copy_(to_torch(arr, env))
            poison(*_ll_outputs(st), st.get("out"))
            replay_all(graphs)
            got = _ll_numpy(st, fp8)
            eager = state(x, topk, w, eo)
            poison(eager.get("out"))
            for phase in phases(eager):
                phase()
            torch.cuda.synchronize()
            return got, _ll_numpy(eager, fp8)

        got, eager = together(gpu)
        tag = f"replay {replay}"
        failures += _ll_compare(f"{tag} vs reference", got, want, fp8=fp8, logfmt=logfmt)
        failures += _ll_compare(f"{tag} vs eager", got, eager, fp8=fp8, logfmt=False)
        if stats:
            total += want["count"]
            same(failures, f"{tag}: cumulative recv stats of the graph", got["cum"], total.astype(np.int32))
            same(failures, f"{tag}: cumulative recv stats of the eager call", eager["cum"], want["count"])
            if (got["wait"] < last_wait).any() or (eager["wait"] < 0).any():
                failures.append(f"{tag}: wait stats went down or negative: graph {last_wait.tolist()} -> "
                                f"{got['wait'].tolist()}, eager {eager['wait'].tolist()}")
            last_wait = got["wait"]
    graphs.clear()
    torch.cuda.synchronize()
    agree(failures)


@NEEDS_NVSHMEM
def test_ll_single_op_graphs(env, ll):
    """A graph holding only a dispatch (BF16, with both stats tensors) replayed five times, then a graph
    holding only a combine with that dispatch's handle, replayed five times on fresh expert outputs and
    weights: each replay matches the reference (each such graph reuses one buffer half at every replay)."""
    import torch

    rank, size, ref = env["rank"], env["size"], env["ref"]
    e_local = E_LL // size
    n = T_LL - (3 * rank) % (T_LL // 2)
    rng = seeded("single-op", rank)
    dflags = dict(use_fp8=False)
    ll.clean_low_latency_buffer(T_LL, H_LL, E_LL)

    def new_inputs():
        x = bf16(rng, (n, H_LL))
        topk, w = routing(rng, n, E_LL, K_LL, empty_tokens=2)
        return x, topk, w

    x, topk, w = new_inputs()
    st = {"x": to_torch(x, env), "topk": to_torch(topk, env), "w": to_torch(w, env),
          "cum": to_torch(np.zeros(e_local, np.int32), env), "wait": to_torch(np.zeros(size, np.int64), env)}

    def dispatch(s):
        recv, count, handle, _e, _h = ll.low_latency_dispatch(
            s["x"], s["topk"], T_LL, E_LL, cumulative_local_expert_recv_stats=s["cum"],
            dispatch_wait_recv_cost_stats=s["wait"], **dflags)
        s.update(recv=recv, count=count, handle=handle)

    warm = dict(st, cum=to_torch(np.zeros(e_local, np.int32), env), wait=to_torch(np.zeros(size, np.int64), env))
    together(lambda: warm_up(lambda: dispatch(warm)))
    graphs = together(lambda: capture([lambda: dispatch(st)]))
    failures = []
    total = np.zeros(e_local, np.int64)
    last_wait = np.zeros(size, np.int64)
    for replay in range(5):
        x, topk, w = new_inputs()
        want, r_handle = _ll_reference(ref, x, topk, w, None, T_LL, E_LL, dflags, False)

        def gpu(x=x, topk=topk):
            st["x"].copy_(to_torch(x, env))
            st["topk"].copy_(to_torch(topk, env))
            poison(*_ll_outputs(st))
            replay_all(graphs)
            return _ll_numpy(st, False)

        got = together(gpu)
        failures += _ll_compare(f"dispatch replay {replay}", got, want, fp8=False, logfmt=False)
        total += want["count"]
        same(failures, f"dispatch replay {replay}: cumulative recv stats", got["cum"], total.astype(np.int32))
        if (got["wait"] < last_wait).any():
            failures.append(f"dispatch replay {replay}: wait stats went down: {last_wait.tolist()} -> "
                            f"{got['wait'].tolist()}")
        last_wait = got["wait"]
    agree(failures)

    # The combine graph returns the last replay's tokens (its routing is in the handle the graph holds).
    cst = {"eo": to_torch(np.zeros((e_local, size * T_LL, H_LL), BF16), env), "topk": st["topk"], "w": st["w"],
           "handle": st["handle"]}

    def combine(s):
        combined, _e, _h = ll.low_latency_combine(s["eo"], s["topk"], s["w"], s["handle"])
        s["combined"] = combined

    together(lambda: warm_up(lambda: combine(dict(cst))))
    cgraphs = together(lambda: capture([lambda: combine(cst)]))
    for replay in range(5):
        w = rng.random((n, K_LL), dtype=np.float32)
        eo = bf16(rng, (e_local, size * T_LL, H_LL), 0.5)
        r_combined = np.asarray(ref.low_latency_combine(eo, topk, w, r_handle)[0])

        def gpu(w=w, eo=eo):
            cst["w"].copy_(to_torch(w, env))
            cst["eo"].copy_(to_torch(eo, env))
            poison(cst["combined"])
            replay_all(cgraphs)
            return to_np(cst["combined"])

        got = together(gpu)
        failures += [f"combine replay {replay}: {m}" for m in combine_failures(got, r_combined, logfmt=False)]
    graphs.clear()
    cgraphs.clear()
    torch.cuda.synchronize()
    agree(failures)


@NEEDS_NVSHMEM
def test_ll_decode_step_graph(env, ll):
    """A whole decode step in one graph at DeepEP's shape (128 tokens, 7168, top-8 of 288): FP8 dispatch,
    per-expert work (dequantise, scale by a power of two per expert), combine. Ten replays on fresh tokens
    and routing, each equal bit for bit to an eager step and to the reference."""
    import torch

    rank, size, ref = env["rank"], env["size"], env["ref"]
    e_local = E_BIG // size
    n = T_BIG - (17 * rank) % (T_BIG // 2)
    rng = seeded("decode-step", rank)
    dflags = dict(use_fp8=True)
    # Powers of two: exact in any order, so the NumPy expert below rounds exactly like torch's.
    expert_scale = (2.0 ** ((np.arange(e_local) + rank * e_local) % 7 - 3)).astype(np.float32)

    def fresh():
        x = bf16(rng, (n, H_BIG))
        topk, w = routing(rng, n, E_BIG, K_BIG, empty_tokens=2)
        return x, topk, w

    def state(x, topk, w):
        return {"x": to_torch(x, env), "topk": to_torch(topk, env), "w": to_torch(w, env), "scale": to_torch(expert_scale, env)}

    def step(st):
        recv, count, handle, _e, _h = ll.low_latency_dispatch(st["x"], st["topk"], T_BIG, E_BIG, **dflags)
        data, scales = recv
        e, s, h = data.shape
        block_scales = (scales * st["scale"].view(e, 1, 1)).unsqueeze(-1)
        y = (data.float().view(e, s, h // 128, 128) * block_scales).reshape(e, s, h).to(torch.bfloat16).contiguous()
        combined, _e, _h = ll.low_latency_combine(y, st["topk"], st["w"], handle)
        st.update(recv=recv, count=count, handle=handle, combined=combined)

    def expert_out(want):
        y = np.zeros((e_local, size * T_BIG, H_BIG), BF16)  # rows past the counts are never read
        for i, c in enumerate(want["count"].tolist()):
            blocks = want["x"][i, :c].astype(np.float32).reshape(c, H_BIG // 128, 128)
            y[i, :c] = (blocks * (want["scales"][i, :c] * expert_scale[i])[:, :, None]).reshape(c, H_BIG).astype(BF16)
        return y

    ll.clean_low_latency_buffer(T_BIG, H_BIG, E_BIG)
    warm = state(*fresh())
    together(lambda: warm_up(lambda: step(warm)))
    st = state(*fresh())
    graphs = together(lambda: capture([lambda: step(st)]))
    failures = []
    for replay in range(REPLAYS):
        x, topk, w = fresh()
        want, _ = _ll_reference(ref, x, topk, w, expert_out, T_BIG, E_BIG, dflags, False)

        def gpu(x=x, topk=topk, w=w):
            for key, arr in (("x", x), ("topk", topk), ("w", w)):
                st[key].copy_(to_torch(arr, env))
            poison(*_ll_outputs(st))
            replay_all(graphs)
            got = _ll_numpy(st, True)
            eager = state(x, topk, w)
            step(eager)
            torch.cuda.synchronize()
            return got, _ll_numpy(eager, True)

        got, eager = together(gpu)
        failures += _ll_compare(f"replay {replay} vs reference", got, want, fp8=True, logfmt=False)
        failures += _ll_compare(f"replay {replay} vs eager", got, eager, fp8=True, logfmt=False)
    graphs.clear()
    torch.cuda.synchronize()
    agree(failures)
