// The emulator's execution engine: blocks on OS threads, CUDA threads as fibers, barriers,
// warp collectives, deadlock reports, and the C entry points the Python side calls.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "emu_counters.h"
#include "emu_fiber.h"
#include "emu_types.h"

namespace emu {

// AtMbarrier and AtNamedBarrier: waiting for an mbarrier's phase or a named barrier (emu_async.h).
enum class State : unsigned char { Ready, AtBarrier, AtWarp, AtMbarrier, AtNamedBarrier, Done };
// Between synchronisation points threads run in thread order, in reverse, in a random order per
// round, or warp by warp (each warp runs alone until it waits at a block barrier or exits,
// lowest or highest warp first): the warp schedules let one warp race far ahead of the others,
// as it can on hardware, which round-robin schedules keep in lockstep.
enum Schedule { kForward = 0, kReverse = 1, kRandom = 2, kWarps = 3, kWarpsReverse = 4 };

// A cp.async copy waits here until its group is waited for, so code that reads shared memory
// before `cp.async.wait_group` sees the poison, as it could on hardware.
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
};

// An mbarrier object's state (PTX ISA, "mbarrier"): the arrivals each phase expects, those still
// pending in the current phase, the transaction count (bytes announced by expect-tx and not yet
// completed) and the number of the phase in progress (0 after init; its parity is the phase bit).
struct Mbarrier {
    unsigned expected = 0, pending = 0;
    long long tx = 0;
    long long phase = 0;
};

// A named barrier (bar.sync / bar.arrive with an id and a thread count): the count of the
// current generation and which threads arrived in it.
struct NamedBarrier {
    unsigned count = 0, arrived = 0;
    std::vector<bool> arrivals;
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
    std::map<unsigned, Mbarrier> mbarriers;  // by shared offset
    NamedBarrier named[16];
    std::vector<TmaCopy> tma_loads;  // TMA loads issued and not yet landed
    unsigned long long tma_issued = 0;
    std::vector<unsigned> warp_registers;  // setmaxnreg's per-thread count per warp; 0: as compiled
    std::vector<unsigned> warp_register_calls;  // how many setmaxnreg each warp executed
    struct WarpgroupRequest { unsigned count; bool increase; };
    std::vector<std::vector<WarpgroupRequest>> register_requests;  // per warpgroup: its i-th setmaxnreg
    Context scheduler;
    unsigned live = 0;
    int barrier_result = 0;
    bool aborted = false;
    std::string error;
};

inline thread_local Block* tl_block = nullptr;
inline thread_local Fiber* tl_fiber = nullptr;
inline thread_local std::vector<Stack>* tl_stacks = nullptr;

