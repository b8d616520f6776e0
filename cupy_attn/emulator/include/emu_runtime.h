// The emulator's execution engine as kernels see it: its state (blocks, fibers, barriers, warp
// collectives) and the device-side functions, declared here and defined once in emu_runtime.cpp,
// which the emulator compiles into the shared library every kernel module links; templates and
// one-line accessors stay inline.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "emu_counters.h"
#include "emu_fiber.h"
#include "emu_lanes.h"
#include "emu_types.h"

namespace emu {

// AtMbarrier and AtNamedBarrier: waiting for an mbarrier's phase or a named barrier; AtRegisters:
// in setmaxnreg.inc, until the block's register pool has what the warp asks for (emu_async.h).
enum class State : unsigned char { Ready, AtBarrier, AtWarp, AtMbarrier, AtNamedBarrier, AtRegisters, Done };
// Between synchronisation points threads run in thread order, in reverse, in a random order per
// round, or warp by warp (each warp runs alone until it waits at a block barrier or exits,
// lowest or highest warp first): the warp schedules let one warp race far ahead of the others,
// as it can on hardware, which round-robin schedules keep in lockstep.
enum Schedule { kForward = 0, kReverse = 1, kRandom = 2, kWarps = 3, kWarpsReverse = 4 };

// A cp.async copy that does not land at issue (copy_lands_at_issue) waits here until its group is
// waited for, so code that reads shared memory before `cp.async.wait_group` sees the poison, as it
// could on hardware.
struct AsyncCopy {
    void* dst;
    const void* src;
    unsigned bytes;
    unsigned group;
};

// The lane's share of a warp-collective operation whose effect is deferred until a later wait
// (wgmma.mma_async until wgmma.wait_group): `operand` is what the collective `fn` receives for
// this lane when the warp waits for the operation's group.
using CollectiveFn = void (*)(void* const* lanes, unsigned mask);
struct DeferredWarpOp {
    CollectiveFn fn;
    std::shared_ptr<void> operand;
    unsigned group;
    const char* what;
};

// A TMA tensor map as the emulator encodes it (cupy_attn/_tensor_map.py writes the same 128
// bytes; on the GPU they are the driver's opaque CUtensorMap): a tiled map over a global array
// of `rank` dimensions, innermost first, with byte strides for dimensions 1.., a box of
// box[0..rank) elements, a swizzle span in bytes (0: none) and the bits that elements outside
// the tensor load as (0, or the element type's NaN).
struct EmulatedTensorMap {
    unsigned long long address;
    unsigned rank, element_bytes, swizzle, oob_fill;
    unsigned long long dims[5];
    unsigned box[5];
    unsigned long long strides[4];  // at byte 88: 4 bytes of padding after box
    unsigned long long magic;
};
static_assert(sizeof(EmulatedTensorMap) == 128 && offsetof(EmulatedTensorMap, strides) == 88 &&
                  offsetof(EmulatedTensorMap, magic) == 120, "the layout cupy_attn/_tensor_map.py writes");
constexpr unsigned long long kTensorMapMagic = 0x50414d524f534e45ull;  // "ENSORMAP" read backwards

// One TMA copy between a box of a tensor and shared memory (load: into shared memory, signalling
// the mbarrier at `bar`; store: from shared memory).
struct TmaCopy {
    EmulatedTensorMap map;
    int coords[5];
    unsigned smem, bar, group;
    bool done;  // a store already performed (it stays listed until its bulk group is waited for)
    bool add;   // a store that adds to global memory (cp.reduce.async.bulk.tensor .add)
};

// A register array a wgmma reads or writes (accumulators, A's fragment) as the thread pinned it
// (fence_operands, kernels/ptx.cuh), with what it held at the thread's latest wgmma.fence (empty
// until a fence comes after the pin).
struct RegisterPin {
    const unsigned char* at;
    unsigned bytes;
    std::vector<unsigned char> at_fence;
};

struct Fiber {
    Context ctx;
    uint3 tid;
    unsigned linear = 0;
    State state = State::Ready;
    int barrier_vote = 0;
    std::vector<AsyncCopy> async_copies;
    unsigned async_groups_committed = 0;
    std::vector<DeferredWarpOp> deferred_ops;
    unsigned deferred_groups_committed = 0;
    AccessLog log;  // counted memory accesses, when the launch counts them
    // What an AtMbarrier or AtNamedBarrier thread waits for: the mbarrier's shared offset and the
    // phase number, or the named barrier's id.
    unsigned waits_on = 0;
    long long waits_for_phase = 0;
    // Per mbarrier (shared offset): the last phase this thread saw completed by a wait (-1: the
    // phase before the first, which counts as completed), to tell which phase a parity means.
    std::map<unsigned, long long> phase_seen;
    std::vector<TmaCopy> bulk_stores;  // TMA stores not yet waited for, by bulk group
    unsigned bulk_groups_committed = 0;
    bool wgmma_fenced = false;  // a wgmma.fence since the thread's start or its last wgmma.wait_group
    std::vector<RegisterPin> register_pins;
    // (shared offset, bytes) of this thread's named plain stores since its last fence.proxy.async
    // (emu_async.h, generic_store), kept once the block uses the async proxy.
    std::vector<std::pair<unsigned, unsigned>> unfenced_stores;
};

// An mbarrier object's state (PTX ISA, "mbarrier"): the arrivals each phase expects, those still
// pending in the current phase, the transaction count (bytes announced by expect-tx and not yet
// completed) and the number of the phase in progress (0 after init; its parity is the phase bit).
struct Mbarrier {
    unsigned expected = 0, pending = 0;
    long long tx = 0;
    long long phase = 0;
    // The threads that may use it: the initialising one, and those a barrier has since ordered
    // after one of them (a __syncthreads, __syncwarp, or a named barrier they waited at).
    unsigned init_thread = 0;
    std::vector<bool> visible_to;
};

// A warpgroup-wide instruction (setmaxnreg, wgmma.mma_async) as one warp executed it: its kind's
// operands, which every warp of the warpgroup must pass alike. The i-th instruction of a kind
// that a warp executes is its warpgroup's i-th of that kind: the first warp to get there records
// it, and the others compare with the record, which goes once all four passed it.
struct WarpgroupInstruction {
    unsigned long long fields[3];
    bool operator==(const WarpgroupInstruction& o) const { return !std::memcmp(fields, o.fields, sizeof fields); }
};
struct WarpgroupSequence {
    std::deque<WarpgroupInstruction> recorded;  // executed by some of the warpgroup's warps, not yet all
    unsigned long long first = 0;               // the index of recorded.front() in the sequence
    unsigned long long executed[4] = {};        // how many each warp of the warpgroup executed
};

// A named barrier (bar.sync / bar.arrive with an id and a thread count): the count of the
// current generation and which threads arrived in it.
struct NamedBarrier {
    unsigned count = 0, arrived = 0;
    std::vector<bool> arrivals;
    // Per warp, where its first lane arrived in this generation (bar.sync or bar.arrive, file,
    // line; no file yet: none arrived): its other lanes must arrive there too.
    struct Site {
        bool wait;
        const char* file;
        int line;
    };
    std::vector<Site> warp_sites;
};

// The last lane of `mask` to arrive computes the collective for all: `fn` gets every lane's
// operand pointer (null for lanes outside the mask) and writes each lane's result through it.
struct Collective {
    unsigned mask;
    unsigned arrived;
    const char* what;
    CollectiveFn fn;
    void* lanes[32];
};

struct Launch {
    void (*invoke)(void**);
    void** args;
    dim3 grid, block;
    size_t shared_bytes;
    int schedule;
    unsigned long long seed;
    size_t stack_bytes;
    unsigned long long blocks;
    bool counting = false;
    // The launch's array arguments (base, bytes), sorted: global addresses are counted as offsets
    // into them, as if each array began on a cudaMalloc boundary (256 bytes) like on the GPU.
    std::vector<std::pair<uintptr_t, size_t>> arrays;
    std::mutex counter_mutex;
    CounterTable counters;
    std::atomic<unsigned long long> next_block{0};
    std::atomic<bool> failed{false};
    std::mutex error_mutex;
    std::string error;
};

struct Block {
    Launch* launch;
    uint3 idx;
    std::vector<Fiber> fibers;
    std::vector<std::vector<Collective>> warps;  // pending collectives per warp
    unsigned char* dynamic_shared = nullptr;
    // What the async proxy (wgmma and TMA reads of shared memory) sees: dynamic shared memory as of
    // the last fence.proxy.async, poison until the first (emu_async.h). Allocated on first use.
    std::vector<unsigned char> async_shared;
    // Per byte of dynamic shared memory: the thread whose named store (emu_async.h, generic_store)
    // wrote it last and has not fenced since, or -1. Allocated with async_shared.
    std::vector<int> unfenced_owner;
    std::map<unsigned, Mbarrier> mbarriers;  // by shared offset
    NamedBarrier named[16];
    std::vector<TmaCopy> tma_loads;  // TMA loads issued and not yet landed
    unsigned long long async_copies_issued = 0;  // cp.async and TMA loads and stores (copy_lands_at_issue)
    // setmaxnreg: each warp's registers per thread (0 until its first setmaxnreg: what ptxas
    // allocated, at most the launch's), and the count a warp waiting in setmaxnreg.inc asks for
    // (0: none waits). Empty until one runs.
    std::vector<unsigned> warp_registers, warp_register_requests;
    std::map<std::pair<int, unsigned>, WarpgroupSequence> warpgroup_sequences;  // by (kind, warpgroup)
    // Per warp: its synchronisation count, new at each __syncwarp, barrier or mbarrier wait that
    // orders its lanes (emu_lanes.h).
    std::vector<unsigned long long> warp_syncs;
    Context scheduler;
    unsigned live = 0;
    int barrier_result = 0;
    bool aborted = false;
    std::string error;
};

// The block and the thread (fiber) running now on this OS thread.
extern thread_local Block* tl_block;
extern thread_local Fiber* tl_fiber;

std::string format(const char* fmt, ...);
// Abort the current block with a message: back to the scheduler, never to resume.
[[noreturn]] void fail(const std::string& message);
inline void yield_to_scheduler() { switch_context(tl_fiber->ctx, tl_block->scheduler); }
inline unsigned lane_id() { return tl_fiber->linear & 31u; }
inline unsigned char* dynamic_shared() { return tl_block->dynamic_shared; }

// ---- device-side API -------------------------------------------------------------------------

// __syncthreads: returns how many threads voted non-zero.
int block_barrier(int vote);
// The last lane of `mask` to arrive runs `fn` for all (struct Collective); a lane outside the
// mask, or lanes of one mask in different collectives, fail the block.
void warp_collective(unsigned mask, void* operand, CollectiveFn fn, const char* what);
void syncwarp_fn(void* const*, unsigned mask);  // __syncwarp's collective
unsigned vote(unsigned mask, int predicate, const char* what);  // the ballot of `mask`'s lanes
void check_width(int width, const char* what);  // a shuffle's width: a power of two in [1, 32]

// Record one lane's access for the launch's counters (emu_counters.h), if it counts: `bytes` at
// `address` in shared (kShared) or global memory (kGlobal).
void count_access(int space, const void* address, unsigned bytes, const char* file, int line);

// The offset of a pointer into the block's dynamic shared memory, standing in for its
// shared-window address (__cvta_generic_to_shared), and back; anything outside fails the block.
unsigned shared_offset(const void* p, const char* what);
unsigned char* shared_pointer(size_t offset, size_t bytes, const char* what);

// Deferred warp operations (wgmma.mma_async): defer_warp_op records this lane's share in the open
// group, deferred_commit closes the group, and deferred_wait(pending) runs (as warp collectives,
// in issue order) every operation of all but the `pending` most recent committed groups.
void defer_warp_op(CollectiveFn fn, std::shared_ptr<void> operand, const char* what);
inline void deferred_commit() { tl_fiber->deferred_groups_committed++; }
void deferred_wait(unsigned pending, const char* what);

// Whether an asynchronous copy (cp.async, a TMA load or store) issued now lands at once or only
// when a wait needs it: at once in the forward and warp schedules, at the wait in the reverse ones,
// either (seeded, per copy) in the random one. The two show different mistakes: landing late, a
// read before the wait sees poison; landing at once, a copy into a buffer other threads still read
// (a stage reloaded too early) changes what they read.
bool copy_lands_at_issue();

// cp.async: a copy lands at issue or at the wait for its group (struct AsyncCopy).
void async_copy(void* dst, const void* src, unsigned bytes);
inline void async_commit() { tl_fiber->async_groups_committed++; }
// Complete every copy except those of the `pending` most recently committed groups (copies not
// yet committed belong to no waited-for group and complete only with `all`).
void async_wait(unsigned pending, bool all = false);

// Run kernel `invoke` over a grid: emu_entry.h's emu_launch, which the Python side calls.
int launch(void (*invoke)(void**), const unsigned* grid, const unsigned* block, size_t shared_bytes, void** args,
           int schedule, unsigned long long seed, int workers, size_t stack_bytes, char* error, size_t error_size,
           int counting, const unsigned long long* array_bases, const unsigned long long* array_bytes, int array_count,
           char* counters, size_t counters_size);

template <class T>
struct ShuffleOperand {
    T value;
    int source;  // the lane to read, or -1: keep own value
    T result;
};

template <class T>
inline void shuffle_fn(void* const* lanes, unsigned mask) {
    for (int l = 0; l < 32; ++l) {
        if (!(mask >> l & 1u)) continue;
        auto* op = static_cast<ShuffleOperand<T>*>(lanes[l]);
        int src = op->source < 0 ? l : op->source;
        if (!(mask >> src & 1u)) src = l;  // reading a lane outside the mask is undefined; see shuffle()
        op->result = static_cast<ShuffleOperand<T>*>(lanes[src])->value;
    }
}

template <class T>
inline T shuffle(unsigned mask, T value, int source, const char* what) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "shuffles move 4- or 8-byte values");
    if (source >= 0 && !(mask >> source & 1u))
        fail(format("%s reads lane %d, which is not in the mask 0x%08x (undefined on hardware)", what, source, mask));
    ShuffleOperand<T> op{value, source, value};
    warp_collective(mask, &op, shuffle_fn<T>, what);
    return op.result;
}

