"""Plan keys: equal metadata finds the plan; what is not a tensor, handle or Config is never cached (so the
argument checks run and name it, and the cache cannot grow with every such call)."""

from __future__ import annotations

import numpy as np

from deepep_cupy.config import Config
from deepep_cupy.frameworks import meta
from deepep_cupy.ops.handles import handle_meta, ll_handle_meta
from deepep_cupy.ops.plan import config_key, lookup, store


def test_equal_metadata_finds_the_plan():
    plans = {}
    a, b = np.zeros((4, 8), np.int64), np.ones((4, 8), np.int64)
    store(plans, (meta(a), 3), "plan")
    assert lookup(plans, (meta(b), 3)) == "plan"
    assert lookup(plans, (meta(np.zeros((4, 9), np.int64)), 3)) is None
    assert lookup(plans, (meta(np.zeros((4, 8), np.int32)), 3)) is None
    assert lookup(plans, (meta(np.zeros((8, 4), np.int64).T), 3)) is None  # not contiguous


def test_unusable_arguments_are_never_cached():
    plans = {}
    for key in ((meta("not a tensor"), 1), (handle_meta((1, 2, 3, 4, 5, 6)),), (handle_meta(object()),),
                (ll_handle_meta((1, 2)),), (config_key(object()),)):
        for _ in range(3):
            assert lookup(plans, key) is None
            store(plans, key, "plan")
    assert plans == {}


def test_lists_and_tuples_are_the_same_handle():
    h = [np.zeros((2, 2), np.int32)] * 6
    assert handle_meta(h) == handle_meta(tuple(h))
    assert config_key(Config(24, 6, 256, 6, 128)) == config_key(Config(24, 6, 256, 6, 128))
