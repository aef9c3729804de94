"""torch.compile against eager calls: the same steps each way on the same fresh random data, results
compared bit for bit, then timed; and what the custom ops cost an eager caller.

Part 1, DeepEP's decode step (``low_latency_dispatch`` FP8 then ``low_latency_combine``, ``--ll-tokens`` x
``--hidden``, top-``--topk`` of ``--ll-experts``; default 128 x 7168, top-8 of 288), torch tensors: eager
Buffer calls; the same calls through the torch custom ops, eagerly (what compiled code runs, without
dynamo); ``torch.compile(fullgraph=True)`` with inductor; and inductor with ``mode="reduce-overhead"``
(CUDA graphs).

Part 2, a training step (``--tokens`` x ``--hidden``, top-``--topk`` of ``--experts``; default 4096 x 7168,
top-8 of 256): ``get_dispatch_layout``, ``dispatch(num_worst_tokens=ranks * tokens)``, an element-wise
stand-in for the experts, ``combine``, a loss, and its gradient with respect to the tokens. Eager with
``autograd.Function``s around the Buffer calls (as frameworks wrap DeepEP), eager through the custom ops
and their registered backward formulas, and compiled with inductor (forward and backward graphs).

Part 3, per op, host microseconds of one eager call of the Buffer method and of the registered
``torch.ops.deepep_cupy`` op with the arguments compiled code passes it (the GPU kept busy, as the ``host``
suite measures), and each one's GPU time.

Checks: before timing, every way but the eager Buffer calls runs ``CHECKS`` times on fresh random inputs,
each time right after the eager calls on the same inputs, and its outputs must equal theirs bit for bit
(where the ops define them: received rows of a slab, rows before a worst-case dispatch's padding). The
training loss, a float32 sum, is compared within ``compiled_steps.LOSS_RTOL`` of the sum of its terms'
magnitudes (inductor sums in another order); its gradient bit for bit. The first check's call includes
compiling: its wall time (slowest rank) is the "first call s" column. A compile error, an error of any
rank, or a difference fails the suite, and ``python -m deepep_cupy.bench`` then exits non-zero.

Times: "step us" is a loop of back-to-back steps between two CUDA events (the host's share counts where
it is the slower side); "host us" the host's time per step with the GPU kept busy; "GPU us" the GPU's
time per step queued behind a sleep kernel. Means over the ranks. On the NumPy reference backend (no
GPU) the compiler is ``aot_eager``, without CUDA graphs, and only host times are measured.

    mpirun -np 2 python -m deepep_cupy.bench compiled
"""

from __future__ import annotations

import faulthandler
import functools
import hashlib
import sys
import time
import traceback

from ..device.group import MPIGroup
from .compiled_steps import (
    LOSS_RTOL,
    Differs,
    decode_differences,
    decode_inputs,
    decode_step,
    training_autograd,
    training_differences,
    training_forward,
    training_inputs,
)
from .timing import format_table, park, row

__all__ = ["run", "Differs", "CompileFailed"]

FAIL_RUN = True  # the bench's entry point exits non-zero when this suite raises
SUITE_TIMEOUT_S = 1500  # unless --suite-timeout is given: the whole suite, cold compiles included
MODE_TIMEOUT_S = 420  # one way of one step: compiling, the checks and the timing
CHECKS = 4  # fresh inputs per way (with reduce-overhead: warm-up, capture, replays)
DECODE_STEPS, TRAINING_STEPS = 200, 20  # steps per timing loop (--compiled-steps sets the first)
CALLS, BATCH, WARMUP = 200, 10, 3  # part 3, as the host suite
PARK_US = 3000.0


class CompileFailed(RuntimeError):
    """Compiling or running one way of a step raised on some rank."""


