// Memory-access counting for the emulator (cupy_attn.emulator.counting, python -m cupy_attn
// kernels --memory): plain loads and stores in the tile helpers and epilogues name themselves
// here, ldmatrix and cp.async in ptx.cuh. A warp-wide access is the lanes' calls at one source
// line, matched in order. Nothing on the GPU.
#pragma once

#ifdef __CUDA_ARCH__
#define ATTN_COUNT_SHARED(address, bytes)
#define ATTN_COUNT_GLOBAL(address, bytes)
#else
#define ATTN_COUNT_SHARED(address, bytes) ::emu::count_access(::emu::kShared, (address), (bytes), __FILE__, __LINE__)
#define ATTN_COUNT_GLOBAL(address, bytes) ::emu::count_access(::emu::kGlobal, (address), (bytes), __FILE__, __LINE__)
#endif
