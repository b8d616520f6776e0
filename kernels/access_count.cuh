// What the emulator must know of plain memory accesses. Counting (cupy_attn.emulator.counting,
// python -m cupy_attn kernels --memory): plain loads and stores in the tile helpers and epilogues
// name themselves here, ldmatrix and cp.async in ptx.cuh; a warp-wide access is the lanes' calls
// at one source line, matched in order. Loads and stores of shared memory are also checked for
// the order of a warp's lanes: one lane's store and another's load or store of the same byte need
// a __syncwarp or barrier between them (emu_lanes.h). Stores to shared memory stay the storing
// thread's until its next fence.proxy.async, the only one that makes them visible to wgmma and TMA
// reads (emu::generic_store). Nothing on the GPU.
#pragma once

#ifdef __CUDA_ARCH__
#define ATTN_LOAD_SHARED(address, bytes)
#define ATTN_STORE_SHARED(address, bytes)
#define ATTN_COUNT_GLOBAL(address, bytes)
#else
#define ATTN_LOAD_SHARED(address, bytes) ::emu::generic_load((address), (bytes), __FILE__, __LINE__)
#define ATTN_STORE_SHARED(address, bytes) ::emu::generic_store((address), (bytes), __FILE__, __LINE__)
#define ATTN_COUNT_GLOBAL(address, bytes) ::emu::count_access(::emu::kGlobal, (address), (bytes), __FILE__, __LINE__)
#endif
