// The order of a warp's lanes' accesses to shared memory. Since Volta a warp's threads are
// scheduled independently: one lane's load and another lane's store of the same byte are ordered
// only by a __syncwarp (or a barrier) between them, not by the program order of a converged warp,
// nor by warp-collective instructions such as ldmatrix or a shuffle. compute-sanitizer's racecheck
// reports such pairs, and on an H200 it found one (the mma.sync forward staged O over its Q rows
// right after its last ldmatrix of them). The emulator cannot reorder the lanes of a collective,
// so it checks instead: every access the kernels name (ldmatrix, ATTN_LOAD_SHARED and
// ATTN_STORE_SHARED, kernels/access_count.cuh) is recorded per byte with its lane and its warp's
// synchronisation count, and a store to a byte that another lane of the warp loaded or stored,
// or a load of one that another lane stored, since the warp's last synchronisation fails the
// block. What renews a warp's count: a __syncwarp of all its lanes, __syncthreads, a named
// barrier (bar.sync) all its lanes waited at, and any of its lanes' mbarrier waits: a wait orders
// the accesses before the phase's arrivals before those after it, which may be another lane's
// of the same warp; that the wait orders the whole warp is generous (lanes that only wait are not
// ordered among themselves), so the check misses such pairs rather than report a right kernel.
// A partial __syncwarp or named barrier renews nothing. Not checked either: accesses of different
// warps (the barriers and mbarriers order those, and the emulator checks them through their
// results), copies (cp.async, TMA: ordered by their waits), and a warp's pending loads once
// another warp loads the byte (one warp's readers are kept per byte).
#pragma once

namespace emu {

struct Block;

// A new synchronisation count for every warp (a block's start, __syncthreads) or for one.
void lanes_synced(Block& b);
void lane_synced(Block& b, unsigned warp);

// The calling lane stores `bytes` of shared memory at `address` (dynamic shared memory; anything
// else is not recorded): generic_store (emu_async.h) checks its named stores here.
void lane_store(const void* address, unsigned bytes, const char* file, int line);

// A load of shared memory the kernels name (ldmatrix, ATTN_LOAD_SHARED): counted (count_access)
// and checked against the warp's other lanes, as generic_store does for stores.
void generic_load(const void* address, unsigned bytes, const char* file, int line);

}  // namespace emu
