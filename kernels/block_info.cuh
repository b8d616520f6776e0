// Which rows and keys one thread block works on, and which key tiles it may skip.
#pragma once

namespace attn {

// The problem as the kernels see it. Strides are in elements; the last dimension of q, k, v and
// out is contiguous. Lengths and ALiBi slopes are always given (full lengths, zero slopes when
// unused) so the kernels need no null checks.
struct Params {
    const int* q_lengths;        // (B,)
    const int* kv_lengths;       // (B,)
    const float* alibi_slopes;   // (B, H), contiguous
    const void* mask;            // bool (uint8) or float32, read through mask strides
    int heads, kv_group, seq_q, seq_k, head_dim, head_dim_v;
    long long mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k;
    int mask_kind;               // 0 none, 1 bool (True = may attend), 2 additive float
    int causal;                  // 0 none, 1 bottom-right, 2 top-left
    int window_left, window_right;  // -1: unbounded
    int has_alibi;
    float scale, softcap;        // softcap 0: off
};

enum { kMaskNone = 0, kMaskBool = 1, kMaskFloat = 2 };
enum { kCausalNone = 0, kCausalBottomRight = 1, kCausalTopLeft = 2 };

// How far right of the diagonal a row may look: min(window right, 0 if causal); -1 if unbounded.
__device__ __forceinline__ int right_reach(const Params& p) {
    if (!p.causal) return p.window_right;
    return p.window_right >= 0 ? min(0, p.window_right) : 0;
}

// One (query tile of block_m rows, head, batch entry): valid lengths, the diagonal offset and
// the range of keys the tile may attend.
struct BlockInfo {
    int m_block, bidh, bidb, bidh_kv;
    int q_len, kv_len;
    int diag_offset;  // query i lines up with key i + diag_offset
    int m0;           // first query row of the tile
    int key_begin, key_end;  // keys any row of the tile may attend: [key_begin, key_end)

    __device__ __forceinline__ BlockInfo(const Params& p, int block_m, int m_block_, int bidh_, int bidb_)
        : m_block(m_block_), bidh(bidh_), bidb(bidb_), bidh_kv(bidh_ / p.kv_group) {
        q_len = p.q_lengths[bidb];
        kv_len = p.kv_lengths[bidb];
        diag_offset = p.causal == kCausalTopLeft ? 0 : kv_len - q_len;
        m0 = m_block * block_m;
        int m_last = min(m0 + block_m, q_len) - 1;  // last valid query row of the tile
        key_begin = 0;
        key_end = m_last < m0 ? 0 : kv_len;  // a tile of padding rows attends nothing
        if (p.window_left >= 0) key_begin = max(0, m0 + diag_offset - p.window_left);
        int right = right_reach(p);
        if (right >= 0) key_end = min(key_end, m_last + diag_offset + right + 1);
        if (key_end < key_begin) key_end = key_begin;
    }

    // No structural mask inside this (block_m x block_n) tile: every row valid and every key
    // inside the causal/window band of every row. Only boundary tiles pay for masking.
    __device__ __forceinline__ bool tile_is_interior(const Params& p, int block_m, int block_n, int n0) const {
        int m1 = m0 + block_m - 1, n1 = n0 + block_n - 1;
        bool inside = m1 < q_len && n1 < kv_len;
        int right = right_reach(p);
        if (right >= 0) inside = inside && n1 <= m0 + diag_offset + right;
        if (p.window_left >= 0) inside = inside && n0 >= m1 + diag_offset - p.window_left;
        return inside;
    }
};

}  // namespace attn
