// Every inline-PTX primitive cupy_attn's kernels use, in one place. Each one has the real
// instruction under __CUDA_ARCH__ and an emulated twin for cupy_attn.emulator, which exchanges
// the lanes' fragments through the emulator's warp-collective mechanism and follows the PTX ISA's
// fragment layout tables exactly (groupID = lane / 4, threadID_in_group = lane % 4).
#pragma once

#ifdef __CUDA_ARCH__
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#endif

namespace ptx {

typedef unsigned int u32;

template <class A, class B> struct is_same { static constexpr bool value = false; };
template <class A> struct is_same<A, A> { static constexpr bool value = true; };

#ifndef __CUDA_ARCH__
namespace emulated {

// 16-bit element i (0 = low half) of a packed register, as float.
template <class T>
inline float unpack(u32 reg, int i) {
    T value;
    unsigned short bits = static_cast<unsigned short>(i ? reg >> 16 : reg & 0xffffu);
    value.__x = bits;
    return float(value);
}

template <class T>
struct MmaOperand {
    const u32* a;    // 4 registers: A (16 x 16, row-major) fragment
    const u32* b;    // 2 registers: B (16 x 8, column-major) fragment
    const float* c;  // 4 accumulators: C (16 x 8)
    float d[4];
};

template <class T>
inline void mma_fn(void* const* lanes, unsigned) {
    float A[16][16], B[16][8], C[16][8];
    for (int lane = 0; lane < 32; ++lane) {
        const MmaOperand<T>* op = static_cast<const MmaOperand<T>*>(lanes[lane]);
        int g = lane >> 2, t = lane & 3;
        for (int r = 0; r < 4; ++r)      // a0: (g, 2t..2t+1)  a1: (g+8, ..)  a2: (g, 2t+8..)  a3: (g+8, 2t+8..)
            for (int e = 0; e < 2; ++e) A[g + 8 * (r & 1)][2 * t + e + 8 * (r >> 1)] = unpack<T>(op->a[r], e);
        for (int r = 0; r < 2; ++r)      // b0: (k = 2t..2t+1, n = g)  b1: (k = 2t+8.., n = g)
            for (int e = 0; e < 2; ++e) B[2 * t + e + 8 * r][g] = unpack<T>(op->b[r], e);
        for (int i = 0; i < 4; ++i)      // c0, c1: (g, 2t..2t+1)  c2, c3: (g+8, 2t..2t+1)
            C[g + 8 * (i >> 1)][2 * t + (i & 1)] = op->c[i];
    }
    for (int lane = 0; lane < 32; ++lane) {
        MmaOperand<T>* op = static_cast<MmaOperand<T>*>(lanes[lane]);
        int g = lane >> 2, t = lane & 3;
        for (int i = 0; i < 4; ++i) {
            int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
            float sum = C[row][col];
            for (int k = 0; k < 16; ++k) sum = std::fma(A[row][k], B[k][col], sum);
            op->d[i] = sum;
        }
    }
}

struct LdmatrixOperand {
    const unsigned short* row;  // the 8 16-bit elements this lane addresses (lanes 8m..8m+7: matrix m)
    u32 r[4];
};

template <int Count, bool Trans>
inline void ldmatrix_fn(void* const* lanes, unsigned) {
    auto op = [&](int lane) { return static_cast<LdmatrixOperand*>(lanes[lane]); };
    for (int m = 0; m < Count; ++m) {
        for (int lane = 0; lane < 32; ++lane) {
            int row = lane >> 2, col = 2 * (lane & 3);
            unsigned short lo, hi;
            if (Trans) {  // this lane gets column lane/4, rows 2(lane%4) and 2(lane%4)+1
                lo = op(8 * m + col)->row[row];
                hi = op(8 * m + col + 1)->row[row];
            } else {      // this lane gets row lane/4, columns 2(lane%4) and 2(lane%4)+1
                lo = op(8 * m + row)->row[col];
                hi = op(8 * m + row)->row[col + 1];
            }
            op(lane)->r[m] = static_cast<u32>(lo) | static_cast<u32>(hi) << 16;
        }
    }
}

}  // namespace emulated
#endif

// D = A·B + C on one warp's tensor cores: A 16x16 (row-major), B 16x8 (column-major), fp16 or
// bf16 inputs (T = __half or __nv_bfloat16) with float accumulators. Fragments per lane:
// a[4] (8 elements), b[2] (4 elements), c[4] and d[4] (floats), as in the PTX ISA for
// mma.m16n8k16. All 32 lanes must execute it together.
template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2], const float (&c)[4]) {
#ifdef __CUDA_ARCH__
    if constexpr (is_same<T, __half>::value) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                       "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                       "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    }
