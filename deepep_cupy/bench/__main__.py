"""Run the benchmarks under MPI and print DeepEP-style tables.

    mpirun -np 2 python -m deepep_cupy.bench [suite ...] --json out.json --plot out.png

With no suite named, every suite runs (as with ``all``). ``compiled`` (torch.compile against eager calls,
minutes of compiling) and ``ep`` (DeepEP V2's calls against the V1 calls doing the same work) run only when
named; a difference, a compile error or an implausible output there makes the exit status non-zero, and so
does a failure of ``overlap`` (hook-mode sends with a late peer, two micro-batches overlapped
with compute), which first checks its overlapped step against the same calls made one at a time. Every suite
needs a CUDA GPU per rank, except ``compiled`` and ``ep``: without a GPU they run on the NumPy reference
backend (host times only).
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import math
import os
import sys

from ..device.gpus import no_gpu_message
from ..device.group import comm_barrier
from ..tuning import gpu_model
from . import targets
from .plot import plot, plottable
from .timing import format_table, parse_sm_counts, sm_counts

SUITES = ("baselines", "intranode", "internode", "low_latency", "overlap", "host")
#: Suites that run only when named (not in ``all``).
OPT_IN = ("compiled", "ep")
#: Suites that also run without a GPU, on the NumPy reference backend.
NO_GPU_SUITES = ("compiled", "ep")
DEFAULT_SUITE_TIMEOUT_S = 240.0

_NAMES = SUITES + OPT_IN + ("all",)


def _non_negative(text: str) -> float:
    """An argparse ``type``: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def command_line() -> argparse.ArgumentParser:
    """The benchmarks' command line; its defaults are the workloads the targets (:mod:`.targets`) were set for."""
    p = argparse.ArgumentParser(prog="python -m deepep_cupy.bench", description=__doc__.replace("``", "'"),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # No `choices` here: Python 3.11's argparse checks a `nargs="*"` positional's default (or the empty list)
    # against them and rejects a command line that names no suite. The names are checked in main() instead.
    p.add_argument("suites", nargs="*", metavar="suite",
                   help=f"one or more of {', '.join(_NAMES)} (default: all, which leaves out {', '.join(OPT_IN)})")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank, normal kernels (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size of the tokens (default: %(default)s)")
    p.add_argument("--experts", type=int, default=256, help="experts, normal kernels (default: %(default)s)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default: %(default)s)")
    p.add_argument("--num-sms", type=parse_sm_counts, default=(24,), metavar="N[,N...]",
                   help="SMs of the normal kernels, one count or a comma list (8,12,24): the intranode suite "
                        "and the internode suite run once per count (default: 24)")
    p.add_argument("--ll-tokens", type=int, default=128,
                   help="tokens per rank, low-latency kernels (default: %(default)s)")
    p.add_argument("--ll-experts", type=int, default=288,
                   help="experts, low-latency kernels (default: %(default)s)")
    p.add_argument("--late-ms", type=_non_negative, default=20,
                   help="overlap suite: milliseconds the last rank sleeps before its send in the late-peer rows "
                        "(default: %(default)s)")
    p.add_argument("--compute-us", type=_non_negative, default=200,
                   help="overlap suite: microseconds of GPU work (a one-thread sleep kernel) after each send of "
                        "the two-micro-batch step (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="measure the library defaults only, no sweeps (default: off)")
    p.add_argument("--compiled-steps", type=int, default=None,
                   help="decode steps per timing loop of the compiled suite (default: 200; training: a tenth)")
    p.add_argument("--suite-timeout", type=float, default=None,
                   help=f"seconds before a hung suite is killed (default: {DEFAULT_SUITE_TIMEOUT_S:g}, "
                        "or the suite's own)")
    p.add_argument("--json", metavar="PATH", help="write all rows to this file (default: none written)")
    p.add_argument("--plot", metavar="PNG",
                   help="save a chart of the run to this PNG (each op next to the naive NCCL path and the copy "
                        "engine; python -m deepep_cupy.bench.plot redraws it from --json) (default: no chart)")
    return p


def main(argv: list[str] | None = None) -> None:
    parser = command_line()
    args = parser.parse_args(argv)
    unknown = [name for name in args.suites if name not in _NAMES]
    if unknown:
        parser.error(f"unknown suite {unknown[0]!r}; choose from {', '.join(_NAMES)}")
    named = tuple(dict.fromkeys(args.suites))
    suites = named if args.suites and "all" not in args.suites else \
        SUITES + tuple(name for name in named if name in OPT_IN)
    no_gpu = no_gpu_message(f"the benchmarks (all but the {' and '.join(NO_GPU_SUITES)} suites) need")
    if no_gpu and any(name not in NO_GPU_SUITES for name in suites):
        # One line, no traceback: the usual cause is running it on a machine without GPUs.
        sys.exit(f"{parser.prog}: {no_gpu}")
    gpu = no_gpu is None
    if not gpu:  # every suite named runs on the reference backend (also where a GPU is, but not CuPy)
        os.environ.setdefault("DEEPEP_CUPY_BACKEND", "reference")
    args.on_gpu = gpu

    os.environ.setdefault("DEEPEP_CUPY_VALIDATE", "0")
    for var in ("NVSHMEM_DISABLE_NVLS", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        os.environ.setdefault(var, "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    try:
        from mpi4py import MPI
    except ImportError:
        sys.exit(f"{parser.prog}: needs mpi4py (pip install \"deepep_cupy[mpi]\") and a launch under mpirun")

    comm = MPI.COMM_WORLD
    if gpu:
        import cupy

        cupy.cuda.Device(comm.Get_rank() % cupy.cuda.runtime.getDeviceCount()).use()
        try:
            import torch

            torch.cuda.set_device(comm.Get_rank() % torch.cuda.device_count())
        except ImportError:
            pass

    rows, fatal = [], []
    for suite in suites:
        module = importlib.import_module(f".{suite}", __package__)
        got, failure = run_suite(module, suite, comm, args)
        rows += got
        if failure:
            fatal.append(failure)
    if comm.Get_rank() == 0:
        workload = (f"{comm.Get_size()} ranks, {args.tokens} tokens x {args.hidden} hidden, top-{args.topk} of "
                    f"{args.experts} experts (low-latency: {args.ll_tokens} tokens, {args.ll_experts} experts)")
        print(f"\n{workload}")
        print(format_table(rows), flush=True)
        why_not = targets.why_not_compared(comm.Get_size(), args, cupy.cuda.runtime.getDeviceCount()) if gpu \
            else "no GPU: the reference backend ran"
        if why_not is None and all(entry["status"] == "not measured" for entry in targets.compare(rows)):
            why_not = "none of the suites run measures a tracked op"
        print(f"\n{targets.format_targets(rows)}" if why_not is None else f"\ntargets not compared: {why_not}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        if args.plot and not plottable(rows):  # e.g. the overlap or host suite alone
            print("--plot skipped: no intranode or low-latency rows to chart", file=sys.stderr)
        elif args.plot:
            try:
                where = (gpu_model() or "GPU") if gpu else "the reference backend (CPU)"
                plot(rows, args.plot, title=f"{where}, {workload}")
            except ImportError as exc:  # the numbers are printed (and in --json) already
                print(f"--plot skipped: {exc} (pip install matplotlib)", file=sys.stderr)
    if fatal:
        sys.exit(f"{parser.prog}: " + "; ".join(fatal))


def run_suite(module, suite: str, comm, args) -> tuple[list[dict], str | None]:
    """A suite's rows, and why the run must end in failure (None: it need not). A suite that raises is
    reported in its row so that the others' numbers still show; one whose ``FAIL_RUN`` is true (its
    checks are what it is for) also fails the run."""
    timeout = args.suite_timeout
    if timeout is None:  # a suite that runs once per SM count gets its budget once per count
        timeout = getattr(module, "SUITE_TIMEOUT_S", DEFAULT_SUITE_TIMEOUT_S) * \
            (len(sm_counts(args)) if getattr(module, "PER_SM_COUNT", False) else 1)
    # A suite that hangs (a peer gone, a collective mismatched) is killed with every thread's stack.
    faulthandler.dump_traceback_later(timeout, exit=True)
    failure = None
    try:
        got = module.run(comm, args)
    except Exception as exc:  # one failing suite must not hide the others' numbers
        got = [{"op": suite, "note": f"failed: {type(exc).__name__}: {exc}"}]
        if getattr(module, "FAIL_RUN", False):
            failure = f"the {suite} suite failed: {type(exc).__name__}: {exc}"
    for r in got:
        r.setdefault("suite", suite)
    comm_barrier(comm, f"bench: end of the {suite} suite")
    faulthandler.cancel_dump_traceback_later()
    return got, failure


if __name__ == "__main__":
    main()
