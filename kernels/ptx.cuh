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

// The caller's file and line, which the emulated twins of shared/global memory primitives hand to
// the emulator's memory counters (access_count.cuh). Nothing on the GPU.
#ifdef __CUDA_ARCH__
#define PTX_CALL_SITE
#else
#define PTX_CALL_SITE , const char *site_file = __builtin_FILE(), int site_line = __builtin_LINE()
#endif

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


// One lane's share of a wgmma.mma_async (m64nNk16; operands K- or MN-major, swizzled or not). The
// warpgroup's warp w computes rows 16w..16w+15 of D; the emulator runs each warp's share as a
// warp collective when the warp waits for the operation's group.
constexpr int kMaxWgmmaAccumulators = 88;  // per lane, of the widest shape wrapped (m64n176k16)
struct WgmmaOperand {
    u32 a[4];                    // A fragment in registers (RS form), as for mma.m16n8k16
    const u32* a_registers;      // the caller's A fragment, which must still hold a[] at the wait
    unsigned long long a_desc;   // or A in shared memory (SS form)
    unsigned long long b_desc;
    bool a_in_registers;
    bool a_mn_major;             // A's core matrices hold 8 k-rows of 8 consecutive m (imm-trans-a; SS form)
    bool b_mn_major;             // B's core matrices hold 8 k-rows of 8 consecutive n (imm-trans-b)
    int scale_d;                 // 0: D = A·B, else D = A·B + D
    int warp_in_group;
    float* d;                    // N / 2 accumulators of this lane
    float d_at_issue[kMaxWgmmaAccumulators];  // and what they held when the instruction was issued
    unsigned long long issued;   // register_clock at the issue
};

// The tensor cores read a wgmma's A registers and read and write its accumulators at any time
// between the issue and the wait that covers it, so the thread must not write them in that window
// (on the GPU the result would be undefined; fence_operands only keeps the compiler from moving
// accesses into it). The emulator, which reads them only at the wait, checks there that they
// still hold what they held at the issue or, for accumulators, what an earlier wgmma of the
// window wrote into them: register_clock orders issues and executions, and last_written records,
// per accumulator array, the values and time of the latest emulated write.
struct WrittenAccumulators {
    unsigned long long at;
    float values[kMaxWgmmaAccumulators];
};
inline thread_local unsigned long long register_clock = 0;  // a block runs on one host thread
inline thread_local std::map<const float*, WrittenAccumulators> last_written;

inline void take_issue_snapshot(WgmmaOperand& op, int accumulators) {
    memcpy(op.d_at_issue, op.d, sizeof(float) * accumulators);
    op.issued = ++register_clock;
}

// The pattern of a swizzled operand restarts every 8 lines (an atom), and the hardware takes the
// operand's line within it from the descriptor's base offset (0 here), not from the address: the
// start must lie in an atom's first 128 bytes (address bits 7.. within the atom clear; the k-steps
// of a K-major operand move it 32, 64 or 96 bytes along the first line). The emulator swizzles
// absolute addresses, as TMA writes them, so without this check a start on a later line would
// read there what the hardware does not.
inline unsigned swizzle_span(unsigned long long desc) {
    static constexpr unsigned kSpan[4] = {0, 128, 64, 32};  // the descriptor's swizzle modes 0..3
    return kSpan[desc >> 62];
}
inline void check_descriptor(unsigned long long desc, const char* operand) {
    if ((desc >> 49) & 7u) ::emu::fail("wgmma: a non-zero matrix base offset is not emulated");
    const unsigned span = swizzle_span(desc), start = static_cast<unsigned>(desc & 0x3fffu) << 4;
    if (span && start % (8 * span) >= 128)
        ::emu::fail(::emu::format("wgmma: %s's %u-byte swizzled operand starts %u bytes into its %u-byte atom, past the "
                                  "atom's first 128 bytes (base offset 0)", operand, span, start % (8 * span), 8 * span));
}

// Element (row, k) of an operand (row: its M or N index), 16-bit elements, after the PTX ISA's
// canonical layouts (CuTe notation, in 16-byte units T). Without swizzle: 8x8 core matrices of 128
// contiguous bytes, LBO bytes apart along k and SBO bytes apart along the rows, ((8,m),(T,2k)):
// ((1T,SBO),(1,LBO)) K-major (a core matrix's 16-byte lines are rows, 8 consecutive k each) and
// ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)) MN-major (its lines are k, 8 consecutive rows each). With
// a swizzle span W of 32, 64 or 128 bytes the lines are W bytes long, 8 of them an atom, and the
// address's 16-byte chunk bits are XORed with its bits 7.. (as TMA writes them): K-major
// ((8,m),(T,2k)):((W/16 T,SBO),(1,T)), a line one row of W/2 consecutive k (LBO unused), and
// MN-major ((T,W/16,m),(8,k)):((1,T,LBO),(W/16 T,SBO)), a line one k of W/2 consecutive rows,
// LBO bytes to the next W/2 rows and SBO to the next 8 k.
template <class T>
inline float descriptor_element(unsigned long long desc, int row, int k, bool mn_major) {
    const unsigned span = swizzle_span(desc);
    const size_t start = (desc & 0x3fffu) << 4, lbo = ((desc >> 16) & 0x3fffu) << 4, sbo = ((desc >> 32) & 0x3fffu) << 4;
    size_t offset;
    if (!span) {
        const size_t in_core = mn_major ? (k % 8) * 16 + (row % 8) * 2 : (row % 8) * 16 + (k % 8) * 2;
        offset = start + (row / 8) * sbo + (k / 8) * lbo + in_core;
    } else {
        const int per_line = static_cast<int>(span / 2);  // elements in a line
        offset = mn_major ? start + (row % per_line) * 2 + (row / per_line) * lbo + (k % 8) * span + (k / 8) * sbo
                          : start + (row % 8) * span + (row / 8) * sbo + k * 2;
        if (!mn_major && k >= per_line) ::emu::fail("wgmma: a K-major swizzled operand's k runs past its line");
        offset = ::emu::swizzled_offset(static_cast<unsigned>(offset), span);
    }
    T value;
    memcpy(&value.__x, ::emu::async_shared_pointer(offset, 2, "wgmma operand"), 2);  // through the async proxy
    return float(value);
}

