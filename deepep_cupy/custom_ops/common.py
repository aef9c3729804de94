"""What the custom ops of both families share: the Buffer registry, output hygiene (several outputs of one
allocation returned as that allocation, copies of aliased ones), the handles the ops made themselves, and
the checks of arguments that only compiled code restricts."""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..config import Config
from ..device.output_pool import framework_outputs
from ..event import EventOverlap
from . import registered

__all__ = ["NS", "NO_EVENT", "buffer_id", "buffer_of", "config_list", "config_of", "run_config", "fresh",
           "TORCH_DTYPES", "word_layout", "unpack", "pack", "remember_handle", "handle_entry", "no_event", "define",
           "run_outside", "graph_tree_running", "dispatch_outputs"]

if not hasattr(torch.library, "register_fake"):
    raise ImportError(f"torch.compile of deepep_cupy's ops needs torch >= 2.4 (torch.library.register_fake), "
                      f"this is torch {torch.__version__}")

from .library import NS, Op  # noqa: E402  (after the version check: it registers with torch.library)

# Every op of a compiled region has finished on the current stream when the next one starts.
NO_EVENT = EventOverlap(None)

_any_alias = getattr(torch._C, "_any_output_is_alias_to_input_or_output", None)


_NO_CONTEXT = contextlib.nullcontext()


def graph_tree_running(device_index: int) -> bool:
    """Whether torch's CUDA-graph trees (``mode="reduce-overhead"``) are warming up or recording a compiled
    function on this thread and device: they run it on their manager's own stream, with torch allocating
    into the graph's memory pool."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:  # never imported: no compiled function uses them
        return False
    try:
        manager = trees.get_manager(device_index, create_if_none_exists=False)
    except Exception:  # a thread whose trees torch never set up
        return False
    stream = getattr(manager, "stream", None)
    return stream is not None and torch._C._cuda_getCurrentRawStream(device_index) == stream.cuda_stream


def dispatch_outputs(x: torch.Tensor):
    """The context a dispatch op calls the Buffer in: outside the output pool (``framework_outputs``) where
    CUDA-graph trees run it, since they want every output in their own pool; else none, so that a compiled
    dispatch takes the modes an eager call of the same shape takes (direct mode into the output pool)."""
    if x.is_cuda and graph_tree_running(x.device.index):
        return framework_outputs()
    return _NO_CONTEXT


def buffer_id(buffer) -> int:
    """The integer that stands for ``buffer`` in the ops' arguments, from the Buffer's attribute made at
    construction. The attribute holds it as text: dynamo reads a string as a constant of the graph, where it
    may make an int attribute symbolic (``dynamic=True``), and folds ``int`` of a constant."""
    return int(buffer._compiled_op_key)


def buffer_of(bid: int):
    buffer = registered(bid)
    if buffer is None:
        raise RuntimeError(f"the Buffer of this compiled deepep_cupy op (id {bid}) no longer exists: a compiled "
                           "function must not outlive the Buffer it was traced with")
    return buffer


@torch.compiler.disable
def run_outside(method, *args):
    return method(*args)


def define(name: str, mutates_args=(), tags=(), integer_inputs: bool = False):
    """A decorator making the function an op of this package's namespace (:class:`library.Op`)."""
    return lambda fn: Op(name, fn, mutates_args=mutates_args, tags=tuple(tags), integer_inputs=integer_inputs)


def config_list(config) -> list[int]:
    """A ``Config`` as the ints an op takes (empty: the Buffer's default)."""
    if config is None:
        return []
    if not isinstance(config, Config):
        raise TypeError(f"config must be a deepep_cupy Config or None, got {type(config).__name__}")
    return list(config.key())


def config_of(values) -> Config | None:
    # int(): a caller's Config read while tracing with dynamic=True gives symbolic values; the fake
    # implementations specialize them (a guard: another config recompiles).
    return _config(tuple(int(v) for v in values)) if values else None


def run_config(values: list) -> Config | None:
    """``config_of`` for an op's implementation, whose values are ints: no conversion of each."""
    return _config(tuple(values)) if values else None


@functools.lru_cache(maxsize=64)
def _config(values: tuple) -> Config:
    return Config(*values)


def no_event(previous_event) -> None:
    """Compiled ops run in stream order: an event from outside the region cannot be waited on inside it."""
    if previous_event is not None and getattr(previous_event, "event", None) is not None:
        raise ValueError("previous_event must be None (or an EventOverlap without event) inside a torch.compile "
                         "region: wait on it before the compiled function, where ops run in stream order")


def fresh(outputs: list, inputs: list) -> list:
    """``outputs`` where each tensor that shares storage with an input or an earlier output is replaced
    by a copy: a custom op's outputs must be new tensors (torch checks it after every call). Only
    handles that pass an input through (``is_token_in_rank``) or outputs carved from one allocation
    need it; the ops avoid both where they can, so this is a fallback."""
    if _any_alias is not None and not _any_alias(tuple(inputs), {}, tuple(outputs)):  # torch's C++ check
        return outputs
    seen = {t.untyped_storage()._cdata for t in inputs if isinstance(t, torch.Tensor)}
    out = []
    for t in outputs:
        key = t.untyped_storage()._cdata
        if key in seen:
            t = t.clone()
            key = t.untyped_storage()._cdata
        seen.add(key)
        out.append(t)
    return out


