// The tensor-core dK/dV kernel for fp16/bf16 (FlashAttention-2's backward on mma.sync).
//
// One block per (kBlockN keys, query head, batch entry). The keys are split into groups of 16, and
// each group's head dims over the kDimWarps = max(1, 64 / kBlockN) warps that share it: warp w
// owns keys 16·(w / kDimWarps) + 0..15 and dims kWarpDims·(w % kDimWarps) + 0..kWarpDims-1 of
// their dK and dV, in float32 registers (every dim per warp for D <= 128, whose blocks of 64 or
// 128 keys take 4 or 8 warps; for D = 256, 32 keys in 4 warps and half the dims each, since a
// warp holding all 256 dims of dK and dV would need 256 accumulators per thread). For each query tile of kBlockM rows that can see the block's keys
// (Q and dO staged by cp.async, the next tile loading during this one where two stages fit):
//   Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ          (16 keys x kBlockM queries per warp, MMAs over the warp's
//                                         dims; partial sums of a key group added through shared
//                                         memory in a fixed order when kDimWarps > 1)
//   Pᵀ = exp2(s - lse), dSᵀ = Pᵀ ∘ (dPᵀ - delta) · softcap'   (in registers)
//   dV += Pᵀ·dO, dK += dSᵀ·Q            (Pᵀ and dSᵀ re-packed as A operands; dO and Q
//                                         read transposed with ldmatrix .trans)
//   dQ += dS·K                           (dS through shared memory; float32 atomics, unscaled:
//                                         the launcher's conversion multiplies by the scale) unless
//                                         the deterministic dQ kernel runs after.
// P and dS are rounded to the input type before their MMAs, as in FlashAttention-2.
//
// attention_bwd_dq_tc is the deterministic dQ on tensor cores: one block of 4 warps per 64 or 128
// query rows (one or two row tiles of 16 per warp, 64 rows apart, as the mma.sync forward's: with
// two, every K and V fragment a warp reads serves both) loops over key tiles, recomputes
// S = Q·Kᵀ and dP = dO·Vᵀ, and accumulates dQ += dS·K in registers in a fixed order (no
// atomics), then writes it in the input type.
#include "backward_stats.cuh"
#include "block_info.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "numeric.cuh"
#include "ptx.cuh"
#include "tc_backward.cuh"
#include "tc_tile.cuh"

