// Shared pieces of the tensor-core kernels: 16-bit tiles in shared memory and fragment packing.
#pragma once
#include "access_count.cuh"
#include "numeric.cuh"
#include "ptx.cuh"
#include "tile_io.cuh"

namespace attn {

template <int kHeadDim>
struct TcLayout {
    static constexpr int kStride = kHeadDim + 8;  // halves per shared-memory row (+16 bytes)
};

// A tile of kRows rows x kCols columns of kBytes-byte elements (16-bit by default; float32 for the
// backward's dK, dV epilogue of a GQA group) as TMA writes it with
// 128-byte swizzle: boxes of 128 bytes of columns (a 128-byte line per row: 64 16-bit or 32
// float32 columns), kCols / kBoxCols of them one after another, the 16-byte chunks of each line
// permuted by its row (ptx.cuh, Swizzle::B128). offset(r, c) is the element offset a descriptor
// starts at for (r, c), before the swizzle, which the hardware applies to the address as TMA did.
// Read K-major (rows the N of the product, columns reduced): 8-row groups 1024 bytes apart
// (SBO; LBO unused); MN-major (rows reduced, columns N): boxes kBoxBytes apart (LBO), 8-row
// groups 1024 bytes (SBO). Boxes start at multiples of 1024 bytes, as the swizzle's atoms
// must.
template <int kRows, int kCols, int kBytes = 2>
struct SwizzledBoxLayout {
    static constexpr int kBoxCols = 128 / kBytes, kChunkCols = 16 / kBytes;
    static constexpr unsigned kBoxBytes = 128 * kRows;
    static constexpr unsigned kKMajorLbo = 16, kKMajorSbo = 1024, kMnMajorLbo = kBoxBytes, kMnMajorSbo = 1024;
    static_assert(kCols % kBoxCols == 0 && kRows % 8 == 0, "whole boxes of 128-byte lines and 8-row atoms");
    static __device__ __forceinline__ int offset(int r, int c) {
        return (c / kBoxCols) * (kBoxCols * kRows) + r * kBoxCols + c % kBoxCols;
    }
    // Where (r, c) lies once swizzled, for a thread's own (generic-proxy) reads and writes: the
    // 16-byte chunk's index within its line XORed with the row's position in its 8-row atom. A
    // thread storing pairs of a 16 x 8 accumulator tile (8 rows x 4 lanes) so hits 32 banks
    // (16-bit pairs) or the fewest wavefronts (float32 pairs, 8 bytes each: two).
    static __device__ __forceinline__ int swizzled(int r, int c) {
        return (c / kBoxCols) * (kBoxCols * kRows) + r * kBoxCols +
               kChunkCols * ((c % kBoxCols / kChunkCols) ^ (r % 8)) + c % kChunkCols;
    }
};

// Row-major rows of kHeadDim + 8 elements (the mma.sync kernels' ldmatrix layout). Staging
// spreads a tile's 16-byte chunks over the block's kBlockThreads threads in passes of kRowsPerPass
// rows x kChunksPerPass chunks, kColumnPasses of them side by side, each thread moving the chunk
// at first_chunk's (row, column) plus a whole pass's rows and columns per step (the offsets are
// additive over such steps, so a thread computes its addresses once): consecutive threads along
// a row, contiguous in global and in shared memory, a whole row per pass where its chunks divide
// the block's threads, else the largest power-of-two share of it (576 dims: 72 chunks, passes of
// 8 chunks x 16 rows, 9 of them across).
template <int kHeadDim, int kBlockThreads>
struct PaddedRowLayout {
    static __device__ __forceinline__ int offset(int r, int c) { return r * TcLayout<kHeadDim>::kStride + c; }
    static constexpr int kChunks = kHeadDim / 8;
    static constexpr int kChunksPerPass = kBlockThreads % kChunks == 0 ? kChunks : (kChunks & -kChunks);
    static constexpr int kRowsPerPass = kBlockThreads / kChunksPerPass;
    static constexpr int kColumnPasses = kChunks / kChunksPerPass;
    static __device__ __forceinline__ void first_chunk(int thread, int& r, int& c) {
        r = thread / kChunksPerPass;
        c = (thread % kChunksPerPass) * 8;
    }
};

// Call chunk(d, s, dr, dc) for each 16-byte chunk this thread moves of a kRows x kHeadDim tile laid
// out by Layout: d and s its shared and global addresses, (dr, dc) its offset from the thread's
// first chunk (Layout::first_chunk). Addresses are computed once and advanced by constants.
// The passes are unrolled fully (kUnrolled) or not at all (less code, fewer registers for a
// rarely taken copy).
template <int kRows, int kHeadDim, class Layout, bool kUnrolled, class T, class Chunk>
__device__ __forceinline__ void for_each_chunk(T* dst, const T* src, long long row_stride, int r0, int c0, Chunk&& chunk) {
    static_assert(Layout::kRowsPerPass > 0 && kRows % Layout::kRowsPerPass == 0 &&
                  Layout::kColumnPasses * Layout::kChunksPerPass * 8 == kHeadDim, "whole passes cover the tile");
    T* const d0 = dst + Layout::offset(r0, c0);
    const T* const s0 = src + r0 * row_stride + c0;
    // One running source pointer per column pass, bumped by a pass's rows: the passes' addresses
    // are not all held at once (which cost registers ptxas then spilled).
    const long long pass_stride = Layout::kRowsPerPass * row_stride;
    constexpr int kUnrollColumns = kUnrolled ? Layout::kColumnPasses : 1;
    constexpr int kUnrollRows = kUnrolled ? kRows / Layout::kRowsPerPass : 1;
#pragma unroll kUnrollColumns
    for (int pass_c = 0; pass_c < Layout::kColumnPasses; ++pass_c) {
        const int dc = pass_c * Layout::kChunksPerPass * 8;
        const T* s = s0 + dc;
#pragma unroll kUnrollRows
        for (int pass_r = 0; pass_r < kRows / Layout::kRowsPerPass; ++pass_r, s += pass_stride) {
            const int dr = pass_r * Layout::kRowsPerPass;
            chunk(d0 + Layout::offset(dr, dc), s, dr, dc);
        }
    }
}

// A 16-bit matrix whose tiles stage_async copies: `rows` rows (the sequence) of `dims` elements
// (the head) from src, row_stride elements apart; vectorised where its rows may go by 16-byte
// chunks (aligned base and stride). whole_width: vectorised, and the head as wide as kHeadDim.
template <class T, int kHeadDim>
struct TileSource {
    const T* src;
    long long row_stride;
    int rows, dims;
    bool vectorised, whole_width;
    __device__ __forceinline__ TileSource(const T* src, long long row_stride, int rows, int dims, bool vectorised)
        : src(src), row_stride(row_stride), rows(rows), dims(dims), vectorised(vectorised),
          whole_width(vectorised && dims >= kHeadDim) {}

