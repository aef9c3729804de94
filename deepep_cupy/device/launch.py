"""Kernel launches with their argument block packed once.

Every kernel takes one by-value parameter struct (``cuda_src/<family>/args.cuh``). An :class:`ArgStruct`
describes it: field names, kinds and C offsets (read from the header by :mod:`deepep_cupy.ops.headers`).
A :class:`LaunchPlan` holds the driver function handle, grid, block and shared memory of one kernel and the
struct's bytes in one block, with a ctypes scalar over each field's bytes. A call changes only the few
fields that differ between calls (pointers, counts) by assigning ``.value`` of the slot, then calls
``cuLaunchKernel`` with the arguments of the call itself prebuilt as C values too (function, grid, block,
shared memory, the one-entry parameter array's address), the stream written into its own slot (see
:func:`_choose_launcher`): nothing is converted at launch, which is what makes the host path of an op a
few microseconds instead of the tens that generic launchers spend packing ~30 arguments.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["ArgStruct", "LaunchPlan", "ARG_TYPES", "LAUNCHER"]

#: Argument kinds a plan understands, as ctypes types (pointers travel as 64-bit integers).
ARG_TYPES = {
    "ptr": ctypes.c_uint64,
    "i32": ctypes.c_int32,
    "i64": ctypes.c_int64,
    "u32": ctypes.c_uint32,
    "u64": ctypes.c_uint64,
    "f32": ctypes.c_float,
}
#: The same kinds as NumPy types: their C layout (``align=True``) is the struct's.
_NUMPY_TYPES = {"ptr": np.uint64, "i32": np.int32, "i64": np.int64, "u32": np.uint32, "u64": np.uint64,
                "f32": np.float32}


class ArgStruct:
    """A kernel's parameter struct: ``fields`` ``[(name, kind), ...]`` in declaration order, ``kind`` a key of
    :data:`ARG_TYPES`; offsets and size follow the C rules (each field at a multiple of its size, the size a
    multiple of the largest), as a NumPy structured dtype with ``align=True`` lays them out.

    Attributes: ``name``, ``names``, ``kinds`` (name -> kind), ``offsets`` (name -> byte offset), ``size``,
    ``dtype``.
    """

    __slots__ = ("name", "names", "kinds", "offsets", "size", "dtype")

    def __init__(self, name: str, fields: Sequence[tuple[str, str]]) -> None:
        self.name = str(name)
        self.names = tuple(n for n, _ in fields)
        if not self.names:
            raise ValueError(f"struct {name}: no fields")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"struct {name}: duplicate field names in {list(self.names)}")
        for field, kind in fields:
            if kind not in ARG_TYPES:
                raise ValueError(f"struct {name}, field {field}: unknown kind {kind!r}")
        self.kinds = dict(fields)
        self.dtype = np.dtype({"names": list(self.names), "formats": [_NUMPY_TYPES[k] for _, k in fields]},
                              align=True)
        self.offsets = {n: int(self.dtype.fields[n][1]) for n in self.names}
        self.size = int(self.dtype.itemsize)

    def fields(self) -> list[tuple[str, str, int]]:
        """``(name, kind, offset)`` of every field, in order."""
        return [(n, self.kinds[n], self.offsets[n]) for n in self.names]

    def __repr__(self) -> str:
        return f"ArgStruct({self.name}, {len(self.names)} fields, {self.size} bytes)"


def _driver():
    from cuda.bindings import driver

    return driver


class LaunchPlan:
    """One kernel launch: function, launch shape and a pre-packed parameter struct.

    Arguments:
        kernel: a loaded kernel (:class:`deepep_cupy.jit.module.Kernel` or anything with ``raw.ptr`` /
            ``ptr`` giving the ``CUfunction`` address).
        grid, block: launch dimensions (int or up to three ints).
        struct: the kernel's parameter struct (:class:`ArgStruct`).
        values: a value for every field of ``struct`` by name: an int (a pointer is its address), a float for
            ``f32``, None for a field set before every launch (0 until then), or for a pointer an array (its
            ``data.ptr``). A missing or unknown name raises ValueError naming it.
        shared_mem: dynamic shared memory bytes.

    ``plan.slot(name)`` returns the ctypes scalar over a field's bytes in the block; assign ``.value`` to
    change it. The plan keeps a reference to the kernel (and so to its module).
    """

    __slots__ = ("kernel", "grid", "block", "shared_mem", "struct", "names", "_block", "_slots", "_array",
                 "_address", "_fn", "_stream", "_call")

    def __init__(self, kernel, grid, block, struct: ArgStruct, values: Mapping[str, object],
                 shared_mem: int = 0) -> None:
        if not isinstance(struct, ArgStruct):
            raise TypeError(f"struct must be an ArgStruct, got {type(struct).__name__}")
        self.grid = _dim3(grid)
        self.block = _dim3(block)
        self.shared_mem = int(shared_mem)
        self.struct = struct
        self.names = list(struct.names)
        missing = [n for n in struct.names if n not in values]
        unknown = [n for n in values if n not in struct.kinds]
        if missing or unknown:
            raise ValueError(f"arguments of {struct.name}: " + "; ".join(
                part for part in (f"no value for {', '.join(missing)}" if missing else "",
                                  f"no field named {', '.join(map(str, unknown))}" if unknown else "") if part))
        # The struct's bytes, 8-byte aligned; each slot is a ctypes scalar over its field's bytes.
        self._block = (ctypes.c_uint64 * (-(-struct.size // 8)))()
        self._slots = {}
        for name, kind, offset in struct.fields():
            slot = ARG_TYPES[kind].from_buffer(self._block, offset)
            value = values[name]
            if value is not None:
                try:
                    slot.value = _field_value(kind, value)
                except (TypeError, ValueError, AttributeError) as exc:
                    raise ValueError(f"argument {name} of {struct.name}: {exc}") from None
            self._slots[name] = slot
        # cuLaunchKernel's kernelParams: one entry, the struct.
        self._array = (ctypes.c_void_p * 1)(ctypes.addressof(self._block))
        self._address = ctypes.addressof(self._array)
        self._bind(kernel)

    def _bind(self, kernel) -> None:
        """Make ``kernel`` the plan's function."""
        self.kernel = kernel
        self._fn = _function_address(kernel)
        # cuLaunchKernel's whole argument list as C values, fixed for the plan's life but the stream,
        # which each launch writes into its slot (one per plan: a plan made by with_kernel has its own).
        self._stream = ctypes.c_void_p()
        self._call = (ctypes.c_void_p(self._fn), *(ctypes.c_uint(d) for d in (*self.grid, *self.block)),
                      ctypes.c_uint(self.shared_mem), self._stream, ctypes.c_void_p(self._address),
                      ctypes.c_void_p())
        # Static and dynamic shared memory together past 48 KiB need the opt-in for the dynamic part.
        if self.shared_mem > 0 and self.shared_mem + _static_shared(self._fn) > _DEFAULT_SHARED_LIMIT:
            _allow_shared(self._fn, self.shared_mem, kernel)

    def with_kernel(self, kernel) -> LaunchPlan:
        """A plan launching ``kernel`` (same parameter list) with this plan's shape and argument block:
        a patch to either plan's slots is seen by both."""
        other = object.__new__(LaunchPlan)
        for name in LaunchPlan.__slots__:
            setattr(other, name, getattr(self, name))
        other._bind(kernel)
        return other

    def slot(self, name: str):
        """The ctypes scalar over field ``name`` (set ``.value`` to patch it)."""
        return self._slots[name]

    def block_bytes(self) -> bytes:
        """The struct's bytes as the next launch passes them."""
        return ctypes.string_at(ctypes.addressof(self._block), self.struct.size)

    def value(self, name: str):
        return self._slots[name].value

    def set(self, **values) -> None:
        """Patch several arguments by name (convenience; hot paths keep the slots and assign directly)."""
        for name, v in values.items():
            self._slots[name].value = v

    def launch(self, stream: int) -> None:
        """Launch on the CUDA stream handle ``stream`` (an int; 0 is the legacy default stream)."""
        self._stream.value = stream
        err = _launch(*self._call)
        if err:
            _raise_launch_error(err, self.kernel, f"grid {self.grid}, block {self.block}, {self.shared_mem} bytes of "
                                f"dynamic shared memory{_shared_limits(self._fn)}")