#else
    emulated::MmaOperand<T> op{a, b, c, {}};
    ::emu::warp_collective(0xffffffffu, &op, emulated::mma_fn<T>, "mma.sync.aligned.m16n8k16");
    for (int i = 0; i < 4; ++i) d[i] = op.d[i];
#endif
}

// ldmatrix.sync.aligned.m8n8.xCount[.trans].shared.b16: lane 8m + i passes the address of row i
// (16 bytes, 16-byte aligned, in shared memory) of matrix m; lane l receives in r[m] the
// elements (l/4, 2(l%4)) and (l/4, 2(l%4)+1) of matrix m, or of its transpose with Trans.
// With Count < 4 the addresses of lanes 8·Count and up are ignored. All 32 lanes execute it.
template <int Count, bool Trans = false>
__device__ __forceinline__ void ldmatrix(u32 (&r)[Count], const void* row) {
    static_assert(Count == 1 || Count == 2 || Count == 4, "ldmatrix loads 1, 2 or 4 matrices");
#ifdef __CUDA_ARCH__
    u32 address = static_cast<u32>(__cvta_generic_to_shared(row));
    if constexpr (Count == 1) {
        if constexpr (Trans) asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(address));
        else asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(address));
    } else if constexpr (Count == 2) {
        if constexpr (Trans) asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(address));
        else asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(address));
    } else {
        if constexpr (Trans) asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
        else asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
    }
#else
    emulated::LdmatrixOperand op{static_cast<const unsigned short*>(row), {}};
    ::emu::warp_collective(0xffffffffu, &op, emulated::ldmatrix_fn<Count, Trans>, Trans ? "ldmatrix.trans" : "ldmatrix");
    for (int m = 0; m < Count; ++m) r[m] = op.r[m];
#endif
}

// cp.async: copy Bytes (4, 8 or 16) from global to shared memory without staging through
// registers. The copy is only guaranteed to have landed after cp_async_wait covers its group.
// The emulator defers it until then, so a missing wait reads poisoned shared memory.
template <int Bytes>
__device__ __forceinline__ void cp_async(void* shared_dst, const void* global_src) {
    static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async copies 4, 8 or 16 bytes");
#ifdef __CUDA_ARCH__
    u32 dst = static_cast<u32>(__cvta_generic_to_shared(shared_dst));
    if constexpr (Bytes == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(global_src));
    else asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" :: "r"(dst), "l"(global_src), "n"(Bytes));
#else
    ::emu::async_copy(shared_dst, global_src, Bytes);
#endif
}

// Close the group of cp.async copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.commit_group;\n" ::);
#else
    ::emu::async_commit();
#endif
}

// Wait until at most Pending of the most recent committed groups are still in flight.
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.wait_group %0;\n" :: "n"(Pending));
#else
    ::emu::async_wait(Pending);
#endif
}

// 2^x with the MUFU unit (about 2 ulp; +-0 -> 1, -inf -> +0). Emulated with exp2f.
__device__ __forceinline__ float ex2_approx(float x) {
#ifdef __CUDA_ARCH__
    float y;
    asm volatile("ex2.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
#else
    return exp2f(x);
#endif
}

}  // namespace ptx
