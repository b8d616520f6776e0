#include "access_count.cuh"
#include "ptx.cuh"
// The order of a warp's lanes' shared-memory accesses (the emulator's emu_lanes.h): a lane may
// store to a byte another lane of its warp loaded or stored, or load one another lane stored,
// only after a __syncwarp (or a barrier) between them. Each kernel does it right, and wrong with
// -DNO_SYNC (the __syncwarp left out).
//
// rows_then_restage: the mma.sync forward's epilogue in miniature: the warp reads 8 rows of 8
// halves with ldmatrix (lane i passes row i), then lane i overwrites row (i + 1) % 8, which lane
// i + 1 read. out gets the fragments.
extern "C" __global__ void rows_then_restage(const unsigned short* rows, unsigned* out) {
    extern __shared__ __align__(16) unsigned short smem[];
    const int lane = threadIdx.x % 32;
    if (lane < 8)
        for (int c = 0; c < 8; ++c) {
            ATTN_STORE_SHARED(&smem[8 * lane + c], 2);
            smem[8 * lane + c] = rows[8 * lane + c];
        }
    __syncwarp();
    unsigned r[1];
    ptx::ldmatrix<1>(r, &smem[8 * (lane % 8)]);
#ifndef NO_SYNC
    __syncwarp();
#endif
    if (lane < 8) {
        ATTN_STORE_SHARED(&smem[8 * ((lane + 1) % 8)], 2);
        smem[8 * ((lane + 1) % 8)] = 0;
    }
    out[threadIdx.x] = r[0];
}

// store_then_load: lane 0 stores a value, lane 1 loads it.
extern "C" __global__ void store_then_load(int value, int* out) {
    extern __shared__ __align__(16) int words[];
    const int lane = threadIdx.x % 32;
    if (lane == 0) {
        ATTN_STORE_SHARED(&words[0], 4);
        words[0] = value;
    }
#ifndef NO_SYNC
    __syncwarp();
#endif
    int got = -1;
    if (lane == 1) {
        ATTN_LOAD_SHARED(&words[0], 4);
        got = words[0];
    }
    out[threadIdx.x] = got;
}

// across_warps: warp 0's lanes store, warp 1's load the same words after __syncthreads (never
// left out: the lanes of different warps are the barriers' concern, not the lane check's).
extern "C" __global__ void across_warps(int* out) {
    extern __shared__ __align__(16) int words[];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (warp == 0) {
        ATTN_STORE_SHARED(&words[lane], 4);
        words[lane] = 100 + lane;
    }
    __syncthreads();
    if (warp == 1) {
        ATTN_LOAD_SHARED(&words[31 - lane], 4);
        out[lane] = words[31 - lane];
    }
}
