"""Starting ``torch.distributed`` on the ranks of an mpi4py communicator (:func:`init_torch_distributed`),
for the tests and benchmarks that compare against torch collectives or build a Buffer on a torch group."""

from __future__ import annotations

__all__ = ["init_torch_distributed"]


def init_torch_distributed(comm, backend: str = "gloo", **kwargs) -> None:
    """Start ``torch.distributed`` on the ranks of an mpi4py communicator within one host.

    Rank 0 starts the rendezvous store on a loopback port the system picks and the others learn it through MPI
    (a port found free and then bound by the store could be taken in between, by another process of the host:
    the store then failed with EADDRINUSE and the other ranks waited for it). A store rank 0 cannot start is
    raised on every rank; the stores and the process group keep torch's own time limits (the ranks of a
    benchmark may reach their first collective minutes apart, one of them compiling kernels). Does nothing
    when torch.distributed is already initialised. Used by tests and benchmarks that compare against torch
    collectives.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    rank, size = comm.Get_rank(), comm.Get_size()
    store, failure = None, None
    if rank == 0:
        try:
            store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
        except Exception as exc:  # the others must hear of it instead of waiting for a store that never comes
            failure = f"{type(exc).__name__}: {exc}"
    port, failure = comm.bcast((store.port if store is not None else None, failure), root=0)
    if failure is not None:
        raise RuntimeError(f"torch.distributed on rank {rank}: rank 0 could not start the rendezvous store ({failure})")
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, **kwargs)