namespace attn {

// Shared-memory layout of the dK/dV kernel; the launcher's TensorCoreBackwardTile.shared_bytes
// computes the same size.
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct DkdvTcLayout {
    static constexpr int kStride = TcLayout<kHeadDim>::kStride;
    static constexpr int kSStride = kBlockN + 8;           // dS tile (kBlockM, kBlockN), 16-bit, padded
    static constexpr int kKeyGroups = kBlockN / 16;         // groups of 16 keys
    static constexpr int kDimWarps = kKeyGroups < 4 ? 4 / kKeyGroups : 1;  // warps sharing a group
    static constexpr int kWarps = kKeyGroups * kDimWarps;   // 4, or one per group past 64 keys
    static constexpr int kBlockThreads = 32 * kWarps;
    static constexpr int kWarpDims = kHeadDim / kDimWarps;  // dims of dK, dV per warp
    // Per warp, Sᵀ and dPᵀ partial sums in fragment order ([2][kBlockM / 8][4][32 lanes] floats,
    // conflict-free), when a key group's dims are split over several warps.
    static constexpr int kPartialFloats = kDimWarps > 1 ? 4 * 2 * kBlockM * 16 : 0;
    static_assert(kBlockN % 16 == 0 && (kKeyGroups < 4 ? 4 % kKeyGroups == 0 : kKeyGroups % 4 == 0),
                  "4 warps sharing groups of 16 keys, or a warp per group in whole warpgroups");
    static_assert(kWarpDims % 16 == 0, "each warp's dims are whole pairs of 8-dim MMA tiles");
    static_assert(kStages == 1 || kStages == 2, "Q and dO tiles in one or two stages");
};

template <class T, int kHeadDim, int kBlockM, int kBlockN, int kStages>
__device__ __forceinline__ void dkdv_tc_block(const Params& p, const T* q, const T* k, const T* v, const T* dout,
                                              const float* lse, const float* delta, float* dq_accum, void* dk_out,
                                              void* dv_out, const GradientRows& dk_rows, const GradientRows& dv_rows,
                                              int accumulate_dq, DkdvOut dkdv_out, int vectorised,
                                              const long long (&strides)[12]) {
    using Layout = DkdvTcLayout<T, kHeadDim, kBlockM, kBlockN, kStages>;
    constexpr int kStride = Layout::kStride, kSStride = Layout::kSStride;
    constexpr int kDimWarps = Layout::kDimWarps, kWarpDims = Layout::kWarpDims;
    constexpr int kQTiles = kBlockM / 8;        // 8-query column tiles of Sᵀ
    constexpr int kDTiles = kWarpDims / 8;      // 8-dim column tiles of this warp's dK, dV
    extern __shared__ __align__(16) unsigned char smem_bytes[];
    // K, V (kBlockN, kStride); dS (kBlockM, kSStride) with queries as rows; per stage Q and dO
    // (kBlockM, kStride) and the rows' lse (base 2) and delta (kBlockM floats each); the warps'
    // partial sums (kPartialFloats). Stages by arithmetic: a run-time index into an array of
    // pointers would put it in local memory.
    T* sK = reinterpret_cast<T*>(smem_bytes);
    T* sV = sK + kBlockN * kStride;
    T* sDS = sV + kBlockN * kStride;
    T* sQDO = sDS + kBlockM * kSStride;
    float* sStats = reinterpret_cast<float*>(sQDO + kStages * 2 * kBlockM * kStride);
    float* sPartial = sStats + kStages * 2 * kBlockM;
    auto sQ = [&](int stage) { return sQDO + stage * 2 * kBlockM * kStride; };
    auto sDO = [&](int stage) { return sQ(stage) + kBlockM * kStride; };
    auto sLse2 = [&](int stage) { return sStats + stage * 2 * kBlockM; };
    auto sDelta = [&](int stage) { return sLse2(stage) + kBlockM; };

    // In sections up to D = 128 (key_block_place; the launcher's TensorCoreBackwardTile.sectioned).
    const BlockPlace place = kHeadDim <= 128 ? key_block_place(p) : grid_place();
    const BlockInfo b(p, place.head, place.batch);
    const ScoreTransform score(p, b);
    const Dropout dropout(p, b);
    const HeadView at = head_view(p, b, strides);  // .o is dout; .stats indexes lse, delta, dq rows
    const int n0 = place.tile * kBlockN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int key0 = (warp / kDimWarps) * 16;           // this warp's 16 keys, within the block
    const int dim_slice = warp % kDimWarps;              // and its dims [dim0, dim0 + kWarpDims)
    const int dim0 = dim_slice * kWarpDims;
    const TileSource<T, kHeadDim> k_source(k + at.k, at.k_row, b.kv_rows(p), p.head_dim, vectorised & 2);
    const TileSource<T, kHeadDim> v_source(v + at.v, at.v_row, b.kv_rows(p), p.head_dim_v, vectorised & 4);
    stage_async<kBlockN, Layout::kBlockThreads>(sK, k_source, n0);
    stage_async<kBlockN, Layout::kBlockThreads>(sV, v_source, n0);
    // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ take this warp's 16 keys of K and V as A operands for every query
    // tile: up to D = 64 each warp loads them into registers once (32 per thread at D = 64) rather
    // than from shared memory per tile. The SASS audit (NVRTC 13.5, fp16, plain builds):
    // shared_per_tensor at D = 64 1.45 → 1.35 on sm_80 and 2.70 → 2.50 on sm_90 (at wgmma's rate),
    // issue_per_tensor 0.47 → 0.46 and 0.93 → 0.91; at D = 32 1.60 → 1.50 and 3.00 → 2.80. No
    // feature set spills on sm_80, but on sm_90 softcap, ALiBi and a bool mask did (8 bytes; 4 with
    // dropout), and so did mods at D = 64 (bench_mods' bias table: 4-28 bytes), and dropout with a
    // mask on sm_80 (4-24 bytes, its Philox rounds unrolled): those keep K and V in shared memory,
    // as D = 128 does, where the 64 registers spilled 48-56 bytes.
    constexpr bool kKvInRegisters = kHeadDim <= 64 && !ATTN_MODS &&
                                    !(kSoftcapBuilt && kAlibiBuilt && kMaskBuilt == kMaskBool) &&
                                    !(kDropoutBuilt && kMaskBuilt != kMaskNone);
    RowFragments<kKvInRegisters ? kWarpDims / 16 : 1> k_rows, v_rows;
    if constexpr (kKvInRegisters) {
        ptx::cp_async_commit();
        ptx::cp_async_wait<0>();
        __syncthreads();  // every thread's copies of K and V have landed
        k_rows.template load<kStride>(sK + dim0, key0, lane);
        v_rows.template load<kStride>(sV + dim0, key0, lane);
    }

    float dk[kDTiles][4], dv[kDTiles][4];
    #pragma unroll
    for (int d = 0; d < kDTiles; ++d)
        #pragma unroll
        for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = 0.f;

    TileWalk rows = b.row_walk(p, n0, kBlockN, kBlockM);
    const TileSource<T, kHeadDim> q_source(q + at.q, at.q_row, b.q_rows(p), p.head_dim, vectorised & 1);
    const TileSource<T, kHeadDim> do_source(dout + at.o, at.o_row, b.q_rows(p), p.head_dim_v, vectorised & 8);
    const int whole_tiles = whole_rows_of(q_source, do_source) / kBlockM;
    // With two stages the next query tile loads while this one is worked on.
    auto stage_queries = [&](int m_block, int stage) {
        const int m0 = m_block * kBlockM;
        stage_async_pair<kBlockM, Layout::kBlockThreads>(sQ(stage), q_source, sDO(stage), do_source, m0,
                                                    m_block < whole_tiles);
        stage_row_stats<Layout::kBlockThreads>(sLse2(stage), sDelta(stage), lse, delta, at.stats, m0, kBlockM, b.q_rows(p));
        ptx::cp_async_commit();
    };
    if (kStages == 2 && rows.more()) stage_queries(rows.tile, rows.stage<kStages>());
    for (; rows.more(); rows.advance()) {
        const int m_block = rows.tile, m0 = m_block * kBlockM, stage = rows.stage<kStages>();
        if (kStages == 1) {
            __syncthreads();  // every warp is done with the previous Q, dO, statistics and dS
            stage_queries(m_block, stage);
        }
        ptx::cp_async_wait<0>();
        // K, V (first pass), this tile's Q, dO and row statistics are in place; with two stages
        // every warp is also done with the previous tile: its dS, and the stage loaded next.
        __syncthreads();
        if (kStages == 2 && !rows.last()) stage_queries(rows.after(), rows.stage_after<kStages>());
        const T* tile_q = sQ(stage);
        const T* tile_do = sDO(stage);
        const float* tile_lse2 = sLse2(stage);
        const float* tile_delta = sDelta(stage);

        // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: st[j], dpt[j] hold keys key0 + (g, g+8) x queries (8j + 2t, +1),
        // summed over this warp's dims.
        float st[kQTiles][4], dpt[kQTiles][4];
        #pragma unroll
        for (int j = 0; j < kQTiles; ++j)
            #pragma unroll
            for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.f;
        if constexpr (kKvInRegisters) {
            mma_rows_by_rows<T, kStride, kWarpDims / 16>(st, k_rows, tile_q + dim0, lane);
            mma_rows_by_rows<T, kStride, kWarpDims / 16>(dpt, v_rows, tile_do + dim0, lane);
        } else {
            mma_rows_by_rows<T, kStride, kWarpDims / 16>(st, sK + dim0, key0, tile_q + dim0, lane);
            mma_rows_by_rows<T, kStride, kWarpDims / 16>(dpt, sV + dim0, key0, tile_do + dim0, lane);
        }
        if (kDimWarps > 1) {
            // The key group's full sums: every warp of the group adds the partials in the same
            // order (dim slice 0, 1, ...), so all of them hold bit-identical Sᵀ and dPᵀ.
            float* mine = sPartial + warp * (2 * kQTiles * 4 * 32) + lane;
            #pragma unroll
            for (int j = 0; j < kQTiles; ++j)
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    mine[(j * 4 + e) * 32] = st[j][e];
                    mine[((kQTiles + j) * 4 + e) * 32] = dpt[j][e];
                }
            __syncthreads();  // every warp's partial sums are in shared memory
            const float* group = sPartial + (warp - dim_slice) * (2 * kQTiles * 4 * 32) + lane;
            #pragma unroll
            for (int j = 0; j < kQTiles; ++j)
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    st[j][e] = dpt[j][e] = 0.f;
                    for (int slice = 0; slice < kDimWarps; ++slice) {
                        st[j][e] += group[slice * (2 * kQTiles * 4 * 32) + (j * 4 + e) * 32];
                        dpt[j][e] += group[slice * (2 * kQTiles * 4 * 32) + ((kQTiles + j) * 4 + e) * 32];
                    }
                }
        }

