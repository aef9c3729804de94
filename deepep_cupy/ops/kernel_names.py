"""NVRTC name expressions of every kernel in ``cuda_src/``, and the op codes of the value errors they report.

Every kernel lives in a ``deepep_cupy::<family>`` namespace (``intranode``, ``internode``, ``low_latency``,
``layout``; the sources are in ``cuda_src/<family>/``), next to its family's device helpers; the helpers
all families share (``cuda_src/common/``) sit in ``deepep_cupy`` itself. Each family has exactly one kernel
whose name contains ``::dispatch`` and one containing ``::combine``. A profiler trace therefore shows a
short name for each kernel, and ``::dispatch`` / ``::combine`` picks out the data-moving kernels. Helper
kernels (the FP8 staging kernel, the intranode count exchange, the layout counts) have neither word in
their names.

Each function returns the string to give to ``BuildSpec.make(..., name_expressions=[...])`` and then to
``LoadedModule.get_function``. Template arguments appear as C++ spells them: integers in decimal,
booleans as ``true`` / ``false``, separated by ``", "``.

Value errors: a kernel that reads ``topk_idx`` treats an id outside ``[-1, num_experts)`` as ``-1`` (no
expert) and reports one such id through its error record (``cuda_src/common/value_errors.cuh``): flag 1,
``op`` one of the ``VALUE_OP_*`` codes below, ``peer`` -1, the word after ``line`` set to
:attr:`~deepep_cupy.device.kernel_errors.RecordKind.VALUE_ERROR`, and the offending id in the 64-bit word where a timeout keeps the time it
waited. :data:`VALUE_OP_ARGS` names the operation and the argument for each code.
"""

from __future__ import annotations

from .headers import constant

__all__ = [
    "LL_BOTH",
    "LL_RECV",
    "LL_SEND",
    "VALUE_OP_ARGS",
    "VALUE_OP_INTERNODE_DISPATCH",
    "VALUE_OP_INTRANODE_DISPATCH",
    "VALUE_OP_LAYOUT",
    "VALUE_OP_LL_COMBINE",
    "VALUE_OP_LL_DISPATCH",
    "internode_combine",
    "internode_dispatch",
    "internode_notify",
    "intranode_combine",
    "intranode_combine_copy",
    "intranode_dispatch",
    "intranode_notify",
    "layout_count_recv_rows",
    "layout_count_tokens",
    "layout_place_recv_rows",
    "ll_combine",
    "ll_dispatch",
    "ll_stage",
]

#: Op codes of value errors (``kValueOp*`` in ``cuda_src/common/value_errors.cuh``).
_VALUES = "common/value_errors.cuh"
VALUE_OP_LAYOUT = constant(_VALUES, "kValueOpLayout")
VALUE_OP_INTRANODE_DISPATCH = constant(_VALUES, "kValueOpIntranodeDispatch")
VALUE_OP_LL_DISPATCH = constant(_VALUES, "kValueOpLowLatencyDispatch")
VALUE_OP_LL_COMBINE = constant(_VALUES, "kValueOpLowLatencyCombine")
VALUE_OP_INTERNODE_DISPATCH = constant(_VALUES, "kValueOpInternodeDispatch")

#: Op code -> (operation, argument) for error messages.
VALUE_OP_ARGS: dict[int, tuple[str, str]] = {
    VALUE_OP_LAYOUT: ("get_dispatch_layout", "topk_idx"),
    VALUE_OP_INTRANODE_DISPATCH: ("intranode_dispatch", "topk_idx"),
    VALUE_OP_LL_DISPATCH: ("low_latency_dispatch", "topk_idx"),
    VALUE_OP_LL_COMBINE: ("low_latency_combine", "topk_idx"),
    VALUE_OP_INTERNODE_DISPATCH: ("internode_dispatch", "topk_idx"),
}


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _ints(*values: int) -> str:
    return ", ".join(str(int(v)) for v in values)


# ---------------------------------------------------------------------------------------- low latency
#: ``DEEPEP_CUPY_LL_PHASES`` of a low-latency module: both phases in one launch (no hook), or a hook's send
#: part and its receive part, each compiled without the other phase's code. The phases are a define of the
#: module, not part of the kernel's name: a hook's two parts are two modules whose kernels have the same
#: name, so a profile shows one ``::dispatch`` and one ``::combine`` row, as DeepEP's tests count them.
LL_SEND = constant("low_latency/buffer_map.cuh", "kPhaseSend")
LL_RECV = constant("low_latency/buffer_map.cuh", "kPhaseRecv")
LL_BOTH = LL_SEND | LL_RECV


