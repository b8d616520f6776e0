// The Hopper (sm_90a) dK/dV kernel for fp16/bf16: attention_bwd_tc.cu's algorithm on wgmma.
//
// One block is one warpgroup per (64 keys, query head, batch entry); the accumulators of wgmma
// (M = 64 keys) give warp w keys 16w..16w+15, the layout of the mma.sync kernel, whose P/dS and
// dQ steps (tc_backward.cuh) this kernel shares. For each query tile of kBlockM rows that can see
// the block's keys (Q, dO and their row statistics in two stages: the next tile loads during
// this one):
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ      wgmma SS, N = kBlockM: K, V, Q and dO in shared memory in one
//                               core-matrix layout (rows x head dims), Q and dO read K-major
//   Pᵀ, dSᵀ                     in registers
//   dV += Pᵀ·dO, dK += dSᵀ·Q    wgmma RS: Pᵀ and dSᵀ from registers, dO and Q from the same
//                               shared memory read MN-major (head dims, N here, consecutive):
//                               no transpose; 64 head dims per instruction
//   dQ += dS·K·scale            mma.sync from dS and a row-major copy of K, float32 atomics,
//                               unless the deterministic dQ kernel runs after.
// Head dims up to 128: dK and dV of 64 keys take D floats per thread, so D = 256 stays on the
// mma.sync kernel, which splits its dims over two warps.
#include "backward_stats.cuh"
#include "block_info.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "numeric.cuh"
#include "ptx.cuh"
#include "tc_backward.cuh"
#include "tc_tile.cuh"