class _Env:
    """The ranks, the device, timing and agreement helpers of one run."""

    def __init__(self, comm, buf, seconds: float):
        import torch

        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.deadline = time.monotonic() + seconds
        # The suite's gathers and barriers: bounded, and a rank at another one is a named error (the
        # library's messages on a duplicate of comm; only _bounded gathers on comm itself).
        self.group = MPIGroup(comm)
        self.gpu = buf.backend == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.gpu else torch.device("cpu")
        self.stream = None
        if self.gpu:
            from ..device.streams import current_stream

            self.stream = current_stream("torch", self.device.index)

    def sync(self) -> None:
        import torch

        if self.gpu:
            torch.cuda.synchronize()

    def barrier(self, what: str) -> None:
        self.group.barrier(op=f"bench compiled: {what}")

    def gather(self, obj, what: str) -> list:
        return self.group.allgather_object(obj, op=f"bench compiled: {what}")

    def mean(self, values: list) -> list:
        got = self.gather(values, "times")
        return [None if v is None else sum(g[i] for g in got) / len(got) for i, v in enumerate(values)]

    def generator(self, *name):
        import torch

        seed = int.from_bytes(hashlib.sha256(repr((*name, self.rank)).encode()).digest()[:8], "little")
        return torch.Generator(device=self.device).manual_seed(seed)

    def _events(self):
        import torch

        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def loop_us(self, fn, steps: int) -> float:
        """Microseconds per call of ``steps`` back-to-back calls (CUDA events; the host clock without GPU)."""
        fn()
        self.sync()
        self.barrier("before a timing loop")
        if not self.gpu:
            t = time.perf_counter()
            for _ in range(steps):
                fn()
            return self.mean([(time.perf_counter() - t) * 1e6 / steps])[0]
        start, end = self._events()
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        return self.mean([start.elapsed_time(end) * 1e3 / steps])[0]

    def host_gpu_us(self, fn, calls: int, batch: int, park_us: float) -> list:
        """``[host us, GPU us]`` per call: batches of calls queued behind a sleep kernel of ``park_us``
        (host time per call; GPU time per call from the end of the sleep). Host time only without GPU."""
        batch = max(1, min(batch, calls))
        rounds = max(1, calls // batch)
        for _ in range(WARMUP):
            fn()
        self.sync()
        if self.gpu:
            # The sleep must outlast the batch's host time, or the GPU waits for the host and its time
            # reads long: twice the batch at the host time of one call measured now.
            t = time.perf_counter()
            fn()
            probe_us = (time.perf_counter() - t) * 1e6
            park_us = max(park_us, 2.0 * batch * probe_us)
            self.sync()
        host = gpu = 0.0
        start, end = self._events() if self.gpu else (None, None)
        for _ in range(rounds):
            self.barrier("before a batch of calls")
            if self.gpu:
                park(self.stream, park_us)
                start.record()
            for _ in range(batch):
                t = time.perf_counter()
                fn()
                host += time.perf_counter() - t
            if self.gpu:
                end.record()
                end.synchronize()
                gpu += start.elapsed_time(end) * 1e3
        n = rounds * batch
        return self.mean([host / n * 1e6, gpu / n if self.gpu else None])


def _modes(gpu: bool) -> tuple:
    return ("default", "reduce-overhead") if gpu else ("default",)


def _compile(fn, mode: str, backend: str):
    import torch

    return torch.compile(fn, fullgraph=True, backend=backend, mode=None if mode == "default" else mode,
                         dynamic=False)


def _bounded(env, what: str, body):
    """``body()`` killed with every thread's stack after ``MODE_TIMEOUT_S``; an error on any rank raises
    ``CompileFailed`` on every rank (naming each rank's error), after all ranks got here."""
    faulthandler.dump_traceback_later(max(1.0, min(MODE_TIMEOUT_S, env.deadline - time.monotonic())), exit=True)
    error, result = "", None
    try:
        result = body()
    except Exception as exc:  # gathered: the other ranks must learn of it instead of waiting
        traceback.print_exc(file=sys.stderr)
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    finally:  # the rest of the suite stays bounded by the suite's time
        faulthandler.dump_traceback_later(max(1.0, env.deadline - time.monotonic()), exit=True)
    # On comm itself, bounded by the timer above only: a rank whose peer failed may first wait out the
    # kernels' own budget for it.
    errors = env.comm.allgather(error)
    if any(errors):  # every rank's: the first to fail may be a peer that waited for the one that failed first
        raise CompileFailed(f"{what}: " + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))
    return result


def _checked(env, fn, reference, inputs, differences) -> tuple[float, str]:
    """``CHECKS`` calls of ``fn`` on fresh inputs, each after ``reference`` on the same ones: the first
    call's wall seconds (slowest rank) and a verdict (``differences(got, want, inputs)`` lists what differs)."""
    import torch

    first, found = 0.0, []
    for check in range(CHECKS):
        args = inputs(check)
        want = reference(*args)
        env.sync()
        t = time.perf_counter()
        got = fn(*args)
        env.sync()
        if check == 0:
            first = time.perf_counter() - t
        with torch.no_grad():
            found += [f"{d} (check {check})" for d in differences(got, want, args)]
        del got, want
    gathered = env.gather(found, "differences")
    first = max(env.gather(first, "first call"))
    bad = [(r, f) for r, f in enumerate(gathered) if f]
    if bad:
        return first, f"DIFFERS on rank {bad[0][0]}: {', '.join(bad[0][1][:4])}"
    return first, f"same, {CHECKS} checks"