        // Pᵀ and dSᵀ in place of Sᵀ and dPᵀ; dS also to shared memory (queries as rows) for dQ.
        const int checks = b.tile_checks(p, m0, kBlockM, n0, kBlockN);
        // By key bands up to D = 128; at D = 256 (255 registers) their 4 registers made ptxas
        // spill 16 bytes on sm_90 (NVRTC 13.5).
        probabilities_and_ds<kHeadDim <= 128>(st, dpt, p, b, score, dropout, tile_lse2, tile_delta, m0, n0, key0,
                                              g, t, checks);
        if (accumulate_dq && dim_slice == 0) store_ds_rows<kSStride>(sDS, dpt, key0, g, t);

        // dV += Pᵀ·dO and dK += dSᵀ·Q over this tile's queries, in this warp's dims.
        mma_registers_by_rows<T, kStride, kBlockM / 16>(dv, st, tile_do + dim0, lane);
        mma_registers_by_rows<T, kStride, kBlockM / 16>(dk, dpt, tile_q + dim0, lane);

        if (accumulate_dq) {
            __syncthreads();  // every warp's dS is in shared memory
            atomic_dq<T, kHeadDim, kBlockM, kBlockN, kSStride, Layout::kWarps>(p, b, at, dq_accum, sDS, sK, m0, warp,
                                                                               lane);
        }
    }

    // The head whose rows of dK and dV this block writes: its own, or its kv head's that a GQA
    // group adds to (DkdvOut). With 8 warps, and above D = 128, the rows from an entry and head
    // the compiler cannot take from before the loop: with 128 keys at D = 128 it held (bidb·H +
    // bidh) across the loop for them, and spilled it (12 bytes on sm_80); the kv head held made a
    // packed 128-key D = 64 build with softcap, ALiBi and a mask spill 12 bytes, and the D = 256
    // build 12-28 bytes on sm_90 (NVRTC 13.5). (Not with 4 warps up to D = 128: the 64-key D = 128
    // build with softcap, ALiBi and a float mask then takes 9 instructions more per tile.)
    const bool add = dkdv_out == kDkdvFloatAdded;
    BlockInfo b_out = b;
    if constexpr (Layout::kWarps > 4 || kHeadDim > 128) {
        b_out.bidh = static_cast<int>(ptx::opaque(static_cast<unsigned long long>(b.bidh)));
        b_out.bidb = static_cast<int>(ptx::opaque(static_cast<unsigned long long>(b.bidb)));
    }
    const int out_head = add ? b_out.bidh / p.kv_group : b_out.bidh;
    if (dkdv_out == kDkdvInputType)
        store_dkdv(p, b_out, static_cast<T*>(dk_out), static_cast<T*>(dv_out), dk_rows, dv_rows, out_head, dk, dv, n0,
                   key0, dim0, g, t);
    else store_dkdv(p, b_out, static_cast<float*>(dk_out), static_cast<float*>(dv_out), dk_rows, dv_rows, out_head, dk,
                    dv, n0, key0, dim0, g, t, add);
}

