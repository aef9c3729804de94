"""Registers, spills and launchability of the intranode data kernels over a grid of block shapes.

    python tools/kernel_resources.py [--arch sm_90] [--ranks 2,4,8] [--warps 16,24,32]
                                     [--dispatch-unroll 4,6,8,14] [--combine-unroll 2,4,8] [--jobs N]
    python tools/kernel_resources.py --internode 1x2x8,1x2x16,2x2x4   (internode: L x D x channels a block)

No GPU needed: every variant is compiled with NVRTC (the options the JIT uses, plus ptxas' ``-v``) and its
ptxas report read back. Kernels: ``dispatch`` (direct and ring modes are one kernel), ``combine`` (ring
mode) and ``combine_copy`` (copy mode). A block of W warps launches only when W * 32 threads fit the
register file (65536 registers per SM on sm_80 / sm_90: at most 64 per thread for 32 warps); the kernels
declare ``__launch_bounds__(W * 32, 1)``, so ptxas stays under that by spilling instead, and the spills are
what to watch. Columns: registers, spill stores / loads in bytes (the kernel and, after "+", the
``__noinline__`` direct dispatch), stack frame, static shared memory.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REGISTERS_PER_SM = 65536
REG_ALLOC_UNIT = 256  # registers are handed out per warp in units of 256
MAX_SHARED = 227 * 1024

_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")  # not printed for every build (NVSHMEM's relocatable ones)
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PROPS = re.compile(r"Function properties for (\S+)")


def parse_ptxas(log: str) -> dict:
    """The entry function's registers and static shared memory, and stack / spills per function, from a
    ptxas ``-v`` log: ``{"registers", "smem", "functions": {name: (stack, spill stores, spill loads)}}``."""
    out: dict = {"registers": None, "smem": None, "functions": {}}
    current = None
    for line in log.splitlines():
        m = _PROPS.search(line)
        if m:
            current = m.group(1)
            continue
        m = _SPILL.search(line)
        if m and current is not None:
            out["functions"][current] = tuple(int(v) for v in m.groups())
            continue
        m = _USED.search(line)
        if m:
            smem = _SMEM.search(line)
            out["registers"], out["smem"] = int(m.group(1)), int(smem.group(1)) if smem else None
    return out


def fits(registers: int, warps: int) -> bool:
    """Whether one block of ``warps`` warps at ``registers`` per thread fits an SM's register file."""
    per_warp = -(-registers * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    return warps <= 32 and per_warp * warps <= REGISTERS_PER_SM


def variants(ranks, warps, dispatch_unrolls, combine_unrolls) -> list[tuple[str, int, int, int]]:
    out = []
    for r in ranks:
        out += [("dispatch", r, w, u) for w in warps for u in dispatch_unrolls]
        out += [(kind, r, w, u) for kind in ("combine_copy", "combine") for w in warps for u in combine_unrolls]
    return out


def spec_of(kind: str, r: int, w: int, u: int):
    """Intranode kinds: ``(ranks, warps, unroll)``; internode kinds: ``(L, D, sub_channels)``."""
    from deepep_cupy.ops.internode import engine as internode
    from deepep_cupy.ops.intranode.copy import combine_copy_spec
    from deepep_cupy.ops.intranode.engine import combine_spec, dispatch_spec

    return {"dispatch": dispatch_spec, "combine": combine_spec, "combine_copy": combine_copy_spec,
            "internode_dispatch": internode.dispatch_spec, "internode_combine": internode.combine_spec}[kind](r, w, u)


def internode_warps(kind: str, lsize: int, ndom: int, sub: int) -> int:
    """Warps of an internode block (``block_threads`` / ``combine_block_threads`` / 32)."""
    from deepep_cupy.ops.internode import engine as internode

    threads = internode.block_threads if kind == "internode_dispatch" else internode.combine_block_threads
    return threads(lsize, ndom, sub) // 32


def measure(job: tuple[str, int, int, int, str]) -> dict:
    """Worker: compile one variant with ptxas -v; the parsed report (or the error)."""
    kind, r, w, u, arch = job
    from deepep_cupy.jit.compiler import compile_cubin, compile_options
    from deepep_cupy.jit.sources import source_root

    spec = spec_of(kind, r, w, u)
    root = source_root()
    try:
        result = compile_cubin(spec, arch, root, compile_options(spec, arch, root) + ["-Xptxas=-v"])
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return {"kind": kind, "ranks": r, "warps": w, "unroll": u, "error": str(exc).splitlines()[0]}
    info = parse_ptxas(result.log)
    return {"kind": kind, "ranks": r, "warps": w, "unroll": u, **info}


def describe(row: dict) -> str:
    internode = row["kind"].startswith("internode")
    head = (f"{row['kind']:<18} {row['ranks']} x {row['warps']} S={row['unroll']:<2}" if internode else
            f"{row['kind']:<13} R={row['ranks']} {row['warps']:>2} x {row['unroll']:<2}")
    if "error" in row:
        return f"{head}  FAILED: {row['error']}"
    funcs = row["functions"]
    # Internode builds link NVSHMEM's device functions too: only the kernel itself is of interest there.
    entry = [v for k, v in funcs.items() if "direct" not in k and (not internode or "deepep_cupy" in k)]
    inner = [v for k, v in funcs.items() if "direct" in k and not internode]
    stack, st, ld = entry[0] if entry else (0, 0, 0)
    spills = f"{st}/{ld}" + (f" + {inner[0][1]}/{inner[0][2]}" if inner else "")
    warps = internode_warps(row["kind"], row["ranks"], row["warps"], row["unroll"]) if internode else row["warps"]
    ok = row["registers"] is not None and fits(row["registers"], warps) and (row["smem"] or 0) <= MAX_SHARED
    return (f"{head}  regs {row['registers']:>3}  spill st/ld {spills:<18} stack {stack:>4}  smem {row['smem']!s:>4}  "
            f"{'launches' if ok else 'DOES NOT LAUNCH'}")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _shapes(text: str) -> list[tuple[int, int, int]]:
    """``1x2x8,2x2x4`` -> [(1, 2, 8), (2, 2, 4)]."""
    try:
        out = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LxDxS[,...], got {text!r}") from None
    if not out or any(len(v) != 3 for v in out):
        raise argparse.ArgumentTypeError(f"expected LxDxS[,...], got {text!r}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--ranks", type=_ints, default=[2, 4, 8])
    p.add_argument("--warps", type=_ints, default=[16, 24, 32])
    p.add_argument("--dispatch-unroll", type=_ints, default=[4, 6, 8, 14])
    p.add_argument("--combine-unroll", type=_ints, default=[2, 4, 8])
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--internode", type=_shapes, default=None, metavar="LxDxS[,...]",
                   help="the internode dispatch and combine with L ranks a domain, D domains, S channels a block "
                        "(instead of the intranode kernels)")
    args = p.parse_args(argv)
    if args.internode:
        jobs = [(kind, lsize, ndom, sub, args.arch) for lsize, ndom, sub in args.internode
                for kind in ("internode_dispatch", "internode_combine")]
    else:
        jobs = [(*v, args.arch) for v in variants(args.ranks, args.warps, args.dispatch_unroll, args.combine_unroll)]
    failed = 0
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        for row in pool.map(measure, jobs):
            failed += "error" in row
            print(describe(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
