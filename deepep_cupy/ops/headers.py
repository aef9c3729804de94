"""What the CUDA headers say once and the host reads: kernel parameter structs and shared constants.

Each family's ``cuda_src/<family>/args.cuh`` declares one struct per kernel, the kernel's only parameter,
one field per declaration::

    struct CombineArgs {
        const int4* __restrict__ x;  // [rows, hidden] bf16
        int num_topk;
        long long timeout_ns;
    };

:func:`kernel_struct` reads such a struct into an :class:`~deepep_cupy.device.launch.ArgStruct` (names,
kinds, C offsets) that a :class:`~deepep_cupy.device.launch.LaunchPlan` packs; :func:`constant` reads a
``constexpr int kName = N;`` (or ``long long``) line. Both read the package's own sources
(:func:`deepep_cupy.jit.sources.packaged_source_root`, not a source override), once per header. The unit tests compile a translation unit that
``static_assert``\\ s every offset and size computed here against the compiler's.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from ..device.launch import ArgStruct
from ..jit.sources import packaged_source_root

__all__ = ["kernel_struct", "constant", "struct_names", "header_text", "field_kind"]

# Scalar C types -> ArgStruct kinds (after qualifiers are dropped); any pointer is "ptr".
_SCALAR_KINDS = {
    "int": "i32", "int32_t": "i32", "long long": "i64", "int64_t": "i64", "unsigned int": "u32",
    "uint32_t": "u32", "unsigned long long": "u64", "uint64_t": "u64", "float": "f32",
}
_QUALIFIERS = re.compile(r"\b(const|volatile|__restrict__)\b")
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_NAME = re.compile(r"[A-Za-z_]\w*$")


@functools.cache
def _read(root: Path, header: str) -> str:
    path = root / header
    try:
        return path.read_text()
    except OSError as exc:
        raise FileNotFoundError(f"deepep_cupy: CUDA header {path} cannot be read ({exc})") from None


def header_text(header: str) -> str:
    """The text of ``header`` (a path relative to ``cuda_src/``)."""
    return _read(packaged_source_root(), header)


def field_kind(ctype: str) -> str | None:
    """The ArgStruct kind of a field of C type ``ctype`` (qualifiers allowed), or None for other types."""
    if "*" in ctype:
        return "ptr"
    return _SCALAR_KINDS.get(" ".join(_QUALIFIERS.sub(" ", ctype).split()))


def _struct_body(text: str, header: str, name: str) -> str:
    match = re.search(r"\bstruct\s+" + re.escape(name) + r"\s*\{([^{}]*)\}\s*;", text)
    if match is None:
        raise LookupError(f"deepep_cupy: no `struct {name} {{ ... }};` in cuda_src/{header}")
    return match.group(1)


def struct_names(header: str) -> list[str]:
    """Every ``struct Name { ... };`` of ``header`` whose name ends in ``Args``, in order."""
    text = _COMMENTS.sub("", header_text(header))
    return re.findall(r"\bstruct\s+(\w+Args)\s*\{", text)


@functools.cache
def _kernel_struct(root: Path, header: str, name: str) -> ArgStruct:
    body = _struct_body(_COMMENTS.sub("", _read(root, header)), header, name)
    fields = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        where = f"cuda_src/{header}, struct {name}, `{decl};`"
        if "," in decl or "[" in decl or "(" in decl or "=" in decl:
            raise ValueError(f"deepep_cupy: {where}: declare one plain field per line (no lists, arrays, "
                             "functions or initialisers)")
        found = _NAME.search(decl)
        ctype = decl[: found.start()].strip() if found else ""
        kind = field_kind(ctype) if ctype else None
        if kind is None:
            raise ValueError(f"deepep_cupy: {where}: a field must be a pointer or one of "
                             f"{', '.join(sorted(_SCALAR_KINDS))}")
        fields.append((found.group(0), kind))
    return ArgStruct(name, fields)


def kernel_struct(header: str, name: str) -> ArgStruct:
    """The parameter struct ``name`` of ``header`` (relative to ``cuda_src/``). Raises LookupError when the
    header has no such struct and ValueError for a field this reader cannot pack."""
    return _kernel_struct(packaged_source_root(), header, name)


@functools.cache
def _constant(root: Path, header: str, name: str) -> int:
    text = _COMMENTS.sub("", _read(root, header))
    value = r"\s*=\s*(-?(?:0x[0-9A-Fa-f]+|\d+))"
    match = (re.search(r"^\s*(?:static\s+)?constexpr\s+(?:int|long long|unsigned int|uint32_t|uint64_t|int64_t)\s+"
                       + re.escape(name) + value + r"\s*;", text, re.M)
             or re.search(r"^\s*" + re.escape(name) + value + r"\s*,?\s*$", text, re.M))  # an enum member
    if match is None:
        raise LookupError(f"deepep_cupy: no `constexpr int {name} = <integer>;` (or enum member `{name} = <integer>,`) "
                          f"in cuda_src/{header}")
    return int(match.group(1), 0)


def constant(header: str, name: str) -> int:
    """The integer constant ``name`` of ``header`` (``constexpr int kName = N;``, or an enum member ``kName = N,``
    on a line of its own). Raises LookupError naming the header and the constant where it has none."""
    return _constant(packaged_source_root(), header, name)
