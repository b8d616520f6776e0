// What the tensor-core dK/dV kernels (mma.sync and wgmma) share: both hold Sᵀ and dPᵀ of 16 keys
// per warp in the m16n8 accumulator layout (keys key0 + g and key0 + g + 8, queries 8j + 2t and
// + 1), and dK, dV with the keys as rows.
#pragma once
#include "backward_stats.cuh"
#include "block_info.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "numeric.cuh"
#include "ptx.cuh"
#include "tc_tile.cuh"

namespace attn {

// Calls element(j, e, prob, qk, i, key, row_delta, z) for each score of Sᵀ (st[j][e] = q·k of
// query row i and key `key`) of query tile m0 and key tile n0, prob its probability (before
// dropout) and z its dropout factor (1 / (1 − p) where kept, else 0; 1 without dropout).
// lse2 and delta: the tile's rows' statistics in shared memory (an element that does not use
// row_delta costs no load of it). A boundary tile masks by the lane's two keys' bands of rows
// (kBandsByKey: ScoreTransform::by_key, 4 registers held across the tile) or by each row's band
// of keys (worked out per row, 8 instructions each).
template <bool kBandsByKey, int kQTiles, class Element>
__device__ __forceinline__ void each_probability(const float (&st)[kQTiles][4], const Params& p, const BlockInfo& b,
                                                 const ScoreTransform& score, const Dropout& dropout, const float* lse2,
                                                 const float* delta, int m0, int n0, int key0, int g, int t, int checks,
                                                 Element&& element) {
    auto tile = [&](int tile_checks) {
        unsigned keeps[kQTiles];
        dropout.transposed_tile_keeps(keeps, m0, n0 + key0 + g, t);
#pragma unroll
        for (int j = 0; j < kQTiles; ++j) {
            // The two rows' statistics, once (read per score, they would be read again after any
            // store to shared memory the compiler cannot tell apart from them).
            const float row_lse2[2] = {lse2[j * 8 + 2 * t], lse2[j * 8 + 2 * t + 1]};
            const float row_delta[2] = {delta[j * 8 + 2 * t], delta[j * 8 + 2 * t + 1]};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + g + 8 * (e / 2), query = j * 8 + 2 * t + (e & 1);
                const float qk = st[j][e];
                // m0 + query and n0 + key as run-time bases and unrolled offsets, for ALiBi (Index)
                const Index row(m0 + 2 * t, j * 8 + (e & 1)), column(n0 + key0 + g, 8 * (e / 2));
                const float s2 = kBandsByKey ? score.by_key(p, b, qk, row, column, tile_checks)
                                             : score(p, b, qk, row, column, tile_checks);
                // A dead row's test is redundant (its lse2 is +inf: probability gives 0) but kept
                // in the checked copy, where rows past the sequence are: without it ptxas keeps
                // more exponentials in flight there, and the mma.sync dK/dV at D = 128 with
                // softcap, ALiBi and a float mask spilled 4 bytes on sm_80 (NVRTC 13.5).
                const float prob = tile_checks && row_lse2[e & 1] == infinity()
                                       ? 0.f
                                       : probability(s2, row_lse2[e & 1], score.softmax_scale());
                element(j, e, prob, qk, m0 + query, n0 + key, row_delta[e & 1], dropout.factor_of(keeps[j], e));
            }
        }
    };
    // An interior tile's copy with the checks a constant 0: no branch per score (NVRTC 13.5, the
    // warp-specialised wgmma dK/dV at D = 64: a branch and a predicate per score without it).
    if (checks) tile(checks);
    else tile(0);
}

