// Low-latency combine with per-rank partial sums: where every rank is reached by stores and a token
// picks several experts of one rank (top-8 of 288 on 2 ranks: ~4), the expert side reduces the rows of
// a token that its own experts produced, in float32, and sends one float32 row per (token, rank)
// instead of one BF16 row per (token, expert): ~2x fewer bytes over the link, and the owner adds R
// rows instead of K. The owner's sum is the same on every path (see the reference): per rank in rank
// order, acc = acc + part, each part an fma chain over that rank's top-k entries in top-k order.
// LogFMT: the part is rounded to BF16 and travels as LogFMT-10 (logfmt.cuh), which the owner decodes and
// rounds to BF16 before adding: one LogFMT row per (token, rank) as well, so never more bytes than the
// per-expert LogFMT rows, and R decodes per value instead of K (the decode is what bounds the owner).
//
// The weights live on the owner, so the send phase first publishes them: every rank writes, into the
// receive region of every live destination d, one route per (token, top-k entry) of its own tokens: two
// 8-byte words, each with the launch's full 32-bit sequence number in its low half, and in its high half
// the local expert on d + 1 (0 when the entry has no expert on d), then the float32 weight. One 8-byte
// store is single-copy atomic, so a route whose two words carry the launch's sequence number is complete
// and needs no fence or flag. The receive region may hold any bytes of an earlier op on this half (a
// dispatch's rows): a stale word passes for a new one only if its 32 low bits equal the sequence number,
// and a route needs two. Routes are written for all T token slots (none past the owner's token count),
// so a reader never waits for a token the owner does not have.
//
// The expert side's send is combine_partials_send.cuh, the owner's reduction combine_partials_recv.cuh;
// this header holds what both read: the wire format and how the send splits its items over the grid.
//
// The receive region of a half holds the rows [R][T] (float32 [H], or H / 128 LogFMT blocks), then
// the routes [R][T][K] of 16 bytes (LowLatencyBufferMap.partials_fit checks that both fit).
#pragma once

#include "low_latency/buffer_map.cuh"

namespace deepep_cupy::low_latency {

// Bytes of one partial row on the wire: float32, or LogFMT-10 blocks of the BF16-rounded sum padded to 16
// bytes (the encoder's 16-byte stores; 17 blocks are 2856 bytes).
template <int kHidden, bool kLogfmt>
constexpr size_t kPartialRowBytes =
    kLogfmt ? (static_cast<size_t>(kHidden / kChannelsPerBlock) * kLogfmtBlockBytes + 15) / 16 * 16
            : static_cast<size_t>(kHidden) * 4;

// Routes [R][T][K], two words each, after the rows.
__device__ __forceinline__ uint64_t* partial_routes(uint8_t* recv, int num_ranks, int max_tokens, size_t row_bytes) {
    return reinterpret_cast<uint64_t*>(recv + static_cast<size_t>(num_ranks) * max_tokens * row_bytes);
}

__device__ __forceinline__ uint64_t route_word(uint32_t seq, uint32_t high) {
    return (static_cast<uint64_t>(high) << 32) | seq;
}

// How the send splits its items (token, source, segment) over the grid: every warp a contiguous range of
// per_warp items, every block kBlockWarps such ranges. The owner uses the same split to learn which of a
// source's blocks wrote its rows, so every rank must run the same grid (each block's completion word
// carries the grid size, and an owner waiting for another one times out instead of reading early).
// Item counts fit 32 bits: R * T <= 2^16 (LowLatencyBufferMap.partials_fit) and kSegs is small.
template <int kHidden, int kThreads>
struct PartialItems {
    static constexpr int kSeg = 256;  // channels per item: 16 bytes of BF16 in per lane; one LogFMT wire segment
    static constexpr int kSegs = (kHidden + kSeg - 1) / kSeg;
    int total, per_warp;
    __device__ __forceinline__ PartialItems(int num_ranks, int max_tokens)
        : total(num_ranks * max_tokens * kSegs),
          per_warp((total + static_cast<int>(gridDim.x) * (kThreads / 32) - 1) /
                   (static_cast<int>(gridDim.x) * (kThreads / 32))) {}
    // The block of the grid that sends `item`.
    __device__ __forceinline__ int block_of(int item) const { return item / (per_warp * (kThreads / 32)); }
};

}  // namespace deepep_cupy::low_latency
