"""What the host-side argument tests share.

Every kernel takes one parameter struct (``cuda_src/<family>/args.cuh``) that the host reads
(deepep_cupy.ops.headers) and packs itself. :func:`layout_unit` writes a translation unit that includes the
header and ``static_assert``\\ s, for every field, the offset, size and kind the host computed, and the struct's
size: :func:`compile_unit` compiles it with NVRTC (no GPU needed), so a host layout that differs from the
compiler's fails to compile. :func:`check_packing` checks that a plan's values name every field of a struct.
"""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np

from deepep_cupy.device import launch

#: Field kind -> the code the unit's ArgKind trait gives the C type.
KIND_CODES = {"ptr": 1, "i32": 2, "i64": 3, "u32": 4, "u64": 5, "f32": 6}

_TRAIT = """\
#define DEEPEP_OFFSETOF(s, m) __builtin_offsetof(s, m)
// 1 pointer, 2 int32, 3 int64, 4 uint32, 5 uint64, 6 float (and 0 for anything else).
template <class T> struct ArgKind {
    static constexpr int value = T(0.5) != T(0) ? (sizeof(T) == 4 ? 6 : 0)
                               : T(-1) < T(0) ? (sizeof(T) == 4 ? 2 : sizeof(T) == 8 ? 3 : 0)
                                              : (sizeof(T) == 4 ? 4 : sizeof(T) == 8 ? 5 : 0);
};
template <class T> struct ArgKind<T*> { static constexpr int value = 1; };
template <class T> struct ArgKind<T* __restrict__> { static constexpr int value = 1; };
template <class T> struct ArgKind<const T> : ArgKind<T> {};
"""


def layout_unit(units, *, overrides=None) -> str:
    """A translation unit checking ``units``: ``[(header, namespace, [ArgStruct, ...]), ...]``. ``overrides``
    ``{(struct, field): offset}`` replaces the host's offset of a field (to see a wrong one rejected)."""
    overrides = overrides or {}
    lines = ['#include "common/nvrtc_compat.cuh"']
    lines += [f'#include "{header}"' for header, _, _ in units]
    lines.append(_TRAIT)
    for _, namespace, structs in units:
        for struct in structs:
            qualified = f"{namespace}::{struct.name}"
            for name, kind, offset in struct.fields():
                offset = overrides.get((struct.name, name), offset)
                size = struct.dtype.fields[name][0].itemsize
                lines.append(f'static_assert(DEEPEP_OFFSETOF({qualified}, {name}) == {offset}, '
                             f'"{struct.name}::{name}: offset is not {offset}");')
                lines.append(f'static_assert(sizeof({qualified}::{name}) == {size}, '
                             f'"{struct.name}::{name}: size is not {size}");')
                lines.append(f'static_assert(ArgKind<decltype({qualified}::{name})>::value == {KIND_CODES[kind]}, '
                             f'"{struct.name}::{name}: not of kind {kind}");')
            lines.append(f'static_assert(sizeof({qualified}) == {struct.size}, '
                         f'"{struct.name}: size is not {struct.size}");')
    return "\n".join(lines) + "\n"


def compile_unit(text: str, folder: Path, arch: str = "sm_90") -> None:
    """Compile ``text`` with NVRTC against the package's CUDA sources; raises ``CompileError`` (with the log)
    when a static_assert fails."""
    from deepep_cupy.jit import BuildSpec, source_root
    from deepep_cupy.jit.compiler import compile_cubin, compile_options

    folder = Path(folder)
    (folder / "args_layout.cu").write_text(text)
    spec = BuildSpec.make("args_layout.cu")
    compile_cubin(spec, arch, folder, compile_options(spec, arch, source_root()))


class FakeArray:
    """Stands in for a device array in argument values (its address is ``data.ptr``)."""

    data = types.SimpleNamespace(ptr=0x1000)


class _Kernel:
    name = "fake"

    class raw:  # noqa: N801 - mirrors jit.module.Kernel
        class kernel:  # noqa: N801
            ptr = 1


def check_packing(struct: launch.ArgStruct, values: dict) -> bytes:
    """``values`` names every field of ``struct`` once and packs (a LaunchPlan takes it); returns the bytes."""
    assert isinstance(values, dict)
    assert sorted(values) == sorted(struct.names), set(values) ^ set(struct.names)
    plan = launch.LaunchPlan(_Kernel, 1, 32, struct, values)
    packed = plan.block_bytes()
    assert len(packed) == struct.size
    record = np.frombuffer(packed, dtype=struct.dtype)[0]
    for name in struct.names:
        value = values[name]
        if struct.kinds[name] == "ptr" and not isinstance(value, (int, np.integer, type(None))):
            value = value.data.ptr
        assert record[name] == (0 if value is None else value), name
    return packed
