// Intranode combine: send every received row back to its source rank and sum there.
//
// Grid: 2 * C blocks; block 2c sends channel c, block 2c + 1 receives channel c (same channels as the
// dispatch that produced the handle).
//
// Sender block of channel c: warps split evenly over the R - 1 peers. For peer d, the rows this rank
// received from d in channel c are rows (rows before d) + recv_channel_prefix_matrix[d][c] + i, i < n;
// warp (i % group size) copies row i (and its top-k weights) into slot i % cap of ring (c, me) in d's
// buffer and releases the slot flag (seq << 32 | i), after waiting for the "slot free" word when i >= cap.
// Rows this rank received from itself are not sent: the receiver reads them from x directly.
//
// Receiver block of channel c: warp w reduces tokens t_begin + w, t_begin + w + kNumWarps, ... For token t
// and every rank r in rank order with send_head[t][r] >= 0, the row index within the channel is
// i_r = send_head[t][r] - channel_prefix_matrix[r][c - 1]; the row comes from ring (c, r) slot i_r % cap,
// or from x for r == me. Sum in float32: acc = (bias_0 + bias_1) when a bias is given, else 0; then
// acc += row_r in rank order; round to bf16 (nearest even) once. The same for the top-k weights (no bias).
// After the reads, the "slot free" word goes back to r when r will reuse the slot (i_r + cap < n_r).

#include "common/nvrtc_compat.cuh"
#include "intranode/layout.cuh"

namespace deepep_intranode {

__device__ __forceinline__ float bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }

// float -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ unsigned int f32_to_bf16_rn(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& v) {
    const unsigned int w[4] = {static_cast<unsigned int>(v.x), static_cast<unsigned int>(v.y),
                               static_cast<unsigned int>(v.z), static_cast<unsigned int>(v.w)};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        acc[2 * k] += bf16_lo(w[k]);
        acc[2 * k + 1] += bf16_hi(w[k]);
    }
}

__device__ __forceinline__ void load_bf16x8(float (&out)[8], const int4& v) {
    const unsigned int w[4] = {static_cast<unsigned int>(v.x), static_cast<unsigned int>(v.y),
                               static_cast<unsigned int>(v.z), static_cast<unsigned int>(v.w)};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        out[2 * k] = bf16_lo(w[k]);
        out[2 * k + 1] = bf16_hi(w[k]);
    }
}

__device__ __forceinline__ int4 pack_bf16x8(const float (&acc)[8]) {
    unsigned int w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = f32_to_bf16_rn(acc[2 * k]) | (f32_to_bf16_rn(acc[2 * k + 1]) << 16);
    return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]), static_cast<int>(w[3]));
}

