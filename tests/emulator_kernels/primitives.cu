#include "ptx.cuh"
#ifdef ADD_TO_NEAREST  // a wrong __fadd_rd, which the exp2_polynomial check must catch
#define __fadd_rd __fadd_rn
#endif
#include "numeric.cuh"
// One kernel per PTX primitive. Fragments are loaded and stored with plain C++ following the PTX
// ISA tables; -DWRONG_LAYOUT pairs each lane with its neighbouring group's rows, which a correct emulation of
// the primitive must expose as a wrong result.
#ifdef WRONG_LAYOUT
#define GROUP(lane) (((lane) >> 2) ^ 1)
#define THREAD(lane) ((lane) & 3)
#else
#define GROUP(lane) ((lane) >> 2)
#define THREAD(lane) ((lane) & 3)
#endif

template <class T>
__device__ unsigned pack(T lo, T hi) {
    return static_cast<unsigned>(lo.__x) | static_cast<unsigned>(hi.__x) << 16;
}

// A (16, 16) row-major, B (16, 8) with B[k][n] at b[k * 8 + n], C and D (16, 8) row-major.
template <class T>
__global__ void mma(const T* A, const T* B, const float* C, float* D) {
    int lane = threadIdx.x, g = GROUP(lane), t = THREAD(lane);
    unsigned a[4], b[2];
    float c[4], d[4];
    for (int r = 0; r < 4; ++r) {
        int row = g + 8 * (r & 1), col = 2 * t + 8 * (r >> 1);
        a[r] = pack(A[row * 16 + col], A[row * 16 + col + 1]);
    }
    for (int r = 0; r < 2; ++r) {
        int k = 2 * t + 8 * r;
        b[r] = pack(B[k * 8 + g], B[(k + 1) * 8 + g]);
    }
    for (int i = 0; i < 4; ++i) c[i] = C[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)];
    ptx::mma_m16n8k16<T>(d, a, b, c);
    for (int i = 0; i < 4; ++i) D[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = d[i];
}

// Count 8x8 matrices of 16-bit values staged in shared memory; lane 8m+i addresses row i of
// matrix m. out[lane * 4 + m] = register m of the lane.
template <int Count, bool Trans>
__global__ void ldmatrix(const unsigned short* in, unsigned* out) {
    __shared__ __align__(16) unsigned short tile[4 * 64];
    int lane = threadIdx.x;
    for (int i = lane; i < Count * 64; i += 32) tile[i] = in[i];
    __syncwarp();
    unsigned r[Count];
    int m = (lane / 8) % Count, row = lane % 8;
#ifdef WRONG_LAYOUT
    row = 7 - row;
#endif
    ptx::ldmatrix<Count, Trans>(r, tile + m * 64 + row * 8);
    for (int i = 0; i < Count; ++i) out[lane * 4 + i] = r[i];
}

// Stage 2 x 32 float4 through cp.async in two groups; `waits` = 0 waits for both, 1 leaves the
// second group in flight, 2 skips waiting (its reads must see the poison).
extern "C" __global__ void copy_async(const float4* in, float4* out, int waits) {
    extern __shared__ float4 staged[];
    int t = threadIdx.x;
    ptx::cp_async<16>(&staged[t], &in[t]);
    ptx::cp_async_commit();
    ptx::cp_async<16>(&staged[32 + t], &in[32 + t]);
    ptx::cp_async_commit();
    if (waits == 0) ptx::cp_async_wait<0>();
    else if (waits == 1) ptx::cp_async_wait<1>();
    out[t] = staged[t];
    out[32 + t] = staged[32 + t];
}

// Stage 32 float4 through cp.async, then reload the buffer from in[32..63], each thread into its
// neighbour's slot, and return what each thread read of the first load: `guarded` reads before
// a barrier and reloads after it (right); otherwise a thread reloads first and reads after, while
// its neighbour may not have read yet (wrong: a stage reloaded while still read; every wait comes
// after every read, so only a copy landing at issue shows it).
extern "C" __global__ void reload_async(const float4* in, float4* out, int guarded) {
    extern __shared__ float4 staged[];
    const int t = threadIdx.x, neighbour = (t + 1) % 32;
    ptx::cp_async<16>(&staged[t], &in[t]);
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
    __syncthreads();
    if (guarded) {
        out[t] = staged[t];
        __syncthreads();
    }
    ptx::cp_async<16>(&staged[neighbour], &in[32 + neighbour]);
    ptx::cp_async_commit();
    if (!guarded) out[t] = staged[t];
    __syncthreads();  // every read done before any thread waits for its reload
    ptx::cp_async_wait<0>();
}

extern "C" __global__ void max_nan(const float* a, const float* b, float* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = ptx::max_nan(a[i], b[i]);
}

// The softmax's 2^x off the MUFU unit, and (for the test that the twin of its rounding matters)
// the one add it rounds down.
extern "C" __global__ void exp2_polynomial(const float* x, float* y, float* floor_shifted, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = attn::exp2_polynomial(x[i]);
        floor_shifted[i] = __fadd_rd(x[i], 12582912.f);
    }
}

// Each lane adds its pair (values[2 lane], values[2 lane + 1]) to dst's pair `slot[lane]` (lanes
// may share a slot) if enabled[lane]; `offset` floats shift every address, and 1 breaks the 8-byte
// alignment the vector reduction needs.
extern "C" __global__ void red_pairs(float* dst, const int* slot, const float* values, const int* enabled, int offset) {
    const int lane = threadIdx.x;
    ptx::red_add_pair(dst + 2 * slot[lane] + offset, values[2 * lane], values[2 * lane + 1], enabled[lane] != 0);
}