inline std::string format(const char* fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

inline std::string block_name(const Block& b) { return format("block (%u, %u, %u)", b.idx.x, b.idx.y, b.idx.z); }

// Abort the current block with a message: back to the scheduler, never to resume.
[[noreturn]] inline void fail(const std::string& message) {
    Block* b = tl_block;
    Fiber* f = tl_fiber;
    b->aborted = true;
    b->error = block_name(*b) + format(", thread (%u, %u, %u): ", f->tid.x, f->tid.y, f->tid.z) + message;
    f->state = State::Done;
    switch_context(f->ctx, b->scheduler);
    __builtin_unreachable();
}

inline void yield_to_scheduler() { switch_context(tl_fiber->ctx, tl_block->scheduler); }

inline void fiber_main() {
    Launch* launch = tl_block->launch;
    launch->invoke(launch->args);
    Fiber* f = tl_fiber;
    if (!f->bulk_stores.empty())
        fail(format("the thread exits with %zu TMA store(s) whose reads of shared memory it did not wait for "
                    "(cp.async.bulk.wait_group.read)", f->bulk_stores.size()));
    f->state = State::Done;
    f->async_copies.clear();
    f->deferred_ops.clear();
    tl_block->live--;
    switch_context(f->ctx, tl_block->scheduler);
    __builtin_unreachable();
}

inline unsigned lane_id() { return tl_fiber->linear & 31u; }

inline std::string lane_list(unsigned bits) {
    std::string s;
    for (int l = 0; l < 32; ++l)
        if (bits >> l & 1u) s += (s.empty() ? "" : ", ") + std::to_string(l);
    return s;
}

inline std::string async_waits_report(const Block& b);  // emu_async.h

// Why nothing can run: name each waiting collective, the lanes it misses and where they are.
inline std::string deadlock_report(const Block& b) {
    std::string report = "deadlock in " + block_name(b) + ":";
    unsigned at_barrier = 0;
    for (const Fiber& f : b.fibers) at_barrier += f.state == State::AtBarrier;
    for (size_t w = 0; w < b.warps.size(); ++w) {
        for (const Collective& c : b.warps[w]) {
            unsigned missing = c.mask & ~c.arrived, exited = 0, barrier = 0, other = 0, async_wait = 0;
            for (int l = 0; l < 32; ++l) {
                if (!(missing >> l & 1u)) continue;
                size_t t = w * 32 + l;
                if (t >= b.fibers.size()) { exited |= 1u << l; continue; }  // lane does not exist
                State s = b.fibers[t].state;
                (s == State::Done ? exited : s == State::AtBarrier ? barrier
                 : s == State::AtMbarrier || s == State::AtNamedBarrier ? async_wait : other) |= 1u << l;
            }
            report += format(" warp %zu waits in %s with mask 0x%08x; missing lanes [%s]", w, c.what, c.mask,
                             lane_list(missing).c_str());
            if (exited) report += " (exited or absent: [" + lane_list(exited) + "])";
            if (barrier) report += " (at __syncthreads: [" + lane_list(barrier) + "])";
            if (other) report += " (in another warp collective: [" + lane_list(other) + "])";
            if (async_wait) report += " (at an mbarrier or named barrier: [" + lane_list(async_wait) + "])";
            report += ";";
        }
    }
    report += async_waits_report(b);
    if (at_barrier) report += format(" %u thread(s) wait at __syncthreads for threads stuck elsewhere;", at_barrier);
    report.pop_back();
    return report;
}

inline void run_block(Launch& L, unsigned long long linear_block) {
    Block b;
    b.launch = &L;
    b.idx = uint3{static_cast<unsigned>(linear_block % L.grid.x),
                  static_cast<unsigned>(linear_block / L.grid.x % L.grid.y),
                  static_cast<unsigned>(linear_block / (static_cast<unsigned long long>(L.grid.x) * L.grid.y))};
    unsigned n = L.block.x * L.block.y * L.block.z;
    b.fibers.resize(n);
    b.warps.resize((n + 31) / 32);
    // Dynamic shared memory, filled with 0xff bytes: NaN as float, half and bfloat16, so reads
    // of unwritten shared memory show. Allocated per block at its exact size for AddressSanitizer.
    std::vector<unsigned char> shared(std::max<size_t>(L.shared_bytes, 1), 0xff);
    b.dynamic_shared = shared.data();
    std::vector<Stack>& stacks = *tl_stacks;
    while (stacks.size() < n) stacks.push_back(make_stack(L.stack_bytes));
    for (unsigned t = 0; t < n; ++t) {
        Fiber& f = b.fibers[t];
        f.linear = t;
        f.tid = uint3{t % L.block.x, t / L.block.x % L.block.y, t / (L.block.x * L.block.y)};
        make_context(f.ctx, stacks[t], fiber_main);
    }
    b.live = n;
    tl_block = &b;
    std::vector<unsigned> order(n);
    std::iota(order.begin(), order.end(), 0u);
    std::mt19937_64 rng(L.seed * 0x9e3779b97f4a7c15ull + linear_block);
    if (L.schedule == kReverse || L.schedule == kWarpsReverse) std::reverse(order.begin(), order.end());
    const bool by_warp = L.schedule == kWarps || L.schedule == kWarpsReverse;
    auto resume = [&](Fiber& f) {
        tl_fiber = &f;
        switch_context(b.scheduler, f.ctx);
        tl_fiber = nullptr;
    };
    while (b.live) {
        if (L.schedule == kRandom) std::shuffle(order.begin(), order.end(), rng);
        bool ran = false;
        if (by_warp) {
            // `order` lists the warps' threads together, in warp order (or reversed).
            for (size_t first = 0; first < order.size() && !b.aborted; first += 32) {
                size_t last = std::min(order.size(), first + 32);
                for (bool warp_ran = true; warp_ran && !b.aborted;) {
                    warp_ran = false;
                    for (size_t i = first; i < last && !b.aborted; ++i)
                        if (b.fibers[order[i]].state == State::Ready) { resume(b.fibers[order[i]]); warp_ran = ran = true; }
                }
            }
        } else {
            for (unsigned t : order) {
                Fiber& f = b.fibers[t];
                if (f.state != State::Ready) continue;
                resume(f);
                ran = true;
                if (b.aborted) break;
            }
        }
        if (b.aborted || !b.live) break;
        unsigned waiting = 0;
        int votes = 0;
        for (const Fiber& f : b.fibers)
            if (f.state == State::AtBarrier) { waiting++; votes += f.barrier_vote != 0; }
        // __syncthreads releases when every thread that has not exited arrived (sm_70+).
        if (waiting == b.live) {
            b.barrier_result = votes;
            for (Fiber& f : b.fibers)
                if (f.state == State::AtBarrier) f.state = State::Ready;
        } else if (!ran) {
            b.aborted = true;
            b.error = deadlock_report(b);
        }
    }
    if (!b.aborted && !b.tma_loads.empty()) {
        b.aborted = true;
        b.error = block_name(b) + format(": the block exits with %zu TMA load(s) no thread waited for (their "
                                         "mbarrier's phase was never awaited)", b.tma_loads.size());
    }
    tl_block = nullptr;
    if (b.aborted) {
        std::lock_guard<std::mutex> lock(L.error_mutex);
        if (!L.failed.exchange(true)) L.error = b.error;
    } else if (L.counting) {
        CounterTable block_counters;
        for (size_t first = 0; first < b.fibers.size(); first += 32) {
            std::vector<const AccessLog*> logs;
            for (size_t t = first; t < std::min(b.fibers.size(), first + 32); ++t) logs.push_back(&b.fibers[t].log);
            count_warp(logs, block_counters);
        }
        std::lock_guard<std::mutex> lock(L.counter_mutex);
        for (const auto& [site, totals] : block_counters) L.counters[site].add(totals.accesses, totals.lanes, totals.cost);
    }
}

inline void run_worker(Launch* L) {
    std::vector<Stack> stacks;
    tl_stacks = &stacks;
    for (unsigned long long i; !L->failed && (i = L->next_block++) < L->blocks;) run_block(*L, i);
    for (Stack& s : stacks) free_stack(s);
    tl_stacks = nullptr;
}

// ---- device-side API -------------------------------------------------------------------------

inline int block_barrier(int vote) {
    Fiber* f = tl_fiber;
    f->barrier_vote = vote;
    f->state = State::AtBarrier;
    yield_to_scheduler();
    return tl_block->barrier_result;
}

inline void warp_collective(unsigned mask, void* operand, CollectiveFn fn, const char* what) {
    Block* b = tl_block;
    Fiber* f = tl_fiber;
    unsigned lane = f->linear & 31u, warp = f->linear >> 5;
    if (!(mask >> lane & 1u)) fail(format("%s called with mask 0x%08x, which excludes the calling lane %u", what, mask, lane));
    std::vector<Collective>& pending = b->warps[warp];
    auto it = std::find_if(pending.begin(), pending.end(), [&](const Collective& c) { return c.mask == mask; });
    if (it == pending.end()) {
        pending.push_back(Collective{mask, 0u, what, fn, {}});
        it = pending.end() - 1;
    } else if (it->fn != fn) {
        fail(format("warp %u diverged: lane %u is in %s while lanes [%s] of the same mask 0x%08x are in %s", warp,
                    lane, what, lane_list(it->arrived).c_str(), mask, it->what));
    }
    it->lanes[lane] = operand;
    it->arrived |= 1u << lane;
    if (it->arrived != mask) {
        f->state = State::AtWarp;
        yield_to_scheduler();
        return;
    }
    Collective done = *it;
    pending.erase(it);
    done.fn(done.lanes, mask);
    for (int l = 0; l < 32; ++l)
        if ((mask >> l & 1u) && static_cast<unsigned>(l) != lane) b->fibers[warp * 32 + l].state = State::Ready;
}

inline unsigned char* dynamic_shared() { return tl_block->dynamic_shared; }

// Record one lane's access for the launch's counters (emu_counters.h), if it counts: `bytes` at
// `address` in shared (kShared; kept as its offset, which decides the bank) or global memory.
inline void count_access(int space, const void* address, unsigned bytes, const char* file, int line) {
    Block* b = tl_block;
    if (!b || !b->launch->counting) return;
    Fiber* f = tl_fiber;
    uintptr_t at = reinterpret_cast<uintptr_t>(address);
    if (space == kShared) {
        const unsigned char* c = static_cast<const unsigned char*>(address);
        if (c < b->dynamic_shared || c + bytes > b->dynamic_shared + b->launch->shared_bytes)
            fail(format("counted shared access of %u bytes at %p (%s:%d) is not in the block's %zu bytes of dynamic "
                        "shared memory", bytes, address, file, line, b->launch->shared_bytes));
        at = static_cast<uintptr_t>(c - b->dynamic_shared);
    } else {
        const auto& arrays = b->launch->arrays;
        auto it = std::upper_bound(arrays.begin(), arrays.end(), std::make_pair(at, ~size_t(0)));
        while (it != arrays.begin() && at + bytes > std::prev(it)->first + std::prev(it)->second) --it;  // views overlap
        if (it == arrays.begin())
            fail(format("counted global access of %u bytes at %p (%s:%d) is not inside an array argument", bytes,
                        address, file, line));
        --it;
        // array i's byte j becomes i * 2^40 + j: distinct arrays never share a sector
        at = (static_cast<uintptr_t>(it - arrays.begin()) << 40) + (at - it->first);
    }
    unsigned occurrence = f->log.seen[{file, line, space}]++;
    f->log.accesses.push_back(Access{file, line, space, occurrence, f->linear & 31u, at, bytes});
}

// The offset of a pointer into the block's dynamic shared memory, standing in for its
// shared-window address (__cvta_generic_to_shared), and back; anything outside fails the block.
// On the GPU, kernels without static shared memory have theirs start after the 1 KB the system
// reserves per block (sm_80 and later): a multiple of 1024 bytes, so banks, swizzle atoms and the
// alignments the emulator checks fall as they do there.
inline unsigned shared_offset(const void* p, const char* what) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    Block* b = tl_block;
    if (c < b->dynamic_shared || c >= b->dynamic_shared + b->launch->shared_bytes)
        fail(format("%s: address %p is not in the block's %zu bytes of dynamic shared memory", what, p,
                    b->launch->shared_bytes));
    return static_cast<unsigned>(c - b->dynamic_shared);
}
inline unsigned char* shared_pointer(size_t offset, size_t bytes, const char* what) {
    Block* b = tl_block;
    if (offset + bytes > b->launch->shared_bytes)
        fail(format("%s reads shared bytes [%zu, %zu) beyond the block's %zu", what, offset, offset + bytes,
                    b->launch->shared_bytes));
    return b->dynamic_shared + offset;
}

