// Intranode dispatch, step 2: move the tokens.
//
// Grid: 2 * C blocks; block 2c sends channel c, block 2c + 1 receives channel c. Channel c is the token
// range [c * ceil(N/C), ...) of every rank.
//
// Sender block of channel c: warps [0, num_self_warps) copy this rank's own tokens straight from x into
// the outputs (no ring); the other warps are split evenly over the R - 1 peers. Every warp of a peer's
// group scans the channel's is_token_in_rank column with ballots, so it knows the index i of each token
// going to that peer; warp (i % group size) moves token i into slot i % cap of ring (c, me) in the peer's
// buffer with 16-byte stores, then releases the slot flag (seq << 32 | i). Before reusing a slot
// (i >= cap) it waits for the peer's "slot free" word for token i in its own buffer.
//
// Receiver block of channel c: warps split evenly over the R - 1 peers; warp (i % group size) waits for
// the flag of token i of ring (c, s), copies the slot into output row
// (rows before source s) + recv_channel_prefix_matrix[s][c] + i, and, when the sender will need the slot
// again (i + cap < count), stores the "slot free" word into the sender's buffer. Different warps work on
// different tokens independently, so there is no block-wide synchronisation on the data path.
//
// send_head[t][d] (non-cached mode) = position of token t among all rows rank d receives from this rank,
// or -1. Top-k ids become local ids of the destination (e - d * E_local, or -1 when e is elsewhere) with
// weight 0 for -1. When num_worst_tokens > 0 the receiver blocks also fill the padding rows of the index
// outputs (-1 / 0); rows beyond num_out_rows are dropped and reported.

#include "common/nvrtc_compat.cuh"
#include "intranode/layout.cuh"