template <int kNumRanks, int kNumWarps, int kUnroll>
__global__ void __launch_bounds__(kNumWarps * 32, 1)
combine_kernel(const int4* __restrict__ x, const float* __restrict__ topk_weights, int num_topk,
               const int4* __restrict__ bias_0, const int4* __restrict__ bias_1,
               const int* __restrict__ rank_prefix_matrix, const int* __restrict__ channel_prefix_matrix,
               const int* __restrict__ recv_channel_prefix_matrix, const int* __restrict__ send_head, int num_tokens,
               int hidden_int4, int4* __restrict__ combined_x, float* __restrict__ combined_topk_weights,
               const long long* __restrict__ bases, long long ring_offset, long long free_offset, int slot_bytes,
               int cap, int slot_topk_weights_offset, int num_channels, deepep::ErrorRecord* err,
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

    if (is_sender) {
        if (R > 1) {
            int g, gi, gs;
            split_warps(warp, kNumWarps, R - 1, g, gi, gs);
            const int dst = (rank + 1 + g) % R;
            const int dst_begin = dst > 0 ? rank_prefix_matrix[(dst - 1) * R + rank] : 0;
            const int dst_end = rank_prefix_matrix[dst * R + rank];
            const int ch_begin = recv_channel_prefix_matrix[dst * num_channels + c];
            const int ch_end =
                c + 1 < num_channels ? recv_channel_prefix_matrix[dst * num_channels + c + 1] : dst_end - dst_begin;
            const int n = ch_end - ch_begin;
            const long long row_base = dst_begin + ch_begin;
            uint8_t* ring = rank_base(bases, dst) + ring_offset + static_cast<long long>(c * R + rank) * ring_bytes;
            const uint64_t* free_words =
                reinterpret_cast<const uint64_t*>(my_base + free_offset) + static_cast<long long>(c * R + dst) * cap;

            bool ok = warp_wait(ctrl.arrive(dst), [seq](uint64_t v) { return v >= seq; }, wctx, kOpCombineArrive,
                                dst, __LINE__);
            for (int idx = gi; ok && idx < n; idx += gs) {
                const int slot = idx % cap;
                if (idx >= cap) {
                    const uint64_t want = tag(seq, idx);
                ok = warp_wait(free_words + slot, [want](uint64_t v) { return v == want; }, wctx, kOpCombineSlot,
                               dst, __LINE__);
                    if (!ok) break;
                }
                uint8_t* slot_ptr = ring + static_cast<long long>(slot) * slot_bytes;
                const long long row = row_base + idx;
                warp_copy_nc<kUnroll>(reinterpret_cast<int4*>(slot_ptr + 16), x + row * hidden_int4, hidden_int4, lane);
                if (topk_weights != nullptr) {
                    float* slot_w = reinterpret_cast<float*>(slot_ptr + slot_topk_weights_offset);
                    for (int j = lane; j < num_topk; j += 32) slot_w[j] = topk_weights[row * num_topk + j];
                }
                __syncwarp();
                if (lane == 0) deepep::st_release_sys(reinterpret_cast<uint64_t*>(slot_ptr), tag(seq, idx));
            }
        }
    } else {
        int t_begin, t_end;
        channel_range(num_tokens, num_channels, c, t_begin, t_end);
        // Per-rank constants of this channel.
        int ch_prev[R], ch_count[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            ch_prev[r] = c > 0 ? channel_prefix_matrix[r * num_channels + c - 1] : 0;
            ch_count[r] = channel_prefix_matrix[r * num_channels + c] - ch_prev[r];
        }
        const long long self_base = (rank > 0 ? rank_prefix_matrix[(rank - 1) * R + rank] : 0) +
                                    recv_channel_prefix_matrix[rank * num_channels + c];
        const bool has_bias = bias_0 != nullptr || bias_1 != nullptr;

        bool ok = true;
        for (int t = t_begin + warp; ok && t < t_end; t += kNumWarps) {
            // Where each rank's row for token t is (nullptr: rank r did not get the token). For peers the
            // row is a ring slot (weights at slot_topk_weights_offset - 16 from it); for this rank, x.
            const int4* rows[R];
            int idx_of[R];
            long long self_row = -1;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int head = send_head[static_cast<long long>(t) * R + r];
                idx_of[r] = head >= 0 ? head - ch_prev[r] : -1;
                rows[r] = nullptr;
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (ok && idx_of[r] >= 0) {
                    if (r == rank) {
                        self_row = self_base + idx_of[r];
                        rows[r] = x + self_row * hidden_int4;
                    } else {
                        const uint8_t* slot_ptr = my_base + ring_offset + static_cast<long long>(c * R + r) * ring_bytes +
                                                  static_cast<long long>(idx_of[r] % cap) * slot_bytes;
                        const uint64_t want = tag(seq, idx_of[r]);
                        ok = warp_wait(reinterpret_cast<const uint64_t*>(slot_ptr), [want](uint64_t v) { return v == want; },
                                       wctx, kOpCombineRecv, r, __LINE__);
                        rows[r] = reinterpret_cast<const int4*>(slot_ptr + 16);
                    }
                }
            }
            if (!ok) break;

            // Hidden: lane-strided 16-byte words, kUnroll per lane per step.
            const long long out_row = static_cast<long long>(t) * hidden_int4;
            for (int base = 0; base < hidden_int4; base += 32 * kUnroll) {
                float acc[kUnroll][8];
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const int j = base + u * 32 + lane;
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[u][e] = 0.0f;
                    if (j < hidden_int4 && has_bias) {
                        // acc = b0 + b1, a missing bias being +0 (the reference's exact float32 order).
                        float b[8];
#pragma unroll
                        for (int e = 0; e < 8; ++e) b[e] = 0.0f;
                        if (bias_0 != nullptr) load_bf16x8(acc[u], deepep::ld_nc_v4(bias_0 + out_row + j));
                        if (bias_1 != nullptr) load_bf16x8(b, deepep::ld_nc_v4(bias_1 + out_row + j));
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[u][e] = acc[u][e] + b[e];
                    }
                }
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (rows[r] == nullptr) continue;
                    int4 v[kUnroll];
#pragma unroll
                    for (int u = 0; u < kUnroll; ++u) {
                        const int j = base + u * 32 + lane;
                        if (j < hidden_int4) v[u] = (r == rank) ? deepep::ld_nc_v4(rows[r] + j) : ld_cg_v4(rows[r] + j);
                    }
#pragma unroll
                    for (int u = 0; u < kUnroll; ++u) {
                        const int j = base + u * 32 + lane;
                        if (j < hidden_int4) add_bf16x8(acc[u], v[u]);
                    }
                }
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const int j = base + u * 32 + lane;
                    if (j < hidden_int4) deepep::st_na_v4(combined_x + out_row + j, pack_bf16x8(acc[u]));
                }
            }
            if (combined_topk_weights != nullptr) {
                for (int j = lane; j < num_topk; j += 32) {
                    float acc = 0.0f;
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        if (rows[r] == nullptr) continue;
                        if (r == rank) {
                            acc += topk_weights[self_row * num_topk + j];
                        } else {
                            const float* w = reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(rows[r]) - 16 +
                                                                            slot_topk_weights_offset);
                            acc += ld_cg_f32(w + j);
                        }
                    }
                    combined_topk_weights[static_cast<long long>(t) * num_topk + j] = acc;
                }
            }
            __syncwarp();
            // All reads of the slots are done: hand back the ones the senders will reuse.
            if (lane < R && lane != rank) {
                int my_idx = -1, my_count = 0;
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (r == lane) {
                        my_idx = idx_of[r];
                        my_count = ch_count[r];
                    }
                }
                if (my_idx >= 0 && my_idx + cap < my_count) {
                    uint64_t* peer_free = reinterpret_cast<uint64_t*>(rank_base(bases, lane) + free_offset) +
                                          static_cast<long long>(c * R + rank) * cap;
                    deepep::st_release_sys(peer_free + (my_idx % cap), tag(seq, my_idx + cap));
                }
            }
        }
    }
    end_kernel(ctrl, seq);
}

}  // namespace deepep_intranode
