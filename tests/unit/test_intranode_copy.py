"""The combine's copy mode on the CPU: a NumPy model of the copies (deepep_cupy/ops/intranode/copy.py) and of
the sums (cuda_src/intranode/combine_copy.cu) against the reference combine."""

from __future__ import annotations

import numpy as np
import pytest
from intranode_cases import model_inputs, reference_dispatch
from kernel_args import check_packing
from thread_group import run_ranks

from deepep_cupy.ops.intranode import copy as CC
from deepep_cupy.ops.intranode.args import COMBINE_COPY
from deepep_cupy.reference import normal


def _model_copy_combine(ys, ws, handles, chunk_rows, rounds=1, whole_turns=True):
    """Every rank runs its copy schedule into byte arrays standing for the homes' staging areas (poisoned
    first), counting the chunks each flag reports; then every home sums as the kernel does, reading only rows
    whose chunk the flag covers."""
    R = len(ys)
    counts = handles[0][0]
    cnt = CC.home_counts(counts)
    row_bytes, K = ys[0].shape[1] * 4, ws[0].shape[1]
    used = [CC.staging_map(cnt, h, row_bytes, K)[2] for h in range(R)]
    staging = [np.full(max(used[h], 1), 0xEE, np.uint8) for h in range(R)]
    flags = np.zeros((R, R), np.int64)  # flags[h][p]: chunks of p's rows landed at h
    for p in range(R):
        np.testing.assert_array_equal(handles[p][0], counts)  # every rank has the same matrix
        last = {}
        for h, kind, dst, src, n, done in CC.copy_schedule(cnt, p, row_bytes, K, chunk_rows, rounds, whole_turns):
            data = (ys[p] if kind == "x" else ws[p])[src:src + n].tobytes()
            assert dst + len(data) <= used[h] and src + n <= ys[p].shape[0]
            staging[h][dst:dst + len(data)] = np.frombuffer(data, np.uint8)
            if kind == "x":
                assert n > 0 and done == last.get(h, 0) + n  # chunks of one home in order, none empty
                last[h] = done
                flags[h][p] = done
        for h in range(R):
            assert flags[h][p] == (cnt[h][p] if h != p else 0)
    outs, out_ws = [], []
    for me in range(R):
        rpm, send_head = handles[me][0], handles[me][5]
        first, weights_offset, _ = CC.staging_map(cnt, me, row_bytes, K)
        rows = staging[me][: weights_offset].view(np.float32).reshape(-1, ys[me].shape[1]) if weights_offset else None
        wrows = staging[me][weights_offset: used[me]].view(np.float32).reshape(-1, K)
        self_base = rpm[me - 1, me] if me > 0 else 0
        n = send_head.shape[0]
        out = np.zeros((n, ys[me].shape[1]), np.float32)
        out_w = np.zeros((n, K), np.float32)
        for t in range(n):
            for r in range(R):
                pos = send_head[t, r]
                if pos < 0:
                    continue
                if r == me:
                    out[t] += ys[me][self_base + pos]
                    out_w[t] += ws[me][self_base + pos]
                else:
                    assert pos < flags[me][r]
                    out[t] += rows[first[r] + pos]
                    out_w[t] += wrows[first[r] + pos]
        outs.append(out)
        out_ws.append(out_w)
    return outs, out_ws


@pytest.mark.parametrize("whole_turns", [True, False])
@pytest.mark.parametrize("rounds", [1, 3, (5, 3, 2)])
@pytest.mark.parametrize("R,C,n_tokens,chunk_rows", [(2, 3, 37, 4), (3, 2, 0, 1), (4, 5, 23, 3), (2, 12, 1, 512),
                                                     (8, 4, 50, 7), (2, 1, 100, 16)])
