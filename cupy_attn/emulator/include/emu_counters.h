// Memory-access counters (cupy_attn.emulator.counting): shared-memory wavefronts and global
// 32-byte sectors of each warp-wide access made through the kernels' counted helpers, against the
// conflict-free (or fully coalesced) minimum.
//
// Lanes of a fiber run one after another, so a warp-wide access is rebuilt afterwards: the n-th
// access a lane makes at one source line (file, line, space) meets the n-th access of the other
// lanes of its warp there. Bank rules as on sm_80/sm_90: 32 banks of 4 bytes; a warp's access is
// served in phases of 128 bytes (all 32 lanes for accesses up to 4 bytes, half-warps for 8-byte
// and quarter-warps for 16-byte accesses); a phase takes as many wavefronts as the most distinct
// 4-byte words any one bank holds (lanes reading one word share it: a broadcast), and at least
// ceil(words / 32).
#pragma once
#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace emu {

enum Space : int { kShared = 0, kGlobal = 1 };

struct Access {
    const char* file;
    int line;
    int space;
    unsigned occurrence;  // this lane's how-manyth access at (file, line, space)
    unsigned lane;
    uintptr_t address;    // shared: offset into the block's shared memory
    unsigned bytes;
};

struct AccessLog {
    std::vector<Access> accesses;
    std::map<std::tuple<const char*, int, int>, unsigned> seen;
};

struct CostPair {
    unsigned long long actual = 0, ideal = 0;
};

struct LaneAccess {
    unsigned lane;
    uintptr_t address;
    unsigned bytes;
};

// Wavefronts one warp-wide shared-memory access takes, and the fewest it could.
inline CostPair shared_wavefronts(const std::vector<LaneAccess>& lanes) {
    unsigned widest = 4;
    for (const LaneAccess& a : lanes) widest = std::max(widest, a.bytes);
    const unsigned lanes_per_phase = 128 / std::min(widest, 16u);
    std::map<unsigned, std::set<uintptr_t>> words_by_phase;
    for (const LaneAccess& a : lanes)
        for (uintptr_t w = a.address / 4; w <= (a.address + a.bytes - 1) / 4; ++w) words_by_phase[a.lane / lanes_per_phase].insert(w);
    CostPair cost;
    for (const auto& [phase, words] : words_by_phase) {
        unsigned per_bank[32] = {};
        unsigned most = 0;
        for (uintptr_t w : words) most = std::max(most, ++per_bank[w % 32]);
        cost.actual += most;
        cost.ideal += (words.size() + 31) / 32;
    }
    return cost;
}

// 32-byte sectors one warp-wide global access touches, and the fewest its distinct bytes need.
inline CostPair global_sectors(const std::vector<LaneAccess>& lanes) {
    std::set<uintptr_t> sectors;
    std::vector<std::pair<uintptr_t, uintptr_t>> spans;
    for (const LaneAccess& a : lanes) {
        for (uintptr_t s = a.address / 32; s <= (a.address + a.bytes - 1) / 32; ++s) sectors.insert(s);
        spans.emplace_back(a.address, a.address + a.bytes);
    }
    std::sort(spans.begin(), spans.end());
    unsigned long long distinct = 0;
    uintptr_t covered = 0;
    for (const auto& [begin, end] : spans) {
        uintptr_t from = std::max(begin, covered);
        if (end > from) distinct += end - from;
        covered = std::max(covered, end);
    }
    return CostPair{sectors.size(), (distinct + 31) / 32};
}

struct SiteTotals {
    unsigned long long accesses = 0;  // warp-wide
    unsigned long long lanes = 0;     // lane accesses in them
    CostPair cost;                    // wavefronts (shared) or sectors (global)

    void add(unsigned long long more_accesses, unsigned long long more_lanes, CostPair more) {
        accesses += more_accesses;
        lanes += more_lanes;
        cost.actual += more.actual;
        cost.ideal += more.ideal;
    }
};

using CounterTable = std::map<std::tuple<std::string, int, int>, SiteTotals>;

// Fold one warp's lane logs (index = lane) into `table`.
inline void count_warp(const std::vector<const AccessLog*>& lane_logs, CounterTable& table) {
    std::map<std::tuple<const char*, int, int, unsigned>, std::vector<LaneAccess>> warp_accesses;
    for (const AccessLog* log : lane_logs)
        for (const Access& a : log->accesses)
            warp_accesses[{a.file, a.line, a.space, a.occurrence}].push_back(LaneAccess{a.lane, a.address, a.bytes});
    for (const auto& [key, lanes] : warp_accesses) {
        const auto& [file, line, space, occurrence] = key;
        table[{file, line, space}].add(1, lanes.size(), space == kShared ? shared_wavefronts(lanes) : global_sectors(lanes));
    }
}

}  // namespace emu
