// Scores in base-2 units, with every feature applied element by element:
//   s = q·k·scale;  softcap c: s = c·tanh(s / c);  s -= slope·|i + off - j|;  s += float mask;
//   -inf where the bool mask, causal, window or lengths remove the key.
#pragma once
#include "access_count.cuh"
#include "block_info.cuh"
#include "numeric.cuh"

namespace attn {

// The score features a module is compiled with (-DATTN_SCORE_FEATURES, chosen per call by the
// launcher: exactly those the call uses). A loop carries no trace of a feature its call lacks and
// no run-time test of one it has; a module asked to compute with other features than its own
// traps rather than ignore one or read arrays that were not passed. The mask's kind is part of
// the build: a bool mask is a byte load and a select per score, a float mask a float load and an
// add. (Attention sinks are not a build feature: a forward reads its row's sink once, after the
// key loop.)
enum : int { kFeatureSoftcap = 1, kFeatureAlibi = 2, kFeatureBoolMask = 4, kFeatureFloatMask = 8, kFeatureDropout = 16 };
#ifndef ATTN_SCORE_FEATURES
#define ATTN_SCORE_FEATURES 0
#endif
constexpr int kScoreFeatures = ATTN_SCORE_FEATURES;
static_assert((kScoreFeatures & ~31) == 0 && (~kScoreFeatures & (kFeatureBoolMask | kFeatureFloatMask)),
              "ATTN_SCORE_FEATURES: unknown bits, or both mask kinds");
constexpr bool kSoftcapBuilt = kScoreFeatures & kFeatureSoftcap, kAlibiBuilt = kScoreFeatures & kFeatureAlibi,
               kDropoutBuilt = kScoreFeatures & kFeatureDropout;
constexpr int kMaskBuilt = kScoreFeatures & kFeatureBoolMask    ? kMaskBool
                           : kScoreFeatures & kFeatureFloatMask ? kMaskFloat
                                                                : kMaskNone;

// This head's attention sink in base 2, or -inf (none), which each forward row folds into its
// softmax after the key loop (OnlineSoftmax::add_sink). Only the forwards read it (the
// backward's lse already holds the sink).
__device__ __forceinline__ float sink_log2(const Params& p, const BlockInfo& b) {
    return p.has_sinks ? p.sinks[b.bidh] * kLog2e : -infinity();
}

// Programmable attention (cupy_attn.mods): a module built for a call with score_mod or mask_mod
// (-DATTN_MODS=1 and ATTN_SCORE_MOD / ATTN_MASK_MOD) has the user's C expressions appended to its
// source as these functions (cupy_attn/_mods_source.py); mod_words holds their tensors' addresses
// and strides and their scalars. Other modules carry no trace of them.
#ifndef ATTN_SCORE_MOD
#define ATTN_SCORE_MOD 0
#endif
#ifndef ATTN_MASK_MOD
#define ATTN_MASK_MOD 0
#endif
#if ATTN_MODS
namespace mods {
__device__ __forceinline__ float score_mod(float score, int b, int h, int q_idx, int kv_idx, const long long* words);
__device__ __forceinline__ float score_mod_grad(float score, int b, int h, int q_idx, int kv_idx, const long long* words);
__device__ __forceinline__ bool mask_mod(int b, int h, int q_idx, int kv_idx, const long long* words);
}  // namespace mods
#endif

// (1 - tanh x) / 2 = 1 / (2^x2 + 1) for x2 = 2x · log2 e: the softcap's tanh as one exp2 and one
// reciprocal on the MUFU unit, which tanhf issues too, without its ~10 other instructions per
// score (the wgmma forward's build with softcap, ALiBi and a float mask at D = 128: 1014 → 628 per
// tile of 64 keys, NVRTC 13.5). The result is within about 2^-22 of (1 - tanh x) / 2 (2 ulp of
// the exp2, 1 of the reciprocal, of values at most 1), so the softcap's c · tanh is within
// c · 2^-21 absolutely, tanhf's within c · 2^-22. x2 = +inf gives 0 (tanh 1), -inf gives 1 (-1).
__device__ __forceinline__ float half_one_minus_tanh(float x2) { return __fdividef(1.f, exp2f(x2) + 1.f); }

// The mask's element at `at` where the structure keeps the pair (inside), else `outside`: outside
// it the element need not exist (a key past the sequence's end, a padding row). Counted in the
// emulator, where a counted access outside every array argument fails the launch.
template <class Element>
__device__ __forceinline__ Element mask_value(const Params& p, long long at, bool inside, Element outside) {
    if (!inside) return outside;
    const Element* element = static_cast<const Element*>(p.mask) + at;
    ATTN_COUNT_GLOBAL(element, sizeof(Element));
    return *element;
}

// A query or key index as a run-time base plus an offset that is a constant where the caller's
// loop is unrolled (a lane's columns of a tile: n0 + 2t plus 8·(c / 2) + c % 2), so that ALiBi's
// distance converts the bases' difference once per tile (the same expression for every score)
// and adds the offsets' difference as a literal, where float(i − j) took a conversion per score
// (I2FP on sm_90). Both are exact for distances below 2^24. NVRTC 13.5, the wgmma forward at
// D = 64 with ALiBi: 311 instructions per tile of 64 keys against 328, 12 I2FP in the kernel
// against 232. It converts to the index itself everywhere else.
struct Index {
    int base, offset;
    __device__ __forceinline__ Index(int index) : base(index), offset(0) {}
    __device__ __forceinline__ Index(int base_, int offset_) : base(base_), offset(offset_) {}
    __device__ __forceinline__ operator int() const { return base + offset; }
};

struct ScoreTransform {
    float scale_log2;      // scale · log2 e (no softcap)
    // A build whose scores need nothing but the scale (no softcap, ALiBi, mask or mods) returns
    // them unscaled; the softmax applies the scale in its FFMA. (Dropout and sinks act on what follows.)
    static constexpr bool kDeferScale = !kSoftcapBuilt && !kAlibiBuilt && kMaskBuilt == kMaskNone && !ATTN_MODS;
    // A build with no feature at all: the one whose registers the tile table's min_blocks is for.
    static constexpr bool kPlain = kScoreFeatures == 0 && !ATTN_MODS;
    float tanh_scale;      // 2 · log2 e · scale / c: half_one_minus_tanh's argument per q·k
    float cap_log2;        // c · log2 e
    float slope_log2;      // ALiBi slope of this (batch, head) · log2 e
    // kSoftcapBuilt, held as a member: read from the constant where it is used, the same code
    // compiled worse (measured 2026-12-01: the CUDA-core dQ at D = 64, attention_bwd_dq<float, 64,
    // 64, 64, 2>, plain on sm_90, took 72 registers and spilled 28 bytes, against 94 and none).
    bool softcap;