// Deferred warp operations: defer_warp_op records this lane's share in the open group,
// deferred_commit closes the group, and deferred_wait(pending) runs (as warp collectives, in
// issue order) every operation of all but the `pending` most recent committed groups. Until
// then their results are not written, as on hardware, where they land only at the wait.
inline void defer_warp_op(CollectiveFn fn, std::shared_ptr<void> operand, const char* what) {
    Fiber* f = tl_fiber;
    f->deferred_ops.push_back(DeferredWarpOp{fn, std::move(operand), f->deferred_groups_committed, what});
}
inline void deferred_commit() { tl_fiber->deferred_groups_committed++; }

struct DeferredBatch {
    const DeferredWarpOp* ops;
    size_t count;
};

inline void deferred_batch_fn(void* const* lanes, unsigned mask) {
    const DeferredBatch* first = nullptr;
    for (int l = 0; l < 32; ++l) {
        if (!(mask >> l & 1u)) continue;
        const DeferredBatch* batch = static_cast<const DeferredBatch*>(lanes[l]);
        if (!first) first = batch;
        if (batch->count != first->count)
            fail(format("lanes of a warp wait for different numbers of asynchronous warp operations (%zu and %zu)",
                        first->count, batch->count));
    }
    for (size_t i = 0; i < first->count; ++i) {
        void* operands[32] = {};
        for (int l = 0; l < 32; ++l) {
            if (!(mask >> l & 1u)) continue;
            const DeferredWarpOp& op = static_cast<const DeferredBatch*>(lanes[l])->ops[i];
            if (op.fn != first->ops[i].fn)
                fail(format("lanes of a warp issued different asynchronous operations: %s and %s", first->ops[i].what,
                            op.what));
            operands[l] = op.operand.get();
        }
        first->ops[i].fn(operands, mask);
    }
}

