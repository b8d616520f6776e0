// Online softmax over key tiles, in base 2, for a row whose columns are spread over kLanes
// consecutive lanes of a warp (row statistics need only shuffles within those lanes).
#pragma once
#include "numeric.cuh"

namespace attn {

template <int kLanes>
__device__ __forceinline__ float row_reduce_max(float x) {
    for (int offset = kLanes / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

template <int kLanes>
__device__ __forceinline__ float row_reduce_sum(float x) {
    for (int offset = kLanes / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// kMaxLag: how far (base 2) the running max may lag a row's true max, FlashAttention-4's
// conditional rescaling. The running max moves only when a tile's max exceeds it by more than
// kMaxLag, so probabilities reach 2^kMaxLag at most (kMaxLag = 8: no overflow in the float32
// sums and accumulators, nor in 16-bit P unless a caller scales P up, as dropout does) and the
// result is exact either way (sum and accumulators share the reference). Over a long row the max
// soon settles and most tiles leave the accumulators unscaled, which pays where a caller then
// skips scaling them (the tensor-core forwards' rescale_rows); 0 keeps the exact running max.
// kSumsProbabilities: whether update adds up the probabilities. Without, the caller sums them
// itself (the mma.sync forward, and the wgmma forward at D = 64: on the tensor cores, as P·1
// beside P·V) and sets row_sum to the whole row's sum after the last tile, in place of
// gather_sum.
template <int kLanes, int kMaxLag = 0, bool kSumsProbabilities = true>
struct OnlineSoftmax {
    static constexpr bool kSums = kSumsProbabilities;
    // Running max of the base-2 scores seen so far (the whole row's), from the lowest float
    // rather than -inf: a row that has seen only masked keys (-inf) then shifts by a finite
    // amount, exp2(-inf - lowest) = 0, with no test per tile against exp2(-inf - -inf) = NaN,
    // and its rescale factor is exp2(0) = 1, so that a warp holding such rows (past the
    // sequence) may skip rescaling its O. A finite score never stays below it (x > lowest + lag
    // for every float above lowest), so every real max is as before.
    float row_max = -kFloatMax;
    // Running sum of exp2(score - row_max): over this lane's columns only until gather_sum, then
    // over the row. Every lane rescales its share by the same factor, so the shuffles that add
    // the shares are paid once per row, not once per tile (as FlashAttention-2 does).
    float row_sum = 0.f;
    // The last update's move of the running max: whether it moved, and the old max minus the
    // new (0 where it did not), whose exp2 is the factor update returned. A caller that skips
    // scaling where the max stayed (rescale_rows) tests max_moved and works the factor out only
    // where it scales.
    bool max_moved = false;
    float max_shift = 0.f;

    // Add up the row's lanes' shares of the sum, after the last tile and before add_sink,
    // inverse_sum or lse. Every lane of the warp together (a shuffle), rows inside the sequence
    // or not.
    __device__ __forceinline__ void gather_sum() { row_sum = row_reduce_sum<kLanes>(row_sum); }

    // Fold an attention sink into the gathered row: a base-2 logit that joins the denominator
    // with no value attached (gpt-oss). After the key loop, so the loop carries no trace of it.
    // Returns the factor by which the row's accumulator must be scaled to the new max (1 without
    // a sink, sink2 = -inf). A row that attended nothing (max the lowest float, sum 0) gets
    // max = sink, sum = 1: out 0, lse = sink.
    __device__ __forceinline__ float add_sink(float sink2) {
        if (sink2 == -infinity()) return 1.f;
        const float new_max = fmaxf(row_max, sink2);
        const float rescale = exp2f(row_max - new_max);  // 0 when the row attended nothing
        row_sum = row_sum * rescale + exp2f(sink2 - new_max);
        row_max = new_max;
        return rescale;
    }

    // Turn this lane's kCols scores of the current tile into probabilities (in place) relative
    // to the running max (moved only by more than kMaxLag); return the factor by which earlier
    // accumulators must be scaled, exactly 1 where the max stayed (max_moved and max_shift say
    // the same, for a caller that skips the scaling then: rescale_rows). The base-2 scores are
    // s·scale (scale > 0): a caller whose scores need no more than the scale passes them
    // unscaled and the scale here, where it folds into one FFMA per score, exp2(s·scale − max),
    // as FlashAttention does; others pass base-2 scores and scale 1.
    // polynomial_every, polynomial_of: the exp2 of polynomial_of columns in every polynomial_every
    // (the last ones of each group) by exp2_polynomial on the FMA pipe rather than by the MUFU
    // unit (polynomial_every 0: none), for a caller whose MUFU cycles exceed its tensor cycles:
    // each such column trades one MUFU instruction (8 cycles of its sub-partition's unit) for 9
    // issue slots, and the share balances the two bounds (the SASS audit's mufu_per_tensor and
    // issue_per_tensor). Constants at every call, so that the choice per column folds away.
    template <int kCols>
    __device__ __forceinline__ float update(float (&s)[kCols], float scale = 1.f, int polynomial_every = 0,
                                            int polynomial_of = 1) {
        float tile_max = s[0];  // (not from -inf: fmaxf(-inf, x) is kept, as it is not x for NaN)
        for (int c = 1; c < kCols; ++c) tile_max = fmaxf(tile_max, s[c]);
        tile_max = row_reduce_max<kLanes>(tile_max) * scale;
        max_moved = tile_max > row_max + kMaxLag;
        const float new_max = max_moved ? tile_max : row_max;
        for (int c = 0; c < kCols; ++c) {
            const float x = fmaf(s[c], scale, -new_max);
            s[c] = polynomial_every && c % polynomial_every >= polynomial_every - polynomial_of ? exp2_polynomial(x)
                                                                                                : exp2f(x);
        }
        // The factor is 1 where the max stayed (also for a row that has seen only masked keys
        // so far), else the factor from the old max to the new: exp2(0), not 1 selected outright,
        // which spilled 40 bytes in the mma.sync forward at D = 64 with mods on sm_80 (NVRTC
        // 13.5) when that kernel took the factor from here.
        max_shift = row_max - new_max;
        const float rescale = exp2f(max_shift);
        if constexpr (kSumsProbabilities) {
            // The sum starts from the first probability: from 0.f it would cost an add (0 + x
            // is not x for x = -0, so the compiler keeps it).
            float tile_sum = s[0];
            for (int c = 1; c < kCols; ++c) tile_sum += s[c];
            row_sum = row_sum * rescale + tile_sum;
        }
        row_max = new_max;
        return rescale;
    }

    // After gather_sum: 1 / row_sum, or 0 for a row that attended nothing (its output is 0, never
    // 0/0 = NaN). A live row's sum is at least 1 (its max's own term), so only such a row's is 0;
    // a NaN sum (NaN or inf in the row's inputs) is no empty row: it stays NaN, as below.
    __device__ __forceinline__ float inverse_sum() const { return row_sum == 0.f ? 0.f : 1.f / row_sum; }

    // After gather_sum: the natural-log logsumexp of the row's scores; -inf for a row that
    // attended nothing, NaN for a NaN sum: -inf would mark the row empty, and a merge of split
    // rows (the combine kernel, merge_attention) would drop it, NaN and all.
    __device__ __forceinline__ float lse() const {
        return row_sum == 0.f ? -infinity() : (row_max + log2f(row_sum)) * kLn2;
    }
};

}  // namespace attn
