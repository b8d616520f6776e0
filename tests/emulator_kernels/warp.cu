// Shuffles and votes with partial masks and widths: each lane records what it got.
// mode: 0 idx, 1 up, 2 down, 3 xor. Lanes outside `mask` do not take part (they write -1).
extern "C" __global__ void shuffle(const int* values, int* out, unsigned mask, int mode, int arg, int width) {
    int lane = threadIdx.x % 32;
    int v = values[threadIdx.x];
    int r = -1;
    if (mask >> lane & 1u) {
        if (mode == 0) r = __shfl_sync(mask, v, arg, width);
        else if (mode == 1) r = __shfl_up_sync(mask, v, arg, width);
        else if (mode == 2) r = __shfl_down_sync(mask, v, arg, width);
        else r = __shfl_xor_sync(mask, v, arg, width);
    }
    out[threadIdx.x] = r;
}

extern "C" __global__ void shuffle_double(const double* values, double* out) {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, values[threadIdx.x], 5);
}

extern "C" __global__ void votes(const int* pred, unsigned* out, unsigned mask) {
    int lane = threadIdx.x % 32;
    unsigned* o = out + 3 * threadIdx.x;
    o[0] = o[1] = o[2] = 0xdeadbeefu;
    if (mask >> lane & 1u) {
        o[0] = __ballot_sync(mask, pred[threadIdx.x]);
        o[1] = __any_sync(mask, pred[threadIdx.x]);
        o[2] = __all_sync(mask, pred[threadIdx.x]);
        __syncwarp(mask);
    }
}

// Warp-level sum by xor butterfly, the pattern attention kernels use for row statistics.
extern "C" __global__ void warp_sum(const float* in, float* out) {
    float v = in[threadIdx.x + blockIdx.x * blockDim.x];
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    out[threadIdx.x + blockIdx.x * blockDim.x] = v;
}

extern "C" __global__ void atomics(float* fsum, int* isum, int* imax, unsigned long long* usum, int* cas_count) {
    __shared__ int block_count;
    if (threadIdx.x == 0) block_count = 0;
    __syncthreads();
    int id = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(fsum, 0.5f);
    atomicAdd(isum, id);
    atomicMax(imax, (id * 7919) % 1000);
    atomicAdd(usum, 1ull);
    atomicAdd(&block_count, 1);
    int old;
    do { old = *cas_count; } while (atomicCAS(cas_count, old, old + 1) != old);
    __syncthreads();
    if (threadIdx.x == 0 && block_count != (int)blockDim.x) __trap();
}