    // The rows within which a tile may be copied whole: all of the sequence's where the source
    // is vectorised and the head as wide as kHeadDim, none otherwise. A tile [row0, row0 + n)
    // is whole where row0 + n <= whole_rows(): all but a sequence's last tile of a head that
    // fills its tile.
    __device__ __forceinline__ int whole_rows() const { return whole_width ? rows : 0; }
};

// The whole_rows of two matrices a loop stages together, with the same rows (K and V, Q and
// dO), for stage_async_pair: the loop works out once how many of its tiles lie within it and
// tests each tile's index against that, one comparison for both matrices. Testing each
// matrix's flags per tile, ptxas reloaded and retested them on every one (NVRTC 13.5: 14
// instructions more per 64-key tile of the fp16 mma.sync forward at D = 64 on sm_90; comparing
// rows instead of tile indices made the deterministic dQ kernel's path 47 longer).
template <class T, int kHeadDimA, int kHeadDimB>
__device__ __forceinline__ int whole_rows_of(const TileSource<T, kHeadDimA>& a, const TileSource<T, kHeadDimB>& b) {
    return a.whole_width && b.whole_width ? a.rows : 0;
}

// Stage rows [row0, row0 + kRows) x kHeadDim of `from` in shared memory laid out by
// PaddedRowLayout: 16-byte chunks by cp.async where the source allows it, element by element
// otherwise; zeros past its rows and dims. The caller commits and waits. A whole tile (the
// caller's `whole`: row0 + kRows <= TileSource::whole_rows) is copied with no test per chunk, fully
// unrolled; other tiles check each chunk, in rolled passes. (A test per thread, taking the
// unchecked copy for the columns inside a narrower head too, made the common whole tile's path
// 1–3 % longer in the SASS audit: its branch diverges.) Every one of the block's kBlockThreads
// threads takes part.
template <int kRows, int kBlockThreads = kThreads, class T, int kHeadDim>
__device__ __forceinline__ void stage_async(T* dst, const TileSource<T, kHeadDim>& from, int row0, bool whole) {
    using Layout = PaddedRowLayout<kHeadDim, kBlockThreads>;
    int r0, c0;
    Layout::first_chunk(threadIdx.x, r0, c0);
    const T* src = from.src + row0 * from.row_stride;
    if (whole) {
        for_each_chunk<kRows, kHeadDim, Layout, true>(dst, src, from.row_stride, r0, c0,
                                                      [](T* d, const T* s, int, int) { ptx::cp_async<16>(d, s); });
        return;
    }
    for_each_chunk<kRows, kHeadDim, Layout, false>(dst, src, from.row_stride, r0, c0, [&](T* d, const T* s, int dr, int dc) {
        const bool row_in = row0 + r0 + dr < from.rows;
        if (from.vectorised && row_in && c0 + dc + 8 <= from.dims) {
            ptx::cp_async<16>(d, s);
        } else {
            for (int e = 0; e < 8; ++e) d[e] = (row_in && c0 + dc + e < from.dims) ? s[e] : from_float<T>(0.f);
        }
    });
}

// stage_async of a tile copied whole wherever its source's whole_rows allow (a tile staged once,
// or the fallback of stage_async_pair).
template <int kRows, int kBlockThreads = kThreads, class T, int kHeadDim>
__device__ __forceinline__ void stage_async(T* dst, const TileSource<T, kHeadDim>& from, int row0) {
    stage_async<kRows, kBlockThreads>(dst, from, row0, row0 + kRows <= from.whole_rows());
}

// Stage the same rows of two matrices (K and V, Q and dO): both copied whole where the caller
// found the tile within whole_rows_of(a, b) (both_whole), else each as its own whole_rows allows,
// so that a narrower or unaligned one (V or dO with Dv < D) leaves the other's copy unchecked.
template <int kRows, int kBlockThreads = kThreads, class T, int kHeadDimA, int kHeadDimB>
__device__ __forceinline__ void stage_async_pair(T* dst_a, const TileSource<T, kHeadDimA>& a, T* dst_b,
                                                 const TileSource<T, kHeadDimB>& b, int row0, bool both_whole) {
    if (both_whole) {
        stage_async<kRows, kBlockThreads>(dst_a, a, row0, true);
        stage_async<kRows, kBlockThreads>(dst_b, b, row0, true);
    } else {
        stage_async<kRows, kBlockThreads>(dst_a, a, row0);
        stage_async<kRows, kBlockThreads>(dst_b, b, row0);
    }
}

template <class T>
__device__ __forceinline__ unsigned pack_pair(float lo, float hi) {
    T a = from_float<T>(lo), b = from_float<T>(hi);
    unsigned short ua, ub;
    memcpy(&ua, &a, 2);
    memcpy(&ub, &b, 2);
    return static_cast<unsigned>(ua) | static_cast<unsigned>(ub) << 16;
}

// This lane's pairs of o (rows g and g + 8 of its warp's 16, columns 8d + 2t and + 1) in the
// accumulator layout, scaled by inv[r] for row g + 8r and rounded to T, written to shared memory
// at staging + offset(row, column): one 4-byte store per pair.
template <class T, int kDTiles, class Offset>
__device__ __forceinline__ void stage_pairs(const float (&o)[kDTiles][4], const float (&inv)[2], int lane, T* staging,
                                            Offset offset) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
            T* dst = staging + offset(g + 8 * r, d * 8 + 2 * t);
            ATTN_STORE_SHARED(dst, 4);
            *reinterpret_cast<unsigned*>(dst) = pack_pair<T>(o[d][2 * r] * inv[r], o[d][2 * r + 1] * inv[r]);
        }
}