def test_copy_mode_model_matches_reference(R, C, n_tokens, chunk_rows, rounds, whole_turns):
    rng = np.random.default_rng(R * 10 + chunk_rows)
    xs, in_ranks, topks, per_experts = model_inputs(rng, R, n_tokens, skew=True, H=8)
    refs = reference_dispatch(xs, in_ranks, topks, per_experts, C)
    handles = [refs[me][5] for me in range(R)]
    ys = [rng.standard_normal(refs[me][0].shape).astype(np.float32) for me in range(R)]
    ws = [rng.standard_normal((refs[me][0].shape[0], 3)).astype(np.float32) for me in range(R)]
    combined, combined_w = _model_copy_combine(ys, ws, handles, chunk_rows, rounds, whole_turns)

    def ref_combine(group):
        me = group.rank
        return normal.combine(group, ys[me], refs[me][5], topk_weights=ws[me], bias_0=None, bias_1=None)

    ref = run_ranks(R, ref_combine)
    for me in range(R):
        np.testing.assert_array_equal(combined[me], ref[me][0])
        np.testing.assert_array_equal(combined_w[me], ref[me][1])


def test_staging_map_and_fit():
    rpm = np.array([[5, 7, 0], [9, 7, 4], [9, 10, 6]])  # [i][r]: rows rank r receives from ranks 0..i
    cnt = CC.home_counts(rpm)
    assert cnt == [[5, 7, 0], [4, 0, 4], [0, 3, 2]]
    first, weights_offset, used = CC.staging_map(cnt, 0, 32, 2)
    assert first == [0, 0, 7] and weights_offset == 256 and used == 256 + 7 * 8
    first, weights_offset, used = CC.staging_map(cnt, 1, 32, 0)
    assert first == [0, 0, 4] and used == weights_offset == 256
    assert CC.fits(cnt, 32, 2, 320)  # home 1: 8 rows of 32 bytes, then 8 x 2 weights
    assert not CC.fits(cnt, 32, 2, 319)
    # Rank 2's copies: home 0 gets nothing (rank 2 received no row from it), home 1 four rows (x rows 0-3,
    # after home 1's rows from rank 0 in its staging area); weights first.
    sched = CC.copy_schedule(cnt, 2, 32, 2, 2)  # 4 rows in chunks of 2
    assert sched == [(1, "w", 256 + 4 * 8, 0, 4, 0), (1, "x", 4 * 32, 0, 2, 2), (1, "x", 6 * 32, 2, 2, 4)]
    # Rank 1 sends 3 rows to home 2 (x rows 7-9, chunks 1 + 2) and 7 to home 0 (x rows 0-6, chunks 1, 1, 2, 1,
    # 1, 1): home 2 (= 1 + 1) first, then home 0, each home's chunks in order.
    sched = CC.copy_schedule(cnt, 1, 32, 0, 2, whole_turns=False)
    assert [(h, done) for h, kind, _, _, _, done in sched] == [(2, 1), (2, 3), (0, 1), (0, 2), (0, 4), (0, 5), (0, 6),
                                                               (0, 7)]
    assert [src for h, kind, _, src, _, _ in sched] == [7, 8, 0, 1, 2, 4, 5, 6]
    # By default only the last turn (home 0 = 1 - 1) goes in chunks; home 2's rows are one copy.
    sched = CC.copy_schedule(cnt, 1, 32, 0, 2)
    assert [(h, done) for h, kind, _, _, _, done in sched] == [(2, 3), (0, 1), (0, 2), (0, 4), (0, 5), (0, 6), (0, 7)]
    assert [src for h, kind, _, src, _, _ in sched] == [7, 0, 1, 2, 4, 5, 6]
    # Two rounds: the first part of every block (home 2: 1 row; home 0: 3 rows, chunks 1 + 2), then the second.
    sched = CC.copy_schedule(cnt, 1, 32, 0, 2, rounds=2)
    assert [(h, done) for h, kind, _, _, _, done in sched] == [(2, 1), (0, 1), (0, 3), (2, 3), (0, 5), (0, 7)]
    assert [src for h, kind, _, src, _, _ in sched] == [7, 0, 1, 8, 3, 5]
    with pytest.raises(ValueError, match="rounds"):
        CC.copy_schedule(cnt, 1, 32, 0, 2, rounds=0)


