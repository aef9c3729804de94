"""``python -m deepep_cupy.jit precompile``: compile the shipped kernels into the cache ahead of time.

Usage::

    python -m deepep_cupy.jit precompile [--arch sm_90 ...] [--jobs N] [family ...]

Families: layout, intranode, internode, low_latency (default: all). A family's shipped kernels are what its
module's ``representative_builds()`` returns. Each kernel is looked up in the cache first; a verified
entry is counted as such, a missing or refused one (altered, damaged, not ours) is compiled, so running
the command again repairs the cache. The cache is the one ``$DEEPEP_CUPY_CACHE_DIR`` names. No GPU is
needed: the default architecture is that of the first visible GPU, else sm_90. It needs NVRTC, nvJitLink
and the CUDA, CCCL and NVSHMEM headers (``pip install "deepep_cupy[compile]"``, or the cuda13/cuda12
extra); they are looked for once before any kernel, so a missing piece is one line, not one failure per
kernel.

Compiles run in worker processes, one per usable CPU: a compile is single-threaded CPU work, and processes
share no NVRTC or nvJitLink state, so they need nothing from those libraries' thread safety (two threads
of one process compiled no faster than one after the other when measured).
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from ..ops import BUILD_MODULES
from .cache import build_with_status, cache_dir, check_entry, entry_for
from .compiler import first_device_arch, normalize_arch, nvjitlink_version, nvrtc_version, toolchain
from .spec import BuildSpec

__all__ = ["FAMILIES", "DEFAULT_ARCH", "COMPILE_INSTALL", "Job", "Report", "family_specs", "default_arch", "plan",
           "missing_toolkit", "run", "main"]

#: Kernel family -> the module whose ``representative_builds()`` lists its shipped kernels (imported lazily).
FAMILIES = BUILD_MODULES
DEFAULT_ARCH = "sm_90"
#: What installs NVRTC, nvJitLink and the headers the kernels compile with, without CuPy or a GPU.
COMPILE_INSTALL = 'pip install "deepep_cupy[compile]" (or the cuda13 or cuda12 extra, which include it)'
_FAILURE_LINES = 30  # of a failure's message (compiler log, source lines) repeated after the summary


@dataclass(frozen=True)
class Job:
    """One kernel of one family for one architecture."""

    family: str
    spec: BuildSpec
    arch: str

    def describe(self) -> str:
        return f"{self.family}: {self.spec.describe()} for {self.arch}"


@dataclass
class Report:
    """What a run did: counts, plus the failures' messages."""

    compiled: int = 0
    repaired: int = 0  # of ``compiled``: an entry was there but failed its checks
    verified: int = 0
    failed: list[str] = field(default_factory=list)  # one message per kernel that did not compile

    @property
    def total(self) -> int:
        return self.compiled + self.verified + len(self.failed)


def family_specs(family: str) -> list[BuildSpec]:
    """The shipped kernels of ``family`` (a key of :data:`FAMILIES`)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; choose from {', '.join(FAMILIES)}")
    module = importlib.import_module(FAMILIES[family])
    return list(module.representative_builds())


def default_arch() -> str:
    """The first visible GPU's ``sm_XX``, else :data:`DEFAULT_ARCH`."""
    return first_device_arch() or DEFAULT_ARCH


def plan(families: Sequence[str], archs: Sequence[str]) -> list[Job]:
    """Every (family, kernel, arch) to provide, each once, in a stable order."""
    jobs: dict[tuple[BuildSpec, str], Job] = {}
    for family in families:
        for spec in family_specs(family):
            for arch in archs:
                jobs.setdefault((spec, arch), Job(family, spec, arch))
    return list(jobs.values())


