"""LaunchPlan: the argument block a kernel launch passes to cuLaunchKernel (no GPU needed: the driver
call is replaced by one that reads the block back)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from deepep_cupy.device import launch


class _Function:
    ptr = 0xABC0


class _Kernel:
    """What jit.module.Kernel looks like to a plan: ``raw.kernel.ptr``."""

    name = "fake<1>"

    class raw:  # noqa: N801 - mirrors the attribute name
        kernel = _Function


def _plan(kernel, grid, block, args, shared_mem=0):
    """A plan over a struct of ``args`` ``[(name, kind, value), ...]`` in that order."""
    struct = launch.ArgStruct("S", [(n, k) for n, k, _ in args])
    return launch.LaunchPlan(kernel, grid, block, struct, {n: v for n, _, v in args}, shared_mem=shared_mem)


def _read_block(address: int, kinds):
    """The fields of the struct the one-entry parameter array at ``address`` points at."""
    (struct_address,) = (ctypes.c_void_p * 1).from_address(address)
    struct = launch.ArgStruct("S", [(f"f{i}", k) for i, k in enumerate(kinds)])
    record = np.frombuffer(ctypes.string_at(struct_address, struct.size), dtype=struct.dtype)[0]
    return [record[f"f{i}"].item() for i in range(len(kinds))]


@pytest.fixture
def captured(monkeypatch):
    calls = []

    def fake(*args):
        # The launcher gets C values, as cuLaunchKernel through ctypes does.
        assert all(isinstance(a, ctypes._SimpleCData) for a in args)
        fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra = (a.value for a in args)
        calls.append({"fn": fn, "grid": (gx, gy, gz), "block": (bx, by, bz), "smem": smem, "stream": stream or 0,
                      "params": params, "extra": extra})
        return 0

    monkeypatch.setattr(launch, "_launch", fake)
    monkeypatch.setattr(launch, "_static_shared", lambda fn: 0)
    return calls


def test_block_holds_every_argument_in_order(captured):
    args = [("x", "ptr", 0x1000), ("n", "i32", -7), ("big", "i64", 1 << 40), ("flag", "u32", 3),
            ("scale", "f32", 0.5), ("out", "ptr", None)]
    plan = _plan(_Kernel(), (12,), 256, args, shared_mem=64)
    plan.slot("out").value = 0x2000
    plan.launch(77)
    (call,) = captured
    assert call["fn"] == 0xABC0 and call["grid"] == (12, 1, 1) and call["block"] == (256, 1, 1)
    assert call["smem"] == 64 and call["stream"] == 77
    assert _read_block(call["params"], [k for _, k, _ in args]) == [0x1000, -7, 1 << 40, 3, 0.5, 0x2000]


def test_patching_changes_only_that_slot(captured):
    plan = _plan(_Kernel(), (2, 3), (32, 4), [("a", "ptr", 1), ("b", "i32", 2)])
    plan.launch(0)
    plan.set(b=5)
    plan.launch(0)
    first, second = captured
    assert first["grid"] == (2, 3, 1) and first["block"] == (32, 4, 1)
    assert first["params"] == second["params"]  # the same block, patched in place
    assert _read_block(second["params"], ["ptr", "i32"]) == [1, 5]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown kind"):
        _plan(_Kernel(), 1, 1, [("a", "float64", 1)])
    with pytest.raises(ValueError, match="duplicate"):
        _plan(_Kernel(), 1, 1, [("a", "ptr", 1), ("a", "i32", 1)])
    struct = launch.ArgStruct("S", [("a", "ptr"), ("n", "i32")])
    with pytest.raises(ValueError, match="S: no value for n"):
        launch.LaunchPlan(_Kernel(), 1, 1, struct, {"a": 1})
    with pytest.raises(ValueError, match="argument n of S"):
        launch.LaunchPlan(_Kernel(), 1, 1, struct, {"a": 1, "n": "many"})


def test_a_failed_launch_raises_with_the_kernel_name(monkeypatch):
    monkeypatch.setattr(launch, "_launch", lambda *a: 1)  # CUDA_ERROR_INVALID_VALUE
    plan = _plan(_Kernel(), 1, 1, [("a", "ptr", 1)])
    with pytest.raises(RuntimeError, match=r"fake<1>"):
        plan.launch(0)


def test_large_dynamic_shared_memory_is_opted_into(monkeypatch):
    """Past 48 KiB of static and dynamic shared memory together the function must opt in for its dynamic
    part (cuFuncSetAttribute), when the plan is made; at or below it nothing is asked of the driver, a plan
    never lowers what an earlier plan of the same function opted into (its launches would become invalid),
    and a refusal names the kernel."""
    import types

    calls = []
    attrs = types.SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES="max-dynamic-shared",
                                  CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES="static-shared")
    status = {"err": 0, "static": 0, "max": 48 * 1024}

    def set_attribute(fn, attr, n):
        calls.append((fn, attr, n))
        if not status["err"]:
            status["max"] = n
        return (status["err"],)

    fake = types.SimpleNamespace(CUfunction=lambda fn: ("CUfunction", fn), CUfunction_attribute=attrs,
                                 cuFuncSetAttribute=set_attribute,
                                 cuFuncGetAttribute=lambda attr, fn: (0, status["static"] if attr == "static-shared"
                                                                      else status["max"]))
    monkeypatch.setattr(launch, "_driver", lambda: fake)
    _plan(_Kernel, 1, 32, [("a", "i32", 1)], shared_mem=48 * 1024)
    assert calls == []
    _plan(_Kernel, 1, 32, [("a", "i32", 1)], shared_mem=80 * 1024)
    assert calls == [(("CUfunction", 0xABC0), "max-dynamic-shared", 80 * 1024)]
    calls.clear()
    _plan(_Kernel, 1, 32, [("a", "i32", 1)], shared_mem=60 * 1024)  # less: the limit stays
    assert calls == [] and status["max"] == 80 * 1024
    status["max"] = 48 * 1024
    status["static"] = 40 * 1024  # 40 KiB static + 16 KiB dynamic
    _plan(_Kernel, 1, 32, [("a", "i32", 1)], shared_mem=16 * 1024)
    assert calls == []  # within the function's limit already
    status["max"] = 0
    _plan(_Kernel, 1, 32, [("a", "i32", 1)], shared_mem=16 * 1024)
    assert calls == [(("CUfunction", 0xABC0), "max-dynamic-shared", 16 * 1024)]
    calls.clear()
    _plan(_Kernel, 1, 32, [("a", "i32", 1)], shared_mem=8 * 1024)
    assert calls == []
    status["err"] = 1
    with pytest.raises(RuntimeError, match="fake<1>"):
        _plan(_Kernel, 1, 32, [("a", "i32", 1)], shared_mem=100 * 1024)


def test_with_kernel_shares_the_block_but_not_the_function_or_stream(captured):
    class _Other(_Kernel):
        class raw:  # noqa: N801
            class kernel:  # noqa: N801
                ptr = 0xDEF0

    send = _plan(_Kernel(), 4, 64, [("a", "ptr", 1), ("phase", "i32", 1)])
    recv = send.with_kernel(_Other())
    recv.slot("phase").value = 2
    send.launch(11)
    recv.launch(22)
    first, second = captured
    assert (first["fn"], first["stream"]) == (0xABC0, 11) and (second["fn"], second["stream"]) == (0xDEF0, 22)
    assert first["params"] == second["params"] and first["extra"] is None
    assert _read_block(first["params"], ["ptr", "i32"]) == [1, 2]


def test_bindings_launcher_passes_the_same_values(monkeypatch):
    seen = []
    monkeypatch.setattr(launch, "_cu_launch", lambda *a: seen.append(a) or (0,))
    monkeypatch.setattr(launch, "_driver", lambda: type("D", (), {"CUfunction": staticmethod(lambda fn: ("fn", fn))}))
    monkeypatch.setattr(launch, "_functions", {})
    monkeypatch.setattr(launch, "_static_shared", lambda fn: 0)
    plan = _plan(_Kernel(), (3, 2), 128, [("a", "ptr", 5)], shared_mem=256)
    monkeypatch.setattr(launch, "_launch", launch._bindings_launch)
    plan.launch(0)
    plan.launch(99)
    assert seen[0] == (("fn", 0xABC0), 3, 2, 1, 128, 1, 1, 256, 0, plan._address, 0)
    assert seen[1][8] == 99
