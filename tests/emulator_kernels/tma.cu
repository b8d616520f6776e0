#include "ptx.cuh"
#include "tc_tile.cuh"
// TMA copies (ptx.cuh) between a tensor map's boxes and shared memory, and wgmma reading boxes
// that TMA swizzled. The same file compiles with NVRTC for sm_90a (test_emulator_tma.py checks the
// SASS). Deliberately wrong uses, each of which a test expects to fail: -DNO_WAIT reads the box
// without waiting for its mbarrier, -DNO_EXPECT_TX arrives without announcing the box's bytes,
// -DMISALIGNED puts the box 128 bytes past its swizzle atom, -DNO_FENCE stores shared memory
// through TMA without the proxy fence, -DNO_STORE_WAIT exits before the store read shared memory,
// -DWRONG_SWIZZLE gives wgmma a 64-byte swizzle for 128-byte swizzled boxes, -DWRONG_MAJOR_A the
// wrong major-ness of A, -DWRONG_LBO a wrong leading byte offset to an MN-major B of two boxes,
// -DNO_WGMMA_FENCE issues wgmma without the wgmma.fence before it, -DWRITE_AFTER_FENCE writes a
// register of the wide wgmma's (A's fragment or an accumulator) between its fence and it.

#ifdef MISALIGNED
constexpr int kBoxAt = 1024 + 128;
#else
constexpr int kBoxAt = 1024;  // the mbarrier at 0, the box at the next 128-byte swizzle atom
#endif

// Thread 0 loads the box at coords[0..kRank) into shared memory; every thread waits for it and
// copies the box's bytes, as they lie in shared memory (swizzled), to out.
template <int kRank>
__global__ void tma_box(const __grid_constant__ ptx::TensorMap map, const int* coords, int box_bytes, unsigned char* out) {
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned long long* bar = reinterpret_cast<unsigned long long*>(smem);
    if (threadIdx.x == 0) {
        ptx::mbarrier_init(bar, 1);
        ptx::fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int at[kRank];
        for (int d = 0; d < kRank; ++d) at[d] = coords[d];
#ifdef NO_EXPECT_TX
        ptx::mbarrier_arrive(bar);
#else
        ptx::mbarrier_arrive_expect_tx(bar, box_bytes);
#endif
        ptx::tma_load<kRank>(smem + kBoxAt, map, at, bar);
    }
#ifndef NO_WAIT
    ptx::mbarrier_wait(bar, 0);
#endif
    for (int i = threadIdx.x; i < box_bytes; i += blockDim.x) out[i] = smem[kBoxAt + i];
}

// Every thread writes the box's bytes from in to shared memory; thread 0 stores the box at coords
// (kAdd: adds it there; every block of the grid does, so the tensor gains gridDim.x boxes).
template <int kRank, bool kAdd>
__global__ void tma_store_box(const __grid_constant__ ptx::TensorMap map, const int* coords, int box_bytes,
                              const unsigned char* in) {
    extern __shared__ __align__(1024) unsigned char smem[];
    for (int i = threadIdx.x; i < box_bytes; i += blockDim.x) smem[kBoxAt + i] = in[i];
#ifndef NO_FENCE
    ptx::fence_proxy_async();  // the stores above, for TMA's reads through the async proxy
#endif
    __syncthreads();
    if (threadIdx.x == 0) {
        int at[kRank];
        for (int d = 0; d < kRank; ++d) at[d] = coords[d];
        ptx::tma_write<kAdd>(map, at, smem + kBoxAt);
        ptx::bulk_commit();
#ifndef NO_STORE_WAIT
        ptx::bulk_wait_read<0>();
#endif
    }
}

// D (64 x 64, float) = A (64 x 64) · B, A and B loaded by TMA as 64 x 64 boxes with 128-byte
// swizzle (a line is one 64-element row of the box): A K-major (rows m, 64 k per line) or MN-major
// (A given as its transpose: rows k, 64 m per line, as dSᵀ is for dQ = dS·K); B K-major (B given
// as its transpose, rows n) or MN-major (rows k, 64 n per line), as K and V are in attention.
// Four k-steps of m64n64k16; the K-major descriptors advance 32 bytes within the line per step,
// the MN-major ones 16 lines (2048 bytes). -DWRONG_MAJOR_A tells the instruction the other
// major-ness of A than the one it was loaded in; -DMID_ATOM_START starts A's descriptor one line
// into the box's first swizzle atom, which base offset 0 cannot express (the emulator must fail).
// The wgmma kernels' operands: thread 0 loads A's 64 x 64 box (to smem + 1024) and kBBoxes boxes of
// B, 64 columns apart (after it, 8 KB each), completing on the mbarrier at smem, which the caller
// waits for (phase 0).
template <int kBBoxes>
__device__ void load_operands(unsigned char* smem, const ptx::TensorMap& a_map, const ptx::TensorMap& b_map) {
    unsigned long long* bar = reinterpret_cast<unsigned long long*>(smem);
    if (threadIdx.x == 0) {
        ptx::mbarrier_init(bar, 1);
        ptx::fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        ptx::mbarrier_arrive_expect_tx(bar, (1 + kBBoxes) * 8192);
        ptx::tma_load<2>(smem + 1024, a_map, {0, 0}, bar);
        for (int box = 0; box < kBBoxes; ++box) ptx::tma_load<2>(smem + 1024 + 8192 * (1 + box), b_map, {64 * box, 0}, bar);
    }
}

