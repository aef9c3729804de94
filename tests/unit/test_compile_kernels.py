"""NVRTC compile (and NVSHMEM link) of every kernel instantiation the ops modules ship. No GPU needed.

Every family of ``deepep_cupy.ops.FAMILIES`` gives its ``representative_builds()`` (``ops.BUILD_MODULES``); each spec is built for
sm_90, and for sm_80 unless it uses NVSHMEM. Every kernel must take its family's parameter struct (the one the
host packs, ``KERNEL_STRUCTS`` of the family's args module) as its only parameter: its mangled name says so.
"""

from __future__ import annotations

import importlib
import os

import pytest

import deepep_cupy.ops
from deepep_cupy.jit import build


def _collect():
    params = []
    for family in deepep_cupy.ops.FAMILIES:
        name = deepep_cupy.ops.BUILD_MODULES[family]
        try:
            builds = importlib.import_module(name).representative_builds
        except Exception as exc:  # report it as a failing test instead of breaking collection
            params.append(pytest.param(name, None, None, exc, id=f"{family}:import"))
            continue
        for spec in builds():
            archs = ["sm_90"] if spec.nvshmem else ["sm_90", "sm_80"]
            for arch in archs:
                params.append(
                    pytest.param(name, spec, arch, None, id=f"{family}:{spec.describe()}:{arch}")
                )
    return params


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """The cache the builds share: a fresh one, or ``$DEEPEP_CUPY_TEST_JIT_CACHE`` (CI points both of its passes
    at one folder; its keys hold the compiler and toolkit versions, so a pass with other versions still
    compiles everything)."""
    shared = os.environ.get("DEEPEP_CUPY_TEST_JIT_CACHE")
    if shared:
        os.makedirs(shared, exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("jit_cache")


@pytest.mark.parametrize("module_name, spec, arch, import_error", _collect())
def test_compiles(module_name, spec, arch, import_error, shared_cache, monkeypatch):
    if import_error is not None:
        pytest.fail(f"importing {module_name} failed: {import_error!r}")
    monkeypatch.setenv("DEEPEP_CUPY_CACHE_DIR", str(shared_cache))
    monkeypatch.delenv("DEEPEP_CUPY_SOURCE_DIR", raising=False)
    compiled = build(spec, arch)
    assert compiled.cubin_path.is_file() and compiled.cubin_path.stat().st_size > 0
    assert set(compiled.lowered_names) == set(spec.name_expressions)
    family = spec.source.split("/")[0]
    structs = importlib.import_module("deepep_cupy.ops.layout" if family == "layout" else
                                      f"deepep_cupy.ops.{family}.args").KERNEL_STRUCTS
    for expression, mangled in compiled.lowered_names.items():
        struct = structs[expression.split("<")[0].split("::")[-1]].name
        # ...E (template arguments) v (void, for a template) then the one parameter: the struct, nested in the
        # family's namespace.
        returns = "v" if "<" in expression else ""
        assert mangled.endswith(f"E{returns}{_nested(struct)}"), (expression, mangled, struct)


def _nested(name: str) -> str:
    """How a class of the kernel's own namespace is mangled as its parameter (a substitution of that namespace)."""
    return f"NS0_{len(name)}{name}E"
