// What every backward kernel recomputes per query row: lse in base 2, delta, and P from them.
#pragma once
#include "access_count.cuh"
#include "numeric.cuh"
#include "tile_io.cuh"

namespace attn {

// How a dK/dV kernel writes a block's dK and dV (the launcher's choice by dtype, GQA and
// deterministic mode; the float32 CUDA-core kernel's T is float32: the first two are one).
enum DkdvOut : int {
    kDkdvInputType = 0,   // T, per query head: each is its kv head's (no GQA group to sum)
    kDkdvFloat = 1,       // float32 per query head, each GQA group summed after, in a fixed order
    kDkdvFloatAdded = 2,  // float32 per kv head, which every query head of its group adds to
                          // (reductions into zeros: an order of the adds not fixed)
};

// Row r's statistics of a tile whose first row is `first` (an index into lse and delta) and which
// has rows_left rows inside the sequence, as the backward uses them: lse in base 2 and delta;
// lse2 = +inf for a row past the sequence (delta 0 there) or one that attended to nothing
// (forward lse -inf), so that every probability of such a row is exp2(-inf) = 0 (probability).
__device__ __forceinline__ void row_stats(const float* lse, const float* delta, long long first, int r, int rows_left,
                                          float& lse2, float& row_delta) {
    const bool valid = r < rows_left;
    if (valid) {  // (empty on the GPU)
        ATTN_COUNT_GLOBAL(lse + first + r, 4);
        ATTN_COUNT_GLOBAL(delta + first + r, 4);
    }
    lse2 = valid ? lse[first + r] * kLog2e : -infinity();
    lse2 = lse2 == -infinity() ? infinity() : lse2;  // after the multiply: an lse below -2.4e38 gives -inf too
    row_delta = valid ? delta[first + r] : 0.f;
}

// The per-row statistics the backward needs (row_stats): lse in base 2 (or +inf) and delta, by the
// block's kBlockThreads threads.
template <int kBlockThreads = kThreads>
__device__ __forceinline__ void stage_row_stats(float* s_lse2, float* s_delta, const float* lse, const float* delta,
                                                long long first_row, int m0, int block_m, int rows) {
    for (int r = threadIdx.x; r < block_m; r += kBlockThreads)
        row_stats(lse, delta, first_row + m0, r, rows - m0, s_lse2[r], s_delta[r]);
}

// P = exp2(s·scale - lse2) for a recomputed score s whose base-2 value is s·scale (as
// OnlineSoftmax::update: ScoreTransform::softmax_scale), lse2 from row_stats. A row that attended
// to nothing has lse2 = +inf, so its scores, finite or masked to -inf, all give exp2(-inf) = 0
// (with its forward lse of -inf, a masked score would give exp2(-inf + inf) = NaN): no test per
// score.
__device__ __forceinline__ float probability(float s, float lse2, float scale) {
    return exp2f(fmaf(s, scale, -lse2));
}

}  // namespace attn
