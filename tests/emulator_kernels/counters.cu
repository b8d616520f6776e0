// Hand-made access patterns with known wavefront and sector counts, for the emulator's memory
// counters (tests/test_memory_counters.py).
#include "access_count.cuh"
#include "ptx.cuh"

// Lane l accesses `bytes` at shared offset (l * stride) % 4096.
extern "C" __global__ void shared_pattern(int stride, int bytes) {
    extern __shared__ unsigned char sm[];
    ATTN_LOAD_SHARED(sm + threadIdx.x * stride % 4096, bytes);
}

// Lane l accesses `bytes` at element l * stride of a global array.
extern "C" __global__ void global_pattern(const float* data, int stride, int bytes) {
    ATTN_COUNT_GLOBAL(reinterpret_cast<const unsigned char*>(data) + threadIdx.x * stride, bytes);
}

// ldmatrix.x4 of four 8x8 matrices whose rows are `row_bytes` apart (lane l addresses row l).
extern "C" __global__ void ldmatrix_rows(int row_bytes, unsigned* out) {
    extern __shared__ unsigned char sm[];
    for (int i = threadIdx.x; i < 32 * row_bytes / 4; i += blockDim.x) reinterpret_cast<unsigned*>(sm)[i] = i;
    __syncthreads();
    unsigned r[4];
    ptx::ldmatrix<4>(r, sm + threadIdx.x * row_bytes);
    out[threadIdx.x] = r[0] + r[1] + r[2] + r[3];
}

// A loop: every lane makes `n` accesses at one line, each iteration's a warp-wide access of its own.
extern "C" __global__ void repeated(int n) {
    extern __shared__ unsigned char sm[];
    for (int i = 0; i < n; ++i) ATTN_LOAD_SHARED(sm + 4 * threadIdx.x + 128 * i, 4);
}