def test_rounds_of_unequal_parts():
    """``rounds`` as relative sizes: the parts end where the weights' running sums put them, equal weights as the
    count; the schedule copies the parts in rounds, the homes in turns in each."""
    assert [CC.part_end(100, k, 3) for k in range(3)] == [33, 66, 100]
    assert [CC.part_end(100, k, (1, 1, 1)) for k in range(3)] == [33, 66, 100]
    assert [CC.part_end(100, k, (5, 3, 2)) for k in range(3)] == [50, 80, 100]
    assert [CC.part_rows(100, k, (5, 3, 2)) for k in range(3)] == [50, 30, 20]
    assert CC.round_weights(2) == (1, 1) and CC.round_weights([4, 1]) == (4, 1)
    for bad in (0, (), (2, 0)):
        with pytest.raises(ValueError, match="rounds"):
            CC.round_weights(bad)
    cnt = [[0, 10, 10], [10, 0, 10], [10, 10, 0]]
    sched = CC.copy_schedule(cnt, 0, 16, 0, 100, (7, 3))
    assert [(h, n, done) for h, _, _, _, n, done in sched] == [(1, 7, 7), (2, 7, 7), (1, 3, 10), (2, 3, 10)]


def test_default_rounds_by_ranks_and_sms():
    assert CC.default_rounds(4, 8) == (6, 3, 1) and CC.default_rounds(3, 4) == (6, 3, 1)
    assert CC.default_rounds(8, 10) == CC.default_rounds(4, 12) == (2, 1)
    assert CC.default_rounds(4, 16) == 1 and CC.default_rounds(8, 24) == 1
    assert CC.default_rounds(2, 8) == 1  # one home: no turns to cut


def _simulate_turns(cnt, rounds):
    """Every rank runs its turns in order, a turn starting once its wait (turn_waits) is met, one turn a step.
    Returns the (rank, home) pairs of each step; fails if some rank can never go on."""
    R = len(cnt)
    plans = []
    for me in range(R):
        schedule = CC.copy_schedule(cnt, me, 16, 0, 3, rounds)
        waits = CC.turn_waits(cnt, me, rounds, schedule)
        turns = []  # (home, part, wait): one a part with rows, in schedule order
        for i, (home, kind, _dst, _src, size, done) in enumerate(schedule):
            if kind != "x":
                continue
            n = cnt[home][me]
            part = next(k for k in range(len(CC.round_weights(rounds))) if done - size < CC.part_end(n, k, rounds))
            if turns and turns[-1][:2] == (home, part):
                assert i not in waits  # only a turn's first copy waits
                continue
            turns.append((home, part, waits.get(i)))
        plans.append(turns)
    landed = {}  # (home, source) -> rows landed there so far
    steps, pos = [], [0] * R
    while any(pos[me] < len(plans[me]) for me in range(R)):
        ready = [me for me in range(R) if pos[me] < len(plans[me]) and (
            plans[me][pos[me]][2] is None or landed.get(plans[me][pos[me]][2][:2], 0) >= plans[me][pos[me]][2][2])]
        assert ready, f"no rank can go on: {pos}"
        steps.append([(me, plans[me][pos[me]][0]) for me in ready])
        for me in ready:
            home, part, _ = plans[me][pos[me]]
            landed[(home, me)] = CC.part_end(cnt[home][me], part, rounds)
            pos[me] += 1
    return steps


