// What the two tensor-core forwards (mma.sync and wgmma) share: both hold S and O in the
// m16n8 accumulator layout (warp w: rows 16w + g and 16w + g + 8, columns 8j + 2t and + 1), so
// the per-tile online softmax, the normalisation of O and the staging of its pairs in shared
// memory are the same code (each kernel stores the staged rows its own way).
#pragma once
#include "access_count.cuh"
#include "block_info.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "numeric.cuh"
#include "softmax.cuh"
#include "tc_tile.cuh"

namespace attn {

// A lane's row in the m16n8 accumulator layout spreads over its quad; the running max lags by up
// to 8 (base 2: OnlineSoftmax's kMaxLag), so that most tiles skip rescaling O (rescale_rows).
// Builds with dropout keep the exact max: P·V there sees P/(1 − p), which with a lagging max
// reaches 2^8/(1 − p), past fp16's 65504 for p > 0.996.
// kSumsProbabilities as OnlineSoftmax's: false where the caller sums P on the tensor cores.
template <bool kSumsProbabilities = true>
using TcSoftmaxOf = OnlineSoftmax<4, kDropoutBuilt ? 0 : 8, kSumsProbabilities>;
using TcSoftmax = TcSoftmaxOf<>;

// This tile's scores (s: kNTiles 8-key column tiles from key n0) -> base-2 units with every feature
// applied (-inf where masked), then probabilities by the online softmax of this lane's two rows
// (row_lo, row_lo + 8), whose columns are spread over the lane's quad; the rows' earlier
// accumulators must then be scaled to the new running max (rescale_rows: a caller whose O is still
// being summed by the tensor cores scales it once they are done, before the next tile's softmax).
// Dropout then zeroes the probabilities P·V sees, after the row sums took them all, by `keeps`
// (Dropout::tile_keeps; the kept ones are scaled once per row, in finish_rows). kRowByRow: one row after the other (a compiler barrier between
// them), for a caller whose registers hold more besides (the wgmma forward's builds with score
// features or mods, whose softmax runs beside the next S and the previous P): with both rows'
// features interleaved (mask loads, softcap's tanh), ptxas ran out of registers there and spilled
// (NVRTC 13.5: 12-28 bytes at D = 128 with a float mask, 24-72 with softcap and a float mask, in
// the key loop), none with the barrier. Elsewhere the rows stay interleaved: with the barrier the
// mma.sync forward's dropout builds issued 0.6-1.2 % more, the wgmma forward's plain boundary tiles
// 0.2-0.4 %. kPolynomialEvery, kBoundaryPolynomialEvery: OnlineSoftmax::update's polynomial_every
// for interior and for boundary tiles, where the MUFU unit bounds the loop (a boundary tile's
// checks can make it issue-bound where an interior tile is not); kPolynomialOf: its polynomial_of
// in interior tiles (boundary tiles take 1).
template <bool kRowByRow = false, int kPolynomialEvery = 0, int kBoundaryPolynomialEvery = 0, int kPolynomialOf = 1,
          int kNTiles, class Softmax>
__device__ __forceinline__ void softmax_scores(float (&s)[kNTiles][4], Softmax (&softmax)[2],
                                               const Params& p, const BlockInfo& b, const ScoreTransform& score,
                                               const Dropout& dropout, const unsigned (&keeps)[kNTiles], int row_lo,
                                               int n0, int t, int checks) {
    auto tile = [&](int tile_checks, int polynomial_every, int polynomial_of) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float row[2 * kNTiles];
#pragma unroll
            for (int c = 0; c < 2 * kNTiles; ++c)
                row[c] = score(p, b, s[c / 2][2 * r + c % 2], Index(row_lo, 8 * r),
                               Index(n0 + 2 * t, (c / 2) * 8 + c % 2), tile_checks);
            softmax[r].update(row, score.softmax_scale(), polynomial_every, polynomial_of);
#pragma unroll
            for (int c = 0; c < 2 * kNTiles; ++c)
                s[c / 2][2 * r + c % 2] = dropout.kept(row[c], keeps[c / 2], 2 * r + c % 2);
            if constexpr (kRowByRow) ptx::compiler_barrier();
        }
    };
    // An interior tile's copy with the checks a constant 0: no test per score. Without it the
    // warp-specialised wgmma forward kept a branch and an index add per score (NVRTC 13.5: 537
    // instructions per tile of 128 keys at D = 64 against 442).
    if (checks) tile(checks, kBoundaryPolynomialEvery, 1);
    else tile(0, kPolynomialEvery, kPolynomialOf);
}

// o's rows (2r, 2r + 1 of each 8-dim tile: row r of the lane) scaled to row r's new running max
// after softmax_scores, unless every row of the warp kept its max (TcSoftmax), as most tiles of a
// long row do. Every lane of the warp together (a vote). The factors are worked out only past
// the vote, so a tile that keeps its max pays no exp2 for them.
template <int kDTiles, class Softmax>
__device__ __forceinline__ void rescale_rows(float (&o)[kDTiles][4], const Softmax (&softmax)[2]) {
    if (!__any_sync(0xffffffffu, softmax[0].max_moved || softmax[1].max_moved)) return;
    const float rescale[2] = {exp2f(softmax[0].max_shift), exp2f(softmax[1].max_shift)};
#pragma unroll
    for (int d = 0; d < kDTiles; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[d][e] *= rescale[e / 2];
}

// softmax_scores (its polynomial_every for interior and boundary tiles, polynomial_of for interior
// ones), with o rescaled at once (for a caller whose O is in registers).
template <int kPolynomialEvery = 0, int kBoundaryPolynomialEvery = 0, int kPolynomialOf = 1, int kNTiles, int kDTiles,
          class Softmax>
__device__ __forceinline__ void softmax_tile(float (&s)[kNTiles][4], float (&o)[kDTiles][4], Softmax (&softmax)[2],
                                             const Params& p, const BlockInfo& b, const ScoreTransform& score,
                                             const Dropout& dropout, const unsigned (&keeps)[kNTiles], int row_lo,
                                             int n0, int t, int checks) {
    softmax_scores<false, kPolynomialEvery, kBoundaryPolynomialEvery, kPolynomialOf>(s, softmax, p, b, score, dropout,
                                                                                    keeps, row_lo, n0, t, checks);
    rescale_rows(o, softmax);
}

// After the last tile: each of this lane's two rows' sums gathered and its attention sink folded
// in; inv[r] is the factor that normalises row r's accumulators (0 for a row that attended
// nothing: its output is 0, not 0/0), and one lane per quad writes the row's lse where the row
// lies inside the sequence. Every lane of the warp together (the sums are shuffles).
template <class Softmax>
__device__ __forceinline__ void finish_rows(const Params& p, const BlockInfo& b, const HeadView& at, float* lse,
                                            Softmax (&softmax)[2], int row_lo, int t, float (&inv)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if constexpr (Softmax::kSums) softmax[r].gather_sum();
        const float sink_rescale = softmax[r].add_sink(sink_log2(p, b));  // before inverse_sum and lse
        // (dropout's 1 / (1 − p) here, once per row, not on each kept probability: Dropout::kept)
        inv[r] = sink_rescale * softmax[r].inverse_sum() * (kDropoutBuilt ? p.dropout_scale : 1.f);
        if (t == 0 && row_lo + 8 * r < b.q_rows(p)) {
            ATTN_COUNT_GLOBAL(&lse[at.stats + row_lo + 8 * r], 4);
            lse[at.stats + row_lo + 8 * r] = softmax[r].lse();
        }
    }
}

}  // namespace attn