inline void deferred_wait(unsigned pending, const char* what) {
    Fiber* f = tl_fiber;
    unsigned committed = f->deferred_groups_committed;
    size_t ready = 0;
    while (ready < f->deferred_ops.size()) {
        unsigned group = f->deferred_ops[ready].group;
        if (!(group < committed && committed - group > pending)) break;
        ++ready;
    }
    DeferredBatch batch{f->deferred_ops.data(), ready};
    warp_collective(0xffffffffu, &batch, deferred_batch_fn, what);
    f->deferred_ops.erase(f->deferred_ops.begin(), f->deferred_ops.begin() + ready);
}

inline void async_copy(void* dst, const void* src, unsigned bytes) {
    Fiber* f = tl_fiber;
    f->async_copies.push_back(AsyncCopy{dst, src, bytes, f->async_groups_committed});
}
inline void async_commit() { tl_fiber->async_groups_committed++; }
// Complete every copy except those of the `pending` most recently committed groups (copies not
// yet committed belong to no waited-for group and complete only with wait_all).
inline void async_wait(unsigned pending, bool all = false) {
    Fiber* f = tl_fiber;
    unsigned committed = f->async_groups_committed;
    std::vector<AsyncCopy> keep;
    for (const AsyncCopy& c : f->async_copies) {
        bool complete = all || (c.group < committed && committed - c.group > pending);
        if (complete) std::memcpy(c.dst, c.src, c.bytes);
        else keep.push_back(c);
    }
    f->async_copies.swap(keep);
}

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

