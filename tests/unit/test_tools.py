"""The GPU tools' own kernels still compile (NVRTC on the CPU, as every shipped kernel is checked)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the tools import CUDA packages inside main(), not at import
    return module


def test_mps_residency_kernel_compiles():
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    source = _tool("mps_residency")._SOURCE
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"mps_residency.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, 1, [b"--gpu-architecture=sm_90"])
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            pytest.fail(f"the residency probe does not compile:\n{log.decode(errors='replace')}")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_PTXAS_LOG = """\
ptxas info    : 79 bytes gmem
ptxas info    : Compiling entry function '_ZN11deepep_cupy9intranode8dispatchILi2ELi32ELi8EEEv' for 'sm_90'
ptxas info    : Function properties for _ZN11deepep_cupy9intranode8dispatchILi2ELi32ELi8EEEv
ptxas         .     512 bytes stack frame, 688 bytes spill stores, 1326 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 512 bytes cumulative stack size, 128 bytes smem
ptxas info    : Compile time = 852.097 ms
ptxas info    : Function properties for _ZN11deepep_cupy9intranode15dispatch_directILi2ELi32ELi8EEEb
ptxas         .     0 bytes stack frame, 52 bytes spill stores, 80 bytes spill loads
"""


def test_kernel_resources_reads_the_ptxas_report():
    tool = _tool("kernel_resources")
    got = tool.parse_ptxas(_PTXAS_LOG)
    assert got["registers"] == 64 and got["smem"] == 128
    assert list(got["functions"].values()) == [(512, 688, 1326), (0, 52, 80)]
    row = {"kind": "dispatch", "ranks": 2, "warps": 32, "unroll": 8, **got}
    line = tool.describe(row)
    assert "regs  64" in line and "688/1326 + 52/80" in line and line.endswith("launches")
    # 1024 threads fit at 64 registers a thread, not at 72; 768 threads at 80.
    assert tool.fits(64, 32) and not tool.fits(72, 32) and tool.fits(80, 24) and not tool.fits(88, 24)
    assert len(tool.variants([2], [16, 32], [4, 8], [2])) == 2 * 2 + 2 * 2 * 1
    # Internode kernels: L x D x channels a block; their relocatable builds print no smem, and NVSHMEM's
    # device functions are not the kernel's spills.
    assert tool._shapes("1x2x8,2X2x4") == [(1, 2, 8), (2, 2, 4)]
    log = ("ptxas info    : Function properties for _ZN11deepep_cupy9internode8dispatchILi1ELi2ELi16EEEv\n"
           "ptxas         .     120 bytes stack frame, 160 bytes spill stores, 260 bytes spill loads\n"
           "ptxas info    : Used 64 registers, used 1 barriers\n"
           "ptxas info    : Function properties for _Z14nvshmemi_fenceIL13threadgroup_t3EEviPii\n"
           "ptxas         .     8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n")
    got = tool.parse_ptxas(log)
    assert got["registers"] == 64 and got["smem"] is None
    line = tool.describe({"kind": "internode_dispatch", "ranks": 1, "warps": 2, "unroll": 16, **got})
    assert "1 x 2 S=16" in line and "160/260 " in line and line.endswith("launches")  # 1024 threads, 64 regs


def _phase_codes() -> dict[str, int]:
    """PhaseCode's enumerators as the kernels' header defines them (each one more than the last unless given)."""
    import re

    text = (TOOLS.parent / "cuda_src" / "internode" / "buffer_map.cuh").read_text()
    body = re.search(r"enum PhaseCode : int \{(.*?)\};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    codes, value = {}, None
    for item in (part.strip() for part in body.split(",")):
        if not item:
            continue
        name, _, given = item.partition("=")
        value = int(given) if given.strip() else value + 1
        codes[name.strip()] = value
    return codes


def test_wait_profile_names_every_phase_in_its_own_counter():
    tool = _tool("internode_waits")
    codes = _phase_codes()
    assert sorted(codes.values()) == sorted(tool.PHASES), "PHASES and PhaseCode in buffer_map.cuh disagree"
    from deepep_cupy.ops.internode import engine

    # Counters are [32][2][3] by code - 400: no phase may share one with a wait kind or the role clock (431).
    taken = {code - 400 for code in engine.OP_NAMES} | {31}
    assert all(0 <= code - 400 < 31 and code - 400 not in taken for code in codes.values())
    import numpy as np

    values = np.zeros((32, 2, 3), dtype=np.uint64)
    values[31, 0] = (8_000, 2, 0)           # two sending warps, 4 us each
    values[413 - 400, 0] = (3_000, 6, 0)    # phase 413: 3 us over 6 laps
    values[403 - 400, 0] = (400, 1, 5)      # a wait kind: 1 short, 5 ready
    lines = tool.table(0, "dispatch", values, engine.OP_NAMES)
    assert lines[0].startswith("rank 0 dispatch") and "4.0 us a warp" in lines[0]
    assert any("6 laps" in line and "0.50 us a lap" in line and "row copied" in line for line in lines)
    assert any("1 short" in line and "5 ready" in line for line in lines)


def test_wait_profile_builds_compile(tmp_path, monkeypatch):
    """The diagnostics builds (DEEPEP_CUPY_WAIT_PROFILE=1: wait counters and phase clocks) of one shape."""
    pytest.importorskip("cuda.bindings.nvrtc")
    monkeypatch.setenv("DEEPEP_CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DEEPEP_CUPY_SOURCE_DIR", raising=False)
    from deepep_cupy.jit import build
    from deepep_cupy.ops.internode import engine, plans

    monkeypatch.setattr(engine, "dispatch_spec", engine.dispatch_spec)  # restored after the test
    monkeypatch.setattr(engine, "combine_spec", engine.combine_spec)
    monkeypatch.setattr(plans, "dispatch_spec", plans.dispatch_spec)
    monkeypatch.setattr(plans, "combine_spec", plans.combine_spec)
    tool = _tool("internode_waits")
    tool.use_profiled_builds()
    for spec in (engine.dispatch_spec(1, 2, 16), engine.combine_spec(1, 2, 16)):
        assert "DEEPEP_CUPY_WAIT_PROFILE" in spec.describe()
        compiled = build(spec, "sm_90")
        assert compiled.cubin_path.is_file() and compiled.cubin_path.stat().st_size > 0
