"""Dispatch layout: per-rank, per-RDMA-rank and per-expert token counts and the token -> rank map."""

from __future__ import annotations

import functools

from ..device.gpus import compute_capability
from ..device.kernel_errors import KernelErrorRecord
from ..device.launch import LaunchPlan
from ..device.streams import ForkJoin, OpStreams
from ..event import EventOverlap
from ..frameworks import BOOL, I32, SmallOutputs, frame_for
from ..jit import BuildSpec, load
from . import kernel_names, limits
from .headers import constant, kernel_struct
from .recv_rows import COUNT_RECV_ROWS, PLACE_RECV_ROWS, recv_rows_spec  # V2's layout arrays, the family's others

__all__ = ["MAX_TOPK", "LayoutPlan", "get_dispatch_layout", "layout_spec", "representative_builds"]

MAX_TOPK = limits.LAYOUT_MAX_TOPK
_SOURCE = "layout/count_tokens.cu"
#: Threads of a block (the kernel's launch bounds).
_THREADS = constant("layout/count_tokens.cu", "kThreads")
#: The kernel's parameter struct, and every kernel of the family -> its struct.
COUNT_TOKENS = kernel_struct("layout/args.cuh", "CountTokensArgs")
KERNEL_STRUCTS = {"count_tokens": COUNT_TOKENS, "count_recv_rows": COUNT_RECV_ROWS, "place_recv_rows": PLACE_RECV_ROWS}
_CLUSTER = 8  # blocks of the kernel's cluster on sm_90 (one block before it)
#: The kernel counts experts, ranks and RDMA ranks in dynamic shared memory, one int32 each.
MAX_COUNT_WORDS = limits.LAYOUT_MAX_COUNT_WORDS


_kernel_name = kernel_names.layout_count_tokens


@functools.cache
def layout_spec(num_topk: int, cluster: int = _CLUSTER) -> BuildSpec:
    """The build of the layout kernel for one top-k and cluster size (its compile-time parameters)."""
    return BuildSpec.make(_SOURCE, name_expressions=[_kernel_name(num_topk, cluster)])


def representative_builds() -> list[BuildSpec]:
    """Instantiations compiled by the CPU test suite: odd/even top-k, scalar and vector load paths, the
    one-block kernel of GPUs without clusters, and V2's layout arrays."""
    return [layout_spec(k) for k in (1, 4, 8, 32)] + [layout_spec(8, 1), recv_rows_spec()]


def _cluster_for(frame) -> int:
    """Blocks per launch: a cluster of 8 from sm_90 on, else one block (no plan has a frame in unit tests)."""
    return _CLUSTER if frame is None else _device_cluster(frame.device_id)


@functools.cache
def _device_cluster(device_id: int) -> int:
    return _CLUSTER if compute_capability(device_id)[0] >= 9 else 1


