// The Hopper (sm_90a) forward for fp16/bf16: FlashAttention-2's algorithm on wgmma.
//
// One block is one warpgroup (4 warps, 128 threads) per (64 query rows, head, batch entry). The
// accumulators of wgmma m64nNk16 give warp w rows 16w..16w+15 in the same layout as mma.sync's,
// so the online softmax, the re-packing of P as an A operand and the epilogue are those of
// attention_fwd_tc.cu (tc_forward.cuh). Per tile of kBlockN keys (the tile table's block_n: 64 or
// 128, the N of the S instruction):
//   S = Q·Kᵀ     wgmma SS: Q in shared memory in the core-matrix layout (cp.async, once per
//                block), K in boxes of 64 head dims that TMA loads with 128-byte swizzle (K and V
//                in two stages: thread 0 loads the next tile during this one, its bytes completing
//                on the stage's mbarrier); K is S's B operand K-major (its head dims, the reduced
//                ones, are consecutive)
//   O += P·V     wgmma RS: P from registers, V from shared memory in the same boxes as K, read as
//                an MN-major B operand (its head dims, N here, are consecutive): no transpose; up
//                to 128 head dims per instruction
// TMA makes each thread's staging of K and V one mbarrier wait (thread 0 issues the copies); the
// launcher uses this kernel where TMA can address K and V (cupy_attn/_tensor_map.py) and the
// mma.sync forward elsewhere. Q's cp.async copies are fenced to the async proxy before the barrier
// that precedes the first wgmma reading them.
#include "block_info.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "numeric.cuh"
#include "ptx.cuh"
#include "softmax.cuh"
#include "tc_forward.cuh"
#include "tc_tile.cuh"

