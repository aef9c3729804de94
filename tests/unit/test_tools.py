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