template <bool kMnMajorA, bool kMnMajorB>
__global__ void tma_wgmma(const __grid_constant__ ptx::TensorMap a_map, const __grid_constant__ ptx::TensorMap b_map,
                          float* D) {
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char* sA = smem + 1024;
    unsigned char* sB = sA + 8192;
    load_operands<1>(smem, a_map, b_map);
    ptx::mbarrier_wait(reinterpret_cast<unsigned long long*>(smem), 0);
#ifdef WRONG_SWIZZLE
    constexpr ptx::Swizzle kSwizzle = ptx::Swizzle::B64;
#else
    constexpr ptx::Swizzle kSwizzle = ptx::Swizzle::B128;
#endif
#ifdef WRONG_MAJOR_A
    constexpr bool kToldMnMajorA = !kMnMajorA;
#else
    constexpr bool kToldMnMajorA = kMnMajorA;
#endif
    // MN-major: LBO steps to the next 64 m or n (none here), SBO to the next 8 k (8 lines).
#ifdef MID_ATOM_START
    constexpr int kAStart = 128;  // one line into the atom
#else
    constexpr int kAStart = 0;
#endif
    const unsigned long long a_desc = ptx::wgmma_descriptor(sA + kAStart, kMnMajorA ? 8192 : 16, 1024, kSwizzle);
    const unsigned long long b_desc = ptx::wgmma_descriptor(sB, kMnMajorB ? 8192 : 16, 1024, kSwizzle);
    float d[32];
#ifndef NO_WGMMA_FENCE
    ptx::wgmma_fence();
#endif
    for (int kk = 0; kk < 4; ++kk)
        ptx::wgmma_m64k16_ss<__half, 64, kMnMajorB ? ptx::Major::MN : ptx::Major::K,
                             kToldMnMajorA ? ptx::Major::MN : ptx::Major::K>(
            d, ptx::descriptor_plus(a_desc, kMnMajorA ? 2048 * kk : 32 * kk),
            ptx::descriptor_plus(b_desc, kMnMajorB ? 2048 * kk : 32 * kk), kk > 0);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    for (int j = 0; j < 8; ++j)
        for (int e = 0; e < 4; ++e) D[(16 * warp + g + 8 * (e / 2)) * 64 + 8 * j + 2 * t + (e & 1)] = d[4 * j + e];
}

// D (64 x N, float) = A (64 x 64) · B (64 x N), one m64nNk16 per k-step (N = 128 or 72). B is
// MN-major in two TMA boxes of 64 n (rows k, 64 n per line), which the descriptor's leading byte
// offset (8192 bytes) steps between, as V's does at D = 128 and dO's and Q's in the backward at
// D = 128; with N = 72 the instruction reads only the second box's first 8 n, as P·V at D = 64
// reads its 8 columns of ones. A is K-major
// from its box (SS) or, with kRegisterA, in registers: read from a_values (64 x 64, float) in the
// accumulator layout and packed as P is for P·V (accumulators_as_a, RS). -DWRONG_LBO gives B's
// descriptor the leading byte offset of a K-major operand (16 bytes).
template <bool kRegisterA, int N>
__global__ void tma_wgmma_wide(const __grid_constant__ ptx::TensorMap a_map, const __grid_constant__ ptx::TensorMap b_map,
                               const float* a_values, float* D) {
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char* sA = smem + 1024;
    unsigned char* sB = sA + 8192;
    load_operands<2>(smem, a_map, b_map);
    const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    unsigned a[4][4];  // this warp's 16 rows of A, 16 k per step
    unsigned(&a_flat)[16] = reinterpret_cast<unsigned(&)[16]>(a);
    if constexpr (kRegisterA) {
        float acc[8][4];
        for (int j = 0; j < 8; ++j)
            for (int e = 0; e < 4; ++e) acc[j][e] = a_values[(16 * warp + g + 8 * (e / 2)) * 64 + 8 * j + 2 * t + (e & 1)];
        for (int kk = 0; kk < 4; ++kk) attn::accumulators_as_a<__half>(a[kk], acc[2 * kk], acc[2 * kk + 1]);
    }
    ptx::mbarrier_wait(reinterpret_cast<unsigned long long*>(smem), 0);
#ifdef WRONG_LBO
    constexpr unsigned kBLbo = 16;
#else
    constexpr unsigned kBLbo = 8192;
#endif
    const unsigned long long a_desc = ptx::wgmma_descriptor(sA, 16, 1024, ptx::Swizzle::B128);
    const unsigned long long b_desc = ptx::wgmma_descriptor(sB, kBLbo, 1024, ptx::Swizzle::B128);
    float d[N / 2];
#ifdef WRITE_AFTER_FENCE
    for (float& x : d) x = 0.f;
    ptx::fence_operands(d);
#endif
    ptx::fence_operands(a_flat);
    ptx::wgmma_fence();
#ifdef WRITE_AFTER_FENCE
    if constexpr (kRegisterA) a[1][0] ^= 1u;  // the second k-step's A fragment
    else d[0] = 1.f;                          // an accumulator
#endif
    for (int kk = 0; kk < 4; ++kk) {
        const unsigned long long b_step = ptx::descriptor_plus(b_desc, 2048 * kk);
        if constexpr (kRegisterA)
            ptx::wgmma_m64k16_rs<__half, N, ptx::Major::MN>(d, a[kk], b_step, kk > 0);
        else
            ptx::wgmma_m64k16_ss<__half, N, ptx::Major::MN>(d, ptx::descriptor_plus(a_desc, 32 * kk), b_step, kk > 0);
    }
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    ptx::fence_operands(a_flat);
    for (int j = 0; j < N / 8; ++j)
        for (int e = 0; e < 4; ++e) D[(16 * warp + g + 8 * (e / 2)) * N + 8 * j + 2 * t + (e & 1)] = d[4 * j + e];
}
