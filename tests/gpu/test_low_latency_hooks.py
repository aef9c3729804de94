"""Low-latency hooks and overlap on GPUs through the public ``deepep_cupy.Buffer`` API, against the NumPy
reference backend: hook mode, two dispatches in flight, rounds queued back to back, the timing of fused
ops next to their hook parts, and a CuPy CUDA-graph capture.

Run on every rank:  mpirun -np 2 python -m pytest tests/gpu/test_low_latency_hooks.py -q
Same conventions as test_low_latency.py (collective tests, failures gathered on every rank, 30 s kernel
wait budget); torch.cuda.graph captures are in test_torch_graphs.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_common import COMM, agree, bf16, sync, to_dev, to_np
from ll_common import (
    E_BIG,
    FRAMEWORKS,
    H_BIG,
    K_BIG,
    LL_MARKS,
    T_BIG,
    combine_both,
    combine_failures,
    dispatch_arrays,
    dispatch_failures,
    kernel_error,
    make_expert_out,
    ref_round,
    routing,
    run_round,
    with_low_latency_buffer,
)
from reference_cases import ll_dispatch

pytestmark = LL_MARKS
ENV = with_low_latency_buffer


@pytest.mark.parametrize("fp8", [False, True])
def test_hook_mode(env, fp8):
    failures, _, _ = run_round(env, FRAMEWORKS[-1], seed=11, t_max=T_BIG, hidden=H_BIG, num_experts=E_BIG, k=K_BIG,
                               fp8=fp8, hook=True)
    agree(failures)


def test_two_dispatches_in_flight(env):
    """Two hooked dispatches (both buffer halves), received afterwards, then both combines."""
    buf, ref, rank, size = env["buf"], env["ref"], env["rank"], env["size"]
    fw = FRAMEWORKS[0]
    rng = np.random.default_rng(15 + rank)
    data = []
    for _ in range(2):
        n = int(rng.integers(1, T_BIG + 1))
        x = bf16(rng, (n, H_BIG))
        topk, w = routing(rng, n, E_BIG, K_BIG)
        data.append((x, topk, w))
    results = []
    for x, topk, _ in data:
        recv, count, handle, _e, hook = buf.low_latency_dispatch(to_dev(x, fw, env), to_dev(topk, fw, env), T_BIG,
                                                                 E_BIG, use_fp8=True, return_recv_hook=True)
        results.append((recv, count, handle, hook))
    for r in results:
        r[3]()
    sync()
    COMM.Barrier()
    failures = []
    refs = []
    for (x, topk, _), (recv, count, handle, _) in zip(data, results, strict=True):
        r_recv, r_count, r_handle, _ = ll_dispatch(ref, x, topk, E_BIG, num_max_dispatch_tokens_per_rank=T_BIG,
                                                   use_fp8=True)
        failures += dispatch_failures(dispatch_arrays(recv, count, handle), dispatch_arrays(r_recv, r_count, r_handle),
                                      fp8=True)
        refs.append((r_handle, r_count))
    for (_x, topk, w), (_, _, handle, _), (r_handle, r_count) in zip(data, results, refs, strict=True):
        expert_out = make_expert_out(rng, r_count, E_BIG // size, size * T_BIG, H_BIG)
        got, want = combine_both(env, fw, expert_out, topk, w, handle, r_handle)
        failures += combine_failures(got, want, logfmt=False)
    agree(failures)


def test_back_to_back_rounds(env):
    """Four dispatch + combine rounds of different data queued with no host synchronisation in between (both
    buffer halves in flight, the peer possibly a round ahead), then all results checked."""
    buf, rank, size = env["buf"], env["rank"], env["size"]
    fw = FRAMEWORKS[0]
    rng = np.random.default_rng(60 + rank)
    rounds = []
    for _ in range(4):
        x = bf16(rng, (T_BIG, H_BIG))
        topk, w = routing(rng, T_BIG, E_BIG, K_BIG)
        theirs, expert_out, r_combined = ref_round(
            env, x, topk, w, lambda c: make_expert_out(rng, c, E_BIG // size, size * T_BIG, H_BIG))
        rounds.append(((to_dev(x, fw, env), to_dev(topk, fw, env), to_dev(w, fw, env),
                        to_dev(expert_out, fw, env)), theirs, r_combined))
    sync()
    COMM.Barrier()
    outs = []
    for (x_d, topk_d, w_d, eo_d), _, _ in rounds:
        recv, count, handle, _e, _h = buf.low_latency_dispatch(x_d, topk_d, T_BIG, E_BIG, use_fp8=True)
        combined, _e, _h = buf.low_latency_combine(eo_d, topk_d, w_d, handle)
        outs.append((recv, count, handle, combined))
    sync()
    failures = kernel_error(env)
    for i, ((recv, count, handle, combined), (_, theirs, r_combined)) in enumerate(zip(outs, rounds, strict=True)):
        ours = dispatch_arrays(recv, count, handle)
        failures += [f"round {i}: {m}" for m in dispatch_failures(ours, theirs, fp8=True)]
        failures += [f"round {i}: {m}" for m in combine_failures(to_np(combined), r_combined, logfmt=False)]
    agree(failures)


def test_fused_vs_hook_timing(env, record_property):
    """Not a benchmark and asserts nothing: prints the GPU time of a fused dispatch / combine next to the sum
    of its hook parts. A fused op much slower than its parts means the receive phase disturbs the sends
    (the symptom of spinning waits); the numbers land in the test log and the junit properties."""
    import cupy

    buf, rank, size = env["buf"], env["rank"], env["size"]
    fw = FRAMEWORKS[0]
    rng = np.random.default_rng(70 + rank)
    x_d = to_dev(bf16(rng, (T_BIG, H_BIG)), fw, env)
    topk, w = routing(rng, T_BIG, E_BIG, K_BIG)
    topk_d, w_d = to_dev(topk, fw, env), to_dev(w, fw, env)
    _, count, handle, _e, _h = buf.low_latency_dispatch(x_d, topk_d, T_BIG, E_BIG, use_fp8=True)
    eo_d = to_dev(make_expert_out(rng, to_np(count), E_BIG // size, size * T_BIG, H_BIG), fw, env)
    stream = cupy.cuda.get_current_stream()

    def timed(fn, reps=10):
        sync()
        COMM.Barrier()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(reps):
            fn()
        end.record(stream)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) * 1e3 / reps

    def hooked_dispatch():
        buf.low_latency_dispatch(x_d, topk_d, T_BIG, E_BIG, use_fp8=True, return_recv_hook=True)[4]()

    def hooked_combine():
        buf.low_latency_combine(eo_d, topk_d, w_d, handle, return_recv_hook=True)[2]()

    for _ in range(2):  # warm-up
        timed(lambda: buf.low_latency_dispatch(x_d, topk_d, T_BIG, E_BIG, use_fp8=True), 2)
        timed(lambda: buf.low_latency_combine(eo_d, topk_d, w_d, handle), 2)
        timed(hooked_dispatch, 2)
        timed(hooked_combine, 2)
    got = {
        "dispatch_fused_us": timed(lambda: buf.low_latency_dispatch(x_d, topk_d, T_BIG, E_BIG, use_fp8=True)),
        "dispatch_hook_pair_us": timed(hooked_dispatch),
        "combine_fused_us": timed(lambda: buf.low_latency_combine(eo_d, topk_d, w_d, handle)),
        "combine_hook_pair_us": timed(hooked_combine),
    }
    sync()
    for k, v in got.items():
        record_property(f"rank{rank}_{k}", round(v, 1))
    print(f"\n[rank {rank}] fused vs hook parts (us, includes launch gaps of the hook pair): "
          + ", ".join(f"{k}={v:.1f}" for k, v in got.items()), flush=True)
    agree(kernel_error(env))


def test_cuda_graph(env, monkeypatch):
    """Dispatch + combine captured once into a CUDA graph (after one eager warm-up), then replayed six times,
    each time on fresh inputs copied into the captured arrays: every replay matches the reference, and no
    kernel recorded a timeout (graph replays never raise one by themselves)."""
    import cupy

    from deepep_cupy.frameworks import copy_into

    if "cupy" not in FRAMEWORKS:
        pytest.skip("needs CuPy bfloat16 arrays")
    monkeypatch.setenv("DEEPEP_CUPY_VALIDATE", "0")
    buf, rank, size = env["buf"], env["rank"], env["size"]
    rng = np.random.default_rng(50 + rank)

    def fresh():
        x = bf16(rng, (T_BIG, H_BIG))
        topk, w = routing(rng, T_BIG, E_BIG, K_BIG)
        theirs, expert_out, r_combined = ref_round(
            env, x, topk, w, lambda c: make_expert_out(rng, c, E_BIG // size, size * T_BIG, H_BIG))
        return x, topk, w, expert_out, theirs, r_combined

    x, topk, w, expert_out, _, _ = fresh()
    x_dev, topk_dev, w_dev, eo_dev = (to_dev(a, "cupy", env) for a in (x, topk, w, expert_out))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        _, _, handle, _e, _h = buf.low_latency_dispatch(x_dev, topk_dev, T_BIG, E_BIG, use_fp8=True)
        buf.low_latency_combine(eo_dev, topk_dev, w_dev, handle)
    stream.synchronize()
    graph, error = None, None
    try:
        with stream:
            stream.begin_capture()
            try:
                recv, count, handle, _e, _h = buf.low_latency_dispatch(x_dev, topk_dev, T_BIG, E_BIG, use_fp8=True)
                combined, _e, _h = buf.low_latency_combine(eo_dev, topk_dev, w_dev, handle)
            finally:
                graph = stream.end_capture()
    except Exception as exc:  # capture not possible here: skip on every rank together
        error = f"{type(exc).__name__}: {exc}"
    errors = COMM.allgather(error)
    if any(errors):
        pytest.skip(f"stream capture failed: {[e for e in errors if e]}")
    failures = []
    for replay in range(6):
        x, topk, w, expert_out, theirs, r_combined = fresh()
        with stream:  # in place: the graph holds these pointers
            copy_into(x_dev, x)
            copy_into(topk_dev, topk)
            copy_into(w_dev, w)
            copy_into(eo_dev, expert_out)
            graph.launch(stream)
        stream.synchronize()
        failures += [f"replay {replay}: {m}" for m in kernel_error(env)]
        ours = dispatch_arrays(recv, count, handle)
        failures += [f"replay {replay}: {m}" for m in dispatch_failures(ours, theirs, fp8=True)]
        failures += [f"replay {replay}: {m}" for m in combine_failures(to_np(combined), r_combined, logfmt=False)]
    # Back to back, no host work in between: the last replay's results must still be right.
    for _ in range(4):
        graph.launch(stream)
    stream.synchronize()
    failures += [f"4 replays back to back: {m}" for m in kernel_error(env)]
    failures += [f"4 replays back to back: {m}"
                 for m in combine_failures(to_np(combined), r_combined, logfmt=False)]
    agree(failures)
