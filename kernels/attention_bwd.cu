// The backward kernels, FlashAttention-2's algorithm on CUDA cores (FMA), exact in fp32:
//   attention_bwd_preprocess  delta = rowsum(dO ∘ O) per query row;
//   attention_bwd_dkdv        one block per (key tile, query head, batch entry): loops over the
//                             query tiles that can see its keys, recomputes P = exp(s - lse)
//                             from the saved lse, accumulates dV += Pᵀ·dO and dK += dSᵀ·Q·scale
//                             in registers with dS = P ∘ (dP - delta), dP = dO·Vᵀ, and (unless
//                             deterministic) adds dQ += dS·K·scale into a float32 buffer with
//                             atomics;
//   attention_bwd_dq          the deterministic dQ: one block per query tile loops over key
//                             tiles and accumulates dQ in registers, no atomics.
// Without GQA, dK and dV are written per head (float32, (B, H, Sk, D)); a GQA group's query
// heads add theirs to their kv head's (B, Hkv, Sk, D) by atomics, or in deterministic mode write
// them per query head for the host to sum each group in a fixed order, bit-identical run to run
// (DkdvOut).
#include "block_info.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "numeric.cuh"
#include "backward_stats.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"

namespace attn {

// Shared memory of the dK/dV kernel, in floats: Q, dO (kBlockM, D) | K, V (kBlockN, D + 1) |
// P, dS (kBlockM, kBlockN) | lse2, delta (kBlockM). K and V rows are padded by one float: the
// threads computing one row of scores read K[j][d] (and V[j][d]) for consecutive j.
template <int kHeadDim, int kBlockM, int kBlockN>
struct DkdvSmem {
    static constexpr int kKStride = kHeadDim + 1;
    static constexpr int kQ = 0, kDO = kQ + kBlockM * kHeadDim, kK = kDO + kBlockM * kHeadDim;
    static constexpr int kV = kK + kBlockN * kKStride, kP = kV + kBlockN * kKStride;
    static constexpr int kDS = kP + kBlockM * kBlockN, kLse = kDS + kBlockM * kBlockN, kDelta = kLse + kBlockM;
    static constexpr int kFloats = kDelta + kBlockM;
};

template <class T, int kHeadDim, int kBlockM, int kBlockN>
__device__ __forceinline__ void dkdv_block(const Params& p, const T* q, const T* k, const T* v, const T* dout,
                                           const float* lse, const float* delta, float* dq_accum, float* dk_part,
                                           float* dv_part, int accumulate_dq, int dkdv_out,
                                           const long long (&strides)[12]) {
    using Smem = DkdvSmem<kHeadDim, kBlockM, kBlockN>;
    constexpr int kPerKey = kThreads / kBlockN;        // threads per key row of dK/dV
    constexpr int kKeyDims = kHeadDim / kPerKey;       // dK (and dV) dims per thread
    constexpr int kPerRow = kThreads / kBlockM;        // threads per query row of dQ
    constexpr int kRowDims = kHeadDim / kPerRow;       // dQ dims per thread
    constexpr int kEntries = kBlockM * kBlockN / kThreads;  // score entries per thread
    static_assert(kThreads % kBlockN == 0 && kThreads % kBlockM == 0 && (kBlockM * kBlockN) % kThreads == 0, "tile");
    extern __shared__ float smem[];
    float *sQ = smem + Smem::kQ, *sDO = smem + Smem::kDO, *sK = smem + Smem::kK, *sV = smem + Smem::kV;
    float *sP = smem + Smem::kP, *sDS = smem + Smem::kDS, *sLse2 = smem + Smem::kLse, *sDelta = smem + Smem::kDelta;

    const BlockInfo b(p, blockIdx.y, blockIdx.z);
    const ScoreTransform score(p, b);
    const Dropout dropout(p, b);
    const int n0 = blockIdx.x * kBlockN;
    const HeadView at = head_view(p, b, strides);  // .o is dout; .stats indexes lse, delta and dq rows
    stage_tile<kBlockN, kHeadDim, Smem::kKStride>(sK, k + at.k, at.k_row, n0, b.kv_rows(p), p.head_dim);
    stage_tile<kBlockN, kHeadDim, Smem::kKStride>(sV, v + at.v, at.v_row, n0, b.kv_rows(p), p.head_dim_v);

    const int key = threadIdx.x / kPerKey, key_part = threadIdx.x % kPerKey;  // this thread's dK/dV row
    const int qrow = threadIdx.x / kPerRow, row_part = threadIdx.x % kPerRow;  // this thread's dQ row
    float dk[kKeyDims], dv[kKeyDims];
    for (int e = 0; e < kKeyDims; ++e) dk[e] = dv[e] = 0.f;

    for (TileWalk rows = b.row_walk(p, n0, kBlockN, kBlockM); rows.more(); rows.advance()) {
        const int m0 = rows.tile * kBlockM;
        __syncthreads();  // the previous query tile's Q, dO, P and dS are no longer read
        stage_tile<kBlockM, kHeadDim, kHeadDim>(sQ, q + at.q, at.q_row, m0, b.q_rows(p), p.head_dim);
        stage_tile<kBlockM, kHeadDim, kHeadDim>(sDO, dout + at.o, at.o_row, m0, b.q_rows(p), p.head_dim_v);
        stage_row_stats(sLse2, sDelta, lse, delta, at.stats, m0, kBlockM, b.q_rows(p));
        __syncthreads();  // K, V (first pass), Q, dO and the row statistics are staged

        const int checks = b.tile_checks(p, m0, kBlockM, n0, kBlockN);
        for (int e = 0; e < kEntries; ++e) {
            const int idx = threadIdx.x + kThreads * e, r = idx / kBlockN, c = idx % kBlockN;
            float qk = 0.f, dp = 0.f;
            for (int d = 0; d < kHeadDim; ++d) {
                qk = fmaf(sQ[r * kHeadDim + d], sK[c * Smem::kKStride + d], qk);
                dp = fmaf(sDO[r * kHeadDim + d], sV[c * Smem::kKStride + d], dp);
            }
            const float prob = probability(score(p, b, qk, m0 + r, n0 + c, checks), sLse2[r], score.softmax_scale());
            const float z = dropout.factor(m0 + r, n0 + c);  // out = (P ∘ z)·V
            sP[idx] = prob * z;
            sDS[idx] = prob * (dp * z - sDelta[r]) * score.grad(p, b, qk, m0 + r, n0 + c, prob);  // dS of q·k·scale
        }
        __syncthreads();  // P and dS complete

        for (int r = 0; r < kBlockM; ++r) {
            const float pr = sP[r * kBlockN + key], dsr = sDS[r * kBlockN + key];
            for (int e = 0; e < kKeyDims; ++e) {
                const int d = key_part + kPerKey * e;
                dv[e] = fmaf(pr, sDO[r * kHeadDim + d], dv[e]);
                dk[e] = fmaf(dsr, sQ[r * kHeadDim + d], dk[e]);
            }
        }
        if (accumulate_dq && m0 + qrow < b.q_rows(p)) {
            for (int e = 0; e < kRowDims; ++e) {
                const int d = row_part + kPerRow * e;
                if (d >= p.head_dim) break;
                float sum = 0.f;
                for (int c = 0; c < kBlockN; ++c) sum = fmaf(sDS[qrow * kBlockN + c], sK[c * Smem::kKStride + d], sum);
                atomicAdd(dq_accum + (at.stats + m0 + qrow) * p.head_dim + d, sum * p.scale);
            }
        }
    }

    // Every key row inside the sequence is written, those no query could see included (as 0), or
    // added to its kv head's row.
    if (n0 + key < b.kv_rows(p)) {
        const bool add = dkdv_out == kDkdvFloatAdded;
        const long long out_row = (add ? b.kv_key_stats(p) : b.key_stats(p)) + n0 + key;
        const auto put = [add](float* dst, float value) {
            if (add) atomicAdd(dst, value);
            else *dst = value;
        };
        for (int e = 0; e < kKeyDims; ++e) {
            const int d = key_part + kPerKey * e;
            if (d < p.head_dim) put(dk_part + out_row * p.head_dim + d, dk[e] * p.scale);
            if (d < p.head_dim_v) put(dv_part + out_row * p.head_dim_v + d, dv[e]);
        }
    }
}

// Shared memory of the dQ kernel, in floats: Q, dO (kBlockM, D) | K, V (kBlockN, D + 1) |
// dS (kBlockM, kBlockN) | lse2, delta (kBlockM).
template <int kHeadDim, int kBlockM, int kBlockN>
struct DqSmem {
    static constexpr int kKStride = kHeadDim + 1;
    static constexpr int kQ = 0, kDO = kQ + kBlockM * kHeadDim, kK = kDO + kBlockM * kHeadDim;
    static constexpr int kV = kK + kBlockN * kKStride, kDS = kV + kBlockN * kKStride;
    static constexpr int kLse = kDS + kBlockM * kBlockN, kDelta = kLse + kBlockM;
    static constexpr int kFloats = kDelta + kBlockM;
};

// The deterministic dQ: laid out like the forward (each query row on kLanesPerRow lanes of one
// warp), accumulating dQ = Σ_key-tiles dS·K·scale in registers in a fixed order.
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kLanesPerRow>
__device__ __forceinline__ void dq_block(const Params& p, const T* q, const T* k, const T* v, const T* dout,
                                         const float* lse, const float* delta, float* dq_accum,
                                         const long long (&strides)[12]) {
    using Smem = DqSmem<kHeadDim, kBlockM, kBlockN>;
    constexpr int kRowsPerWarp = 32 / kLanesPerRow;
    static_assert(kBlockM == kRowsPerWarp * kThreads / 32, "4 warps of kRowsPerWarp rows");
    constexpr int kCols = kBlockN / kLanesPerRow;
    constexpr int kDims = kHeadDim / kLanesPerRow;
    extern __shared__ float smem[];
    float *sQ = smem + Smem::kQ, *sDO = smem + Smem::kDO, *sK = smem + Smem::kK, *sV = smem + Smem::kV;
    float *sDS = smem + Smem::kDS, *sLse2 = smem + Smem::kLse, *sDelta = smem + Smem::kDelta;

    const BlockInfo b(p, blockIdx.y, blockIdx.z);
    const ScoreTransform score(p, b);
    const Dropout dropout(p, b);
    const int m0 = blockIdx.x * kBlockM;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = warp * kRowsPerWarp + lane / kLanesPerRow, part = lane % kLanesPerRow;
    const HeadView at = head_view(p, b, strides);
    stage_tile<kBlockM, kHeadDim, kHeadDim>(sQ, q + at.q, at.q_row, m0, b.q_rows(p), p.head_dim);
    stage_tile<kBlockM, kHeadDim, kHeadDim>(sDO, dout + at.o, at.o_row, m0, b.q_rows(p), p.head_dim_v);
    stage_row_stats(sLse2, sDelta, lse, delta, at.stats, m0, kBlockM, b.q_rows(p));

    float acc[kDims];
    for (int e = 0; e < kDims; ++e) acc[e] = 0.f;
    for (TileWalk keys = b.key_walk(p, m0, kBlockM, kBlockN); keys.more(); keys.advance()) {
        const int n0 = keys.tile * kBlockN;
        __syncthreads();  // the previous K and V tiles are no longer read
        // K and V's offsets recomputed per tile, not held across the loop: a packed build reads
        // them from memory, and held they made ptxas spill (a padded build recomputes them anyway).
        const HeadView kv = head_view(p, b, strides);
        stage_tile<kBlockN, kHeadDim, Smem::kKStride>(sK, k + kv.k, kv.k_row, n0, b.kv_rows(p), p.head_dim);
        stage_tile<kBlockN, kHeadDim, Smem::kKStride>(sV, v + kv.v, kv.v_row, n0, b.kv_rows(p), p.head_dim_v);
        __syncthreads();  // Q, dO, row statistics (first pass), K and V staged

        const int checks = b.tile_checks(p, m0, kBlockM, n0, kBlockN);
        for (int c = 0; c < kCols; ++c) {
            const int j = part + kLanesPerRow * c;
            float qk = 0.f, dp = 0.f;
            for (int d = 0; d < kHeadDim; ++d) {
                qk = fmaf(sQ[row * kHeadDim + d], sK[j * Smem::kKStride + d], qk);
                dp = fmaf(sDO[row * kHeadDim + d], sV[j * Smem::kKStride + d], dp);
            }
            const float prob = probability(score(p, b, qk, m0 + row, n0 + j, checks), sLse2[row], score.softmax_scale());
            const float z = dropout.factor(m0 + row, n0 + j);
            sDS[row * kBlockN + j] = prob * (dp * z - sDelta[row]) * score.grad(p, b, qk, m0 + row, n0 + j, prob);
        }
        __syncwarp();  // the row's dS, written by its lanes (all in this warp), is visible
        for (int j = 0; j < kBlockN; ++j) {
            const float ds = sDS[row * kBlockN + j];
            for (int e = 0; e < kDims; ++e) acc[e] = fmaf(ds, sK[j * Smem::kKStride + part + kLanesPerRow * e], acc[e]);
        }
    }
    // b.stats(p), not at.stats: recomputed here rather than held across the loop, which a packed
    // build (its offset read from memory) would spill.
    if (m0 + row < b.q_rows(p)) {
        for (int e = 0; e < kDims; ++e) {
            const int d = part + kLanesPerRow * e;
            if (d < p.head_dim) dq_accum[(b.stats(p) + m0 + row) * p.head_dim + d] = acc[e] * p.scale;
        }
    }
}

// Lanes per row of attention_bwd_preprocess: a warp reads 4 rows at a time, 128 contiguous bytes
// of each (8 chunks of 16 bytes at 16 bits: whole sectors). cupy_attn._config.PREPROCESS_ROWS_PER_BLOCK
// (kThreads / kPreprocessLanes) must match.
constexpr int kPreprocessLanes = 8;

}  // namespace attn