def ll_dispatch(hidden: int, topk: int, warps: int, groups: int, use_fp8: bool) -> str:
    """``deepep_cupy::low_latency::dispatch<H, K, W, G, fp8>`` (``cuda_src/low_latency/dispatch.cu``)."""
    return f"deepep_cupy::low_latency::dispatch<{_ints(hidden, topk, warps, groups)}, {_flag(use_fp8)}>"


def ll_stage(hidden: int, use_fp8: bool) -> str:
    """``deepep_cupy::low_latency::stage<H, fp8>``: the RMA path's staging cast, same source as the dispatch."""
    return f"deepep_cupy::low_latency::stage<{_ints(hidden)}, {_flag(use_fp8)}>"


def ll_combine(hidden: int, topk: int, warps: int, groups: int, use_logfmt: bool, partials: bool = False) -> str:
    """``deepep_cupy::low_latency::combine<H, K, W, G, logfmt, partials>`` (``cuda_src/low_latency/combine.cu``)."""
    return (f"deepep_cupy::low_latency::combine<{_ints(hidden, topk, warps, groups)}, {_flag(use_logfmt)}, "
            f"{_flag(partials)}>")


# ---------------------------------------------------------------------------------------- intranode
def intranode_notify(num_ranks: int) -> str:
    """``deepep_cupy::intranode::notify<R>``: the count exchange before a dispatch (``intranode/notify.cu``)."""
    return f"deepep_cupy::intranode::notify<{_ints(num_ranks)}>"


def intranode_dispatch(num_ranks: int, warps: int, unroll: int) -> str:
    """``deepep_cupy::intranode::dispatch<R, W, U>`` (``cuda_src/intranode/dispatch.cu``)."""
    return f"deepep_cupy::intranode::dispatch<{_ints(num_ranks, warps, unroll)}>"


def intranode_combine(num_ranks: int, warps: int, unroll: int, ordered: bool = False) -> str:
    """``deepep_cupy::intranode::combine<R, W, U>`` (``cuda_src/intranode/combine.cu``); ``ordered``: the
    instantiation that sums in V2's order (``<R, W, U, true>``)."""
    return f"deepep_cupy::intranode::combine<{_ints(num_ranks, warps, unroll)}{', true' if ordered else ''}>"


def intranode_combine_copy(num_ranks: int, warps: int, unroll: int, ordered: bool = False) -> str:
    """``deepep_cupy::intranode::combine_copy<R, W, U>``: the sums of the combine's copy mode
    (``cuda_src/intranode/combine_copy.cu``); ``ordered`` as for :func:`intranode_combine`."""
    return f"deepep_cupy::intranode::combine_copy<{_ints(num_ranks, warps, unroll)}{', true' if ordered else ''}>"


# ---------------------------------------------------------------------------------------- internode
def internode_notify(num_nvl_ranks: int, num_domains: int) -> str:
    """``deepep_cupy::internode::notify<L, D>``: counts across domains (``cuda_src/internode/notify.cu``)."""
    return f"deepep_cupy::internode::notify<{_ints(num_nvl_ranks, num_domains)}>"


def internode_dispatch(num_nvl_ranks: int, num_domains: int, sub_channels: int) -> str:
    """``deepep_cupy::internode::dispatch<L, D, S>``, ``S`` channels a block (``cuda_src/internode/dispatch.cu``)."""
    return f"deepep_cupy::internode::dispatch<{_ints(num_nvl_ranks, num_domains, sub_channels)}>"


def internode_combine(num_nvl_ranks: int, num_domains: int, sub_channels: int) -> str:
    """``deepep_cupy::internode::combine<L, D, S>`` (``cuda_src/internode/combine.cu``)."""
    return f"deepep_cupy::internode::combine<{_ints(num_nvl_ranks, num_domains, sub_channels)}>"


# ---------------------------------------------------------------------------------------- layout
def layout_count_tokens(num_topk: int, cluster: int) -> str:
    """``deepep_cupy::layout::count_tokens<K, C>``: tokens per expert / rank / RDMA rank, on a cluster of C
    blocks (``cuda_src/layout/count_tokens.cu``)."""
    return f"deepep_cupy::layout::count_tokens<{_ints(num_topk, cluster)}>"


def layout_count_recv_rows() -> str:
    """``deepep_cupy::layout::count_recv_rows``: V2's received selections per local expert and the sent
    tokens' slots at their destinations (``cuda_src/layout/recv_rows.cu``)."""
    return "deepep_cupy::layout::count_recv_rows"


def layout_place_recv_rows() -> str:
    """``deepep_cupy::layout::place_recv_rows``: V2's expanded rows and per-row metadata (``layout/recv_rows.cu``)."""
    return "deepep_cupy::layout::place_recv_rows"
