// The emulator's execution engine: blocks on OS threads, CUDA threads as fibers, barriers, warp
// collectives, deadlock reports and the launch. Compiled once per toolchain into the shared library
// every kernel module links (cupy_attn/emulator/_build.py), so a kernel's build compiles only the
// kernel and the declarations of emu_runtime.h.
#include "emu_runtime.h"

#include <cstdarg>
#include <numeric>
#include <random>
#include <thread>

#include "emu_async.h"

namespace emu {

thread_local Block* tl_block = nullptr;
thread_local Fiber* tl_fiber = nullptr;
static thread_local std::vector<Stack>* tl_stacks = nullptr;

std::string format(const char* fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

static std::string block_name(const Block& b) { return format("block (%u, %u, %u)", b.idx.x, b.idx.y, b.idx.z); }

// Abort the current block with a message: back to the scheduler, never to resume.
[[noreturn]] void fail(const std::string& message) {
    Block* b = tl_block;
    Fiber* f = tl_fiber;
    b->aborted = true;
    b->error = block_name(*b) + format(", thread (%u, %u, %u): ", f->tid.x, f->tid.y, f->tid.z) + message;
    f->state = State::Done;
    switch_context(f->ctx, b->scheduler);
    __builtin_unreachable();
}

static void fiber_main() {
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

static std::string lane_list(unsigned bits) {
    std::string s;
    for (int l = 0; l < 32; ++l)
        if (bits >> l & 1u) s += (s.empty() ? "" : ", ") + std::to_string(l);
    return s;
}

// Why nothing can run: name each waiting collective, the lanes it misses and where they are.
static std::string deadlock_report(const Block& b) {
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
                 : s == State::AtMbarrier || s == State::AtNamedBarrier || s == State::AtRegisters ? async_wait
                                                                                                   : other) |= 1u << l;
            }
            report += format(" warp %zu waits in %s with mask 0x%08x; missing lanes [%s]", w, c.what, c.mask,
                             lane_list(missing).c_str());
            if (exited) report += " (exited or absent: [" + lane_list(exited) + "])";
            if (barrier) report += " (at __syncthreads: [" + lane_list(barrier) + "])";
            if (other) report += " (in another warp collective: [" + lane_list(other) + "])";
            if (async_wait) report += " (at an mbarrier, a named barrier or setmaxnreg: [" + lane_list(async_wait) + "])";
            report += ";";
        }
    }
    report += async_waits_report(b);
    if (at_barrier) report += format(" %u thread(s) wait at __syncthreads for threads stuck elsewhere;", at_barrier);
    report.pop_back();
    return report;
}