template <class T, int N>
inline void wgmma_fn(void* const* lanes, unsigned) {
    static_assert(N / 2 <= kMaxWgmmaAccumulators, "an emulated wgmma holds at most kMaxWgmmaAccumulators per lane");
    auto op = [&](int lane) { return static_cast<const WgmmaOperand*>(lanes[lane]); };
    const WgmmaOperand& first = *op(0);
    for (int lane = 1; lane < 32; ++lane)
        if (op(lane)->b_desc != first.b_desc || op(lane)->a_in_registers != first.a_in_registers ||
            (!first.a_in_registers && op(lane)->a_desc != first.a_desc) || op(lane)->scale_d != first.scale_d ||
            op(lane)->a_mn_major != first.a_mn_major || op(lane)->b_mn_major != first.b_mn_major)
            ::emu::fail("wgmma: the lanes of a warp passed different descriptors or scale-d");
    // One instruction of the warpgroup: PTX requires the same descriptors in its four warps (each
    // warp takes its 16 rows of A from the shared descriptor, not from one of its own).
    const ::emu::WarpgroupInstruction mine{
        {first.a_in_registers ? 0ull : first.a_desc, first.b_desc,
         static_cast<unsigned long long>(N) | first.a_in_registers << 8 | first.a_mn_major << 9 | first.b_mn_major << 10}};
    if (!(::emu::warpgroup_instruction(::emu::kWgmma, mine) == mine))
        ::emu::fail(::emu::format("wgmma: the warps of warpgroup %u issued different wgmma.mma_async (matrix descriptors, "
                                  "shape or form) where each warp issues the same instruction of the warpgroup",
                                  ::emu::tl_fiber->linear / 128));
    check_descriptor(first.b_desc, "B");
    if (!first.a_in_registers) check_descriptor(first.a_desc, "A");
    for (int lane = 0; lane < 32; ++lane) {
        const WgmmaOperand& o = *op(lane);
        if (o.a_in_registers && memcmp(o.a_registers, o.a, sizeof o.a))
            ::emu::fail(::emu::format("wgmma: lane %d wrote its A registers before the wait that covers the wgmma reading "
                                      "them", lane));
        const auto written = last_written.find(o.d);
        const float* expected =
            written != last_written.end() && written->second.at > o.issued ? written->second.values : o.d_at_issue;
        if (memcmp(o.d, expected, sizeof(float) * (N / 2)))
            ::emu::fail(::emu::format("wgmma: lane %d wrote its accumulators between the wgmma's issue and the wait that "
                                      "covers it", lane));
    }
    float A[16][16], B[16][N];
    for (int k = 0; k < 16; ++k)
        for (int n = 0; n < N; ++n) B[k][n] = descriptor_element<T>(first.b_desc, n, k, first.b_mn_major);
    for (int lane = 0; lane < 32; ++lane) {
        const int g = lane >> 2, t = lane & 3;
        for (int r = 0; r < 4; ++r)
            for (int e = 0; e < 2; ++e) {
                const int row = g + 8 * (r & 1), k = 2 * t + e + 8 * (r >> 1);
                A[row][k] = first.a_in_registers ? unpack<T>(op(lane)->a[r], e)
                                                 : descriptor_element<T>(first.a_desc, 16 * first.warp_in_group + row, k,
                                                                         first.a_mn_major);
            }
    }
    for (int lane = 0; lane < 32; ++lane) {
        const int g = lane >> 2, t = lane & 3;
        float* d = op(lane)->d;
        for (int j = 0; j < N / 8; ++j)
            for (int e = 0; e < 4; ++e) {
                const int row = g + 8 * (e >> 1), col = 8 * j + 2 * t + (e & 1);
                float sum = first.scale_d ? d[4 * j + e] : 0.f;
                for (int k = 0; k < 16; ++k) sum = std::fma(A[row][k], B[k][col], sum);
                d[4 * j + e] = sum;
            }
        WrittenAccumulators& written = last_written[d];
        written.at = ++register_clock;
        memcpy(written.values, d, sizeof(float) * (N / 2));
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
__device__ __forceinline__ void ldmatrix(u32 (&r)[Count], const void* row PTX_CALL_SITE) {
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
    if (::emu::lane_id() < 8u * Count) ::emu::generic_load(row, 16, site_file, site_line);
    emulated::LdmatrixOperand op{static_cast<const unsigned short*>(row), {}};
    ::emu::warp_collective(0xffffffffu, &op, emulated::ldmatrix_fn<Count, Trans>, Trans ? "ldmatrix.trans" : "ldmatrix");
    for (int m = 0; m < Count; ++m) r[m] = op.r[m];
#endif
}

// cp.async: copy Bytes (4, 8 or 16) from global to shared memory without staging through
// registers. The copy is only guaranteed to have landed after cp_async_wait covers its group.
// The emulator lands it at issue or defers it until then, by schedule (emu::copy_lands_at_issue), so
// a missing wait reads poisoned shared memory in some, and a reload of a buffer still read shows in
// others.
template <int Bytes>
__device__ __forceinline__ void cp_async(void* shared_dst, const void* global_src PTX_CALL_SITE) {
    static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async copies 4, 8 or 16 bytes");
#ifdef __CUDA_ARCH__
    u32 dst = static_cast<u32>(__cvta_generic_to_shared(shared_dst));
    if constexpr (Bytes == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(global_src));
    else asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" :: "r"(dst), "l"(global_src), "n"(Bytes));
#else
    ::emu::count_access(::emu::kShared, shared_dst, Bytes, site_file, site_line);
    ::emu::count_access(::emu::kGlobal, global_src, Bytes, site_file, site_line);
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

// If `enabled`: dst[0] += a and dst[1] += b in global memory (dst 8-byte aligned), with no result
// read back. On sm_90 one red.global.add.v2.f32 (PTX ISA 8.1) under a predicate; two scalar atomic
// adds before it. The emulator adds both atomically and counts one 8-byte access, checking the
// alignment the vector form needs.
__device__ __forceinline__ void red_add_pair(float* dst, float a, float b, bool enabled PTX_CALL_SITE) {
#ifdef __CUDA_ARCH__
#if __CUDA_ARCH__ >= 900
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %3, 0;\n@p red.global.add.v2.f32 [%0], {%1, %2};\n}\n"
                 :: "l"(dst), "f"(a), "f"(b), "r"(static_cast<int>(enabled)) : "memory");
#else
    if (enabled) {
        atomicAdd(dst, a);
        atomicAdd(dst + 1, b);
    }
#endif
#else
    if (!enabled) return;
    if (reinterpret_cast<unsigned long long>(dst) % 8) ::emu::fail("red.global.add.v2.f32: address not 8-byte aligned");
    ::emu::count_access(::emu::kGlobal, dst, 8, site_file, site_line);
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
#endif
}

// max(a, b) that propagates NaN, where fmaxf returns the other operand: one max.NaN.f32 (PTX ISA
// 7.0, sm_80). A clamp that must not turn a NaN into a number (exp2_polynomial).
__device__ __forceinline__ float max_nan(float a, float b) {
#ifdef __CUDA_ARCH__
    float y;
    asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(y) : "f"(a), "f"(b));
    return y;
#else
    if (a != a || b != b) return __int_as_float(0x7fffffff);  // PTX's canonical NaN
    return a > b || (a == b && !std::signbit(a)) ? a : b;  // +0 above -0
#endif
}