// ldmatrix.x4 address for this lane: row (lane % 8) of 8x8 matrix (lane / 8) of the 16 x 16
// block at (row0, col0) of a row-major tile, matrices ordered (rows 0-7, cols 0-7), (rows 8-15,
// cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15): the A-operand order of mma.m16n8k16.
// With ldmatrix .trans the same addresses give the B operands of two adjacent n-tiles of a tile
// stored (k, n) row-major (registers 0-1: columns 0-7, registers 2-3: columns 8-15). The lane's
// offset and the block's are summed apart, so that for constant (row0, col0) the lane's address
// is shared by every fragment and the rest folds into ldmatrix's immediate offset (one product
// of the summed rows, ptxas recomputed an address per fragment and tile: NVRTC 13.5).
template <int kStride, class T>
__device__ __forceinline__ const T* a_address(const T* tile, int row0, int col0, int lane) {
    const int m = lane / 8;
    return tile + (((m % 2) * 8 + lane % 8) * kStride + (m / 2) * 8) + (row0 * kStride + col0);
}

// ldmatrix.x4 address for B operands of two adjacent n-tiles of 8: matrices (rows 0-7, cols 0-7),
// (rows 0-7, cols 8-15), (rows 8-15, cols 0-7), (rows 8-15, cols 8-15), so registers 0-1 are
// the fragment of the rows 0-7 and registers 2-3 that of rows 8-15. For a non-transposed load
// the rows are n (e.g. keys of K for Q·Kᵀ) and the columns k. Offsets summed as a_address's.
template <int kStride, class T>
__device__ __forceinline__ const T* b_address(const T* tile, int row0, int col0, int lane) {
    const int m = lane / 8;
    return tile + (((m / 2) * 8 + lane % 8) * kStride + (m % 2) * 8) + (row0 * kStride + col0);
}

