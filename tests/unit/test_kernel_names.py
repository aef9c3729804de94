"""Kernel names as profilers show them: per family exactly one kernel whose name contains ``::dispatch``
and one with ``::combine``; helper kernels have neither (DeepEP users' profiling scripts look for them)."""

from __future__ import annotations

import re

from deepep_cupy.ops import kernel_names as K

FAMILIES = {
    "low_latency": [K.ll_dispatch(7168, 8, 6, 4, True), K.ll_combine(7168, 8, 6, 4, False),
                    K.ll_stage(7168, True)],
    "intranode": [K.intranode_notify(8), K.intranode_dispatch(8, 16, 8), K.intranode_combine(8, 32, 2)],
    "layout": [K.layout_count_tokens(8, 8)],
}


def test_one_dispatch_and_one_combine_per_family():
    for family, names in FAMILIES.items():
        assert all(n.startswith(f"deepep_cupy::{family}::") for n in names), names
        dispatch = [n for n in names if "::dispatch" in n]
        combine = [n for n in names if "::combine" in n]
        want = 0 if family == "layout" else 1
        assert len(dispatch) == want and len(combine) == want, (family, names)


def test_helpers_do_not_look_like_dispatch_or_combine():
    helpers = [K.ll_stage(2048, False), K.intranode_notify(2), K.layout_count_tokens(1, 1)]
    for name in helpers:
        assert "dispatch" not in name and "combine" not in name, name


def test_every_name_is_a_template_instantiation_in_a_namespace():
    for names in FAMILIES.values():
        for name in names:
            assert re.fullmatch(r"deepep_cupy::\w+::\w+<[\w, ]+>", name), name


def test_value_error_codes_name_an_op_and_argument():
    for code in (K.VALUE_OP_LAYOUT, K.VALUE_OP_INTRANODE_DISPATCH, K.VALUE_OP_LL_DISPATCH, K.VALUE_OP_LL_COMBINE):
        op, arg = K.VALUE_OP_ARGS[code]
        assert op and arg == "topk_idx"


def test_a_value_record_becomes_a_named_value_error():
    from deepep_cupy.device.kernel_errors import RecordKind, value_error

    exc = value_error({"op": K.VALUE_OP_LL_DISPATCH, "rank": 1, "peer": -1, "line": 10,
                       "kind": RecordKind.VALUE_ERROR, "waited_ns": 300})
    assert isinstance(exc, ValueError)
    text = str(exc)
    assert "low_latency_dispatch" in text and "topk_idx" in text and "300" in text and "rank 1" in text
