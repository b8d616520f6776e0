// Which rows and keys one thread block works on, and which key tiles it may skip.
#pragma once
#include "tile_io.cuh"

namespace attn {

// The problem as the kernels see it. Strides are in elements; the last dimension of q, k, v and
// out is contiguous. Lengths and ALiBi slopes are always given (full lengths, zero slopes when
// unused) so the kernels need no null checks.
//
// Two ways to lay out a batch. Padded (packed = 0): entry b starts at b · batch stride and owns
// seq_q query and seq_k key rows; rows past its lengths are padding, and outputs are written
// for them (0). Packed (packed = 1, variable-length): entry b owns the rows [q_starts[b],
// q_starts[b] + q_lengths[b]) of a (total_q, H, D) tensor (keys likewise), and rows past its
// lengths belong to the next sequence: they are never read nor written. The launcher then
// passes the row stride as the batch stride, so an entry starts at q_starts[b] · batch stride
// in both layouts (one product per tensor, as padded). seq_q, seq_k are the longest lengths
// (they size the grid); row statistics (lse, delta, dQ) are (H, total_q) and the per-query-head
// dK, dV are (H, total_k).
// Which layout a module is built for (-DATTN_PACKED, chosen per call by the launcher): the
// padded build carries no trace of the packed one (its offsets come from blockIdx and
// parameters alone, which ptxas rematerialises instead of holding them across the hot loop).
// Whether the module carries a score_mod or mask_mod (kernels/mask.cuh): then every kernel takes
// one more argument, mod_words, after the others.
#ifndef ATTN_MODS
#define ATTN_MODS 0
#endif
#if ATTN_MODS
#define ATTN_MOD_PARAM , const long long *mod_words
#define ATTN_MOD_FIELD , mod_words
#else
#define ATTN_MOD_PARAM
#define ATTN_MOD_FIELD
#endif

// Whether the module takes a block mask (cupy_attn.block_mask): per (batch entry, head), for this
// kernel's tile sizes, the first non-empty key tile at or after each key tile of each query tile
// (block_kv_next), the same for the query tiles of each key tile (block_q_next), and its full
// tiles; a block's TileWalk steps over the empty ones. Other modules carry no trace of it.
#ifndef ATTN_BLOCK_MASK
#define ATTN_BLOCK_MASK 0
#endif
#if ATTN_BLOCK_MASK
#define ATTN_BLOCK_PARAM \
    , const int *block_kv_next, const int *block_q_next, const unsigned char *block_full, int block_m_tiles, \
        int block_n_tiles
#define ATTN_BLOCK_FIELD , block_kv_next, block_q_next, block_full, block_m_tiles, block_n_tiles
#else
#define ATTN_BLOCK_PARAM
#define ATTN_BLOCK_FIELD
#endif

#ifndef ATTN_PACKED
#define ATTN_PACKED 0
#endif
constexpr bool kPacked = ATTN_PACKED;

struct Params {
    const int* q_lengths;        // (B,)
    const int* kv_lengths;       // (B,)
    const int* q_starts;         // (B,) first row of each entry; read only when packed
    const int* kv_starts;        // (B,)
    int packed, total_q, total_k;
    const float* alibi_slopes;   // (B, H), contiguous
    const float* sinks;          // (H,) natural-log logits; read only when has_sinks
    const void* mask;            // bool (uint8) or float32: batch, head and query strides, keys contiguous
    int heads;
    unsigned heads_magic;        // pair / heads = umulhi(2 · pair, heads_magic) >> heads_shift
    int heads_shift;             //   (cupy_attn/_schedule.py, division_magic)
    int kv_group, seq_q, seq_k, head_dim, head_dim_v;
    long long mask_stride_b, mask_stride_h, mask_stride_q;  // elements, 0 on broadcast axes
    int mask_kind;               // 0 none, 1 bool (True = may attend), 2 additive float
    int causal;                  // 0 none, 1 bottom-right, 2 top-left
    int window_left, window_right;  // -1: unbounded
    int has_alibi, has_sinks;
    float scale, softcap;        // softcap 0: off
    unsigned long long dropout_seed;           // kernels/dropout.cuh
    unsigned dropout_offset, dropout_threshold;  // threshold 0: no dropout
    float dropout_scale;                       // 1 / (1 − p)
#if ATTN_MODS
    const long long* mod_words;  // the mods' tensor addresses and strides, and scalars
#endif
#if ATTN_BLOCK_MASK
    const int* block_kv_next;    // (B, H, block_m_tiles, block_n_tiles): the first non-empty key tile at or after each
    const int* block_q_next;     // (B, H, block_n_tiles, block_m_tiles): the first non-empty query tile at or after each
    const unsigned char* block_full;  // (B, H, block_m_tiles, block_n_tiles): 1 where the mask_mod allows every pair
    int block_m_tiles, block_n_tiles;
#endif
};

enum { kMaskNone = 0, kMaskBool = 1, kMaskFloat = 2 };
enum { kCausalNone = 0, kCausalBottomRight = 1, kCausalTopLeft = 2 };
// What a tile's scores must be checked for (BlockInfo::tile_checks, ScoreTransform).
enum { kCheckStructure = 1, kCheckMods = 2 };

// 1 only in the SASS audit's model of a boundary tile (cupy_attn/_compile.py
// BOUNDARY_MODEL_OPTIONS): every tile taken as a boundary tile, so that the hot loop's fastest
// path is the masked copy's. Never set in a build that runs.
#ifndef ATTN_BOUNDARY_TILES
#define ATTN_BOUNDARY_TILES 0
#endif

// The keys one query row attends, or the rows that attend one key: [begin, end), empty when
// end <= begin (BlockInfo::key_band, query_band).
struct Band {
    int begin, end;
    __device__ __forceinline__ bool contains(int x) const { return begin <= x && x < end; }
};

// The tiles one block visits along its row of tiles, in order: the key tiles of a query tile
// (BlockInfo::key_walk) or the query tiles of a key tile (row_walk). The structure (causal, window,
// lengths) leaves [begin, end); in a block-mask build the tiles inside it that the block mask finds
// empty (no pair allowed, so skipping them changes nothing but the time) are stepped over through
// its table of the next non-empty tile, one load per visit, so that a mask costs time in proportion
// to its non-empty tiles wherever they lie. A plain build's walk is the counted loop over
// [begin, end) it stands for, whose stages go by the tile's own index (pipeline_stage); a
// block-mask build's visits are not consecutive tiles, so it counts them.
struct TileWalk {
    int tile;  // the tile visited now (end or more once none is left)
    int begin, end;
#if ATTN_BLOCK_MASK
    const int* next;  // next[t]: the first non-empty tile at or after t (the row's tile count where none)
    int visit;        // tiles visited before this one
#endif

