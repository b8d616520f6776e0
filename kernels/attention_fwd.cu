// The forward kernel: FlashAttention-2's tiled online softmax on CUDA cores (FMA), exact in fp32.
//
// One block of 128 threads per (query tile of kBlockM rows, head, batch entry). Each warp owns
// kBlockM / 4 rows; each row is spread over kLanesPerRow consecutive lanes, which hold every
// kLanesPerRow-th key of the tile's scores and every kLanesPerRow-th output dimension, so the row
// max and sum need only shuffles among those lanes. Q, K and V tiles are staged in shared memory
// as float (zero-padded past D and past the sequence, so padding never produces NaN); the loop
// visits only the key tiles the block may attend (causal, window and lengths) and applies the
// structural mask only on boundary tiles.
#include "block_info.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "numeric.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"

namespace attn {

// Shared memory, in floats: Q (kBlockM, D) | K (kBlockN, D + 1) | V (kBlockN, D) | P (kBlockM, kBlockN).
// K rows are padded by one float so the lanes of a row, which read K[j][d] for consecutive j,
// hit different banks.
template <int kHeadDim, int kBlockM, int kBlockN>
struct FwdSmem {
    static constexpr int kKStride = kHeadDim + 1;
    static constexpr int kQ = 0;
    static constexpr int kK = kQ + kBlockM * kHeadDim;
    static constexpr int kV = kK + kBlockN * kKStride;
    static constexpr int kP = kV + kBlockN * kHeadDim;
    static constexpr int kFloats = kP + kBlockM * kBlockN;
};

template <class T, int kHeadDim, int kBlockM, int kBlockN, int kLanesPerRow>
__device__ __forceinline__ void forward_block(const Params& p, const T* q, const T* k, const T* v, T* out, float* lse,
                                              const long long (&strides)[12]) {
    constexpr int kRowsPerWarp = 32 / kLanesPerRow;
    static_assert(kBlockM == kRowsPerWarp * kThreads / 32, "4 warps of kRowsPerWarp rows");
    constexpr int kCols = kBlockN / kLanesPerRow;   // scores per lane per tile
    constexpr int kDims = kHeadDim / kLanesPerRow;  // output dimensions per lane
    using Smem = FwdSmem<kHeadDim, kBlockM, kBlockN>;
    extern __shared__ float smem[];
    float* sQ = smem + Smem::kQ;  // (kBlockM, kHeadDim)
    float* sK = smem + Smem::kK;  // (kBlockN, kHeadDim + 1)
    float* sV = smem + Smem::kV;  // (kBlockN, kHeadDim)
    float* sP = smem + Smem::kP;  // (kBlockM, kBlockN)

    const BlockInfo b(p, blockIdx.y, blockIdx.z);
    const int m0 = blockIdx.x * kBlockM;  // first query row of the tile
    const ScoreTransform score(p, b);
    const Dropout dropout(p, b);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = warp * kRowsPerWarp + lane / kLanesPerRow;  // this lane's row in the tile
    const int part = lane % kLanesPerRow;                       // which of the row's lanes
    const int i = m0 + row;                                   // global query index

    const HeadView at = head_view(p, b, strides);
    stage_tile<kBlockM, kHeadDim, kHeadDim>(sQ, q + at.q, at.q_row, m0, b.q_rows(p), p.head_dim);

    OnlineSoftmax<kLanesPerRow> softmax;
    float acc[kDims];  // output row, dimensions part + kLanesPerRow · e
    for (int e = 0; e < kDims; ++e) acc[e] = 0.f;

    for (TileWalk keys = b.key_walk(p, m0, kBlockM, kBlockN); keys.more(); keys.advance()) {
        const int n0 = keys.tile * kBlockN;
        __syncthreads();  // everyone is done reading the previous K, V (and P) tiles
        stage_tile<kBlockN, kHeadDim, Smem::kKStride>(sK, k + at.k, at.k_row, n0, b.kv_rows(p), p.head_dim);
        stage_tile<kBlockN, kHeadDim, kHeadDim>(sV, v + at.v, at.v_row, n0, b.kv_rows(p), p.head_dim_v);
        __syncthreads();  // Q (first pass), K and V staged

        float s[kCols];  // scores of keys n0 + part + kLanesPerRow · c
        for (int c = 0; c < kCols; ++c) s[c] = 0.f;
        for (int d = 0; d < kHeadDim; ++d) {
            const float qd = sQ[row * kHeadDim + d];
            for (int c = 0; c < kCols; ++c) s[c] = fmaf(qd, sK[(part + kLanesPerRow * c) * Smem::kKStride + d], s[c]);
        }
        const int checks = b.tile_checks(p, m0, kBlockM, n0, kBlockN);
        for (int c = 0; c < kCols; ++c) s[c] = score(p, b, s[c], i, Index(n0 + part, kLanesPerRow * c), checks);

        const float rescale = softmax.update(s, score.softmax_scale());
        for (int e = 0; e < kDims; ++e) acc[e] *= rescale;
        for (int c = 0; c < kCols; ++c)  // after the row sum, which takes every probability
            sP[row * kBlockN + part + kLanesPerRow * c] = s[c] * dropout.factor(i, n0 + part + kLanesPerRow * c);
        __syncwarp();  // the row's probabilities, written by its lanes (all in this warp), are visible
        for (int j = 0; j < kBlockN; ++j) {
            const float pj = sP[row * kBlockN + j];
            for (int e = 0; e < kDims; ++e) acc[e] = fmaf(pj, sV[j * kHeadDim + part + kLanesPerRow * e], acc[e]);
        }
    }

    // Every row of the tile inside the sequence is written, padding rows and fully masked rows
    // included (as 0), so no output element is left unwritten.
    softmax.gather_sum();  // every lane: the shuffles need the whole warp
    if (i < b.q_rows(p)) {
        const float sink_rescale = softmax.add_sink(sink_log2(p, b));  // before inverse_sum and lse
        const float inv = sink_rescale * softmax.inverse_sum();
        for (int e = 0; e < kDims; ++e) {
            const int d = part + kLanesPerRow * e;
            if (d < p.head_dim_v) out[at.o + i * at.o_row + d] = from_float<T>(acc[e] * inv);
        }
        if (part == 0) lse[at.stats + i] = softmax.lse();
    }
}

}  // namespace attn

// grid (ceil(Sq / kBlockM), H, B), block 128 threads, dynamic shared memory FwdSmem::kFloats · 4.
// minBlocksPerSM 4: at most 128 registers, 4 blocks per SM (the tiles' shared memory allows 2-5).
// Left to itself ptxas gave the D = 32 build with softcap, ALiBi and a float mask 80 registers on
// sm_90 and spilled 12 bytes (NVRTC 13.5); with a minimum of 1 it took up to 233.
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kLanesPerRow>
__global__ void __launch_bounds__(attn::kThreads, 4)
attention_fwd(const T* q, const T* k, const T* v, T* out, float* lse, ATTN_PARAMS) {
    ATTN_UNPACK_PARAMS;
    attn::forward_block<T, kHeadDim, kBlockM, kBlockN, kLanesPerRow>(p, q, k, v, out, lse, strides);
}