// ---- Hopper (sm_90a) warpgroup MMA ------------------------------------------------------------
// A warpgroup is 4 consecutive warps starting at a warp index divisible by 4 (in cupy_attn a
// 128-thread block, or one of the warp-specialised kernels' three). Its wgmma.mma_async m64nNk16
// computes D (64 x N, float) = A (64 x 16) · B (16 x N) [+ D] asynchronously: warp w holds rows
// 16w..16w+15 of D in the mma.m16n8k16 accumulator layout, d[4j + e] at row g + 8(e / 2),
// column 8j + 2t + e % 2 (g = lane / 4, t = lane % 4), so N / 2 floats per lane. B, and A in the
// SS form, are read from shared memory through matrix descriptors, in the canonical layouts
// without swizzle (8x8 core matrices of 128 contiguous bytes; LBO = bytes between core matrices
// along K, SBO = along M/N) or with one (descriptor_element above; the kernels' TMA boxes are
// 128-byte swizzled), each K-major or MN-major (Major below; A from registers is the
// mma.m16n8k16 fragment).
// The results are defined only after wgmma_wait covers their group; the emulator writes them
// then, reading the operands as the async proxy sees them (poison where no fence_proxy_async
// published the generic writes), and checking that the thread left the instruction's registers
// alone until then (WgmmaOperand), and that a wgmma_fence preceded it (emu_async.h).

// The shared-window address of a pointer into shared memory.
__device__ __forceinline__ u32 shared_address(const void* p) {
#ifdef __CUDA_ARCH__
    return static_cast<u32>(__cvta_generic_to_shared(p));
#else
    return ::emu::shared_offset(p, "shared_address");
#endif
}