    __device__ __forceinline__ bool more() const { return tile < end; }
    // The tile visited after this one: end or more when none is left.
    __device__ __forceinline__ int after() const {
#if ATTN_BLOCK_MASK
        return tile + 1 < end ? next[tile + 1] : end;
#else
        return tile + 1;
#endif
    }
    __device__ __forceinline__ bool last() const { return after() >= end; }
    __device__ __forceinline__ void advance() {
        tile = after();
#if ATTN_BLOCK_MASK
        ++visit;
#endif
    }
    // Tiles visited before this one.
    __device__ __forceinline__ int visits() const {
#if ATTN_BLOCK_MASK
        return visit;
#else
        return tile - begin;
#endif
    }
    // The buffer, of kStages taken in turn, of this tile and of the one after.
    template <int kStages>
    __device__ __forceinline__ int stage() const {
#if ATTN_BLOCK_MASK
        return pipeline_stage<kStages>(visit);
#else
        return pipeline_stage<kStages>(tile);
#endif
    }
    template <int kStages>
    __device__ __forceinline__ int stage_after() const {
#if ATTN_BLOCK_MASK
        return pipeline_stage<kStages>(visit + 1);
#else
        return pipeline_stage<kStages>(tile + 1);
#endif
    }
};

// Where a block of a tensor-core kernel works: its tile (of query rows or of keys), head and batch
// entry. A GPU starts a grid's blocks in the order of their linear index (x fastest), and the
// launcher shapes the grid so that that order serves two ends (cupy_attn/_schedule.py):
// - the tail: under a causal mask a later query tile visits more key tiles and an earlier key tile
//   more query tiles, and a heavy block started last keeps its SM busy while the others idle; so
//   the heaviest tiles start first (longest processing time first, as FlashAttention-3 orders its
//   query tiles): query tiles from the last, key tiles from the first;
// - the L2: the blocks of one (batch entry, head) pair all read its K and V (query tiles) or its
//   Q, dO, lse and delta (key tiles); so the pairs go in sections, sized so that a section's
//   shared rows fit the L2 together, and a section's blocks start before the next section's.
// The grid is (pairs per section, tiles, sections): x the pair within its section, y the tile's
// rank, z the section. The place comes from blockIdx and parameters through a multiply-high and a
// shift (the division by the head count, its magic number worked out by the launcher), short
// enough for ptxas to recompute where it needs the values rather than hold them across the hot
// loop: with a division, or a decode from the linear index, ptxas held them and spilled at D = 256
// (4-52 bytes in the wgmma forward with features, NVRTC 13.5). Kernels where even this spilled keep
// the grid (tiles, heads, batch entries), grid_place: the CUDA-core ones (the fp32 forward at its
// 128 registers) and the mma.sync dK/dV above D = 128 (36 bytes at D = 256 on sm_90).
struct BlockPlace {
    int tile, head, batch;
};

// The place of block (x, y, z) of a sectioned grid of `pairs` x `tiles` x sections.
template <bool kLastTileFirst>
__device__ __forceinline__ BlockPlace sectioned_place(const Params& p, unsigned x, unsigned y, unsigned z,
                                                      unsigned pairs, unsigned tiles) {
    const unsigned pair = z * pairs + x;  // batch entry · heads + head, < 2^31
    const unsigned batch = __umulhi(2 * pair, p.heads_magic) >> p.heads_shift;  // pair / heads
    return BlockPlace{static_cast<int>(kLastTileFirst ? tiles - 1 - y : y), static_cast<int>(pair - batch * p.heads),
                      static_cast<int>(batch)};
}
// The tensor-core forwards and dQ kernel: query tiles, the last first.
__device__ __forceinline__ BlockPlace query_block_place(const Params& p) {
    return sectioned_place<true>(p, blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.y);
}
// The tensor-core dK/dV kernels up to D = 128: key tiles, the first first.
__device__ __forceinline__ BlockPlace key_block_place(const Params& p) {
    return sectioned_place<false>(p, blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.y);
}

// A persistent kernel's work: the blocks of the sectioned grid (pairs, tiles, sections) the
// launcher would have started, as work tiles in the order the GPU would have started them. Its
// blocks (one per SM) start with their own (block i work tile i) and each claims its next one on
// a counter as it nears the end of its current one (claim): so the tiles go, the heaviest first,
// to the blocks that free first, as a grid's blocks go to the SMs that free first, and the order
// serves the tail and the L2 as above, while a block's next tile reuses its barriers, its shared
// memory and its start (FlashAttention-3's persistent kernels and their dynamic scheduler). A
// fixed turn (block i tiles i, i + gridDim.x, ...) would not do under a causal mask: in the
// sectioned order some blocks meet the heaviest tile of every section (bench/schedule_model.py).
struct WorkTiles {
    unsigned pairs, tiles, total;  // the sectioned grid's x and y extents, and its block count (< 2^31)
    unsigned* claims;              // work tiles claimed past the launch's own: zeroed per launch

