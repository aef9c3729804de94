"""Index checks of the handles the GPU kernels are given (intranode 6-tuple, low-latency handle), run on
the host when validation is on: a valid handle passes, each corrupted entry raises a ValueError naming
it, and a handle is checked once (not at every call), never while validation is off."""

from __future__ import annotations

import numpy as np
import pytest

from deepep_cupy.ops import handles as checks
from deepep_cupy.reference.normal import channel_prefix_matrix, send_head_matrix

R, ME, C, N = 2, 0, 3, 20


def intranode_handle(rng=None):
    """The handle rank 0 of 2 would get: it sends ``in_rank`` and receives its own tokens, then 5 of rank 1's."""
    rng = rng or np.random.default_rng(0)
    in_rank = rng.random((N, R)) < 0.5
    cp = channel_prefix_matrix(in_rank, C)
    own = int(cp[ME, -1])
    from_1 = np.array([1, 4, 0])  # rows rank 1 sends me per channel
    rp = np.array([[own, 7], [own + from_1.sum(), 7 + 3]], np.int32)
    rcp = np.array([np.concatenate([[0], cp[ME, :-1]]), np.concatenate([[0], np.cumsum(from_1)[:-1]])], np.int32)
    src = np.concatenate([np.flatnonzero(in_rank[:, ME]), [2, 5, 6, 9, 11], [-1, -1]]).astype(np.int32)  # 2 pad rows
    return [rp, cp, rcp, src, in_rank, send_head_matrix(in_rank)]


def test_a_handle_dispatch_made_passes():
    checks.intranode_handle_values(intranode_handle(), ME, R)


@pytest.mark.parametrize("entry,corrupt,named", [
    (0, lambda h: h[0].__setitem__((1, 0), h[0][0, 0] - 1), "handle[0] (rank_prefix_matrix)"),
    (0, lambda h: h[0].__setitem__((1, 0), len(h[3]) + 1), "handle[0] (rank_prefix_matrix)"),
    (1, lambda h: h[1].__setitem__((1, 1), h[1][1, 1] + 1), "handle[1] (channel_prefix_matrix)"),
    (2, lambda h: h[2].__setitem__((1, 2), 99), "handle[2] (recv_channel_prefix_matrix)"),
    (2, lambda h: h[2].__setitem__((0, 0), 1), "handle[2] (recv_channel_prefix_matrix)"),
    (3, lambda h: h[3].__setitem__(0, -3), "handle[3] (recv_src_idx)"),
    (3, lambda h: h[3].__setitem__(len(h[3]) - 4, 0), "handle[3] (recv_src_idx)"),
    (5, lambda h: h[5].__setitem__((0, 0), 1000), "handle[5] (send_head)"),
])
def test_each_corrupted_intranode_entry_is_named(entry, corrupt, named):
    h = intranode_handle()
    corrupt(h)
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        checks.intranode_handle_values(h, ME, R)


def ll_handle(t=4, e_local=2):
    """Rows of local expert e: 2 from rank 0, then 1 from rank 1 (tokens 0..3), the rest -1."""
    slab = R * t
    src = np.full((e_local, slab), -1, np.int32)
    src[:, :3] = [3, 1, 0]
    counts = np.array([[2, 1]] * e_local, np.int64)
    begins = np.array([[0, 2]] * e_local, np.int64)
    return [src, (begins << 32) | counts, t, 128, e_local * R]


def test_a_low_latency_handle_dispatch_made_passes():
    checks.ll_handle_values(ll_handle(), R)


def test_an_empty_range_may_share_its_begin_with_the_next():
    # Rank 1 of 3: its own group first (1 row), then rank 2's (empty, at row 1), then rank 0's (2 rows at
    # row 1): the empty range shares its begin with a range of a lower rank index.
    t, e_local, ranks = 4, 1, 3
    src = np.full((e_local, ranks * t), -1, np.int32)
    src[0, :3] = [3, 0, 2]
    ranges = np.array([[(1 << 32) | 2, (0 << 32) | 1, (1 << 32) | 0]], np.int64)
    checks.ll_handle_values([src, ranges, t, 128, e_local * ranks], ranks)
    ranges[0, 2] = (1 << 32) | 1  # no longer empty: it overlaps rank 0's rows
    with pytest.raises(ValueError, match=r"handle\[1\] \(layout_range\)"):
        checks.ll_handle_values([src, ranges, t, 128, e_local * ranks], ranks)


@pytest.mark.parametrize("corrupt,named", [
    (lambda h: h[0].__setitem__((1, 2), 4), r"handle\[0\] \(src_info\)"),
    (lambda h: h[0].__setitem__((0, 0), -1), r"handle\[0\] \(src_info\)"),
    (lambda h: h[1].__setitem__((0, 1), (7 << 32) | 2), r"handle\[1\] \(layout_range\)"),  # past R*T rows
    (lambda h: h[1].__setitem__((0, 1), (1 << 32) | 1), r"handle\[1\] \(layout_range\)"),  # overlaps rank 0's
    (lambda h: h[1].__setitem__((1, 0), 5), r"handle\[1\] \(layout_range\)"),  # more than T rows
])
def test_each_corrupted_low_latency_entry_is_named(corrupt, named):
    h = ll_handle()
    corrupt(h)
    with pytest.raises(ValueError, match=named):
        checks.ll_handle_values(h, R)


class _Buffer:
    rank, group_size = ME, R

    class runtime:  # noqa: N801 - stands in for the runtime object (no communication stream here)
        pass


def test_checked_once_per_handle_and_never_with_validation_off(monkeypatch):
    seen = []
    monkeypatch.setattr(checks, "intranode_handle_values", lambda h, rank, size: seen.append(len(h)))
    monkeypatch.setattr(checks, "_CHECKED", {})
    h = tuple(intranode_handle())
    checks.device_handle_values(_Buffer(), h)
    checks.device_handle_values(_Buffer(), h)
    assert seen == [6]
    monkeypatch.setenv("DEEPEP_CUPY_VALIDATE", "0")
    checks.device_handle_values(_Buffer(), tuple(intranode_handle()))
    assert seen == [6]
    monkeypatch.delenv("DEEPEP_CUPY_VALIDATE")
    internode = tuple(intranode_handle()) + (None,) * 4
    checks.device_handle_values(_Buffer(), internode)  # 10-tuples have checks of their own
    assert seen == [6]


def test_a_bad_handle_is_reported_through_the_wrapper(monkeypatch):
    monkeypatch.setattr(checks, "_CHECKED", {})
    h = intranode_handle()
    h[5] = h[5] + 1
    with pytest.raises(ValueError, match=r"handle\[5\] \(send_head\)"):
        checks.device_handle_values(_Buffer(), tuple(h))
    ll = ll_handle()
    ll[0][0, 0] = 9
    with pytest.raises(ValueError, match=r"handle\[0\] \(src_info\)"):
        checks.device_handle_values(_Buffer(), tuple(ll))