// grid (ceil(Sq / 16), H, B), block 128: delta[b, h, i] = Σ_d dout · out, in float32. Row i is
// read by 8 consecutive lanes in 16-byte chunks where both its rows start 16-byte aligned (else
// element by element, and elements past the last whole chunk so too), FlashAttention-2's
// dot_do_o layout; the lanes' partial sums meet by shuffles. (One thread per row, as before,
// made each warp-wide load touch 32 rows: 16 times the sectors of its bytes at 16 bits.)
template <class T>
__global__ void __launch_bounds__(attn::kThreads)
attention_bwd_preprocess(const T* dout, const T* out, float* delta, int heads, int seq_q, int head_dim_v,
                         long long do_sb, long long do_sh, long long do_sr, long long o_sb, long long o_sh, long long o_sr) {
    constexpr int kLanes = attn::kPreprocessLanes, kChunk = 16 / sizeof(T);  // elements per 16 bytes
    const int part = threadIdx.x % kLanes;
    const int i = blockIdx.x * (attn::kThreads / kLanes) + threadIdx.x / kLanes;
    float sum = 0.f;
    if (i < seq_q) {  // no return: every lane of the warp takes part in the shuffles below
        const T* d_row = dout + blockIdx.z * do_sb + blockIdx.y * do_sh + i * do_sr;
        const T* o_row = out + blockIdx.z * o_sb + blockIdx.y * o_sh + i * o_sr;
        int d = part;
        if ((reinterpret_cast<unsigned long long>(d_row) | reinterpret_cast<unsigned long long>(o_row)) % 16 == 0) {
            for (d = part * kChunk; d + kChunk <= head_dim_v; d += kLanes * kChunk) {
                alignas(16) T d_chunk[kChunk], o_chunk[kChunk];
                ATTN_COUNT_GLOBAL(d_row + d, 16);
                *reinterpret_cast<uint4*>(d_chunk) = *reinterpret_cast<const uint4*>(d_row + d);
                ATTN_COUNT_GLOBAL(o_row + d, 16);
                *reinterpret_cast<uint4*>(o_chunk) = *reinterpret_cast<const uint4*>(o_row + d);
#pragma unroll
                for (int e = 0; e < kChunk; ++e) sum = fmaf(attn::to_float(d_chunk[e]), attn::to_float(o_chunk[e]), sum);
            }
            d = head_dim_v / kChunk * kChunk + part;
        }
        for (; d < head_dim_v; d += kLanes) {
            ATTN_COUNT_GLOBAL(d_row + d, sizeof(T));
            ATTN_COUNT_GLOBAL(o_row + d, sizeof(T));
            sum = fmaf(attn::to_float(d_row[d]), attn::to_float(o_row[d]), sum);
        }
    }
    sum = attn::row_reduce_sum<kLanes>(sum);
    if (i < seq_q && part == 0) delta[(static_cast<long long>(blockIdx.z) * heads + blockIdx.y) * seq_q + i] = sum;
}

