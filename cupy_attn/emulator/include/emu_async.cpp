// The emulator's Hopper synchronisation and proxies (emu_async.h): compiled into the emulator's
// runtime library with emu_runtime.cpp.
#include "emu_async.h"

#include <algorithm>
#include <cstring>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

namespace emu {

// ---- the async proxy's view of shared memory --------------------------------------------------
// wgmma and TMA read shared memory through the async proxy, which sees generic-proxy writes
// (plain stores, cp.async) only after a fence.proxy.async. The emulator keeps a second copy of the
// block's dynamic shared memory for it: poison (0xff) until the first fence, and at each fence a
// copy of the generic view, except for the bytes of other threads' named stores (generic_store)
// not yet fenced, which keep what the async proxy saw: each thread that stored must fence its own
// stores, before the barrier that hands them to the thread issuing the wgmma or TMA store. That
// is the CUDA Programming Guide's and CUTLASS's convention, which every kernel here follows; it
// may be stricter than the PTX ISA, whose proxy fences compose with other synchronisation (one
// fence after the barrier, in the issuing thread, may be enough there), as the mbarrier-init rule
// is. Writes the kernels do not name (cp.async copies) and named stores made before the block's
// first use of the async proxy are published by any thread's fence, so a missing fence of those
// shows as poison only if no later fence covers it, which the schedules vary.

static std::vector<unsigned char>& async_view() {
    Block* b = tl_block;
    if (b->async_shared.empty()) {
        b->async_shared.assign(std::max<size_t>(b->launch->shared_bytes, 1), 0xff);
        b->unfenced_owner.assign(b->async_shared.size(), -1);
    }
    return b->async_shared;
}

void fence_proxy_async() {
    Block* b = tl_block;
    Fiber* me = tl_fiber;
    std::vector<unsigned char>& view = async_view();
    // Other threads' unfenced bytes keep what the async proxy saw: those each still owns (a later
    // named store by another thread, this one's included, took the byte over).
    std::vector<std::pair<unsigned, unsigned char>> kept;
    for (const Fiber& f : b->fibers)
        if (&f != me)
            for (const auto& [at, n] : f.unfenced_stores)
                for (unsigned i = at; i < at + n; ++i)
                    if (b->unfenced_owner[i] == static_cast<int>(f.linear)) kept.emplace_back(i, view[i]);
    std::memcpy(view.data(), b->dynamic_shared, b->launch->shared_bytes);
    for (const auto& [i, byte] : kept) view[i] = byte;
    for (const auto& [at, n] : me->unfenced_stores)
        for (unsigned i = at; i < at + n; ++i)
            if (b->unfenced_owner[i] == static_cast<int>(me->linear)) b->unfenced_owner[i] = -1;
    me->unfenced_stores.clear();
}

void generic_store(const void* address, unsigned bytes, const char* file, int line) {
    count_access(kShared, address, bytes, file, line);
    lane_store(address, bytes, file, line);
    Block* b = tl_block;
    if (b->async_shared.empty()) return;  // the async proxy not used yet: the first fence publishes it
    const uintptr_t at = reinterpret_cast<uintptr_t>(address) - reinterpret_cast<uintptr_t>(b->dynamic_shared);
    if (at >= b->launch->shared_bytes || bytes > b->launch->shared_bytes - at) return;  // dynamic shared memory only
    const int me = static_cast<int>(tl_fiber->linear);
    bool taken = false;  // whether a byte was not already this thread's unfenced store (then listed once more)
    for (uintptr_t i = at; i < at + bytes; ++i) {
        taken |= b->unfenced_owner[i] != me;
        b->unfenced_owner[i] = me;
    }
    if (taken) tl_fiber->unfenced_stores.emplace_back(static_cast<unsigned>(at), bytes);
}

// wgmma.fence: PTX requires one before a warpgroup's first wgmma.mma_async and between a thread's
// access to registers a wgmma reads or writes (its accumulators, A's fragment) and that wgmma. The
// emulator takes a thread's wgmma.wait_group as such an access (the thread reads the results
// next), so each batch of wgmma issued after a wait needs a fence of its own.
void require_wgmma_fence(const char* what) {
    if (!tl_fiber->wgmma_fenced)
        fail(format("%s issued without a wgmma.fence since the thread's start or its last wgmma.wait_group: the "
                    "fence orders the thread's accesses to the instruction's registers before it", what));
}

void wgmma_fence() {
    Fiber* f = tl_fiber;
    f->wgmma_fenced = true;
    std::vector<RegisterPin>& pins = f->register_pins;
#if defined(__SANITIZE_ADDRESS__)
    // A pin may outlive its array (one pinned after a wait, in a scope that ended before this
    // fence): what lies there is no wgmma's register any more, and AddressSanitizer would stop
    // the copy below, so such pins go.
    pins.erase(std::remove_if(pins.begin(), pins.end(),
                              [](const RegisterPin& pin) { return __asan_region_is_poisoned(const_cast<unsigned char*>(pin.at), pin.bytes); }),
               pins.end());
#endif
    for (RegisterPin& pin : pins) pin.at_fence.assign(pin.at, pin.at + pin.bytes);
}

void pin_registers(const void* at, unsigned bytes) {
    const unsigned char* p = static_cast<const unsigned char*>(at);
    for (const RegisterPin& pin : tl_fiber->register_pins)
        if (pin.at == p && pin.bytes == bytes) return;
    tl_fiber->register_pins.push_back(RegisterPin{p, bytes, {}});
}

void require_registers_as_fenced(const void* at, unsigned bytes, const char* operand, const char* what) {
    const unsigned char* p = static_cast<const unsigned char*>(at);
    for (const RegisterPin& pin : tl_fiber->register_pins) {
        if (pin.at_fence.empty() || p < pin.at || p + bytes > pin.at + pin.bytes) continue;  // no fence since the pin
        if (std::memcmp(p, pin.at_fence.data() + (p - pin.at), bytes))
            fail(format("%s: its %s registers were written after the thread's last wgmma.fence, which must come "
                        "between a thread's access to a wgmma's registers and the wgmma (PTX ISA, wgmma.fence)",
                        what, operand));
    }
}

// `bytes` of shared memory at `offset` as the async proxy reads them.
const unsigned char* async_shared_pointer(size_t offset, size_t bytes, const char* what) {
    Block* b = tl_block;
    if (offset + bytes > b->launch->shared_bytes)
        fail(format("%s reads shared bytes [%zu, %zu) beyond the block's %zu", what, offset, offset + bytes,
                    b->launch->shared_bytes));
    return async_view().data() + offset;
}

// ---- warpgroup-wide instructions ----------------------------------------------------------------
WarpgroupInstruction warpgroup_instruction(WarpgroupKind kind, const WarpgroupInstruction& mine) {
    const unsigned warp = tl_fiber->linear / 32;
    WarpgroupSequence& seq = tl_block->warpgroup_sequences[{kind, warp / 4}];
    const unsigned long long index = seq.executed[warp % 4]++;
    if (index - seq.first == seq.recorded.size()) seq.recorded.push_back(mine);
    const WarpgroupInstruction recorded = seq.recorded[index - seq.first];
    while (!seq.recorded.empty() && *std::min_element(seq.executed, seq.executed + 4) > seq.first) {
        seq.recorded.pop_front();  // every warp of the group passed it
        seq.first++;
    }
    return recorded;
}

// ---- mbarrier ---------------------------------------------------------------------------------
// The state lives in Block::mbarriers, keyed by the object's shared offset; the object's 8 bytes
// hold a canary, so a store that overwrites a live mbarrier is reported at its next use.
static constexpr unsigned long long kMbarrierCanary = 0x4d42415252494552ull;  // "MBARRIER"

static unsigned mbarrier_offset(const void* bar, const char* what) {
    const unsigned offset = shared_offset(bar, what);
    if (offset % 8) fail(format("%s: the mbarrier at shared offset %u is not 8-byte aligned", what, offset));
    if (offset + 8 > tl_block->launch->shared_bytes)
        fail(format("%s: the mbarrier at shared offset %u does not fit in shared memory", what, offset));
    return offset;
}

// The mbarrier at `offset`, valid and intact; `by_thread`: used by the calling thread (not by a TMA
// copy landing), which must be the initialising one or one its init was published to.
static Mbarrier& mbarrier_at(unsigned offset, const char* what, bool by_thread = true) {
    Block* b = tl_block;
    auto it = b->mbarriers.find(offset);
    if (it == b->mbarriers.end())
        fail(format("%s: no mbarrier is initialised at shared offset %u (mbarrier.init, then a barrier, must come "
                    "first)", what, offset));
    unsigned long long canary;
    std::memcpy(&canary, b->dynamic_shared + offset, 8);
    if (canary != kMbarrierCanary)
        fail(format("%s: the mbarrier at shared offset %u was overwritten by a store to its 8 bytes", what, offset));
    const Mbarrier& m = it->second;
    if (by_thread && !m.visible_to[tl_fiber->linear])
        fail(format("%s: the mbarrier at shared offset %u, initialised by thread %u, is used by thread %u before a "
                    "barrier published its init to it (mbarrier.init, then a barrier both threads take part in)",
                    what, offset, m.init_thread, tl_fiber->linear));
    return it->second;
}

// A barrier orders the init before what each thread waiting at it does after it, if one of the
// threads arriving could use the mbarrier already.
void publish_mbarriers(Block& b, const std::vector<bool>* arrived, const std::vector<bool>* waited) {
    for (auto& entry : b.mbarriers) {
        std::vector<bool>& visible = entry.second.visible_to;
        bool seen = !arrived;
        for (size_t t = 0; t < visible.size() && !seen; ++t) seen = visible[t] && (*arrived)[t];
        if (!seen) continue;
        for (size_t t = 0; t < visible.size(); ++t)
            if (!waited || (*waited)[t]) visible[t] = true;
    }
}

// The PTX ISA leaves an init of memory that holds a valid mbarrier undefined, and any other use
// of a valid mbarrier's memory: mbarrier.inval must come first. ptx.cuh has no inval: each kernel
// initialises its mbarriers once and leaves their memory alone (the block's end releases it), which
// mbarrier_at and, at the end, mbarrier_exit_error check.
void mbarrier_init(void* bar, unsigned count) {
    Block* b = tl_block;
    const unsigned offset = mbarrier_offset(bar, "mbarrier.init");
    if (count < 1 || count >= (1u << 20))
        fail(format("mbarrier.init: the arrival count %u is outside [1, 2^20 - 1]", count));
    if (b->mbarriers.count(offset))
        fail(format("mbarrier.init: shared offset %u holds a valid mbarrier already (an init of it is undefined: "
                    "mbarrier.inval first)", offset));
    Mbarrier m{count, count, 0, 0, tl_fiber->linear, std::vector<bool>(b->fibers.size(), false)};
    m.visible_to[tl_fiber->linear] = true;
    b->mbarriers[offset] = std::move(m);
    std::memcpy(b->dynamic_shared + offset, &kMbarrierCanary, 8);
}

std::string mbarrier_exit_error(const Block& b) {
    for (const auto& entry : b.mbarriers) {
        const unsigned offset = entry.first;
        unsigned long long canary;
        std::memcpy(&canary, b.dynamic_shared + offset, 8);
        if (canary != kMbarrierCanary)
            return format("the mbarrier at shared offset %u was overwritten by a store to its 8 bytes (its memory "
                          "used for something else without mbarrier.inval)", offset);
    }
    return "";
}

// The phase completes when every expected arrival came and every announced byte landed: the
// phase number advances (flipping the phase bit) and the waiters on the completed phase go on.
static void mbarrier_try_complete(unsigned offset, Mbarrier& m) {
    if (m.pending || m.tx) return;
    m.phase++;
    m.pending = m.expected;
    for (Fiber& f : tl_block->fibers)
        if (f.state == State::AtMbarrier && f.waits_on == offset && f.waits_for_phase < m.phase) f.state = State::Ready;
}

// The transaction count's range (PTX ISA, "Contents of the mbarrier object"): +-(2^20 - 1).
constexpr long long kTxLimit = (1 << 20) - 1;

static void check_tx_range(const Mbarrier& m, unsigned offset, const char* what) {
    if (m.tx > kTxLimit || m.tx < -kTxLimit)
        fail(format("%s: the transaction count of the mbarrier at shared offset %u would be %lld, outside "
                    "[-(2^20 - 1), 2^20 - 1]", what, offset, m.tx));
}

// expect_tx adds `bytes` to the transaction count; arrive also counts one arrival.
void mbarrier_arrive(void* bar, unsigned expect_tx_bytes, bool arrive, const char* what) {
    const unsigned offset = mbarrier_offset(bar, what);
    Mbarrier& m = mbarrier_at(offset, what);
    if (expect_tx_bytes > kTxLimit) fail(format("%s: %u bytes exceed the transaction count's range", what, expect_tx_bytes));
    m.tx += expect_tx_bytes;
    check_tx_range(m, offset, what);
    if (arrive && m.pending == 0)
        fail(format("%s: an arrival beyond the %u the phase expects (the mbarrier at shared offset %u waits only for "
                    "%lld transaction bytes)", what, m.expected, offset, m.tx));
    if (arrive) m.pending--;
    mbarrier_try_complete(offset, m);
}

// What a TMA copy (by_thread false: its issue checked the mbarrier) or mbarrier.complete_tx does
// when `bytes` of it landed.
static void complete_tx(unsigned offset, unsigned bytes, const char* what, bool by_thread) {
    Mbarrier& m = mbarrier_at(offset, what, by_thread);
    m.tx -= bytes;
    check_tx_range(m, offset, what);
    mbarrier_try_complete(offset, m);
}

void mbarrier_complete_tx(void* bar, unsigned bytes, const char* what) {
    complete_tx(mbarrier_offset(bar, what), bytes, what, true);
}

// The phase a wait with `parity` means to this thread: the one it last saw completed if the
// parity is that one's, else the next. The hardware compares the parity with the phase in
// progress only, so a wait is invalid once the barrier has completed the meant phase and the one
// after it: the same parity then names a later phase (the wait would block for it) or the
// thread skipped a phase. Both are reported. This asks more than the PTX ISA does (a thread that
// deliberately skips phases and waits with the parity of the current one is legal there): it is
// the discipline of a pipeline, where every waiting thread sees every phase of its barriers.
static long long mbarrier_meant_phase(unsigned offset, const Mbarrier& m, unsigned parity, const char* what) {
    auto& seen = tl_fiber->phase_seen;
    const auto it = seen.find(offset);
    const long long last = it == seen.end() ? -1 : it->second;
    const long long meant = (last & 1) == static_cast<long long>(parity & 1) ? last : last + 1;
    if (meant < m.phase - 1)
        fail(format("%s: invalid phase use: parity %u means phase %lld to this thread, but the mbarrier at shared "
                    "offset %u has completed phases up to %lld, so its parity names another phase", what, parity & 1,
                    meant, offset, m.phase - 1));
    return meant;
}

static void tma_land_for(unsigned bar);

// mbarrier.test_wait.parity: whether the meant phase completed, without blocking.
bool mbarrier_test_wait(const void* bar, unsigned parity) {
    const char* what = "mbarrier.test_wait.parity";
    const unsigned offset = mbarrier_offset(bar, what);
    const Mbarrier& m = mbarrier_at(offset, what);
    const long long meant = mbarrier_meant_phase(offset, m, parity, what);
    if (meant >= m.phase) tma_land_for(offset);  // copies still in flight land before a wait that would fail
    if (meant >= m.phase) return false;
    tl_fiber->phase_seen[offset] = meant;
    lane_synced(*tl_block, tl_fiber->linear >> 5);
    return true;
}

// A loop on mbarrier.try_wait.parity: the thread sleeps until the meant phase completed.
void mbarrier_wait(const void* bar, unsigned parity) {
    const char* what = "mbarrier.try_wait.parity";
    const unsigned offset = mbarrier_offset(bar, what);
    const long long meant = mbarrier_meant_phase(offset, mbarrier_at(offset, what), parity, what);
    // Copies still in flight land before a wait that would block; one whose phase already
    // completed (it announced too few bytes) keeps them in flight, and the reads find poison.
    if (meant >= tl_block->mbarriers[offset].phase) tma_land_for(offset);
    Fiber* f = tl_fiber;
    if (meant >= tl_block->mbarriers[offset].phase) {
        f->waits_on = offset;
        f->waits_for_phase = meant;
        f->state = State::AtMbarrier;
        yield_to_scheduler();
        // Woken once the meant phase completed; if the next one has completed too before this
        // thread ran again, a try_wait polling now would see the later phase's parity: a race.
        if (mbarrier_at(offset, what).phase > meant + 1)
            fail(format("%s: invalid phase use: the mbarrier at shared offset %u completed phase %lld and the next one "
                        "before this thread, waiting for the first, ran again", what, offset, meant));
    }
    f->phase_seen[offset] = meant;
    lane_synced(*tl_block, f->linear >> 5);
}

// ---- TMA (cp.async.bulk.tensor) ------------------------------------------------------------------
// A load copies a box of the tensor into shared memory (elements outside the tensor read as 0, or
// as NaN) and completes its bytes on an mbarrier; a store writes the box from shared
// memory (read through the async proxy) to the elements inside the tensor; swizzled boxes land as
// swizzled_offset (emu_async.h) places them. When a copy happens varies by schedule, as the hardware's timing does: at issue in the forward
// and warp schedules, at the first wait on its mbarrier (or the bulk group's wait) in the reverse
// ones, either in the random one; so reading before the wait, or overwriting a stage still read,
// shows on some schedule.

static const EmulatedTensorMap& tensor_map(const void* map, const char* what) {
    const EmulatedTensorMap* m = static_cast<const EmulatedTensorMap*>(map);
    if (reinterpret_cast<uintptr_t>(map) % 64) fail(format("%s: the tensor map is not 64-byte aligned", what));
    if (m->magic != kTensorMapMagic)
        fail(format("%s: the tensor map was not encoded for the emulator (cupy_attn._tensor_map)", what));
    return *m;
}

// Visit every element of a copy's box: fn(shared byte offset, global address or null when outside).
template <class Fn>
static void for_each_box_element(const TmaCopy& c, Fn fn) {
    const EmulatedTensorMap& m = c.map;
    unsigned box[5] = {1, 1, 1, 1, 1};
    for (unsigned d = 0; d < m.rank; ++d) box[d] = m.box[d];
    const unsigned row_bytes = box[0] * m.element_bytes;
    unsigned row = 0;
    for (unsigned i4 = 0; i4 < box[4]; ++i4)
        for (unsigned i3 = 0; i3 < box[3]; ++i3)
            for (unsigned i2 = 0; i2 < box[2]; ++i2)
                for (unsigned i1 = 0; i1 < box[1]; ++i1, ++row)
                    for (unsigned i0 = 0; i0 < box[0]; ++i0) {
                        const unsigned index[5] = {i0, i1, i2, i3, i4};
                        bool inside = true;
                        unsigned long long address = m.address;
                        for (unsigned d = 0; d < m.rank; ++d) {
                            const long long g = static_cast<long long>(c.coords[d]) + index[d];
                            inside = inside && g >= 0 && g < static_cast<long long>(m.dims[d]);
                            address += static_cast<unsigned long long>(g) * (d ? m.strides[d - 1] : m.element_bytes);
                        }
                        const unsigned at = swizzled_offset(c.smem + row * row_bytes + i0 * m.element_bytes, m.swizzle);
                        fn(at, inside ? reinterpret_cast<unsigned char*>(address) : nullptr);
                    }
}

static unsigned box_bytes(const EmulatedTensorMap& m) {
    unsigned bytes = m.element_bytes;
    for (unsigned d = 0; d < m.rank; ++d) bytes *= m.box[d];
    return bytes;
}

static void tma_land(const TmaCopy& c) {
    Block* b = tl_block;
    std::vector<unsigned char>& view = async_view();
    const unsigned bytes = c.map.element_bytes;
    for_each_box_element(c, [&](unsigned at, const unsigned char* src) {
        if (src) std::memcpy(b->dynamic_shared + at, src, bytes);
        else std::memcpy(b->dynamic_shared + at, &c.map.oob_fill, bytes);  // little-endian: its low bytes
        std::memcpy(view.data() + at, b->dynamic_shared + at, bytes);  // written by the async proxy: both views
    });
    complete_tx(c.bar, box_bytes(c.map), "cp.async.bulk.tensor (landing)", false);
}

// Land the pending loads that signal the mbarrier at `bar`.
static void tma_land_for(unsigned bar) {
    std::vector<TmaCopy>& pending = tl_block->tma_loads;
    for (size_t i = 0; i < pending.size();) {
        if (pending[i].bar != bar) { ++i; continue; }
        const TmaCopy c = pending[i];
        pending.erase(pending.begin() + static_cast<long>(i));
        tma_land(c);
    }
}

static TmaCopy tma_copy(const void* map, const int* coords, void* smem, const char* what) {
    const EmulatedTensorMap& m = tensor_map(map, what);
    TmaCopy c{m, {}, shared_offset(smem, what), 0, tl_fiber->bulk_groups_committed, false, false};
    for (unsigned d = 0; d < m.rank; ++d) c.coords[d] = coords[d];
    if (c.smem % 128) fail(format("%s: the shared address %u is not 128-byte aligned", what, c.smem));
    // PTX ISA, "Tensor" / "Bounding Box": the box's address in global memory must be 16-byte
    // aligned, as its size must be a multiple of 16 bytes (the map's checks, _tensor_map.py, hold
    // the address and strides to that; the innermost coordinate is the copy's own). The first H200
    // run's illegal instruction came from a box starting at byte 180 of its line.
    long long first = static_cast<long long>(m.address) + static_cast<long long>(c.coords[0]) * m.element_bytes;
    for (unsigned d = 1; d < m.rank; ++d) first += static_cast<long long>(c.coords[d]) * static_cast<long long>(m.strides[d - 1]);
    if (first % 16)
        fail(format("%s: the box's first element (coordinate %d of the innermost dimension, %lld bytes into its "
                    "line) is not 16-byte aligned in global memory",
                    what, c.coords[0], static_cast<long long>(c.coords[0]) * m.element_bytes));
    if (m.swizzle && c.smem % (8 * m.swizzle))
        fail(format("%s: a %u-byte swizzled box must start at a multiple of %u bytes, not at %u (the kernels' "
                    "rule, not the hardware's: their wgmma descriptors take base offset 0)", what, m.swizzle,
                    8 * m.swizzle, c.smem));
    if (c.smem + box_bytes(m) > tl_block->launch->shared_bytes)
        fail(format("%s: the box's %u bytes at shared offset %u exceed the block's %zu", what, box_bytes(m), c.smem,
                    tl_block->launch->shared_bytes));
    return c;
}

void tma_load(void* smem, const void* map, const int* coords, void* bar) {
    const char* what = "cp.async.bulk.tensor (load)";
    TmaCopy c = tma_copy(map, coords, smem, what);
    c.bar = mbarrier_offset(bar, what);
    mbarrier_at(c.bar, what);
    bool waited_on = false;
    for (const Fiber& f : tl_block->fibers) waited_on |= f.state == State::AtMbarrier && f.waits_on == c.bar;
    if (waited_on || copy_lands_at_issue()) tma_land(c);
    else tl_block->tma_loads.push_back(c);
}

static void tma_write_now(const TmaCopy& c) {
    const std::vector<unsigned char>& view = async_view();
    for_each_box_element(c, [&](unsigned at, unsigned char* dst) {
        if (!dst) return;
        if (!c.add) {
            std::memcpy(dst, view.data() + at, c.map.element_bytes);
            return;
        }
        float value;  // a 4-byte element is float32: the only 4-byte type of cupy_attn's maps
        std::memcpy(&value, view.data() + at, sizeof value);
        atomic_float_update<float>(reinterpret_cast<float*>(dst), [](float x, float y) { return x + y; }, value);
    });
}

void tma_write(const void* map, const int* coords, const void* smem, bool add) {
    const char* what = add ? "cp.reduce.async.bulk.tensor (add)" : "cp.async.bulk.tensor (store)";
    TmaCopy c = tma_copy(map, coords, const_cast<void*>(smem), what);
    if (add && c.map.element_bytes != 4)
        fail(format("%s: the emulator adds float32 elements only, and this map's are %u bytes", what,
                    c.map.element_bytes));
    c.add = add;
    if (copy_lands_at_issue()) {
        tma_write_now(c);
        c.done = true;
    }
    tl_fiber->bulk_stores.push_back(c);
}

// cp.async.bulk.wait_group(.read) pending: the stores of all but the `pending` most recent groups
// have read shared memory (and, here, written global memory too).
void bulk_wait(unsigned pending) {
    Fiber* f = tl_fiber;
    std::vector<TmaCopy> keep;
    for (const TmaCopy& c : f->bulk_stores) {
        if (!(c.group < f->bulk_groups_committed && f->bulk_groups_committed - c.group > pending)) keep.push_back(c);
        else if (!c.done) tma_write_now(c);
    }
    f->bulk_stores.swap(keep);
}

// ---- named barriers ---------------------------------------------------------------------------
// bar.sync / bar.arrive id, count: `count` threads (a multiple of 32) complete a generation;
// bar.sync waits for it, bar.arrive does not. Id 0 is __syncthreads' barrier, which the emulator
// keeps apart, so kernels use 1..15.
void named_barrier(unsigned id, unsigned count, bool wait, const char* file, int line) {
    Block* b = tl_block;
    Fiber* f = tl_fiber;
    const char* what = wait ? "bar.sync" : "bar.arrive";
    if (id < 1 || id > 15) fail(format("%s: barrier id %u is not in 1..15 (0 is __syncthreads')", what, id));
    if (count < 32 || count % 32 || count > b->fibers.size())
        fail(format("%s %u: the thread count %u is not a multiple of 32 in [32, %zu]", what, id, count, b->fibers.size()));
    NamedBarrier& nb = b->named[id];
    if (nb.arrived == 0) {
        nb.count = count;
        nb.arrivals.assign(b->fibers.size(), false);
        nb.warp_sites.assign((b->fibers.size() + 31) / 32, NamedBarrier::Site{false, nullptr, 0});
    } else if (nb.count != count) {
        fail(format("%s %u: this thread arrives with count %u while %u thread(s) arrived with count %u", what, id, count,
                    nb.arrived, nb.count));
    }
    if (nb.arrivals[f->linear])
        fail(format("%s %u: this thread arrives a second time before the barrier completed (%u of %u arrived)", what,
                    id, nb.arrived, nb.count));
    // .aligned (PTX ISA, bar / barrier): a warp's lanes execute the same barrier instruction.
    NamedBarrier::Site& site = nb.warp_sites[f->linear / 32];
    if (!site.file) {
        site = NamedBarrier::Site{wait, file, line};
    } else if (site.wait != wait || site.line != line || std::strcmp(site.file, file)) {
        fail(format("%s %u: lanes of warp %u reach different barrier instructions (%s at %s:%d, this lane %s at %s:%d); "
                    "bar.sync and bar.arrive are .aligned: every lane of a warp must execute the same one", what, id,
                    f->linear / 32, site.wait ? "bar.sync" : "bar.arrive", site.file, site.line, what, file, line));
    }
    nb.arrivals[f->linear] = true;
    if (++nb.arrived == nb.count) {
        nb.arrived = 0;
        std::vector<bool> waited(b->fibers.size(), false);  // bar.arrive's threads go on without waiting
        waited[f->linear] = wait;
        for (Fiber& other : b->fibers)
            if (other.state == State::AtNamedBarrier && other.waits_on == id) {
                waited[other.linear] = true;
                other.state = State::Ready;
            }
        publish_mbarriers(*b, &nb.arrivals, &waited);
        // A warp whose every lane waited here (bar.sync, not bar.arrive) has its lanes ordered.
        for (unsigned warp = 0; warp < b->warp_syncs.size(); ++warp) {
            const unsigned first = 32 * warp, last = std::min<unsigned>(first + 32, b->fibers.size());
            bool whole = true;
            for (unsigned t = first; t < last && whole; ++t) whole = waited[t];
            if (whole) lane_synced(*b, warp);
        }
        return;
    }
    if (!wait) return;
    f->waits_on = id;
    f->state = State::AtNamedBarrier;
    yield_to_scheduler();
}

// ---- elect.sync -------------------------------------------------------------------------------
// The PTX ISA promises one leader among the mask's lanes, the same for the same mask, but not
// which: the emulator picks it from the mask and the launch's seed, so code that assumes lane 0
// fails on some seed.
struct ElectOperand {
    unsigned leader;
};

static void elect_fn(void* const* lanes, unsigned mask) {
    const int members = __builtin_popcount(mask);
    unsigned long long h = (tl_block->launch->seed + 1) * 0x9e3779b97f4a7c15ull ^ mask;
    h ^= h >> 29;
    int pick = static_cast<int>(h % static_cast<unsigned long long>(members));
    unsigned leader = 0;
    for (int l = 0; l < 32; ++l)
        if (mask >> l & 1u && pick-- == 0) { leader = static_cast<unsigned>(l); break; }
    for (int l = 0; l < 32; ++l)
        if (mask >> l & 1u) static_cast<ElectOperand*>(lanes[l])->leader = leader;
}

bool elect(unsigned mask) {
    ElectOperand op{0};
    warp_collective(mask, &op, elect_fn, "elect.sync");
    return op.leader == lane_id();
}

// ---- setmaxnreg -------------------------------------------------------------------------------
// All four warps of a warpgroup execute the same setmaxnreg: .dec lowers the warp's registers per
// thread to `count` and returns them to the block's pool, .inc raises it to `count` with
// registers from the pool, waiting until the pool has them. The pool is what the launch gave the
// block: under __launch_bounds__(threads, 1), 65536 / threads per thread rounded down to 8, which
// every warp holds until its first setmaxnreg (ptxas may allocate less, which the emulator cannot
// see: the compile report checks the kernels' counts, and the launcher again on the GPU; nor does
// it know a warp's count before its first setmaxnreg, but none holds more). A warp that exits
// keeps its registers here: the PTX ISA does not say that they return to the pool. So a split
// that does not fit, or an .inc whose .dec never comes, deadlocks, as it hangs on the GPU.
// The legal counts (24..256, multiples of 8) are checked at compile time by ptx.cuh.
constexpr unsigned kRegisterFile = 65536;

static unsigned launch_registers_per_thread(size_t threads) {
    return static_cast<unsigned>(std::min<size_t>(256, kRegisterFile / threads / 8 * 8));
}

// The block's pool: every thread at the launch's count.
static unsigned long long register_pool(const Block& b) {
    return b.fibers.size() * launch_registers_per_thread(b.fibers.size());
}

// A warp's registers per thread, counted at the launch's until its first setmaxnreg.
static unsigned registers_per_thread(const Block& b, size_t warp) {
    return b.warp_registers[warp] ? b.warp_registers[warp] : launch_registers_per_thread(b.fibers.size());
}

// Registers the block's warps hold, with `warp` at `count` per thread.
static unsigned long long registers_held(const Block& b, size_t warp, unsigned count) {
    unsigned long long total = 0;
    for (size_t w = 0; w < b.warp_registers.size(); ++w) total += 32ull * (w == warp ? count : registers_per_thread(b, w));
    return total;
}

// Give waiting .inc requests, in warp order, what the pool now has.
static void grant_register_requests(Block& b) {
    for (size_t w = 0; w < b.warp_registers.size(); ++w) {
        const unsigned count = b.warp_register_requests[w];
        if (!count || registers_held(b, w, count) > register_pool(b)) continue;
        b.warp_registers[w] = count;
        b.warp_register_requests[w] = 0;
        for (size_t t = 32 * w; t < 32 * w + 32; ++t)
            if (b.fibers[t].state == State::AtRegisters) b.fibers[t].state = State::Ready;
    }
}

struct SetMaxRegistersOperand {
    unsigned count;
    bool increase;
};

static void set_max_registers_fn(void* const* lanes, unsigned) {
    Block* b = tl_block;
    const SetMaxRegistersOperand& op = *static_cast<const SetMaxRegistersOperand*>(lanes[0]);
    for (int l = 1; l < 32; ++l) {
        const auto* other = static_cast<const SetMaxRegistersOperand*>(lanes[l]);
        if (other->count != op.count || other->increase != op.increase)
            fail("setmaxnreg: the lanes of a warp execute different setmaxnreg instructions");
    }
    const unsigned warp = tl_fiber->linear / 32;
    const WarpgroupInstruction first = warpgroup_instruction(kSetMaxRegisters, {{op.count, op.increase, 0}});
    if (first.fields[0] != op.count || first.fields[1] != op.increase)
        fail(format("setmaxnreg: warps of warpgroup %u execute setmaxnreg.%s %llu and setmaxnreg.%s %u", warp / 4,
                    first.fields[1] ? "inc" : "dec", first.fields[0], op.increase ? "inc" : "dec", op.count));
    // The PTX ISA: the warpgroup's warps synchronise between one setmaxnreg and the next, so none
    // may start its next before all executed this one (a schedule running a warp ahead shows it).
    const WarpgroupSequence& seq = b->warpgroup_sequences[{kSetMaxRegisters, warp / 4}];
    const unsigned long long index = seq.executed[warp % 4] - 1;
    for (unsigned w = 0; w < 4; ++w)
        if (seq.executed[w] < index)
            fail(format("setmaxnreg: warp %u executes its warpgroup's setmaxnreg number %llu before warp %u executed "
                        "number %llu (the warpgroup must synchronise between them)", warp, index + 1, 4 * (warp / 4) + w,
                        index));
    const unsigned current = b->warp_registers[warp], launch = launch_registers_per_thread(b->fibers.size());
    if (current && (op.increase ? op.count < current : op.count > current))
        fail(format("setmaxnreg.%s %u: warp %u holds %u registers per thread already", op.increase ? "inc" : "dec",
                    op.count, warp, current));
    if (!current && !op.increase && op.count > launch)
        fail(format("setmaxnreg.dec %u: warp %u holds at most the launch's %u registers per thread", op.count, warp,
                    launch));
    if (op.increase) {
        b->warp_register_requests[warp] = op.count;  // granted now if the pool has them
    } else {
        b->warp_registers[warp] = op.count;
    }
    grant_register_requests(*b);
}

void set_max_registers(unsigned count, bool increase) {
    Block* b = tl_block;
    if (b->fibers.size() % 128)
        fail(format("setmaxnreg: the block's %zu threads are not whole warpgroups of 128", b->fibers.size()));
    if (b->warp_registers.empty()) {
        b->warp_registers.assign(b->fibers.size() / 32, 0);
        b->warp_register_requests.assign(b->fibers.size() / 32, 0);
    }
    SetMaxRegistersOperand op{count, increase};
    warp_collective(0xffffffffu, &op, set_max_registers_fn, "setmaxnreg");
    while (b->warp_register_requests[tl_fiber->linear / 32]) {
        tl_fiber->state = State::AtRegisters;
        yield_to_scheduler();
    }
}

// ---- deadlock report ----------------------------------------------------------------------------
std::string async_waits_report(const Block& b) {
    std::string report;
    for (const auto& [offset, m] : b.mbarriers) {
        std::string threads;
        long long phase = 0;
        for (const Fiber& f : b.fibers)
            if (f.state == State::AtMbarrier && f.waits_on == offset) {
                threads += (threads.empty() ? "" : ", ") + std::to_string(f.linear);
                phase = f.waits_for_phase;
            }
        if (!threads.empty())
            report += format(" thread(s) [%s] wait for phase %lld of the mbarrier at shared offset %u (%u of %u "
                             "arrivals pending, transaction count %lld);", threads.c_str(), phase, offset, m.pending,
                             m.expected, m.tx);
    }
    for (size_t w = 0; w < b.warp_register_requests.size(); ++w)
        if (b.warp_register_requests[w])
            report += format(" warp %zu waits in setmaxnreg.inc %u: the block's warps hold %llu of the launch's %llu "
                             "registers (%u per thread of %zu) and no setmaxnreg.dec will return them;", w,
                             b.warp_register_requests[w], registers_held(b, w, registers_per_thread(b, w)),
                             register_pool(b),
                             launch_registers_per_thread(b.fibers.size()), b.fibers.size());
    for (unsigned id = 1; id < 16; ++id) {
        std::string threads;
        for (const Fiber& f : b.fibers)
            if (f.state == State::AtNamedBarrier && f.waits_on == id)
                threads += (threads.empty() ? "" : ", ") + std::to_string(f.linear);
        if (!threads.empty())
            report += format(" thread(s) [%s] wait at named barrier %u (%u of %u arrived);", threads.c_str(), id,
                             b.named[id].arrived, b.named[id].count);
    }
    return report;
}

}  // namespace emu
