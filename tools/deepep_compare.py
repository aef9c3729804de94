"""The loops users run, timed through whatever ``import deep_ep`` loads: DeepEP itself, or this library with
``DEEPEP_CUPY_AS_DEEP_EP=1``. Run it once each way on the same machine to compare them:

    mpirun -np 2 python tools/deepep_compare.py                                  # DEEPEP_CUPY_AS_DEEP_EP=1 set
    mpirun -np 2 -x PYTHONPATH=<DeepEP checkout> python tools/deepep_compare.py  # DeepEP

torch tensors, one GPU per rank, NCCL process group (set up from Open MPI's or torchrun's variables).
Rows: the decode step (low-latency FP8 dispatch + combine, 128 x 7168, top-8 of 288) back to back with one
event pair around all steps, with an event pair around each step (DeepEP's ``tests/utils.py`` ``bench``),
and replayed from a ``torch.cuda.graph``; the host time of each of its two calls in a back-to-back loop; one
``get_dispatch_layout`` call with its host time (4096 x 8 of 256), the same calls back to back with an event
pair around each (as DeepEP's ``test_intranode.py`` times its "[layout]" line), and the host time per call of the layout,
the cached BF16 dispatch and the combine (4096 x 7168) called back to back; and a Megatron-style training step (4096 x 7168 BF16, top-8 of 256: layout, dispatch with top-k
weights and combine forward; combine of the gradients and cached dispatch backward; ``async_finish`` with
``EventOverlap(EventHandle())`` previous events, as Megatron-Core calls them). Rank 0 prints the means
over ranks.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist


def import_deep_ep():
    """``import deep_ep``. With ``DEEPEP_CUPY_AS_DEEP_EP`` set, through ``deepep_cupy.as_deep_ep()``, which works
    where the library's start-up hook is not installed too (a source checkout on ``PYTHONPATH``, as on the GPU
    machines): the variable alone would leave ``deep_ep`` missing there. Unset, deepep_cupy is not imported."""
    if os.environ.get("DEEPEP_CUPY_AS_DEEP_EP"):
        from deepep_cupy import alias

        if alias._mode() != "off":  # the variable read as the hook reads it (0, false, ... turn it off)
            return alias.as_deep_ep()
    import deep_ep

    return deep_ep


def init_group(port: int = 29533) -> tuple[int, int]:
    """(rank, size) of an NCCL process group over Open MPI's or torchrun's variables, one GPU a rank."""
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", 0)))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", rank=rank, world_size=size, device_id=torch.device("cuda", torch.cuda.current_device()))
    return rank, size


def _routing(tokens: int, experts: int, topk: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand((tokens, experts), device="cuda", generator=g) + 1
    return torch.topk(scores, topk, dim=-1).indices.to(torch.int64)


def events_over(fn, n: int) -> float:
    """Microseconds a call of ``fn`` over ``n`` calls between one pair of events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def _event_times(fn, n: int) -> list[float]:
    """Microseconds between an event pair around each of ``n`` back-to-back calls, the first left out."""
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in pairs[1:]]


def _events_each(fn, n: int) -> float:
    return statistics.fmean(_event_times(fn, n))


