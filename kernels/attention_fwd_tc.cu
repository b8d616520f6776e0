// The tensor-core forward kernel for fp16/bf16: FlashAttention-2's algorithm on mma.sync.
//
// One block of 4 warps per (query tile of kBlockM rows, head, batch entry): 64 or 128 (the tile
// table's block_m). Each warp owns kBlockM / 64 row tiles of 16 query rows, 64 rows apart, so a
// row's max and sum live in the 4 lanes of one quad and need two shuffles; with two row tiles
// every K and V fragment read from shared memory serves two MMAs (FlashAttention-2's 128-row
// block). Q, K and V
// tiles are copied to shared memory with cp.async (rows padded by 16 bytes so ldmatrix is free of
// bank conflicts) and read into fragments with ldmatrix (transposed for V). S = Q·Kᵀ and O += P·V
// are m16n8k16 MMAs with float32 accumulators; P never leaves registers: the accumulator layout
// of S is re-packed as the A operand of P·V. Softmax is kernels/softmax.cuh's online softmax, in
// base 2 with scale·log2 e folded in; without dropout the rows' sums are taken on the tensor
// cores too (P·1 beside P·V). Masking is done on boundary tiles only.
#include "block_info.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "numeric.cuh"
#include "ptx.cuh"
#include "softmax.cuh"
#include "tc_forward.cuh"
#include "tc_tile.cuh"