namespace attn {

constexpr int kWgmmaBwdKeys = 64;  // keys per block: M of every wgmma
constexpr int kWgmmaBwdDims = 64;  // head dims per dV/dK instruction (its N)

template <class T, int kHeadDim, int kBlockM>
__device__ __forceinline__ void dkdv_wgmma_block(const Params& p, const T* q, const T* k, const T* v, const T* dout,
                                                 const float* lse, const float* delta, float* dq_accum, float* dk_part,
                                                 float* dv_part, int accumulate_dq, int vectorised,
                                                 const long long (&strides)[12]) {
    static_assert(kHeadDim % kWgmmaBwdDims == 0 && kHeadDim <= 128, "head-dim tiles 64 and 128");
    static_assert(kBlockM == 32 || kBlockM == 64, "Sᵀ and dPᵀ are m64n32k16 or m64n64k16 products");
    constexpr int kKeys = kWgmmaBwdKeys;
    constexpr int kStride = TcLayout<kHeadDim>::kStride, kSStride = kKeys + 8;
    constexpr int kQTiles = kBlockM / 8, kDTiles = kHeadDim / 8;
    using Rows = CoreMatrixLayout<kHeadDim>;  // K, V, Q, dO: rows x head dims
    extern __shared__ __align__(128) unsigned char smem_bytes[];
    // K, V (64 x kHeadDim, core matrices); K again row-major (64 x kStride) for dQ; dS
    // (kBlockM x kSStride); per stage Q, dO (kBlockM x kHeadDim, core matrices) and lse (base 2),
    // delta (kBlockM floats each).
    T* sK = reinterpret_cast<T*>(smem_bytes);
    T* sV = sK + kKeys * kHeadDim;
    T* sKRows = sV + kKeys * kHeadDim;
    T* sDS = sKRows + kKeys * kStride;
    T* sQDO = sDS + kBlockM * kSStride;
    float* sStats = reinterpret_cast<float*>(sQDO + 2 * 2 * kBlockM * kHeadDim);
    // Stages by arithmetic: a run-time index into an array of pointers would be local memory.
    auto sQ = [&](int stage) { return sQDO + stage * 2 * kBlockM * kHeadDim; };
    auto sDO = [&](int stage) { return sQ(stage) + kBlockM * kHeadDim; };
    auto sLse2 = [&](int stage) { return sStats + stage * 2 * kBlockM; };
    auto sDelta = [&](int stage) { return sLse2(stage) + kBlockM; };

    const BlockInfo b(p, blockIdx.y, blockIdx.z);
    const ScoreTransform score(p, b);
    const Dropout dropout(p, b);
    const HeadView at = head_view(p, b, strides);  // .o is dout; .stats indexes lse, delta, dq rows
    const int n0 = blockIdx.x * kKeys;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const bool vq = vectorised & 1, vk = vectorised & 2, vv = vectorised & 4, vdo = vectorised & 8;
    // Descriptors are built once (K, V) or once per tile (the Q and dO stages, K-major for Sᵀ and
    // dPᵀ, MN-major for dK and dV) and advanced by constant offsets within it.
    const unsigned long long k_desc = ptx::wgmma_descriptor(sK, Rows::kLbo, Rows::kSbo);
    const unsigned long long v_desc = ptx::wgmma_descriptor(sV, Rows::kLbo, Rows::kSbo);
    stage_async<kKeys, kHeadDim, Rows>(sK, k + at.k, at.k_row, n0, b.kv_rows(p), p.head_dim, vk);
    stage_async<kKeys, kHeadDim, Rows>(sV, v + at.v, at.v_row, n0, b.kv_rows(p), p.head_dim_v, vv);
    if (accumulate_dq) stage_async<kKeys, kHeadDim>(sKRows, k + at.k, at.k_row, n0, b.kv_rows(p), p.head_dim, vk);

    float dk[kDTiles][4], dv[kDTiles][4];
#pragma unroll
    for (int d = 0; d < kDTiles; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = 0.f;
    float(&dk_flat)[4 * kDTiles] = reinterpret_cast<float(&)[4 * kDTiles]>(dk);
    float(&dv_flat)[4 * kDTiles] = reinterpret_cast<float(&)[4 * kDTiles]>(dv);

    int m_begin, m_end;
    b.row_tiles(p, n0, kKeys, kBlockM, &m_begin, &m_end);
    auto stage_queries = [&](int m_block) {
        const int stage = pipeline_stage<2>(m_block, m_begin), m0 = m_block * kBlockM;
        stage_async<kBlockM, kHeadDim, Rows>(sQ(stage), q + at.q, at.q_row, m0, b.q_rows(p), p.head_dim, vq);
        stage_async<kBlockM, kHeadDim, Rows>(sDO(stage), dout + at.o, at.o_row, m0, b.q_rows(p), p.head_dim_v, vdo);
        stage_row_stats(sLse2(stage), sDelta(stage), lse, delta, at.stats, m0, kBlockM, b.q_rows(p));
        ptx::cp_async_commit();
    };
    if (m_begin < m_end) stage_queries(m_begin);
    for (int m_block = m_begin; m_block < m_end; ++m_block) {
        const int m0 = m_block * kBlockM, stage = pipeline_stage<2>(m_block, m_begin);
        ptx::cp_async_wait<0>();   // this thread's copies of this tile (and of K, V) have landed
        ptx::fence_proxy_async();  // and are visible to wgmma
        // Everyone's copies and statistics are in place, and every warp is done with the previous
        // tile: its dS, and the stage loaded next.
        __syncthreads();
        if (m_block + 1 < m_end) stage_queries(m_block + 1);
        const unsigned long long q_desc = ptx::wgmma_descriptor(sQ(stage), Rows::kLbo, Rows::kSbo);
        const unsigned long long do_desc = ptx::wgmma_descriptor(sDO(stage), Rows::kLbo, Rows::kSbo);
        // dO and Q read MN-major: the 8-query core-matrix rows (Rows' SBO apart) are the K
        // direction (LBO), the 8-dim core matrices (Rows' LBO apart) the N direction (SBO).
        const unsigned long long q_mn_desc = ptx::wgmma_descriptor(sQ(stage), Rows::kSbo, Rows::kLbo);
        const unsigned long long do_mn_desc = ptx::wgmma_descriptor(sDO(stage), Rows::kSbo, Rows::kLbo);

        // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (64 keys x kBlockM queries), 16 head dims per instruction.
        float st[kQTiles][4], dpt[kQTiles][4];
        float(&st_flat)[4 * kQTiles] = reinterpret_cast<float(&)[4 * kQTiles]>(st);
        float(&dpt_flat)[4 * kQTiles] = reinterpret_cast<float(&)[4 * kQTiles]>(dpt);
        ptx::fence_operands(st_flat);
        ptx::fence_operands(dpt_flat);
        ptx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk)
            ptx::wgmma_m64k16_ss<T, kBlockM, ptx::Major::K>(
                st_flat, ptx::descriptor_plus(k_desc, sizeof(T) * Rows::offset(0, 16 * kk)),
                ptx::descriptor_plus(q_desc, sizeof(T) * Rows::offset(0, 16 * kk)), kk > 0);
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk)
            ptx::wgmma_m64k16_ss<T, kBlockM, ptx::Major::K>(
                dpt_flat, ptx::descriptor_plus(v_desc, sizeof(T) * Rows::offset(0, 16 * kk)),
                ptx::descriptor_plus(do_desc, sizeof(T) * Rows::offset(0, 16 * kk)), kk > 0);
        ptx::wgmma_commit();
        ptx::wgmma_wait<0>();  // Sᵀ and dPᵀ are in registers
        ptx::fence_operands(st_flat);
        ptx::fence_operands(dpt_flat);

        // Pᵀ and dSᵀ in place of Sᵀ and dPᵀ; dS also to shared memory (queries as rows) for dQ.
        const int checks = b.tile_checks(p, m0, kBlockM, n0, kKeys);
        probabilities_and_ds<kSStride>(st, dpt, p, b, score, dropout, sLse2(stage), sDelta(stage), sDS, accumulate_dq, m0, n0,
                                       warp * 16, g, t, checks);

        // dV += Pᵀ·dO and dK += dSᵀ·Q: Pᵀ and dSᵀ re-packed as A fragments (16 queries each),
        // all of them before the first instruction reads them asynchronously.
        unsigned pa[kBlockM / 16][4], da[kBlockM / 16][4];
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk) {
            accumulators_as_a<T>(pa[kk], st[2 * kk], st[2 * kk + 1]);
            accumulators_as_a<T>(da[kk], dpt[2 * kk], dpt[2 * kk + 1]);
        }
        unsigned(&pa_flat)[kBlockM / 4] = reinterpret_cast<unsigned(&)[kBlockM / 4]>(pa);
        unsigned(&da_flat)[kBlockM / 4] = reinterpret_cast<unsigned(&)[kBlockM / 4]>(da);
        ptx::fence_operands(pa_flat);
        ptx::fence_operands(da_flat);
        ptx::fence_operands(dk_flat);
        ptx::fence_operands(dv_flat);
        ptx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
            for (int c = 0; c < kHeadDim / kWgmmaBwdDims; ++c) {
                const unsigned chunk = sizeof(T) * Rows::offset(16 * kk, c * kWgmmaBwdDims);  // queries 16kk.., dims 64c..
                ptx::wgmma_m64k16_rs<T, kWgmmaBwdDims, ptx::Major::MN>(
                    reinterpret_cast<float(&)[32]>(dv_flat[c * kWgmmaBwdDims / 2]), pa[kk],
                    ptx::descriptor_plus(do_mn_desc, chunk), 1);
                ptx::wgmma_m64k16_rs<T, kWgmmaBwdDims, ptx::Major::MN>(
                    reinterpret_cast<float(&)[32]>(dk_flat[c * kWgmmaBwdDims / 2]), da[kk],
                    ptx::descriptor_plus(q_mn_desc, chunk), 1);
            }
        ptx::wgmma_commit();