template <class T, int kHeadDim, int kBlockN, int kBlockM>
__device__ __forceinline__ void dq_tc_block(const Params& p, const T* q, const T* k, const T* v, const T* dout,
                                            const float* lse, const float* delta, T* dq_out,
                                            const GradientRows& dq_rows, int vectorised,
                                            const long long (&strides)[12]) {
    static_assert(kBlockM == 64 || kBlockM == 128, "one or two row tiles of 16 rows per warp");
    constexpr int kStride = TcLayout<kHeadDim>::kStride;
    constexpr int kRowTiles = kBlockM / 64;  // per warp, rows 64m + 16·warp .. + 15 of the block
    constexpr int kNTiles = kBlockN / 8, kDTiles = kHeadDim / 8;
    extern __shared__ __align__(16) unsigned char smem_bytes[];
    T* sQ = reinterpret_cast<T*>(smem_bytes);  // (kBlockM, kStride)
    T* sDO = sQ + kBlockM * kStride;           // (kBlockM, kStride)
    T* sK = sDO + kBlockM * kStride;           // (kBlockN, kStride)
    T* sV = sK + kBlockN * kStride;            // (kBlockN, kStride)
    float* sLse2 = reinterpret_cast<float*>(sV + kBlockN * kStride);
    float* sDelta = sLse2 + kBlockM;

    const BlockPlace place = query_block_place(p);
    const BlockInfo b(p, place.head, place.batch);
    const ScoreTransform score(p, b);
    const Dropout dropout(p, b);
    const HeadView at = head_view(p, b, strides);
    const int m0 = place.tile * kBlockM;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const TileSource<T, kHeadDim> q_source(q + at.q, at.q_row, b.q_rows(p), p.head_dim, vectorised & 1);
    const TileSource<T, kHeadDim> do_source(dout + at.o, at.o_row, b.q_rows(p), p.head_dim_v, vectorised & 8);
    stage_async<kBlockM>(sQ, q_source, m0);
    stage_async<kBlockM>(sDO, do_source, m0);
    stage_row_stats(sLse2, sDelta, lse, delta, at.stats, m0, kBlockM, b.q_rows(p));

    float dq[kRowTiles][kDTiles][4];
#pragma unroll
    for (int m = 0; m < kRowTiles; ++m)
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) dq[m][d][0] = dq[m][d][1] = dq[m][d][2] = dq[m][d][3] = 0.f;
    TileWalk keys = b.key_walk(p, m0, kBlockM, kBlockN);
    const TileSource<T, kHeadDim> k_source(k + at.k, at.k_row, b.kv_rows(p), p.head_dim, vectorised & 2);
    const TileSource<T, kHeadDim> v_source(v + at.v, at.v_row, b.kv_rows(p), p.head_dim_v, vectorised & 4);
    const int whole_tiles = whole_rows_of(k_source, v_source) / kBlockN;
    // S = Q·Kᵀ takes this warp's 16 rows of Q as A operands for every key tile: at D = 128 (one
    // row tile per warp) each warp loads them into registers once (32 per thread). The SASS audit
    // (NVRTC 13.5, fp16, plain build): shared_per_tensor 1.34 → 1.26 on sm_80 and 2.69 → 2.52 on
    // sm_90 (at wgmma's rate), 238 → 242 registers; no feature set or mods spills. At D = 256 (64
    // per thread; 1.85 → 1.52) 8 of the 48 feature builds spilled 8-16 bytes; dO too at D = 128
    // (1.18) spilled with softcap, ALiBi and a float mask.
    constexpr bool kQInRegisters = kRowTiles == 1 && kHeadDim == 128;
    RowFragments<kQInRegisters ? kHeadDim / 16 : 1> q_rows;
    if (kQInRegisters && keys.more()) {
        ptx::cp_async_commit();
        ptx::cp_async_wait<0>();
        __syncthreads();  // every thread's copies of Q have landed
        q_rows.template load<kStride>(sQ, warp * 16, lane);
    }
    for (; keys.more(); keys.advance()) {
        const int n_block = keys.tile, n0 = n_block * kBlockN;
        __syncthreads();  // every warp is done with the previous K and V tiles
        stage_async_pair<kBlockN>(sK, k_source, sV, v_source, n0, n_block < whole_tiles);
        ptx::cp_async_commit();
        ptx::cp_async_wait<0>();
        __syncthreads();  // Q, dO, the row statistics (first pass), K and V are in place

        // S = Q·Kᵀ and dP = dO·Vᵀ for this warp's row tiles: [m][j] holds rows (g, g+8) of row tile m
        // x keys 8j + 2t, +1. With two row tiles every K and V fragment serves two MMAs.
        float s[kRowTiles][kNTiles][4], dp[kRowTiles][kNTiles][4];
#pragma unroll
        for (int m = 0; m < kRowTiles; ++m)
#pragma unroll
            for (int j = 0; j < kNTiles; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[m][j][e] = dp[m][j][e] = 0.f;
        unsigned keeps[kRowTiles][kNTiles];  // dropout's, before S (Dropout::tile_keeps)
#pragma unroll
        for (int m = 0; m < kRowTiles; ++m) dropout.tile_keeps(keeps[m], m0 + 64 * m + warp * 16 + g, n0, t);
        if constexpr (kQInRegisters) mma_rows_by_rows<T, kStride, kHeadDim / 16>(s[0], q_rows, sK, lane);
        else mma_rows_by_rows<T, kStride, kHeadDim / 16>(s, sQ, warp * 16, sK, lane);
        mma_rows_by_rows<T, kStride, kHeadDim / 16>(dp, sDO, warp * 16, sV, lane);

        // dS in place of S.
        const int checks = b.tile_checks(p, m0, kBlockM, n0, kBlockN);
#pragma unroll
        for (int m = 0; m < kRowTiles; ++m)
#pragma unroll
            for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = 64 * m + warp * 16 + g + 8 * (e / 2), key = j * 8 + 2 * t + (e & 1);
                    const float qk = s[m][j][e];
                    const float s2 = score(p, b, qk, Index(m0 + warp * 16 + g, 64 * m + 8 * (e / 2)),
                                           Index(n0 + 2 * t, j * 8 + (e & 1)), checks);  // m0 + row, n0 + key
                    const float prob = probability(s2, sLse2[row], score.softmax_scale());
                    const float z = dropout.factor_of(keeps[m][j], e);  // bit 2·(e / 2) + (e & 1)
                    s[m][j][e] = prob * (dp[m][j][e] * z - sDelta[row]) * score.grad(p, b, qk, m0 + row, n0 + key, prob);
                }
            }

        // dQ += dS·K: dS stays in registers as the A operand; K is read transposed, each fragment
        // once for every row tile.
        mma_registers_by_rows<T, kStride, kBlockN / 16>(dq, s, sK, lane);
    }

    // Every row inside the sequence is written at dq_rows, rows that attended nothing included
    // (as 0), by pairs (store_pair).