// The accumulator fragments of two adjacent 8-column tiles (16 rows x 16 columns, float) as the
// A operand of the next MMA, rounded to T: FlashAttention-2's register-resident P.
template <class T>
__device__ __forceinline__ void accumulators_as_a(unsigned (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = pack_pair<T>(lo[0], lo[1]);
    a[1] = pack_pair<T>(lo[2], lo[3]);
    a[2] = pack_pair<T>(hi[0], hi[1]);
    a[3] = pack_pair<T>(hi[2], hi[3]);
}

// acc[m] (16 x 8·kNTiles) += A_m·Bᵀ over kKSteps·16 columns, for B = rows [0, 8·kNTiles) of
// b_tile, row-major along the reduced dimension (Q·Kᵀ, K·Qᵀ, dO·Vᵀ, ...), and A_m's fragment of
// k-step kk from a_fragment(kk, m, fragment). acc[m][j] holds rows (g, g+8) x columns (8j + 2t,
// +1) of row tile m. Each B fragment is read once per k-step for all kRowTiles row tiles: a warp
// holding 32 query rows (FlashAttention-2's 128-row block of 4 warps) issues half the ldmatrix
// per MMA that one holding 16 does.
template <class T, int kStride, int kKSteps, int kRowTiles, int kNTiles, class AFragment>
__device__ __forceinline__ void mma_fragments_by_rows(float (&acc)[kRowTiles][kNTiles][4], AFragment&& a_fragment,
                                                      const T* b_tile, int lane) {
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
        unsigned a[kRowTiles][4];
#pragma unroll
        for (int m = 0; m < kRowTiles; ++m) a_fragment(kk, m, a[m]);
#pragma unroll
        for (int j = 0; j < kNTiles; j += 2) {
            unsigned bf[4];  // B fragments of column tiles j (bf[0..1]) and j + 1 (bf[2..3])
            ptx::ldmatrix<4>(bf, b_address<kStride>(b_tile, j * 8, kk * 16, lane));
#pragma unroll
            for (int m = 0; m < kRowTiles; ++m) {
                ptx::mma_m16n8k16<T>(acc[m][j], a[m], {bf[0], bf[1]}, acc[m][j]);
                ptx::mma_m16n8k16<T>(acc[m][j + 1], a[m], {bf[2], bf[3]}, acc[m][j + 1]);
            }
        }
    }
}

// mma_fragments_by_rows for A_m = rows [a_row0 + 64m, a_row0 + 64m + 16) of a_tile, read from
// shared memory at each k-step.
template <class T, int kStride, int kKSteps, int kRowTiles, int kNTiles>
__device__ __forceinline__ void mma_rows_by_rows(float (&acc)[kRowTiles][kNTiles][4], const T* a_tile, int a_row0,
                                                 const T* b_tile, int lane) {
    mma_fragments_by_rows<T, kStride, kKSteps>(acc, [&](int kk, int m, unsigned (&a)[4]) {
        ptx::ldmatrix<4>(a, a_address<kStride>(a_tile, a_row0 + 64 * m, kk * 16, lane));
    }, b_tile, lane);
}

// A warp's A fragments of rows [row0, row0 + 16) x kKSteps·16 columns of a row-major tile, held
// in registers (4 per k-step) for a loop that multiplies them by one tile of B after another.
template <int kKSteps>
struct RowFragments {
    unsigned a[kKSteps][4];

