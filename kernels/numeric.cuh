// Conversions between the storage types and float, and the constants of base-2 softmax.
// NVRTC has no <math.h>: infinities and constants are spelled out here.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "ptx.cuh"

namespace attn {

constexpr float kLog2e = 1.4426950408889634f;  // exp(x) = exp2(x · log2 e)
constexpr float kLn2 = 0.6931471805599453f;    // ln(x) = log2(x) · ln 2

__device__ __forceinline__ float infinity() { return __int_as_float(0x7f800000); }
constexpr float kFloatMax = 3.4028234663852886e38f;  // the largest finite float

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// 2^x for x < 128 on the FMA pipe, without the MUFU unit, whose 16 results per clock per SM
// bound the softmax where the tensor cores need fewer cycles per score than it (the wgmma
// forward's plain builds at D = 64 and softcap builds, the mma.sync forward's softcap builds up
// to D = 64: OnlineSoftmax::update's polynomial_every). FlashAttention-4's technique, in 9 instructions: x = n + f with
// n = floor(x) and f in [0, 1); 2^f by a cubic (Horner, 3 FFMA) and 2^n built in the exponent
// field, then one multiply. Coefficients: the minimax fit of 2^f on [0, 1] for relative error
// with p(0) = 1 exactly (linear programming on 20001 points, rounded to float): within 8.6e-5 of
// 2^x relatively, a fifth of fp16's half ulp (P·V sees P rounded to 16 bits), and exact at
// integers. ex2.approx.ftz's special cases hold: x < -126 (-inf included) gives exactly +0 (2^n
// is 0 there), so a masked score adds nothing to a row's sum and a row that attended nothing
// keeps its sum of 0; NaN stays NaN (the clamp propagates it, and NaN · 2^n).
__device__ __forceinline__ float exp2_polynomial(float x) {
    // Below -127 every result is 0; the clamp keeps n within the exponent field's range.
    x = ptx::max_nan(x, -127.f);
    // x + 1.5·2^23 rounded down lies in [2^23, 2^24), where floats are the integers: its low
    // mantissa bits hold floor(x) in two's complement (from 2^22 + n), and subtracting the
    // constant again gives floor(x) exactly (two adds on the FMA pipe, not a conversion).
    constexpr float kRoundShift = 12582912.f;  // 1.5 · 2^23
    const float shifted = __fadd_rd(x, kRoundShift);
    const float f = x - (shifted - kRoundShift);  // exact, in [0, 1)
    const float mantissa = fmaf(fmaf(fmaf(0.077068030834198f, f, 0.22764353454113007f), f, 0.6951172947883606f), f, 1.f);
    // n in the exponent field: the shifted float's bits times 2^23 keep n's low 9 bits there
    // (2^22 + 2^23's bits shift out); with the bias 127 that is 2^n, or +0 for n = -127.
    const float power = __uint_as_float(__float_as_uint(shifted) * (1u << 23) + 0x3f800000u);
    return mantissa * power;
}

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

}  // namespace attn