namespace attn {

// Where a warp stages 16 rows x kDims 16-bit elements of its output: rows kDims apart, no padding
// (so the rows fit in the warp's own rows of any Q tile layout), with each 16-byte chunk's index
// XORed by the row's position among the rows of one 128-byte line, so that the lanes' pair
// writes (8 rows of one 8-dim tile at a time) and the chunk reads (128 contiguous bytes per 8
// lanes) are both free of bank conflicts.
template <int kDims>
struct OutputStaging {
    static constexpr int kChunks = kDims / 8;                          // 16-byte chunks per row
    static constexpr int kRowsPerLine = kChunks < 8 ? 8 / kChunks : 1;  // rows per 128 bytes
    static constexpr int kSwizzle = kChunks < 8 ? kChunks : 8;
    static __device__ __forceinline__ int offset(int row, int col) {
        return row * kDims + 8 * ((col / 8) ^ (row / kRowsPerLine % kSwizzle)) + col % 8;
    }
};

// Normalise once and write this lane's two rows of O (finish_rows: and their lse). Every row
// inside the sequence is written. O goes out through `staging`: 16 rows of shared memory
// (OutputStaging) that this warp alone uses, its own rows of the Q tile (dead once its last S is
// in registers, and no copy into them is in flight: Q is staged only when the block has key
// tiles, and the first tile's wait covers it). Each lane writes its pairs there, then stores 16
// contiguous bytes of a row (8 lanes per row of 64 dims: whole 32-byte sectors), where out's rows
// are 16-byte aligned and the chunk lies inside the head; element by element otherwise.
template <class T, int kDTiles, class Softmax>
__device__ __forceinline__ void store_rows(const Params& p, const BlockInfo& b, const HeadView& at, T* out,
                                           float* lse, const float (&o)[kDTiles][4],
                                           Softmax (&softmax)[2], int row_lo, int lane, T* staging) {
    using Staging = OutputStaging<8 * kDTiles>;
    const int g = lane / 4;
    float inv[2];
    finish_rows(p, b, at, lse, softmax, row_lo, lane % 4, inv);
    // Every lane's ldmatrix reads of these rows of Q are done before any lane overwrites them: a
    // warp's lanes are ordered by __syncwarp alone (compute-sanitizer's racecheck reported the
    // staging stores against the Q reads without it, on an H200).
    __syncwarp();
    stage_pairs<T>(o, inv, lane, staging, [](int row, int col) { return Staging::offset(row, col); });
    __syncwarp();  // the warp's rows are staged
    const bool chunks = reinterpret_cast<unsigned long long>(out + at.o) % 16 == 0 && at.o_row % 8 == 0;
    const int row0 = row_lo - g;  // the warp's first row
    static_assert(16 * Staging::kChunks % 32 == 0, "whole passes of the warp over its 16 rows");
#pragma unroll
    for (int pass = 0; pass < 16 * Staging::kChunks / 32; ++pass) {
        const int idx = lane + 32 * pass;
        const int row = idx / Staging::kChunks, col = idx % Staging::kChunks * 8, i = row0 + row;
        if (i >= b.q_rows(p)) continue;
        const T* src = staging + Staging::offset(row, col);
        T* dst = out + at.o + i * at.o_row + col;
        if (chunks && col + 8 <= p.head_dim_v) {
            ATTN_LOAD_SHARED(src, 16);
            ATTN_COUNT_GLOBAL(dst, 16);
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
            continue;
        }
        for (int e = 0; e < 8 && col + e < p.head_dim_v; ++e) {
            ATTN_COUNT_GLOBAL(dst + e, sizeof(T)); ATTN_LOAD_SHARED(src + e, sizeof(T));
            dst[e] = src[e];
        }
    }
}

template <class T, int kHeadDim, int kBlockM, int kBlockN, int kHeadDimV>
__device__ __forceinline__ void forward_tc_block(const Params& p, const T* q, const T* k, const T* v, T* out, float* lse,
                                                 const long long (&strides)[12], int vectorised) {
    static_assert(kBlockM == 64 || kBlockM == 128, "one or two row tiles of 16 rows per warp");
    constexpr int kStride = TcLayout<kHeadDim>::kStride, kStrideV = TcLayout<kHeadDimV>::kStride;
    constexpr int kRowTiles = kBlockM / 64;  // per warp, rows 64m + 16·warp .. + 15 of the block
    constexpr int kNTiles = kBlockN / 8;     // 8-key column tiles of S
    constexpr int kDTiles = kHeadDimV / 8;   // 8-dim column tiles of O
    extern __shared__ __align__(16) unsigned char smem_bytes[];
    // Q (kBlockM, kStride), then two stages of K (kBlockN, kStride) and V (kBlockN, kStrideV): while
    // the warps work on one key tile, cp.async brings the next into the other stage.
    T* sQ = reinterpret_cast<T*>(smem_bytes);
    // (Arithmetic, not an array of stage pointers: a run-time index would put it in local memory.)
    auto stage_k = [&](int stage) { return sQ + kBlockM * kStride + kBlockN * (kStride + kStrideV) * stage; };
    auto stage_v = [&](int stage) { return stage_k(stage) + kBlockN * kStride; };

    const BlockPlace place = query_block_place(p);
    const BlockInfo b(p, place.head, place.batch);
    const ScoreTransform score(p, b);
    const Dropout dropout(p, b);
    const HeadView at = head_view(p, b, strides);
    const int m0 = place.tile * kBlockM;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;           // groupID, threadID_in_group
    const int row_lo = m0 + warp * 16 + g;          // row tile m's two rows: row_lo + 64m and + 8

    // Without dropout the rows' sums of P are taken on the tensor cores, as P·1 beside P·V: one
    // MMA per row tile and 16 keys into an accumulator tile after O's, rescaled with O, where
    // float adds took one instruction per score (per 64-key tile and lane at D = 64, 64 adds
    // against 8 MMAs). They sum the very rounded P that P·V weighs V by. With dropout the sums
    // must take P before it is dropped: float adds (OnlineSoftmax).
    constexpr int kSumTiles = kDropoutBuilt ? 0 : 1;
    float o[kRowTiles][kDTiles + kSumTiles][4];
#pragma unroll
    for (int m = 0; m < kRowTiles; ++m)
#pragma unroll
        for (int d = 0; d < kDTiles + kSumTiles; ++d) o[m][d][0] = o[m][d][1] = o[m][d][2] = o[m][d][3] = 0.f;
    TcSoftmaxOf<kSumTiles == 0> softmax[kRowTiles][2];  // rows row_lo + 64m and row_lo + 64m + 8
    // Softcap's tanh adds an exp2 and a reciprocal to each score's exp2: 3 MUFU per score, each
    // holding the sub-partition's special-function unit 8 cycles, against 4·D multiply-adds. Up to
    // D = 64 that unit bounds the loop, so every 2nd exp2 of the softmax goes to the FMA pipe
    // (exp2_polynomial), as in the wgmma forward (SASS audit, NVRTC 13.5, fp16, D = 64 at sm_80;
    // the larger of mufu_per_tensor and issue_per_tensor, before → after): softcap alone 1.41 →
    // 1.18 (0.78 → 1.02 issue), with ALiBi or a float mask 1.41 → 1.18, with both 1.41 → 1.27
    // (every 3rd: 1.27); on sm_90 at wgmma's rate 2.82 → 2.35 and 2.82 → 2.51; at D = 32 2.67 →
    // 2.22 and 2.67 → 2.23. Boundary tiles with a mask are issue-bound already (softcap and a bool
    // mask 1.41 → 1.45, with ALiBi and a float mask 1.41 → 1.51) and keep MUFU; without one,
    // 1.41 → 1.18 (softcap alone) and 1.41 → 1.27 (with ALiBi). Builds with dropout issue 2.9 per
    // tensor cycle (every 2nd: 2.92) and mods vary: they keep MUFU. Softcap alone leaves issue
    // slots to spare at every 2nd, so its interior tiles take more (kPolynomialOf of every
    // kPolynomialEvery, 2026-12-07): 2 of 3 at D = 64, 1.18 → 1.12 (issue 1.02 → 1.08; on sm_90
    // 2.35 → 2.24), 3 of 4 at D = 32, 2.22 → 2.00 (1.75 → 1.97; on sm_90 4.44 → 4.00).
    constexpr bool kSoftcapMufuBound = kSoftcapBuilt && !kDropoutBuilt && !ATTN_MODS && kHeadDim <= 64;
    constexpr int kPolynomialEvery = kSoftcapMufuBound ? (!kAlibiBuilt && kMaskBuilt == kMaskNone ? (kHeadDim <= 32 ? 4 : 3) : 2) : 0;
    constexpr int kPolynomialOf = kSoftcapMufuBound ? kPolynomialEvery - 1 : 1;
    constexpr int kBoundaryPolynomialEvery = kSoftcapMufuBound && kMaskBuilt == kMaskNone ? 2 : 0;

    TileWalk keys = b.key_walk(p, m0, kBlockM, kBlockN);
    const TileSpan interior = b.interior_key_tiles(p, m0, kBlockM, kBlockN);
    const TileSource<T, kHeadDim> k_source(k + at.k, at.k_row, b.kv_rows(p), p.head_dim, vectorised & 2);
    const TileSource<T, kHeadDimV> v_source(v + at.v, at.v_row, b.kv_rows(p), p.head_dim_v, vectorised & 4);
    const int whole_tiles = whole_rows_of(k_source, v_source) / kBlockN;
    // At D = 256 (16-key tiles, 16 rows per warp) S = Q·Kᵀ read a Q fragment from shared memory for
    // every K fragment, a third of the loop's wavefronts: each warp holds its rows of Q in
    // registers instead (64 per thread, loaded once). The SASS audit (NVRTC 13.5, fp16, plain
    // build): shared_per_tensor 1.72 → 1.23 on sm_80 and 3.45 → 2.46 on sm_90 (at wgmma's rate),
    // issue_per_tensor 0.49 → 0.47 and 1.04 → 0.99, at 255 registers (240), 2 blocks per SM either
    // way; with softcap and a mask 1.72 → 1.23 too. At 255 registers, builds with ALiBi or dropout
    // spilled in 7 of their 18 feature sets (4-16 bytes, on sm_80 or sm_90): those, and builds with
    // mods, keep Q in shared memory.
    constexpr bool kQInRegisters = kHeadDim == 256 && kRowTiles == 1 && !kAlibiBuilt && !kDropoutBuilt && !ATTN_MODS;
    auto stage_keys = [&](int n_block, int stage) {
        const int n0 = n_block * kBlockN;
        stage_async_pair<kBlockN>(stage_k(stage), k_source, stage_v(stage), v_source, n0, n_block < whole_tiles);
        ptx::cp_async_commit();
    };
    if (keys.more()) {  // Q only then: the epilogue stages O in Q's rows, where no copy may still land
        const TileSource<T, kHeadDim> q_source(q + at.q, at.q_row, b.q_rows(p), p.head_dim, vectorised & 1);
        stage_async<kBlockM>(sQ, q_source, m0);
        if constexpr (kQInRegisters) ptx::cp_async_commit();  // Q's own group, awaited below
        stage_keys(keys.tile, keys.stage<2>());
    }
    RowFragments<kQInRegisters ? kHeadDim / 16 : 1> q_rows;
    if (kQInRegisters && keys.more()) {  // Q landed (everyone's copies), the first K/V may not have
        ptx::cp_async_wait<1>();
        __syncthreads();
        q_rows.template load<kStride>(sQ, warp * 16, lane);
    }
    for (; keys.more(); keys.advance()) {
        const int n_block = keys.tile, n0 = n_block * kBlockN;
        const int stage = keys.stage<2>();
        const T* sK = stage_k(stage);
        const T* sV = stage_v(stage);
        ptx::cp_async_wait<0>();  // this thread's copies of this tile (and of Q) have landed
        // Everyone's copies have landed, and every warp is done with the previous tile, whose
        // stage the next prefetch overwrites.
        __syncthreads();
        if (!keys.last()) stage_keys(keys.after(), keys.stage_after<2>());

        // S = Q·Kᵀ for this warp's row tiles: s[m][j] holds rows (g, g+8) of row tile m x keys
        // (8j + 2t, 8j + 2t + 1).
        float s[kRowTiles][kNTiles][4];
#pragma unroll
        for (int m = 0; m < kRowTiles; ++m)
#pragma unroll
            for (int j = 0; j < kNTiles; ++j) s[m][j][0] = s[m][j][1] = s[m][j][2] = s[m][j][3] = 0.f;
        unsigned keeps[kRowTiles][kNTiles];  // dropout's, before S (Dropout::tile_keeps)
#pragma unroll
        for (int m = 0; m < kRowTiles; ++m) dropout.tile_keeps(keeps[m], row_lo + 64 * m, n0, t);
        if constexpr (kQInRegisters) mma_rows_by_rows<T, kStride, kHeadDim / 16>(s[0], q_rows, sK, lane);
        else mma_rows_by_rows<T, kStride, kHeadDim / 16>(s, sQ, warp * 16, sK, lane);

        const int checks = b.tile_checks(p, interior.contains(n_block), place.tile, n_block);
#pragma unroll
        for (int m = 0; m < kRowTiles; ++m)
            softmax_tile<kPolynomialEvery, kBoundaryPolynomialEvery, kPolynomialOf>(s[m], o[m], softmax[m], p, b, score, dropout,
                                                                     keeps[m], row_lo + 64 * m, n0, t, checks);

        // O += P·V: P stays in registers as the A operand (16 keys per k-step).
        mma_registers_by_rows<T, kStrideV, kBlockN / 16, kSumTiles>(o, s, sV, lane);
    }

#pragma unroll
    for (int m = 0; m < kRowTiles; ++m) {  // O through this warp's rows of Q
        if constexpr (kSumTiles == 1)  // every column of the sums' tile holds its row's whole sum
            for (int r = 0; r < 2; ++r) softmax[m][r].row_sum = o[m][kDTiles][2 * r];
        store_rows<T>(p, b, at, out, lse, reinterpret_cast<const float(&)[kDTiles][4]>(o[m]), softmax[m],
                      row_lo + 64 * m, lane, sQ + (64 * m + 16 * warp) * kStride);
    }
}

}  // namespace attn