// How an operand's lines are swizzled in shared memory (the descriptor's layout type): not at all
// (core matrices), or 16-byte chunks permuted within lines of 128, 64 or 32 bytes, as TMA writes
// boxes with the same swizzle (the box's innermost dimension one line).
enum class Swizzle : unsigned { None = 0, B128 = 1, B64 = 2, B32 = 3 };

// A matrix descriptor (base offset 0) for the operand starting at `tile` in shared memory, 16-byte
// aligned (swizzled: at a multiple of 8 lines of the span within its atom, so the base offset is
// 0); lbo and sbo in bytes, multiples of 16.
__device__ __forceinline__ unsigned long long wgmma_descriptor(const void* tile, u32 lbo, u32 sbo,
                                                               Swizzle swizzle = Swizzle::None) {
    const u32 address = shared_address(tile);
    return static_cast<unsigned long long>((address & 0x3ffffu) >> 4) |
           static_cast<unsigned long long>((lbo & 0x3ffffu) >> 4) << 16 |
           static_cast<unsigned long long>((sbo & 0x3ffffu) >> 4) << 32 |
           static_cast<unsigned long long>(swizzle) << 62;
}

// The descriptor of the operand `bytes` (a multiple of 16) further on in shared memory, with the
// same strides: the start address is the low 14 bits in 16-byte units, and shared addresses stay
// below 2^18 bytes, so the addition never carries into LBO. One integer add where building the
// descriptor again would mask, shift and combine every field.
__device__ __forceinline__ unsigned long long descriptor_plus(unsigned long long desc, u32 bytes) {
    return desc + (bytes >> 4);
}

// x, which the compiler must take as computed here: values derived from it (a k-step's descriptors)
// are then computed where they are used, not hoisted out of a loop to stay live in registers.
__device__ __forceinline__ unsigned long long opaque(unsigned long long x) {
#ifdef __CUDA_ARCH__
    asm volatile("mov.b64 %0, %0;\n" : "+l"(x));
#endif
    return x;
}

// A compiler barrier: NVVM moves no memory access (or volatile asm) across it, so the loads and
// stores before it are emitted before those after it (arithmetic may still move, and ptxas
// schedules the rest). Nothing is emitted; the emulator, which runs the source in order, needs
// nothing.
__device__ __forceinline__ void compiler_barrier() {
#ifdef __CUDA_ARCH__
    asm volatile("" ::: "memory");
#endif
}

// Order this thread's earlier register writes (accumulators, A fragments) before the next wgmma.
__device__ __forceinline__ void wgmma_fence() {
#ifdef __CUDA_ARCH__
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
    ::emu::wgmma_fence();
#endif
}

// Make this thread's generic-proxy writes of shared memory (stores, cp.async) visible to the
// async proxy that wgmma reads through; a barrier must follow before other threads' wgmma.
__device__ __forceinline__ void fence_proxy_async() {
#ifdef __CUDA_ARCH__
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#else
    ::emu::fence_proxy_async();
#endif
}

// Pin the compiler's view of registers a wgmma reads or writes asynchronously (accumulators, A
// fragments): an empty asm that "modifies" each one, placed before the issue and after the
// wait, so no access to them moves into the asynchronous window.
template <class R, int N>
__device__ __forceinline__ void fence_operands(R (&registers)[N]) {
#ifdef __CUDA_ARCH__
#pragma unroll
    for (int i = 0; i < N; ++i) {
        if constexpr (is_same<R, float>::value) asm volatile("" : "+f"(registers[i])::"memory");
        else asm volatile("" : "+r"(registers[i])::"memory");
    }
#else
    ::emu::pin_registers(registers, sizeof registers);  // a wgmma's registers: checked at its issue
#endif
}

// Close the group of wgmma operations issued since the last commit.
__device__ __forceinline__ void wgmma_commit() {
#ifdef __CUDA_ARCH__
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
    ::emu::deferred_commit();
#endif
}

// Wait until at most Pending of the most recent committed wgmma groups are in flight.
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
#ifdef __CUDA_ARCH__
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(Pending) : "memory");
#else
    ::emu::deferred_wait(Pending, "wgmma.wait_group");
    ::emu::wgmma_waited();
#endif
}

// ---- Hopper (sm_90) synchronisation: mbarriers, named barriers, elect, setmaxnreg -------------
// An mbarrier is an 8-byte object in shared memory (8-byte aligned) that counts arrivals and
// transaction bytes per phase: a phase completes when `count` arrivals came (count from
// mbarrier_init) and every byte announced by expect-tx has been completed (by TMA copies, or
// mbarrier_complete_tx); then the phase bit flips and the next phase expects `count` again. A
// wait names the phase by its parity: waiting for parity p returns once the phase in progress
// has the other parity, so a thread must never fall two phases behind (the emulator reports it).
// One thread initialises; a block barrier must follow before any other thread uses the object.
// Each is initialised once per block and its 8 bytes left alone until the block ends: there is no
// mbarrier.inval here, without which the PTX ISA leaves a second init, or any other use of the
// memory, undefined (the emulator reports both).

__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, u32 count) {
#ifdef __CUDA_ARCH__
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(shared_address(bar)), "r"(count) : "memory");
#else
    ::emu::mbarrier_init(bar, count);
#endif
}