def main() -> None:
    deep_ep = import_deep_ep()
    from deep_ep.utils import EventHandle, EventOverlap

    rank, size = init_group()
    group = dist.new_group(list(range(size)))
    rows: list[tuple[str, float]] = []
    # ---- decode step
    t, hidden, ll_experts, topk = 128, 7168, 288, 8
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(t, hidden, size, ll_experts)
    ll = deep_ep.Buffer(group, num_rdma_bytes=rdma, low_latency_mode=True, num_qps_per_rank=ll_experts // size,
                        explicitly_destroy=True)
    x = torch.randn((t, hidden), dtype=torch.bfloat16, device="cuda") * 0.5
    idx = _routing(t, ll_experts, topk, 7 + rank)
    w = torch.rand((t, topk), dtype=torch.float32, device="cuda")
    out = torch.randn((ll_experts // size, size * t, hidden), dtype=torch.bfloat16, device="cuda") * 0.1

    def step():
        _, _, handle, _, _ = ll.low_latency_dispatch(x, idx, t, ll_experts, use_fp8=True)
        ll.low_latency_combine(out, idx, w, handle)

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    dist.barrier(group)
    rows.append(("decode step, back to back (one event pair)", events_over(step, 200)))
    dist.barrier(group)
    rows.append(("decode step, an event pair per step", _events_each(step, 200)))
    dist.barrier(group)
    host_d, host_c = [], []
    for _ in range(200):
        t0 = time.perf_counter()
        _, _, handle, _, _ = ll.low_latency_dispatch(x, idx, t, ll_experts, use_fp8=True)
        t1 = time.perf_counter()
        ll.low_latency_combine(out, idx, w, handle)
        host_d.append(t1 - t0)
        host_c.append(time.perf_counter() - t1)
    torch.cuda.synchronize()
    rows.append(("low_latency_dispatch, host time per call (median)", statistics.median(host_d) * 1e6))
    rows.append(("low_latency_combine, host time per call (median)", statistics.median(host_c) * 1e6))
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier(group)
    rows.append(("decode step, CUDA graph replay", events_over(graph.replay, 200)))
    torch.cuda.synchronize()
    del graph
    dist.barrier(group)
    ll.destroy()
    # ---- normal ops
    tokens, experts = 4096, 256
    nvl = max(deep_ep.Buffer.get_dispatch_config(size).get_nvl_buffer_size_hint(hidden * 2, size),
              deep_ep.Buffer.get_combine_config(size).get_nvl_buffer_size_hint(hidden * 2, size))
    buf = deep_ep.Buffer(group, num_nvl_bytes=nvl, explicitly_destroy=True)
    xs = torch.randn((tokens, hidden), dtype=torch.bfloat16, device="cuda") * 0.5
    nidx = _routing(tokens, experts, topk, 11 + rank)
    nw = torch.rand((tokens, topk), dtype=torch.float32, device="cuda")
    for _ in range(5):
        buf.get_dispatch_layout(nidx, experts)
    samples = []
    for _ in range(30):
        torch.cuda.synchronize()
        dist.barrier(group)
        t0 = time.perf_counter()
        buf.get_dispatch_layout(nidx, experts)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6)
    rows.append(("get_dispatch_layout, one call with its host time", statistics.median(samples)))
    # As DeepEP's test_intranode.py times its "[layout] Kernel performance" line: 50 calls back to back, an
    # event pair around each, the mean (an idle GPU: the host's time per call shows).
    for _ in range(50):
        buf.get_dispatch_layout(nidx, experts)
    times = _event_times(lambda: buf.get_dispatch_layout(nidx, experts), 50)
    rows.append(("get_dispatch_layout, an event pair per call (mean)", statistics.fmean(times)))
    rows.append(("get_dispatch_layout, an event pair per call (median)", statistics.median(times)))
    torch.cuda.synchronize()
    dist.barrier(group)
    host_l = []
    for _ in range(100):
        t0 = time.perf_counter()
        buf.get_dispatch_layout(nidx, experts)
        host_l.append(time.perf_counter() - t0)
    rows.append(("get_dispatch_layout, host time per call (median)", statistics.median(host_l) * 1e6))
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(nidx, experts)
    recv_x, _, _, _, handle, _ = buf.dispatch(xs, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                                              is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    torch.cuda.synchronize()
    dist.barrier(group)
    host_d, host_c = [], []
    for _ in range(30):
        t0 = time.perf_counter()
        buf.dispatch(xs, handle=handle)
        t1 = time.perf_counter()
        buf.combine(recv_x, handle)
        host_d.append(t1 - t0)
        host_c.append(time.perf_counter() - t1)
    torch.cuda.synchronize()
    rows.append(("dispatch (cached handle), host time per call (median)", statistics.median(host_d) * 1e6))
    rows.append(("combine, host time per call (median)", statistics.median(host_c) * 1e6))

    def train_step():
        previous = EventOverlap(EventHandle())
        per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(
            nidx, experts, previous_event=previous, async_finish=True, allocate_on_comm_stream=True)
        recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
            xs, topk_idx=nidx, topk_weights=nw, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, previous_event=event, async_finish=True,
            allocate_on_comm_stream=True)
        event.current_stream_wait()
        combined, _, event = buf.combine(recv_x, handle, previous_event=EventOverlap(EventHandle()),
                                         async_finish=True, allocate_on_comm_stream=True)
        event.current_stream_wait()
        # Backward: the combine's backward dispatches the output gradient along the handle, the dispatch's
        # backward combines the received rows' gradients (and sums the weights').
        grad_recv, _, _, _, _, event = buf.dispatch(combined, handle=handle,
                                                    previous_event=EventOverlap(EventHandle()), async_finish=True,
                                                    allocate_on_comm_stream=True)
        event.current_stream_wait()
        grad_x, grad_w, event = buf.combine(grad_recv, handle, topk_weights=recv_w,
                                            previous_event=EventOverlap(EventHandle()), async_finish=True,
                                            allocate_on_comm_stream=True)
        event.current_stream_wait()
        return grad_x

    for _ in range(5):
        train_step()
    torch.cuda.synchronize()
    dist.barrier(group)
    rows.append(("Megatron-style forward + backward", _events_each(train_step, 20)))
    torch.cuda.synchronize()
    dist.barrier(group)
    buf.destroy()
    gathered = [None] * size
    dist.all_gather_object(gathered, rows, group=group)
    if rank == 0:
        lib = getattr(deep_ep, "__file__", "?")
        print(f"COMPARE library: {lib}")
        for i, (name, _) in enumerate(rows):
            print(f"COMPARE {name:52s} {statistics.fmean(g[i][1] for g in gathered):9.1f} us")
    dist.barrier(group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