# ---------------------------------------------------------------------------------------------------- part 1
def decode(env, buf, args, report) -> None:
    import torch
    from torch._dynamo.utils import counters

    from ..custom_ops import low_latency as traced

    t, h, e, k = int(args.ll_tokens), int(args.hidden), int(args.ll_experts), int(args.topk)
    name = f"decode: LL dispatch FP8 + combine, {t} x {h}, top-{k} of {e}"
    eager = decode_step(buf.low_latency_dispatch, buf.low_latency_combine, t, e)
    ops = decode_step(functools.partial(traced.low_latency_dispatch, buf),
                      functools.partial(traced.low_latency_combine, buf), t, e)

    def inputs(tag):
        x, idx, w, y = decode_inputs(env.generator("decode", tag), env.device, t, h, e, k, env.size, t)
        # The experts' outputs stand in for a buffer the model keeps (in a real step a GEMM writes them):
        # a static address, which CUDA-graph trees do not copy into the graph's own input on every replay
        # (a copy of 2 x E_local x R*T x H bytes, larger than the step).
        torch._dynamo.mark_static_address(y)
        return x, idx, w, y

    ways = [("eager, custom ops", lambda: ops)]
    ways += [(f"compiled ({mode})", functools.partial(_compile, decode_step(
        buf.low_latency_dispatch, buf.low_latency_combine, t, e), mode, _backend(env))) for mode in _modes(env.gpu)]
    timing_inputs = inputs("timing")
    steps = int(getattr(args, "compiled_steps", None) or DECODE_STEPS)
    for way, make in [("eager", lambda: eager)] + ways:
        def body(way=way, make=make):
            torch._dynamo.reset()
            skips = counters["inductor"]["cudagraph_skips"]
            fn = make()
            first, verdict = (None, "the reference") if way == "eager" else _checked(
                env, fn, eager, inputs, lambda got, want, _: decode_differences(got, want))
            # A step that inductor kept out of CUDA graphs would be timed as the default mode: said, not hidden.
            if any(env.gather(counters["inductor"]["cudagraph_skips"] > skips, "skips")) and "reduce" in way:
                verdict = "FAILED: inductor kept the step out of CUDA graphs (its warning above says why)"
            loop = env.loop_us(lambda: fn(*timing_inputs), steps)
            host, gpu = env.host_gpu_us(lambda: fn(*timing_inputs), min(CALLS, steps), BATCH, PARK_US)
            return first, verdict, loop, host, gpu

        report.step(name, way, *_bounded(env, f"{name}: {way}", body))


