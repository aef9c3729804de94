// Intranode combine: send every received row back to its source rank and sum there.
//
// Grid: 2 * C blocks; block 2c sends channel c, block 2c + 1 receives channel c (same channels as the
// dispatch that produced the handle).
//
// Sender block of channel c: warps split evenly over the R - 1 peers. For peer d, the rows this rank
// received from d in channel c are rows (rows before d) + recv_channel_prefix_matrix[d][c] + i, i < n.
// Rows go in runs of B = clamp_batch(publish_batch, cap) consecutive indices (B <= 32 / R), run k to warp
// k % (group size): the warp copies each row i (kSendUnroll loads a lane in flight) and its top-k weights
// into slot i % cap of ring (c, me) in d's buffer, after waiting for the "slot free" word when i >= cap, and
// at the end of the run publishes all the run's slot flags (seq << 32 | i) after one system fence.
// Rows this rank received from itself are not sent: the receiver reads them from x directly.
//
// Reduction of channel c: runs of B consecutive tokens of the channel, claimed in order from a per-channel
// counter (run_claims[c], back to 0 when the kernel ends) by the receiver block's warps and, once their
// pushes are done, by the sender block's warps too (with fixed shares the receiver block finished long
// after the senders). For token t and every rank r in rank order with send_head[t][r] >= 0, the row
// index within the channel is i_r = send_head[t][r] - channel_prefix_matrix[r][c - 1]; the row comes from
// ring (c, r) slot i_r % cap, or from x for r == me. The warp reads send_head for the whole run and waits
// for all its slot flags at once (lane k * R + r: token k of the run, rank r). Sum in float32: acc = (bias_0 + bias_1)
// when a bias is given, else 0; then acc += row_r in rank order; round to bf16 (nearest even) once. The
// same for the top-k weights (no bias). After the run, one fence, then the "slot free" words go back to
// every r that will reuse a slot (i_r + cap < n_r).
//
// No deadlock: a run of B tokens spans at most B indices of each ring, and B <= ceil(cap / 2), so the
// receiver run holding index i - cap ends before the sender run holding i begins (see dispatch.cu). A warp
// claims its next run while it reduces the current one, so it may hold two; the smallest run not yet done
// is always some warp's current run, and the flags it waits for only need slots freed by smaller runs.

#include "common/nvrtc_compat.cuh"
#include "intranode/combine_sum.cuh"
#include "intranode/args.cuh"
#include "intranode/buffer_map.cuh"
#include "intranode/copies.cuh"
#include "intranode/sync.cuh"


