// A paged KV cache: where key (or value) j of a batch entry lives, and staging a tile of those rows
// into shared memory through the block table.
#pragma once
#include "access_count.cuh"
#include "numeric.cuh"
#include "ptx.cuh"
#include "tile_io.cuh"

namespace attn {

// One batch entry's rows of one kv head in a paged cache (num_pages, page_size, Hkv, D): row j
// lives in page pages[j / page_size], at row j % page_size of it. A contiguous cache
// (B_cache, S_cache, Hkv, D) is the same with page_size = S_cache and a single page per entry
// (its cache_batch_idx), so one code path serves both.
struct PagedRows {
    const int* pages;       // this entry's row of the block table
    unsigned page_size;
    long long page_stride;  // elements between pages
    long long row_stride;   // elements between rows of a page

    __device__ __forceinline__ long long offset(int j) const {
        const unsigned n = static_cast<unsigned>(j);
        return pages[n / page_size] * page_stride + (n % page_size) * row_stride;
    }
};

// Stage rows [row0, row0 + kRows) x kDims of the rows `at` locates (from src, the kv head's first
// element) in shared memory, kStride elements of T per row: 16-byte cp.async chunks where
// `vectorised` (every row 16-byte aligned), element by element otherwise; zeros past `rows` and
// past `dims`. Rows at or past `rows` are never looked up in the block table, whose entries past
// an entry's length may be anything. Consecutive threads take consecutive chunks of a row, so a
// warp reads whole rows (512 contiguous bytes at D = 256, 16-bit). The caller commits and waits.
template <int kRows, int kDims, int kStride, class T>
__device__ __forceinline__ void stage_paged_rows(T* dst, const T* src, const PagedRows& at, int row0, int rows, int dims,
                                                 bool vectorised) {
    constexpr int kChunk = 16 / sizeof(T);  // elements per 16-byte chunk
    constexpr int kChunksPerRow = kDims / kChunk;
    static_assert(kDims % kChunk == 0 && (kStride * sizeof(T)) % 16 == 0, "rows of whole, aligned 16-byte chunks");
    for (int idx = threadIdx.x; idx < kRows * kChunksPerRow; idx += kThreads) {
        const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * kChunk;
        T* d = dst + r * kStride + c;
        if (row0 + r >= rows || c >= dims) {
            ATTN_STORE_SHARED(d, 16);
            *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
            continue;
        }
        const T* s = src + at.offset(row0 + r) + c;
        if (vectorised && c + kChunk <= dims) {
            ptx::cp_async<16>(d, s);
        } else {
            for (int e = 0; e < kChunk; ++e) d[e] = c + e < dims ? s[e] : from_float<T>(0.f);
        }
    }
}

}  // namespace attn