// Pᵀ (after dropout: what dV needs) and dSᵀ in place of Sᵀ and dPᵀ (each_probability's tile),
// both once both are in: the mma.sync dK/dV's order. (Taken as the wgmma dK/dV takes them,
// probabilities then ds_from_probabilities, its fp16 builds' paths per tile changed by -8 to +10
// instructions, 25 of 36 up; NVRTC 13.5.)
template <bool kBandsByKey, int kQTiles>
__device__ __forceinline__ void probabilities_and_ds(float (&st)[kQTiles][4], float (&dpt)[kQTiles][4], const Params& p,
                                                     const BlockInfo& b, const ScoreTransform& score,
                                                     const Dropout& dropout, const float* lse2, const float* delta,
                                                     int m0, int n0, int key0, int g, int t, int checks) {
    each_probability<kBandsByKey>(st, p, b, score, dropout, lse2, delta, m0, n0, key0, g, t, checks,
                                  [&](int j, int e, float prob, float qk, int i, int key, float row_delta, float z) {
                                      const float ds = prob * (dpt[j][e] * z - row_delta) * score.grad(p, b, qk, i, key, prob);
                                      st[j][e] = prob * z;
                                      dpt[j][e] = ds;
                                  });
}

// What dSᵀ needs of each score of a tile once Pᵀ has gone to dV (probabilities, then
// ds_from_probabilities): dS = c ∘ (dP ∘ z − δ) = (c ∘ z) ∘ dP − c ∘ δ, with c = P · (the
// score's derivative through softcap and a score_mod, else 1) and z the dropout factor (1 / (1 −
// p) where kept, else 0; 1 without dropout). Without dropout c ∘ z is c, and in a plain build c is
// P itself: neither takes registers of its own there.
template <int kQTiles>
struct DsFactors {
    float of_dp[kQTiles][4];     // c ∘ z
    float of_delta[kQTiles][4];  // c
};

// Pᵀ (after dropout: what dV needs) in place of Sᵀ, and ds's factors (each_probability's tile),
// so that dSᵀ can follow once dPᵀ is in while the tensor cores multiply Pᵀ·dO.
template <bool kBandsByKey, int kQTiles>
__device__ __forceinline__ void probabilities(float (&st)[kQTiles][4], DsFactors<kQTiles>& ds, const Params& p,
                                              const BlockInfo& b, const ScoreTransform& score, const Dropout& dropout,
                                              const float* lse2, int m0, int n0, int key0, int g, int t, int checks) {
    // (delta: lse2 stands in for the row statistic this element never reads, so nothing loads it)
    each_probability<kBandsByKey>(st, p, b, score, dropout, lse2, lse2, m0, n0, key0, g, t, checks,
                                  [&](int j, int e, float prob, float qk, int i, int key, float, float z) {
                                      const float c = prob * score.grad(p, b, qk, i, key, prob);
                                      ds.of_dp[j][e] = c * z;
                                      ds.of_delta[j][e] = c;
                                      st[j][e] = prob * z;
                                  });
}

// dSᵀ in place of dPᵀ from probabilities' factors; delta: the tile's rows' in shared memory.
template <int kQTiles>
__device__ __forceinline__ void ds_from_probabilities(const DsFactors<kQTiles>& ds, float (&dpt)[kQTiles][4],
                                                      const float* delta, int t) {
#pragma unroll
    for (int j = 0; j < kQTiles; ++j) {
        const float row_delta[2] = {delta[j * 8 + 2 * t], delta[j * 8 + 2 * t + 1]};
#pragma unroll
        for (int e = 0; e < 4; ++e) dpt[j][e] = ds.of_dp[j][e] * dpt[j][e] - ds.of_delta[j][e] * row_delta[e & 1];
    }
}

// dS (probabilities_and_ds' dSᵀ, this warp's keys key0..key0 + 15) to a shared tile with the
// queries as rows, kSStride elements apart, for the mma.sync dQ.
template <int kSStride, int kQTiles, class T>
__device__ __forceinline__ void store_ds_rows(T* ds_tile, const float (&dst)[kQTiles][4], int key0, int g, int t) {
#pragma unroll
    for (int j = 0; j < kQTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            T* at = ds_tile + (j * 8 + 2 * t + (e & 1)) * kSStride + key0 + g + 8 * (e / 2);
            ATTN_STORE_SHARED(at, sizeof(T));
            *at = from_float<T>(dst[j][e]);
        }
}