# ------------------------------------------------------------------------------------ one allocation
# A GPU plan that cuts several small outputs from one allocation (frameworks.SmallOutputs) has the op
# return that allocation, and the traced code cuts the same views: outputs of one op may not share
# storage, and a copy of each would cost more host time than the op.
TORCH_DTYPES = {"int32": torch.int32, "float32": torch.float32, "int64": torch.int64, "bool": torch.bool}
_ITEMSIZE = {"int32": 4, "float32": 4, "int64": 8, "bool": 1}
_ALIGN_BYTES = 64


def word_layout(specs) -> tuple:
    """``(parts, total_words)`` for ``specs`` ``(shape, dtype name)``: parts ``(shape, dtype name, strides,
    offset)`` (strides and offset in elements of the part's dtype) where ``SmallOutputs`` places them in one
    int32 allocation, each on a 64-byte boundary. Plain arithmetic, so that the traced code may call it
    with symbolic sizes."""
    parts, nbytes = [], 0
    for shape, kind in specs:
        size = _ITEMSIZE[kind]
        strides, step, count = [], 1, 1
        for d in reversed(shape):
            strides.append(step)
            step, count = step * at_least_1(d), count * d
        parts.append((tuple(shape), kind, tuple(reversed(strides)), nbytes // size))
        nbytes += -(-(count * size) // _ALIGN_BYTES) * _ALIGN_BYTES
    return tuple(parts), at_least_1(nbytes // 4)


def at_least_1(n):
    """``max(n, 1)``, without a guard on a symbolic ``n``. Plain ints take ``max``: dynamo on torch 2.11
    refuses ``torch.sym_max`` of two constants ("torch.* op returned non-Tensor")."""
    return torch.sym_max(n, 1) if isinstance(n, torch.SymInt) else max(n, 1)


def unpack(words, layout) -> list:
    """The views of ``words`` (int32) that ``layout`` (:func:`word_layout`) places."""
    parts, _ = layout
    bases = {"int32": words}
    views = []
    for shape, kind, strides, offset in parts:
        base = bases.get(kind)
        if base is None:
            base = bases[kind] = words.view(torch.uint8 if kind == "bool" else TORCH_DTYPES[kind])
        view = base.as_strided(shape, strides, offset)
        if kind == "bool":
            # Inductor's CUDA lowering of a view as bool asks torch.iinfo(torch.bool) and fails, so traced
            # code compares the bytes instead (a copy of a few bytes a token); eager code keeps the view,
            # which pack writes through.
            view = (view != 0) if torch.compiler.is_compiling() else view.view(torch.bool)
        views.append(view)
    return views


def _stored(parts: list, layout) -> bool:
    """Whether ``parts`` already sit in one allocation as ``layout`` places them (the GPU plans')."""
    first = parts[0]
    if first.storage_offset() != 0:
        return False
    base = first.data_ptr()
    for t, (shape, _, strides, offset) in zip(parts, layout[0], strict=True):
        if tuple(t.shape) != shape or t.stride() != strides or \
                (t.data_ptr() != base + offset * t.element_size() and t.numel()):  # an empty part holds nothing
            return False
    return True


def pack(parts: list, layout):
    """The one int32 allocation holding ``parts`` as ``layout`` places them: the GPU plan's own where they
    are its views (no copy), else a new one they are copied into (the reference backend's arrays)."""
    if _stored(parts, layout):
        return parts[0].as_strided((layout[1],), (1,), 0)  # part 0 is int32 in every layout here
    words = parts[0].new_zeros((layout[1],), dtype=torch.int32)  # zeros: the gaps read the same every call
    for view, t in zip(unpack(words, layout), parts, strict=True):
        view.copy_(t)
    return words


# Handles this package's ops made, by the storage of one of their tensors: the handle class and the
# attributes the GPU path keeps on it (read back counts, a row map's place). Only storages still alive
# count (a weak reference to each), so a caller's tensor that reuses the memory is never taken for one.
_OWN: dict = {}
_OWN_MAX = 64


def remember_handle(tensor, info) -> None:
    """Note that ``tensor`` (one of a handle's tensors) came from an op of this package with ``info``."""
    storage = tensor.untyped_storage()
    if len(_OWN) >= _OWN_MAX:
        for key in [k for k, (ref, _) in _OWN.items() if ref.expired()]:
            del _OWN[key]
        if len(_OWN) >= _OWN_MAX:
            del _OWN[next(iter(_OWN))]
    _OWN[storage._cdata] = (StorageWeakRef(storage), info)


def handle_entry(tensor):
    """The ``info`` :func:`remember_handle` kept for ``tensor``'s storage, or None (a handle the caller built,
    or one whose tensors were copied on their way, e.g. by functionalization)."""
    found = _OWN.get(tensor.untyped_storage()._cdata)
    if found is None or found[0].expired():
        return None
    return found[1]
