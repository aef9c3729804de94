"""Host side of the low-latency path, no GPU needed: DeepEP's size hint, the buffer map, the warp
split, the NVSHMEM environment, the kernels' row-assignment arithmetic, and a compile of small kernels."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from deepep_cupy.device import nvshmem as nvshmem_runtime
from deepep_cupy.ops.low_latency import engine as ll
from deepep_cupy.ops.low_latency.buffer_map import (
    LOGFMT_BLOCK_BYTES,
    REGIONS,
    LowLatencyBufferMap,
    combine_message_bytes,
    dispatch_message_bytes,
    rank_message_bytes,
    rdma_size_hint,
)


# ---------------------------------------------------------------- DeepEP's size hint
def _deepep_hint(t, h, r, e):
    """DeepEP's LowLatencyLayout total (csrc/config.hpp), spelled out step by step."""
    num_scales = h // 128
    bytes_per_dispatch_msg = 16 + max(h * 2, h + num_scales * 4)  # int4 header + data
    bytes_per_combine_msg = num_scales * 4 + h * 2  # per-128 min/max (2 x bf16) + data
    send = max(t * bytes_per_dispatch_msg, e * t * bytes_per_combine_msg)
    recv = max(e * t * bytes_per_dispatch_msg, e * t * bytes_per_combine_msg)
    signaling = -(-(e * 4) // 128) * 128
    total = 2 * send + 2 * recv + 2 * signaling
    return ((total + 128) // 128) * 128  # NUM_BUFFER_ALIGNMENT_BYTES = 128


@pytest.mark.parametrize("t, h, r, e", [
    (128, 7168, 2, 288), (128, 7168, 8, 256), (128, 4096, 2, 32), (256, 2048, 16, 64), (1, 128, 1, 1),
    (512, 5120, 4, 16), (64, 2560, 32, 256), (96, 8, 2, 4), (128, 7168, 2, 256),
])
def test_size_hint_matches_deepep(t, h, r, e):
    assert rdma_size_hint(t, h, r, e) == _deepep_hint(t, h, r, e)


def test_size_hint_known_value():
    # 128 tokens x 7168 hidden, 288 experts: 2 x 536739840 send + 2 x 536739840 receive + 2 x 1152 signal,
    # rounded past the next 128 bytes.
    assert rdma_size_hint(128, 7168, 2, 288) == 2146961792


def test_size_hint_is_128_aligned():
    for t, h, r, e in itertools.product((1, 7, 128), (8, 128, 1000, 7168), (1, 2, 8), (8, 24, 256)):
        if e % r:
            continue
        hint = rdma_size_hint(t, h, r, e)
        assert hint % 128 == 0 and hint > 0


# ---------------------------------------------------------------- buffer map
SHAPES = [(t, h, r, e_local * r)
          for t in (1, 3, 32, 128, 1024)
          for h in (8, 120, 128, 2048, 2056, 4096, 7168)
          for r in (1, 2, 8, 16)
          for e_local in (1, 4, 9, 144)]


@pytest.mark.parametrize("t, h, r, e", SHAPES)
def test_buffer_map_fits_in_deepep_hint(t, h, r, e):
    bmap = LowLatencyBufferMap(t, h, r, e)
    assert bmap.fits(rdma_size_hint(t, h, r, e))


@pytest.mark.parametrize("t, h, r, e", [(128, 7168, 2, 288), (128, 7168, 4, 256), (128, 7168, 8, 288),
                                        (256, 7168, 16, 256), (32, 2048, 8, 64)])
def test_data_regions_start_on_128_byte_lines(t, h, r, e):
    """The rows of both halves start on 128-byte lines, so that a warp's 512-byte access to a row touches four
    lines, not five; at these sizes that still fits DeepEP's size hint."""
    bmap = LowLatencyBufferMap(t, h, r, e)
    assert bmap.fits(rdma_size_hint(t, h, r, e))
    for b in (0, 1):
        for name in ("src_idx", "recv", "send"):
            assert bmap.region(b, name) % 128 == 0, (b, name, bmap.region(b, name))


@pytest.mark.parametrize("t, h, r, e", [(128, 7168, 2, 288), (3, 2056, 8, 72), (1, 8, 1, 1), (1024, 4096, 16, 256)])
def test_buffer_map_regions_are_disjoint_and_aligned(t, h, r, e):
    bmap = LowLatencyBufferMap(t, h, r, e)
    sizes = {"tags": bmap.tags_bytes, "arrivals": bmap.arrivals_bytes, "receipts": bmap.receipts_bytes,
             "src_idx": bmap.src_idx_bytes, "recv": bmap.recv_bytes, "send": bmap.send_bytes}
    assert list(sizes) == list(REGIONS) and bmap.receipts_bytes == 4 * (r + 1)
    spans = []
    for b in (0, 1):
        for name, size in sizes.items():
            off = bmap.region(b, name)
            assert off % 16 == 0, (name, off)
            spans.append((off, off + size, f"{name}{b}"))
        lo, hi = bmap.half_base(b), bmap.half_base(b) + bmap.half_bytes
        for off, end, name in spans[-len(sizes):]:
            assert lo <= off and end <= hi, name
    spans.sort()
    for (_a0, a1, na), (b0, _b1, nb) in zip(spans[:-1], spans[1:], strict=True):
        assert a1 <= b0, f"{na} overlaps {nb}"
    assert bmap.region(1, "tags") == bmap.half_bytes
    assert bmap.total_bytes == 2 * bmap.half_bytes and bmap.half_bytes % 128 == 0
    assert bmap.region(0, "arrivals") % 8 == 0  # uint64 signal words
    # Cleaning zeroes the tags, the arrival counters and the receipts of each half, and nothing after them.
    for b in (0, 1):
        offset, length = bmap.signal_span(b)
        assert offset == bmap.region(b, "tags")
        assert offset + length == bmap.region(b, "src_idx") >= bmap.region(b, "receipts") + 4 * r


def test_buffer_map_slots_hold_every_message_format():
    for h in (128, 256, 2048, 7168, 8192):
        bmap = LowLatencyBufferMap(64, h, 2, 16)
        assert dispatch_message_bytes(h, True) <= bmap.slot_bytes
        assert dispatch_message_bytes(h, False) == bmap.slot_bytes
        assert combine_message_bytes(h, True) <= bmap.slot_bytes
        assert combine_message_bytes(h, False) == bmap.slot_bytes
        assert dispatch_message_bytes(h, True) % 16 == 0
    assert combine_message_bytes(7168, True) == 56 * LOGFMT_BLOCK_BYTES
    # The combine rows of every local expert and source fit the send area, and so do T staged messages.
    bmap = LowLatencyBufferMap(128, 7168, 2, 288)
    assert bmap.send_bytes >= 144 * 2 * 128 * 2 * 7168
    assert bmap.send_bytes >= 128 * bmap.slot_bytes


def test_rank_messages_fit_where_their_tables_and_messages_do():
    # The benchmark shape at 2, 8 and 72 ranks: per-(token, rank) messages.
    for r in (2, 8, 72):
        assert LowLatencyBufferMap(128, 7168, r, 288 if r < 72 else 576).rank_messages_fit(8, True)
    bmap = LowLatencyBufferMap(128, 7168, 2, 288)
    assert bmap.rank_messages_fit(8, False) and bmap.rank_messages_fit(32, False)
    assert rank_message_bytes(7168, 8, True) == 7392 + 48 and rank_message_bytes(7168, 8, False) == 14336 + 48
    assert 2 * 128 * rank_message_bytes(7168, 32, False) <= bmap.recv_bytes
    # Per-expert rows: top-k past 32, one expert per rank, bitmaps too large for shared memory.
    assert not bmap.rank_messages_fit(33, True)
    assert not LowLatencyBufferMap(128, 7168, 8, 8).rank_messages_fit(8, True)
    assert not LowLatencyBufferMap(1024, 7168, 2, 288).rank_messages_fit(8, True)
    assert LowLatencyBufferMap(512, 7168, 2, 288).rank_messages_fit(8, True)


def test_partials_where_they_fit_and_pay():
    # The benchmark shape: 4 experts of 8 per rank reached on 2 ranks (float32 partial rows pay); on 4 and
    # 8 ranks a token picks ~2.2 and ~1.5 experts per rank reached, so BF16 rows per expert stay.
    bmap = LowLatencyBufferMap(128, 7168, 2, 288)
    assert bmap.partials_fit(8) and bmap.partials_pay(8)
    assert 2 * 128 * (4 * 7168 + 16 * 8) <= bmap.recv_bytes
    assert bmap.partial_table_bytes(8) == 4 * 2 * 128 * 9
    for r in (4, 8):
        assert LowLatencyBufferMap(128, 7168, r, 288).partials_fit(8)
        assert not LowLatencyBufferMap(128, 7168, r, 288).partials_pay(8)
    # A LogFMT partial row is as long as one LogFMT expert row: it pays from 1.5 experts per rank reached,
    # so on 2, 4 and 8 ranks; at 16 ranks (~1.3) it does not.
    assert bmap.partial_row_bytes(True) == 56 * LOGFMT_BLOCK_BYTES and bmap.partial_row_bytes(False) == 4 * 7168
    # LogFMT partial rows are padded to 16 bytes
    assert LowLatencyBufferMap(128, 2176, 2, 32).partial_row_bytes(True) == 17 * LOGFMT_BLOCK_BYTES + 8
    for r in (2, 4, 8):
        assert LowLatencyBufferMap(128, 7168, r, 288).partials_fit(8, True)
        assert LowLatencyBufferMap(128, 7168, r, 288).partials_pay(8, True)
    assert not LowLatencyBufferMap(128, 7168, 16, 288).partials_pay(8, True)
    # Top-1 never pays; one expert per rank leaves no room for float32 rows (LogFMT rows fit); top-k past
    # 32 and tables past shared memory do not fit.
    assert not bmap.partials_pay(1) and not bmap.partials_pay(1, True)
    assert not LowLatencyBufferMap(128, 7168, 2, 2).partials_fit(8)
    assert LowLatencyBufferMap(128, 7168, 2, 2).partials_fit(8, True)
    assert not bmap.partials_fit(33)
    assert not LowLatencyBufferMap(8192, 7168, 2, 288).partials_fit(8)
    # Every block of a rank's grid leaves a completion word in the source-index region ([E, T] words).
    assert LowLatencyBufferMap(1, 7168, 2, 288).partials_fit(8, True, grid=144)
    assert not LowLatencyBufferMap(1, 7168, 2, 288).partials_fit(8, True, grid=145)


def test_hook_mode_combines_never_send_partial_sums():
    """A hook-mode combine takes per-expert rows where a fused one sends per-rank partial sums: the partial
    sums need the owner's routes, written by the owner's own combine send, so their send would wait for
    every peer to reach its combine."""
    from types import SimpleNamespace

    engine = SimpleNamespace(_stores_everywhere=lambda: True, num_sms=132)
    bmap = LowLatencyBufferMap(128, 7168, 2, 288)
    for logfmt in (False, True):
        assert ll.LowLatencyEngine.rank_partials(engine, bmap, 8, logfmt)
        assert ll.LowLatencyEngine.rank_partials(engine, bmap, 8, logfmt, hook=False)
        assert not ll.LowLatencyEngine.rank_partials(engine, bmap, 8, logfmt, hook=True)


@pytest.mark.parametrize("bad", [(0, 128, 2, 8), (8, 128, 2, 7), (8, 100, 2, 8), (8, 128, 0, 8)])
def test_buffer_map_rejects_bad_sizes(bad):
    with pytest.raises(ValueError):
        LowLatencyBufferMap(*bad)


def test_buffer_map_region_names():
    bmap = LowLatencyBufferMap(8, 128, 2, 8)
    with pytest.raises(KeyError):
        bmap.region(0, "nope")
    with pytest.raises(ValueError):
        bmap.region(2, "recv")


# ---------------------------------------------------------------- warp split
@pytest.mark.parametrize("experts", [1, 2, 8, 16, 132, 133, 256, 288, 527, 528, 529, 1024, 4096])
@pytest.mark.parametrize("sms", [1, 8, 78, 132])
def test_warp_split(experts, sms):
    warps, groups, blocks = ll.warp_split(experts, sms)
    assert 1 <= groups <= 4 and warps * groups <= 24 and warps >= 6
    assert 1 <= blocks <= sms
    assert blocks * groups >= min(experts, sms * groups)  # every group has a unit while units last
    if experts <= sms * 4:
        assert blocks * groups >= experts  # one pass covers all units


def test_warp_split_benchmark_shape():
    assert ll.warp_split(288, 132) == (8, 3, 96)


# ---------------------------------------------------------------- the kernels' row assignment
def _assign(chunk_masks, warps):
    """Python copy of the send loop of ll_dispatch_kernel: (slot -> (warp, token))."""
    out = {}
    for warp in range(warps):
        running = 0
        for c, bits in enumerate(chunk_masks):
            in_chunk = bin(bits).count("1")
            first = running + (warp - running % warps + warps) % warps
            for s in range(first, running + in_chunk, warps):
                j = s - running
                lanes = [lane for lane in range(32)
                         if (bits >> lane) & 1 and bin(bits & ((1 << lane) - 1)).count("1") == j]
                assert len(lanes) == 1
                assert s not in out
                out[s] = (warp, c * 32 + lanes[0])
            running += in_chunk
    return out


@pytest.mark.parametrize("warps", [1, 3, 8, 10, 32])
def test_send_rows_cover_tokens_in_order(warps):
    rng = np.random.default_rng(warps)
    for _ in range(20):
        n = int(rng.integers(0, 200))
        hits = rng.random(n) < rng.random()
        masks = []
        for c in range(-(-n // 32)):
            bits = 0
            for lane in range(32):
                t = c * 32 + lane
                if t < n and hits[t]:
                    bits |= 1 << lane
            masks.append(bits)
        got = _assign(masks, warps)
        tokens = np.nonzero(hits)[0].tolist()
        assert sorted(got) == list(range(len(tokens)))
        assert [got[s][1] for s in range(len(tokens))] == tokens  # slot order = token order
        assert all(got[s][0] == s % warps for s in got)  # round-robin over the warps


def _sequence_tag(s):
    return (s - 1) % 65535 + 1


def test_sequence_tags_never_zero_and_distinct_nearby():
    tags = [_sequence_tag(s) for s in range(1, 200000)]
    assert min(tags) == 1 and max(tags) == 65535
    assert all(a != b for a, b in zip(tags[:-1], tags[1:], strict=True))


# ---------------------------------------------------------------- environment, hooks, timeouts
def test_nvshmem_environment_defaults():
    env = nvshmem_runtime.nvshmem_environment({}, 1 << 30, allow_nvlink=True, num_qps_per_rank=24, allow_mnnvl=False)
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert env["NVSHMEM_DISABLE_MNNVL"] == "1"
    assert env["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "24"
    assert "NVSHMEM_DISABLE_P2P" not in env
    assert int(env["NVSHMEM_SYMMETRIC_SIZE"]) >= (1 << 30) + (256 << 20)
    assert int(env["NVSHMEM_SYMMETRIC_SIZE"]) % int(env["NVSHMEM_CUMEM_GRANULARITY"]) == 0


def test_nvshmem_environment_respects_user_values():
    user = {"NVSHMEM_SYMMETRIC_SIZE": "8G", "NVSHMEM_DISABLE_P2P": "0", "NVSHMEM_DISABLE_NVLS": "0",
            "NVSHMEM_IBGDA_NUM_RC_PER_PE": "4"}
    env = nvshmem_runtime.nvshmem_environment(user, 1 << 30, allow_nvlink=False, num_qps_per_rank=24,
                                              allow_mnnvl=True)
    assert "NVSHMEM_SYMMETRIC_SIZE" not in env and "NVSHMEM_DISABLE_P2P" not in env
    assert "NVSHMEM_IBGDA_NUM_RC_PER_PE" not in env and "NVSHMEM_DISABLE_MNNVL" not in env
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"  # never multicast, whatever the user said
    env = nvshmem_runtime.nvshmem_environment({}, 10, allow_nvlink=False, num_qps_per_rank=3, allow_mnnvl=True)
    assert env["NVSHMEM_DISABLE_P2P"] == "1"


def test_heap_size_and_parse():
    assert nvshmem_runtime.heap_bytes_for(1) == 512 << 20
    assert nvshmem_runtime.heap_bytes_for(2146961792) >= 2146961792 + (256 << 20)
    assert nvshmem_runtime._parse_size("2G") == 2 << 30
    assert nvshmem_runtime._parse_size("512m") == 512 << 20
    assert nvshmem_runtime._parse_size("1234") == 1234


def test_hook_runs_once_with_the_receive_phase():
    import ctypes

    from deepep_cupy.ops.low_latency import plans as low_latency_plans

    class FakePlan:
        def __init__(self):
            self.phases = ctypes.c_int32(ll.PHASE_SEND)
            self.launches = []

        def slot(self, name):
            assert name == "phases"
            return self.phases

        def launch(self, stream):
            self.launches.append((stream, self.phases.value))

    plan = FakePlan()
    hook = low_latency_plans._Hook(plan, 1234)
    hook()
    hook()
    assert plan.launches == [(1234, ll.PHASE_RECV)]


def test_timeout_from_env(monkeypatch):
    monkeypatch.delenv("DEEPEP_CUPY_TIMEOUT_S", raising=False)
    assert ll.timeout_ns() == 100 * 10**9
    monkeypatch.setenv("DEEPEP_CUPY_TIMEOUT_S", "2.5")
    assert ll.timeout_ns() == 2_500_000_000
    monkeypatch.setenv("DEEPEP_CUPY_TIMEOUT_S", "soon")
    with pytest.raises(ValueError):
        ll.timeout_ns()


def test_kernel_names_match_specs():
    spec = ll.dispatch_spec(7168, 8, 8, 3, True)
    assert spec.nvshmem and spec.source == "low_latency/dispatch.cu"
    assert ll.dispatch_kernel_name(7168, 8, 8, 3, True) in spec.name_expressions
    assert ll.stage_kernel_name(7168, True) in spec.name_expressions
    spec = ll.combine_spec(2048, 4, 12, 2, False)
    assert spec.name_expressions == (ll.combine_kernel_name(2048, 4, 12, 2, False),)
    assert len(set(ll.representative_builds())) == len(ll.representative_builds())


# ---------------------------------------------------------------- compile (NVRTC + nvJitLink, no GPU)
def _have_toolchain():
    try:
        from deepep_cupy.jit.compiler import toolchain

        toolchain().require_nvshmem()
        return True
    except Exception:
        return False


@pytest.mark.skipif(not _have_toolchain(), reason="NVRTC / nvJitLink / NVSHMEM device library not installed")
@pytest.mark.parametrize("spec", [ll.dispatch_spec(256, 2, 12, 2, True), ll.combine_spec(256, 3, 12, 2, True)],
                         ids=["dispatch-fp8", "combine-logfmt"])
def test_small_kernels_build(spec, tmp_path, monkeypatch):
    from deepep_cupy.jit import build

    monkeypatch.setenv("DEEPEP_CUPY_CACHE_DIR", str(tmp_path))
    compiled = build(spec, "sm_90")
    assert compiled.cubin_path.stat().st_size > 0
    assert set(compiled.lowered_names) == set(spec.name_expressions)


def test_engine_region_addresses_follow_the_buffer_map():
    """The region addresses plans keep are the symmetric base plus the buffer map's offsets, and buffer
    maps of equal sizes are one object (plans compare them by identity)."""
    from types import SimpleNamespace

    engine = object.__new__(ll.LowLatencyEngine)
    engine._sym = SimpleNamespace(ptr=0x7F00_0000_0000)
    engine._buffer_maps = {}
    for t, h, r, e in ((128, 7168, 2, 288), (1, 2056, 4, 16)):
        engine.num_ranks, engine.num_rdma_bytes = r, 1 << 40
        bmap = engine.make_buffer_map(t, h, e)
        assert engine.make_buffer_map(t, h, e) is bmap
        assert bmap == LowLatencyBufferMap(t, h, r, e)
        addrs = engine.region_addresses(bmap)
        for b in (0, 1):
            for name in REGIONS:
                assert addrs[b][name] == 0x7F00_0000_0000 + bmap.region(b, name)


def test_hook_waits_for_the_send_stream_before_receiving():
    """A hook-mode send on the communication stream: the hook first makes its stream wait for the send's
    join point, then receives, and lets go of what the send used."""
    import ctypes
    import gc
    import weakref

    from deepep_cupy.ops.low_latency import plans as low_latency_plans

    calls = []

    class FakePlan:
        phases = ctypes.c_int32(ll.PHASE_SEND)

        def slot(self, name):
            return self.phases

        def launch(self, stream):
            calls.append(("launch", stream, self.phases.value))

    class FakeJoin:
        def wait_join(self, stream):
            calls.append(("wait", stream))

    class Used:
        pass

    used = Used()
    alive = weakref.ref(used)
    hook = low_latency_plans._Hook(FakePlan(), 1234, FakeJoin(), (used,))
    del used
    gc.collect()
    assert alive() is not None  # held until the receive is queued behind the send
    hook()
    hook()
    gc.collect()
    assert calls == [("wait", 1234), ("launch", 1234, ll.PHASE_RECV)]
    assert alive() is None
