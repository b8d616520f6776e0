// The Hopper (sm_90a) forward for fp16/bf16: FlashAttention-2's algorithm on wgmma.
//
// One block is one warpgroup (4 warps, 128 threads) per (64 query rows, head, batch entry). The
// accumulators of wgmma m64n64k16 give warp w rows 16w..16w+15 in the same layout as mma.sync's,
// so the online softmax, the re-packing of P as an A operand and the epilogue are those of
// attention_fwd_tc.cu (tc_forward.cuh). Per tile of 64 keys:
//   S = Q·Kᵀ     wgmma SS: Q and K in shared memory in the K-major core-matrix layout, copied
//                there by cp.async (K in two stages: the next tile loads during this one)
//   Vᵀ           V arrives row-major (cp.async, two stages); while the tensor cores compute S,
//                the block transposes it into the K-major layout of P·V's B operand
//   O += P·V     wgmma RS: P from registers, Vᵀ from shared memory, 64 head dims per instruction
// Shared memory written by the generic proxy (cp.async, stores) is fenced to the async proxy
// before the barrier that precedes the wgmma reading it.
#include "block_info.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "numeric.cuh"
#include "ptx.cuh"
#include "softmax.cuh"
#include "tc_forward.cuh"
#include "tc_tile.cuh"