namespace deepep_cupy::intranode {

// kOrdered: sum each token's rows in V2's order (args.order_topk_idx, combine_sum.cuh), a kernel of its own so
// that rank order keeps its registers.
template <int kNumRanks, int kNumWarps, int kUnroll, bool kOrdered = false>
__global__ void __launch_bounds__(kNumWarps * 32, 1)
combine(const __grid_constant__ CombineArgs args) {
    constexpr int R = kNumRanks;
    // The pushes keep at least 4 loads a lane in flight, whatever the sums' unroll (2 with more than two
    // ranks, for their registers), which measured faster than 2 at every SM count.
    constexpr int kSendUnroll = kUnroll < 4 ? 4 : kUnroll;
    // The sums load every rank's words of a step before adding any where that fits: 4 ranks x 2 (ptxas spills
    // 96 bytes at 32 warps) measured faster at 12 and 24 SMs than one rank at a time, and level at 8. The copy
    // mode's kernel, with other registers live, keeps one rank at a time above 2 ranks.
    constexpr bool kLoadsFirst = R <= 2 || (R <= 4 && R * kUnroll <= 8);
    const int c = blockIdx.x / 2;
    const bool is_sender = (blockIdx.x % 2) == 0;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    uint8_t* my_base = rank_base(args.bases, args.rank);
    const Ctrl ctrl = ctrl_of(my_base, R);
    const uint64_t seq = begin_kernel(ctrl);
    const WaitCtx wctx{args.err, args.timeout_ns, args.rank};
    if (blockIdx.x == 0) announce_arrival(args.bases, R, args.rank, seq);
    const long long ring_bytes = static_cast<long long>(args.cap) * args.slot_bytes;
    // Runs of B tokens; the receiver needs one lane per (token, rank) of a run.
    const int B = min(clamp_batch(args.publish_batch, args.cap), 32 / R);

    bool reduce = !is_sender;  // sender warps join the reduction once their pushes are done
    if (is_sender) {
        reduce = true;
        if (R > 1) {
            int g, gi, gs;
            split_warps(warp, kNumWarps, R - 1, g, gi, gs);
            const int dst = (args.rank + 1 + g) % R;
            const int dst_begin = dst > 0 ? args.rank_prefix_matrix[(dst - 1) * R + args.rank] : 0;
            const int dst_end = args.rank_prefix_matrix[dst * R + args.rank];
            const int ch_begin = args.recv_channel_prefix_matrix[dst * args.num_channels + c];
            const int ch_end =
                c + 1 < args.num_channels ? args.recv_channel_prefix_matrix[dst * args.num_channels + c + 1] : dst_end - dst_begin;
            const int n = ch_end - ch_begin;
            const long long row_base = dst_begin + ch_begin;
            uint8_t* ring = rank_base(args.bases, dst) + args.ring_offset + static_cast<long long>(c * R + args.rank) * ring_bytes;
            const uint64_t* free_words =
                reinterpret_cast<const uint64_t*>(my_base + args.free_offset) + static_cast<long long>(c * R + dst) * args.cap;

            bool ok = warp_wait(ctrl.arrive(dst), [seq](uint64_t v) { return v >= seq; }, wctx, kOpCombineArrive,
                                dst, __LINE__);
            for (int first = gi * B; ok && first < n; first += gs * B) {
                const int len = min(B, n - first);
                for (int idx = first; idx < first + len; ++idx) {
                    const int slot = idx % args.cap;
                    if (idx >= args.cap) {
                        const uint64_t want = tag(seq, idx);
                        ok = warp_wait(free_words + slot, [want](uint64_t v) { return v == want; }, wctx,
                                       kOpCombineSlot, dst, __LINE__);
                        if (!ok) break;
                    }
                    uint8_t* slot_ptr = ring + static_cast<long long>(slot) * args.slot_bytes;
                    const long long row = row_base + idx;
                    warp_copy_nc<kSendUnroll>(reinterpret_cast<int4*>(slot_ptr + kSlotHeaderBytes), args.x + row * args.hidden_int4,
                                              args.hidden_int4, lane);
                    if (args.topk_weights != nullptr) {
                        float* slot_w = reinterpret_cast<float*>(slot_ptr + args.slot_topk_weights_offset);
                        for (int j = lane; j < args.num_topk; j += 32) slot_w[j] = args.topk_weights[row * args.num_topk + j];
                    }
                }
                if (!ok) break;
                publish_run(ring, args.slot_bytes, args.cap, seq, first, len, lane);
            }
            reduce = ok;
        }
    }
    if (reduce) {
        int t_begin, t_end;
        channel_range(args.num_tokens, args.num_channels, c, t_begin, t_end);
        // Lane l handles rank lr = l % R of token l / R of each run.
        const int lr = lane % R, lk = lane / R;
        const int lr_prev = channel_start(args.channel_prefix_matrix, lr, args.num_channels, c);
        const int lr_count = args.channel_prefix_matrix[lr * args.num_channels + c] - lr_prev;
        const uint8_t* lr_ring = my_base + args.ring_offset + static_cast<long long>(c * R + lr) * ring_bytes;
        const long long own_base = (args.rank > 0 ? args.rank_prefix_matrix[(args.rank - 1) * R + args.rank] : 0) +
                                   args.recv_channel_prefix_matrix[args.rank * args.num_channels + c];

        int* claim = args.run_claims + c;
        int run = 0;
        if (lane == 0) run = atomicAdd(claim, 1);
        run = __shfl_sync(kFullMask, run, 0);
        for (int t0 = t_begin + run * B; t0 < t_end; t0 = t_begin + run * B) {
            const int len = min(B, t_end - t0);
            // The next claim is issued now and read at the end of this run, so its latency is hidden.
            int next = 0;
            if (lane == 0) next = atomicAdd(claim, 1);
            // This lane's (token, rank) of the run: its row index in ring (c, lr), or -1.
            int my_idx = -1;
            const uint64_t* my_flag = nullptr;
            uint64_t my_want = 0;
            if (lk < len) {
                const int head = args.send_head[static_cast<long long>(t0 + lk) * R + lr];
                if (head >= 0) {
                    my_idx = head - lr_prev;
                    if (lr != args.rank) {
                        my_flag = reinterpret_cast<const uint64_t*>(lr_ring +
                                                                    static_cast<long long>(my_idx % args.cap) * args.slot_bytes);
                        my_want = tag(seq, my_idx);
                    }
                }
            }
            if (!warp_wait_lanes(my_flag, my_want, lr, wctx, kOpCombineRecv, __LINE__)) {
                run = __shfl_sync(kFullMask, next, 0);  // the claim is complete before the warp leaves
                break;
            }

            for (int k = 0; k < len; ++k) {
                const int t = t0 + k;
                // Where each rank's row for token t is (nullptr: rank r did not get the token). For peers the
                // row is a ring slot (weights at slot_topk_weights_offset - 16 from it); for this rank, x.
                const int4* rows[R];
                long long own_row = -1;
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const int idx = __shfl_sync(kFullMask, my_idx, k * R + r);
                    rows[r] = nullptr;
                    if (idx >= 0) {
                        if (r == args.rank) {
                            own_row = own_base + idx;
                            rows[r] = args.x + own_row * args.hidden_int4;
                        } else {
                            const uint8_t* slot_ptr = my_base + args.ring_offset +
                                                      static_cast<long long>(c * R + r) * ring_bytes +
                                                      static_cast<long long>(idx % args.cap) * args.slot_bytes;
                            rows[r] = reinterpret_cast<const int4*>(slot_ptr + kSlotHeaderBytes);
                        }
                    }
                }

                if constexpr (!kOrdered) {
                    sum_token<R, kUnroll, false, kLoadsFirst>(rows, args.bias_0, args.bias_1,
                                                              static_cast<long long>(t) * args.hidden_int4,
                                                              args.hidden_int4, args.combined_x, lane);
                } else {
                    const int4* ordered[R];
                    order_by_last_slot<R>(rows, ordered, args.order_topk_idx + static_cast<long long>(t) * args.order_num_topk,
                                          args.order_num_topk, args.num_local_experts);
                    sum_token<R, kUnroll, false, kLoadsFirst>(ordered, args.bias_0, args.bias_1,
                                                              static_cast<long long>(t) * args.hidden_int4,
                                                              args.hidden_int4, args.combined_x, lane);
                }
                if (args.combined_topk_weights != nullptr) {
                    const float* w[R];
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        w[r] = nullptr;
                        if (rows[r] == nullptr) continue;
                        w[r] = r == args.rank ? args.topk_weights + own_row * args.num_topk
                                         : reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(rows[r]) -
                                                                          16 + args.slot_topk_weights_offset);
                    }
                    sum_weights<R>(w, args.rank, args.num_topk, args.combined_topk_weights + static_cast<long long>(t) * args.num_topk,
                                   lane);
                }
            }
            // All reads of the run's slots are done: one fence, then hand back the ones the senders will reuse.
            const bool give_back = my_idx >= 0 && lr != args.rank && my_idx + args.cap < lr_count;
            if (__any_sync(kFullMask, give_back)) {
                __syncwarp();
                fence_acq_rel_sys();
                if (give_back) {
                    uint64_t* peer_free = reinterpret_cast<uint64_t*>(rank_base(args.bases, lr) + args.free_offset) +
                                          static_cast<long long>(c * R + args.rank) * args.cap;
                    st_relaxed_sys(peer_free + (my_idx % args.cap), tag(seq, my_idx + args.cap));
                }
                __syncwarp();
            }
            run = __shfl_sync(kFullMask, next, 0);
        }
    }
    end_kernel(ctrl, seq, args.run_claims, args.num_channels);
}

}  // namespace deepep_cupy::intranode
