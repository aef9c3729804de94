"""Low-latency hooks and overlap on GPUs through the public ``deepep_cupy.Buffer`` API, against the NumPy
reference backend: hook mode, two dispatches in flight, rounds queued back to back, fused ops and their hook
parts queued back to back (their GPU times printed), and a CuPy CUDA-graph capture.

Run on every rank:  mpirun -np 2 python -m pytest tests/gpu/test_low_latency_hooks.py -q
Same conventions as test_low_latency.py (collective tests, failures gathered on every rank, 30 s kernel
wait budget); torch.cuda.graph captures are in test_torch_graphs.py.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from gpu_common import BF16, COMM, agree, bf16, sync, to_dev, to_np, together
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
    valid_rows,
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


#: The byte every poisoned output is filled with: no result holds it (bf16 -2.9e-16 and negative float32
#: scales, negative counts, source indices and layout ranges, none of them the -1 of an empty row).
POISON = 0xA5
#: Calls of each kind queued back to back in test_fused_and_hooked_back_to_back.
REPS = 10


def poisoned_rows(fw, env):
    """A ``[T_BIG, H_BIG]`` bf16 output on the device, every byte POISON."""
    return to_dev(np.full((T_BIG, H_BIG), POISON * 0x101, np.uint16).view(BF16), fw, env)


def held_dispatch(recv, count, handle) -> dict:
    """An FP8 dispatch's outputs as NumPy for dispatch_failures, the rows cut after the largest count (only
    rows below the counts are compared)."""
    count_np = to_np(count)
    return {"count": count_np, "src_info": to_np(handle[0]), "layout": to_np(handle[1]),
            "x": valid_rows(recv[0], count_np), "scales": valid_rows(recv[1], count_np)}


def test_fused_and_hooked_back_to_back(env, record_property):
    """REPS fused FP8 dispatches queued back to back with no host synchronisation, then REPS with the receive
    hook (each hook called right after its send), then the same for the combine (into outputs poisoned
    beforehand): every call's results equal the reference bit for bit. Every result is held until checked,
    and the fused and hooked calls run on data of their own (the warm-up on a third set), so a call that
    wrote nothing cannot pass on memory the allocator handed back from another call.

    The GPU time per call of each run of REPS is printed and recorded in the junit properties as
    information only (deepep_cupy.bench measures these ops): a fused op much slower than its hook parts
    means the receive phase disturbs the sends (the symptom of spinning waits)."""
    import cupy

    buf, rank, size = env["buf"], env["rank"], env["size"]
    fw = FRAMEWORKS[0]
    rng = np.random.default_rng(70 + rank)
    e_local, slab = E_BIG // size, size * T_BIG

    def on_device(x, topk, w, expert_out):
        return {"x": to_dev(x, fw, env), "topk": to_dev(topk, fw, env), "w": to_dev(w, fw, env),
                "eo": to_dev(expert_out, fw, env)}

    def checked_data():
        x = bf16(rng, (T_BIG, H_BIG))
        topk, w = routing(rng, T_BIG, E_BIG, K_BIG)
        theirs, expert_out, r_combined = ref_round(
            env, x, topk, w, lambda c: make_expert_out(rng, c, e_local, slab, H_BIG))
        return {**on_device(x, topk, w, expert_out), "theirs": theirs, "combined": r_combined}

    fused, hooked = checked_data(), checked_data()
    x_w = bf16(rng, (T_BIG, H_BIG))
    topk_w, w_w = routing(rng, T_BIG, E_BIG, K_BIG)
    warm = on_device(x_w, topk_w, w_w, None)
    _, count_w, handle_w, _e, _h = buf.low_latency_dispatch(warm["x"], warm["topk"], T_BIG, E_BIG, use_fp8=True)
    warm["eo"] = to_dev(make_expert_out(rng, to_np(count_w), e_local, slab, H_BIG), fw, env)
    stream = cupy.cuda.get_current_stream()
    api = []  # what a call returned against what it promises (recorded, not raised: the ranks stay in step)

    def dispatches(d, hook):
        def call():
            recv, count, handle, _e, recv_hook = buf.low_latency_dispatch(d["x"], d["topk"], T_BIG, E_BIG,
                                                                          use_fp8=True, return_recv_hook=hook)
            if (recv_hook is not None) != hook:
                api.append(f"dispatch with return_recv_hook={hook} returned hook {recv_hook!r}")
            elif hook:
                recv_hook()
            return recv, count, handle
        return [call] * REPS

    def combines(d, handle, hook, outs):
        def call(out):
            combined, _e, recv_hook = buf.low_latency_combine(d["eo"], d["topk"], d["w"], handle,
                                                              return_recv_hook=hook, out=out)
            if combined is not out:
                api.append("combine(out=...) returned another array than out")
            if (recv_hook is not None) != hook:
                api.append(f"combine with return_recv_hook={hook} returned hook {recv_hook!r}")
            elif hook:
                recv_hook()
            return combined
        return [lambda out=out: call(out) for out in outs]

    def timed(calls):
        """GPU microseconds per call of ``calls`` run back to back (launch gaps included), and their results."""
        sync()
        COMM.Barrier()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        results = [call() for call in calls]
        end.record(stream)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) * 1e3 / len(calls), results

    # Warm-up: every plan made, and the allocator grown to REPS held results of each kind.
    warm_outs = [poisoned_rows(fw, env) for _ in range(REPS)]
    for _ in range(2):
        for hook in (False, True):
            timed(dispatches(warm, hook))
            timed(combines(warm, handle_w, hook, warm_outs))
    del warm_outs
    us = {}
    us["dispatch_fused_us"], fused["dispatched"] = timed(dispatches(fused, False))
    us["dispatch_hook_pair_us"], hooked["dispatched"] = timed(dispatches(hooked, True))
    for name, d, hook in (("fused", fused, False), ("hook_pair", hooked, True)):
        outs = [poisoned_rows(fw, env) for _ in range(REPS)]
        us[f"combine_{name}_us"], d["combined_out"] = timed(combines(d, d["dispatched"][0][2], hook, outs))
    sync()
    failures = kernel_error(env) + sorted(set(api))
    for name, d in (("fused", fused), ("hooked", hooked)):
        for i, (recv, count, handle) in enumerate(d["dispatched"]):
            failures += [f"{name} dispatch {i}: {m}"
                         for m in dispatch_failures(held_dispatch(recv, count, handle), d["theirs"], fp8=True)]
        for i, combined in enumerate(d["combined_out"]):
            failures += [f"{name} combine {i}: {m}"
                         for m in combine_failures(to_np(combined), d["combined"], logfmt=False)]
    for k, v in us.items():
        record_property(f"rank{rank}_{k}", round(v, 1))
    print(f"\n[rank {rank}] fused vs hook parts (us per call, includes launch gaps of the hook pair): "
          + ", ".join(f"{k}={v:.1f}" for k, v in us.items()), flush=True)
    agree(failures)


def poison_cupy(arrays, stream) -> None:
    """Every byte of each CuPy array in ``arrays`` set to POISON, in ``stream`` order."""
    import cupy

    for a in arrays:
        cupy.cuda.runtime.memsetAsync(a.data.ptr, POISON, a.nbytes, stream.ptr)


@pytest.mark.skipif("cupy" not in FRAMEWORKS, reason="needs a CuPy that holds bfloat16 arrays")
def test_cuda_graph(env, monkeypatch):
    """Dispatch + combine captured once into a CUDA graph (after one eager warm-up), then replayed six times,
    each time on fresh inputs copied into the captured arrays and with every captured output poisoned
    first: every replay matches the reference bit for bit, and no kernel recorded a timeout (graph replays
    never raise one by themselves). Then, outputs poisoned again, four replays back to back with no host
    work in between: the last one's results match the reference too. A capture that raises on any rank
    fails the test on every rank."""
    import cupy

    from deepep_cupy.frameworks import copy_into

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

    def capture():
        with stream:
            stream.begin_capture()
            try:
                recv, count, handle, _e, _h = buf.low_latency_dispatch(x_dev, topk_dev, T_BIG, E_BIG, use_fp8=True)
                combined, _e, _h = buf.low_latency_combine(eo_dev, topk_dev, w_dev, handle)
            except BaseException:
                with contextlib.suppress(Exception):  # leave capture mode; the call's own error is reported
                    stream.end_capture()
                raise
            return stream.end_capture(), recv, count, handle, combined

    graph, recv, count, handle, combined = together(capture)
    outputs = (recv[0], recv[1], count, handle[0], handle[1], combined)
    failures = []
    for replay in range(6):
        x, topk, w, expert_out, theirs, r_combined = fresh()
        with stream:  # in place: the graph holds these pointers
            poison_cupy(outputs, stream)
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
    poison_cupy(outputs, stream)
    for _ in range(4):
        graph.launch(stream)
    stream.synchronize()
    failures += [f"4 replays back to back: {m}" for m in kernel_error(env)]
    failures += [f"4 replays back to back: {m}"
                 for m in dispatch_failures(dispatch_arrays(recv, count, handle), theirs, fp8=True)]
    failures += [f"4 replays back to back: {m}"
                 for m in combine_failures(to_np(combined), r_combined, logfmt=False)]
    agree(failures)
