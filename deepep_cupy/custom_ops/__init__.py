"""``torch.compile`` support: every ``Buffer`` op as a torch custom op that dynamo traces through.

A ``Buffer`` method called while dynamo traces (``torch.compile``) hands its arguments to this package,
which calls custom ops registered with ``torch.library`` (namespace ``deepep_cupy``): their fake
implementations give the output shapes from the inputs and the op's static parameters, their real
implementations call the same ``Buffer`` method eagerly when the compiled graph runs. Eager calls never
come here: each routed method starts with one check, ``_compiling()``, bound to
``torch.compiler.is_dynamo_compiling`` (a function that returns False) once torch is imported.

Custom ops take no Python objects, so a Buffer travels as an integer id (:func:`common.buffer_id`,
fixed while tracing), a handle as its tensors (rebuilt into the tuple by the traced code), a receive
hook as a second op that the traced code calls, and an event as ``EventOverlap(None)``: inside a
compiled region every op finishes on the current stream (``async_finish`` and
``allocate_on_comm_stream`` are ignored there, ``previous_event`` must carry no event).

Modules: ``library`` (how an op is registered with the dispatcher: one Python kernel per call, not
``torch.library.custom_op``'s layers), ``common`` (registry, handle bookkeeping, output hygiene),
``low_latency`` (decoding ops, hooks, zero-copy), ``normal`` (layout, dispatch, cached dispatch, combine
and their backward formulas). Those import torch; this module does not.
"""

from __future__ import annotations

import itertools
import sys
import weakref

__all__ = ["tracing_check", "outside", "register", "registered"]

# Every Buffer by the integer that stands for it in the custom ops' arguments (custom ops take no Python
# objects). Given at construction, which every rank does in the same order: the same ids everywhere.
_BUFFERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count(1)


def register(buffer) -> int:
    """A new id for ``buffer`` (called by ``Buffer.__init__``); the registry holds it weakly."""
    bid = next(_NEXT_ID)
    _BUFFERS[bid] = buffer
    return bid


def registered(bid: int):
    """The Buffer of id ``bid``, or None once it is gone."""
    return _BUFFERS.get(bid)


def tracing_check(namespace: dict, name: str = "_compiling"):
    """The function a module binds as ``namespace[name]`` to ask "is dynamo tracing this call?".

    ``torch.compiler.is_dynamo_compiling`` itself when torch is imported (dynamo folds it to True while
    tracing; eagerly it is a call that returns False). Before torch is imported, a stand-in that returns
    False while torch is absent and, at its first eager call with torch present, rebinds
    ``namespace[name]`` to torch's function (never while tracing: dynamo would replay the rebinding).
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        return _torch_check(torch)

    def check() -> bool:
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        fn = _torch_check(torch)
        if fn():
            return True
        namespace[name] = fn
        return False

    return check


def outside(method, *args):
    """``method(*args)`` run eagerly, outside the graph dynamo is tracing: a graph break, as dynamo makes
    for DeepEP's C++ methods. For the Buffer methods that are no op of a model's step (buffer cleaning,
    rank masks, raw buffer views, streams, ``destroy``), which would otherwise be traced into their
    NumPy or driver code."""
    from .common import run_outside

    return run_outside(method, *args)


def _torch_check(torch):
    compiler = getattr(torch, "compiler", None)
    fn = getattr(compiler, "is_dynamo_compiling", None)
    if fn is None:  # torch before 2.3: the ops need 2.4 anyway, so nothing is routed
        return _never
    return fn


def _never() -> bool:
    return False