// grid (ceil(Sk / kBlockN), H, B), block 128, dynamic shared memory DkdvSmem::kFloats · 4.
template <class T, int kHeadDim, int kBlockM, int kBlockN>
__global__ void __launch_bounds__(attn::kThreads)
attention_bwd_dkdv(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,
                   float* dq_accum, float* dk_part, float* dv_part, int accumulate_dq, int dkdv_out, ATTN_PARAMS) {
    ATTN_UNPACK_PARAMS;
    attn::dkdv_block<T, kHeadDim, kBlockM, kBlockN>(p, q, k, v, dout, lse, delta, dq_accum, dk_part, dv_part,
                                                    accumulate_dq, dkdv_out, strides);
}

// grid (ceil(Sq / kBlockM), H, B), block 128, dynamic shared memory DqSmem::kFloats · 4.
// minBlocksPerSM = 1 lets ptxas take the registers it needs (105-142 for every tile, NVRTC 13.5):
// left to its own choice it gave the D = 64 build 72 and 12-28 bytes of spills on sm_90. Shared
// memory (BackwardTile.dq_shared_bytes, 48-109 KB) holds occupancy to 2-4 blocks of 128 threads
// per SM on sm_80 and sm_90, which those registers still allow.
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kLanesPerRow>
__global__ void __launch_bounds__(attn::kThreads, 1)
attention_bwd_dq(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,
                 float* dq_accum, ATTN_PARAMS) {
    ATTN_UNPACK_PARAMS;
    attn::dq_block<T, kHeadDim, kBlockM, kBlockN, kLanesPerRow>(p, q, k, v, dout, lse, delta, dq_accum, strides);
}
