// What every backward kernel recomputes per query row: lse in base 2, delta, and P from them.
#pragma once
#include "numeric.cuh"
#include "tile_io.cuh"

namespace attn {

// The per-row statistics the backward needs: lse in base 2 (or -inf) and delta.
__device__ __forceinline__ void stage_row_stats(float* s_lse2, float* s_delta, const float* lse, const float* delta,
                                                long long first_row, int m0, int block_m, int rows) {
    for (int r = threadIdx.x; r < block_m; r += kThreads) {
        bool valid = m0 + r < rows;
        s_lse2[r] = valid ? lse[first_row + m0 + r] * kLog2e : -infinity();
        s_delta[r] = valid ? delta[first_row + m0 + r] : 0.f;
    }
}

// P = exp2(s·scale - lse2) for a recomputed score s whose base-2 value is s·scale (as
// OnlineSoftmax::update: ScoreTransform::softmax_scale). A fully masked row has lse -inf and only
// -inf scores: its P is 0 (not exp2(-inf - -inf) = NaN).
__device__ __forceinline__ float probability(float s, float lse2, float scale) {
    return lse2 == -infinity() ? 0.f : exp2f(fmaf(s, scale, -lse2));
}

}  // namespace attn
