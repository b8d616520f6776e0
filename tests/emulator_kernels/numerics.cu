#include <cuda_fp16.h>
#include <cuda_bf16.h>
// Conversions, both directions, and the math functions attention uses.
extern "C" __global__ void to_half(const float* in, unsigned short* h, unsigned short* b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        h[i] = __half_as_ushort(__float2half_rn(in[i]));
        b[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
    }
}

extern "C" __global__ void from_half(const __half* h, const __nv_bfloat16* b, float* hf, float* bf, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        hf[i] = __half2float(h[i]);
        bf[i] = __bfloat162float(b[i]);
    }
}

extern "C" __global__ void half_arith(const __half* a, const __half* b, __half* sum, __half* prod, __half2* pair, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        sum[i] = __hadd(a[i], b[i]);
        prod[i] = a[i] * b[i];
        pair[i] = __hmul2(__halves2half2(a[i], b[i]), __floats2half2_rn(2.0f, 0.5f));
    }
}

extern "C" __global__ void math(const float* x, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        float* o = out + 8 * i;
        o[0] = exp2f(v); o[1] = __expf(v); o[2] = logf(fabsf(v) + 1.0f); o[3] = fmaxf(v, 0.25f);
        o[4] = rsqrtf(fabsf(v) + 1.0f); o[5] = tanhf(v); o[6] = max(v, -v); o[7] = v > 0 ? INFINITY : -INFINITY;
    }
}