// Order this thread's mbarrier_init before other threads' and TMA's use of the mbarriers at cluster
// scope, once after its last init and before the block barrier that publishes them. Within one
// block the barrier alone would do (PTX); the kernels keep the fence, as CUTLASS and
// FlashAttention-3 do, so that they stay correct in a cluster. Nothing to emulate.
__device__ __forceinline__ void fence_mbarrier_init() {
#ifdef __CUDA_ARCH__
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// One arrival (release: this thread's earlier writes are visible to threads its phase releases).
__device__ __forceinline__ void mbarrier_arrive(unsigned long long* bar) {
#ifdef __CUDA_ARCH__
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(shared_address(bar)) : "memory");
#else
    ::emu::mbarrier_arrive(bar, 0, true, "mbarrier.arrive");
#endif
}

// Announce `bytes` that asynchronous copies will complete in this phase, and arrive once.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned long long* bar, u32 bytes) {
#ifdef __CUDA_ARCH__
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(shared_address(bar)), "r"(bytes)
                 : "memory");
#else
    ::emu::mbarrier_arrive(bar, bytes, true, "mbarrier.arrive.expect_tx");
#endif
}

// Count `bytes` of this phase's transactions as done, as a TMA copy does when it lands.
__device__ __forceinline__ void mbarrier_complete_tx(unsigned long long* bar, u32 bytes) {
#ifdef __CUDA_ARCH__
    asm volatile("mbarrier.complete_tx.shared::cta.b64 [%0], %1;\n" :: "r"(shared_address(bar)), "r"(bytes) : "memory");
#else
    ::emu::mbarrier_complete_tx(bar, bytes, "mbarrier.complete_tx");
#endif
}

// Whether the phase of this parity completed, without waiting.
__device__ __forceinline__ bool mbarrier_test_wait(unsigned long long* bar, u32 parity) {
#ifdef __CUDA_ARCH__
    u32 done;
    asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(shared_address(bar)), "r"(parity) : "memory");
    return done != 0;
#else
    return ::emu::mbarrier_test_wait(bar, parity);
#endif
}

// Wait (acquire) until the phase of this parity completed: try_wait suspends the thread for a
// while in hardware, and the loop retries until it returns true.
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, u32 parity) {
#ifdef __CUDA_ARCH__
    asm volatile("{\n.reg .pred done;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n@!done bra WAIT;\n}\n"
                 :: "r"(shared_address(bar)), "r"(parity) : "memory");
#else
    ::emu::mbarrier_wait(bar, parity);
#endif
}

// ---- TMA: tensor copies between global and shared memory (sm_90) -----------------------------
// A tensor map (the driver's CUtensorMap, 128 opaque bytes) describes a global tensor of up to 5
// dimensions, a box (the tile one copy moves) and the swizzle of the box's lines in shared
// memory. It is encoded on the host (cupy_attn/_tensor_map.py) and must reach the kernel as a
// `const __grid_constant__ ptx::TensorMap` parameter, the address space TMA reads it from.
// Coordinates are element indices per dimension, innermost first; box elements outside the
// tensor load as zero and are not stored. A box's first element must be 16-byte aligned in global
// memory (the PTX ISA's bounding box), so the innermost coordinate times the element size is a
// multiple of 16 (the map's address and strides are; the emulator checks each copy).
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

// Copy the box at `coords` into shared memory at `smem` (128-byte aligned; 8 lines of the swizzle
// span aligned when swizzled) and complete its bytes on `bar`, whose phase must expect them
// (mbarrier_arrive_expect_tx). The data may be read only after waiting for that phase.
template <int kRank>
__device__ __forceinline__ void tma_load(void* smem, const TensorMap& map, const int (&coords)[kRank],
                                         unsigned long long* bar) {
    static_assert(kRank >= 1 && kRank <= 5, "tensor maps have 1 to 5 dimensions");
#ifdef __CUDA_ARCH__
    const u32 dst = shared_address(smem), barrier = shared_address(bar);
    const unsigned long long tensor = reinterpret_cast<unsigned long long>(&map);
#define TMA_LOAD(N, COORDS, ...) \
    asm volatile("cp.async.bulk.tensor." #N "d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, " \
                 COORDS "], [%2];\n" :: "r"(dst), "l"(tensor), "r"(barrier), __VA_ARGS__ : "memory")
    if constexpr (kRank == 1) TMA_LOAD(1, "{%3}", "r"(coords[0]));
    else if constexpr (kRank == 2) TMA_LOAD(2, "{%3, %4}", "r"(coords[0]), "r"(coords[1]));
    else if constexpr (kRank == 3) TMA_LOAD(3, "{%3, %4, %5}", "r"(coords[0]), "r"(coords[1]), "r"(coords[2]));
    else if constexpr (kRank == 4)
        TMA_LOAD(4, "{%3, %4, %5, %6}", "r"(coords[0]), "r"(coords[1]), "r"(coords[2]), "r"(coords[3]));
    else
        TMA_LOAD(5, "{%3, %4, %5, %6, %7}", "r"(coords[0]), "r"(coords[1]), "r"(coords[2]), "r"(coords[3]), "r"(coords[4]));
#undef TMA_LOAD
#else
    ::emu::tma_load(smem, &map, coords, bar);
#endif
}

