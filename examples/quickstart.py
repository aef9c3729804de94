"""Quick start: each rank routes its tokens to random experts, dispatches them, runs a toy "expert" and
combines the results back. Run it as ``mpiexec -n 4 python examples/quickstart.py``: on the GPUs when there
are any (one per rank), on the NumPy reference backend otherwise."""
import ml_dtypes
import numpy as np
from mpi4py import MPI

import deepep_cupy as deep_ep

comm = MPI.COMM_WORLD
rank, num_ranks = comm.Get_rank(), comm.Get_size()
if deep_ep.gpu_count() > 0:  # CuPy arrays, one GPU per rank, where there are GPUs ...
    import cupy as xp
    xp.cuda.Device(rank % deep_ep.gpu_count()).use()
else:  # ... NumPy arrays on the reference backend elsewhere
    xp = np

# Routing: each of 128 tokens picks 4 distinct experts out of 8 per rank, with weights that sum to 1.
num_tokens, hidden, num_experts, topk = 128, 512, 8 * num_ranks, 4
rng = np.random.default_rng(rank)
topk_idx = np.stack([rng.choice(num_experts, topk, replace=False) for _ in range(num_tokens)])
topk_weights = rng.random((num_tokens, topk), dtype=np.float32)
topk_weights /= topk_weights.sum(axis=1, keepdims=True)
topk_idx, topk_weights = xp.asarray(topk_idx), xp.asarray(topk_weights)
x = xp.asarray(rng.standard_normal((num_tokens, hidden)).astype(ml_dtypes.bfloat16))

config = deep_ep.Buffer.get_dispatch_config(num_ranks)
buffer = deep_ep.Buffer(comm=comm, num_nvl_bytes=config.get_nvl_buffer_size_hint(hidden * 2, num_ranks),
                        explicitly_destroy=True)

# Layout, then dispatch: every rank receives the tokens that picked one of its experts.
per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
recv_x, recv_topk_idx, recv_topk_weights, per_local_expert, handle, _ = buffer.dispatch(
    x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
    topk_idx=topk_idx, topk_weights=topk_weights)

# The "experts": each received row times the weights of this rank's experts (0 for other ranks' experts).
expert_out = (recv_x.astype(np.float32) * recv_topk_weights.sum(axis=1, keepdims=True)).astype(x.dtype)

# Combine: each token gets back the sum over the ranks it went to, x times the sum of its weights: x.
combined_x, _, _ = buffer.combine(expert_out, handle)
ok = bool(xp.allclose(combined_x.astype(np.float32), x.astype(np.float32), rtol=2e-2, atol=2e-2))
line = (f"rank {rank} [{buffer.backend}]: {recv_x.shape[0]} rows received ({per_local_expert} per local "
        f"expert), combine {'matches' if ok else 'DIFFERS'}")
buffer.destroy()

lines = comm.gather(line, root=0)  # printed by rank 0 in rank order, not interleaved
if rank == 0:
    print("\n".join(lines), flush=True)
if not comm.allreduce(ok, op=MPI.LAND):
    raise SystemExit("combine does not give back the tokens")
if rank == 0:
    print("quickstart: all ranks OK")