    __device__ __forceinline__ ScoreTransform(const Params& p, const BlockInfo& b) {
        if (kSoftcapBuilt != (p.softcap > 0.f) || kAlibiBuilt != (p.has_alibi != 0) || kMaskBuilt != p.mask_kind ||
            kDropoutBuilt != (p.dropout_threshold > 0))
            __trap();
        softcap = kSoftcapBuilt;
        scale_log2 = p.scale * kLog2e;
        tanh_scale = kSoftcapBuilt ? 2.f * kLog2e * p.scale / p.softcap : 0.f;
        cap_log2 = p.softcap * kLog2e;
        slope_log2 = kAlibiBuilt ? p.alibi_slopes[b.bidb * p.heads + b.bidh] * kLog2e : 0.f;
    }

    // The base-2 score of q·k = qk for query row i and key j with softcap and ALiBi applied: what
    // a score_mod modifies.
    __device__ __forceinline__ float capped(const Params& p, const BlockInfo& b, float qk, Index i, Index j) const {
        float s = softcap ? fmaf(-2.f * cap_log2, half_one_minus_tanh(qk * tanh_scale), cap_log2)
                  : kDeferScale ? qk
                                : qk * scale_log2;
        if (kAlibiBuilt)
            s -= slope_log2 * fabsf(static_cast<float>(i.base + b.diag_offset - j.base) +
                                    static_cast<float>(i.offset - j.offset));
        return s;
    }

    // d(final score)/d(q·k·scale) at row i, key j: 1 - tanh² through the softcap (1 without), times
    // the score_mod's derivative where there is one. That derivative is evaluated only where the
    // probability prob is nonzero: elsewhere (padding rows and keys, masked pairs) the element
    // does not count, and the mod's tensors need not be defined at (i, j).
    __device__ __forceinline__ float grad(const Params& p, const BlockInfo& b, float qk, int i, int j, float prob) const {
        float g = 1.f;
        if (softcap) {  // tanh from the h capped() takes, which the compiler computes once for both
            const float t = fmaf(-2.f, half_one_minus_tanh(qk * tanh_scale), 1.f);
            g = 1.f - t * t;
        }
#if ATTN_SCORE_MOD
        if (prob != 0.f) g *= mods::score_mod_grad(capped(p, b, qk, i, j) * kLn2, b.bidb, b.bidh, i, j, p.mod_words);
#endif
        return g;
    }