    template <int kStride, class T>
    __device__ __forceinline__ void load(const T* tile, int row0, int lane) {
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) ptx::ldmatrix<4>(a[kk], a_address<kStride>(tile, row0, kk * 16, lane));
    }
};

// acc (16 x 8·kNTiles) += A·Bᵀ for A held in registers.
template <class T, int kStride, int kKSteps, int kNTiles>
__device__ __forceinline__ void mma_rows_by_rows(float (&acc)[kNTiles][4], const RowFragments<kKSteps>& rows,
                                                 const T* b_tile, int lane) {
    mma_fragments_by_rows<T, kStride, kKSteps>(reinterpret_cast<float(&)[1][kNTiles][4]>(acc),
                                               [&](int kk, int, unsigned (&a)[4]) {
#pragma unroll
        for (int r = 0; r < 4; ++r) a[r] = rows.a[kk][r];
    }, b_tile, lane);
}

// One row tile: acc (16 x 8·kNTiles) += A·Bᵀ for A = rows [a_row0, a_row0 + 16) of a_tile.
template <class T, int kStride, int kKSteps, int kNTiles>
__device__ __forceinline__ void mma_rows_by_rows(float (&acc)[kNTiles][4], const T* a_tile, int a_row0, const T* b_tile,
                                                 int lane) {
    mma_rows_by_rows<T, kStride, kKSteps>(reinterpret_cast<float(&)[1][kNTiles][4]>(acc), a_tile, a_row0, b_tile, lane);
}

// acc[m] (16 x 8·kNTiles) += P_m·B, for P_m the 16 x 16·kKSteps accumulators of an earlier MMA
// (rounded to T and re-packed as A operands: FlashAttention-2's register-resident P) and B = rows
// [0, 16·kKSteps) of b_tile, read transposed (P·V, Pᵀ·dO, dS·K, ...), once per k-step for all
// kRowTiles row tiles. With kSumTiles = 1 the last column tile of acc takes P_m·1 instead: every
// column of it the sums of P_m's rows, of the same rounded P the product weighs B by.
template <class T, int kStride, int kKSteps, int kSumTiles = 0, int kRowTiles, int kNTiles>
__device__ __forceinline__ void mma_registers_by_rows(float (&acc)[kRowTiles][kNTiles][4],
                                                      const float (&p)[kRowTiles][2 * kKSteps][4], const T* b_tile,
                                                      int lane) {
    static_assert(kSumTiles == 0 || kSumTiles == 1, "one column tile of row sums at most");
    const unsigned ones = pack_pair<T>(1.f, 1.f);
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
        unsigned a[kRowTiles][4];
#pragma unroll
        for (int m = 0; m < kRowTiles; ++m) accumulators_as_a<T>(a[m], p[m][2 * kk], p[m][2 * kk + 1]);
        if constexpr (kSumTiles == 1)
#pragma unroll
            for (int m = 0; m < kRowTiles; ++m)
                ptx::mma_m16n8k16<T>(acc[m][kNTiles - 1], a[m], {ones, ones}, acc[m][kNTiles - 1]);
#pragma unroll
        for (int j = 0; j < kNTiles - kSumTiles; j += 2) {
            unsigned bf[4];  // B fragments of column tiles j (bf[0..1]) and j + 1 (bf[2..3])
            ptx::ldmatrix<4, true>(bf, a_address<kStride>(b_tile, kk * 16, j * 8, lane));
#pragma unroll
            for (int m = 0; m < kRowTiles; ++m) {
                ptx::mma_m16n8k16<T>(acc[m][j], a[m], {bf[0], bf[1]}, acc[m][j]);
                ptx::mma_m16n8k16<T>(acc[m][j + 1], a[m], {bf[2], bf[3]}, acc[m][j + 1]);
            }
        }
    }
}

// One row tile: acc (16 x 8·kNTiles) += P·B.
template <class T, int kStride, int kKSteps, int kNTiles>
__device__ __forceinline__ void mma_registers_by_rows(float (&acc)[kNTiles][4], const float (&p)[2 * kKSteps][4],
                                                      const T* b_tile, int lane) {
    mma_registers_by_rows<T, kStride, kKSteps>(reinterpret_cast<float(&)[1][kNTiles][4]>(acc),
                                               reinterpret_cast<const float(&)[1][2 * kKSteps][4]>(p), b_tile, lane);
}

}  // namespace attn
