"""Host side of the internode kernels, on the CPU: buffer maps against the size hints and the device structs,
argument blocks against the kernel signatures, op codes against the header, kernel names."""

import re
from pathlib import Path

import pytest
from kernel_args import FakeArray, check_packing

from deepep_cupy.config import Config
from deepep_cupy.ops import kernel_names as K
from deepep_cupy.ops.internode import args as internode_args
from deepep_cupy.ops.internode import buffer_map as IL
from deepep_cupy.ops.internode import engine as internode

CUDA_SRC = Path(__file__).resolve().parents[2] / "cuda_src" / "internode"


@pytest.mark.parametrize("hidden", [128, 2048, 4096, 7168])
def test_slot_holds_worst_case_rows(hidden):
    s = IL.slot_for(hidden)
    assert s.slot_bytes % 16 == 0 and s.scales_offset % 16 == 0
    assert s.scales_offset == 16 + 2 * hidden
    assert s.topk_idx_offset >= s.scales_offset + 4 * IL.MAX_SCALES
    assert s.topk_weights_offset >= s.topk_idx_offset + 4 * IL.MAX_TOPK
    assert s.slot_bytes >= s.topk_weights_offset + 4 * IL.MAX_TOPK


@pytest.mark.parametrize("lsize,ndom", [(1, 2), (2, 2), (4, 2), (8, 2), (8, 4), (1, 32)])
@pytest.mark.parametrize("num_sms,rdma_recv,nvl_recv", [(20, 256, 256), (24, 128, 512), (2, 2, 2), (132, 64, 64)])
@pytest.mark.parametrize("hidden", [2048, 7168])
def test_buffer_maps_fit_hints(lsize, ndom, num_sms, rdma_recv, nvl_recv, hidden):
    cfg = Config(num_sms=num_sms, num_max_nvl_chunked_send_tokens=1, num_max_nvl_chunked_recv_tokens=nvl_recv,
                 num_max_rdma_chunked_send_tokens=1, num_max_rdma_chunked_recv_tokens=rdma_recv)
    ranks = lsize * ndom
    slot = IL.slot_for(hidden)
    rdma = IL.rdma_buffer_map(lsize, ndom, cfg.num_channels, cfg.num_max_rdma_chunked_recv_tokens, slot)
    assert rdma.end <= cfg.get_rdma_buffer_size_hint(hidden * 2, ranks, lsize)
    nvl = IL.nvl_buffer_map(lsize, ndom, cfg.num_channels, nvl_recv, slot, 256 // lsize)
    # The NVLink control words are sized for MAX_CHANNELS channels (16 KiB with 8 ranks per domain): only
    # the tiniest rings (2 slots, 1 channel) need more than the hint, and check_sizes says so.
    fixed = (2 * IL.MAX_CHANNELS * lsize + lsize) * 8
    if ranks <= 8 or ranks % 8 == 0:  # the NVLink hint assumes DeepEP's domain size
        assert nvl.end - fixed <= max(cfg.get_nvl_buffer_size_hint(hidden * 2, ranks),
                              _nvl_hint(cfg, hidden * 2, lsize, ndom))


def _nvl_hint(cfg, hidden_bytes, lsize, ndom):
    # Config's formula with the real domain size (it assumes 8 per domain).
    slots = cfg.num_channels * lsize * cfg.num_max_nvl_chunked_recv_tokens
    return cfg.num_channels * lsize * (2 * ndom + 3) * 4 + slots * (hidden_bytes + 8 + 128 * 12 + 128 * 4)


@pytest.mark.parametrize("lsize,ndom,channels,cap", [(1, 2, 10, 8), (4, 2, 3, 6), (8, 4, 12, 256)])
def test_rdma_regions_disjoint(lsize, ndom, channels, cap):
    bmap = IL.rdma_buffer_map(lsize, ndom, channels, cap, IL.slot_for(256))
    metas = [bmap.meta(h, i) for h in (0, 1) for i in range(channels * ndom)]
    assert metas == sorted(metas) and metas[-1] + bmap.meta_ints * 4 <= bmap.ring_offset
    assert bmap.ring_offset % 128 == 0
    slots = [bmap.slot_start(h, i, k) for h in (0, 1) for i in range(channels * ndom) for k in range(cap)]
    assert all(b - a == bmap.slot.slot_bytes for a, b in zip(slots, slots[1:], strict=False))
    assert slots[-1] + bmap.slot.slot_bytes == bmap.end
    assert bmap.slot_start(1, 0, cap) == bmap.slot_start(1, 0, 0)  # ring index wraps


def test_signal_and_nvl_maps_match_device_structs():
    text = (CUDA_SRC / "buffer_map.cuh").read_text()
    assert f"kMaxChannels = {IL.MAX_CHANNELS};" in text
    for lsize, ndom in ((1, 2), (8, 4)):
        sig = IL.signal_map(lsize, ndom)
        # Signals: tail at 0, head after kMaxChannels * D words, notify after twice that.
        assert sig.head_offset == IL.MAX_CHANNELS * ndom * 8 and sig.notify_offset == 2 * sig.head_offset
        assert sig.record_offset >= sig.notify_offset + 8 * ndom and sig.record_stride >= lsize + lsize * 1024 + 1
        nvl = IL.nvl_buffer_map(lsize, ndom, 4, 16, IL.slot_for(256), 32)
        # NvlCtrl: tail[kMaxChannels*L], head[kMaxChannels*L], notify_flag[L] before the meta.
        assert nvl.meta_offset >= (2 * IL.MAX_CHANNELS * lsize + lsize) * 8
        assert nvl.ring_offset >= nvl.meta_offset + 4 * lsize * ndom * 2 * 4
        assert nvl.notify_offset == nvl.ring_offset + 4 * lsize * 16 * IL.slot_for(256).slot_bytes
        assert nvl.record_stride >= ndom + 32
    assert IL.state_words(8, 4) == 8 + 2 * IL.MAX_CHANNELS * 4 + 2 * IL.MAX_CHANNELS * 8


def test_sub_channels_fill_blocks_of_at_most_768_threads():
    for lsize in (1, 2, 4, 8):
        for ndom in (2, 3, 4, 8, 16):
            if lsize * ndom > 32:  # check_combine_shape refuses these
                continue
            sub = IL.sub_channels(lsize, ndom)
            assert sub >= 1
            threads = [internode.block_threads(lsize, ndom), internode.combine_block_threads(lsize, ndom)]
            assert max(threads) <= (768 if sub > 1 else 1024), (lsize, ndom, sub, threads)
    assert IL.sub_channels(1, 2) == 12 and IL.sub_channels(2, 2) == 4 and IL.sub_channels(4, 2) == 2
    assert IL.sub_channels(8, 2) == 1 and IL.sub_channels(8, 4) == 1


def test_sub_channels_take_1024_threads_with_one_rank_a_domain_on_few_sms():
    # 1024-thread blocks while every SM pair can run them: num_sms / 2 * S * D <= MAX_CHANNELS.
    assert [IL.sub_channels(1, 2, n) for n in (2, 8, 12, 16, 18, 24)] == [16, 16, 16, 16, 12, 12]
    assert [IL.sub_channels(1, 4, n) for n in (8, 12, 16, 18, 24)] == [8, 8, 8, 6, 6]
    assert IL.sub_channels(2, 2, 8) == IL.sub_channels(2, 2) == 4  # more ranks a domain: always 512
    assert IL.channels_per_block(1, 2, None, 8) == 16 and IL.channels_per_block(1, 2, 4, 8) == 4
    for n in (8, 12, 24):
        cfg = Config(n, 8, 256, 16, 128)
        sub = IL.sub_channels(1, 2, n)
        assert limits_default_channels(cfg) == min(n // 2 * sub, IL.MAX_CHANNELS // 2)
        assert max(internode.block_threads(1, 2, sub), internode.combine_block_threads(1, 2, sub)) <= 1024
    # The device sizes the combine's loads by the block's channels, not by a default of its own.
    assert "constexpr int combine_registers(int L, int D, int S)" in (CUDA_SRC / "buffer_map.cuh").read_text()
    assert "constexpr int kRegs = combine_registers(L, D, S);" in (CUDA_SRC / "combine.cu").read_text()


def limits_default_channels(cfg):
    from deepep_cupy.ops import limits

    return limits.default_channels(cfg, 1, 2)


    # One rank per domain: no NVLink stage, so a combine channel is D forwarder warps and one reducer warp.
    assert [IL.combine_channel_warps(1, d) for d in (2, 3, 16)] == [2, 3, 16]
    assert IL.combine_channel_warps(2, 2) == 4 and IL.combine_channel_warps(2, 4) == 8


def test_ring_sizes_split_the_configs_rings_between_sub_channels():
    from deepep_cupy.config import Config

    for cfg in (Config(24, 8, 512, 16, 128), Config(24, 4, 12, 1, 8), Config(20, 6, 256, 6, 128)):
        for sub in (1, 2, 5, 8):
            cap, chunk, nvl = IL.ring_sizes(cfg, sub)
            assert cap % chunk == 0 and 2 * chunk <= cap and chunk <= cfg.num_max_rdma_chunked_send_tokens
            assert cap * sub <= max(cfg.num_max_rdma_chunked_recv_tokens, 2 * sub)
            assert nvl * sub <= cfg.num_max_nvl_chunked_recv_tokens and nvl >= 1


def _buffer_maps():
    slot = IL.slot_for(7168)
    return (IL.rdma_buffer_map(2, 2, 12, 256, slot), IL.nvl_buffer_map(2, 2, 12, 256, slot, 16),
            IL.signal_map(2, 2))


def test_notify_args_fill_the_struct():
    a = FakeArray()
    _, nvl, sig = _buffer_maps()
    packed = internode.notify_args(
        is_token_in_rank=a, num_tokens=5, num_channels=3, num_tokens_per_expert=a, num_local_experts=4,
        expert_alignment=1, rdma_channel_prefix_matrix=a, gbl_channel_prefix_matrix=a, recv_rdma_rank_prefix_sum=a,
        recv_gbl_rank_prefix_sum=a, meta=a, sig=1 << 20, signals=sig, nvl_bases=a, nvl=nvl, state=a, err_ptr=9,
        timeout_ns=10, rank=1)
    check_packing(internode_args.NOTIFY, packed)
    assert packed["record_offset"] == sig.record_offset


def test_dispatch_args_fill_the_struct():
    a = FakeArray()
    rdma, nvl, _ = _buffer_maps()
    packed = internode.dispatch_args(
        x=a, x_scales=None, scale_token_stride=0, scale_block_stride=0, num_scales=0, topk_idx=a, topk_weights=None,
        num_topk=8, num_local_experts=16, is_token_in_rank=a, num_tokens=100, hidden_int4=896,
        rdma_channel_prefix_matrix=a, gbl_channel_prefix_matrix=a, recv_rdma_rank_prefix_sum=a,
        recv_gbl_rank_prefix_sum=a, recv_x=a, recv_x_scales=None, recv_topk_idx=a, recv_topk_weights=None,
        recv_rdma_channel_prefix_matrix=a, recv_gbl_channel_prefix_matrix=a, recv_src_meta=a, send_rdma_head=a,
        send_nvl_head=a, num_out_rows=10, num_nvl_head_rows=4, rdma=1 << 30, rdma_map=rdma, rdma_chunk=6,
        sig=1 << 20, nvl_bases=a, nvl=nvl, state=a, err_ptr=9, timeout_ns=10, rank=3)
    check_packing(internode_args.DISPATCH, packed)
    d = packed
    assert d["ring_offset"] == rdma.ring_offset and d["nvl_ring_offset"] == nvl.ring_offset
    assert d["slot_bytes"] == rdma.slot.slot_bytes and d["x_scales"] == 0 and d["rdma_cpm"] is a


def test_op_codes_match_header():
    text = (CUDA_SRC / "buffer_map.cuh").read_text()
    codes = {int(v) for v in re.findall(r"kOp\w+ = (\d+)", text)}
    assert codes == set(internode.OP_NAMES)
    assert f"kValueOpInternodeDispatch = {K.VALUE_OP_INTERNODE_DISPATCH};" in (
        CUDA_SRC.parent / "common" / "value_errors.cuh").read_text()


def test_kernel_names_and_specs():
    assert K.internode_dispatch(2, 4, 2) == "deepep_cupy::internode::dispatch<2, 4, 2>"
    assert K.internode_notify(1, 2) == "deepep_cupy::internode::notify<1, 2>"
    assert K.internode_combine(8, 2, 1) == "deepep_cupy::internode::combine<8, 2, 1>"
    spec = internode.dispatch_spec(1, 2)
    assert spec.nvshmem and spec.name_expressions == (K.internode_dispatch(1, 2, 12),)
    assert internode.dispatch_spec(1, 2, 4).name_expressions == (K.internode_dispatch(1, 2, 4),)
    assert internode.block_threads(1, 2) == 64 * 12 and internode.block_threads(8, 4) == 512  # 12 channels a block at 1 x 2
    with pytest.raises(ValueError):
        internode.dispatch_spec(1, 1)
    with pytest.raises(ValueError):
        internode.notify_spec(16, 2)
    assert "32 * dispatch_channel_warps(kNumNvlRanks, kNumDomains) * kSubChannels" in (
        CUDA_SRC / "dispatch.cu").read_text()
    assert "constexpr int dispatch_channel_warps(int L, int D) { return D > 2 * L ? D : 2 * L; }" in (
        CUDA_SRC / "buffer_map.cuh").read_text()


def test_domain_view_keeps_domain_entries():
    class G:
        rank, size = 5, 8

        def allgather_object(self, obj, op=None):
            return [f"r{i}" for i in range(8)]

    v = internode._DomainView(G(), 4)
    assert (v.rank, v.size) == (1, 4) and v.allgather_object("x") == ["r4", "r5", "r6", "r7"]


def test_combine_args_fill_the_struct():
    a = FakeArray()
    rdma, nvl, _ = _buffer_maps()
    packed = internode.combine_args(
        x=a, topk_weights=None, num_topk=8, bias_0=a, bias_1=None, recv_rdma_channel_prefix_matrix=a,
        recv_rdma_rank_prefix_sum=a, recv_gbl_channel_prefix_matrix=a, recv_gbl_rank_prefix_sum=a, send_rdma_head=a,
        send_nvl_head=a, num_tokens=100, hidden_int4=896, combined_x=a, combined_topk_weights=None, rdma=1 << 30,
        rdma_map=rdma, rdma_chunk=6, sig=1 << 20, nvl_bases=a, nvl=nvl, state=a, err_ptr=9, timeout_ns=10,
        rank=3)
    check_packing(internode_args.COMBINE, packed)
    d = packed
    assert d["ring_offset"] == rdma.ring_offset and d["nvl_ring_offset"] == nvl.ring_offset
    assert d["slot_topk_weights_offset"] == rdma.slot.topk_weights_offset and d["bias_1"] == 0 and d["recv_gbl_prefix"] is a


def test_combine_spec_and_block_shape():
    spec = internode.combine_spec(8, 4)
    assert spec.nvshmem and spec.name_expressions == (K.internode_combine(8, 4, 1),)
    assert spec in internode.representative_builds()
    assert internode.combine_block_threads(1, 2) == 64 * 12 and internode.combine_block_threads(8, 4) == 1024
    with pytest.raises(ValueError):
        internode.combine_spec(2, 32)  # one sender warp per (forwarder, source domain): 64 warps
    assert "32 * combine_channel_warps(kNumNvlRanks, kNumDomains) * kSubChannels" in (
        CUDA_SRC / "combine.cu").read_text()
    assert "return L == 1 ? D : L * D;" in (CUDA_SRC / "buffer_map.cuh").read_text()


def test_sub_channels_tuning_sets_blocks_channels_and_rings():
    from deepep_cupy.ops import limits

    assert IL.max_sub_channels(1, 2) == 16 and IL.max_sub_channels(2, 2) == 8 and IL.max_sub_channels(8, 4) == 1
    for sub in (1, 4, 8, 12, 16):
        assert internode.block_threads(1, 2, sub) == 64 * sub == internode.combine_block_threads(1, 2, sub)
        assert internode.num_blocks(24, 1, 2, sub) == -(-24 // sub)
    for bad in (0, 17):
        with pytest.raises(ValueError):
            internode.block_threads(1, 2, bad)
        with pytest.raises(ValueError):
            internode.dispatch_spec(1, 2, bad)
    cfg = Config(24, 8, 512, 16, 128)
    # 12 SM pairs x 12 channels, capped at MAX_CHANNELS / D
    assert limits.default_channels(cfg, 1, 2) == IL.MAX_CHANNELS // 2 and limits.default_channels(cfg, 1, 2, 4) == 48
    assert limits.internode_grid(48, 1, 2, 132, 4) == 24 and limits.internode_grid(96, 1, 2, 132, 8) == 24
    assert limits.internode_grid(120, 1, 2, 132) == 20  # the default: 12 channels a block
    big = 1 << 40
    kw = dict(hidden=7168, fp8=False, num_scales=0, num_topk=8, num_local_experts=128, handle_channels=None,
              num_device_sms=132)
    for sub in (2, 4, 8):
        channels, grid, rdma, nvl, chunk = limits.internode_dispatch(1, 2, big, big, cfg, sub=sub, **kw)
        assert (channels, grid) == (12 * sub, 24) and (rdma.cap, chunk, nvl.cap) == IL.ring_sizes(cfg, sub)
        grid_c, rdma_c, nvl_c, chunk_c = limits.internode_combine(1, 2, big, big, cfg, hidden=7168, num_topk=8,
                                                                  handle_channels=channels, num_device_sms=132,
                                                                  sub=sub)
        # Dispatch and combine with the same tuning lay the rings out alike (no geometry change between them).
        assert grid_c == grid and (rdma_c.cap, chunk_c, nvl_c.cap) == (rdma.cap, chunk, nvl.cap)


def test_one_rank_domains_need_no_nvlink_ring_slots_in_combine():
    from deepep_cupy.ops import limits

    cfg = Config(24, 4, 8, 16, 128)  # 8 NVLink slots per SM pair: 2 per channel at 4 channels a block
    big = 1 << 40
    limits.internode_combine(1, 4, big, big, cfg, hidden=256, num_topk=8, handle_channels=48, num_device_sms=132,
                             sub=4)
    with pytest.raises(ValueError):  # with NVLink forwarding each of the 4 domains needs a slot
        limits.internode_combine(2, 4, big, big, cfg, hidden=256, num_topk=8, handle_channels=48, num_device_sms=132,
                                 sub=4)
