"""A small MoE layer in PyTorch on deepep_cupy, checked against the same layer computed densely.

    mpiexec -n 4 python examples/moe_layer.py

The layer: a router picks the top-k experts of each token; ``get_dispatch_layout`` and ``dispatch`` send
each token to the ranks holding its experts; each rank runs its experts' MLPs on what it received and
weights the outputs by the router's weights; ``combine`` sums them back on the tokens' ranks. Every rank
builds the same weights (same seed) and holds the experts ``[rank * E / R, (rank + 1) * E / R)``; the dense
check runs every expert on the rank's own tokens in this process, without communication.

Runs on the GPUs when there are any (one rank per GPU) and on the NumPy reference backend otherwise.
"""

from __future__ import annotations

import argparse

try:
    import torch
except ImportError:  # one line, from rank 0 only, instead of a traceback per rank
    from mpi4py import MPI

    raise SystemExit(None if MPI.COMM_WORLD.Get_rank() else
                     'this example needs PyTorch: pip install -e ".[torch,mpi]" (a CPU-only machine: pip install '
                     'torch --index-url https://download.pytorch.org/whl/cpu first)') from None
import torch.nn.functional as F
from mpi4py import MPI

import deepep_cupy as deep_ep


def make_weights(hidden: int, ffn: int, num_experts: int, seed: int = 0) -> dict:
    """Router and expert weights (float32, on the CPU): the same on every rank for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(hidden, num_experts, generator=gen) / hidden ** 0.5,
        "w1": torch.randn(num_experts, hidden, ffn, generator=gen) / hidden ** 0.5,
        "w2": torch.randn(num_experts, ffn, hidden, generator=gen) / ffn ** 0.5,
    }


def route(x: torch.Tensor, router: torch.Tensor, topk: int):
    """Top-k experts of each token and their weights (softmax over the chosen experts' scores)."""
    scores = x.float() @ router
    top_scores, topk_idx = scores.topk(topk, dim=-1)
    return topk_idx.to(torch.int64), torch.softmax(top_scores, dim=-1)


def expert_mlp(h: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.silu(h @ w1) @ w2


class MoELayer(torch.nn.Module):
    """Expert-parallel MoE layer: this rank's share of the experts, tokens moved by a deepep_cupy Buffer."""

    def __init__(self, buffer: deep_ep.Buffer, weights: dict, topk: int, device: torch.device) -> None:
        super().__init__()
        self.buffer, self.topk = buffer, topk
        self.num_experts = weights["router"].shape[1]
        per_rank = self.num_experts // buffer.group_size
        first = buffer.rank * per_rank
        self.router = torch.nn.Parameter(weights["router"].to(device), requires_grad=False)
        self.w1 = torch.nn.Parameter(weights["w1"][first:first + per_rank].to(device), requires_grad=False)
        self.w2 = torch.nn.Parameter(weights["w2"][first:first + per_rank].to(device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: `[tokens, hidden]` bf16 on this rank; returns the layer's output for the same tokens."""
        topk_idx, topk_weights = route(x, self.router, self.topk)
        per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx, self.num_experts)
        recv_x, recv_idx, recv_weights, _, handle, _ = self.buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights)
        # recv_idx holds local expert ids (-1: an expert of another rank). combine only sums, so the
        # router's weights are applied here, before the rows go back.
        h, out = recv_x.float(), torch.zeros(recv_x.shape, dtype=torch.float32, device=recv_x.device)
        for e in range(self.w1.shape[0]):
            rows, slot = (recv_idx == e).nonzero(as_tuple=True)
            if rows.numel():
                y = expert_mlp(h[rows], self.w1[e], self.w2[e]) * recv_weights[rows, slot, None]
                out.index_add_(0, rows, y)
        combined, _, _ = self.buffer.combine(out.to(torch.bfloat16), handle)
        return combined


def dense_layer(x: torch.Tensor, weights: dict, topk: int) -> torch.Tensor:
    """The same layer in one process: every expert on every token, weighted by the router (0 if not chosen)."""
    w = {k: v.to(x.device) for k, v in weights.items()}
    topk_idx, topk_weights = route(x, w["router"], topk)
    gates = torch.zeros(x.shape[0], w["router"].shape[1], device=x.device).scatter_(1, topk_idx, topk_weights)
    h = x.float()
    out = sum(expert_mlp(h, w["w1"][e], w["w2"][e]) * gates[:, e, None] for e in range(gates.shape[1]))
    return out.to(torch.bfloat16)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if want.numel() == 0:
        return 0.0
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512, help="hidden size inside each expert's MLP")
    parser.add_argument("--experts-per-rank", type=int, default=4)
    parser.add_argument("--topk", type=int, default=4)
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    num_experts = args.experts_per_rank * num_ranks
    topk = min(args.topk, num_experts)
    device = torch.device("cpu")
    if deep_ep.gpu_count() > 0:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)

    weights = make_weights(args.hidden, args.ffn, num_experts)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device, torch.bfloat16)

    hidden_bytes = args.hidden * x.element_size()
    num_nvl_bytes = max(deep_ep.Buffer.get_dispatch_config(num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks),
                        deep_ep.Buffer.get_combine_config(num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks))
    buffer = deep_ep.Buffer(comm=comm, num_nvl_bytes=num_nvl_bytes, explicitly_destroy=True)
    try:
        layer = MoELayer(buffer, weights, topk, device)
        with torch.no_grad():
            out = layer(x)
            want = dense_layer(x, weights, topk)
        err = relative_error(out, want)
        # BF16 rounding of each rank's partial sums, then of the total: well under 1 %.
        ok = out.shape == want.shape and err < 2e-2
        for r in range(num_ranks):
            comm.Barrier()
            if r == rank:
                print(f"rank {rank} [{buffer.backend}, {device}]: {args.tokens} tokens, experts "
                      f"{rank * args.experts_per_rank}..{(rank + 1) * args.experts_per_rank - 1}; largest difference "
                      f"from the dense layer {err:.2e} of its largest value: {'OK' if ok else 'WRONG'}", flush=True)
    finally:
        buffer.destroy()
    all_ok = comm.allreduce(ok, op=MPI.LAND)
    if rank == 0:
        print("moe_layer:", "all ranks match the dense layer" if all_ok else "MISMATCH")
    if not all_ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
