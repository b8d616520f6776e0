// What the emulator must know of plain memory accesses. Counting (cupy_attn.emulator.counting,
// python -m cupy_attn kernels --memory): plain loads and stores in the tile helpers and epilogues
// name themselves here, ldmatrix and cp.async in ptx.cuh; a warp-wide access is the lanes' calls
// at one source line, matched in order. Stores to shared memory name themselves as stores: the
// emulator keeps each as its thread's until the thread's next fence.proxy.async, the only one
// that makes it visible to wgmma and TMA reads (emu::generic_store). Nothing on the GPU.
#pragma once

#ifdef __CUDA_ARCH__
#define ATTN_COUNT_SHARED(address, bytes)
#define ATTN_STORE_SHARED(address, bytes)
#define ATTN_COUNT_GLOBAL(address, bytes)
#else
#define ATTN_COUNT_SHARED(address, bytes) ::emu::count_access(::emu::kShared, (address), (bytes), __FILE__, __LINE__)
#define ATTN_STORE_SHARED(address, bytes) ::emu::generic_store((address), (bytes), __FILE__, __LINE__)
#define ATTN_COUNT_GLOBAL(address, bytes) ::emu::count_access(::emu::kGlobal, (address), (bytes), __FILE__, __LINE__)
#endif
