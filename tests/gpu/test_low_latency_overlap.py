"""Hook mode that overlaps, on GPUs, through the public ``deepep_cupy.Buffer`` API: a low-latency send never
waits for a late peer, in every format the planner can choose for a hook-mode call; and two micro-batches
in flight (the two-batch overlap order: both sends, compute between, the hooks last) give the same bits as
the same calls made one at a time, eagerly with ranks late by different amounts and replayed from a
``torch.cuda.graph``.

Run on every rank:  mpirun -np 2 python -m pytest tests/gpu/test_low_latency_overlap.py -q
Same conventions as test_low_latency.py (collective tests, failures gathered on every rank, 30 s kernel
wait budget). A late rank is a host ``time.sleep`` before its call; a punctual rank's send is timed with
CUDA events from its stream to the later of its stream and the Buffer's communication stream (where a
hook-mode send runs), so the time is the send kernel's (plus its launch), not the host's.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from gpu_common import COMM, agree, bf16, check, collective_buffer, sync, to_dev, to_np, together, torch_cuda
from ll_common import (
    E_BIG,
    E_SMALL,
    FRAMEWORKS,
    H_BIG,
    H_SMALL,
    K_BIG,
    LL_MARKS,
    T_BIG,
    T_SMALL,
    combine_failures,
    dispatch_arrays,
    dispatch_failures,
    engine_paths,
    hint,
    kernel_error,
    make_expert_out,
    reference_oracle,
    routing,
    with_low_latency_buffer,
)
from reference_cases import ll_combine, ll_dispatch

from deepep_cupy.device.streams import external_stream, stream_ptr

pytestmark = LL_MARKS
ENV = with_low_latency_buffer

#: The late rank's host delay before each of its sends.
LATE_S = 0.2
#: A send that waits for nobody ends well inside this; one that waits for the late rank takes LATE_S.
SEND_BOUND_S = 0.02

BIG = (T_BIG, H_BIG, E_BIG, K_BIG)
SMALL = (T_SMALL, H_SMALL, E_SMALL, 8)

#: Every format a hook-mode round can take on stores, forced through the engine's path attributes:
#: (id, dispatch flags, combine flags, engine paths). Puts and shrink have Buffers of their own below.
FORMATS = [
    ("bf16", dict(use_fp8=False), dict(), {}),
    ("fp8", dict(use_fp8=True), dict(), {}),
    ("fp8-logfmt", dict(use_fp8=True), dict(use_logfmt=True), {}),
    ("bf16-zero_copy", dict(use_fp8=False), dict(zero_copy=True), {}),
    ("fp8-per_expert", dict(use_fp8=True), dict(), dict(per_expert=True, staged=False)),
    ("fp8-staged-logfmt", dict(use_fp8=True), dict(use_logfmt=True), dict(per_expert=True, staged=True)),
]


def _round_data(env, ref, rng, shape, dflags, cflags):
    """Inputs of one dispatch + combine round and the reference's results (collective)."""
    t_max, hidden, num_experts, k = shape
    size = env["size"]
    x = bf16(rng, (t_max, hidden))
    topk, w = routing(rng, t_max, num_experts, k)
    r_recv, r_count, r_handle, _ = ll_dispatch(ref, x, topk, num_experts, num_max_dispatch_tokens_per_rank=t_max,
                                               **dflags)
    theirs = dispatch_arrays(r_recv, r_count, r_handle)
    expert_out = make_expert_out(rng, theirs["count"], num_experts // size, size * t_max, hidden)
    r_combined, _ = ll_combine(ref, expert_out, topk, w, r_handle, use_logfmt=cflags.get("use_logfmt", False))
    return dict(x=x, topk=topk, w=w, eo=expert_out, theirs=theirs, combined=np.asarray(r_combined))


def _hooked_round(env, buf, shape, d, dflags, cflags, late: bool) -> tuple[dict, list[str]]:
    """One hook-mode dispatch + combine of ``d``; before each send the ranks meet, and with ``late`` the last
    rank then sleeps LATE_S. Returns every rank's own send times (seconds) and its result failures."""
    import cupy

    t_max, _, num_experts, _ = shape
    rank, size = env["rank"], env["size"]
    fw = FRAMEWORKS[0]
    x_d, topk_d, w_d = (to_dev(d[key], fw, env) for key in ("x", "topk", "w"))
    stream = cupy.cuda.get_current_stream()
    send_stream = external_stream(stream_ptr(buf.get_comm_stream()), cupy.cuda.Device().id)
    times = {}

    def timed_send(name, send):
        sync()
        COMM.Barrier()
        if late and rank == size - 1:
            time.sleep(LATE_S)
        start, ends = cupy.cuda.Event(), (cupy.cuda.Event(), cupy.cuda.Event())
        start.record(stream)
        result = send()
        for end, on in zip(ends, (stream, send_stream), strict=True):  # a hook-mode send runs on the latter
            end.record(on)
        for end in ends:
            end.synchronize()
        times[name] = max(cupy.cuda.get_elapsed_time(start, end) for end in ends) / 1e3
        return result

    recv, count, handle, _e, d_hook = timed_send("dispatch send", lambda: buf.low_latency_dispatch(
        x_d, topk_d, t_max, num_experts, return_recv_hook=True, **dflags))
    d_hook()
    sync()
    failures = dispatch_failures(dispatch_arrays(recv, count, handle), d["theirs"], fp8=dflags["use_fp8"])
    if cflags.get("zero_copy"):
        from deepep_cupy.frameworks import copy_into

        eo_d = buf.get_next_low_latency_combine_buffer(handle)
        copy_into(eo_d, d["eo"])
    else:
        eo_d = to_dev(d["eo"], fw, env)
    combined, _e, c_hook = timed_send("combine send", lambda: buf.low_latency_combine(
        eo_d, topk_d, w_d, handle, return_recv_hook=True, **cflags))
    c_hook()
    sync()
    failures += combine_failures(to_np(combined), d["combined"], logfmt=cflags.get("use_logfmt", False))
    return times, failures


def _late_peer(env, buf, ref, shape, name, dflags, cflags, seed) -> list[str]:
    """A punctual round (plans made, results checked), then a round with the last rank late: every other
    rank's sends end within SEND_BOUND_S, and the results are right."""
    rng = np.random.default_rng(seed * 100 + env["rank"])
    failures = []
    for late in (False, True):
        d = _round_data(env, ref, rng, shape, dflags, cflags)
        times, f = _hooked_round(env, buf, shape, d, dflags, cflags, late)
        failures += [f"{name}, late={late}: {m}" for m in f]
        if late and env["rank"] != env["size"] - 1:
            for op, seconds in times.items():
                def bounded(op=op, seconds=seconds):
                    assert seconds < SEND_BOUND_S, f"{op} took {seconds * 1e3:.2f} ms"

                check(failures, f"{name}: {op} with a peer {LATE_S * 1e3:.0f} ms late", bounded)
        print(f"\n[rank {env['rank']}] {name} late={late}: "
              + ", ".join(f"{op} {s * 1e6:.0f} us" for op, s in times.items()), flush=True)
    return failures + kernel_error(dict(env, buf=buf))


@pytest.mark.parametrize("case", FORMATS, ids=[c[0] for c in FORMATS])
def test_late_peer_never_holds_a_send(env, case):
    """The last rank sleeps LATE_S before each of its sends; every other rank's hook-mode dispatch send and
    combine send end within SEND_BOUND_S (a send that waited for it would take LATE_S), for each format
    the planner can choose (forced one at a time), and the results match the reference."""
    name, dflags, cflags, paths = case
    failures = engine_paths(env, lambda: _late_peer(env, env["buf"], env["ref"], BIG, name, dflags, cflags, 3),
                            **paths)
    agree(failures)


def test_late_peer_over_puts(env, monkeypatch):
    """The same over NVSHMEM puts (DEEPEP_CUPY_LL_FORCE_RMA=1: staged dispatch rows, per-expert combine rows),
    BF16 and FP8 with LogFMT."""
    monkeypatch.setenv("DEEPEP_CUPY_LL_FORCE_RMA", "1")
    with collective_buffer(num_rdma_bytes=hint(T_SMALL, H_SMALL, E_SMALL), low_latency_mode=True) as buf:
        monkeypatch.delenv("DEEPEP_CUPY_LL_FORCE_RMA")
        ref = reference_oracle()
        failures = []
        for i, (dflags, cflags) in enumerate([(dict(use_fp8=False), {}), (dict(use_fp8=True), dict(use_logfmt=True))]):
            failures += _late_peer(env, buf, ref, SMALL, f"puts {i}", dflags, cflags, 5 + i)
    agree(failures)


def test_late_peer_with_shrink(env):
    """The same on a Buffer made with enable_shrink=True (every rank in the mask)."""
    with collective_buffer(num_rdma_bytes=hint(T_SMALL, H_SMALL, E_SMALL), low_latency_mode=True,
                           enable_shrink=True) as buf:
        ref = reference_oracle(enable_shrink=True)
        failures = _late_peer(env, buf, ref, SMALL, "shrink", dict(use_fp8=True), {}, 7)
    agree(failures)


# ------------------------------------------------------------------------------------------- two micro-batches
#: GPU "compute" between the overlapped calls, in clock cycles of torch.cuda._sleep (about 100 us).
COMPUTE_CYCLES = 200_000


def _tbo_calls(buf, st, fp8, delay=None):
    """The two-batch-overlap order over micro-batches 0 and 1 of ``st`` (torch tensors): dispatch sends 0, 1
    with compute after each, both dispatch hooks, combine sends 0, 1 with compute after each, both combine
    hooks. ``delay(point)`` runs on the host before each send (a late rank sleeps there); outputs land in
    ``st``."""
    import torch

    def wait(point):
        if delay is not None:
            delay(point)

    hooks = []
    for mb in (0, 1):
        wait(f"dispatch {mb}")
        recv, count, handle, _e, hook = buf.low_latency_dispatch(st[f"x{mb}"], st[f"topk{mb}"], T_BIG, E_BIG,
                                                                 use_fp8=fp8, return_recv_hook=True)
        st.update({f"recv{mb}": recv, f"count{mb}": count, f"handle{mb}": handle})
        hooks.append(hook)
        torch.cuda._sleep(COMPUTE_CYCLES)
    for hook in hooks:
        hook()
    hooks = []
    for mb in (0, 1):
        wait(f"combine {mb}")
        combined, _e, hook = buf.low_latency_combine(st[f"eo{mb}"], st[f"topk{mb}"], st[f"w{mb}"], st[f"handle{mb}"],
                                                     return_recv_hook=True, out=st.get(f"out{mb}"))
        st[f"combined{mb}"] = combined
        hooks.append(hook)
        torch.cuda._sleep(COMPUTE_CYCLES)
    for hook in hooks:
        hook()


def _plain_calls(buf, st, fp8):
    """The same two rounds one at a time (each hook right after its send)."""
    for mb in (0, 1):
        recv, count, handle, _e, hook = buf.low_latency_dispatch(st[f"x{mb}"], st[f"topk{mb}"], T_BIG, E_BIG,
                                                                 use_fp8=fp8, return_recv_hook=True)
        hook()
        combined, _e, hook = buf.low_latency_combine(st[f"eo{mb}"], st[f"topk{mb}"], st[f"w{mb}"], handle,
                                                     return_recv_hook=True)
        hook()
        st.update({f"recv{mb}": recv, f"count{mb}": count, f"handle{mb}": handle, f"combined{mb}": combined})


def _tbo_state(env, rng, fp8):
    """Inputs of two micro-batches as torch tensors, and the reference's results for each (collective)."""
    st, want = {}, []
    for mb in (0, 1):
        d = _round_data(env, env["ref"], rng, BIG, dict(use_fp8=fp8), {})
        st.update({f"{key}{mb}": to_dev(d[key], "torch", env) for key in ("x", "topk", "w", "eo")})
        want.append(d)
    return st, want


def _tbo_results(st, fp8) -> list[dict]:
    out = []
    for mb in (0, 1):
        recv = st[f"recv{mb}"]
        got = dispatch_arrays(recv, st[f"count{mb}"], st[f"handle{mb}"])
        got["combined"] = to_np(st[f"combined{mb}"])
        out.append(got)
    return out


def _tbo_compare(tag, got, plain, want, fp8) -> list[str]:
    """Overlapped results bit for bit as the plain calls', and the plain calls' as the reference's."""
    failures = []
    for mb in (0, 1):
        failures += [f"{tag}, micro-batch {mb} vs plain calls: {m}"
                     for m in dispatch_failures(got[mb], plain[mb], fp8=fp8)]
        failures += [f"{tag}, micro-batch {mb} vs plain calls: {m}"
                     for m in combine_failures(got[mb]["combined"], plain[mb]["combined"], logfmt=False)]
        failures += [f"{tag}, micro-batch {mb}, plain calls vs reference: {m}"
                     for m in dispatch_failures(plain[mb], want[mb]["theirs"], fp8=fp8)]
        failures += [f"{tag}, micro-batch {mb}, plain calls vs reference: {m}"
                     for m in combine_failures(plain[mb]["combined"], want[mb]["combined"], logfmt=False)]
    return failures


needs_torch = pytest.mark.skipif(not torch_cuda(), reason="needs torch with CUDA")


@needs_torch
@pytest.mark.parametrize("fp8", [False, True])
def test_two_batch_overlap_with_late_ranks(env, fp8):
    """The two-batch-overlap order with the ranks late by different amounts before different sends (rank r
    sleeps 15 * r ms before the first dispatch, the last rank 40 ms before the second combine, rank 0
    30 ms before the first combine): every result equals the same calls made one at a time, bit for bit,
    and those equal the reference."""
    import torch

    buf, rank, size = env["buf"], env["rank"], env["size"]
    rng = np.random.default_rng(80 + rank)
    delays = {"dispatch 0": 0.015 * rank, "combine 0": 0.03 if rank == 0 else 0.0,
              "combine 1": 0.04 if rank == size - 1 else 0.0}
    failures = []
    for rep in range(3):
        st, want = _tbo_state(env, rng, fp8)
        _plain_calls(buf, st, fp8)
        torch.cuda.synchronize()
        plain = _tbo_results(st, fp8)
        COMM.Barrier()
        _tbo_calls(buf, st, fp8, delay=lambda point: time.sleep(delays.get(point, 0.0)))
        torch.cuda.synchronize()
        failures += _tbo_compare(f"round {rep}", _tbo_results(st, fp8), plain, want, fp8)
    agree(failures + kernel_error(env))


@needs_torch
def test_two_batch_overlap_in_a_cuda_graph(env):
    """The two-batch-overlap order captured once in a torch.cuda.graph, replayed on fresh inputs with the
    ranks starting their replays at different times (rank r sleeps 10 * r ms): every replay equals the
    plain calls on the same inputs bit for bit, and the reference."""
    import torch
    from graph_common import capture, poison, warm_up

    buf, rank = env["buf"], env["rank"]
    rng = np.random.default_rng(90 + rank)
    fp8 = True
    buf.clean_low_latency_buffer(T_BIG, H_BIG, E_BIG)  # every rank on buffer half 0
    warm, _ = _tbo_state(env, rng, fp8)
    together(lambda: warm_up(lambda: _tbo_calls(buf, warm, fp8)))
    st, _ = _tbo_state(env, rng, fp8)
    for mb in (0, 1):
        st[f"out{mb}"] = torch.empty((T_BIG, H_BIG), dtype=torch.bfloat16, device=st["x0"].device)
    (graph,) = together(lambda: capture([lambda: _tbo_calls(buf, st, fp8)]))
    failures = []
    for replay in range(4):
        fresh, want = _tbo_state(env, rng, fp8)
        for key, tensor in fresh.items():
            st[key].copy_(tensor)
        outputs = [st[f"out{mb}"] for mb in (0, 1)]
        for mb in (0, 1):
            recv = st[f"recv{mb}"]
            outputs += [*(recv if isinstance(recv, (tuple, list)) else (recv,)), st[f"count{mb}"],
                        *st[f"handle{mb}"][:2]]
        poison(*outputs)
        torch.cuda.synchronize()
        COMM.Barrier()
        time.sleep(0.01 * rank)
        graph.replay()
        torch.cuda.synchronize()
        got = _tbo_results(st, fp8)
        _plain_calls(buf, fresh, fp8)
        torch.cuda.synchronize()
        failures += _tbo_compare(f"replay {replay}", got, _tbo_results(fresh, fp8), want, fp8)
    agree(failures + kernel_error(env))