def missing_toolkit(jobs: Sequence[Job]) -> list[str]:
    """The pieces ``jobs`` need that cannot be found: NVRTC and the CUDA and CCCL headers, and for kernels
    that link NVSHMEM, nvJitLink, NVSHMEM's headers and ``libnvshmem_device.a``. Empty when nothing is missing.

    The libraries are looked for with the loader ``cuda.bindings`` loads them with (``cuda.pathfinder``).
    """
    nvshmem = any(job.spec.nvshmem for job in jobs)
    missing = []
    try:
        from cuda import pathfinder
    except ImportError:
        missing.append("cuda.pathfinder")
    else:
        not_found = tuple(getattr(pathfinder, name) for name in ("DynamicLibNotFoundError",
                                                                 "DynamicLibNotAvailableError")
                          if hasattr(pathfinder, name))
        for lib in ("nvrtc", "nvJitLink") if nvshmem else ("nvrtc",):
            try:
                pathfinder.load_nvidia_dynamic_lib(lib)
            except not_found:
                missing.append(f"lib{lib}.so")
    tc = toolchain()
    if not any(Path(d, "cuda_runtime.h").is_file() for d in tc.cuda_include_dirs):
        missing.append("the CUDA headers (cuda_runtime.h)")
    if not any(Path(d, "cuda", "std", "cstdint").is_file() for d in tc.cuda_include_dirs):
        missing.append("the CCCL headers (cuda/std/cstdint)")
    if nvshmem and not (tc.nvshmem_include_dir and tc.nvshmem_device_lib):
        missing.append("the NVSHMEM headers and libnvshmem_device.a")
    return missing


def _build(job: Job) -> tuple[bool, str | None, float]:
    """Worker: ``(compiled, why an existing entry was refused, seconds)``."""
    start = time.perf_counter()
    compiled, refused = build_with_status(job.spec, job.arch, quiet=True)
    return not compiled.from_cache, refused, time.perf_counter() - start


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def run(jobs: Sequence[Job], workers: int | None = None, out=None) -> Report:
    """Verify each job's cache entry; compile those missing or refused, in ``workers`` processes.

    Arguments:
        jobs: from :func:`plan`.
        workers: processes that compile at once; None means one per usable CPU (at most one per job).
        out: where the progress lines go (default stdout).

    Returns:
        The :class:`Report`; failed compiles are in it, not raised.
    """
    out = sys.stdout if out is None else out
    report = Report()
    done = 0

    def line(text: str) -> None:
        nonlocal done
        done += 1
        print(f"[{done}/{len(jobs)}] {text}", file=out, flush=True)

    todo: list[tuple[Job, str | None]] = []
    for job in jobs:
        try:
            entry, claims, _, _ = entry_for(job.spec, job.arch)
            meta, refused = check_entry(entry, claims)
        except Exception:  # e.g. no NVSHMEM headers: the build below fails the same way and reports it
            meta, refused = None, None
        if meta is not None:
            report.verified += 1
            line(f"verified {job.describe()}")
        else:
            todo.append((job, refused))

    def record(job: Job, seen: str | None, outcome) -> None:
        if isinstance(outcome, BaseException):
            lines = str(outcome).strip().splitlines() or [""]
            shown = lines[:_FAILURE_LINES] + ([f"... ({len(lines) - _FAILURE_LINES} more lines)"]
                                               if len(lines) > _FAILURE_LINES else [])
            report.failed.append(f"FAILED {job.describe()}: {type(outcome).__name__}: " + "\n  ".join(shown))
            line(f"FAILED {job.describe()}: {type(outcome).__name__}: {lines[0]}")
            return
        compiled, refused, seconds = outcome
        refused = refused or seen
        if not compiled:  # another process put a verified entry there meanwhile
            report.verified += 1
            line(f"verified {job.describe()}")
            return
        report.compiled += 1
        if refused:
            report.repaired += 1
            line(f"repaired {job.describe()} in {seconds:.1f} s (the entry {refused})")
        else:
            line(f"compiled {job.describe()} in {seconds:.1f} s")

    count = min(len(todo), workers or _usable_cpus())
    if count <= 1:
        for job, seen in todo:
            try:
                outcome = _build(job)
            except Exception as exc:  # reported in the summary; the other kernels still get built
                outcome = exc
            record(job, seen, outcome)
        return report
    # spawn: the workers need no CUDA context, and a fork after the driver was asked for the GPU is unsafe.
    with ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_build, job): (job, seen) for job, seen in todo}
        for future in as_completed(futures):
            job, seen = futures[future]
            exc = future.exception()
            record(job, seen, exc if exc is not None else future.result())
    return report