# ---------------------------------------------------------------------------------------------------- part 2
def training(env, buf, args, report) -> None:
    import torch

    from ..custom_ops import normal as traced

    n, h, e, k = int(args.tokens), int(args.hidden), int(args.experts), int(args.topk)
    worst = n * env.size
    intranode = buf.num_nvl_ranks == buf.group_size
    name = f"training: layout + dispatch (num_worst_tokens={worst}) + combine, fwd + bwd, {n} x {h}, top-{k} of {e}"

    def with_grad(forward):
        def step(x, idx, w, probe):
            x = x.detach().requires_grad_()
            outs = forward(x, idx, w, probe)
            (grad,) = torch.autograd.grad(outs[0], x)
            return outs, grad

        return step

    eager = with_grad(training_autograd(buf, e, worst))
    ops = with_grad(training_forward(functools.partial(traced.get_dispatch_layout, buf),
                                     functools.partial(traced.dispatch, buf), functools.partial(traced.combine, buf),
                                     e, worst))

    def inputs(tag):
        return training_inputs(env.generator("training", tag), env.device, n, h, e, k)

    def differences(got, want, args):
        return training_differences(got[0], want[0], got[1], want[1], args[3], env.rank, intranode)

    def compiled():
        return with_grad(_compile(training_forward(buf.get_dispatch_layout, buf.dispatch, buf.combine, e, worst),
                                  "default", _backend(env)))

    timing_inputs = inputs("timing")
    given = getattr(args, "compiled_steps", None)
    steps = max(2, int(given) // 10) if given else TRAINING_STEPS
    for way, make in (("eager, autograd.Function", lambda: eager), ("eager, custom ops", lambda: ops),
                      ("compiled (default)", compiled)):
        def body(way=way, make=make):
            torch._dynamo.reset()
            fn = make()
            first, verdict = (None, "the reference") if way.startswith("eager, autograd") else _checked(
                env, fn, eager, inputs, differences)
            loop = env.loop_us(lambda: fn(*timing_inputs), steps)
            # Parked for longer than the host takes to queue a batch (a step's loop time bounds its host time).
            host, gpu = env.host_gpu_us(lambda: fn(*timing_inputs), 2 * max(2, steps // 5), 2, 4 * loop + PARK_US)
            return first, verdict, loop, host, gpu

        report.step(name, way, *_bounded(env, f"{name}: {way}", body))


# ---------------------------------------------------------------------------------------------------- part 3
def normal_op_pairs(env, buf, args) -> list:
    """``(op, custom op, Buffer call maker, custom-op call maker)`` of the high-throughput ops, on the
    training shape; a maker runs right before its call is timed."""
    import torch

    from ..custom_ops import normal as traced

    ops, bid = torch.ops.deepep_cupy, int(buf._compiled_op_key)
    n, e, worst = int(args.tokens), int(args.experts), int(args.tokens) * env.size
    x, idx, w, _ = training_inputs(env.generator("ops", "normal"), env.device, n, int(args.hidden), e, int(args.topk))
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
    layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    recv, _, recv_w, _, handle, _ = buf.dispatch(x, num_worst_tokens=worst, **layout)
    # The custom ops' handle as compiled code has it: built from the op's outputs (on the GPU the op
    # recognizes it as its own and skips the index checks of a caller's handle).
    op_recv, _, op_recv_w, _, op_handle, _ = traced.dispatch(buf, x, num_worst_tokens=worst, **layout)
    d_cfg, c_cfg = list(traced._resolved(buf, None, "dispatch")), list(traced._resolved(buf, None, "combine"))

    def fixed(fn):
        return lambda: fn

    return [
        ("get_dispatch_layout", "layout", fixed(lambda: buf.get_dispatch_layout(idx, e)),
         fixed(lambda: ops.layout(bid, idx, e))),
        (f"dispatch (num_worst_tokens={worst})", "dispatch", fixed(lambda: buf.dispatch(x, num_worst_tokens=worst,
                                                                                          **layout)),
         fixed(lambda: ops.dispatch(bid, x, None, per_rank, per_rdma, in_rank, per_expert, idx, w, 1, worst, d_cfg))),
        ("dispatch (cached handle)", "cached_dispatch", fixed(lambda: buf.dispatch(x, handle=handle)),
         fixed(lambda: ops.cached_dispatch(bid, x, None, list(op_handle), d_cfg))),
        ("combine", "combine", fixed(lambda: buf.combine(recv, handle, topk_weights=recv_w)),
         fixed(lambda: ops.combine(bid, op_recv, list(op_handle), op_recv_w, None, None, c_cfg))),
    ]


def low_latency_op_pairs(env, buf, args) -> list:
    """The same for the low-latency ops, on the decode shape. Each combine is timed with the handle of a
    dispatch made right before (by the Buffer, or by the custom op: its views, as compiled code has them)."""
    import torch

    from ..custom_ops import low_latency as traced

    ops, bid = torch.ops.deepep_cupy, int(buf._compiled_op_key)
    t, h, e = int(args.ll_tokens), int(args.hidden), int(args.ll_experts)
    x, idx, w, y = decode_inputs(env.generator("ops", "ll"), env.device, t, h, e, int(args.topk), env.size, t)

    def method_combine():
        handle = buf.low_latency_dispatch(x, idx, t, e, use_fp8=True)[2]
        return lambda: buf.low_latency_combine(y, idx, w, handle)

    def op_combine():
        src_info, layout_range, *_ = traced.low_latency_dispatch(buf, x, idx, t, e, use_fp8=True)[2]
        return lambda: ops.ll_combine(bid, y, idx, w, src_info, layout_range, t, h, e, False, False)

    return [
        ("low_latency_dispatch (FP8)", "ll_dispatch",
         lambda: lambda: buf.low_latency_dispatch(x, idx, t, e, use_fp8=True),
         lambda: lambda: ops.ll_dispatch(bid, x, idx, t, e, True, False, False)),
        ("low_latency_combine", "ll_combine", method_combine, op_combine),
    ]


def op_overhead(env, pairs, report) -> None:
    for op, op_name, method, custom in pairs:
        def body(method=method, custom=custom):
            return env.host_gpu_us(method(), CALLS, BATCH, PARK_US) + env.host_gpu_us(custom(), CALLS, BATCH, PARK_US)

        report.op(op, op_name, *_bounded(env, f"custom-op overhead: {op}", body))


def _backend(env) -> str:
    return "inductor" if env.gpu else "aot_eager"


# ---------------------------------------------------------------------------------------------------- report
def _us(v):
    return "-" if v is None else round(v, 1)


class _Report:
    """The rows of the run (for ``--json``) and the tables rank 0 prints."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.steps: dict[str, list[dict]] = {}
        self.ops: list[dict] = []
        self.failures: list[str] = []

    def step(self, name, way, first, verdict, loop, host, gpu) -> None:
        self.rows.append(row(f"{name}: {way}", loop, host_us=_us(host), gpu_us=_us(gpu),
                             first_call_s="-" if first is None else round(first, 2), results=verdict))
        self.steps.setdefault(name, []).append({
            "way": way, "first call s": "-" if first is None else round(first, 2), "step us": _us(loop),
            "host us": _us(host), "GPU us": _us(gpu), "results vs eager": verdict})
        if verdict.startswith(("DIFFERS", "FAILED")):
            self.failures.append(f"{name}: {way}: {verdict}")

    def op(self, op, op_name, host, gpu, op_host, op_gpu) -> None:
        self.rows.append(row(f"eager host: {op}: Buffer method", host, gpu_us=_us(gpu)))
        self.rows.append(row(f"eager host: {op}: torch.ops.deepep_cupy.{op_name}", op_host, gpu_us=_us(op_gpu)))
        self.ops.append({"op": op, "custom op": op_name, "Buffer host us": _us(host), "op host us": _us(op_host),
                         "op overhead us": _us(op_host - host), "Buffer GPU us": _us(gpu), "op GPU us": _us(op_gpu)})

    def print(self, env) -> None:
        import torch

        where = torch.cuda.get_device_name() if env.gpu else "the reference backend (CPU)"
        print(f"\ntorch.compile against eager calls: {env.size} ranks, {where}, torch {torch.__version__}, "
              f"{_backend(env)}")
        for name, ways in self.steps.items():
            print(f"\n{name}\n{format_table(ways)}")
        if self.ops:
            busy = "; GPU kept busy" if env.gpu else ""
            print(f"\nEager calls, host us per call (mean of {CALLS} calls and the ranks{busy}): the Buffer method, "
                  f"and the custom op with the arguments compiled code passes\n{format_table(self.ops)}")
        print(f"\nResults: bit for bit, only where the ops define them; the training loss within {LOSS_RTOL:g} of "
              "the sum of its terms' magnitudes (compiled code sums in another order)", flush=True)


def run(comm, args) -> list[dict]:
    """Rows of every way of both steps and of the custom-op overhead; collective. Raises ``CompileFailed``
    when a way raised on any rank and ``Differs`` when results differ (after printing the tables)."""
    import deepep_cupy

    size, hidden = comm.Get_size(), int(args.hidden)
    t, e_ll = int(args.ll_tokens), int(args.ll_experts)
    Buffer = deepep_cupy.Buffer
    nvl = max(Buffer.get_dispatch_config(size).get_nvl_buffer_size_hint(hidden * 2, size),
              Buffer.get_combine_config(size).get_nvl_buffer_size_hint(hidden * 2, size))
    rdma = Buffer.get_low_latency_rdma_size_hint(t, hidden, size, e_ll)
    buf = Buffer(comm=comm, num_nvl_bytes=nvl, num_rdma_bytes=rdma, low_latency_mode=True,
                 num_qps_per_rank=max(1, e_ll // size), explicitly_destroy=True)
    env, report = _Env(comm, buf, getattr(args, "suite_timeout", None) or SUITE_TIMEOUT_S), _Report()
    try:
        op_overhead(env, _bounded(env, "normal ops' inputs", lambda: normal_op_pairs(env, buf, args)), report)
        training(env, buf, args, report)
        env.sync()
        # The normal kernels shared the buffer: the low-latency ones need their state zeroed first.
        buf.clean_low_latency_buffer(t, hidden, e_ll)
        op_overhead(env, _bounded(env, "low-latency ops' inputs", lambda: low_latency_op_pairs(env, buf, args)),
                    report)
        decode(env, buf, args, report)
    finally:
        faulthandler.cancel_dump_traceback_later()  # the caller's own bound, if any, is the caller's
        env.sync()
        env.barrier("before destroy")
        env.group.close()
        buf.destroy()
        if env.rank == 0:
            report.print(env)
    if report.failures:
        raise Differs("; ".join(report.failures))
    return report.rows