class LayoutPlan:
    """``get_dispatch_layout`` for one (framework, N, K, E): count where each token goes.

    Experts live on ranks contiguously (rank ``e // (E // R)``); ``-1`` selects no expert, and an id outside
    ``[-1, E)`` selects none either and is reported by the kernel (raised as ``ValueError`` at the next
    call). Outputs: ``num_tokens_per_rank int32[R]``, ``num_tokens_per_rdma_rank int32[R / nvl]`` or None
    within one NVLink domain, ``num_tokens_per_expert int32[E]``, ``is_token_in_rank bool[N, R]``; a token
    counts once per rank and once per RDMA rank however many of its experts live there.
    """

    def __init__(self, frame, *, num_tokens: int, num_topk: int, num_experts: int, num_ranks: int,
                 num_nvl_ranks: int, rank: int, errors, comm_stream: int, async_finish: bool) -> None:
        count_words = limits.layout_args(num_tokens, num_topk, num_experts, num_ranks, num_nvl_ranks)
        self.has_rdma = num_nvl_ranks < num_ranks
        self.frame, self.errors = frame, errors
        self._fork_join = ForkJoin()
        self.num_tokens, self.num_experts, self.num_ranks = num_tokens, num_experts, num_ranks
        self.num_rdma_ranks = num_ranks // num_nvl_ranks
        self.comm_stream, self.async_finish = comm_stream, bool(async_finish)
        cluster = _cluster_for(frame)
        kernel = load(layout_spec(num_topk, cluster)).get_function(_kernel_name(num_topk, cluster))
        # The grid does not depend on num_tokens: with N = 0 the kernel still writes zero counts.
        self.plan = LaunchPlan(kernel, cluster, _THREADS, COUNT_TOKENS, dict(
            topk_idx=None, num_tokens=num_tokens, num_experts=num_experts, num_ranks=num_ranks,
            num_nvl_ranks=num_nvl_ranks if self.has_rdma else num_ranks, num_tokens_per_expert=None,
            num_tokens_per_rank=None, num_tokens_per_rdma_rank=0, is_token_in_rank=None, err=errors.ptr, rank=rank),
            shared_mem=4 * count_words)
        self.slots = tuple(self.plan.slot(n) for n in ("topk_idx", "num_tokens_per_expert", "num_tokens_per_rank",
                                                        "num_tokens_per_rdma_rank", "is_token_in_rank"))
        # The outputs are cut from one allocation (an allocation costs the host about what two views do, and
        # the kernel writes every element, so they need no clearing): per rank, per expert, the token -> rank
        # map, and per RDMA rank last when there is one.
        specs = [((num_ranks,), I32), ((num_experts,), I32), ((num_tokens, num_ranks), BOOL)]
        if self.has_rdma:
            specs.append(((self.num_rdma_ranks,), I32))
        self.outputs = SmallOutputs(specs)

    def run(self, topk_idx, previous_event=None):
        if self.errors.flag_word():
            self.errors.check()
        frame = self.frame
        ptr = frame.ptr
        compute = frame.stream()
        # The kernel touches no communication buffer, so without async_finish or a previous event it runs
        # on the caller's stream: the same order as a fork onto the communication stream and a join back,
        # without their two event records and two waits.
        direct = not self.async_finish and (previous_event is None or getattr(previous_event, "event", None) is None)
        streams = None if direct else OpStreams(self.comm_stream, compute, frame.framework, frame.device_id,
                                                previous_event, self.async_finish, self._fork_join)
        outputs, part = self.outputs, frame.part
        words = frame.empty_words(outputs)
        per_rank, per_expert, in_rank = part(words, outputs, 0), part(words, outputs, 1), part(words, outputs, 2)
        per_rdma = part(words, outputs, 3) if self.has_rdma else None
        base = ptr(words)
        s_topk, s_expert, s_rank, s_rdma, s_in = self.slots
        s_topk.value = ptr(topk_idx)
        s_rank.value, s_expert.value, s_in.value = base, base + outputs.byte_offsets[1], base + outputs.byte_offsets[2]
        if per_rdma is not None:
            s_rdma.value = base + outputs.byte_offsets[3]
        if direct:
            self.plan.launch(compute)
            return per_rank, per_rdma, per_expert, in_rank, EventOverlap(None)
        self.plan.launch(self.comm_stream)
        event = streams.finish()
        keep = (topk_idx, per_rank, per_rdma, per_expert, in_rank) if event is not None else None
        return per_rank, per_rdma, per_expert, in_rank, EventOverlap(event, keep)


def get_dispatch_layout(topk_idx, num_experts: int, num_ranks: int, num_nvl_ranks: int, stream=None):
    """One layout on CuPy arrays, outside any Buffer (tests and benchmarks): the kernel runs on ``stream``
    (a CuPy stream, default the current one) and the outputs are returned as
    ``(per_rank, per_rdma or None, per_expert, is_token_in_rank)``."""
    import cupy


    if not isinstance(topk_idx, cupy.ndarray) or topk_idx.dtype != cupy.int64 or topk_idx.ndim != 2:
        raise TypeError("topk_idx must be a 2-D int64 cupy.ndarray")
    if not topk_idx.flags.c_contiguous:
        raise ValueError("topk_idx must be C-contiguous")
    stream = stream if stream is not None else cupy.cuda.get_current_stream()
    errors = _standalone_errors()
    plan = LayoutPlan(frame_for("cupy", topk_idx.data.device_id), num_tokens=int(topk_idx.shape[0]),
                      num_topk=int(topk_idx.shape[1]), num_experts=int(num_experts), num_ranks=int(num_ranks),
                      num_nvl_ranks=int(num_nvl_ranks), rank=0, errors=errors, comm_stream=stream.ptr,
                      async_finish=False)
    with stream:
        outs = plan.run(topk_idx)
    return outs[:4]


@functools.cache
def _standalone_errors():
    return KernelErrorRecord()