static void run_block(Launch& L, unsigned long long linear_block) {
    Block b;
    b.launch = &L;
    b.idx = uint3{static_cast<unsigned>(linear_block % L.grid.x),
                  static_cast<unsigned>(linear_block / L.grid.x % L.grid.y),
                  static_cast<unsigned>(linear_block / (static_cast<unsigned long long>(L.grid.x) * L.grid.y))};
    unsigned n = L.block.x * L.block.y * L.block.z;
    b.fibers.resize(n);
    b.warps.resize((n + 31) / 32);
    lanes_synced(b);
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
            publish_mbarriers(b, nullptr, nullptr);
            lanes_synced(b);
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
    if (!b.aborted) {
        const std::string mbarrier_error = mbarrier_exit_error(b);
        if (!mbarrier_error.empty()) {
            b.aborted = true;
            b.error = block_name(b) + ": at the block's end, " + mbarrier_error;
        }
    }
    // A named barrier's generation that threads arrived at (bar.arrive) and none completed: the
    // kernels keep their barrier protocols whole (a hand-over no one takes is a turn lost), so
    // the emulator holds them to it, stricter than the PTX ISA, which says nothing of it.
    for (unsigned id = 1; id < 16 && !b.aborted; ++id)
        if (b.named[id].arrived) {
            b.aborted = true;
            b.error = block_name(b) + format(": at the block's end, named barrier %u holds %u of its %u arrivals "
                                             "(a generation no thread completed)", id, b.named[id].arrived,
                                             b.named[id].count);
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

static void run_worker(Launch* L) {
    std::vector<Stack> stacks;
    tl_stacks = &stacks;
    for (unsigned long long i; !L->failed && (i = L->next_block++) < L->blocks;) run_block(*L, i);
    for (Stack& s : stacks) free_stack(s);
    tl_stacks = nullptr;
}

int block_barrier(int vote) {
    Fiber* f = tl_fiber;
    f->barrier_vote = vote;
    f->state = State::AtBarrier;
    yield_to_scheduler();
    return tl_block->barrier_result;
}

void warp_collective(unsigned mask, void* operand, CollectiveFn fn, const char* what) {
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

// Record one lane's access for the launch's counters (emu_counters.h), if it counts: `bytes` at
// `address` in shared (kShared; kept as its offset, which decides the bank) or global memory.
void count_access(int space, const void* address, unsigned bytes, const char* file, int line) {
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
unsigned shared_offset(const void* p, const char* what) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    Block* b = tl_block;
    if (c < b->dynamic_shared || c >= b->dynamic_shared + b->launch->shared_bytes)
        fail(format("%s: address %p is not in the block's %zu bytes of dynamic shared memory", what, p,
                    b->launch->shared_bytes));
    return static_cast<unsigned>(c - b->dynamic_shared);
}
unsigned char* shared_pointer(size_t offset, size_t bytes, const char* what) {
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
void defer_warp_op(CollectiveFn fn, std::shared_ptr<void> operand, const char* what) {
    Fiber* f = tl_fiber;
    f->deferred_ops.push_back(DeferredWarpOp{fn, std::move(operand), f->deferred_groups_committed, what});
}

struct DeferredBatch {
    const DeferredWarpOp* ops;
    size_t count;
};

static void deferred_batch_fn(void* const* lanes, unsigned mask) {
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

void deferred_wait(unsigned pending, const char* what) {
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

bool copy_lands_at_issue() {
    Block* b = tl_block;
    const int schedule = b->launch->schedule;
    if (schedule == kForward || schedule == kWarps) return true;
    if (schedule == kReverse || schedule == kWarpsReverse) return false;
    unsigned long long h = (b->launch->seed + 7) * 0x9e3779b97f4a7c15ull + ++b->async_copies_issued;
    h ^= h >> 31;
    return h & 1;
}

void async_copy(void* dst, const void* src, unsigned bytes) {
    Fiber* f = tl_fiber;
    if (copy_lands_at_issue()) std::memcpy(dst, src, bytes);
    else f->async_copies.push_back(AsyncCopy{dst, src, bytes, f->async_groups_committed});
}
// Complete every copy except those of the `pending` most recently committed groups (copies not
// yet committed belong to no waited-for group and complete only with wait_all).
void async_wait(unsigned pending, bool all) {
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

void check_width(int width, const char* what) {
    if (width < 1 || width > 32 || (width & (width - 1)))
        fail(format("%s: width %d is not a power of two in [1, 32]", what, width));
}

struct VoteOperand {
    int predicate;
    unsigned result;
};

static void ballot_fn(void* const* lanes, unsigned mask) {
    unsigned bits = 0;
    for (int l = 0; l < 32; ++l)
        if ((mask >> l & 1u) && static_cast<VoteOperand*>(lanes[l])->predicate) bits |= 1u << l;
    for (int l = 0; l < 32; ++l)
        if (mask >> l & 1u) static_cast<VoteOperand*>(lanes[l])->result = bits;
}

unsigned vote(unsigned mask, int predicate, const char* what) {
    VoteOperand op{predicate, 0};
    warp_collective(mask, &op, ballot_fn, what);
    return op.result;
}

void syncwarp_fn(void* const*, unsigned mask) {
    Block* b = tl_block;
    const unsigned warp = tl_fiber->linear >> 5;
    const unsigned lanes = std::min<size_t>(32, b->fibers.size() - 32 * warp);
    if (mask == (lanes == 32 ? ~0u : (1u << lanes) - 1)) lane_synced(*b, warp);  // a partial mask orders only its lanes
    if (b->mbarriers.empty()) return;  // nothing to publish
    std::vector<bool> took_part(b->fibers.size(), false);
    const unsigned first = tl_fiber->linear & ~31u;
    for (unsigned l = 0; l < 32; ++l)
        if (mask >> l & 1u) took_part[first + l] = true;
    publish_mbarriers(*b, &took_part, &took_part);
}

int launch(void (*invoke)(void**), const unsigned* grid, const unsigned* block, size_t shared_bytes, void** args,
           int schedule, unsigned long long seed, int workers, size_t stack_bytes, char* error, size_t error_size,
           int counting, const unsigned long long* array_bases, const unsigned long long* array_bytes, int array_count,
           char* counters, size_t counters_size) {
    Launch L;
    L.invoke = invoke;
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
    for (unsigned long long i = 1; i < n; ++i) threads.emplace_back(run_worker, &L);
    run_worker(&L);
    for (std::thread& t : threads) t.join();
    if (L.counting && !L.failed) {
        // One line per site: file, line, space, warp-wide accesses, lane accesses, actual, ideal.
        std::string text;
        for (const auto& [site, totals] : L.counters)
            text += format("%s\t%d\t%d\t%llu\t%llu\t%llu\t%llu\n", std::get<0>(site).c_str(), std::get<1>(site),
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

}  // namespace emu
