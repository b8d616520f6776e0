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

// Pᵀ (after dropout: what dV needs) and dSᵀ in place of Sᵀ and dPᵀ for query tile m0 and key tile
// n0; with write_ds, dS also to shared memory (queries as rows, kSStride elements apart) for dQ. lse2 and delta: the tile's
// rows' statistics in shared memory.
template <int kSStride, int kQTiles, class T>
__device__ __forceinline__ void probabilities_and_ds(float (&st)[kQTiles][4], float (&dpt)[kQTiles][4], const Params& p,
                                                     const BlockInfo& b, const ScoreTransform& score,
                                                     const Dropout& dropout, const float* lse2, const float* delta, T* ds_tile, bool write_ds,
                                                     int m0, int n0, int key0, int g, int t, int checks) {
#pragma unroll
    for (int j = 0; j < kQTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = key0 + g + 8 * (e / 2), query = j * 8 + 2 * t + (e & 1);
            const float qk = st[j][e];
            const float s2 = score(p, b, qk, m0 + query, n0 + key, checks);
            const float prob = probability(s2, lse2[query], score.softmax_scale());
            const float z = dropout.factor(m0 + query, n0 + key);  // out = (P ∘ z)·V
            const float ds = prob * (dpt[j][e] * z - delta[query]) * score.grad(p, b, qk, m0 + query, n0 + key, prob);
            st[j][e] = prob * z;
            dpt[j][e] = ds;
            if (write_ds) {
                ATTN_COUNT_SHARED(ds_tile + query * kSStride + key, sizeof(T));
                ds_tile[query * kSStride + key] = from_float<T>(ds);
            }
        }
    }
}

// This warp's share of dS·K for the block's dS (kBlockM queries x kBlockN keys, rows kSStride
// apart) and K (kBlockN x kHeadDim) in shared memory, K's element (key, dim) at k_element(key,
// dim) (a padded row-major tile, or a swizzled one: ldmatrix reads 8-element chunks, which both
// keep contiguous; dim is a multiple of 8): 16 rows and every few pairs of
// 8-dim tiles. For each pair of adjacent products a lane holds (rows g and g + 8 of the warp's
// 16, dims 2t and 2t + 1 of each 8-dim tile) calls add(pair, row, dim) with row and dim relative
// to the tile's first row and dim 0. The pairs of dim tiles are unrolled fully (kUnrolled) or not
// at all (less code, fewer registers for a rarely taken copy).
template <bool kUnrolled, class T, int kHeadDim, int kBlockM, int kBlockN, int kSStride, class KElement, class Add>
__device__ __forceinline__ void dq_products(const T* ds_tile, KElement&& k_element, int warp, int lane, Add&& add) {
    constexpr int kRowGroups = kBlockM / 16;    // 16-row groups of the dQ tile
    constexpr int kDimGroups = 4 / kRowGroups;  // warps sharing one row group's dimensions
    static_assert(kBlockM % 16 == 0 && 4 % kRowGroups == 0, "dQ rows split over the 4 warps");
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
            ptx::ldmatrix<4, true>(bk, k_element(kk * 16 + a_lane_row(lane), d * 8 + a_lane_col(lane)));
            ptx::mma_m16n8k16<T>(c0, a, {bk[0], bk[1]}, c0);
            ptx::mma_m16n8k16<T>(c1, a, {bk[2], bk[3]}, c1);
        }
#pragma unroll
        for (int e = 0; e < 8; e += 2)
            add(e < 4 ? c0 + e : c1 + e - 4, rows + g + 8 * ((e % 4) / 2), (d + e / 4) * 8 + 2 * t);
    }
}

// dQ += dS·K·scale by float32 reductions of dq_products' pairs: with every dim present
// (head_dim = kHeadDim, even, so each pair is 8-byte aligned) one 8-byte reduction per pair,
// predicated on its row being inside the sequence, unrolled; else element by element inside the
// sequence and the head, rolled.
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kSStride, class KElement>
__device__ __forceinline__ void atomic_dq(const Params& p, const BlockInfo& b, const HeadView& at, float* dq_accum,
                                          const T* ds_tile, KElement&& k_element, int m0, int warp, int lane) {
    const int rows_left = b.q_rows(p) - m0;
    auto dq = [&](int row, int dim) { return dq_accum + (at.stats + m0 + row) * p.head_dim + dim; };
    if (p.head_dim == kHeadDim) {
        dq_products<true, T, kHeadDim, kBlockM, kBlockN, kSStride>(
            ds_tile, k_element, warp, lane, [&](const float* pair, int row, int dim) {
                ptx::red_add_pair(dq(row, dim), pair[0] * p.scale, pair[1] * p.scale, row < rows_left);
            });
        return;
    }
    dq_products<false, T, kHeadDim, kBlockM, kBlockN, kSStride>(ds_tile, k_element, warp, lane, [&](const float* pair, int row, int dim) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (row < rows_left && dim + h < p.head_dim) {
                ATTN_COUNT_GLOBAL(dq(row, dim + h), 4);
                atomicAdd(dq(row, dim + h), pair[h] * p.scale);
            }
        }
    });
}

// Write this warp's rows of dK (times scale) and dV: keys n0 + key0 + (g, g + 8), dims
// dim0 + 8d + 2t (+1), each pair as one 8-byte store where both dims exist (head_dim and
// head_dim_v even keep the float32 rows 8-byte aligned). Every key row inside the sequence is
// written, those no query could see included (as 0).
template <int kDTiles>
__device__ __forceinline__ void store_dkdv(const Params& p, const BlockInfo& b, float* dk_part, float* dv_part,
                                           const float (&dk)[kDTiles][4], const float (&dv)[kDTiles][4], int n0,
                                           int key0, int dim0, int g, int t) {
    const long long key_rows = b.key_stats(p) + n0;
    auto store = [](float* dst, int col, int dims, float lo, float hi) {
        if (col + 1 < dims && dims % 2 == 0) {
            ATTN_COUNT_GLOBAL(dst, 8);
            *reinterpret_cast<float2*>(dst) = make_float2(lo, hi);
            return;
        }
        if (col < dims) {
            ATTN_COUNT_GLOBAL(dst, 4);
            dst[0] = lo;
        }
        if (col + 1 < dims) {
            ATTN_COUNT_GLOBAL(dst + 1, 4);
            dst[1] = hi;
        }
    };
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key0 + g + 8 * r;
        if (n0 + key >= b.kv_rows(p)) continue;
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
            const int col = dim0 + d * 8 + 2 * t;
            store(dk_part + (key_rows + key) * p.head_dim + col, col, p.head_dim, dk[d][2 * r] * p.scale,
                  dk[d][2 * r + 1] * p.scale);
            store(dv_part + (key_rows + key) * p.head_dim_v + col, col, p.head_dim_v, dv[d][2 * r], dv[d][2 * r + 1]);
        }
    }
}

}  // namespace attn