    // Work tile w's query tile (the last first), head and batch entry.
    __device__ __forceinline__ BlockPlace query_place(const Params& p, unsigned w) const {
        const unsigned per_section = pairs * tiles;
        const unsigned z = w / per_section, in_section = w - z * per_section;
        const unsigned y = in_section / pairs;
        return sectioned_place<true>(p, in_section - y * pairs, y, z, pairs, tiles);
    }
    // The first work tile no block has claimed yet, and this block's now; >= total once all are.
    // One thread of a block claims for it. (Claims past total stay below 2 x 2^31: one per block.)
    __device__ __forceinline__ unsigned claim() const { return gridDim.x + atomicAdd(claims, 1u); }
};
// The grid (tiles, heads, batch entries).
__device__ __forceinline__ BlockPlace grid_place() {
    return BlockPlace{static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
}

// A range [begin, end) of tile indices (empty when end <= begin).
struct TileSpan {
    int begin, end;
    __device__ __forceinline__ bool contains(int tile) const { return begin <= tile && tile < end; }
};

// a / b rounded towards -inf, for b > 0 (C++ division rounds towards 0).
__device__ __forceinline__ int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// How far right of the diagonal a row may look: min(window right, 0 if causal); -1 if unbounded.
__device__ __forceinline__ int right_reach(const Params& p) {
    if (!p.causal) return p.window_right;
    return p.window_right >= 0 ? min(0, p.window_right) : 0;
}

// One (head, batch entry): its valid lengths and diagonal offset, and which tiles of it are
// worth visiting.
struct BlockInfo {
    int bidh, bidb, bidh_kv;
    int q_len, kv_len;
    int diag_offset;  // query i lines up with key i + diag_offset

    __device__ __forceinline__ BlockInfo(const Params& p, int bidh_, int bidb_)
        : bidh(bidh_), bidb(bidb_), bidh_kv(bidh_ / p.kv_group) {
        if (p.packed != kPacked) __trap();  // a module built for the other batch layout
        q_len = p.q_lengths[bidb];
        kv_len = p.kv_lengths[bidb];
        diag_offset = p.causal == kCausalTopLeft ? 0 : kv_len - q_len;
    }

    // What the batch stride multiplies: the entry (padded) or its first row (packed).
    __device__ __forceinline__ int q_origin(const Params& p) const { return kPacked ? p.q_starts[bidb] : bidb; }
    __device__ __forceinline__ int kv_origin(const Params& p) const { return kPacked ? p.kv_starts[bidb] : bidb; }

    // First row of this (entry, head) in the row statistics (lse, delta, dQ): (B, H, Sq) padded,
    // (H, total_q) packed.
    __device__ __forceinline__ long long stats(const Params& p) const {
        return kPacked ? static_cast<long long>(bidh) * p.total_q + q_origin(p)
                       : (static_cast<long long>(bidb) * p.heads + bidh) * p.seq_q;
    }

    // Rows of the entry that are in memory, read (tiles zero-filled past them) and written:
    // padding rows included (written as 0) in a padded batch; in a packed one the rows past a
    // length are the next sequence's, never touched.
    __device__ __forceinline__ int q_rows(const Params& p) const { return kPacked ? q_len : p.seq_q; }
    __device__ __forceinline__ int kv_rows(const Params& p) const { return kPacked ? kv_len : p.seq_k; }

    // First row of this (entry, head) in the per-query-head dK, dV: (B, H, Sk) padded, (H,
    // total_k) packed.
    __device__ __forceinline__ long long key_stats(const Params& p) const {
        return kPacked ? static_cast<long long>(bidh) * p.total_k + kv_origin(p)
                       : (static_cast<long long>(bidb) * p.heads + bidh) * p.seq_k;
    }

    // The same in a per-kv-head dK, dV, which a GQA group's query heads add to: (B, Hkv, Sk)
    // padded, (Hkv, total_k) packed.
    __device__ __forceinline__ long long kv_key_stats(const Params& p) const {
        return kPacked ? static_cast<long long>(bidh_kv) * p.total_k + kv_origin(p)
                       : (static_cast<long long>(bidb) * (p.heads / p.kv_group) + bidh_kv) * p.seq_k;
    }

    // The keys row i attends: inside the lengths (none for a row past q_len), the causal diagonal
    // and the window, i + off - left <= j <= i + off + right.
    __device__ __forceinline__ Band key_band(const Params& p, int i) const {
        const int diag = i + diag_offset;
        Band band{p.window_left >= 0 ? diag - p.window_left : 0, i < q_len ? kv_len : 0};
        const int right = right_reach(p);
        if (right >= 0) band.end = min(band.end, diag + right + 1);
        return band;
    }

    // The rows that attend key j: key_band's condition solved for i, j - off - right <= i <=
    // j - off + left, inside the lengths (none for a key past kv_len).
    __device__ __forceinline__ Band query_band(const Params& p, int j) const {
        const int right = right_reach(p);
        Band band{right >= 0 ? j - diag_offset - right : 0, j < kv_len ? q_len : 0};
        if (p.window_left >= 0) band.end = min(band.end, j - diag_offset + p.window_left + 1);
        return band;
    }

    // Keys [*begin, *end) that any of the rows [m0, m0 + block_m) may attend.
    __device__ __forceinline__ void key_range(const Params& p, int m0, int block_m, int* begin, int* end) const {
        int m_last = min(m0 + block_m, q_len) - 1;  // last valid row; < m0 for a tile of padding
        *begin = p.window_left >= 0 ? max(0, m0 + diag_offset - p.window_left) : 0;
        *end = m_last < m0 ? 0 : kv_len;
        int right = right_reach(p);
        if (right >= 0) *end = min(*end, m_last + diag_offset + right + 1);
        *end = max(*end, *begin);
    }

    // Rows [*begin, *end) that may attend any of the keys [n0, n0 + block_n).
    __device__ __forceinline__ void row_range(const Params& p, int n0, int block_n, int* begin, int* end) const {
        int n_last = min(n0 + block_n, kv_len) - 1;  // last valid key; < n0 for a tile of padding
        int right = right_reach(p);
        *begin = right >= 0 ? max(0, n0 - diag_offset - right) : 0;  // j <= i + off + right
        *end = n_last < n0 ? 0 : q_len;
        if (p.window_left >= 0) *end = min(*end, n_last - diag_offset + p.window_left + 1);  // j >= i + off - left
        *end = max(*end, *begin);
    }

    // Key tiles [*begin, *end) of block_n keys that the structure leaves rows [m0, m0 + block_m).
    __device__ __forceinline__ void key_tiles(const Params& p, int m0, int block_m, int block_n, int* begin, int* end) const {
        int first, last;
        key_range(p, m0, block_m, &first, &last);
        *begin = first / block_n;
        *end = (last + block_n - 1) / block_n;
    }

    // Query tiles [*begin, *end) of block_m rows that the structure leaves keys [n0, n0 + block_n).
    __device__ __forceinline__ void row_tiles(const Params& p, int n0, int block_n, int block_m, int* begin, int* end) const {
        int first, last;
        row_range(p, n0, block_n, &first, &last);
        *begin = first / block_m;
        *end = (last + block_m - 1) / block_m;
    }

    // The key tiles of block_n keys that rows [m0, m0 + block_m) visit.
    __device__ __forceinline__ TileWalk key_walk(const Params& p, int m0, int block_m, int block_n) const {
        int begin, end;
        key_tiles(p, m0, block_m, block_n, &begin, &end);
#if ATTN_BLOCK_MASK
        return walk(p, begin, end, true, m0 / block_m);
#else
        return TileWalk{begin, begin, end};
#endif
    }

    // The query tiles of block_m rows that keys [n0, n0 + block_n) visit.
    __device__ __forceinline__ TileWalk row_walk(const Params& p, int n0, int block_n, int block_m) const {
        int begin, end;
        row_tiles(p, n0, block_n, block_m, &begin, &end);
#if ATTN_BLOCK_MASK
        return walk(p, begin, end, false, n0 / block_n);
#else
        return TileWalk{begin, begin, end};
#endif
    }

#if ATTN_BLOCK_MASK
    // The walk over [begin, end) of tile `tile`'s key tiles (along_keys) or query tiles, from the
    // first the block mask calls non-empty. (A plain build's walk is built in place: through this
    // function, unused arguments and all, ptxas lengthened the backwards' paths by 1-3 %, NVRTC 13.5.)
    __device__ __forceinline__ TileWalk walk(const Params& p, int begin, int end, bool along_keys, int tile) const {
        const int* next = along_keys ? p.block_kv_next + block_row(p, p.block_m_tiles, tile) * p.block_n_tiles
                                     : p.block_q_next + block_row(p, p.block_n_tiles, tile) * p.block_m_tiles;
        // Inside the table's row: where the structure leaves a tile of padding nothing (a window
        // over short q_lengths, causal over short kv_lengths), key_tiles and row_tiles can give a
        // tile past the tensor's, which a plain build visits and masks; read from the table, it
        // would be another row's entry.
        end = min(end, along_keys ? p.block_n_tiles : p.block_m_tiles);
        return TileWalk{begin < end ? min(next[begin], end) : end, begin, end, next, 0};
    }

    // Row `row` of this (entry, head)'s rows of a block mask table with `rows` rows per head.
    __device__ __forceinline__ long long block_row(const Params& p, int rows, int row) const {
        return static_cast<long long>(bidb * p.heads + bidh) * rows + row;
    }
#endif

    // No structural mask inside the (block_m x block_n) tile at (m0, n0): every row valid and
    // every key inside the causal/window band of every row. Only boundary tiles pay for masking.
    __device__ __forceinline__ bool tile_is_interior(const Params& p, int m0, int block_m, int n0, int block_n) const {
        int m1 = m0 + block_m - 1, n1 = n0 + block_n - 1;
        bool inside = m1 < q_len && n1 < kv_len;
        int right = right_reach(p);
        if (right >= 0) inside = inside && n1 <= m0 + diag_offset + right;
        if (p.window_left >= 0) inside = inside && n0 >= m1 + diag_offset - p.window_left;
        return inside;
    }

    // The key tiles n of block_n keys whose tile with the rows [m0, m0 + block_m) is interior
    // (tile_is_interior(p, m0, block_m, n·block_n, block_n)): a contiguous range, worked out once
    // per block, so that a forward's tile tests two comparisons (tile_is_interior per tile took
    // about 11 instructions of the wgmma forward's loop, NVRTC 13.5). The backwards test
    // tile_is_interior per tile: ptxas keeps it off their fastest paths, and the span lengthened
    // them by 2-3 % (bench/RESULTS.md, 2026-12-01).
    __device__ __forceinline__ TileSpan interior_key_tiles(const Params& p, int m0, int block_m, int block_n) const {
        const int m1 = m0 + block_m - 1;
        TileSpan span{0, m1 < q_len ? kv_len / block_n : 0};  // every row valid; n·bn + bn - 1 < kv_len
        const int right = right_reach(p);
        // n·bn + bn - 1 <= m0 + off + right, i.e. n < floor((m0 + off + right + 1) / bn)
        if (right >= 0) span.end = min(span.end, floor_div(m0 + diag_offset + right + 1, block_n));
        // n·bn >= m1 + off - left, i.e. n >= ceil((m1 + off - left) / bn)
        if (p.window_left >= 0) span.begin = -floor_div(-(m1 + diag_offset - p.window_left), block_n);
        return span;
    }

    // The checks the scores of the tile at (m0, n0) need: the structure on boundary tiles, the
    // mask_mod (where one is compiled in) unless a block mask knows the tile to be full. 0 for an
    // interior tile of a call without a mask_mod, which the softmax takes as its unchecked copy.
    __device__ __forceinline__ int tile_checks(const Params& p, int m0, int block_m, int n0, int block_n) const {
        int checks = tile_is_interior(p, m0, block_m, n0, block_n) && !ATTN_BOUNDARY_TILES ? 0 : kCheckStructure;
#if ATTN_BLOCK_MASK
        if (!block_full(p, m0 / block_m, n0 / block_n)) checks |= kCheckMods;
#elif ATTN_MASK_MOD
        checks |= kCheckMods;
#endif
        return checks;
    }
    // The same for the tile (m_tile, n_tile) of a forward, which knows whether it is interior
    // from interior_key_tiles. (Written out rather than called by the form above: passing
    // tile_is_interior's answer through made ptxas lengthen the dK/dV paths by 2-3 %, NVRTC 13.5.)
    __device__ __forceinline__ int tile_checks(const Params& p, bool interior, int m_tile, int n_tile) const {
        int checks = interior && !ATTN_BOUNDARY_TILES ? 0 : kCheckStructure;
#if ATTN_BLOCK_MASK
        if (!block_full(p, m_tile, n_tile)) checks |= kCheckMods;
#elif ATTN_MASK_MOD
        checks |= kCheckMods;
#endif
        return checks;
    }

#if ATTN_BLOCK_MASK
    // Whether the block mask knows tile (m_tile, n_tile) of this (entry, head) to be full (no
    // mask_mod to apply).
    __device__ __forceinline__ bool block_full(const Params& p, int m_tile, int n_tile) const {
        return p.block_full[block_row(p, p.block_m_tiles, m_tile) * p.block_n_tiles + n_tile];
    }
#endif
};

// Where one (batch entry, head) starts in q, k, v and the fourth tensor (out or dout), in
// elements, with their row strides; and its first row in the row statistics (BlockInfo::stats).
struct HeadView {
    long long q, k, v, o;
    long long q_row, k_row, v_row, o_row;
    long long stats;
};

__device__ __forceinline__ HeadView head_view(const Params& p, const BlockInfo& b, const long long (&s)[12]) {
    const int q_origin = b.q_origin(p), kv_origin = b.kv_origin(p);
    return HeadView{q_origin * s[0] + b.bidh * s[1], kv_origin * s[3] + b.bidh_kv * s[4],
                    kv_origin * s[6] + b.bidh_kv * s[7], q_origin * s[9] + b.bidh * s[10],
                    s[2], s[5], s[8], s[11],
                    b.stats(p)};
}

}  // namespace attn

// The run-time arguments every attention kernel takes after its pointers, and how they become
// a Params and the stride table (q, k, v and a fourth tensor: out in the forward, dout in the
// backward; batch, head, row strides each, in elements). One list, so the launcher builds it once.
#define ATTN_PARAMS                                                                                              \
    const int *q_lengths, const int *kv_lengths, const int *q_starts, const int *kv_starts, int packed,          \
        int total_q, int total_k, const float *alibi_slopes, const float *sinks, const void *mask, int heads,    \
        unsigned heads_magic, int heads_shift, int kv_group, int seq_q, int seq_k, int head_dim, int head_dim_v, \
        long long q_sb, long long q_sh, long long q_sr, long long k_sb, long long k_sh, long long k_sr,          \
        long long v_sb, long long v_sh, long long v_sr, long long o_sb, long long o_sh, long long o_sr,          \
        long long mask_sb, long long mask_sh, long long mask_sq, int mask_kind, int causal, int window_left,     \
        int window_right, int has_alibi, int has_sinks, float scale, float softcap,                              \
        unsigned long long dropout_seed, unsigned dropout_offset, unsigned dropout_threshold,                    \
        float dropout_scale ATTN_MOD_PARAM ATTN_BLOCK_PARAM
#define ATTN_UNPACK_PARAMS                                                                                       \
    const attn::Params p{q_lengths, kv_lengths, q_starts, kv_starts, packed, total_q, total_k, alibi_slopes,     \
                         sinks, mask, heads, heads_magic, heads_shift, kv_group, seq_q, seq_k, head_dim,         \
                         head_dim_v, mask_sb, mask_sh, mask_sq, mask_kind, causal, window_left,                  \
                         window_right, has_alibi, has_sinks, scale, softcap, dropout_seed, dropout_offset,       \
                         dropout_threshold, dropout_scale ATTN_MOD_FIELD ATTN_BLOCK_FIELD};                      \
    const long long strides[12] = {q_sb, q_sh, q_sr, k_sb, k_sh, k_sr, v_sb, v_sh, v_sr, o_sb, o_sh, o_sr}

