"""Plan keys: equal metadata finds the plan; what is not a tensor, handle or Config is never cached (so the
argument checks run and name it, and the cache cannot grow with every such call). A change of an engine's
tuning drops the plans made with the old values; a tuning attribute is never changed any other way."""

from __future__ import annotations

import numpy as np
import pytest
from thread_group import run_ranks

from deepep_cupy.config import Config
from deepep_cupy.frameworks import meta
from deepep_cupy.ops.handles import handle_meta, ll_handle_meta
from deepep_cupy.ops.internode.engine import InternodeEngine
from deepep_cupy.ops.intranode.engine import IntranodeEngine
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


@pytest.mark.parametrize("Engine", [IntranodeEngine, InternodeEngine])
def test_tune_sets_the_attributes_then_tells_the_owner(Engine):
    engine = object.__new__(Engine)
    told = []
    engine.on_tuning_change = lambda: told.append(engine.timeout_s)
    engine.tune(timeout_s=3.0, use_output_pool=False)
    assert (engine.timeout_s, engine.use_output_pool, told) == (3.0, False, [3.0])  # told after both were set
    engine.tune()
    assert told == [3.0]  # nothing set, nothing dropped
    with pytest.raises(TypeError, match="unknown tuning attributes own_copy_min_rows, bogus"):
        engine.tune(timeout_s=9.0, own_copy_min_rows=1, bogus=2)
    assert engine.timeout_s == 3.0 and told == [3.0]  # a refused call sets nothing


@pytest.mark.parametrize("Engine", [IntranodeEngine, InternodeEngine])
def test_assigning_a_tuning_attribute_names_tune(Engine):
    engine = object.__new__(Engine)
    engine.on_tuning_change = lambda: pytest.fail("nothing was tuned")
    for name in Engine.TUNING:
        with pytest.raises(AttributeError, match=rf"{name} is a tuning attribute: set it with "
                                                 rf"{Engine.__name__}\.tune\({name}=\.\.\.\)"):
            setattr(engine, name, 1)
        assert name not in engine.__dict__
    engine.own_copies = 5  # state that plans do not fix is assigned as usual
    assert engine.own_copies == 5


def test_intranode_own_rows_knobs_are_tuning():
    assert {"own_rows_warps", "recv_own_rows_warps"} <= set(IntranodeEngine.TUNING)
    assert not {"self_warps", "recv_self_warps"} & set(IntranodeEngine.TUNING)


def test_tuning_an_engine_drops_its_buffers_normal_plans(monkeypatch):
    """engine.tune -> CudaBackend._tuning_changed -> the Buffer's plans_invalidated: the dispatch and combine
    plans go, the layout's (which no tuning attribute shapes) stay."""
    pytest.importorskip("cupy", reason="the GPU backend's module imports CuPy")
    from deepep_cupy import Buffer
    from deepep_cupy import backends as backends_module
    from deepep_cupy import buffer_core as buffer_core_module
    from deepep_cupy.backends.cuda import CudaBackend

    def backend(kind, group, **options):
        # The state CudaBackend's constructor leaves (it needs a GPU), with an engine that has no buffers.
        b = object.__new__(CudaBackend)
        b.pending_agreements, b.low_latency, b.internode = [], None, None
        b.intranode = object.__new__(IntranodeEngine)
        b.intranode.on_tuning_change = b._tuning_changed  # as the constructor wires it
        b.release_local = lambda: None
        return b

    monkeypatch.setattr(backends_module, "gpu_count", lambda: 1)
    monkeypatch.setattr(buffer_core_module, "make_backend", backend)

    def body(group):
        buf = Buffer(comm=group, backend="cuda", num_nvl_bytes=1 << 20, num_nvl_ranks=1)
        engine = buf.runtime.intranode
        buf._dispatch_plans["d"], buf._combine_plans["c"], buf._layout_plans["l"] = 1, 2, 3
        with pytest.raises(AttributeError, match="tune"):
            engine.dispatch_warps = 24
        assert buf._dispatch_plans == {"d": 1} and buf._combine_plans == {"c": 2}
        engine.tune(dispatch_warps=24, own_rows_warps=2)
        assert engine.dispatch_warps == 24 and engine.own_rows_warps == 2
        assert buf._dispatch_plans == {} and buf._combine_plans == {} and buf._layout_plans == {"l": 3}
        del buf  # the backend holds the Buffer weakly: a later tune finds nobody to tell
        engine.tune(dispatch_warps=None)
        return engine.dispatch_warps

    assert run_ranks(1, body) == [None]
