#include "access_count.cuh"
#include "ptx.cuh"
// wgmma.mma_async m64nNk16 (N = 32, 64, 128, 176) in both forms, one warpgroup. Operands are
// placed in shared memory with plain C++ following the no-swizzle canonical layouts (A K-major, B
// K-major or MN-major), with deliberately unusual strides (A: LBO 256, SBO 512 bytes; B: LBO 1024
// bytes, 16·N for N = 128 and 176 whose N / 8 row groups fill that, SBO 128 bytes) so the
// descriptor decoding is exercised; -DWRONG_LAYOUT passes LBO and SBO swapped, -DWRONG_MAJOR tells
// the instruction the other major-ness of B than the one it was placed in: both must give a wrong
// result. -DNO_FENCE leaves out the proxy fence, so wgmma reads poison. -DWRITE_D_BEFORE_WAIT and
// -DWRITE_A_BEFORE_WAIT write an accumulator or an A register (RS form) between the issue and the
// wait, which the emulator must report; -DTWO_GROUPS issues the product twice in two groups
// (D = 2·A·B + C), the second waited for after the first: legal, and must not be reported.
// -DPER_WARP_A (SS form) gives each warp a descriptor of its own 16 rows of A, where PTX wants
// the warpgroup's one descriptor in every warp: the emulator must report it. -DNAMED_STORES uses
// the async proxy before the operands' stores (as a kernel's main loop has) and names the stores
// (ATTN_STORE_SHARED), which only their own thread's fence publishes: with -DONE_THREAD_FENCES
// thread 0 alone fences, and wgmma must read the other threads' operands as poison.
constexpr unsigned kLboA = 256, kSboA = 512, kSboB = 128;
template <int N>
constexpr unsigned kLboB = N <= 64 ? 1024 : 16 * N;

// Byte offset of element (row, k) in the K-major layout with these strides (row: the M or N index).
__device__ unsigned k_major(int row, int k, unsigned lbo, unsigned sbo) {
    return (row / 8) * sbo + (row % 8) * 16 + (k / 8) * lbo + (k % 8) * 2;
}

// Byte offset of element (row, k) in the MN-major layout: a core matrix's 16-byte lines are k.
__device__ unsigned mn_major(int row, int k, unsigned lbo, unsigned sbo) {
    return (row / 8) * sbo + (row % 8) * 2 + (k / 8) * lbo + (k % 8) * 16;
}

template <bool kMnMajorB>
constexpr ptx::Major kInstructionMajor =
#ifdef WRONG_MAJOR
    kMnMajorB ? ptx::Major::K : ptx::Major::MN;
#else
    kMnMajorB ? ptx::Major::MN : ptx::Major::K;
#endif

__device__ unsigned long long descriptor(const void* tile, unsigned lbo, unsigned sbo) {
#ifdef WRONG_LAYOUT
    return ptx::wgmma_descriptor(tile, sbo, lbo);
#else
    return ptx::wgmma_descriptor(tile, lbo, sbo);
#endif
}

// A (64, 16) row-major, B (16, N) with B[k][n] at b[k * N + n], C and D (64, N) row-major.
// kRegisterA: A from registers (RS) instead of shared memory (SS); kMnMajorB: B placed MN-major.
// waits = 0 skips the wait.
template <class T, bool kRegisterA, int N, bool kMnMajorB>
__global__ void wgmma(const T* A, const T* B, const float* C, float* D, int waits) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* sA = smem;          // 8 row groups x 512 bytes
    unsigned char* sB = smem + 4096;   // 8 row groups x 128 bytes, K halves 1024 bytes apart
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
#ifdef NAMED_STORES
    ptx::fence_proxy_async();
    __syncthreads();
#define STORE(at) ATTN_STORE_SHARED(at, 2)
#else
#define STORE(at)
#endif
    for (int i = tid; i < (N > 64 ? N : 64) * 16; i += 128) {
        const int m = i / 16, k = i % 16;
        if (m < 64) {
            STORE(sA + k_major(m, k, kLboA, kSboA));
            memcpy(sA + k_major(m, k, kLboA, kSboA), &A[m * 16 + k], 2);
        }
        // element (n = m, k) of B, at B[k][m]
        if (m < N) {
            STORE(sB + (kMnMajorB ? mn_major : k_major)(m, k, kLboB<N>, kSboB));
            memcpy(sB + (kMnMajorB ? mn_major : k_major)(m, k, kLboB<N>, kSboB), &B[k * N + m], 2);
        }
    }
#if defined(ONE_THREAD_FENCES)
    __syncthreads();  // every store made (a barrier orders them in the generic proxy only)
    if (tid == 0) ptx::fence_proxy_async();  // wrong: every thread's stores need its own fence
#elif !defined(NO_FENCE)
    ptx::fence_proxy_async();  // the stores above, for wgmma's reads through the async proxy
#endif
    __syncthreads();
    float d[N / 2];
    for (int j = 0; j < N / 8; ++j)
        for (int e = 0; e < 4; ++e) d[4 * j + e] = C[(16 * warp + g + 8 * (e / 2)) * N + 8 * j + 2 * t + (e & 1)];
    unsigned a[4];  // (RS form) read by the tensor cores until the wait, so in scope until then
    for (int r = 0; r < 4; ++r) {
        const int row = 16 * warp + g + 8 * (r & 1), col = 2 * t + 8 * (r >> 1);
        a[r] = static_cast<unsigned>(A[row * 16 + col].__x) | static_cast<unsigned>(A[row * 16 + col + 1].__x) << 16;
    }
    ptx::wgmma_fence();
#ifdef TWO_GROUPS
    for (int group = 0; group < 2; ++group) {
#endif
        if (kRegisterA)
            ptx::wgmma_m64k16_rs<T, N, kInstructionMajor<kMnMajorB>>(d, a, descriptor(sB, kLboB<N>, kSboB), 1);
        else
#ifdef PER_WARP_A
            ptx::wgmma_m64k16_ss<T, N, kInstructionMajor<kMnMajorB>>(d, descriptor(sA + 2 * warp * kSboA, kLboA, kSboA),
                                                                      descriptor(sB, kLboB<N>, kSboB), 1);
#else
            ptx::wgmma_m64k16_ss<T, N, kInstructionMajor<kMnMajorB>>(d, descriptor(sA, kLboA, kSboA),
                                                                      descriptor(sB, kLboB<N>, kSboB), 1);
#endif
        ptx::wgmma_commit();
#ifdef TWO_GROUPS
    }
    ptx::wgmma_wait<1>();
#endif
#ifdef WRITE_D_BEFORE_WAIT
    d[N / 2 - 1] = 0.f;
#endif
#ifdef WRITE_A_BEFORE_WAIT
    a[3] ^= 1u;
#endif
    if (waits) ptx::wgmma_wait<0>();
    for (int j = 0; j < N / 8; ++j)
        for (int e = 0; e < 4; ++e) D[(16 * warp + g + 8 * (e / 2)) * N + 8 * j + 2 * t + (e & 1)] = d[4 * j + e];
}