template <class T>
inline T atomic_update(T* address, T (*update)(T, T), T value) {
    // A CAS loop: blocks run on several OS threads, and float atomics have no native fetch-op.
    T old = __atomic_load_n(address, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(address, &old, update(old, value), true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
    }
    return old;
}

template <class T>
inline T atomic_float_update(T* address, T (*update)(T, T), T value) {
    using Bits = std::conditional_t<sizeof(T) == 4, unsigned int, unsigned long long>;
    Bits* word = reinterpret_cast<Bits*>(address);
    Bits old = __atomic_load_n(word, __ATOMIC_RELAXED);
    for (;;) {
        T old_value, new_value;
        std::memcpy(&old_value, &old, sizeof(T));
        new_value = update(old_value, value);
        Bits new_bits;
        std::memcpy(&new_bits, &new_value, sizeof(T));
        if (__atomic_compare_exchange_n(word, &old, new_bits, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) return old_value;
    }
}

// ---- kernel registration ---------------------------------------------------------------------

// Parameter kinds, as the Python side checks arguments: pointer, const pointer, integer, float,
// other (a struct, passed by value).
struct ParamInfo {
    int size;
    char kind;
    int pointee_size;  // 0 for void pointers and non-pointers
};

template <class T>
constexpr ParamInfo param_info() {
    if constexpr (std::is_pointer_v<T>) {
        using P = std::remove_pointer_t<T>;
        int pointee = std::is_void_v<P> ? 0 : static_cast<int>(sizeof(std::conditional_t<std::is_void_v<P>, char, P>));
        return ParamInfo{static_cast<int>(sizeof(T)), std::is_const_v<P> ? 'c' : 'p', pointee};
    } else if constexpr (std::is_same_v<T, bool>) {
        return ParamInfo{static_cast<int>(sizeof(T)), 'b', 0};
    } else if constexpr (std::is_integral_v<T> || std::is_enum_v<T>) {
        return ParamInfo{static_cast<int>(sizeof(T)), 'i', 0};
    } else if constexpr (std::is_floating_point_v<T>) {
        return ParamInfo{static_cast<int>(sizeof(T)), 'f', 0};
    } else {
        return ParamInfo{static_cast<int>(sizeof(T)), 'o', 0};
    }
}

// Parameters a kernel may take here (CUDA bounds their bytes, not their count; the wgmma forward
// with mods and a block mask takes more than 64).
constexpr int kMaxKernelParams = 128;

struct KernelInfo {
    const char* name;
    void (*invoke)(void**);
    int param_count;
    ParamInfo params[kMaxKernelParams];
};

template <class... A, size_t... I>
inline void call_with(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <class... A>
constexpr int count_params(void (*)(A...)) { return sizeof...(A); }

template <auto Kernel, class... A>
constexpr KernelInfo describe_with(const char* name, void (*)(A...)) {
    KernelInfo info{name, [](void** args) { call_with(Kernel, args, std::index_sequence_for<A...>{}); },
                    static_cast<int>(sizeof...(A)), {}};
    ParamInfo params[] = {param_info<A>()..., ParamInfo{0, 0, 0}};
    for (size_t i = 0; i < sizeof...(A); ++i) info.params[i] = params[i];
    return info;
}

template <auto Kernel>
constexpr KernelInfo describe(const char* name) {
    static_assert(count_params(Kernel) <= kMaxKernelParams, "too many kernel parameters (kMaxKernelParams)");
    return describe_with<Kernel>(name, Kernel);
}

}  // namespace emu
