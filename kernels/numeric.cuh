// Conversions between the storage types and float, and the constants of base-2 softmax.
// NVRTC has no <math.h>: infinities and constants are spelled out here.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace attn {

constexpr float kLog2e = 1.4426950408889634f;  // exp(x) = exp2(x · log2 e)
constexpr float kLn2 = 0.6931471805599453f;    // ln(x) = log2(x) · ln 2

__device__ __forceinline__ float infinity() { return __int_as_float(0x7f800000); }
constexpr float kFloatMax = 3.4028234663852886e38f;  // the largest finite float

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

}  // namespace attn