// Write the box at `coords` from shared memory at `smem`, read through the async proxy (so
// generic writes of it need fence_proxy_async first): store it, or with kAdd add it element by
// element to what the tensor holds (cp.reduce.async.bulk.tensor .add: each element's add is
// atomic against other blocks' adds, in no fixed order). Part of the bulk group that bulk_commit
// closes; `smem` may be reused once bulk_wait_read covers the group.
template <bool kAdd, int kRank>
__device__ __forceinline__ void tma_write(const TensorMap& map, const int (&coords)[kRank], const void* smem) {
    static_assert(kRank >= 1 && kRank <= 5, "tensor maps have 1 to 5 dimensions");
#ifdef __CUDA_ARCH__
    const u32 src = shared_address(smem);
    const unsigned long long tensor = reinterpret_cast<unsigned long long>(&map);
// The instruction is OPCODE "<rank>d.global.shared::cta" MODE.
#define TMA_WRITE(OPCODE, MODE, N, COORDS, ...) \
    asm volatile(OPCODE #N "d.global.shared::cta" MODE " [%0, " COORDS "], [%1];\n" \
                 :: "l"(tensor), "r"(src), __VA_ARGS__ : "memory")
#define TMA_WRITE_RANKS(OPCODE, MODE)                                                                                 \
    if constexpr (kRank == 1) TMA_WRITE(OPCODE, MODE, 1, "{%2}", "r"(coords[0]));                                    \
    else if constexpr (kRank == 2) TMA_WRITE(OPCODE, MODE, 2, "{%2, %3}", "r"(coords[0]), "r"(coords[1]));           \
    else if constexpr (kRank == 3)                                                                                    \
        TMA_WRITE(OPCODE, MODE, 3, "{%2, %3, %4}", "r"(coords[0]), "r"(coords[1]), "r"(coords[2]));                   \
    else if constexpr (kRank == 4)                                                                                    \
        TMA_WRITE(OPCODE, MODE, 4, "{%2, %3, %4, %5}", "r"(coords[0]), "r"(coords[1]), "r"(coords[2]), "r"(coords[3])); \
    else                                                                                                              \
        TMA_WRITE(OPCODE, MODE, 5, "{%2, %3, %4, %5, %6}", "r"(coords[0]), "r"(coords[1]), "r"(coords[2]),             \
                  "r"(coords[3]), "r"(coords[4]))
    if constexpr (kAdd) TMA_WRITE_RANKS("cp.reduce.async.bulk.tensor.", ".add.tile.bulk_group");
    else TMA_WRITE_RANKS("cp.async.bulk.tensor.", ".tile.bulk_group");
#undef TMA_WRITE_RANKS
#undef TMA_WRITE
#else
    ::emu::tma_write(&map, coords, smem, kAdd);
#endif
}
template <int kRank>
__device__ __forceinline__ void tma_store(const TensorMap& map, const int (&coords)[kRank], const void* smem) {
    tma_write<false>(map, coords, smem);
}
template <int kRank>
__device__ __forceinline__ void tma_reduce_add(const TensorMap& map, const int (&coords)[kRank], const void* smem) {
    tma_write<true>(map, coords, smem);
}

// Close the bulk group of TMA stores issued since the last commit.
__device__ __forceinline__ void bulk_commit() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#else
    ::emu::bulk_commit();
#endif
}

// Wait until at most Pending of the most recent bulk groups may still read shared memory.
template <int Pending>
__device__ __forceinline__ void bulk_wait_read() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(Pending) : "memory");
#else
    ::emu::bulk_wait(Pending);
#endif
}

// Named barrier `id` (1..15; 0 is __syncthreads'), completed by `count` threads (a multiple of
// 32, whole warps): named_barrier_sync arrives and waits, named_barrier_arrive only arrives (a
// producer's signal to the threads that sync). Both are .aligned: every lane of a warp must reach
// the same one, which the emulator checks by the call's source line (a default argument, so the
// line of each call; on the GPU there is no such argument).
#ifdef __CUDA_ARCH__
#define ATTN_CALL_SITE
#else
#define ATTN_CALL_SITE , const char *call_file = __builtin_FILE(), int call_line = __builtin_LINE()
#endif
__device__ __forceinline__ void named_barrier_sync(u32 id, u32 count ATTN_CALL_SITE) {
#ifdef __CUDA_ARCH__
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(count) : "memory");
#else
    ::emu::named_barrier(id, count, true, call_file, call_line);
#endif
}

__device__ __forceinline__ void named_barrier_arrive(u32 id, u32 count ATTN_CALL_SITE) {
#ifdef __CUDA_ARCH__
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(count) : "memory");
#else
    ::emu::named_barrier(id, count, false, call_file, call_line);
#endif
}
#undef ATTN_CALL_SITE

// True in exactly one lane of `mask` (which must include the calling lane and be executed by all
// of its lanes), always the same for the same mask; which one is not specified.
__device__ __forceinline__ bool elect_one(u32 mask = 0xffffffffu) {
#ifdef __CUDA_ARCH__
    u32 elected;
    asm volatile("{\n.reg .pred p;\nelect.sync _|p, %1;\nselp.u32 %0, 1, 0, p;\n}\n" : "=r"(elected) : "r"(mask));
    return elected != 0;
#else
    return ::emu::elect(mask);
#endif
}

