"""Start-up cost of a low-latency Buffer: creation (NVSHMEM init included) and the first dispatch +
combine (JIT compile when the cache is cold, a cache load when warm). Run twice under mpirun:

    DEEPEP_CUPY_CACHE_DIR=$(mktemp -d) mpirun -np 2 python tools/startup_times.py cold
    mpirun -np 2 python tools/startup_times.py warm     # same cache dir
"""

import sys
import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "run"
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    import cupy

    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    import deepep_cupy as deep_ep

    t_tokens, hidden, experts, k = 128, 7168, 288, 8
    comm.Barrier()
    t0 = time.perf_counter()
    nbytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(t_tokens, hidden, size, experts)
    buf = deep_ep.Buffer(comm=comm, num_rdma_bytes=nbytes, low_latency_mode=True, explicitly_destroy=True)
    t1 = time.perf_counter()
    rng = np.random.default_rng(rank)
    x = cupy.asarray(rng.standard_normal((t_tokens, hidden)).astype("bfloat16"))
    idx = cupy.asarray(np.stack([rng.choice(experts, k, replace=False) for _ in range(t_tokens)]).astype(np.int64))
    w = cupy.asarray(rng.random((t_tokens, k), dtype=np.float32))
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, t_tokens, experts, use_fp8=True)
    out = cupy.zeros((experts // size, size * t_tokens, hidden), dtype="bfloat16")
    buf.low_latency_combine(out, idx, w, handle)
    cupy.cuda.Device().synchronize()
    t2 = time.perf_counter()
    times = comm.gather((t1 - t0, t2 - t1), root=0)
    if rank == 0:
        create = max(t[0] for t in times)
        first = max(t[1] for t in times)
        print(f"STARTUP {label}: Buffer (NVSHMEM init included) {create:.2f} s, first dispatch+combine "
              f"{first:.2f} s", flush=True)
    buf.destroy()


if __name__ == "__main__":
    main()