    // What the scores operator() returns are multiplied by to be base-2 scores.
    __device__ __forceinline__ float softmax_scale() const { return kDeferScale ? scale_log2 : 1.f; }

    // qk = q·k for query row i and key j (global indices); returns the base-2 score (divided by
    // softmax_scale()) or -inf.
    // checks (BlockInfo::tile_checks): kCheckStructure applies causal, window and lengths (boundary
    // tiles), kCheckMods the mask_mod (tiles a block mask does not know to be full).
    // The structure is the row's band of keys (BlockInfo::key_band), a function of i alone, which
    // the compiler works out once per row of a lane's tile: two comparisons and a select per
    // score, where testing each condition per score cost about 16 instructions per score of a
    // boundary tile (NVRTC 13.5). For callers whose lanes hold many rows and few keys, by_key.
    __device__ __forceinline__ float operator()(const Params& p, const BlockInfo& b, float qk, Index i, Index j,
                                                int checks) const {
        if (!(checks & kCheckStructure)) return unstructured(p, b, qk, i, j, checks, true);
        return kept(p, b, qk, i, j, checks, b.key_band(p, i).contains(j));
    }

    // operator() with the structure as the key's band of rows (BlockInfo::query_band, once per
    // key): for the tensor-core dK/dV kernels, whose lanes hold Sᵀ of 2 keys and up to 16 rows
    // (one band per row there took 835 instructions per boundary tile of the mma.sync one at
    // D = 64 on sm_90 against 805, and 686 against 655 in the wgmma one; NVRTC 13.5).
    __device__ __forceinline__ float by_key(const Params& p, const BlockInfo& b, float qk, Index i, Index j,
                                            int checks) const {
        if (!(checks & kCheckStructure)) return unstructured(p, b, qk, i, j, checks, true);
        return kept(p, b, qk, i, j, checks, b.query_band(p, j).contains(i));
    }

    // The score of a pair of a boundary tile: the one the structure keeps (inside), else -inf.
    // The features' work is done for both and the pair selected after (only the mask's load
    // waits for inside: a key past the sequence's end need not exist). Returning -inf first,
    // ptxas branched around each score's softcap (a branch and a BSSY/BSYNC pair per score), and
    // the SASS audit's fastest path ran through that copy with every score masked, below what an
    // interior tile of a softcap build issues (the wgmma forward at D = 128 with softcap, ALiBi
    // and a float mask: 499 instructions per tile of 64 keys, an interior tile 1014 with tanhf;
    // NVRTC 13.5). A build with mods returns -inf first all the same: a mod's tensors need not be
    // defined outside.
    __device__ __forceinline__ float kept(const Params& p, const BlockInfo& b, float qk, Index i, Index j, int checks,
                                          bool inside) const {
#if ATTN_MODS
        if (!inside) return -infinity();
#endif
        const float s = unstructured(p, b, qk, i, j, checks, inside);
        return inside ? s : -infinity();
    }

    // The score past the structure: softcap, ALiBi, the mods and the mask (read only inside).
    __device__ __forceinline__ float unstructured(const Params& p, const BlockInfo& b, float qk, Index i, Index j,
                                                  int checks, bool inside) const {
        float s = capped(p, b, qk, i, j);
#if ATTN_MASK_MOD
        if ((checks & kCheckMods) && !mods::mask_mod(b.bidb, b.bidh, i, j, p.mod_words)) return -infinity();
#endif
#if ATTN_SCORE_MOD
        s = mods::score_mod(s * kLn2, b.bidb, b.bidh, i, j, p.mod_words) * kLog2e;  // natural-log units
#endif
        if (kMaskBuilt != kMaskNone) {
            // The mask's keys are contiguous (the launcher copies one whose are not), so each
            // lane's constant column offsets within a row become the load's immediate: one load
            // per score. Through a run-time key stride, j · stride took about 7 instructions per
            // key column and 2 per score (an 8-byte product and sum).
            const long long at = b.bidb * p.mask_stride_b + b.bidh * p.mask_stride_h + i * p.mask_stride_q + j;
            if (kMaskBuilt == kMaskBool) {
                if (!mask_value<unsigned char>(p, at, inside, 0)) return -infinity();
            } else {
                s += mask_value(p, at, inside, 0.f) * kLog2e;  // -inf stays -inf
            }
        }
        return s;
    }
};

}  // namespace attn
