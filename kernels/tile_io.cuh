// Moving tiles between global and shared memory; every kernel uses blocks of kThreads threads.
#pragma once
#include "numeric.cuh"

namespace attn {

constexpr int kThreads = 128;  // 4 warps; cupy_attn._config.THREADS must match

// The stage (0 .. kStages - 1) holding tile `tile` (>= 0) of a loop that loads each tile into
// the next of kStages buffers: by the tile's own index, not its place in the loop (which costs
// a subtraction per use), as an unsigned remainder, which for 1 or 2 stages is a mask (a signed
// one adds a sign correction per tile).
template <int kStages>
__device__ __forceinline__ int pipeline_stage(int tile) {
    return static_cast<int>(static_cast<unsigned>(tile) % kStages);
}

// Copy rows [row0, row0 + kRows) of a (rows, dims) matrix (row stride in elements, unit stride
// along dims) into shared memory as float, zero-filled past `rows` and past `dims`, so padding
// can never turn into NaN (0 · NaN) in a later product.
template <int kRows, int kDims, int kStride, class T>
__device__ __forceinline__ void stage_tile(float* dst, const T* src, long long row_stride, int row0, int rows, int dims) {
    for (int idx = threadIdx.x; idx < kRows * kDims; idx += kThreads) {
        int r = idx / kDims, d = idx % kDims;
        float x = 0.f;
        if (row0 + r < rows && d < dims) x = to_float(src[(row0 + r) * row_stride + d]);
        dst[r * kStride + d] = x;
    }
}

}  // namespace attn
