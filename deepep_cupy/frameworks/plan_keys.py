"""The metadata plan keys are made of (:func:`meta`): per tensor argument its framework, shape, dtype,
contiguity and device, read natively from each framework (nothing goes through DLPack)."""

from __future__ import annotations

import numpy as np

from .dtypes import framework_of


def _torch_meta(t):
    return ("torch", t.shape, t.dtype, t.is_contiguous(), t.get_device())


def _cupy_meta(t):
    return ("cupy", t.shape, t.dtype, t.flags.c_contiguous, t.data.device_id)


def _numpy_meta(t):
    return ("numpy", t.shape, t.dtype, t.flags.c_contiguous, -1)


_META_BY_FRAMEWORK = {"numpy": _numpy_meta, "torch": _torch_meta, "cupy": _cupy_meta}
_META_BY_TYPE: dict = {np.ndarray: _numpy_meta}


def meta(t):
    """What a plan depends on about a tensor argument: framework, shape, dtype, contiguity, device.

    Cheap (a dictionary lookup on the type and a few attribute reads), hashable, and None for None. An
    object that is no tensor gets an unhashable marker: a key holding it is never cached, so the full
    argument checks run for that call and report the argument by name.
    """
    if t is None:
        return None
    fn = _META_BY_TYPE.get(type(t))
    if fn is None:
        framework = framework_of(t)
        if framework is None:
            return ["not a tensor"]  # unhashable: such a call is never cached, its checks name it
        fn = _META_BY_TYPE[type(t)] = _META_BY_FRAMEWORK[framework]
    return fn(t)
