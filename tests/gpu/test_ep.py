"""DeepEP V2's API on GPUs: ``ElasticBuffer`` (2.1) and ``EPBuffer`` (2.5) making V2's test calls in their order
(``tests/helpers/ep_v2_calls.py``: dispatch A non-expanded, B expanded, C and D cached, combines A and B, E with
the receive stats), bit for bit against the NumPy statement of V2's semantics (``tests/helpers/ep_v2_ref.py``).

Run on every rank:  mpirun -np 2 python -m pytest tests/gpu/test_ep.py -q
Skips without a GPU or with fewer than 2 ranks; the graph and torch-group tests also where torch has no CUDA.
Every test is collective (all ranks, same order, same parameters; inputs and token counts differ per rank):
a rank's calls run under ``together`` and its checks are collected and agreed on (``agree``), so a rank never
waits for one that failed. Arrays are torch CUDA tensors, and CuPy arrays where this CuPy holds bf16 (FP8
modes only where it holds FP8 too). Before each call, free device memory of the output sizes is filled with
0xAB (CuPy's pool, torch's cache, V1's output pool), and the combine inputs are NaN past the rows a token maps
to, so rows a kernel forgets to write show. Also: a cached, sync-free (``do_cpu_sync=False``) dispatch and
combine captured with ``torch.cuda.graph`` and replayed on fresh inputs; one rank late (a host sleep); buffers
on a torch.distributed group (NCCL, or gloo where ranks share a GPU); each rank its own NVLink domain.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from types import SimpleNamespace

import ep_v2_calls as C  # tests/helpers, on the path from pytest's configuration
import ep_v2_ref as R
import numpy as np
import pytest
from gpu_common import (
    BF16,
    COMM,
    FP8,
    MULTI_RANK_GPU,
    agree,
    bits,
    device_group_backend,
    frameworks,
    sync,
    to_dev,
    to_np,
    together,
    torch_cuda,
    with_wait_budget,
)
from graph_common import capture, replay_all, warm_up
from graph_common import poison as poison_outputs
from normal_common import cupy_holds, skip_unless_framework_holds
from normal_common import poison as poison_pools

pytestmark = MULTI_RANK_GPU
ENV = with_wait_budget
NEEDS_TORCH_CUDA = pytest.mark.skipif(not torch_cuda(), reason="needs torch with CUDA")

# 128 tokens (fewer on the other ranks), hidden 2048, top-6 of 8 experts a rank.
T, H, K = 128, 2048, 6
E = 8 * (COMM.Get_size() if COMM is not None else 1)
ALIGN = 128
REPLAYS = 5
MODES_21 = list(C.modes("2.1"))
DEFERRED_25 = list(C.modes("2.5", defer=True))
PLAIN_25 = list(C.modes("2.5", defer=False))


# ------------------------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def v2_buffer(env, cls_name, **kwargs):
    """``deepep_cupy.<cls_name>(comm=COMM, ...)`` sized for T x H; destroyed once every rank's GPU work is done
    and every rank is there."""
    kwargs.setdefault("comm", COMM)
    buffer = getattr(env["deepep_cupy"], cls_name)(num_max_tokens_per_rank=T, hidden=H, num_topk=K,
                                                   explicitly_destroy=True, prefer_overlap_with_compute=False,
                                                   **kwargs)
    try:
        yield buffer
    finally:
        sync()
        COMM.Barrier()
        buffer.destroy()


def poisoner(env, fw, buffer):
    """``before(name)`` for ``make_calls``: 0xAB in free device memory of the largest output's size."""
    size = env["size"]
    rows = size * T * min(K, E // size) + (ALIGN - 1) * (E // size)  # the expanded layout's bound
    nbytes = rows * H * 2

    def before(_name):
        poison_pools({"dev": env["dev"], "buf": buffer.runtime}, fw, [nbytes])
        if fw == "torch":
            import torch

            block = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{env['dev']}")
            block.fill_(0xAB)
            del block  # back to torch's cache, where the outputs come from

    return before


def run_modes(env, fw, cls_name, modes, *, seed, defer=False, do_cpu_sync=True, late=None, **buffer_kw):
    """V2's calls for every mode (``make_calls`` under ``together``) on a new ``cls_name`` buffer, checked on
    each rank, then agreed on. ``late``: ``(rank, call names, seconds)``: that rank sleeps on the host before
    those calls."""
    skip_unless_framework_holds(fw, BF16)
    if fw == "cupy" and not cupy_holds(FP8):
        modes = [m for m in modes if not m[2]]
    with v2_buffer(env, cls_name, **buffer_kw) as buffer:
        _run_modes(env, fw, buffer, modes, version="2.1" if cls_name == "ElasticBuffer" else "2.5", seed=seed,
                   defer=defer, do_cpu_sync=do_cpu_sync, late=late)


def _run_modes(env, fw, buffer, modes, *, version, seed, defer, do_cpu_sync, late):
    g = SimpleNamespace(rank=env["rank"], size=env["size"])
    poison = poisoner(env, fw, buffer)
    failures = [] if (buffer.rank_idx, buffer.num_ranks) == (g.rank, g.size) else [
        f"buffer.rank_idx, num_ranks = {buffer.rank_idx}, {buffer.num_ranks}, not {g.rank}, {g.size}"]

    def before(name):
        if late is not None and g.rank == late[0] and name in late[1]:
            time.sleep(late[2])
        poison(name)

    for i, mode in enumerate(modes):
        calls = together(lambda mode=mode, i=i: C.make_calls(
            buffer, g, mode, seed=seed + i, num_tokens=T, hidden=H, num_experts=E, num_topk=K, version=version,
            defer=defer, do_cpu_sync=do_cpu_sync, to=lambda a: to_dev(a, fw, env), before=before))
        try:
            C.check_calls(calls)
        except AssertionError as exc:
            failures.append(f"{fw} mode {mode}: {C.describe(exc)}"[:800])
    agree(failures)


def spread(modes) -> list:
    """Every 11th mode (prime to the enumeration's loop sizes): each field of the mode varies."""
    picked = modes[::11]
    assert all(len({m[f] for m in picked}) == len({m[f] for m in modes}) for f in range(7))
    return picked


# ------------------------------------------------------------------------------------------- V2's calls
@pytest.mark.parametrize("fw", frameworks())
def test_elastic_buffer_modes(env, fw):
    """2.1's modes (do_handle_copy, alignment 128 / 1, FP8 / BF16, 0-2 biases, the event triples)."""
    run_modes(env, fw, "ElasticBuffer", spread(MODES_21), seed=0)


@pytest.mark.parametrize("fw", frameworks())
def test_elastic_buffer_without_cpu_sync(env, fw):
    """``do_cpu_sync=False``: outputs at their bounds, the valid extent from the handle's prefix sums on the GPU."""
    run_modes(env, fw, "ElasticBuffer", MODES_21[3::23], seed=100, do_cpu_sync=False)


@pytest.mark.parametrize("fw", frameworks())
def test_without_multiple_reduction(env, fw):
    """The expanded combine adds each (token, expert) row on its own."""
    run_modes(env, fw, "ElasticBuffer", MODES_21[5::29], seed=200, allow_multiple_reduction=False)


@pytest.mark.parametrize("do_cpu_sync", [True, False])
@pytest.mark.parametrize("fw", frameworks())
def test_ep_buffer_deferred(env, fw, do_cpu_sync):
    """2.5's default enumeration: every call asynchronous, its epilogue deferred to the wait."""
    run_modes(env, fw, "EPBuffer", DEFERRED_25[:: 5 if do_cpu_sync else 7], seed=300 + do_cpu_sync, defer=True,
              do_cpu_sync=do_cpu_sync)


@pytest.mark.parametrize("fw", frameworks())
def test_ep_buffer_without_deferral(env, fw):
    run_modes(env, fw, "EPBuffer", PLAIN_25[1::11], seed=400)


@pytest.mark.parametrize("hybrid", [True, False])
@pytest.mark.parametrize("fw", frameworks())
def test_across_nvlink_domains(env, fw, hybrid):
    """Every rank its own NVLink domain (V1's internode kernels over NVSHMEM), hybrid mode and one flat domain:
    the source token indices travel in a cached dispatch, each rank's sums at their last slots."""
    run_modes(env, fw, "ElasticBuffer", MODES_21[7::17], seed=500 + hybrid, num_nvl_ranks=1, allow_hybrid_mode=hybrid)


def test_one_rank_late(env):
    """The last rank sleeps 2 s on the host before dispatch A and before combine A, in a synchronous mode and a
    deferred one: the others wait for it (CPU sync, kernels' waits within their budget) and every result is
    still exact."""
    late = (env["size"] - 1, ("dispatch A", "combine A"), 2.0)
    run_modes(env, frameworks()[0], "EPBuffer", [PLAIN_25[0], DEFERRED_25[-1]], seed=500, defer=True, late=late)


@NEEDS_TORCH_CUDA
@pytest.mark.parametrize("cls_name", ["ElasticBuffer", "EPBuffer"])
def test_torch_group(env, cls_name):
    """A buffer on a torch.distributed group as frameworks make one: NCCL, or gloo where ranks share a GPU."""
    import torch.distributed as dist

    from deepep_cupy.device.torch_dist import init_torch_distributed

    init_torch_distributed(COMM, "gloo")
    backend = device_group_backend(env["dev"])
    group = dist.new_group(backend=backend)
    modes = MODES_21[7::31] if cls_name == "ElasticBuffer" else PLAIN_25[4::17]
    run_modes(env, "torch", cls_name, modes, seed=600, comm=None, group=group)


# ------------------------------------------------------------------------------------------- CUDA graphs
@NEEDS_TORCH_CUDA
@pytest.mark.parametrize("cls_name", ["ElasticBuffer", "EPBuffer"])
def test_cached_sync_free_graph(env, cls_name):
    """V2's graph promise: with the handles of eager ``do_cpu_sync=False`` dispatches (non-expanded and
    expanded), a cached dispatch of each (the expanded one with weights and zero padding) and a combine on each
    handle (weights, a bias) are captured in one ``torch.cuda.graph`` and replayed on fresh tokens, expert
    outputs and biases; outputs are poisoned before every replay. Each replay equals the reference bit for bit
    and an eager run of the same calls on the same inputs."""
    import torch

    rank, size = env["rank"], env["size"]
    e_local = E // size
    inputs = [R.rank_inputs(50, r, num_tokens=T, hidden=H, num_experts=E, num_topk=K) for r in range(size)]
    mine = inputs[rank]

    def to(a):
        return to_dev(a, "torch", env)

    with v2_buffer(env, cls_name) as buffer:
        topk_idx, topk_w = to(mine.topk_idx), to(mine.topk_weights)
        common = dict(topk_idx=topk_idx, topk_weights=topk_w, num_experts=E, expert_alignment=ALIGN,
                      do_cpu_sync=False)

        def first():
            a = buffer.dispatch(to(mine.x), **common)
            b = buffer.dispatch(to(mine.x), **common, do_expand=True)
            torch.cuda.synchronize()
            return a, b

        (_, recv_idx, recv_w, h, _), (_, _, ex_w, he, _) = together(first)
        rows = int(to_np(h.psum_num_recv_tokens_per_scaleup_rank)[-1])
        meta, ex_meta, local_topk = to_np(h.recv_src_metadata), to_np(he.recv_src_metadata), to_np(recv_idx)[:rows]
        num_ex = he.num_expanded_tokens
        psum_e = to_np(he.psum_num_recv_tokens_per_expert).astype(np.int64)
        pads = [np.arange(psum_e[e], R.align(psum_e[e], ALIGN)) for e in range(e_local)]

        def fresh(replay):
            """Every rank's new tokens (the reference needs them all), this rank's combine inputs and bias."""
            rngs = [np.random.default_rng([51, replay, r]) for r in range(size)]
            xs = [rng.standard_normal((len(inp.x), H), dtype=np.float32).astype(BF16)
                  for rng, inp in zip(rngs, inputs, strict=True)]
            cin, ein, src, ex_src, ex_rows = C.combine_inputs(meta, local_topk, ex_meta, num_ex, rows=rows,
                                                              num_topk=K, hidden=H, seed=replay)
            bias = (rngs[rank].standard_normal((len(mine.x), H), dtype=np.float32) * 8).astype(BF16)
            return xs, cin, ein, bias, src, ex_src, ex_rows

        def state(x, cin, ein, bias):
            return {"x": to(x), "y": to(cin), "ye": to(ein), "bias": to(bias)}

        def step(s):
            recv_x, recv_i, _, _, _ = buffer.dispatch(s["x"], handle=h, num_sms=h.num_sms)
            ex_x, _, ex_w2, _, _ = buffer.dispatch(s["x"], handle=he, topk_weights=topk_w, do_expand=True,
                                                   do_zero_padding=True, num_sms=he.num_sms)
            comb, comb_w, _ = buffer.combine(s["y"], h, topk_weights=recv_w, bias=s["bias"])
            red, red_w, _ = buffer.combine(s["ye"], he, topk_weights=ex_w, bias=s["bias"])
            s.update(recv_x=recv_x, recv_i=recv_i, ex_x=ex_x, ex_w=ex_w2, comb=comb, comb_w=comb_w, red=red,
                     red_w=red_w)

        outputs = ("recv_x", "recv_i", "ex_x", "ex_w", "comb", "comb_w", "red", "red_w")
        xs, cin, ein, bias, *_ = fresh(0)
        together(lambda: warm_up(lambda: step(state(xs[rank], cin, ein, bias))))
        st = state(xs[rank], cin, ein, bias)
        graphs = together(lambda: capture([lambda: step(st)]))
        failures = []
        for replay in range(1, REPLAYS + 1):
            xs, cin, ein, bias, src, ex_src, ex_rows = fresh(replay)

            def gpu(x=xs[rank], cin=cin, ein=ein, bias=bias):
                for key, arr in (("x", x), ("y", cin), ("ye", ein), ("bias", bias)):
                    st[key].copy_(to(arr))
                poison_outputs(*(st[k] for k in outputs))
                replay_all(graphs)
                got = {k: to_np(st[k]) for k in outputs}
                eager = state(x, cin, ein, bias)
                step(eager)
                torch.cuda.synchronize()
                return got, {k: to_np(eager[k]) for k in outputs}

            got, eager = together(gpu)
            new_inputs = [dataclasses.replace(inp, x=x) for inp, x in zip(inputs, xs, strict=True)]
            want = SimpleNamespace(ref=R.received(new_inputs, rank, E, T), bias=bias,
                                   y_src=R.expert_outputs(rank * T + np.arange(len(mine.x)), K, H, replay))
            for name, res in (("replay", got), ("eager", eager)):
                try:
                    _check_replay(res, want, mine, src, ex_src, ex_rows, pads, rows, e_local)
                except AssertionError as exc:
                    failures.append(f"{cls_name} {name} {replay}: {exc}"[:800])
        graphs.clear()
        torch.cuda.synchronize()
        agree(failures)


def _check_replay(got, want, mine, src, ex_src, ex_rows, pads, rows, e_local) -> None:
    """One replay's (or eager run's) outputs against the reference, bit for bit."""
    ref = want.ref
    assert np.array_equal(np.sort(src), ref.src_global), "sources of the received rows"
    order = np.argsort(src, kind="stable")
    assert np.array_equal(bits(got["recv_x"][:rows][order]), bits(ref.x)), "cached recv_x"
    assert np.array_equal(got["recv_i"][:rows][order], ref.topk_idx), "cached recv_topk_idx"
    ex_order = ex_rows[np.argsort(ex_src, kind="stable")]
    for j in range(K):
        sel = ex_order[:, j] >= 0
        r = ex_order[sel, j]
        assert np.array_equal(bits(got["ex_x"][r]), bits(ref.x[sel])), f"cached expanded x, slot {j}"
        assert np.array_equal(got["ex_w"][r], ref.topk_weights[sel, j]), f"cached expanded weights, slot {j}"
    pad = np.concatenate(pads).astype(np.int64)
    assert not got["ex_x"][pad].astype(np.float32).any() and not got["ex_w"][pad].any(), "zero padding"
    for name, reduce in (("comb", True), ("red", True)):
        expect = R.combined(want.y_src, mine.topk_idx, e_local, (want.bias,), reduce_per_rank=reduce)
        assert np.array_equal(bits(got[name]), bits(expect)), f"{name}: combined_x"
    assert np.array_equal(got["comb_w"], mine.topk_weights), "combined_topk_weights"
    assert np.array_equal(got["red_w"], mine.topk_weights), "reduced combined_topk_weights"