namespace attn {

template <class T, int kHeadDim, int kBlockN>
__device__ __forceinline__ void forward_wgmma_block(const Params& p, const T* q, T* out, float* lse,
                                                    const long long (&strides)[12], int vectorised,
                                                    const ptx::TensorMap& k_map, const ptx::TensorMap& v_map) {
    // Head dims per P·V instruction (its N): all of them up to 128 (one m64n128k16 covers O's 64
    // accumulators per lane at D = 128), in instructions of 128 beyond.
    constexpr int kPvDims = kHeadDim < 128 ? kHeadDim : 128;
    static_assert(kHeadDim % 64 == 0 && kHeadDim % kPvDims == 0, "head-dim tiles are multiples of 64");
    static_assert(kBlockN == 64 || kBlockN == 128, "S instructions m64n64k16 or m64n128k16");
    using QTile = CoreMatrixLayout<kHeadDim>;                 // Q: rows x head dims
    using KvTile = SwizzledBoxLayout<kBlockN, kHeadDim>;      // K and V: keys x head dims
    constexpr int kNTiles = kBlockN / 8;     // 8-key column tiles of S
    constexpr int kDTiles = kHeadDim / 8;    // 8-dim column tiles of O
    constexpr unsigned kStageBytes = sizeof(T) * kBlockN * kHeadDim;  // one stage of K or of V
    extern __shared__ __align__(1024) unsigned char smem_bytes[];
    // Q (64 x kHeadDim), K stages 0 and 1, V stages 0 and 1 (kBlockN x kHeadDim each; all
    // multiples of 1024 bytes, so every box starts a swizzle atom), then each stage's mbarrier.
    // Stages by arithmetic: a run-time index into a pointer array would put it in local memory.
    T* sQ = reinterpret_cast<T*>(smem_bytes);
    auto stage_k = [&](int stage) { return sQ + (kTcBlockM + kBlockN * stage) * kHeadDim; };
    auto stage_v = [&](int stage) { return stage_k(2) + kBlockN * kHeadDim * stage; };
    unsigned long long* landed = reinterpret_cast<unsigned long long*>(stage_v(2));  // [2]

    const BlockInfo b(p, blockIdx.y, blockIdx.z);
    const ScoreTransform score(p, b);
    const Dropout dropout(p, b);
    const HeadView at = head_view(p, b, strides);
    const int m0 = blockIdx.x * kTcBlockM;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
    const int row_lo = m0 + warp * 16 + lane / 4;  // this lane's two rows: row_lo and row_lo + 8

    // Descriptors built once per block; a tile's stage and a k-step's columns are offsets added to
    // them.
    const unsigned long long q_desc = ptx::wgmma_descriptor(sQ, QTile::kLbo, QTile::kSbo);
    const unsigned long long k_desc0 =
        ptx::wgmma_descriptor(stage_k(0), KvTile::kKMajorLbo, KvTile::kKMajorSbo, ptx::Swizzle::B128);
    const unsigned long long v_desc0 =
        ptx::wgmma_descriptor(stage_v(0), KvTile::kMnMajorLbo, KvTile::kMnMajorSbo, ptx::Swizzle::B128);

    float o[kDTiles][4];
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float(&o_flat)[4 * kDTiles] = reinterpret_cast<float(&)[4 * kDTiles]>(o);
    OnlineSoftmax<4> softmax[2];

    int n_begin, n_end;
    b.key_tiles(p, m0, kTcBlockM, kBlockN, &n_begin, &n_end);
    // Thread 0: the boxes of K and V of tile n_block (64 head dims each; TMA zero-fills keys past
    // seq_k and dims past the head; keys between a batch entry's length and seq_k are read, and
    // masked, as the cp.async kernels do) into its stage, announced on the stage's mbarrier.
    auto load_keys = [&](int n_block) {
        const int stage = pipeline_stage<2>(n_block, n_begin);
        ptx::mbarrier_arrive_expect_tx(&landed[stage], 2 * kStageBytes);
#pragma unroll
        for (int c = 0; c < kHeadDim / KvTile::kBoxCols; ++c) {
            const int box[4] = {c * KvTile::kBoxCols, n_block * kBlockN, b.bidh_kv, b.bidb};
            ptx::tma_load<4>(stage_k(stage) + KvTile::offset(0, c * KvTile::kBoxCols), k_map, box, &landed[stage]);
            ptx::tma_load<4>(stage_v(stage) + KvTile::offset(0, c * KvTile::kBoxCols), v_map, box, &landed[stage]);
        }
    };
    if (n_begin < n_end) {  // Q only then: the epilogue stages O in Q's rows, where no copy may still land
        stage_async<kTcBlockM, kHeadDim, QTile>(sQ, q + at.q, at.q_row, m0, b.q_rows(p), p.head_dim, vectorised & 1);
        ptx::cp_async_commit();
        if (threadIdx.x == 0) {
            ptx::mbarrier_init(&landed[0], 1);
            ptx::mbarrier_init(&landed[1], 1);
            ptx::fence_mbarrier_init();
        }
        ptx::cp_async_wait<0>();    // this thread's copies of Q have landed
        ptx::fence_proxy_async();   // and are visible to wgmma
        __syncthreads();            // everyone's, and the mbarriers are initialised
        if (threadIdx.x == 0) load_keys(n_begin);
    }
    for (int n_block = n_begin; n_block < n_end; ++n_block) {
        const int n0 = n_block * kBlockN;
        const int stage = pipeline_stage<2>(n_block, n_begin);
        const unsigned long long k_desc = ptx::descriptor_plus(k_desc0, stage * kStageBytes);
        const unsigned long long v_desc = ptx::descriptor_plus(v_desc0, stage * kStageBytes);
        // This tile's K and V have landed (the stage's (n_block - n_begin) / 2-th phase).
        ptx::mbarrier_wait(&landed[stage], static_cast<unsigned>(n_block - n_begin) / 2 & 1);
        // Every warp is done with the previous tile, whose stage the next load overwrites.
        __syncthreads();

        // S = Q·Kᵀ (64 rows x kBlockN keys for the warpgroup), 16 head dims per instruction.
        float s[kNTiles][4];
        float(&s_flat)[4 * kNTiles] = reinterpret_cast<float(&)[4 * kNTiles]>(s);
        ptx::fence_operands(s_flat);
        ptx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk)
            ptx::wgmma_m64k16_ss<T, kBlockN, ptx::Major::K>(
                s_flat, ptx::descriptor_plus(q_desc, sizeof(T) * QTile::offset(0, 16 * kk)),
                ptx::descriptor_plus(k_desc, sizeof(T) * KvTile::offset(0, 16 * kk)), kk > 0);
        ptx::wgmma_commit();
        if (threadIdx.x == 0 && n_block + 1 < n_end) load_keys(n_block + 1);  // while the tensor cores compute S
        ptx::wgmma_wait<0>();  // S is in registers
        ptx::fence_operands(s_flat);

        const int checks = b.tile_checks(p, m0, kTcBlockM, n0, kBlockN);
        softmax_tile(s, o, softmax, p, b, score, dropout, row_lo, n0, t, checks);

        // O += P·V: P re-packed as A fragments (16 keys each), all of them before the first
        // instruction reads them asynchronously; each instruction covers kPvDims head dims.
        unsigned pa[kBlockN / 16][4];
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) accumulators_as_a<T>(pa[kk], s[2 * kk], s[2 * kk + 1]);
        unsigned(&pa_flat)[kBlockN / 4] = reinterpret_cast<unsigned(&)[kBlockN / 4]>(pa);
        ptx::fence_operands(pa_flat);
        ptx::fence_operands(o_flat);
        ptx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk)