// This warp's share (of the block's kWarps) of dS·K for the block's dS (kBlockM queries x kBlockN
// keys, rows kSStride apart) and K (kBlockN x kHeadDim, padded rows) in shared memory: 16 rows and
// every few pairs of 8-dim tiles. For each pair of adjacent products a lane holds (rows g and
// g + 8 of the warp's 16, dims 2t and 2t + 1 of each 8-dim tile) calls add(pair, row, dim) with
// row and dim relative to the tile's first row and dim 0. The pairs of dim tiles are unrolled fully (kUnrolled) or not
// at all (less code, fewer registers for a rarely taken copy).
template <bool kUnrolled, class T, int kHeadDim, int kBlockM, int kBlockN, int kSStride, int kWarps, class Add>
__device__ __forceinline__ void dq_products(const T* ds_tile, const T* k_tile, int warp, int lane, Add&& add) {
    constexpr int kStride = TcLayout<kHeadDim>::kStride;
    constexpr int kRowGroups = kBlockM / 16;         // 16-row groups of the dQ tile
    constexpr int kDimGroups = kWarps / kRowGroups;  // warps sharing one row group's dimensions
    static_assert(kBlockM % 16 == 0 && kWarps % kRowGroups == 0, "dQ rows split over the block's warps");
    constexpr int kSteps = kHeadDim / 8 / (2 * kDimGroups);  // pairs of 8-dim tiles per warp
    static_assert(kHeadDim / 8 % (2 * kDimGroups) == 0, "the warps sharing a row group split its dim tiles evenly");
    constexpr int kUnroll = kUnrolled ? kSteps : 1;
    const int g = lane / 4, t = lane % 4, rows = (warp % kRowGroups) * 16;
#pragma unroll kUnroll
    for (int step = 0; step < kSteps; ++step) {
        const int d = 2 * (warp / kRowGroups) + step * 2 * kDimGroups;
        float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
            unsigned a[4], bk[4];
            ptx::ldmatrix<4>(a, a_address<kSStride>(ds_tile, rows, kk * 16, lane));
            ptx::ldmatrix<4, true>(bk, a_address<kStride>(k_tile, kk * 16, d * 8, lane));
            ptx::mma_m16n8k16<T>(c0, a, {bk[0], bk[1]}, c0);
            ptx::mma_m16n8k16<T>(c1, a, {bk[2], bk[3]}, c1);
        }
#pragma unroll
        for (int e = 0; e < 8; e += 2)
            add(e < 4 ? c0 + e : c1 + e - 4, rows + g + 8 * ((e % 4) / 2), (d + e / 4) * 8 + 2 * t);
    }
}

// dQ of query tile m0 in float32 (dq_accum), to which pairs of products (dims dim, dim + 1 of a
// row; row relative to m0) are added unscaled (dS·K: the launcher's conversion of dq_accum to the
// caller's type multiplies by the scale once, not each key block's products): with every dim
// present (head_dim = kHeadDim, even, so each pair is 8-byte aligned) one 8-byte reduction per
// pair, predicated on its row being inside the sequence (add_pair); else element by element
// inside the sequence and the head (add_clipped).
struct DqTile {
    float* rows;  // row m0 of this head's dQ
    int rows_left, head_dim;

    __device__ __forceinline__ DqTile(const Params& p, const BlockInfo& b, const HeadView& at, float* dq_accum, int m0)
        : rows(dq_accum + (at.stats + m0) * p.head_dim), rows_left(b.q_rows(p) - m0), head_dim(p.head_dim) {}

    __device__ __forceinline__ void add_pair(const float* pair, int row, int dim) const {
        ptx::red_add_pair(rows + row * head_dim + dim, pair[0], pair[1], row < rows_left);
    }
    // add_pair for a tile whose rows are all inside the sequence and a thread whose pairs lie at
    // (row0, dim0) and beyond: no predicate (ptxas branches around each predicated reduction), and
    // rows kHeadDim apart from one base address, so that the pairs' offsets are constants (the
    // reductions' immediates, no 64-bit address arithmetic per pair).
    template <int kHeadDim>
    __device__ __forceinline__ auto interior_adder(int row0, int dim0) const {
        float* base = rows + row0 * kHeadDim + dim0;
        return [base, row0, dim0](const float* pair, int row, int dim) {
            ptx::red_add_pair(base + (row - row0) * kHeadDim + (dim - dim0), pair[0], pair[1], true);
        };
    }
    __device__ __forceinline__ void add_clipped(const float* pair, int row, int dim) const {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (row < rows_left && dim + h < head_dim) {
                ATTN_COUNT_GLOBAL(rows + row * head_dim + dim + h, 4);
                atomicAdd(rows + row * head_dim + dim + h, pair[h]);
            }
        }
    }
};