// grid (pairs per section, ceil(Sq / kBlockM), sections) (query_block_place), block 128 threads,
// dynamic shared memory (kBlockM + 2 kBlockN) rows of (kHeadDim + 8) and 2 kBlockN rows of
// (kHeadDimV + 8) 16-bit elements. vectorised: bit 0/1/2 set when q/k/v rows may be copied in
// 16-byte chunks (16-byte aligned base, strides multiples of 8 elements). kHeadDimV < kHeadDim: v
// and out are a slice of kHeadDimV dims of the value head dims, one launch per slice (O's
// accumulators are what registers bound; Q and K only take shared memory). kMinBlocks: the blocks
// per SM ptxas is asked to leave registers for in the plain build (the tile table's min_blocks;
// builds with more features need more registers and are left to ptxas).
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kHeadDimV, int kMinBlocks>
__global__ void __launch_bounds__(attn::kThreads, attn::ScoreTransform::kPlain ? kMinBlocks : 1)
attention_fwd_tc(const T* q, const T* k, const T* v, T* out, float* lse, int vectorised, ATTN_PARAMS) {
    ATTN_UNPACK_PARAMS;
    attn::forward_tc_block<T, kHeadDim, kBlockM, kBlockN, kHeadDimV>(p, q, k, v, out, lse, strides, vectorised);
}
