// The order of a warp's lanes' accesses to shared memory. Since Volta a warp's threads are
// scheduled independently: one lane's load and another lane's store of the same byte are ordered
// only by a __syncwarp (or a barrier) between them, not by the program order of a converged warp,
// nor by warp-collective instructions such as ldmatrix or a shuffle. compute-sanitizer's racecheck
// reports such pairs, and on an H200 it found one (the mma.sync forward staged O over its Q rows
// right after its last ldmatrix of them). The emulator cannot reorder the lanes of a collective,
// so it checks instead: every access the kernels name (ldmatrix, ATTN_LOAD_SHARED and
// ATTN_STORE_SHARED, kernels/access_count.cuh) is recorded per byte with its lane and its warp's
// synchronisation count, and a store to a byte that another lane of the warp loaded or stored,
// or a load of one that another lane stored, since the warp's last __syncwarp, __syncthreads,
// named barrier or mbarrier wait fails the block. Accesses of different warps are ordered by the
// barriers and mbarriers that the emulator already checks through their results, and copies
// (cp.async, TMA) by their waits: neither is recorded here.
#pragma once

namespace emu {

struct Block;

// A new synchronisation count for every warp (a block's start, __syncthreads) or for one.
void lanes_synced(Block& b);
void lane_synced(Block& b, unsigned warp);

// The calling lane loads or stores `bytes` of shared memory at `address` (dynamic shared memory;
// anything else is not recorded).
void lane_load(const void* address, unsigned bytes, const char* file, int line);
void lane_store(const void* address, unsigned bytes, const char* file, int line);

}  // namespace emu
