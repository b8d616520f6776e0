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
// arithmetic, which the emulator runs as is: ptxas makes each product's two halves one
// IMAD.WIDE.U32, and the xors two LOP3 per round. Unrolled: a rolled loop's counter and branch
// took a third of each round, and the SASS audit, which walks a nested loop's body once, saw one
// round of ten. Written as a 64-bit product and its halves, the same rounds took 20 % more
// instructions (NVRTC 13.5: VIADDs of the high word).
// kUnroll: rounds per iteration, 1 for the CUDA-core kernels' call per score (unrolled there,
// the fp32 forward at D = 32 took a 128-byte stack frame on sm_80).
template <int kUnroll = 10>
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned key0, unsigned key1) {
#pragma unroll kUnroll
    for (int round = 0; round < 10; ++round) {
        if (round) {  // the key schedule: Weyl increments before every round but the first
            key0 += 0x9E3779B9u;
            key1 += 0xBB67AE85u;
        }
        const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
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
    // dropped (1 without dropout). One Philox call per score: for the CUDA-core kernels, whose
    // lanes hold no group of 4 keys together; the tensor-core kernels share calls (*_keeps).
    __device__ __forceinline__ float factor(int i, int j) const {
        if (!kDropoutBuilt) return 1.f;
        const uint4 words = group_words<1>(i, j);
        const int lane = j & 3;
        const unsigned word = lane == 0 ? words.x : lane == 1 ? words.y : lane == 2 ? words.z : words.w;
        return word >= threshold ? scale : 0.f;
    }

    // The factor of the decision in bit `bit` of a *_keeps result.
    __device__ __forceinline__ float factor_of(unsigned keeps, int bit) const {
        if (!kDropoutBuilt) return 1.f;
        return keeps >> bit & 1u ? scale : 0.f;
    }

    // x if the decision in bit `bit` keeps it, else 0: factor_of without the scale, for a caller
    // that applies 1 / (1 − p) once per row (the forwards' P, whose O is normalised at the end:
    // finish_rows), a select per score rather than a select and a multiply.
    __device__ __forceinline__ float kept(float x, unsigned keeps, int bit) const {
        if (!kDropoutBuilt) return x;
        return keeps >> bit & 1u ? x : 0.f;
    }

    // The keep decisions of a lane's four scores of an m16n8 accumulator fragment, bit 2r + c for
    // query row i + 8r and key j + c, where j = n + 2t (t = lane % 4, n a multiple of 8). One call
    // covers 4 keys of one row, and lanes t and t ^ 1 hold the same 4 keys of the same two rows:
    // each makes the call of one row (lane t of row i + 8·(t & 1)) and the two swap the other
    // row's halves, one Philox call per 4 scores where a call per score made 4 (each ~60
    // instructions; the fragments of S in the forward and in the dQ kernel). Every lane of the
    // warp takes part.
    __device__ __forceinline__ unsigned fragment_keeps(int i, int j) const {
        if (!kDropoutBuilt) return 0xfu;
        const int odd = j >> 1 & 1;  // t & 1: keys 2 and 3 of the group of 4
        const unsigned own = keep_bits(i + 8 * odd, j);
        const unsigned other = __shfl_xor_sync(0xffffffffu, own, 1);
        const unsigned own_pair = own >> (j & 3) & 3u, other_pair = other >> (j & 3) & 3u;
        return odd ? other_pair | own_pair << 2 : own_pair | other_pair << 2;
    }

    // The keep decisions of a lane's four scores of a transposed fragment (Sᵀ: keys on its rows),
    // bit e for query row i + (e & 1) and key j + 8·(e / 2), where j = n + g (g = lane / 4, n a
    // multiple of 16): lanes g, g ^ 1, g ^ 2, g ^ 3 (lane ^ 4, ^ 8, ^ 12) hold the 4 keys of the
    // same groups for the same rows, and the 4 calls they need are one each: lane g makes
    // element e = g & 3's (all 4 of its keys), and each gathers its key's bit of the other 3.
    // One call per 4 scores (the dK/dV kernels' Sᵀ). Every lane of the warp takes part. Bits 4 and
    // up are 0, from shuffled words the compiler cannot know: a caller that adds them to its next
    // call's row makes that call wait for this one (transposed_tile_keeps).
    __device__ __forceinline__ unsigned transposed_fragment_keeps(int i, int j) const {
        if (!kDropoutBuilt) return 0xfu;
        const int u = j & 3;
        const unsigned own = keep_bits(i + (u & 1), (j & ~3) + 8 * (u >> 1));
        // element e's 4 bits at bits 4e..4e + 3, from lane g ^ u ^ e
        unsigned nibbles = own << 4 * u;
#pragma unroll
        for (int r = 1; r < 4; ++r) nibbles |= __shfl_xor_sync(0xffffffffu, own, 4 * r) << 4 * (u ^ r);
        unsigned keeps = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) keeps |= (nibbles >> (4 * e + u) & 1u) << e;
        return keeps | nibbles >> 16 << 4;  // (nibbles' bits 16 and up are 0)
    }

    // The decisions for a lane's scores of a tile of S from key n0 (rows row_lo and row_lo + 8,
    // kNTiles 8-key column tiles): keeps[n] as fragment_keeps for keys n0 + 8n + 2t. They depend
    // on no score, so the forwards and the dQ kernel work them out before the tile's S product,
    // the Philox rounds' integer work beside the tensor cores' (NVRTC 13.5, dropout builds' paths
    // per tile: the mma.sync forward at D = 64 on sm_80 1659 instructions against 1861 with them
    // taken after the softmax, where at D = 32 on sm_90 ptxas spilled 12 bytes; the wgmma forward
    // at D = 64 824 against 860).
    template <int kNTiles>
    __device__ __forceinline__ void tile_keeps(unsigned (&keeps)[kNTiles], int row_lo, int n0, int t) const {
#pragma unroll
        for (int n = 0; n < kNTiles; ++n) keeps[n] = fragment_keeps(row_lo, n0 + 8 * n + 2 * t);
    }

    // The decisions for a lane's scores of a tile of Sᵀ (keys key and key + 8, rows m0 + 8j + 2t
    // and + 1, kQTiles 8-row tiles): keeps[j] as transposed_fragment_keeps. The calls one after the
    // other, each row offset by the previous call's zero bits: unrolled Philox calls side by side
    // held more registers than the dK/dV kernels have beside Sᵀ, dPᵀ, dK and dV (NVRTC 13.5: the
    // wgmma one at D = 64 with ALiBi, a float mask and dropout spilled 40 bytes without the chain,
    // none with it; with the calls inside each_probability's loop over j, the mma.sync one at
    // D = 64 with a bool mask and dropout spilled 16).
    template <int kQTiles>
    __device__ __forceinline__ void transposed_tile_keeps(unsigned (&keeps)[kQTiles], int m0, int key, int t) const {
        unsigned zero = 0;
#pragma unroll
        for (int j = 0; j < kQTiles; ++j) {
            const unsigned bits = transposed_fragment_keeps(m0 + j * 8 + 2 * t + zero, key);
            keeps[j] = bits & 0xfu;
            zero = bits >> 4;
        }
    }

  private:
    // The 4 words of query row i and keys 4·(j / 4) … + 3: the counter of the header's layout.
    template <int kUnroll>
    __device__ __forceinline__ uint4 group_words(int i, int j) const {
        return philox4x32_10<kUnroll>(make_uint4(static_cast<unsigned>(j) >> 2, i, head, offset), key0, key1);
    }

    // Bit k set iff key 4·(j / 4) + k of query row i is kept.
    __device__ __forceinline__ unsigned keep_bits(int i, int j) const {
        const uint4 words = group_words<10>(i, j);
        return unsigned(words.x >= threshold) | unsigned(words.y >= threshold) << 1 |
               unsigned(words.z >= threshold) << 2 | unsigned(words.w >= threshold) << 3;
    }
};

}  // namespace attn