namespace deepep_intranode {

template <int kNumRanks, int kNumWarps, int kUnroll>
__global__ void __launch_bounds__(kNumWarps * 32, 1)
dispatch_kernel(const int4* __restrict__ x, const unsigned int* __restrict__ x_scales, long long scale_token_stride,
                long long scale_block_stride, int num_scales, const long long* __restrict__ topk_idx,
                const float* __restrict__ topk_weights, int num_topk, int num_local_experts,
                const bool* __restrict__ is_token_in_rank, int num_tokens, int hidden_int4,
                const int* __restrict__ rank_prefix_matrix, const int* __restrict__ channel_prefix_matrix,
                const int* __restrict__ recv_channel_prefix_matrix, int4* __restrict__ recv_x,
                unsigned int* __restrict__ recv_x_scales, long long* __restrict__ recv_topk_idx,
                float* __restrict__ recv_topk_weights, int* __restrict__ recv_src_idx, int* __restrict__ send_head,
                int num_out_rows, int num_worst_tokens, const long long* __restrict__ bases, long long ring_offset,
                long long free_offset, int slot_bytes, int cap, int slot_scales_offset, int slot_topk_idx_offset,
                int slot_topk_weights_offset, int num_channels, int num_self_warps, deepep::ErrorRecord* err,
                long long timeout_ns, int rank) {
    constexpr int R = kNumRanks;
    const int c = blockIdx.x / 2;
    const bool is_sender = (blockIdx.x % 2) == 0;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    uint8_t* my_base = rank_base(bases, rank);
    const Ctrl ctrl = ctrl_of(my_base, R);
    const uint64_t seq = begin_kernel(ctrl);
    const WaitCtx wctx{err, timeout_ns, rank};
    if (blockIdx.x == 0) announce_arrival(bases, R, rank, seq);

    const long long ring_bytes = static_cast<long long>(cap) * slot_bytes;
    const int num_recv = rank_prefix_matrix[(R - 1) * R + rank];

    if (is_sender) {
        int dst, gi, gs;
        if (warp < num_self_warps) {
            dst = rank;
            gi = warp;
            gs = num_self_warps;
        } else {
            int g;
            split_warps(warp - num_self_warps, kNumWarps - num_self_warps, R - 1, g, gi, gs);
            dst = (rank + 1 + g) % R;
        }
        const bool to_self = dst == rank;
        int t_begin, t_end;
        channel_range(num_tokens, num_channels, c, t_begin, t_end);
        const int send_base = c > 0 ? channel_prefix_matrix[dst * num_channels + c - 1] : 0;

        bool ok = true;
        uint8_t* ring = nullptr;
        int out_base = 0;
        if (to_self) {
            out_base = (rank > 0 ? rank_prefix_matrix[(rank - 1) * R + rank] : 0) +
                       recv_channel_prefix_matrix[rank * num_channels + c];
        } else {
            ring = rank_base(bases, dst) + ring_offset + static_cast<long long>(c * R + rank) * ring_bytes;
            // The peer must have finished its earlier kernels before anything lands in its buffer.
            ok = warp_wait(ctrl.arrive(dst), [seq](uint64_t v) { return v >= seq; }, wctx, kOpDispatchArrive, dst,
                           __LINE__);
        }
        const uint64_t* free_words =
            reinterpret_cast<const uint64_t*>(my_base + free_offset) + static_cast<long long>(c * R + dst) * cap;

        int count = 0;  // tokens of this channel for dst seen so far
        for (int chunk = t_begin; ok && chunk < t_end; chunk += 32) {
            const int t = chunk + lane;
            const bool in = t < t_end && is_token_in_rank[static_cast<long long>(t) * R + dst];
            unsigned int mask = __ballot_sync(kFullMask, in);
            if (gi == 0 && send_head != nullptr && t < t_end) {
                const int before = __popc(mask & ((1u << lane) - 1u));
                send_head[static_cast<long long>(t) * R + dst] = in ? send_base + count + before : -1;
            }
            while (mask != 0u) {
                const int k = __ffs(mask) - 1;
                mask &= mask - 1u;
                const int idx = count++;
                if (idx % gs != gi) continue;
                const int token = chunk + k;
                const int4* src_row = x + static_cast<long long>(token) * hidden_int4;

                if (to_self) {
                    const int row = out_base + idx;
                    if (row >= num_out_rows) {
                        if (lane == 0) deepep::report_timeout(err, kOpDispatchOverflow, rank, rank, __LINE__, num_recv);
                        continue;
                    }
                    warp_copy_nc<kUnroll>(recv_x + static_cast<long long>(row) * hidden_int4, src_row, hidden_int4, lane);
                    for (int s = lane; s < num_scales; s += 32)
                        recv_x_scales[static_cast<long long>(row) * num_scales + s] =
                            x_scales[token * scale_token_stride + s * scale_block_stride];
                    if (recv_topk_idx != nullptr) {
                        for (int j = lane; j < num_topk; j += 32) {
                            const long long e = topk_idx[static_cast<long long>(token) * num_topk + j];
                            const long long local = e - static_cast<long long>(rank) * num_local_experts;
                            const bool mine = e >= 0 && local >= 0 && local < num_local_experts;
                            recv_topk_idx[static_cast<long long>(row) * num_topk + j] = mine ? local : -1;
                            if (recv_topk_weights != nullptr)
                                recv_topk_weights[static_cast<long long>(row) * num_topk + j] =
                                    mine ? topk_weights[static_cast<long long>(token) * num_topk + j] : 0.0f;
                        }
                    }
                    if (lane == 0 && recv_src_idx != nullptr) recv_src_idx[row] = token;
                    continue;
                }

                const int slot = idx % cap;
                if (idx >= cap) {
                    const uint64_t want = tag(seq, idx);
                    ok = warp_wait(free_words + slot, [want](uint64_t v) { return v == want; }, wctx, kOpDispatchSlot,
                                   dst, __LINE__);
                    if (!ok) break;
                }
                uint8_t* slot_ptr = ring + static_cast<long long>(slot) * slot_bytes;
                warp_copy_nc<kUnroll>(reinterpret_cast<int4*>(slot_ptr + 16), src_row, hidden_int4, lane);
                unsigned int* slot_scales = reinterpret_cast<unsigned int*>(slot_ptr + slot_scales_offset);
                for (int s = lane; s < num_scales; s += 32)
                    slot_scales[s] = x_scales[token * scale_token_stride + s * scale_block_stride];
                if (topk_idx != nullptr) {
                    int* slot_idx = reinterpret_cast<int*>(slot_ptr + slot_topk_idx_offset);
                    float* slot_w = reinterpret_cast<float*>(slot_ptr + slot_topk_weights_offset);
                    for (int j = lane; j < num_topk; j += 32) {
                        const long long e = topk_idx[static_cast<long long>(token) * num_topk + j];
                        const long long local = e - static_cast<long long>(dst) * num_local_experts;
                        const bool mine = e >= 0 && local >= 0 && local < num_local_experts;
                        slot_idx[j] = mine ? static_cast<int>(local) : -1;
                        slot_w[j] = (mine && topk_weights != nullptr)
                                        ? topk_weights[static_cast<long long>(token) * num_topk + j]
                                        : 0.0f;
                    }
                }
                if (lane == 0) reinterpret_cast<int*>(slot_ptr)[2] = token;
                __syncwarp();
                if (lane == 0) deepep::st_release_sys(reinterpret_cast<uint64_t*>(slot_ptr), tag(seq, idx));
            }
        }
    } else {
        // Padding rows of the index outputs (num_worst_tokens mode).
        if (num_worst_tokens > 0) {
            const long long stride = static_cast<long long>(num_channels) * blockDim.x;
            const long long first = static_cast<long long>(c) * blockDim.x + threadIdx.x;
            const long long pad_begin = num_recv < num_out_rows ? num_recv : num_out_rows;
            for (long long row = pad_begin + first; row < num_out_rows; row += stride) {
                if (recv_src_idx != nullptr) recv_src_idx[row] = -1;
            }
            if (recv_topk_idx != nullptr) {
                for (long long k = pad_begin * num_topk + first; k < static_cast<long long>(num_out_rows) * num_topk;
                     k += stride) {
                    recv_topk_idx[k] = -1;
                    if (recv_topk_weights != nullptr) recv_topk_weights[k] = 0.0f;
                }
            }
        }
        if (R > 1) {
            int g, gi, gs;
            split_warps(warp, kNumWarps, R - 1, g, gi, gs);
            const int src = (rank + 1 + g) % R;
            const int src_begin = src > 0 ? rank_prefix_matrix[(src - 1) * R + rank] : 0;
            const int src_end = rank_prefix_matrix[src * R + rank];
            const int ch_begin = recv_channel_prefix_matrix[src * num_channels + c];
            const int ch_end =
                c + 1 < num_channels ? recv_channel_prefix_matrix[src * num_channels + c + 1] : src_end - src_begin;
            const int n = ch_end - ch_begin;
            const int out_base = src_begin + ch_begin;
            const uint8_t* ring = my_base + ring_offset + static_cast<long long>(c * R + src) * ring_bytes;
            uint64_t* peer_free =
                reinterpret_cast<uint64_t*>(rank_base(bases, src) + free_offset) + static_cast<long long>(c * R + rank) * cap;

            for (int idx = gi; idx < n; idx += gs) {
                const int slot = idx % cap;
                const uint8_t* slot_ptr = ring + static_cast<long long>(slot) * slot_bytes;
                const uint64_t want = tag(seq, idx);
                if (!warp_wait(reinterpret_cast<const uint64_t*>(slot_ptr), [want](uint64_t v) { return v == want; },
                               wctx, kOpDispatchRecv, src, __LINE__))
                    break;
                const int row = out_base + idx;
                if (row < num_out_rows) {
                    warp_copy_ring<kUnroll>(recv_x + static_cast<long long>(row) * hidden_int4,
                                            reinterpret_cast<const int4*>(slot_ptr + 16), hidden_int4, lane);
                    const unsigned int* slot_scales = reinterpret_cast<const unsigned int*>(slot_ptr + slot_scales_offset);
                    for (int s = lane; s < num_scales; s += 32)
                        recv_x_scales[static_cast<long long>(row) * num_scales + s] = ld_cg_u32(slot_scales + s);
                    if (recv_topk_idx != nullptr) {
                        const int* slot_idx = reinterpret_cast<const int*>(slot_ptr + slot_topk_idx_offset);
                        const float* slot_w = reinterpret_cast<const float*>(slot_ptr + slot_topk_weights_offset);
                        for (int j = lane; j < num_topk; j += 32) {
                            recv_topk_idx[static_cast<long long>(row) * num_topk + j] = ld_cg_s32(slot_idx + j);
                            if (recv_topk_weights != nullptr)
                                recv_topk_weights[static_cast<long long>(row) * num_topk + j] = ld_cg_f32(slot_w + j);
                        }
                    }
                    if (lane == 0 && recv_src_idx != nullptr)
                        recv_src_idx[row] = ld_cg_s32(reinterpret_cast<const int*>(slot_ptr) + 2);
                } else if (lane == 0) {
                    deepep::report_timeout(err, kOpDispatchOverflow, rank, src, __LINE__, num_recv);
                }
                __syncwarp();
                // Every load of this slot is done (their values were stored above): hand it back.
                if (idx + cap < n && lane == 0) deepep::st_release_sys(peer_free + slot, tag(seq, idx + cap));
            }
        }
    }
    end_kernel(ctrl, seq);
}

}  // namespace deepep_intranode