namespace attn {

constexpr int kWgmmaKeys = 64;  // keys per tile: N of the S instruction, K of P·V
constexpr int kWgmmaDims = 64;  // head dims per P·V instruction (its N)

template <class T, int kHeadDim>
__device__ __forceinline__ void forward_wgmma_block(const Params& p, const T* q, const T* k, const T* v, T* out,
                                                    float* lse, const long long (&strides)[12], int vectorised) {
    static_assert(kHeadDim % kWgmmaDims == 0, "head-dim tiles are multiples of 64");
    using QK = CoreMatrixLayout<kHeadDim>;    // Q and K tiles: rows x head dims
    using VT = CoreMatrixLayout<kWgmmaKeys>;  // Vᵀ: head dims x keys
    constexpr int kStride = TcLayout<kHeadDim>::kStride;
    constexpr int kNTiles = kWgmmaKeys / 8;  // 8-key column tiles of S
    constexpr int kDTiles = kHeadDim / 8;    // 8-dim column tiles of O
    extern __shared__ __align__(128) unsigned char smem_bytes[];
    // Q (64 x kHeadDim), K stages 0 and 1 (64 x kHeadDim), V stages 0 and 1 (64 x kStride), Vᵀ
    // (kHeadDim x 64). Stages by arithmetic: a run-time index into a pointer array would put it
    // in local memory.
    T* sQ = reinterpret_cast<T*>(smem_bytes);
    auto stage_k = [&](int stage) { return sQ + (kTcBlockM + kWgmmaKeys * stage) * kHeadDim; };
    auto stage_v = [&](int stage) { return stage_k(2) + kWgmmaKeys * kStride * stage; };
    T* sVt = stage_v(2);

    const BlockInfo b(p, blockIdx.y, blockIdx.z);
    const ScoreTransform score(p, b);
    const Dropout dropout(p, b);
    const HeadView at = head_view(p, b, strides);
    const int m0 = blockIdx.x * kTcBlockM;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
    const int row_lo = m0 + warp * 16 + lane / 4;  // this lane's two rows: row_lo and row_lo + 8
    const bool vq = vectorised & 1, vk = vectorised & 2, vv = vectorised & 4;

    stage_async<kTcBlockM, kHeadDim, QK>(sQ, q + at.q, at.q_row, m0, b.q_rows(p), p.head_dim, vq);

    float o[kDTiles][4];
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float(&o_flat)[4 * kDTiles] = reinterpret_cast<float(&)[4 * kDTiles]>(o);
    OnlineSoftmax<4> softmax[2];

    int n_begin, n_end;
    b.key_tiles(p, m0, kTcBlockM, kWgmmaKeys, &n_begin, &n_end);
    auto stage_keys = [&](int n_block) {
        const int stage = (n_block - n_begin) % 2;
        stage_async<kWgmmaKeys, kHeadDim, QK>(stage_k(stage), k + at.k, at.k_row, n_block * kWgmmaKeys, b.kv_rows(p),
                                              p.head_dim, vk);
        stage_async<kWgmmaKeys, kHeadDim>(stage_v(stage), v + at.v, at.v_row, n_block * kWgmmaKeys, b.kv_rows(p),
                                          p.head_dim_v, vv);
        ptx::cp_async_commit();
    };
    if (n_begin < n_end) stage_keys(n_begin);
    for (int n_block = n_begin; n_block < n_end; ++n_block) {
        const int n0 = n_block * kWgmmaKeys;
        const T* sK = stage_k((n_block - n_begin) % 2);
        const T* sV = stage_v((n_block - n_begin) % 2);
        ptx::cp_async_wait<0>();    // this thread's copies of this tile (and of Q) have landed
        ptx::fence_proxy_async();   // and are visible to wgmma
        // Everyone's copies have landed, and every warp is done with the previous tile: its Vᵀ,
        // and the stage the next prefetch overwrites.
        __syncthreads();
        if (n_block + 1 < n_end) stage_keys(n_block + 1);

        // S = Q·Kᵀ (64 rows x 64 keys for the warpgroup), 16 head dims per instruction.
        float s[kNTiles][4];
        float(&s_flat)[4 * kNTiles] = reinterpret_cast<float(&)[4 * kNTiles]>(s);
        ptx::fence_operands(s_flat);
        ptx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk)
            ptx::wgmma_m64k16_ss<T, kWgmmaKeys>(s_flat,
                                       ptx::wgmma_descriptor(sQ + kk * 128, QK::kLbo, QK::kSbo),
                                       ptx::wgmma_descriptor(sK + kk * 128, QK::kLbo, QK::kSbo), kk > 0);
        ptx::wgmma_commit();

        // Vᵀ while the tensor cores work.
        transpose_into_core<kWgmmaKeys, kHeadDim, PaddedRowLayout<kHeadDim>>(sVt, sV);
        ptx::fence_proxy_async();
        ptx::wgmma_wait<0>();  // S is in registers
        ptx::fence_operands(s_flat);
        __syncthreads();       // every thread's part of Vᵀ is in place

        const int checks = b.tile_checks(p, m0, kTcBlockM, n0, kWgmmaKeys);
        softmax_tile(s, o, softmax, p, b, score, dropout, row_lo, n0, t, checks);

        // O += P·V: P re-packed as A fragments (16 keys each), all of them before the first
        // instruction reads them asynchronously; each instruction covers 64 head dims.
        unsigned pa[kWgmmaKeys / 16][4];
#pragma unroll
        for (int kk = 0; kk < kWgmmaKeys / 16; ++kk) accumulators_as_a<T>(pa[kk], s[2 * kk], s[2 * kk + 1]);
        unsigned(&pa_flat)[kWgmmaKeys / 4] = reinterpret_cast<unsigned(&)[kWgmmaKeys / 4]>(pa);
        ptx::fence_operands(pa_flat);
        ptx::fence_operands(o_flat);
        ptx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kWgmmaKeys / 16; ++kk)
#pragma unroll
            for (int c = 0; c < kHeadDim / kWgmmaDims; ++c)
                ptx::wgmma_m64k16_rs<T, kWgmmaDims>(reinterpret_cast<float(&)[32]>(o_flat[c * kWgmmaDims / 2]), pa[kk],
                                           ptx::wgmma_descriptor(sVt + c * kWgmmaDims * kWgmmaKeys + kk * 128,
                                                                 VT::kLbo, VT::kSbo), 1);
        ptx::wgmma_commit();
        ptx::wgmma_wait<0>();  // O is in registers before the next tile rescales it
        ptx::fence_operands(o_flat);
        ptx::fence_operands(pa_flat);
    }

    store_rows<T>(p, b, at, out, lse, o, softmax, row_lo, t);
}

}  // namespace attn

// grid (ceil(Sq / 64), H, B), block 128 threads (one warpgroup), dynamic shared memory: Q and
// two stages of K (64 x kHeadDim each), two stages of V (64 x (kHeadDim + 8)) and Vᵀ
// (kHeadDim x 64), 16-bit. vectorised: bit 0/1/2 set when q/k/v rows may be copied in 16-byte
// chunks. Compiled for sm_90a only.
template <class T, int kHeadDim>
__global__ void __launch_bounds__(attn::kThreads, 1)
attention_fwd_wgmma(const T* q, const T* k, const T* v, T* out, float* lse, int vectorised, ATTN_PARAMS) {
    ATTN_UNPACK_PARAMS;
    attn::forward_wgmma_block<T, kHeadDim>(p, q, k, v, out, lse, strides, vectorised);
}