// dQ += dS·K (unscaled: DqTile) from dq_products' pairs: unrolled for a tile whose rows and dims
// are all present (every tile but a sequence's last of a head as wide as the tile), rolled else.
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kSStride, int kWarps>
__device__ __forceinline__ void atomic_dq(const Params& p, const BlockInfo& b, const HeadView& at, float* dq_accum,
                                          const T* ds_tile, const T* k_tile, int m0, int warp, int lane) {
    const DqTile dq(p, b, at, dq_accum, m0);
    if (p.head_dim == kHeadDim && dq.rows_left >= kBlockM) {
        // Every row inside the sequence; the thread's first row and dim in dq_products.
        constexpr int kRowGroups = kBlockM / 16;
        const int row0 = (warp % kRowGroups) * 16 + lane / 4, dim0 = 16 * (warp / kRowGroups) + 2 * (lane % 4);
        dq_products<true, T, kHeadDim, kBlockM, kBlockN, kSStride, kWarps>(ds_tile, k_tile, warp, lane,
                                                                           dq.interior_adder<kHeadDim>(row0, dim0));
        return;
    }
    if (p.head_dim == kHeadDim) {  // a sequence's last tile: rolled, as the clipped copy below
        dq_products<false, T, kHeadDim, kBlockM, kBlockN, kSStride, kWarps>(
            ds_tile, k_tile, warp, lane, [&](const float* pair, int row, int dim) { dq.add_pair(pair, row, dim); });
        return;
    }
    dq_products<false, T, kHeadDim, kBlockM, kBlockN, kSStride, kWarps>(
        ds_tile, k_tile, warp, lane, [&](const float* pair, int row, int dim) { dq.add_clipped(pair, row, dim); });
}

// dQ += a warp's products in the m16n8 accumulator layout (rows row0 + g and + 8, dims dim0 + 8d
// + 2t and + 1), unscaled (DqTile), for a tile of kTileRows rows.
template <int kHeadDim, int kTileRows, int kDTiles>
__device__ __forceinline__ void add_dq_fragments(const Params& p, const DqTile& dq, const float (&frag)[kDTiles][4],
                                                 int row0, int dim0, int g, int t) {
    auto each_pair = [&](auto&& add) {
#pragma unroll
        for (int d = 0; d < kDTiles; ++d)
#pragma unroll
            for (int r = 0; r < 2; ++r) add(frag[d] + 2 * r, row0 + g + 8 * r, dim0 + 8 * d + 2 * t);
    };
    if (p.head_dim != kHeadDim) {
        each_pair([&](const float* pair, int row, int dim) { dq.add_clipped(pair, row, dim); });
    } else if (dq.rows_left >= kTileRows) {
        each_pair(dq.interior_adder<kHeadDim>(row0 + g, dim0 + 2 * t));
    } else {
        each_pair([&](const float* pair, int row, int dim) { dq.add_pair(pair, row, dim); });
    }
}

// Where a tensor-core backward kernel writes rows of a gradient (dQ, dK or dV): element strides of
// its batch entries, heads and rows, which the launcher takes from the array it made (in the
// caller's layout, or per head). A packed batch passes its row stride as the batch stride,
// multiplied by a sequence's first row, as HeadView's strides are. The launcher's arrays are
// contiguous, so every stride is a multiple of the row's length: pairs of an even-length row are
// aligned (store_pair, add_pair).
struct GradientRows {
    long long batch, head, row;

