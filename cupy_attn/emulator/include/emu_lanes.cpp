// The order of a warp's lanes' accesses to shared memory (emu_lanes.h): compiled into the
// emulator's runtime library with emu_runtime.cpp.
#include "emu_lanes.h"

#include <string>
#include <vector>

#include "emu_runtime.h"

namespace emu {

namespace {

// What one byte of shared memory saw last: the thread that stored it and the lanes that loaded it
// since, each with the synchronisation count of its warp then, and where.
struct ByteHistory {
    int writer = -1;
    unsigned long long write_sync = 0;
    unsigned readers = 0;  // lanes, all of the warp whose count is read_sync
    unsigned long long read_sync = 0;
    unsigned last_reader = 0;  // the lane of read_file:read_line
    int write_line = 0, read_line = 0;
    const char* write_file = "";
    const char* read_file = "";
};

// Per worker thread, reused by its blocks without clearing: the counts only grow (a block's warps
// start with new ones), so a byte's history from an earlier block or an earlier phase of this one
// never matches a warp's count now.
thread_local std::vector<ByteHistory> tl_history;
thread_local unsigned long long tl_next_sync = 0;

ByteHistory* history(const void* address, unsigned bytes) {
    Block* b = tl_block;
    const unsigned char* at = static_cast<const unsigned char*>(address);
    if (!b || at < b->dynamic_shared || at + bytes > b->dynamic_shared + b->launch->shared_bytes) return nullptr;
    if (tl_history.size() < b->launch->shared_bytes) tl_history.resize(b->launch->shared_bytes);
    return tl_history.data() + (at - b->dynamic_shared);
}

// other_line 0: other_file says where in words (the site is not kept).
[[noreturn]] void unordered(const char* access, unsigned offset, const char* file, int line, unsigned other_lane,
                            const char* other_access, const char* other_file, int other_line) {
    const unsigned thread = tl_fiber->linear;
    const std::string other_site = other_line ? format("%s:%d", other_file, other_line) : std::string(other_file);
    fail(format("lane %u of warp %u %s shared memory at offset %u (%s:%d), which lane %u of the same warp %s (%s) "
                "since the warp's last __syncwarp or barrier: a warp's lanes are ordered by __syncwarp, not by "
                "program order or a warp-collective instruction (compute-sanitizer's racecheck reports this)",
                thread & 31u, thread >> 5, access, offset, file, line, other_lane, other_access, other_site.c_str()));
}

// A load checks the byte's last store; a store checks it and the loads since.
void lane_access(const void* address, unsigned bytes, const char* file, int line, bool store) {
    ByteHistory* h = history(address, bytes);
    if (!h) return;
    const unsigned thread = tl_fiber->linear, lane = thread & 31u;
    const unsigned long long sync = tl_block->warp_syncs[thread >> 5];
    const unsigned offset = static_cast<unsigned>(static_cast<const unsigned char*>(address) - tl_block->dynamic_shared);
    const char* access = store ? "stores to" : "loads";
    for (unsigned i = 0; i < bytes; ++i, ++h) {
        if (h->write_sync == sync && h->writer != static_cast<int>(thread))
            unordered(access, offset + i, file, line, static_cast<unsigned>(h->writer) & 31u, "stored", h->write_file,
                      h->write_line);
        if (!store) {
            if (h->read_sync != sync) h->readers = 0, h->read_sync = sync;
            h->readers |= 1u << lane;
            h->last_reader = lane, h->read_file = file, h->read_line = line;
            continue;
        }
        const unsigned others = h->read_sync == sync ? h->readers & ~(1u << lane) : 0u;
        if (others >> h->last_reader & 1u)
            unordered(access, offset + i, file, line, h->last_reader, "loaded", h->read_file, h->read_line);
        if (others)  // the last load was this lane's own: another lane's was earlier, its site not kept
            unordered(access, offset + i, file, line, static_cast<unsigned>(__builtin_ctz(others)), "loaded",
                      "an earlier load", 0);
        h->writer = static_cast<int>(thread), h->write_sync = sync, h->write_file = file, h->write_line = line;
        h->readers = 0;
    }
}

}  // namespace

void lanes_synced(Block& b) {
    b.warp_syncs.resize(b.warps.size());
    for (unsigned long long& sync : b.warp_syncs) sync = ++tl_next_sync;
}

void lane_synced(Block& b, unsigned warp) { b.warp_syncs[warp] = ++tl_next_sync; }

void lane_store(const void* address, unsigned bytes, const char* file, int line) {
    lane_access(address, bytes, file, line, true);
}

void generic_load(const void* address, unsigned bytes, const char* file, int line) {
    count_access(kShared, address, bytes, file, line);
    lane_access(address, bytes, file, line, false);
}

}  // namespace emu
