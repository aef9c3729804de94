"""Dispatch tokens to the ranks that hold their experts, run a toy "expert", combine them back.

    mpiexec -n 4 python examples/quickstart.py

Runs on the GPUs when there are any (one rank per GPU, round robin) and on the NumPy reference
backend otherwise. Every rank prints what it sent and received and checks the round trip.
"""

import argparse

import ml_dtypes
import numpy as np
from mpi4py import MPI

import deepep_cupy as deep_ep
from deepep_cupy.device.gpus import gpu_count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts-per-rank", type=int, default=4)
    parser.add_argument("--topk", type=int, default=4)
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    num_experts = args.experts_per_rank * num_ranks
    topk = min(args.topk, num_experts)

    xp = np
    if gpu_count() > 0:
        import cupy

        cupy.cuda.Device(rank % gpu_count()).use()
        xp = cupy

    # Routing: each token picks `topk` distinct experts; token values identify their source.
    rng = np.random.default_rng(1234 + rank)
    topk_idx = np.stack([rng.choice(num_experts, topk, replace=False) for _ in range(args.tokens)]).astype(np.int64)
    x = np.empty((args.tokens, args.hidden), dtype=ml_dtypes.bfloat16)
    # Small integers stay exact in bf16 through the sums below.
    x[:] = (rank * 1000 + np.arange(args.tokens))[:, None] % 32
    x, topk_idx = xp.asarray(x), xp.asarray(topk_idx)

    config = deep_ep.Buffer.get_dispatch_config(num_ranks)
    num_nvl_bytes = config.get_nvl_buffer_size_hint(args.hidden * 2, num_ranks)
    buffer = deep_ep.Buffer(comm=comm, num_nvl_bytes=num_nvl_bytes, explicitly_destroy=True)

    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    weights = xp.ones(topk_idx.shape, dtype=np.float32)
    recv_x, recv_idx, recv_w, per_local_expert, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=weights)

    # The "expert" is the identity, so combine returns each token times the number of ranks it visited.
    combined, _, _ = buffer.combine(recv_x, handle)
    visits = in_rank.sum(axis=1).astype(np.float32)
    expected = x.astype(np.float32) * visits[:, None]
    ok = bool(xp.all(combined.astype(np.float32) == expected))

    prefix = handle[0]
    recv_from = [int(prefix[0, rank])] + [int(prefix[i, rank] - prefix[i - 1, rank]) for i in range(1, num_ranks)]
    for r in range(num_ranks):
        comm.Barrier()
        if r == rank:
            print(f"rank {rank} [{buffer.backend}]: sent {[int(v) for v in per_rank]} tokens to ranks 0..{num_ranks - 1}, "
                  f"received {recv_from} from them ({int(recv_x.shape[0])} rows), per local expert "
                  f"{per_local_expert}; combine round trip {'OK' if ok else 'WRONG'}", flush=True)
    buffer.destroy()
    all_ok = comm.allreduce(ok, op=MPI.LAND)
    if rank == 0:
        print("quickstart:", "all ranks OK" if all_ok else "MISMATCH")
    if not all_ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
