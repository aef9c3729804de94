"""A torch.compile'd MoE layer on deepep_cupy, checked against the same layer computed densely.

    mpiexec -n 2 python examples/compiled_moe.py [--backend inductor] [--mode reduce-overhead]

Training / prefill: routing, ``get_dispatch_layout``, ``dispatch(num_worst_tokens=...)``, the experts and
``combine`` are traced into one graph (``fullgraph=True``). With ``num_worst_tokens`` every shape is
fixed and nothing waits for the host; each local expert runs on every received row, weighted by the
router (0 where the row did not pick it), so the graph has no data-dependent shapes either. The loss's
gradient flows back through the combine (a cached dispatch) and the dispatch (a combine), and is
checked against the dense layer's gradient.

Decoding: ``low_latency_dispatch`` and ``low_latency_combine`` (which applies the router's weights)
compiled the same way.

Runs on the GPUs when there are any (default backend: inductor) and on the NumPy reference backend
otherwise (default backend: aot_eager, which needs no C++ compiler). The layer and the dense check are
those of ``moe_layer.py``.
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
from moe_layer import dense_layer, expert_mlp, make_weights, relative_error, route
from mpi4py import MPI

import deepep_cupy as deep_ep


class CompiledMoE(torch.nn.Module):
    """This rank's share of the experts; tokens move through ``buffer`` with fixed-size outputs."""

    def __init__(self, buffer: deep_ep.Buffer, weights: dict, topk: int, num_worst_tokens: int,
                 device: torch.device) -> None:
        super().__init__()
        self.buffer, self.topk, self.num_worst_tokens = buffer, topk, num_worst_tokens
        self.num_experts = weights["router"].shape[1]
        per_rank = self.num_experts // buffer.group_size
        first = buffer.rank * per_rank
        self.router = torch.nn.Parameter(weights["router"].to(device), requires_grad=False)
        self.w1 = torch.nn.Parameter(weights["w1"][first:first + per_rank].to(device))
        self.w2 = torch.nn.Parameter(weights["w2"][first:first + per_rank].to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_idx, topk_weights = route(x, self.router, self.topk)
        per_rank, per_rdma, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx, self.num_experts)
        recv_x, recv_idx, recv_weights, _, handle, _ = self.buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
            num_worst_tokens=self.num_worst_tokens)
        # Rows past the received ones are padding (recv_idx -1): their gate is 0 like that of any row for
        # an expert it did not pick. combine only sums, so the router's weights are applied here.
        h = recv_x.float()
        out = torch.zeros_like(h)
        for e in range(self.w1.shape[0]):
            gate = (recv_weights * (recv_idx == e)).sum(dim=-1, keepdim=True)
            out = out + expert_mlp(h, self.w1[e], self.w2[e]) * gate
        combined, _, _ = self.buffer.combine(out.to(torch.bfloat16), handle)
        return combined


def decode_step(buffer: deep_ep.Buffer, layer: CompiledMoE, x: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """One decoding step on the low-latency ops: each local expert runs over its whole slab of received
    rows (the combine reads only the valid ones) and the combine applies the router's weights."""
    topk_idx, topk_weights = route(x, layer.router, layer.topk)
    recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, max_tokens, layer.num_experts, use_fp8=False)
    y = torch.stack([expert_mlp(recv_x[e].float(), layer.w1[e], layer.w2[e]) for e in range(layer.w1.shape[0])])
    combined, _, _ = buffer.low_latency_combine(y.to(torch.bfloat16), topk_idx, topk_weights, handle)
    return combined


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per rank (training step)")
    parser.add_argument("--decode-tokens", type=int, default=8, help="tokens per rank (decoding step)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512, help="hidden size inside each expert's MLP")
    parser.add_argument("--experts-per-rank", type=int, default=4)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--backend", default=None, help="torch.compile backend (default: inductor on GPUs, "
                                                        "aot_eager on the CPU)")
    parser.add_argument("--mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    num_experts = args.experts_per_rank * num_ranks
    topk = min(args.topk, num_experts)
    device = torch.device("cpu")
    if deep_ep.gpu_count() > 0:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    backend = args.backend or ("inductor" if device.type == "cuda" else "aot_eager")

    weights = make_weights(args.hidden, args.ffn, num_experts)
    gen = torch.Generator().manual_seed(2000 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device, torch.bfloat16)
    probe = torch.randn(args.tokens, args.hidden, generator=gen).to(device)  # the loss is <output, probe>
    x_decode = torch.randn(args.decode_tokens, args.hidden, generator=gen).to(device, torch.bfloat16)

    hidden_bytes = args.hidden * x.element_size()
    num_nvl_bytes = max(deep_ep.Buffer.get_dispatch_config(num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks),
                        deep_ep.Buffer.get_combine_config(num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks))
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(args.decode_tokens, args.hidden, num_ranks,
                                                                   num_experts)
    buffer = deep_ep.Buffer(comm=comm, num_nvl_bytes=num_nvl_bytes, explicitly_destroy=True)
    ll_buffer = deep_ep.Buffer(comm=comm, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                               num_qps_per_rank=max(1, num_experts // num_ranks), explicitly_destroy=True)
    try:
        # Every token of every rank may come here: the most rows a rank can receive.
        layer = CompiledMoE(buffer, weights, topk, args.tokens * num_ranks, device)
        compiled = torch.compile(layer, fullgraph=True, backend=backend, mode=args.mode)
        x_train = x.clone().requires_grad_()
        out = compiled(x_train)
        (out.float() * probe).sum().backward()

        dense_x = x.clone().requires_grad_()
        dense_w = {k: v.clone().requires_grad_(k != "router") for k, v in weights.items()}
        want = dense_layer(dense_x, dense_w, topk)
        (want.float() * probe).sum().backward()
        # This rank's experts learn from every rank's tokens: the dense gradients of all ranks, summed.
        first = rank * args.experts_per_rank
        dense_w1 = torch.from_numpy(comm.allreduce(dense_w["w1"].grad.cpu().numpy(), op=MPI.SUM))
        errors = {"output": relative_error(out.detach(), want.detach()),
                  "grad x": relative_error(x_train.grad, dense_x.grad),
                  "grad w1": relative_error(layer.w1.grad.cpu(), dense_w1[first:first + args.experts_per_rank])}

        with torch.no_grad():
            step = torch.compile(decode_step, fullgraph=True, backend=backend, mode=args.mode)
            decoded = step(ll_buffer, layer, x_decode, args.decode_tokens)
            errors["decode"] = relative_error(decoded, dense_layer(x_decode, weights, topk))
        # BF16 rounding of the rows, the partial sums and the gradients on their way: well under 3 %.
        ok = out.shape == want.shape and max(errors.values()) < 3e-2
        for r in range(num_ranks):
            comm.Barrier()
            if r == rank:
                shown = ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
                print(f"rank {rank} [{buffer.backend}, {device}, {backend}]: largest difference from the dense "
                      f"layer relative to its largest value: {shown}: {'OK' if ok else 'WRONG'}", flush=True)
    finally:
        buffer.destroy()
        ll_buffer.destroy()
    all_ok = comm.allreduce(ok, op=MPI.LAND)
    if rank == 0:
        print("compiled_moe:", "all ranks match the dense layer" if all_ok else "MISMATCH")
    if not all_ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