// setmaxnreg: this warpgroup's per-thread register count becomes kCount (24..256, a multiple of
// 8), raised (kIncrease) from or lowered to the pool the block shares; all four warps of the
// warpgroup execute the same one, and synchronise before the next. Producer warps lower theirs so
// that consumer warps can raise: a raise waits until the pool has the registers.
template <int kCount, bool kIncrease>
__device__ __forceinline__ void set_max_registers() {
    static_assert(kCount >= 24 && kCount <= 256 && kCount % 8 == 0, "setmaxnreg takes 24..256 registers, a multiple of 8");
#ifdef __CUDA_ARCH__
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (kIncrease) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(kCount));
    else asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(kCount));
#else
    static_assert(kCount == 0, "setmaxnreg needs the sm_90a target (-arch=sm_90a)");
#endif
#else
    ::emu::set_max_registers(kCount, kIncrease);
#endif
}

// The asm of each shape and form, the element type ("f16" or "bf16") spliced into the opcode.
#define WGMMA_ACCUMULATORS_32 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define WGMMA_ACCUMULATORS_64 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WGMMA_ACCUMULATORS_72 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35])
#define WGMMA_ACCUMULATORS_128 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WGMMA_ACCUMULATORS_176 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
#define WGMMA_SS_32(TYPE) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, " \
                 "%16, %17, p, 1, 1, %19, %20;\n}\n" \
                 : WGMMA_ACCUMULATORS_32 : "l"(a_desc), "l"(b_desc), "r"(scale_d), "n"(kTransA), "n"(kTransB))
#define WGMMA_SS_64(TYPE) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
                 "%32, %33, p, 1, 1, %35, %36;\n}\n" \
                 : WGMMA_ACCUMULATORS_64 : "l"(a_desc), "l"(b_desc), "r"(scale_d), "n"(kTransA), "n"(kTransB))
#define WGMMA_SS_72(TYPE) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n72k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35}, " \
                 "%36, %37, p, 1, 1, %39, %40;\n}\n" \
                 : WGMMA_ACCUMULATORS_72 : "l"(a_desc), "l"(b_desc), "r"(scale_d), "n"(kTransA), "n"(kTransB))
#define WGMMA_SS_128(TYPE) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
                 "%64, %65, p, 1, 1, %67, %68;\n}\n" \
                 : WGMMA_ACCUMULATORS_128 : "l"(a_desc), "l"(b_desc), "r"(scale_d), "n"(kTransA), "n"(kTransB))
#define WGMMA_SS_176(TYPE) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n176k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, " \
                 "%88, %89, p, 1, 1, %91, %92;\n}\n" \
                 : WGMMA_ACCUMULATORS_176 : "l"(a_desc), "l"(b_desc), "r"(scale_d), "n"(kTransA), "n"(kTransB))
#define WGMMA_RS_32(TYPE) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, " \
                 "{%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n" \
                 : WGMMA_ACCUMULATORS_32 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d), "n"(kTransB))
#define WGMMA_RS_64(TYPE) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
                 "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n" \
                 : WGMMA_ACCUMULATORS_64 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d), "n"(kTransB))

#define WGMMA_RS_72(TYPE) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %41, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n72k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35}, " \
                 "{%36, %37, %38, %39}, %40, p, 1, 1, %42;\n}\n" \
                 : WGMMA_ACCUMULATORS_72 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d), "n"(kTransB))
#define WGMMA_RS_128(TYPE) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
                 "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n" \
                 : WGMMA_ACCUMULATORS_128 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d), "n"(kTransB))
#define WGMMA_RS_176(TYPE) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %93, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n176k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, " \
                 "{%88, %89, %90, %91}, %92, p, 1, 1, %94;\n}\n" \
                 : WGMMA_ACCUMULATORS_176 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d), "n"(kTransB))

// How an operand lies in its core matrices: K-major, each 16-byte line one row (m of A, n of B)
// with 8 consecutive k (K of Q·Kᵀ as it lies in memory), or MN-major, each line one k with 8
// consecutive rows (V of P·V, dO and Q of the backward's Pᵀ·dO and dSᵀ·Q, dSᵀ and K of dQ = dS·K
// as they lie in memory): the instruction's imm-trans-a / imm-trans-b, which 16-bit types allow,
// so no shared-memory transpose is needed.
enum class Major { K = 0, MN = 1 };