#pragma unroll
            for (int c = 0; c < kHeadDim / kPvDims; ++c)
                ptx::wgmma_m64k16_rs<T, kPvDims, ptx::Major::MN>(
                    reinterpret_cast<float(&)[kPvDims / 2]>(o_flat[c * kPvDims / 2]), pa[kk],
                    ptx::descriptor_plus(v_desc, sizeof(T) * KvTile::offset(16 * kk, c * kPvDims)), 1);
        ptx::wgmma_commit();
        ptx::wgmma_wait<0>();  // O is in registers before the next tile rescales it
        ptx::fence_operands(o_flat);
        ptx::fence_operands(pa_flat);
    }

    // O through this warp's rows of Q (16 of the core-matrix layout: 16·kHeadDim contiguous elements),
    // dead once its last S is in registers: every other warp's S reads only its own rows of Q.
    store_rows<T>(p, b, at, out, lse, o, softmax, row_lo, lane, sQ + 16 * warp * kHeadDim);
}

}  // namespace attn

// grid (ceil(Sq / 64), H, B) of a padded batch, block 128 threads (one warpgroup), dynamic shared
// memory: Q (64 x kHeadDim) and two stages of K and of V (kBlockN x kHeadDim each), 16-bit, and
// two mbarriers. k_map, v_map: TMA maps of k and v (head dims, keys, kv heads, batch) with boxes of
// 64 head dims x kBlockN keys and 128-byte swizzle; k and v are read through them only (their
// pointers and strides in ATTN_PARAMS go unused). vectorised: bit 0 set when q's rows may be
// copied in 16-byte chunks. Compiled for sm_90a only.
template <class T, int kHeadDim, int kBlockN>
__global__ void __launch_bounds__(attn::kThreads, 1)
attention_fwd_wgmma(const T* q, const T* k, const T* v, T* out, float* lse, int vectorised,
                    const __grid_constant__ ptx::TensorMap k_map, const __grid_constant__ ptx::TensorMap v_map,
                    ATTN_PARAMS) {
    ATTN_UNPACK_PARAMS;
    attn::forward_wgmma_block<T, kHeadDim, kBlockN>(p, q, out, lse, strides, vectorised, k_map, v_map);
}
