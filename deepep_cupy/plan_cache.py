"""Plan caches of the ``Buffer``: the keys a call's plan is looked up by.

A key holds what a plan depends on: each tensor argument's framework, shape, dtype, contiguity and
device (:func:`deepep_cupy.tensors.meta`) and the op's flags. A call whose key was seen before skips
every argument check and goes straight to the plan's launch.
"""

from __future__ import annotations

from .config import Config
from .tensors import meta

__all__ = ["lookup", "store", "handle_meta", "ll_handle_meta", "config_key"]


def lookup(plans: dict, key):
    """The plan for ``key``, or None (also for a key that cannot be hashed: the argument checks of a new
    plan then name the argument that made it so)."""
    try:
        return plans.get(key)
    except TypeError:
        return None


def store(plans: dict, key, plan):
    try:
        plans[key] = plan
    except TypeError:
        pass
    return plan


#: Part of a key that is never stored: an unhashable marker makes the lookup miss and the store skip,
#: so the argument checks of a new plan run (and name the argument) on every such call.
_NOT_A_KEY = ["unchecked"]


def handle_meta(handle):
    if handle is None:
        return None
    if not isinstance(handle, (tuple, list)) or len(handle) not in (6, 10):
        return _NOT_A_KEY
    return tuple(meta(h) for h in handle)


def ll_handle_meta(handle):
    if not isinstance(handle, (tuple, list)) or len(handle) != 5:
        return _NOT_A_KEY
    return (meta(handle[0]), meta(handle[1]), handle[2], handle[3], handle[4])


def config_key(config) -> tuple | list:
    if not isinstance(config, Config):
        return _NOT_A_KEY
    return (config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
            config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens)


class OpHandle(tuple):
    """A handle exactly as one of this library's GPU ops returned it (a plain tuple to its users).

    Its entries were written by the kernels, so the index checks of handles given back to an op (which
    wait for the device) are for handles a caller built or rebuilt, which are plain tuples.
    """

    __slots__ = ()


class LowLatencyHandle(OpHandle):
    """A low-latency dispatch's handle, which also keeps the dispatch's row map (``row_map``: the inverse
    of its source info, ``[R*T, E_local]`` int32, cuda_src/low_latency/layout.cuh ``record_row``) for the
    partial-sum combine. A tuple subclass cannot have slots, so the attribute lives in a ``__dict__``."""
