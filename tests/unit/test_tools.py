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