def _key_versions(jobs: Sequence[Job]) -> str:
    """The toolkit versions in the jobs' cache keys (another install of the same versions finds the
    entries, wherever it lives: cache.cache_key)."""
    versions = {k: v for k, v in toolchain().versions.items() if k != "nvshmem_device_lib_bytes"}
    versions["nvrtc"] = nvrtc_version()
    if any(job.spec.nvshmem for job in jobs):
        versions["nvjitlink"] = nvjitlink_version()
    else:
        versions = {k: v for k, v in versions.items() if not k.startswith("nvshmem")}
    return ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))


def _archs(values: Sequence[str] | None) -> list[str]:
    archs: list[str] = []
    for value in values or [default_arch()]:
        for part in value.split(","):
            if part.strip():
                arch = normalize_arch(part)
                if arch not in archs:
                    archs.append(arch)
    return archs


def main(argv: Sequence[str] | None = None) -> int:
    """The ``precompile`` command; returns the exit status (1 when a kernel failed to compile)."""
    parser = argparse.ArgumentParser(
        prog="python -m deepep_cupy.jit precompile",
        description="Compile deepep_cupy's kernels into the kernel cache ($DEEPEP_CUPY_CACHE_DIR) ahead of "
        "time, so that the first call of each op does not wait for NVRTC; entries already there are verified, "
        "and rebuilt when they fail their checks. It needs no GPU, but NVRTC, nvJitLink and the CUDA headers: "
        f"{COMPILE_INSTALL}.",
    )
    parser.add_argument("families", nargs="*", metavar="family",
                        help=f"kernel families to compile: {', '.join(FAMILIES)} (default: all)")
    parser.add_argument("--arch", action="append", metavar="ARCH",
                        help="GPU architecture, e.g. sm_90; repeat or separate with commas for several "
                        f"(default: the first visible GPU's, else {DEFAULT_ARCH})")
    parser.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                        help="compiles at once (default: one per usable CPU)")
    args = parser.parse_args(argv)
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown family {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    try:
        archs = _archs(args.arch)
    except ValueError as exc:
        parser.error(f"--arch: {exc}")
    families = list(dict.fromkeys(args.families)) or list(FAMILIES)

    start = time.perf_counter()
    try:
        jobs = plan(families, archs)
    except (ImportError, AttributeError) as exc:  # a family module moved or lost representative_builds()
        print(f"precompile: cannot list the kernels of {', '.join(families)}: {exc}", file=sys.stderr)
        return 2
    missing = missing_toolkit(jobs)
    if missing:  # every kernel would fail the same way: say it once, with the fix
        print(f"precompile: cannot compile, not found: {', '.join(missing)}; {COMPILE_INSTALL}", file=sys.stderr)
        return 1
    print(f"precompile: {len(jobs)} kernels of {', '.join(families)} for {', '.join(archs)} into {cache_dir()}",
          flush=True)
    print(f"precompile: the entries serve installs of {_key_versions(jobs)}", flush=True)
    report = run(jobs, args.jobs)
    repaired = f" ({report.repaired} repaired)" if report.repaired else ""
    print(f"precompile: {report.compiled} compiled{repaired}, {report.verified} verified from the cache, "
          f"{len(report.failed)} failed in {time.perf_counter() - start:.1f} s", flush=True)
    for failure in report.failed:
        print(failure, file=sys.stderr, flush=True)
    return 1 if report.failed else 0
