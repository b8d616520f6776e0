// The split-KV decoding kernel (attention_with_kvcache): a few queries against a long, possibly
// paged, KV cache. Float32 math on CUDA cores for every storage type: decoding does a few
// multiply-adds per K/V element it reads once, so memory bandwidth bounds it, not arithmetic.
//
// GQA packing: a block takes the G = H / Hkv query heads sharing one kv head, times the Sq
// queries, as rows r = i·G + g (query i, head kv_head·G + g), kBlockM of them; every K/V tile it
// stages serves all of them, so each K/V byte is read once per kv head and split. More rows (MQA,
// prefill over a cache) take more blocks, each reading the keys again: correct, not tuned.
// Split-KV: the key tiles a block's rows may attend (causal, window and length: BlockInfo) are cut
// into num_splits contiguous ranges, one block each. With one split a block writes out (q's dtype)
// and lse; with more it writes float32 partials, which cupy_attn._merge.combine merges.
//
// In a block, row r belongs to warp r % 4. A tile holds kBlockN = 32 keys, one per lane: lane l
// scores key n0 + l against each of its warp's rows (a 16-byte shared read of its key's row per
// 8 or 4 dims, Q read as a broadcast), so Q·Kᵀ needs no sum across lanes and a row's max and sum
// are shuffles within its warp (OnlineSoftmax<32>). For P·V the row's probabilities go through
// shared memory, and each lane accumulates kHeadDim / 32 consecutive output dims. K and V reach
// shared memory through the block table (kv_pages.cuh) in 16-byte cp.async chunks, rows padded by
// 16 bytes so the lanes' reads of 32 different rows are free of bank conflicts, in two stages
// where they fit: the next tile loads while this one is worked on.
#include "access_count.cuh"
#include "block_info.cuh"
#include "kv_pages.cuh"
#include "mask.cuh"
#include "numeric.cuh"
#include "ptx.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"

