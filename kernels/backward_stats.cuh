// What every backward kernel recomputes per query row: lse in base 2, delta, and P from them.
#pragma once
#include "access_count.cuh"
#include "numeric.cuh"
#include "tile_io.cuh"

namespace attn {

// Row `row`'s statistics as the backward uses them: lse in base 2 and delta, or -inf and 0 for a
// row past the sequence (its probabilities are then 0).
__device__ __forceinline__ void row_stats(const float* lse, const float* delta, long long first_row, int row, int rows,
                                          float& lse2, float& row_delta) {
    const bool valid = row < rows;
    if (valid) {  // (empty on the GPU)
        ATTN_COUNT_GLOBAL(lse + first_row + row, 4);
        ATTN_COUNT_GLOBAL(delta + first_row + row, 4);
    }
    lse2 = valid ? lse[first_row + row] * kLog2e : -infinity();
    row_delta = valid ? delta[first_row + row] : 0.f;
}

// The per-row statistics the backward needs: lse in base 2 (or -inf) and delta.
__device__ __forceinline__ void stage_row_stats(float* s_lse2, float* s_delta, const float* lse, const float* delta,
                                                long long first_row, int m0, int block_m, int rows) {
    for (int r = threadIdx.x; r < block_m; r += kThreads) row_stats(lse, delta, first_row, m0 + r, rows, s_lse2[r], s_delta[r]);
}

// P = exp2(s·scale - lse2) for a recomputed score s whose base-2 value is s·scale (as
// OnlineSoftmax::update: ScoreTransform::softmax_scale). A fully masked row has lse -inf and only
// -inf scores: its P is 0 (not exp2(-inf - -inf) = NaN).
__device__ __forceinline__ float probability(float s, float lse2, float scale) {
    return lse2 == -infinity() ? 0.f : exp2f(fmaf(s, scale, -lse2));
}

}  // namespace attn
