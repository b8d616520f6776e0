// Dropout on the attention probabilities, reproducible bit for bit by every backend.
//
// Element (b, h, i, j) (h the query head; i, j positions in the padded problem) is kept iff
//   Philox4x32-10(counter = (j / 4, i, b·H + h, offset), key = (seed lo, seed hi))[j % 4] >= threshold,
// threshold = ⌊p · 2³²⌋, and a kept probability is scaled by 1 / (1 − p): cupy_attn/_philox.py
// (the NumPy backend and `dropout_mask`) computes the same. As FlashAttention, dropout applies to
// P after the softmax: the row sums and lse are those of every key, and the backward regenerates
// each decision from the same counter.
#pragma once
#include "block_info.cuh"
#include "mask.cuh"

namespace attn {

// Philox4x32-10 (Salmon et al., SC'11; Random123's philox4x32 with 10 rounds). Plain integer
// arithmetic: nvcc turns the 64-bit products into mul.wide/mul.hi, and the emulator runs it as is.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned key0, unsigned key1) {
#pragma unroll 1
    for (int round = 0; round < 10; ++round) {
        if (round) {  // the key schedule: Weyl increments before every round but the first
            key0 += 0x9E3779B9u;
            key1 += 0xBB67AE85u;
        }
        const unsigned long long p0 = 0xD2511F53ull * c.x, p1 = 0xCD9E8D57ull * c.z;
        const unsigned hi0 = static_cast<unsigned>(p0 >> 32), lo0 = static_cast<unsigned>(p0);
        const unsigned hi1 = static_cast<unsigned>(p1 >> 32), lo1 = static_cast<unsigned>(p1);
        c = make_uint4(hi1 ^ c.y ^ key0, lo1, hi0 ^ c.w ^ key1, lo0);
    }
    return c;
}

// The dropout of one (batch entry, query head). Modules built without dropout (the launcher's
// choice per call, -DATTN_SCORE_FEATURES) compile factor() to the constant 1.
struct Dropout {
    unsigned key0, key1, offset, head, threshold;
    float scale;  // 1 / (1 − p)

    __device__ __forceinline__ Dropout(const Params& p, const BlockInfo& b)
        : key0(static_cast<unsigned>(p.dropout_seed)), key1(static_cast<unsigned>(p.dropout_seed >> 32)),
          offset(p.dropout_offset), head(static_cast<unsigned>(b.bidb) * p.heads + b.bidh),
          threshold(p.dropout_threshold), scale(p.dropout_scale) {}

    // What the probability of query row i and key j is multiplied by: 1 / (1 − p) if kept, 0 if
    // dropped (1 without dropout). A lane holding keys j and j + 1 of one group of 4 makes the same
    // Philox call for each (the rounds are a rolled loop, which the compiler does not merge):
    // sharing it is left for a GPU measurement to justify.
    __device__ __forceinline__ float factor(int i, int j) const {
        if (!kDropoutBuilt) return 1.f;
        const uint4 words = philox4x32_10(make_uint4(static_cast<unsigned>(j) >> 2, i, head, offset), key0, key1);
        const int lane = j & 3;
        const unsigned word = lane == 0 ? words.x : lane == 1 ? words.y : lane == 2 ? words.z : words.w;
        return word >= threshold ? scale : 0.f;
    }
};

}  // namespace attn
