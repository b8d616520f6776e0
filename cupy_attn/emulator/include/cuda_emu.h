// Force-included (g++ -include cuda_emu.h) before every kernel source the emulator compiles:
// CUDA's keywords, built-in variables and device functions, on top of the fiber runtime.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>

#include "emu_async.h"
#include "emu_entry.h"
#include "emu_runtime.h"

#define __CUDA_EMULATOR__ 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __grid_constant__
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// One copy per block: one OS thread runs one block at a time. (`extern __shared__` arrays are
// rewritten by the Python side into pointers to the block's dynamic shared memory.)
#define __shared__ static thread_local
#define __constant__ static

#define threadIdx (::emu::tl_fiber->tid)
#define blockIdx (::emu::tl_block->idx)
#define blockDim (::emu::tl_block->launch->block)
#define gridDim (::emu::tl_block->launch->grid)
constexpr int warpSize = 32;

inline void __syncthreads() { ::emu::block_barrier(0); }
inline int __syncthreads_count(int p) { return ::emu::block_barrier(p); }
inline int __syncthreads_and(int p) { return ::emu::block_barrier(p) == static_cast<int>(::emu::tl_block->live); }
inline int __syncthreads_or(int p) { return ::emu::block_barrier(p) != 0; }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::emu::warp_collective(mask, nullptr, ::emu::syncwarp_fn, "__syncwarp"); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
[[noreturn]] inline void __trap() { ::emu::fail("__trap() called"); }
inline unsigned __lanemask_lt() { return (1u << ::emu::lane_id()) - 1u; }
inline unsigned __umulhi(unsigned a, unsigned b) { return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32); }
template <class T> inline T __ldg(const T* p) { return *p; }

template <class T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
    ::emu::check_width(width, "__shfl_sync");
    int lane = static_cast<int>(::emu::lane_id());
    return ::emu::shuffle(mask, var, (lane & ~(width - 1)) + (src_lane & (width - 1)), "__shfl_sync");
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
    ::emu::check_width(width, "__shfl_up_sync");
    int lane = static_cast<int>(::emu::lane_id());
    int in_segment = (lane & (width - 1)) - static_cast<int>(delta);
    return ::emu::shuffle(mask, var, in_segment < 0 ? -1 : lane - static_cast<int>(delta), "__shfl_up_sync");
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
    ::emu::check_width(width, "__shfl_down_sync");
    int lane = static_cast<int>(::emu::lane_id());
    int in_segment = (lane & (width - 1)) + static_cast<int>(delta);
    return ::emu::shuffle(mask, var, in_segment >= width ? -1 : lane + static_cast<int>(delta), "__shfl_down_sync");
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
    ::emu::check_width(width, "__shfl_xor_sync");
    int lane = static_cast<int>(::emu::lane_id());
    int src = lane ^ lane_mask;
    // Lanes may read earlier segments but not later ones (they keep their own value).
    bool later = src >= ((lane / width) + 1) * width || src > 31;
    return ::emu::shuffle(mask, var, later ? -1 : src, "__shfl_xor_sync");
}
inline unsigned __ballot_sync(unsigned mask, int predicate) { return ::emu::vote(mask, predicate, "__ballot_sync"); }
inline int __any_sync(unsigned mask, int predicate) { return ::emu::vote(mask, predicate, "__any_sync") != 0; }
inline int __all_sync(unsigned mask, int predicate) { return ::emu::vote(mask, predicate, "__all_sync") == mask; }

// Atomics: on global memory (blocks run on several OS threads) and shared memory alike.
#define EMU_INT_ATOMICS(T)                                                                          \
    inline T atomicAdd(T* a, T v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }            \
    inline T atomicSub(T* a, T v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }            \
    inline T atomicAnd(T* a, T v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }            \
    inline T atomicOr(T* a, T v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }              \
    inline T atomicXor(T* a, T v) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); }            \
    inline T atomicExch(T* a, T v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }          \
    inline T atomicMax(T* a, T v) { return ::emu::atomic_update<T>(a, [](T x, T y) { return x > y ? x : y; }, v); } \
    inline T atomicMin(T* a, T v) { return ::emu::atomic_update<T>(a, [](T x, T y) { return x < y ? x : y; }, v); } \
    inline T atomicCAS(T* a, T compare, T v) {                                                      \
        __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);     \
        return compare;                                                                             \
    }
EMU_INT_ATOMICS(int)
EMU_INT_ATOMICS(unsigned int)
EMU_INT_ATOMICS(unsigned long long)
inline float atomicAdd(float* a, float v) { return ::emu::atomic_float_update<float>(a, [](float x, float y) { return x + y; }, v); }
inline double atomicAdd(double* a, double v) { return ::emu::atomic_float_update<double>(a, [](double x, double y) { return x + y; }, v); }
inline float atomicExch(float* a, float v) { return ::emu::atomic_float_update<float>(a, [](float, float y) { return y; }, v); }
inline unsigned int atomicInc(unsigned int* a, unsigned int limit) {
    return ::emu::atomic_update<unsigned int>(a, [](unsigned x, unsigned lim) { return x >= lim ? 0u : x + 1u; }, limit);
}