def test_turn_waits_follow_the_homes_previous_occupant():
    """Each turn's first copy waits for the rank that last copied into the same home in an earlier turn (the
    turns between put no rows there), for the rows it had copied there by then; with those waits every rank
    finishes, and no step puts two ranks into one home, empty parts and unequal ones included."""
    rng = np.random.default_rng(5)
    for R in (2, 3, 4, 8):
        for rounds in (1, 2, 3, (5, 3, 2), (1, 4)):
            num_rounds = len(CC.round_weights(rounds))
            for high in (40, 6):  # small blocks: parts without rows
                cnt = [[0 if q == h else int(rng.integers(0, high)) for q in range(R)] for h in range(R)]
                cnt[1][0] = 0  # a block without rows: its turns are skipped and nobody waits for them
                for me in range(R):
                    schedule = CC.copy_schedule(cnt, me, 16, 0, 3, rounds)
                    for i, (home, source, rows) in CC.turn_waits(cnt, me, rounds, schedule).items():
                        assert schedule[i][0] == home and source not in (me, home) and rows > 0
                        g = next(k for k in range(num_rounds) if schedule[i][5] - schedule[i][4] <
                                 CC.part_end(cnt[home][me], k, rounds)) * (R - 1) + (home - me) % R - 1
                        # The turn waited for: source's, the last before g with rows for this home.
                        prev = next(p for p in range(g - 1, -1, -1)
                                    if CC.part_rows(cnt[home][(home - p % (R - 1) - 1) % R], p // (R - 1), rounds))
                        assert (source + prev % (R - 1) + 1) % R == home
                        assert rows == CC.part_end(cnt[home][source], prev // (R - 1), rounds)
                for step in _simulate_turns(cnt, rounds):
                    homes = [h for _, h in step]
                    assert len(homes) == len(set(homes)), (rounds, cnt, step)
    # Two ranks: one home, whose previous occupant is the rank itself (its stream keeps the order): no waits.
    cnt = [[0, 40], [40, 0]]
    assert CC.turn_waits(cnt, 0, 3, CC.copy_schedule(cnt, 0, 16, 0, 3, 3)) == {}


def test_homes_take_turns_in_a_permutation():
    """At each turn of the ordered schedule every rank copies into a different home (no home gets two
    sources' copies at once while every rank keeps pace)."""
    R = 4
    cnt = [[5 if q != h else 0 for q in range(R)] for h in range(R)]
    for rounds in (1, 2, 5):
        turns = [[h for h, kind, *_ in CC.copy_schedule(cnt, me, 16, 0, 5, rounds) if kind == "x"]
                 for me in range(R)]
        for k in range(rounds * (R - 1)):
            assert sorted(t[k] for t in turns) == list(range(R))
            assert all(t[k] == (me + 1 + k % (R - 1)) % R for me, t in enumerate(turns))


def test_only_each_rounds_last_turn_goes_in_chunks():
    """Every part is one copy in a round's turns before its last (into home ``me - 1``), and in chunks in that
    turn; with ``whole_turns`` off every turn goes in chunks. Either way each home gets its block once."""
    R, rows = 4, 3670
    cnt = [[rows + h - q if q != h else 0 for q in range(R)] for h in range(R)]
    for rounds in (1, (6, 3, 1), 2):
        for me in range(R):
            last = (me - 1) % R
            for whole in (True, False):
                sched = [c for c in CC.copy_schedule(cnt, me, 16, 0, 1024, rounds, whole) if c[1] == "x"]
                for h in range(R):
                    if h == me:
                        continue
                    sizes = [n for home, _, _, _, n, _ in sched if home == h]
                    parts = [CC.part_rows(cnt[h][me], k, rounds) for k in range(len(CC.round_weights(rounds)))]
                    assert sum(sizes) == cnt[h][me]
                    if h == last or not whole:
                        assert sizes == [n for p in parts for n in CC.chunk_sizes(p, 1024)]
                    else:
                        assert sizes == parts


def test_chunk_sizes_taper_at_both_ends():
    assert CC.chunk_sizes(0, 512) == []
    assert CC.chunk_sizes(4078, 512) == [128, 256] + [512] * 6 + [238, 256, 128]
    assert CC.chunk_sizes(4078, 1024) == [256, 512, 1024, 1024, 494, 512, 256]
    assert CC.chunk_sizes(700, 512) == [350, 350] and CC.chunk_sizes(512, 512) == [512]
    assert CC.chunk_sizes(5, 1) == [1] * 5
    for n in range(0, 3000, 37):
        for c in (1, 3, 64, 512):
            sizes = CC.chunk_sizes(n, c)
            assert sum(sizes) == n and all(s > 0 for s in sizes)


def test_handle_keeps_counts_and_is_a_tuple():
    h = CC.IntranodeHandle((1, 2, 3), ((1, 2), (3, 4)))
    assert h == (1, 2, 3) and isinstance(h, tuple) and h.counts == ((1, 2), (3, 4))
    assert CC.IntranodeHandle((1,)).counts is None


def test_combine_copy_args_fill_the_struct():
    packed = CC.combine_copy_args(
        x=1, topk_weights=2, num_topk=8, bias_0=0, bias_1=0, rank_prefix_matrix=3, send_head=4, num_tokens=4096,
        hidden_int4=896, combined_x=5, combined_topk_weights=6, bases=7, staging=8, weights_offset=1 << 33,
        copy_seq=1 << 40, err_ptr=10, timeout_ns=1, rank=1)
    check_packing(COMBINE_COPY, packed)
    assert COMBINE_COPY.kinds["copy_seq"] == "u64" and COMBINE_COPY.kinds["weights_offset"] == "i64"
