// Built-in variables, shared memory and barriers.
extern "C" __global__ void indices(int* out) {
    int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    int* o = out + 6 * (t + blockDim.x * blockDim.y * blockDim.z * b);
    o[0] = threadIdx.x; o[1] = threadIdx.y; o[2] = threadIdx.z;
    o[3] = blockIdx.x; o[4] = blockIdx.y; o[5] = blockIdx.z;
}

// Reverse each block's slice through static shared memory.
extern "C" __global__ void reverse_static(const float* in, float* out) {
    __shared__ float tile[256];
    int t = threadIdx.x, base = blockIdx.x * blockDim.x;
    tile[t] = in[base + t];
#ifndef MISSING_BARRIER
    __syncthreads();
#endif
    out[base + t] = tile[blockDim.x - 1 - t];
}

// The same through dynamic shared memory.
extern "C" __global__ void reverse_dynamic(const float* in, float* out) {
    extern __shared__ __align__(16) float smem[];
    int t = threadIdx.x, base = blockIdx.x * blockDim.x;
    smem[t] = in[base + t];
    __syncthreads();
    out[base + t] = smem[blockDim.x - 1 - t];
}

// Read dynamic shared memory that nobody wrote: must come back poisoned (NaN).
extern "C" __global__ void read_unwritten(float* out) {
    extern __shared__ float smem[];
    out[threadIdx.x] = smem[threadIdx.x];
}

// Half the threads exit before the barrier; the rest must still pass it (sm_70+ semantics).
extern "C" __global__ void early_exit(int* out) {
    __shared__ int flag;
    if (threadIdx.x == 0) flag = 7;
    if (threadIdx.x % 2) return;
    __syncthreads();
    out[threadIdx.x] = flag;
}

extern "C" __global__ void barrier_votes(const int* pred, int* out) {
    int p = pred[threadIdx.x];
    int count = __syncthreads_count(p);
    int all = __syncthreads_and(p);
    int any = __syncthreads_or(p);
    if (threadIdx.x == 0) { out[0] = count; out[1] = all; out[2] = any; }
}

// Deadlocks: lane 0 leaves before a full-warp shuffle; or one warp waits at a barrier while
// another waits in a collective for a lane that is at the barrier.
extern "C" __global__ void deadlock_exit(float* out) {
    if (threadIdx.x == 0) return;
    out[threadIdx.x] = __shfl_sync(0xffffffffu, 1.0f, 0);
}

extern "C" __global__ void deadlock_barrier(float* out) {
    if (threadIdx.x == 3) __syncthreads();
    else out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

extern "C" __global__ void diverged(float* out) {
    if (threadIdx.x < 16) out[threadIdx.x] = __shfl_sync(0xffffffffu, 1.0f, 0);
    else out[threadIdx.x] = __ballot_sync(0xffffffffu, 1);
}

extern "C" __global__ void bad_mask(float* out) {
    out[threadIdx.x] = __shfl_sync(0x1u, 1.0f, 0);
}

extern "C" __global__ void trap_kernel(float* out) {
    if (blockIdx.x == 2 && threadIdx.x == 5) __trap();
    out[0] = 1.0f;
}

// Argument types for the size checks.
extern "C" __global__ void typed(double* d, const float* f, int n, float s, long long big, unsigned char flag) {
    if (threadIdx.x == 0) d[0] = f[0] * s + n + big + flag;
}

extern "C" __global__ void oob_write(float* out, int n) {
    out[n + threadIdx.x] = 1.0f;  // planted bug: writes past the end
}

template <int Scale>
__global__ void scaled(float* out) { out[threadIdx.x] = Scale * threadIdx.x; }
