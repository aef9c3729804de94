"""Host cost of the pieces of a call on one GPU: a kernel launch through each launcher of
``deepep_cupy.device.launch``, torch allocations and views in the forms the plans could use, the
metadata reads of a plan key, the current-stream lookup.

    python tools/launch_overhead.py

Launches are timed in bursts short enough that the GPU's launch queue never fills (so the host time is
what is measured, not the kernels').
"""

from __future__ import annotations

import os
import time


def per_call(fn, n: int = 400, repeats: int = 7) -> float:
    import cupy

    best = float("inf")
    for _ in range(repeats):
        cupy.cuda.Device().synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    cupy.cuda.Device().synchronize()
    return best


def launch_rows(rows) -> None:
    import cupy

    from deepep_cupy.device import launch
    from deepep_cupy.device.kernel_errors import KernelErrorRecord
    from deepep_cupy.frameworks import frame_for
    from deepep_cupy.ops.layout import LayoutPlan

    topk = cupy.zeros((8, 8), dtype=cupy.int64)
    plan = LayoutPlan(frame_for("cupy", 0), num_tokens=8, num_topk=8, num_experts=32, num_ranks=2, num_nvl_ranks=2,
                      rank=0, errors=KernelErrorRecord(), comm_stream=cupy.cuda.get_current_stream().ptr,
                      async_finish=False)
    plan.run(topk)
    stream = cupy.cuda.Stream(non_blocking=True)
    for name in ("ctypes", "bindings"):
        os.environ["DEEPEP_CUPY_LAUNCHER"] = name
        launch._launch, launch.LAUNCHER = launch._choose_launcher()
        rows.append((f"LaunchPlan.launch ({launch.LAUNCHER})", per_call(lambda: plan.plan.launch(stream.ptr))))
    os.environ.pop("DEEPEP_CUPY_LAUNCHER")
    launch._launch, launch.LAUNCHER = launch._choose_launcher()
    rows.append(("LayoutPlan.run (CuPy outputs, events)", per_call(lambda: plan.run(topk))))
    rows.append(("cupy.empty((36,), int32)", per_call(lambda: cupy.empty((36,), dtype=cupy.int32))))


def torch_rows(rows) -> None:
    import torch

    from deepep_cupy.frameworks import meta

    dev = torch.device("cuda", 0)
    fp8, i32 = torch.float8_e4m3fn, torch.int32
    big = (144, 256, 7168)
    rows.append(("torch.empty((36,), int32, device=torch.device)",
                 per_call(lambda: torch.empty((36,), dtype=i32, device=dev))))
    rows.append(("torch.empty(36, int32, device=0)", per_call(lambda: torch.empty(36, dtype=i32, device=0))))
    rows.append(("torch.empty(big, fp8, device=torch.device)", per_call(lambda: torch.empty(big, dtype=fp8, device=dev))))
    rows.append(("torch.empty(big, fp8, device=0)", per_call(lambda: torch.empty(big, dtype=fp8, device=0))))
    rows.append(("torch.empty_strided(scales, col-major)",
                 per_call(lambda: torch.empty_strided((144, 256, 56), (56 * 256, 1, 256), dtype=torch.float32,
                                                      device=dev))))
    words = torch.empty(1 << 20, dtype=i32, device=dev)
    rows.append(("t.view(float32)", per_call(lambda: words.view(torch.float32))))
    rows.append(("t.as_strided(shape, strides, offset)", per_call(lambda: words.as_strided((144, 256), (256, 1), 64))))
    rows.append(("t[a:b].view(shape)", per_call(lambda: words[64:64 + 144 * 256].view(144, 256))))
    rows.append(("t.transpose(-1, -2)", per_call(lambda: words.view(1024, 1024).transpose(-1, -2))))
    rows.append(("split_with_sizes (5 parts)", per_call(lambda: words.split_with_sizes([16, 16, 16, 16, (1 << 20) - 64]))))
    x = torch.empty((128, 7168), dtype=torch.bfloat16, device=dev)
    rows.append(("meta(torch tensor)", per_call(lambda: meta(x))))
    rows.append(("t.shape", per_call(lambda: x.shape)))
    rows.append(("t.dtype", per_call(lambda: x.dtype)))
    rows.append(("t.is_contiguous()", per_call(lambda: x.is_contiguous())))
    rows.append(("t.get_device()", per_call(lambda: x.get_device())))
    rows.append(("t.data_ptr()", per_call(lambda: x.data_ptr())))
    raw = torch._C._cuda_getCurrentRawStream
    rows.append(("torch current raw stream", per_call(lambda: raw(0))))
    rows.append(("torch.cuda.is_current_stream_capturing()", per_call(torch.cuda.is_current_stream_capturing)))


def main() -> None:
    rows: list[tuple[str, float]] = []
    launch_rows(rows)
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        torch_rows(rows)
    print("HOST FLOORS (us per call, host side only)")
    for name, us in rows:
        print(f"  {name:52s} {us:7.2f}")


if __name__ == "__main__":
    main()