        if (accumulate_dq) {
            __syncthreads();  // every warp's dS is in shared memory
            atomic_dq<T, kHeadDim, kBlockM, kKeys, kSStride>(p, b, at, dq_accum, sDS, sKRows, m0, warp, lane);
        }
        ptx::wgmma_wait<0>();  // dK and dV are in registers; Pᵀ, dSᵀ and this stage's Q, dO are free
        ptx::fence_operands(dk_flat);
        ptx::fence_operands(dv_flat);
        ptx::fence_operands(pa_flat);
        ptx::fence_operands(da_flat);
    }

    store_dkdv(p, b, dk_part, dv_part, dk, dv, n0, warp * 16, 0, g, t);
}

}  // namespace attn

// grid (ceil(Sk / 64), H, B), block 128 (one warpgroup), dynamic shared memory as laid out in
// dkdv_wgmma_block (HopperBackwardTile.shared_bytes). vectorised: bits 0-3 for q, k, v, dout
// rows copyable in 16-byte chunks. Compiled for sm_90a only.
template <class T, int kHeadDim, int kBlockM>
__global__ void __launch_bounds__(attn::kThreads, 1)
attention_bwd_dkdv_wgmma(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,
                         float* dq_accum, float* dk_part, float* dv_part, int accumulate_dq, int vectorised, ATTN_PARAMS) {
    ATTN_UNPACK_PARAMS;
    attn::dkdv_wgmma_block<T, kHeadDim, kBlockM>(p, q, k, v, dout, lse, delta, dq_accum, dk_part, dv_part, accumulate_dq,
                                                 vectorised, strides);
}
