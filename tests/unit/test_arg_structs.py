"""The kernels' parameter structs as the host packs them against the compiler's layout (NVRTC, no GPU), and the
header reader that gives the host its one description of them."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from kernel_args import check_packing, compile_unit, layout_unit

from deepep_cupy.device import launch
from deepep_cupy.jit import CompileError
from deepep_cupy.ops import headers

#: Per family: its args header, the header's namespace, and the module whose KERNEL_STRUCTS maps every kernel of
#: the family to its struct.
FAMILIES = {
    "intranode": ("intranode/args.cuh", "deepep_cupy::intranode", "deepep_cupy.ops.intranode.args"),
    "internode": ("internode/args.cuh", "deepep_cupy::internode", "deepep_cupy.ops.internode.args"),
    "low_latency": ("low_latency/args.cuh", "deepep_cupy::low_latency", "deepep_cupy.ops.low_latency.args"),
    "layout": ("layout/args.cuh", "deepep_cupy::layout", "deepep_cupy.ops.layout"),
}


def _structs(family):
    header, namespace, module = FAMILIES[family]
    return header, namespace, importlib.import_module(module).KERNEL_STRUCTS


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_host_layout_is_the_compilers(family, tmp_path):
    """Every field's offset, size and kind and every struct's size, as the host packs them, hold in a unit the
    compiler builds from the header."""
    header, namespace, structs = _structs(family)
    assert sorted(s.name for s in structs.values()) == sorted(headers.struct_names(header))
    compile_unit(layout_unit([(header, namespace, list(structs.values()))]), tmp_path)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_wrong_offset_fails_to_compile(family, tmp_path):
    header, namespace, structs = _structs(family)
    struct = max(structs.values(), key=lambda s: len(s.names))
    name = struct.names[len(struct.names) // 2]
    wrong = {(struct.name, name): struct.offsets[name] + 4}
    with pytest.raises(CompileError, match=f"{struct.name}::{name}: offset is not"):
        compile_unit(layout_unit([(header, namespace, [struct])], overrides=wrong), tmp_path)


def test_a_wrong_kind_or_size_fails_to_compile(tmp_path):
    header, namespace, structs = _structs("intranode")
    real = structs["dispatch"]
    fields = [(n, k) for n, k, _ in real.fields()]
    as_float = launch.ArgStruct(real.name, [(n, "f32" if n == "num_tokens" else k) for n, k in fields])
    with pytest.raises(CompileError, match="DispatchArgs::num_tokens: not of kind f32"):
        compile_unit(layout_unit([(header, namespace, [as_float])]), tmp_path)
    as_long = launch.ArgStruct(real.name, [(n, "i64" if n == "cap" else k) for n, k in fields])
    with pytest.raises(CompileError, match="DispatchArgs::cap: size is not 8"):
        compile_unit(layout_unit([(header, namespace, [as_long])]), tmp_path)


def test_layout_follows_the_c_rules():
    s = launch.ArgStruct("S", [("a", "i32"), ("p", "ptr"), ("b", "i32"), ("f", "f32"), ("c", "i64"), ("d", "i32")])
    assert s.offsets == {"a": 0, "p": 8, "b": 16, "f": 20, "c": 24, "d": 32} and s.size == 40
    with pytest.raises(ValueError, match="unknown kind"):
        launch.ArgStruct("S", [("a", "float64")])
    with pytest.raises(ValueError, match="duplicate"):
        launch.ArgStruct("S", [("a", "i32"), ("a", "i32")])


def test_a_plan_packs_every_field_at_its_offset():
    s = launch.ArgStruct("S", [("a", "i32"), ("p", "ptr"), ("n", "i64"), ("u", "u64"), ("f", "f32"), ("b", "i32")])
    packed = check_packing(s, {"a": -7, "p": 0xABCDEF, "n": -(1 << 40), "u": (1 << 64) - 1, "f": 0.5, "b": 3})
    assert packed[:4] == np.int32(-7).tobytes() and packed[8:16] == np.uint64(0xABCDEF).tobytes()
    assert packed[32:36] == np.float32(0.5).tobytes() and packed[36:40] == np.int32(3).tobytes()


def test_reader_refuses_what_it_cannot_pack(tmp_path, monkeypatch):
    (tmp_path / "fam").mkdir()
    (tmp_path / "fam" / "args.cuh").write_text(
        "struct GoodArgs {\n  const int* __restrict__ p;  // c, d\n  unsigned long long u;\n  float f;\n};\n"
        "struct ListArgs { int a, b; };\nstruct ArrayArgs { int a[2]; };\nstruct BoolArgs { bool b; };\n"
        "constexpr int kAnswer = 42;\nconstexpr long long kBig = 0x100000000;\n")
    monkeypatch.setattr(headers, "packaged_source_root", lambda: tmp_path)
    good = headers.kernel_struct("fam/args.cuh", "GoodArgs")
    assert good.fields() == [("p", "ptr", 0), ("u", "u64", 8), ("f", "f32", 16)] and good.size == 24
    assert headers.struct_names("fam/args.cuh") == ["GoodArgs", "ListArgs", "ArrayArgs", "BoolArgs"]
    for name in ("ListArgs", "ArrayArgs", "BoolArgs"):
        with pytest.raises(ValueError, match=name):
            headers.kernel_struct("fam/args.cuh", name)
    with pytest.raises(LookupError, match="struct MissingArgs"):
        headers.kernel_struct("fam/args.cuh", "MissingArgs")
    assert headers.constant("fam/args.cuh", "kAnswer") == 42
    assert headers.constant("fam/args.cuh", "kBig") == 1 << 32
    with pytest.raises(LookupError, match="kMissing.*fam/args.cuh"):
        headers.constant("fam/args.cuh", "kMissing")


def test_a_plan_names_missing_and_unknown_fields():
    s = launch.ArgStruct("S", [("a", "i32"), ("p", "ptr")])
    with pytest.raises(ValueError, match="S: no value for p; no field named q"):
        launch.LaunchPlan(_kernel(), 1, 1, s, {"a": 1, "q": 2})
    with pytest.raises(TypeError, match="ArgStruct"):
        launch.LaunchPlan(_kernel(), 1, 1, [("a", "i32", 1)], {})


def _kernel():
    class Kernel:
        name = "fake"

        class raw:  # noqa: N801
            class kernel:  # noqa: N801
                ptr = 1

    return Kernel
