// The emulator's Hopper synchronisation and proxies: mbarriers (arrivals, transaction counts,
// phases), TMA copies, named barriers, elect.sync, setmaxnreg and the async proxy's view of shared
// memory. kernels/ptx.cuh's emulated twins call these; each misuse the PTX ISA leaves undefined,
// and that the emulator can see, fails the block with a message naming it. Defined in
// emu_async.cpp, part of the emulator's runtime library (emu_runtime.h).
#pragma once
#include "emu_runtime.h"

namespace emu {

// ---- the async proxy's view of shared memory --------------------------------------------------
// wgmma and TMA read shared memory through the async proxy, which sees generic-proxy writes
// (plain stores, cp.async) only after a fence.proxy.async: until the first fence it reads poison.
// A plain store the kernel names (ATTN_STORE_SHARED, kernels/access_count.cuh) becomes visible
// there only at its own thread's next fence, once the block uses the async proxy; other generic
// writes at any thread's fence.
void fence_proxy_async();
void generic_store(const void* address, unsigned bytes, const char* file, int line);
// `bytes` of shared memory at `offset` as the async proxy reads them.
const unsigned char* async_shared_pointer(size_t offset, size_t bytes, const char* what);

// wgmma.fence: PTX requires one before a warpgroup's first wgmma.mma_async and between a thread's
// access to registers a wgmma reads or writes (its accumulators, A's fragment) and that wgmma. The
// emulator takes a thread's wgmma.wait_group as such an access (the thread reads the results
// next), so each batch of wgmma issued after a wait needs a fence of its own.
// A register written between the fence and the wgmma that reads or writes it is not ordered (PTX
// ISA, wgmma.fence): the emulator sees the register arrays the kernels pin (fence_operands) since
// the thread's last wgmma.wait_group, and fails a wgmma whose registers within such an array
// changed since the thread's latest fence.
void wgmma_fence();
inline void wgmma_waited() {
    tl_fiber->wgmma_fenced = false;
    tl_fiber->register_pins.clear();  // a fence must follow before the next wgmma, and pin anew
}
void require_wgmma_fence(const char* what);
void pin_registers(const void* at, unsigned bytes);
void require_registers_as_fenced(const void* at, unsigned bytes, const char* operand, const char* what);

// The calling warp's next warpgroup-wide instruction of `kind` (WarpgroupInstruction): the
// warpgroup's record of it, which is `mine` if this warp got there first. The caller compares.
enum WarpgroupKind { kSetMaxRegisters, kWgmma };
WarpgroupInstruction warpgroup_instruction(WarpgroupKind kind, const WarpgroupInstruction& mine);

// ---- mbarrier ---------------------------------------------------------------------------------
// init (arrival count in [1, 2^20), once per block and mbarrier), arrive with an optional
// expect-tx of `expect_tx_bytes`, complete-tx (what a TMA copy does when it lands; the
// transaction count stays within +-(2^20 - 1)), and the parity waits: test_wait answers without
// blocking, wait sleeps until the phase the parity means to this thread completed.
void mbarrier_init(void* bar, unsigned count);
// A barrier completed: an mbarrier that one of the threads that `arrived` could use, each thread
// that `waited` at the barrier can use now (by thread; null: every thread).
void publish_mbarriers(Block& b, const std::vector<bool>* arrived, const std::vector<bool>* waited);
void mbarrier_arrive(void* bar, unsigned expect_tx_bytes, bool arrive, const char* what);
void mbarrier_complete_tx(void* bar, unsigned bytes, const char* what);
bool mbarrier_test_wait(const void* bar, unsigned parity);
void mbarrier_wait(const void* bar, unsigned parity);

// ---- TMA (cp.async.bulk.tensor) ------------------------------------------------------------------
// A load copies a box of the tensor into shared memory (elements outside the tensor read as the
// map's fill) and completes its bytes on the mbarrier at `bar`; a store writes the box from shared
// memory, read through the async proxy, to the elements inside the tensor (with `add`, adds it to
// them, each element atomically: float32 only); bulk_wait(pending) waits for the reads of all but
// the `pending` most recent bulk groups.
void tma_load(void* smem, const void* map, const int* coords, void* bar);
void tma_write(const void* map, const int* coords, const void* smem, bool add);
inline void bulk_commit() { tl_fiber->bulk_groups_committed++; }
void bulk_wait(unsigned pending);

// With a swizzle span of 32, 64 or 128 bytes, each box row (the innermost dimension, exactly that
// span) goes to shared memory with its 16-byte chunks permuted: the chunk index XOR address bits
// 7.. (CUTLASS's Swizzle<1|2|3, 4, 3>), applied to the shared address, as wgmma's swizzled
// descriptors read it.
inline unsigned swizzled_offset(unsigned offset, unsigned swizzle_bytes) {
    if (!swizzle_bytes) return offset;
    const unsigned chunks = swizzle_bytes / 16 - 1;  // 1, 3 or 7: the chunk bits the row bits flip
    return offset ^ ((offset >> 3) & (chunks << 4));
}

// ---- named barriers, elect.sync, setmaxnreg ------------------------------------------------------
// bar.sync (wait) / bar.arrive id, count: ids 1..15, counts multiples of 32.
// `file` and `line`: where the call stands, which every lane of a warp must share (.aligned).
void named_barrier(unsigned id, unsigned count, bool wait, const char* file, int line);
// One leader of `mask`, the same for the same mask, picked by the launch's seed (not lane 0).
bool elect(unsigned mask);
// setmaxnreg.inc (increase) / .dec to `count` registers per thread, for the calling warpgroup.
void set_max_registers(unsigned count, bool increase);

// The deadlock report's part on threads waiting at mbarriers and named barriers.
std::string async_waits_report(const Block& b);
// At the block's end: what went wrong with its mbarriers' memory ("" if nothing): one that was
// overwritten, its memory used for something else while it was valid.
std::string mbarrier_exit_error(const Block& b);

}  // namespace emu