#: ``cuLaunchKernel`` of ``cuda.bindings``, and the ``CUfunction`` objects of the functions launched through
#: it (made once: the bindings convert a plain int into one on every call).
_cu_launch = None
_functions: dict = {}


def _bindings_launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra) -> int:
    """The same call through ``cuda.bindings`` (its arguments are the plan's C values)."""
    function = _functions.get(fn.value)
    if function is None:
        function = _functions[fn.value] = _driver().CUfunction(fn.value)
    err, = _cu_launch(function, gx.value, gy.value, gz.value, bx.value, by.value, bz.value, smem.value,
                      stream.value or 0, params.value, 0)
    return err  # a CUresult: an int subclass, 0 on success


def _choose_launcher():
    """``cuLaunchKernel`` of the driver library called through ctypes with the plan's prebuilt C values
    (default: ctypes then converts nothing), or with ``DEEPEP_CUPY_LAUNCHER=bindings`` through
    ``cuda.bindings``, whose wrapper converts every argument on every call (measured with
    tools/launch_overhead.py: the numbers are in docs/design/host_path.md). Falls back to the bindings
    where the driver library cannot be opened by name."""
    if os.environ.get("DEEPEP_CUPY_LAUNCHER", "ctypes") != "bindings":
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
        except (OSError, AttributeError):
            fn = None
        if fn is not None:
            fn.restype = ctypes.c_int  # no argtypes: every argument is already a ctypes value
            return fn, "ctypes"
    global _cu_launch
    _cu_launch = _driver().cuLaunchKernel
    return _bindings_launch, "bindings"


