"""What the commands of ``python -m deepep_cupy.tuning`` share: their option types and workload options, the one
line they stop with when the machine cannot run them, and the compile step before any rank launches."""

from __future__ import annotations

import argparse
import io
import sys
import time

from ..device.gpus import no_gpu_message

__all__ = ["int_list", "workload_arguments", "check_positive", "require_gpu_and_mpi", "compile_specs"]


def int_list(text: str) -> tuple[int, ...]:
    """An argparse ``type``: ``N[,N...]``, positive, each once, in the order given."""
    try:
        values = tuple(dict.fromkeys(int(v) for v in text.split(",") if v.strip()))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers N[,N...], got {text!r}")
    return values


def workload_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's workload (tokens x hidden, top-k of experts), as options of ``p``."""
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size of the tokens (default: %(default)s)")
    p.add_argument("--experts", type=int, default=256, help="experts (default: %(default)s)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default: %(default)s)")


def check_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, names) -> None:
    """A usage error naming the first of the options ``names`` whose value is not positive."""
    for name in names:
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")


def require_gpu_and_mpi(prog: str, needs: str) -> None:
    """Stop with one line (no traceback) without a usable GPU or without mpi4py; ``needs``: "tuning needs"."""
    no_gpu = no_gpu_message(needs)
    if no_gpu:
        sys.exit(f"{prog}: {no_gpu}")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        sys.exit(f"{prog}: needs mpi4py (pip install \"deepep_cupy[mpi]\") and a launch under mpirun")


def compile_specs(family: str, specs, jobs: int | None) -> str:
    """Compile ``specs`` (of the kernel family ``family``) into the kernel cache for this machine's GPU, in
    ``jobs`` worker processes (None: one per CPU), so that no rank waits in a kernel for a peer that is still
    compiling; a line of summary and one per failure."""
    from ..jit.precompile import Job, default_arch, run

    arch, start = default_arch(), time.perf_counter()
    report = run([Job(family, s, arch) for s in specs], workers=jobs, out=io.StringIO())
    line = (f"precompile: {len(specs)} kernels for {arch}: {report.compiled} compiled, {report.verified} from the "
            f"cache, {len(report.failed)} failed, {time.perf_counter() - start:.1f} s")
    return "\n".join([line, *report.failed])
