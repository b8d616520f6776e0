// The exact merge of partial attention results computed over disjoint key sets (split-KV
// decoding, cascade attention, context parallelism). For the P parts of one query row,
//   lse = log Σ_p exp(lse_p),   out = Σ_p exp(lse_p − lse) · out_p,
// which is a softmax over the parts with lse_p as the scores and out_p as the values. So it runs
// as the forward's online softmax (softmax.cuh, base 2), one warp per row, over chunks of 32
// parts: lane j holds part c + j's score, each weight reaches every lane by a shuffle, and each
// lane accumulates the output dims lane, lane + 32, ... (a warp reads 32 consecutive elements
// of a part's row at a time).
//
// Numerics: the running max shifts the scores (no overflow, whatever the lse magnitudes), and it
// starts from the lowest float, not −inf (OnlineSoftmax::row_max), so a row whose parts so far
// are all −inf shifts by a finite amount and exp2(−inf − −inf) = NaN never appears. A part with
// lse_p = −inf saw no keys: its weight is exp2(−inf) = 0, and it is skipped by a select rather
// than multiplied by 0, so whatever its out holds (garbage, NaN, inf) cannot leak into the
// result. A row whose parts are all −inf gives
// out 0 and lse −inf (OnlineSoftmax::inverse_sum and ::lse).
#include "access_count.cuh"
#include "numeric.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"

// grid (ceil(rows / (kThreads / 32))), block kThreads: one warp per row (cupy_attn._config
// COMBINE_ROWS_PER_BLOCK). out_parts (parts, rows, head_dim_v) and lse_parts (parts, rows)
// contiguous, lse_parts finite or −inf; out (rows, head_dim_v) and lse (rows,) contiguous.
template <class TPart, class TOut>
__global__ void __launch_bounds__(attn::kThreads)
attention_combine(const TPart* out_parts, const float* lse_parts, TOut* out, float* lse, int parts, long long rows,
                  int head_dim_v) {
    using namespace attn;
    constexpr int kWarp = 32;
    const long long row = static_cast<long long>(blockIdx.x) * (kThreads / kWarp) + threadIdx.x / kWarp;
    const int lane = threadIdx.x % kWarp;
    if (row >= rows) return;  // whole warps leave together: the shuffles below need every lane
    const long long part_stride = rows * head_dim_v;
    // One pass per 32 output dims, at least one so that lse is written when head_dim_v is 0. Each
    // pass recomputes the row's softmax over the parts: P exponentials per lane, against P reads
    // of 32 elements.
    const int passes = head_dim_v > 0 ? (head_dim_v + kWarp - 1) / kWarp : 1;
    for (int pass = 0; pass < passes; ++pass) {
        const int d = pass * kWarp + lane;
        OnlineSoftmax<kWarp> softmax;
        float acc = 0.f;  // Σ_p exp2(score_p − running max) · out_p[d]
        for (int c = 0; c < parts; c += kWarp) {
            float score[1] = {-infinity()};  // lane j: part c + j's lse in base 2
            if (c + lane < parts) score[0] = lse_parts[(c + lane) * rows + row] * kLog2e;
            const unsigned live = __ballot_sync(0xffffffffu, score[0] != -infinity());
            acc *= softmax.update(score);  // score[0] is now the part's weight exp2(score − max)
            const int chunk = min(kWarp, parts - c);
            for (int j = 0; j < chunk; ++j) {
                const float weight = __shfl_sync(0xffffffffu, score[0], j);
                if ((live >> j & 1u) && d < head_dim_v) {  // the select: empty parts are never read
                    const TPart* x = out_parts + (c + j) * part_stride + row * head_dim_v + d;
                    ATTN_COUNT_GLOBAL(x, sizeof(TPart));
                    acc = fmaf(weight, to_float(*x), acc);
                }
            }
        }
        softmax.gather_sum();
        if (d < head_dim_v) {
            ATTN_COUNT_GLOBAL(out + row * head_dim_v + d, sizeof(TOut));
            out[row * head_dim_v + d] = from_float<TOut>(acc * softmax.inverse_sum());
        }
        if (pass == 0 && lane == 0) lse[row] = softmax.lse();
    }
}