#pragma unroll
    for (int m = 0; m < kRowTiles; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = m0 + 64 * m + warp * 16 + g + 8 * r;
            if (i >= b.q_rows(p)) continue;
            T* row = dq_out + dq_rows.at(b.q_origin(p), b.bidh, i);
#pragma unroll
            for (int d = 0; d < kDTiles; ++d) {
                const int col = d * 8 + 2 * t;
                store_pair(row + col, col, p.head_dim, dq[m][d][2 * r] * p.scale, dq[m][d][2 * r + 1] * p.scale);
            }
        }
}

}  // namespace attn

// grid (pairs per section, ceil(Sq / kBlockM), sections) (query_block_place), block 128, dynamic
// shared memory: Q, dO (kBlockM rows) and K, V (kBlockN rows) of kHeadDim + 8 16-bit elements, lse
// and delta (kBlockM floats each). dq: T, its rows where dq_batch, dq_head and dq_row say
// (attn::GradientRows: the caller's layout).
template <class T, int kHeadDim, int kBlockN, int kBlockM>
__global__ void __launch_bounds__(attn::kThreads, 1)
attention_bwd_dq_tc(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,
                    T* dq, ATTN_GRADIENT_ROWS_PARAMS(dq), int vectorised, ATTN_PARAMS) {
    ATTN_UNPACK_PARAMS;
    attn::dq_tc_block<T, kHeadDim, kBlockN, kBlockM>(p, q, k, v, dout, lse, delta, dq, ATTN_GRADIENT_ROWS(dq),
                                                     vectorised, strides);
}

