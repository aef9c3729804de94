"""The V2 buffers' constructor, helpers and refusals: a bad argument raises TypeError or ValueError naming it
before any work, what is not offered raises NotImplementedError naming it."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ep_v2_calls as C  # noqa: E402
import ep_v2_ref as R  # noqa: E402
from thread_group import run_ranks  # noqa: E402

import deepep_cupy  # noqa: E402
from deepep_cupy import ElasticBuffer, EPBuffer  # noqa: E402

T, H, E, K = 8, 256, 8, 4
MiB2 = 2 * 1024 * 1024


def _one(fn, size=1):
    return run_ranks(size, fn)


@pytest.mark.parametrize("cls", [ElasticBuffer, EPBuffer])
@pytest.mark.parametrize("kw, kind, name", [
    ({"num_bytes": MiB2 + 1}, ValueError, "num_bytes"),
    ({"num_bytes": None, "hidden": 0}, ValueError, "num_bytes"),
    ({"num_topk": 33}, ValueError, "num_topk"),
    ({"hidden": -1}, ValueError, "hidden"),
    ({"deterministic": "yes"}, TypeError, "deterministic"),
    ({"num_allocated_qps": -2}, ValueError, "num_allocated_qps"),
    ({"num_cpu_timeout_secs": 0}, ValueError, "num_cpu_timeout_secs"),
    ({"no_such_argument": 1}, TypeError, "no_such_argument"),
])
def test_constructor_refuses(cls, kw, kind, name):
    def rank(g):
        args = {"num_max_tokens_per_rank": T, "hidden": H, "backend": "reference"} | kw
        with pytest.raises(kind, match=name):
            cls(g, **args)
        return True

    assert all(_one(rank))


def test_constructor_refuses_what_is_not_offered():
    def rank(g):
        with pytest.raises(ValueError, match="num_cpu_bytes"):
            ElasticBuffer(g, num_cpu_bytes=MiB2, num_max_tokens_per_rank=T, hidden=H, backend="reference")
        with pytest.raises(ValueError, match="lb_allocation_plan_or_num_bytes"):
            EPBuffer(g, num_max_tokens_per_rank=T, hidden=H, lb_allocation_plan_or_num_bytes=MiB2,
                     backend="reference")
        buffer = EPBuffer(g, num_max_tokens_per_rank=T, hidden=H, backend="reference")
        for name in ("lb_prefetch_weights", "lb_reduce_grads", "lb_get_theoretical_num_sms"):
            with pytest.raises(NotImplementedError, match=name):
                getattr(buffer, name)()
        elastic = ElasticBuffer(g, num_max_tokens_per_rank=T, hidden=H, backend="reference")
        for name in ("engram_write", "pp_send", "all_gather", "get_engram_storage_size_hint"):
            with pytest.raises(NotImplementedError, match=name):
                getattr(elastic, name)()
        with pytest.raises(RuntimeError, match="explicitly_destroy"):
            elastic.destroy()
        return True

    assert all(_one(rank))


def test_buffer_helpers():
    def rank(g):
        hint = EPBuffer.get_buffer_size_hint(g, T, H, num_topk=K)
        assert hint % MiB2 == 0 and hint == ElasticBuffer.get_buffer_size_hint(g, T, H, K)
        assert EPBuffer.get_buffer_size_hint(g, T, H) >= hint  # num_topk 0 is sized for more slots
        buffer = EPBuffer(g, num_max_tokens_per_rank=T, hidden=H, explicitly_destroy=True, backend="reference",
                          allow_hybrid_mode=False)
        assert buffer.num_bytes == EPBuffer.get_buffer_size_hint(g, T, H)
        assert buffer.get_physical_domain_size() == (1, g.size)
        assert buffer.get_logical_domain_size() == (1, g.size)
        assert deepep_cupy.get_physical_domain_size(buffer) == (1, g.size)
        assert deepep_cupy.get_logical_domain_size(g, allow_hybrid_mode=False) == (1, g.size)
        assert deepep_cupy.get_physical_domain_size(g) == (1, g.size)
        sms = buffer.get_theoretical_num_sms(E, K)
        assert sms == deepep_cupy.Buffer.num_sms and sms % 2 == 0
        assert buffer.num_allocated_qps == 17 and buffer.get_theoretical_num_qps(sms) == min(sms, 9)
        with pytest.raises(ValueError, match="num_scaleout_topk"):
            buffer.get_theoretical_num_sms(E, K, num_scaleout_topk=1)
        assert isinstance(buffer.capture(), deepep_cupy.EventHandle)
        buffer.barrier()
        assert buffer.get_comm_stream() is None
        buffer.destroy()
        with pytest.raises(RuntimeError, match="destroyed"):
            buffer.dispatch(C.t(np.zeros((1, H), R.BF16)), topk_idx=C.t(np.zeros((1, K), np.int64)), num_experts=E)
        return True

    assert all(_one(rank, 2))


def test_dispatch_and_combine_refuse_bad_arguments():
    def rank(g):
        buffer = EPBuffer(g, num_max_tokens_per_rank=T, hidden=H, backend="reference")
        inp = R.rank_inputs(3, g.rank, num_tokens=T, hidden=H, num_experts=E, num_topk=K)
        x, topk = C.t(inp.x), C.t(inp.topk_idx)
        base = dict(x=x, topk_idx=topk, num_experts=E)
        bad = [
            (dict(topk_idx=None), ValueError, "topk_idx"),
            (dict(num_experts=None), ValueError, "num_experts"),
            (dict(num_experts=7), ValueError, "num_experts"),
            (dict(topk_idx=topk.int()), TypeError, "topk_idx"),
            (dict(topk_weights=C.t(inp.topk_weights[:, :2])), ValueError, "topk_weights"),
            (dict(x=x.float()), TypeError, "x"),
            (dict(x=C.t(np.zeros((T + 1, H), R.BF16)), topk_idx=C.t(np.zeros((T + 1, K), np.int64))),
             ValueError, "num_max_tokens_per_rank"),
            (dict(expert_alignment=0), ValueError, "expert_alignment"),
            (dict(do_zero_padding=True), ValueError, "do_zero_padding"),
            (dict(defer_epilogue=True), ValueError, "defer_epilogue"),
            (dict(previous_event=buffer.capture()), ValueError, "previous_event"),
            (dict(do_handle_copy=True), ValueError, "do_handle_copy"),
            (dict(num_qps=10 ** 6), ValueError, "num_qps"),
            (dict(cumulative_local_expert_recv_stats=C.t(np.zeros(3, np.int32))), ValueError,
             "cumulative_local_expert_recv_stats"),
        ]
        for change, kind, name in bad:
            with pytest.raises(kind, match=name):
                buffer.dispatch(**(base | change))
        recv_x, _, _, handle, _ = buffer.dispatch(**base)
        for change, kind, name in [(dict(topk_idx=topk), ValueError, "topk_idx"),
                                   (dict(do_cpu_sync=True), ValueError, "do_cpu_sync"),
                                   (dict(do_expand=True), ValueError, "do_expand"),
                                   (dict(num_experts=2 * E), ValueError, "num_experts"),
                                   (dict(handle=(1, 2)), TypeError, "handle")]:
            with pytest.raises(kind, match=name):
                buffer.dispatch(**(dict(x=x, handle=handle) | change))
        for change, kind, name in [(dict(x=recv_x[1:]), ValueError, "x"),
                                   (dict(x=recv_x.float()), TypeError, "x"),
                                   (dict(handle=None), TypeError, "handle"),
                                   (dict(topk_weights=C.t(np.zeros((1, K), np.float32))), ValueError, "topk_weights"),
                                   (dict(bias=(x, x, x)), ValueError, "bias"),
                                   (dict(bias=x[:, :8]), ValueError, "bias")]:
            with pytest.raises(kind, match=name):
                buffer.combine(**(dict(x=recv_x, handle=handle) | change))
        return True

    assert all(_one(rank, 2))


def test_num_sms_reaches_v1s_kernels():
    """A V2 call's ``num_sms`` becomes the SM count of V1's config (rounded down to even); 0 leaves V1's own
    choice; the results do not depend on it."""
    def rank(g):
        buffer = EPBuffer(g, num_max_tokens_per_rank=T, hidden=H, backend="reference")
        seen = []
        v1 = buffer._v1
        # V2's combine calls V1's combine past its frame (``_combine``, config its fifth argument).
        for name, attr in (("dispatch", "dispatch"), ("combine", "_combine")):
            method = getattr(v1, attr)

            def spy(*a, _method=method, _name=name, **k):
                config = a[4] if _name == "combine" and len(a) > 4 else k.get("config")
                seen.append((_name, None if config is None else config.num_sms))
                return _method(*a, **k)

            setattr(v1, attr, spy)
        inp = R.rank_inputs(5, g.rank, num_tokens=T, hidden=H, num_experts=E, num_topk=K)
        x, topk, w = C.t(inp.x), C.t(inp.topk_idx), C.t(inp.topk_weights)
        outs = []
        for sms in (0, 7):
            recv_x, _, _, handle, _ = buffer.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=E, num_sms=sms)
            combined = buffer.combine(recv_x, handle, num_sms=sms)[0]
            outs.append(combined.view(torch.int16).numpy().copy())
        assert ("dispatch", None) in seen and ("combine", None) in seen
        assert ("dispatch", 6) in seen and ("combine", 6) in seen
        assert np.array_equal(outs[0], outs[1])
        return True

    assert all(_one(rank, 2))


def test_combine_never_hands_previous_event_to_v1():
    """The V2 combine builds V1's input on the current stream: V1's combine must wait for that stream, so
    the current stream waits for ``previous_event`` and V1 gets none of its own."""
    def rank(g):
        buffer = EPBuffer(g, num_max_tokens_per_rank=T, hidden=H, backend="reference")
        seen = []
        combine = buffer._v1._combine  # what V2's combine calls (previous_event its sixth argument)

        def spy(*a, **k):
            seen.append(a[5] if len(a) > 5 else k.get("previous_event"))
            return combine(*a, **k)

        buffer._v1._combine = spy
        inp = R.rank_inputs(6, g.rank, num_tokens=T, hidden=H, num_experts=E, num_topk=K)
        x, topk, w = C.t(inp.x), C.t(inp.topk_idx), C.t(inp.topk_weights)
        recv_x, _, _, handle, _ = buffer.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=E)
        buffer.combine(recv_x, handle, previous_event=buffer.capture(), allocate_on_comm_stream=True)
        assert seen and all(e is None for e in seen)
        return True

    assert all(_one(rank, 2))