namespace attn {

// Shared memory, in bytes: Q (kBlockM, kHeadDim) float | P (kBlockM, kBlockN) float | per stage
// K then V (kBlockN, kStride) in the storage type. cupy_attn._config.DecodeTile.shared_bytes.
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct DecodeSmem {
    static constexpr int kStride = kHeadDim + 16 / sizeof(T);  // K, V rows padded by 16 bytes
    static constexpr int kQ = 0;
    static constexpr int kP = kQ + 4 * kBlockM * kHeadDim;
    static constexpr int kKV = kP + 4 * kBlockM * kBlockN;
    static constexpr int kStageBytes = 2 * kBlockN * kStride * sizeof(T);
    static constexpr int kBytes = kKV + kStages * kStageBytes;
};

template <int kBytes> struct Word;
template <> struct Word<2> { using type = unsigned short; };
template <> struct Word<4> { using type = unsigned; };
template <> struct Word<8> { using type = uint2; };
template <> struct Word<16> { using type = uint4; };

// kElems consecutive elements of T in shared memory (aligned to their size, up to 16 bytes) as
// float, in loads of up to 16 bytes.
template <int kElems, class T>
__device__ __forceinline__ void load_floats(float (&dst)[kElems], const T* src) {
    constexpr int kBytes = kElems * sizeof(T), kWordBytes = kBytes < 16 ? kBytes : 16, kPerWord = kWordBytes / sizeof(T);
    using W = typename Word<kWordBytes>::type;
#pragma unroll
    for (int w = 0; w < kBytes / kWordBytes; ++w) {
        const W word = *reinterpret_cast<const W*>(src + w * kPerWord);
        T elems[kPerWord];
        memcpy(elems, &word, kWordBytes);
#pragma unroll
        for (int e = 0; e < kPerWord; ++e) dst[w * kPerWord + e] = to_float(elems[e]);
    }
}

template <class T, int kHeadDim, int kBlockM, int kBlockN, int kStages>
__device__ __forceinline__ void decode_block(const Params& p, const T* q, const T* k_cache, const T* v_cache,
                                             const int* block_table, int table_stride, int page_size, T* out,
                                             float* lse, float* out_parts, float* lse_parts, long long out_part_stride,
                                             long long lse_part_stride, int num_splits, int vectorised,
                                             const long long (&strides)[12]) {
    static_assert(kBlockN == 32, "one key per lane");
    constexpr int kWarps = kThreads / 32;
    constexpr int kRowsPerWarp = kBlockM / kWarps;  // rows warp, warp + 4, ...
    constexpr int kChunk = 16 / sizeof(T);          // K elements per 16-byte shared read
    constexpr int kDimsPerLane = kHeadDim / 32;     // output dims per lane in P·V
    static_assert(kBlockM % kWarps == 0 && kHeadDim % 32 == 0, "whole rows per warp, whole dims per lane");
    using Smem = DecodeSmem<T, kHeadDim, kBlockM, kBlockN, kStages>;
    constexpr int kStride = Smem::kStride;
    extern __shared__ __align__(16) unsigned char smem_bytes[];
    float* sQ = reinterpret_cast<float*>(smem_bytes + Smem::kQ);  // (kBlockM, kHeadDim)
    float* sP = reinterpret_cast<float*>(smem_bytes + Smem::kP);  // (kBlockM, kBlockN)
    // (Arithmetic, not an array of stage pointers: a run-time index would put it in local memory.)
    auto stage_k = [&](int stage) { return reinterpret_cast<T*>(smem_bytes + Smem::kKV + stage * Smem::kStageBytes); };
    auto stage_v = [&](int stage) { return stage_k(stage) + kBlockN * kStride; };

    const int split = blockIdx.x % num_splits, m0 = (blockIdx.x / num_splits) * kBlockM;
    const int kv_head = blockIdx.y, bidb = blockIdx.z;
    const int group = p.kv_group;
    const int block_rows = min(kBlockM, p.seq_q * group - m0);  // valid rows of this block
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warp_rows = block_rows > warp ? (block_rows - warp + kWarps - 1) / kWarps : 0;  // uniform in the warp
    // Row r of the block: query (m0 + r) / G of head kv_head·G + (m0 + r) % G.
    auto query_of = [&](int r) { return (m0 + r) / group; };
    auto head_of = [&](int r) { return kv_head * group + (m0 + r) % group; };

    // Each warp stages its own rows of Q as float, zero past D (read by the first tile's barrier).
    for (int t = 0; t < warp_rows; ++t) {
        const int r = warp + kWarps * t;
        const HeadView at = head_view(p, BlockInfo(p, head_of(r), bidb), strides);
        for (int d = lane; d < kHeadDim; d += 32)
            sQ[r * kHeadDim + d] = d < p.head_dim ? to_float(q[at.q + query_of(r) * at.q_row + d]) : 0.f;
    }

    // Lengths and diagonal are those of the batch entry, the same for every head of the group.
    const BlockInfo b(p, kv_head * group, bidb);
    const int i_first = query_of(0), i_count = block_rows > 0 ? query_of(block_rows - 1) - i_first + 1 : 0;
    int n_begin, n_end;
    b.key_tiles(p, i_first, i_count, kBlockN, &n_begin, &n_end);
    const int per_split = (n_end - n_begin + num_splits - 1) / num_splits;  // this split's share
    n_begin = min(n_end, n_begin + split * per_split);
    n_end = min(n_end, n_begin + per_split);

    const int* pages = block_table + static_cast<long long>(bidb) * table_stride;
    const PagedRows k_rows{pages, static_cast<unsigned>(page_size), strides[3], strides[5]};
    const PagedRows v_rows{pages, static_cast<unsigned>(page_size), strides[6], strides[8]};
    const T* k_head = k_cache + kv_head * strides[4];
    const T* v_head = v_cache + kv_head * strides[7];
    auto stage_keys = [&](int n_block, int stage) {
        stage_paged_rows<kBlockN, kHeadDim, kStride>(stage_k(stage), k_head, k_rows, n_block * kBlockN, b.kv_len,
                                                     p.head_dim, vectorised & 1);
        stage_paged_rows<kBlockN, kHeadDim, kStride>(stage_v(stage), v_head, v_rows, n_block * kBlockN, b.kv_len,
                                                     p.head_dim_v, vectorised & 2);
        ptx::cp_async_commit();
    };

    OnlineSoftmax<32> softmax[kRowsPerWarp];
    float acc[kRowsPerWarp][kDimsPerLane];  // row t's output dims lane · kDimsPerLane + e
#pragma unroll
    for (int t = 0; t < kRowsPerWarp; ++t)
#pragma unroll
        for (int e = 0; e < kDimsPerLane; ++e) acc[t][e] = 0.f;

    if (n_begin < n_end) stage_keys(n_begin, pipeline_stage<kStages>(n_begin));
    for (int n_block = n_begin; n_block < n_end; ++n_block) {
        const int n0 = n_block * kBlockN;
        const int stage = pipeline_stage<kStages>(n_block);
        const T* sK = stage_k(stage);
        const T* sV = stage_v(stage);
        ptx::cp_async_wait<0>();  // this thread's copies of this tile have landed
        // Everyone's copies (and Q) have landed, and every warp is done with the previous tile,
        // whose stage the next prefetch overwrites.
        __syncthreads();
        if (kStages == 2 && n_block + 1 < n_end) stage_keys(n_block + 1, 1 - stage);

        // S = Q·Kᵀ: lane holds key n0 + lane's score against each of its warp's rows.
        float s[kRowsPerWarp];
#pragma unroll
        for (int t = 0; t < kRowsPerWarp; ++t) s[t] = 0.f;
#pragma unroll
        for (int d0 = 0; d0 < kHeadDim; d0 += kChunk) {
            float kf[kChunk];
            ATTN_LOAD_SHARED(sK + lane * kStride + d0, 16);
            load_floats(kf, sK + lane * kStride + d0);
#pragma unroll
            for (int t = 0; t < kRowsPerWarp; ++t) {
                if (t < warp_rows) {
                    const float* qr = sQ + (warp + kWarps * t) * kHeadDim + d0;
#pragma unroll
                    for (int e = 0; e < kChunk; ++e) s[t] = fmaf(qr[e], kf[e], s[t]);
                }
            }
        }
        const bool boundary = !b.tile_is_interior(p, i_first, i_count, n0, kBlockN);
        // Every row of the warp, the block's rows or not: the softmax's shuffles must be reached by
        // all lanes together, and under a branch the compiler cannot prove that (it calls a slow,
        // spilling shuffle). A row the block lacks computes on zeros and is never written.
#pragma unroll
        for (int t = 0; t < kRowsPerWarp; ++t) {
            const int r = warp + kWarps * t;
            const BlockInfo row(p, head_of(r), bidb);
            const ScoreTransform score(p, row);
            float col[1] = {score(p, row, s[t], query_of(r), n0 + lane, boundary)};
            const float rescale = softmax[t].update(col, score.softmax_scale());
#pragma unroll
            for (int e = 0; e < kDimsPerLane; ++e) acc[t][e] *= rescale;
            ATTN_STORE_SHARED(sP + r * kBlockN + lane, 4);
            sP[r * kBlockN + lane] = col[0];
        }
        __syncwarp();  // the warp's rows of P, one key per lane, are visible to all its lanes

        // O += P·V
        for (int j = 0; j < kBlockN; ++j) {
            float vf[kDimsPerLane];
            ATTN_LOAD_SHARED(sV + j * kStride + lane * kDimsPerLane, kDimsPerLane * sizeof(T));
            load_floats(vf, sV + j * kStride + lane * kDimsPerLane);
#pragma unroll
            for (int t = 0; t < kRowsPerWarp; ++t) {
                if (t < warp_rows) {
                    const float pj = sP[(warp + kWarps * t) * kBlockN + j];
#pragma unroll
                    for (int e = 0; e < kDimsPerLane; ++e) acc[t][e] = fmaf(pj, vf[e], acc[t][e]);
                }
            }
        }
        if (kStages == 1 && n_block + 1 < n_end) {
            __syncthreads();  // every warp is done with the only stage before it is overwritten
            stage_keys(n_block + 1, 0);
        }
    }

    // Every valid row is written, by every split (a split without keys: out 0, lse −inf, which
    // the combine skips). (Guards, not breaks, in these unrolled loops: a break out of one made
    // ptxas spill.)
    const bool partial = num_splits > 1;
#pragma unroll
    for (int t = 0; t < kRowsPerWarp; ++t) {
        softmax[t].gather_sum();  // every row of the warp, as in the loop: the shuffles need all lanes
        if (t < warp_rows) {
            const int r = warp + kWarps * t, i = query_of(r);
            const HeadView at = head_view(p, BlockInfo(p, head_of(r), bidb), strides);
            const float inv = softmax[t].inverse_sum();
#pragma unroll
            for (int e = 0; e < kDimsPerLane; ++e) {
                const int d = lane * kDimsPerLane + e;
                const long long o = at.o + i * at.o_row + d;
                if (d < p.head_dim_v && partial) {
                    ATTN_COUNT_GLOBAL(out_parts + split * out_part_stride + o, 4);
                    out_parts[split * out_part_stride + o] = acc[t][e] * inv;
                } else if (d < p.head_dim_v) {
                    ATTN_COUNT_GLOBAL(out + o, sizeof(T));
                    out[o] = from_float<T>(acc[t][e] * inv);
                }
            }
            if (lane == 0 && partial) lse_parts[split * lse_part_stride + at.stats + i] = softmax[t].lse();
            else if (lane == 0) lse[at.stats + i] = softmax[t].lse();
        }
    }
}

}  // namespace attn