def _launch(*args) -> int:
    # Bound on first use so that importing this module needs no CUDA driver.
    global _launch, LAUNCHER
    _launch, LAUNCHER = _choose_launcher()
    return _launch(*args)


#: Which launcher is in use ("ctypes" or "bindings"); None until the first launch.
LAUNCHER = None


def _shared_limits(fn: int) -> str:
    """What the function at ``fn`` may take and takes of shared memory, for an error message ("" where the
    driver does not say)."""
    try:
        dynamic = _function_attribute(fn, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES")
        static = _function_attribute(fn, "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES")
    except Exception:  # the message must not depend on the driver answering
        return ""
    if dynamic is None or static is None:
        return ""
    return f" (the function allows {dynamic} dynamic and has {static} static)"


def _raise_launch_error(err, kernel, detail_of_launch: str = "") -> None:
    name = getattr(kernel, "name", repr(kernel))
    try:
        driver = _driver()
        _, text = driver.cuGetErrorString(driver.CUresult(int(err)))
        detail = text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # the message must not depend on the driver answering
        detail = "see the CUDA driver's error codes"
    where = f"; {detail_of_launch}" if detail_of_launch else ""
    raise RuntimeError(f"launching {name} failed: {detail} (CUresult {int(err)}){where}")


#: Shared memory (static and dynamic together) a kernel may take without opting in (cuFuncSetAttribute
#: of its dynamic part above it).
_DEFAULT_SHARED_LIMIT = 48 * 1024


def _function_attribute(fn: int, name: str) -> int | None:
    """Attribute ``name`` (a ``CUfunction_attribute`` member) of the function at ``fn``; None where the driver
    refuses. Raises ImportError or RuntimeError where the driver cannot be loaded."""
    driver = _driver()
    err, value = driver.cuFuncGetAttribute(getattr(driver.CUfunction_attribute, name), driver.CUfunction(fn))
    return int(value) if int(err) == 0 else None


def _static_shared(fn: int) -> int:
    """Static shared memory bytes of the function at ``fn`` (0 where the driver cannot be loaded: then
    nothing launches, and plans built without a GPU, as in the unit tests, need no opt-in)."""
    try:
        value = _function_attribute(fn, "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES")
    except (ImportError, RuntimeError):  # no CUDA driver library on this machine
        return 0
    return value or 0


def _allow_shared(fn: int, nbytes: int, kernel) -> None:
    """Let the function at ``fn`` take ``nbytes`` of dynamic shared memory. The driver keeps the limit on the
    function, for every plan that launches it: a plan only ever raises it, so that a later plan needing less
    (a low-latency combine of a smaller top-k) cannot make an earlier one's launches invalid."""
    current = _function_attribute(fn, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES")
    if current is not None and current >= int(nbytes):
        return
    driver = _driver()
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    (err,) = driver.cuFuncSetAttribute(driver.CUfunction(fn), attr, int(nbytes))
    if int(err) != 0:
        raise RuntimeError(f"{getattr(kernel, 'name', kernel)}: cannot take {nbytes} bytes of dynamic shared "
                           f"memory (CUresult {int(err)})")


def _function_address(kernel) -> int:
    """The ``CUfunction`` behind a project kernel, a ``cupy.RawKernel`` or a CuPy ``Function``."""
    raw = getattr(kernel, "raw", kernel)
    function = getattr(raw, "kernel", raw)  # RawKernel -> its loaded Function
    return int(function.ptr)


def _field_value(kind: str, value):
    """A plan-time value as the slot of ``kind`` takes it."""
    if kind == "f32":
        return float(value)
    if kind == "ptr" and not isinstance(value, (int, np.integer)):
        return int(value.data.ptr)  # an array: its address
    return int(value)


def _dim3(value) -> tuple[int, int, int]:
    if isinstance(value, int):
        return (int(value), 1, 1)
    dims = [int(v) for v in value] + [1, 1]
    if len(dims) > 5:
        raise ValueError(f"launch dimensions must have at most 3 entries, got {value}")
    return (dims[0], dims[1], dims[2])
