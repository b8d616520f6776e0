// What the two tensor-core forwards (mma.sync and wgmma) share: both hold S and O in the
// m16n8 accumulator layout (warp w: rows 16w + g and 16w + g + 8, columns 8j + 2t and + 1), so
// the per-tile online softmax and the epilogue are the same code.
#pragma once
#include "access_count.cuh"
#include "block_info.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "numeric.cuh"
#include "softmax.cuh"
#include "tc_tile.cuh"

namespace attn {

// This tile's scores (s: kNTiles 8-key column tiles from key n0) -> base-2 units with every
// feature applied (-inf where masked), then probabilities by the online softmax of this lane's
// two rows (row_lo, row_lo + 8), whose columns are spread over the lane's quad; o is rescaled
// to the new running max. Dropout then zeroes (or scales) the probabilities P·V sees, after the
// row sums took them all.
template <int kNTiles, int kDTiles>
__device__ __forceinline__ void softmax_tile(float (&s)[kNTiles][4], float (&o)[kDTiles][4], OnlineSoftmax<4> (&softmax)[2],
                                             const Params& p, const BlockInfo& b, const ScoreTransform& score,
                                             const Dropout& dropout, int row_lo, int n0, int t, int checks) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float row[2 * kNTiles];
#pragma unroll
        for (int c = 0; c < 2 * kNTiles; ++c)
            row[c] = score(p, b, s[c / 2][2 * r + c % 2], row_lo + 8 * r, n0 + (c / 2) * 8 + 2 * t + c % 2, checks);
        const float rescale = softmax[r].update(row, score.softmax_scale());
#pragma unroll
        for (int c = 0; c < 2 * kNTiles; ++c)
            s[c / 2][2 * r + c % 2] = row[c] * dropout.factor(row_lo + 8 * r, n0 + (c / 2) * 8 + 2 * t + c % 2);
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
            o[d][2 * r] *= rescale;
            o[d][2 * r + 1] *= rescale;
        }
    }
}

// Normalise once and write this lane's two rows of O (and, from one lane per quad, their lse);
// rows that attended nothing (row_sum 0) give 0, not 0/0. Every row inside the sequence is
// written. The lane's two adjacent dims of each 8-dim tile go out as one 4-byte store where out's
// rows allow it (4-byte aligned) and both dims exist, element by element otherwise.
template <class T, int kDTiles>
__device__ __forceinline__ void store_rows(const Params& p, const BlockInfo& b, const HeadView& at, T* out,
                                           float* lse, const float (&o)[kDTiles][4],
                                           OnlineSoftmax<4> (&softmax)[2], int row_lo, int t) {
    const bool pairs = reinterpret_cast<unsigned long long>(out + at.o) % 4 == 0 && at.o_row % 2 == 0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = row_lo + 8 * r;
        softmax[r].gather_sum();  // every lane: the shuffles need the whole warp
        if (i >= b.q_rows(p)) continue;
        const float sink_rescale = softmax[r].add_sink(sink_log2(p, b));  // before inverse_sum and lse
        const float inv = sink_rescale * softmax[r].inverse_sum();
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
            const int col = d * 8 + 2 * t;
            T* dst = out + at.o + i * at.o_row + col;
            if (pairs && col + 1 < p.head_dim_v) {
                ATTN_COUNT_GLOBAL(dst, 4);
                *reinterpret_cast<unsigned*>(dst) = pack_pair<T>(o[d][2 * r] * inv, o[d][2 * r + 1] * inv);
                continue;
            }
            if (col < p.head_dim_v) {
                ATTN_COUNT_GLOBAL(dst, sizeof(T));
                dst[0] = from_float<T>(o[d][2 * r] * inv);
            }
            if (col + 1 < p.head_dim_v) {
                ATTN_COUNT_GLOBAL(dst + 1, sizeof(T));
                dst[1] = from_float<T>(o[d][2 * r + 1] * inv);
            }
        }
        if (t == 0) lse[at.stats + i] = softmax[r].lse();
    }
}

}  // namespace attn