    __device__ __forceinline__ long long at(int origin, int head_index, int row_index) const {
        return origin * batch + head_index * head + row_index * row;
    }
};

// A GradientRows as a kernel's parameters (name_batch, name_head, name_row), and back.
#define ATTN_GRADIENT_ROWS_PARAMS(name) long long name##_batch, long long name##_head, long long name##_row
#define ATTN_GRADIENT_ROWS(name) attn::GradientRows{name##_batch, name##_head, name##_row}

// A pair of adjacent elements (columns col, col + 1 of a row of `dims`, lo and hi) to dst as Out:
// one 8-byte (float32) or 4-byte (16-bit) store where both columns exist and rows have an even
// number of them (pair-aligned), else element by element within the row.
template <class Out>
__device__ __forceinline__ void store_pair(Out* dst, int col, int dims, float lo, float hi) {
    if (col + 1 < dims && dims % 2 == 0) {
        ATTN_COUNT_GLOBAL(dst, 2 * sizeof(Out));
        if constexpr (sizeof(Out) == 4) *reinterpret_cast<float2*>(dst) = make_float2(lo, hi);
        else *reinterpret_cast<unsigned*>(dst) = pack_pair<Out>(lo, hi);
        return;
    }
    if (col < dims) {
        ATTN_COUNT_GLOBAL(dst, sizeof(Out));
        dst[0] = from_float<Out>(lo);
    }
    if (col + 1 < dims) {
        ATTN_COUNT_GLOBAL(dst + 1, sizeof(Out));
        dst[1] = from_float<Out>(hi);
    }
}

// A pair of adjacent elements (columns col, col + 1 of a row of `dims`, lo and hi) added to dst in
// float32: one 8-byte reduction where both columns exist and rows have an even number of them
// (pair-aligned), else an atomic add per element within the row.
__device__ __forceinline__ void add_pair(float* dst, int col, int dims, float lo, float hi) {
    if (col + 1 < dims && dims % 2 == 0) {
        ptx::red_add_pair(dst, lo, hi, true);
        return;
    }
    if (col < dims) {
        ATTN_COUNT_GLOBAL(dst, 4);
        atomicAdd(dst, lo);
    }
    if (col + 1 < dims) {
        ATTN_COUNT_GLOBAL(dst + 1, 4);
        atomicAdd(dst + 1, hi);
    }
}

// Write this warp's rows of dK (times scale) and dV as Out (float32 or the input type), or with
// `add` add them (float32: DkdvOut), at head `head` of dk_rows and dv_rows (the query head's, or
// its kv head's). Keys n0 + key0 + (g, g + 8), dims dim0 + 8d + 2t (+1), by pairs (store_pair,
// add_pair). Every key row inside the sequence is written, those no query could see included
// (as 0).
template <class Out, int kDTiles>
__device__ __forceinline__ void store_dkdv(const Params& p, const BlockInfo& b, Out* dk_out, Out* dv_out,
                                           const GradientRows& dk_rows, const GradientRows& dv_rows, int head,
                                           const float (&dk)[kDTiles][4], const float (&dv)[kDTiles][4], int n0,
                                           int key0, int dim0, int g, int t, bool add = false) {
    const int origin = b.kv_origin(p);
    auto write = [&](Out* dst, int col, int dims, float lo, float hi) {
        if constexpr (sizeof(Out) == 4) {
            if (add) {
                add_pair(dst, col, dims, lo, hi);
                return;
            }
        }
        store_pair(dst, col, dims, lo, hi);
    };
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = n0 + key0 + g + 8 * r;
        if (key >= b.kv_rows(p)) continue;
        Out* dk_row = dk_out + dk_rows.at(origin, head, key);
        Out* dv_row = dv_out + dv_rows.at(origin, head, key);
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
            const int col = dim0 + d * 8 + 2 * t;
            write(dk_row + col, col, p.head_dim, dk[d][2 * r] * p.scale, dk[d][2 * r + 1] * p.scale);
            write(dv_row + col, col, p.head_dim_v, dv[d][2 * r], dv[d][2 * r + 1]);
        }
    }
}

}  // namespace attn