// grid (ceil(Sq·G / kBlockM) · num_splits, Hkv, B), block 128 threads, dynamic shared memory
// DecodeSmem::kBytes. k_cache, v_cache: (num_pages, page_size, Hkv, D | Dv) through the k and v
// strides of ATTN_PARAMS (batch stride = page stride); block_table (B, table_stride) int32, its
// entries for an entry's pages below kv_lengths[b] valid. num_splits = 1: out (q's layout, through
// the fourth strides) and lse (B, H, Sq); more: out_parts, lse_parts float32, split s's rows at
// s · out_part_stride / s · lse_part_stride, laid out like out and lse. vectorised: bit 0/1 set when
// k_cache / v_cache rows may be copied in 16-byte chunks. (__launch_bounds__'s minimum of one
// block per SM: without it ptxas held some builds to 56-80 registers and spilled; with it they
// take 80-218 and none spills.)
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kStages>
__global__ void __launch_bounds__(attn::kThreads, 1)
attention_decode(const T* q, const T* k_cache, const T* v_cache, const int* block_table, int table_stride,
                 int page_size, T* out, float* lse, float* out_parts, float* lse_parts, long long out_part_stride,
                 long long lse_part_stride, int num_splits, int vectorised, ATTN_PARAMS) {
    ATTN_UNPACK_PARAMS;
    attn::decode_block<T, kHeadDim, kBlockM, kBlockN, kStages>(p, q, k_cache, v_cache, block_table, table_stride,
                                                                page_size, out, lse, out_parts, lse_parts,
                                                                out_part_stride, lse_part_stride, num_splits,
                                                                vectorised, strides);
}
