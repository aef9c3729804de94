"""Host cost of the pieces of a call on one GPU: a kernel launch through each launcher of
``deepep_cupy.runtime.launch``, a torch allocation, the current-stream lookup.

    python tools/launch_overhead.py

Launches are timed in bursts short enough that the GPU's launch queue never fills (so the host time is
what is measured, not the kernels').
"""

from __future__ import annotations

import time


def per_call(fn, n: int = 400, repeats: int = 5) -> float:
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


def main() -> None:
    import cupy
    import torch

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
    rows = []
    for name in ("ctypes", "bindings"):
        import os

        os.environ["DEEPEP_CUPY_LAUNCHER"] = name
        launch._launch, launch.LAUNCHER = launch._choose_launcher()
        rows.append((f"LaunchPlan.launch ({launch.LAUNCHER})", per_call(lambda: plan.plan.launch(stream.ptr))))
    rows.append(("LayoutPlan.run (CuPy outputs, events)", per_call(lambda: plan.run(topk))))
    dev = torch.device("cuda", 0)
    rows.append(("torch.empty((36,), int32, cuda)", per_call(lambda: torch.empty((36,), dtype=torch.int32, device=dev))))
    rows.append(("torch.empty((144, 256, 7168), fp8, cuda)",
                 per_call(lambda: torch.empty((144, 256, 7168), dtype=torch.float8_e4m3fn, device=dev))))
    raw = torch._C._cuda_getCurrentRawStream
    rows.append(("torch current raw stream", per_call(lambda: raw(0))))
    rows.append(("cupy.empty((36,), int32)", per_call(lambda: cupy.empty((36,), dtype=cupy.int32))))
    print("LAUNCH OVERHEAD (us per call, host side only)")
    for name, us in rows:
        print(f"  {name:48s} {us:7.2f}")


if __name__ == "__main__":
    main()