inline void check_width(int width, const char* what) {
    if (width < 1 || width > 32 || (width & (width - 1)))
        fail(format("%s: width %d is not a power of two in [1, 32]", what, width));
}

struct VoteOperand {
    int predicate;
    unsigned result;
};

inline void ballot_fn(void* const* lanes, unsigned mask) {
    unsigned bits = 0;
    for (int l = 0; l < 32; ++l)
        if ((mask >> l & 1u) && static_cast<VoteOperand*>(lanes[l])->predicate) bits |= 1u << l;
    for (int l = 0; l < 32; ++l)
        if (mask >> l & 1u) static_cast<VoteOperand*>(lanes[l])->result = bits;
}

inline unsigned vote(unsigned mask, int predicate, const char* what) {
    VoteOperand op{predicate, 0};
    warp_collective(mask, &op, ballot_fn, what);
    return op.result;
}

inline void no_op_fn(void* const*, unsigned) {}

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

struct KernelInfo {
    const char* name;
    void (*invoke)(void**);
    int param_count;
    ParamInfo params[64];
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
    static_assert(count_params(Kernel) <= 64, "at most 64 kernel parameters");
    return describe_with<Kernel>(name, Kernel);
}

}  // namespace emu

// ---- C entry points for the Python side (emu_kernel_table is generated per module) -----------