// SS form: B (kMajorB) and A (kMajorA, last: K-major unless told) from shared memory; N (32, 64,
// 72, 128 or 176: FlashAttention-3's key tile at D = 64) columns, N / 2 accumulators per lane.
// scale_d = 0 overwrites d, 1 accumulates.
template <class T, int N, Major kMajorB, Major kMajorA = Major::K>
__device__ __forceinline__ void wgmma_m64k16_ss(float (&d)[N / 2], unsigned long long a_desc, unsigned long long b_desc,
                                                int scale_d) {
    static_assert(N == 32 || N == 64 || N == 72 || N == 128 || N == 176,
                  "wgmma shapes m64n32k16, m64n64k16, m64n72k16, m64n128k16 and m64n176k16");
    constexpr int kTransA = kMajorA == Major::MN, kTransB = kMajorB == Major::MN;
#ifdef __CUDA_ARCH__
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr bool kHalf = is_same<T, __half>::value;
    if constexpr (N == 32) {
        if constexpr (kHalf) WGMMA_SS_32("f16"); else WGMMA_SS_32("bf16");
    } else if constexpr (N == 64) {
        if constexpr (kHalf) WGMMA_SS_64("f16"); else WGMMA_SS_64("bf16");
    } else if constexpr (N == 72) {
        if constexpr (kHalf) WGMMA_SS_72("f16"); else WGMMA_SS_72("bf16");
    } else if constexpr (N == 128) {
        if constexpr (kHalf) WGMMA_SS_128("f16"); else WGMMA_SS_128("bf16");
    } else {
        if constexpr (kHalf) WGMMA_SS_176("f16"); else WGMMA_SS_176("bf16");
    }
#else
    static_assert(sizeof(T) == 0, "wgmma needs the sm_90a target (-arch=sm_90a)");
#endif
#else
    auto op = std::make_shared<emulated::WgmmaOperand>();
    *op = emulated::WgmmaOperand{{}, nullptr, a_desc, b_desc, false, kTransA != 0, kTransB != 0, scale_d,
                                 static_cast<int>(::emu::tl_fiber->linear / 32 % 4), d};
    emulated::take_issue_snapshot(*op, N / 2);
    ::emu::require_wgmma_fence("wgmma.mma_async (SS)");
    ::emu::require_registers_as_fenced(d, sizeof d, "accumulator", "wgmma.mma_async (SS)");
    ::emu::defer_warp_op(emulated::wgmma_fn<T, N>, op, "wgmma.mma_async (SS)");
#endif
}

// RS form: A from registers (the mma.m16n8k16 A fragment of this warp's 16 rows), B (kMajorB)
// from shared memory (N = 72: P·V at D = 64 with the rows' sums of P in 8 columns beside O's).
// The A registers, like the accumulators, must stay untouched until the wait (the emulator fails
// otherwise).
template <class T, int N, Major kMajorB>
__device__ __forceinline__ void wgmma_m64k16_rs(float (&d)[N / 2], const u32 (&a)[4], unsigned long long b_desc,
                                                int scale_d) {
    static_assert(N == 32 || N == 64 || N == 72 || N == 128 || N == 176,
                  "wgmma shapes m64n32k16, m64n64k16, m64n72k16, m64n128k16 and m64n176k16");
    constexpr int kTransB = kMajorB == Major::MN;
#ifdef __CUDA_ARCH__
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr bool kHalf = is_same<T, __half>::value;
    if constexpr (N == 32) {
        if constexpr (kHalf) WGMMA_RS_32("f16"); else WGMMA_RS_32("bf16");
    } else if constexpr (N == 64) {
        if constexpr (kHalf) WGMMA_RS_64("f16"); else WGMMA_RS_64("bf16");
    } else if constexpr (N == 72) {
        if constexpr (kHalf) WGMMA_RS_72("f16"); else WGMMA_RS_72("bf16");
    } else if constexpr (N == 128) {
        if constexpr (kHalf) WGMMA_RS_128("f16"); else WGMMA_RS_128("bf16");
    } else {
        if constexpr (kHalf) WGMMA_RS_176("f16"); else WGMMA_RS_176("bf16");
    }
#else
    static_assert(sizeof(T) == 0, "wgmma needs the sm_90a target (-arch=sm_90a)");
#endif
#else
    auto op = std::make_shared<emulated::WgmmaOperand>();
    *op = emulated::WgmmaOperand{{a[0], a[1], a[2], a[3]}, a, 0, b_desc, true, false, kTransB != 0, scale_d,
                                 static_cast<int>(::emu::tl_fiber->linear / 32 % 4), d};
    emulated::take_issue_snapshot(*op, N / 2);
    ::emu::require_wgmma_fence("wgmma.mma_async (RS)");
    ::emu::require_registers_as_fenced(d, sizeof d, "accumulator", "wgmma.mma_async (RS)");
    ::emu::require_registers_as_fenced(a, sizeof a, "A fragment", "wgmma.mma_async (RS)");
    ::emu::defer_warp_op(emulated::wgmma_fn<T, N>, op, "wgmma.mma_async (RS)");
#endif
}

#undef WGMMA_SS_32
#undef WGMMA_SS_64
#undef WGMMA_SS_72
#undef WGMMA_RS_32
#undef WGMMA_RS_64
#undef WGMMA_RS_72
#undef WGMMA_SS_128
#undef WGMMA_RS_128
#undef WGMMA_SS_176
#undef WGMMA_RS_176
#undef WGMMA_ACCUMULATORS_32
#undef WGMMA_ACCUMULATORS_64
#undef WGMMA_ACCUMULATORS_72
#undef WGMMA_ACCUMULATORS_128
#undef WGMMA_ACCUMULATORS_176

}  // namespace ptx