// grid (pairs per section, ceil(Sk / kBlockN), sections) (key_block_place) up to D = 128, else
// (ceil(Sk / kBlockN), H, B), block DkdvTcLayout::kBlockThreads (128, or 256 for 128 keys), dynamic
// shared memory (DkdvTcLayout): K, V (kBlockN rows)
// of kHeadDim + 8 16-bit elements, dS (kBlockM x (kBlockN + 8), 16-bit), kStages x (Q, dO (kBlockM
// rows of kHeadDim + 8), lse and delta (kBlockM floats each)), and with kBlockN < 64 the warps'
// partial sums of Sᵀ and dPᵀ (4 x 2 x kBlockM x 16 floats). dk_out, dv_out as dkdv_out
// (attn::DkdvOut) says: T or float32 per query head, or float32 per kv head, zeroed, to add to;
// their rows where dk_* and dv_* say (attn::GradientRows). With accumulate_dq, dS·K (without the
// scale) is added to dq_accum (float32, per query head, zeroed). vectorised: bits 0-3 for q, k,
// v, dout rows copyable in 16-byte chunks. minBlocksPerSM = 1 lets ptxas use up to 255
// registers: dK and dV stay in registers, unspilled.
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kStages>
__global__ void __launch_bounds__(attn::DkdvTcLayout<T, kHeadDim, kBlockM, kBlockN, kStages>::kBlockThreads, 1)
attention_bwd_dkdv_tc(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,
                      float* dq_accum, void* dk_out, void* dv_out, ATTN_GRADIENT_ROWS_PARAMS(dk),
                      ATTN_GRADIENT_ROWS_PARAMS(dv), int accumulate_dq, int dkdv_out, int vectorised, ATTN_PARAMS) {
    ATTN_UNPACK_PARAMS;
    attn::dkdv_tc_block<T, kHeadDim, kBlockM, kBlockN, kStages>(p, q, k, v, dout, lse, delta, dq_accum, dk_out, dv_out,
                                                                ATTN_GRADIENT_ROWS(dk), ATTN_GRADIENT_ROWS(dv),
                                                                accumulate_dq, static_cast<attn::DkdvOut>(dkdv_out),
                                                                vectorised, strides);
}
