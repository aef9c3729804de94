"""Host-side cost per call of the Python layers (no GPU sync inside the loops), to see where the
microseconds of small ops go. Single process, one GPU:

    python tools/host_overhead.py
"""

import time

import numpy as np


def per_call(fn, n=2000) -> float:
    import cupy

    for _ in range(50):
        fn()
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    cupy.cuda.Device().synchronize()
    return host


def main() -> None:
    import cupy
    from mpi4py import MPI

    import deepep_cupy as deep_ep
    from deepep_cupy.jit import BuildSpec, load
    from deepep_cupy.ops.layout import get_dispatch_layout

    rows = []
    stream = cupy.cuda.Stream(non_blocking=True)
    rows.append(("cupy.empty(4096x2 bool)", per_call(lambda: cupy.empty((4096, 2), dtype=cupy.bool_))))
    rows.append(("with stream: (enter+exit)", per_call(lambda: (stream.__enter__(), stream.__exit__(None, None, None)))))
    ev = cupy.cuda.Event(disable_timing=True)
    rows.append(("cupy.cuda.Event()", per_call(lambda: cupy.cuda.Event(disable_timing=True))))
    rows.append(("event.record + stream.wait_event", per_call(lambda: (ev.record(stream), stream.wait_event(ev)))))
    idx = cupy.asarray(np.random.default_rng(0).integers(0, 256, (4096, 8)), dtype=cupy.int64)
    get_dispatch_layout(idx, 256, 2, 2, stream=stream)
    kernel = load(BuildSpec.make("layout.cu", name_expressions=("dispatch_layout_kernel<8>",))).get_function(
        "dispatch_layout_kernel<8>")
    rows.append(("ops.layout.get_dispatch_layout", per_call(lambda: get_dispatch_layout(idx, 256, 2, 2, stream=stream))))
    buf = deep_ep.Buffer(comm=MPI.COMM_SELF, explicitly_destroy=True)
    rows.append(("Buffer.get_dispatch_layout (cupy)", per_call(lambda: buf.get_dispatch_layout(idx, 256))))
    try:
        import torch

        t_idx = torch.as_tensor(idx.get(), device="cuda")
        rows.append(("torch.from_dlpack(cupy)", per_call(lambda: torch.from_dlpack(idx))))
        rows.append(("cupy.from_dlpack(torch)", per_call(lambda: cupy.from_dlpack(t_idx))))
        rows.append(("Buffer.get_dispatch_layout (torch)", per_call(lambda: buf.get_dispatch_layout(t_idx, 256))))
    except ImportError:
        pass
    del kernel
    buf.destroy()
    print("HOST OVERHEAD (us per call, host side only)")
    for name, us in rows:
        print(f"  {name:40s} {us:8.2f}")


if __name__ == "__main__":
    main()