extern const emu::KernelInfo emu_kernel_table[];
extern const int emu_kernel_count;

extern "C" __attribute__((visibility("default"))) int emu_kernel_count_get() { return emu_kernel_count; }

extern "C" __attribute__((visibility("default"))) const char* emu_kernel_name(int k) { return emu_kernel_table[k].name; }

extern "C" __attribute__((visibility("default"))) int emu_kernel_params(int k, int* sizes, char* kinds, int* pointee_sizes) {
    const emu::KernelInfo& info = emu_kernel_table[k];
    for (int i = 0; i < info.param_count; ++i) {
        sizes[i] = info.params[i].size;
        kinds[i] = info.params[i].kind;
        pointee_sizes[i] = info.params[i].pointee_size;
    }
    return info.param_count;
}

extern "C" __attribute__((visibility("default"))) int emu_launch(int k, const unsigned* grid, const unsigned* block,
                                                                 size_t shared_bytes, void** args, int schedule,
                                                                 unsigned long long seed, int workers,
                                                                 size_t stack_bytes, char* error, size_t error_size,
                                                                 int counting, const unsigned long long* array_bases,
                                                                 const unsigned long long* array_bytes, int array_count,
                                                                 char* counters, size_t counters_size) {
    emu::Launch L;
    L.invoke = emu_kernel_table[k].invoke;
    L.args = args;
    L.grid = dim3(grid[0], grid[1], grid[2]);
    L.block = dim3(block[0], block[1], block[2]);
    L.shared_bytes = shared_bytes;
    L.schedule = schedule;
    L.seed = seed;
    L.stack_bytes = stack_bytes;
    L.blocks = static_cast<unsigned long long>(grid[0]) * grid[1] * grid[2];
    L.counting = counting != 0;
    for (int i = 0; i < array_count; ++i) L.arrays.emplace_back(array_bases[i], array_bytes[i]);
    std::sort(L.arrays.begin(), L.arrays.end());
    unsigned long long n = std::min<unsigned long long>(std::max(workers, 1), L.blocks);
    std::vector<std::thread> threads;
    for (unsigned long long i = 1; i < n; ++i) threads.emplace_back(emu::run_worker, &L);
    emu::run_worker(&L);
    for (std::thread& t : threads) t.join();
    if (L.counting && !L.failed) {
        // One line per site: file, line, space, warp-wide accesses, lane accesses, actual, ideal.
        std::string text;
        for (const auto& [site, totals] : L.counters)
            text += emu::format("%s\t%d\t%d\t%llu\t%llu\t%llu\t%llu\n", std::get<0>(site).c_str(), std::get<1>(site),
                                std::get<2>(site), totals.accesses, totals.lanes, totals.cost.actual, totals.cost.ideal);
        if (text.size() >= counters_size) {
            std::snprintf(error, error_size, "the counters of %zu sites do not fit their %zu-byte buffer",
                          L.counters.size(), counters_size);
            return 1;
        }
        std::memcpy(counters, text.c_str(), text.size() + 1);
    }
    if (!L.failed) return 0;
    std::snprintf(error, error_size, "%s", L.error.c_str());
    return 1;
}
