// The Hopper (sm_90a) forward for fp16/bf16: FlashAttention-3's structure on wgmma and TMA.
//
// Work tiles of (128 query rows, head, batch entry); persistent blocks (one per SM) take them
// the heaviest first, each claiming its next as it nears the end of its current one (WorkTiles,
// block_info.cuh), so a tile's Q, K and V load while the previous tile's O is staged and stored.
// Three warpgroups with their roles fixed at the start (warp specialisation):
//   producer   warpgroup 0 gives up registers (setmaxnreg.dec 40); one elected thread of its
//              first warp loads each work tile's Q once and each key tile's K and V with TMA into
//              128-byte-swizzled boxes of 64 head dims, K and V into rings of two stages
//              (pipeline.cuh) whose full barriers count the bytes that landed and whose empty
//              barriers count the consumer threads done reading; the rings go on from one work
//              tile to the next. Its other threads exit.
//   consumers  warpgroups 1 and 2 take the registers (setmaxnreg.inc 232) and own 64 query rows
//              of a work tile each. The accumulators of wgmma m64nNk16 give warp w of a group its rows 16w..+15
//              in mma.sync's layout, so the online softmax, the packing of P as an A operand and
//              the normalisation are tc_forward.cuh's, shared with the mma.sync forward.
// Per key tile n of kBlockN keys (the tile table's block_n, the N of the S instruction), each
// consumer group issues, on its turn,
//   S_n = Q·K_nᵀ        wgmma SS: Q and K K-major from their swizzled boxes (head dims reduced)
//   O  += P_{n-1}·V_{n-1}  wgmma RS: P from registers, V an MN-major operand (no transpose); up to
//                       128 head dims per instruction (at D = 64 with 8 columns of ones beside
//                       V's, which sum P's rows on the tensor cores: kTensorRowSums)
// and then computes the softmax of S_n while the tensor cores still work on P_{n-1}·V_{n-1}
// (wgmma.wait_group 1: FlashAttention-3's intra-warpgroup overlap; O is rescaled once that
// product is in). The two groups take turns at the tensor cores on two named barriers (ping-
// pong): a group issues its products once the other has issued its own, so one group's softmax
// runs while the other's products do. Rows whose scores the mask kills are handled as in every
// kernel (tc_forward.cuh); the key range is the whole block's, so a group may visit a tile none
// of its rows attends (its probabilities are 0).
// The epilogue stages each group's normalised O in its own rows of O's staging tile (swizzled as
// TMA reads them; at D = 256 with 64 keys, where shared memory has no room for it, in Q's rows,
// and that build runs one block per work tile) and one thread stores them with TMA, which clips
// rows past the sequence and head dims past Dv. The launcher uses this kernel where
// TMA can address q, k, v and out (cupy_attn/_tensor_map.py) and the mma.sync forward elsewhere.
#include "block_info.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "numeric.cuh"
#include "pipeline.cuh"
#include "ptx.cuh"
#include "softmax.cuh"
#include "tc_forward.cuh"
#include "tc_tile.cuh"

namespace attn {

constexpr int kConsumerGroups = 2;                        // warpgroups computing, 64 query rows each
constexpr int kWsThreads = 128 * (1 + kConsumerGroups);   // and the producer's
constexpr int kKvStages = 2;
// Named barriers (0 is __syncthreads'): consumer group g's turn at the tensor cores, and its O
// staged for the TMA store.
constexpr unsigned kTurnBarrier = 1, kStagedBarrier = kTurnBarrier + kConsumerGroups;
// Registers per thread after the split: 40 + 2 x 232 = 504 per lane-triple, 64512 of the SM's
// 65536 (the launch gives each thread 65536 / 384 = 168, rounded to 8). The producer walks the work
// tiles (their key ranges) itself: at 24 it spilled 44-48 bytes (NVRTC 13.5); at 232 the
// consumers spill in no build the tile table chooses.
constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
static_assert(register_split_fits(kWsThreads, kProducerRegisters, kConsumerRegisters), "the split must fit the launch");

// Shared memory a block of 384 threads may use on sm_90 (227 KB).
constexpr int kSharedLimit = 227 * 1024;

struct ForwardBarriers {
    StageRing<kKvStages> k, v;
    unsigned long long q_landed;  // a work tile's Q landed: one phase per Q tile loaded
    unsigned long long q_free;    // the consumers are done with that Q tile: one phase per Q tile
    unsigned long long work_posted;  // the producer wrote next_work: one phase per work tile
    unsigned long long work_read;    // every consumer thread read it: one phase per work tile
    unsigned next_work;              // the block's next work tile (>= WorkTiles::total: none)
};
static_assert(sizeof(ForwardBarriers) == 104, "HopperTile.shared_bytes counts 104 bytes after the tiles");

// TMA copies of rows [row0, row0 + Layout's rows) x kDims head dims of a (head dims, rows, heads,
// batch) tensor map, one box of 64 dims each, into a tile laid out by Layout; their bytes complete
// on `landed`.
template <class Layout, int kDims, class T>
__device__ __forceinline__ void load_tile(T* tile, const ptx::TensorMap& map, int row0, int head, int batch,
                                          unsigned long long* landed) {
#pragma unroll
    for (int c = 0; c < kDims / Layout::kBoxCols; ++c) {
        const int box[4] = {c * Layout::kBoxCols, row0, head, batch};
        ptx::tma_load<4>(tile + Layout::offset(0, c * Layout::kBoxCols), map, box, landed);
    }
}

template <class T, int kHeadDim, int kBlockN>
__device__ __forceinline__ void forward_wgmma_block(const Params& p, const WorkTiles& work, float* lse,
                                                    const long long (&strides)[12], const ptx::TensorMap& q_map,
                                                    const ptx::TensorMap& k_map, const ptx::TensorMap& v_map,
                                                    const ptx::TensorMap& o_map) {
    // Head dims per P·V instruction (its N): all of them up to 128 (one m64n128k16 covers O's 64
    // accumulators per lane at D = 128), in instructions of 128 beyond.
    constexpr int kPvDims = kHeadDim < 128 ? kHeadDim : 128;
    static_assert(kHeadDim % 64 == 0 && kHeadDim % kPvDims == 0, "head-dim tiles are multiples of 64");
    static_assert(kBlockN == 32 || kBlockN == 64 || kBlockN == 128 || kBlockN == 176,
                  "S instructions m64n32k16, m64n64k16, m64n128k16 or m64n176k16");
    constexpr int kBlockM = 64 * kConsumerGroups;
    using QTile = SwizzledBoxLayout<kBlockM, kHeadDim>;   // Q, then O: rows x head dims
    using KvTile = SwizzledBoxLayout<kBlockN, kHeadDim>;  // K and V: keys x head dims
    constexpr int kNTiles = kBlockN / 8;     // 8-key column tiles of S
    constexpr int kDTiles = kHeadDim / 8;    // 8-dim column tiles of O
    // A tile's softmax gives each warp kBlockN / 2 MUFU instructions (an exp2 per score), 8 cycles
    // each on its sub-partition's unit, against kBlockN·kHeadDim / 16 tensor cycles: at D = 64
    // the MUFU unit alone needs as long as the tensor cores, and softcap's tanh adds 2 MUFU per
    // score. Where MUFU bounds the loop, a share of the softmax's exp2 goes to the FMA pipe
    // (exp2_polynomial: 9 issue slots for one MUFU's 8 cycles), as many as balance the two bounds
    // (SASS audit, NVRTC 13.5, fp16; mufu_per_tensor and issue_per_tensor, before → after):
    // - plain builds at D = 64 (their rows' sums on the tensor cores: kTensorRowSums below), every
    //   5th in interior tiles: 0.81 and 0.70 with every 7th → 0.77 and 0.74 at 176 keys, 0.82 and
    //   0.72 → 0.77 and 0.78 at 128 (every 6th: 0.79 and 0.72, 0.79 and 0.75; every 4th: 0.71 and
    //   0.81, 0.71 and 0.84); their boundary tiles, which issue more, keep MUFU;
    // - softcap builds at D <= 128, every 2nd in boundary tiles (MUFU-bound there too), and in
    //   interior tiles as many as balance the two with softcap's companions: at D = 128 (64 keys)
    //   2 of 3 with softcap alone (1.53 and 0.86 → 1.22 and 1.18; 3 of 4: 1.16 and 1.24), 1 of 2
    //   with ALiBi or a mask beside it (1.28 and 1.21-1.41; 2 of 3: a loss); at D = 64 (128 keys,
    //   the row sums on the tensor cores) 5 of 6 with softcap alone (2.06 and 1.95), 3 of 4 with
    //   ALiBi (2.12 and 2.08; 2 of 3: 2.21 and 1.99), 2 of 3 with a float mask, a bool mask, or
    //   ALiBi and a float mask (2.21 and 2.09-2.27; 1 of 2: 2.35 and 2.06-2.14; with a float mask 3
    //   of 4 spilled 8 bytes), 1 of 2 with ALiBi and a bool mask (2.35 and 2.24; 2 of 3: 2.21 and
    //   2.38). bench/RESULTS.md, 2026-12-06 and 2026-12-07, has the earlier steps.
    // Other builds keep the MUFU unit for every score: at D = 128 and 256 plain builds need a half
    // and a quarter of the tensor cycles in MUFU, builds with ALiBi, masks, mods or dropout are
    // issue-bound or within the tensor cores' time (at D = 64 issue_per_tensor 0.85-1.25 with MUFU
    // 0.94, 3.1-3.8 with dropout), and at D = 256 softcap's gain was 4 % alone and a loss with
    // ALiBi and a float mask.
    constexpr bool kSoftcapMufuBound = kSoftcapBuilt && !kDropoutBuilt && !ATTN_MODS && kHeadDim <= 128;
    // softcap's companions, weighed by their issue slots per score: ALiBi and a float mask one, a bool mask two
    constexpr int kSoftcapCompanions = kAlibiBuilt + (kMaskBuilt == kMaskFloat) + 2 * (kMaskBuilt == kMaskBool);
    constexpr int kSoftcapEvery = kHeadDim == 64 ? (kSoftcapCompanions == 0   ? 6
                                                    : kSoftcapCompanions == 1 ? (kAlibiBuilt ? 4 : 3)
                                                    : kSoftcapCompanions == 2 ? 3
                                                                              : 2)
                                                 : kSoftcapCompanions == 0 ? 3 : 2;
    constexpr int kPolynomialEvery = kSoftcapMufuBound ? kSoftcapEvery : kHeadDim == 64 && ScoreTransform::kPlain ? 5 : 0;
    constexpr int kPolynomialOf = kSoftcapMufuBound ? kSoftcapEvery - 1 : 1;
    constexpr int kBoundaryPolynomialEvery = kSoftcapMufuBound ? 2 : 0;
    // Every build overlaps the softmax of a tile with P·V of the previous one, so it holds S, P and
    // O at once (D/2 + 3·kBlockN/4 registers, 4 more for the rows' sums at D = 64 without dropout)
    // besides what its score features and mods need: with the features' tiles (the tile table: 64
    // keys at D <= 128, 32 at 256, 128 at D = 64 without mods, or ALiBi and dropout together) and
    // the rows' scores one after the other (softmax_scores' kRowByRow) no build of the 23 feature
    // sets spills at 232 registers (NVRTC 13.5; bench/feature_builds.py), nor do
    // bench/bench_mods.py's mods (a document mask, a window with global tokens, a bias table; with
    // and without a block mask). With 128 keys ptxas spilled 8-284 bytes at D = 128, and at D = 64
    // 4-44 with ALiBi and dropout and 12 with the bias table.
    constexpr unsigned kTileElements = kBlockN * kHeadDim;  // one stage of K or of V
    // At D = 64 the rows' sums of P are taken on the tensor cores, as P·1 beside P·V (the mma.sync
    // forward's way): P·V's N is 72, its last 8 columns read from ones (a box of kBlockN keys per
    // stage of V, as far from its stage as the other: the V descriptor's leading byte offset) into
    // an accumulator tile after O's, rescaled with O. That trades a float add per score (88 per
    // lane and tile of 176 keys) for 1/8 more P·V (6 % more tensor cycles: 704 → 748 per tile of
    // 176 keys), and sums the very rounded P that P·V weighs V by. With the exp2 shares above, the
    // plain build of 176 keys issues 554 instructions per tile, not 614, and the larger of
    // issue_per_tensor and mufu_per_tensor falls from 0.89 to 0.77 (128 keys: 0.91 → 0.78; issue
    // 15's 0.8 with room for what the model ignores); in boundary tiles issue_per_tensor falls
    // from 1.17 to 0.98 (128 keys: 1.11 → 0.93); the bound of builds with a mask falls 6-10 %, that
    // of ALiBi alone rises 3 % (issue 0.85 and MUFU 0.94 then: the tensor cores bound it) (SASS
    // audit, NVRTC 13.5, fp16). Builds with dropout keep the float adds, whose sums must
    // take P before it is dropped, and leave the ones unused; at D = 128 and 256 the plain builds
    // are within the tensor cores' time already.
    constexpr bool kTensorRowSums = kHeadDim == 64 && !kDropoutBuilt;
    constexpr int kSumTiles = kTensorRowSums ? 1 : 0;
    constexpr int kPvN = kPvDims + 8 * kSumTiles;  // the N of P·V's instructions
    constexpr unsigned kOnesElements = kHeadDim == 64 ? kKvStages * kTileElements : 0;
    // Persistent where O has a staging tile of its own beside Q, K and V (HopperTile.persistent: all
    // but D = 256 with 64 keys): a block then takes work tile after work tile, and the next one's Q,
    // K and V load while this one's O is staged and stored. Else O is staged in Q's rows and the
    // launcher starts one block per work tile.
    constexpr bool kPersistent =
        sizeof(T) * (2 * kBlockM * kHeadDim + 4 * kTileElements + kOnesElements) + sizeof(ForwardBarriers) <=
        kSharedLimit;
    extern __shared__ __align__(1024) unsigned char smem_bytes[];
    // Q (kBlockM x kHeadDim), K's stages, V's stages (kBlockN x kHeadDim each), at D = 64 the ones
    // (kBlockN x 64 per stage of V), O's staging tile (kBlockM x kHeadDim) if persistent (all
    // multiples of 1024 bytes, so every box starts a swizzle atom), then the barriers. Stages by
    // arithmetic: a run-time index into a pointer array would put it in local memory.
    T* sQ = reinterpret_cast<T*>(smem_bytes);
    T* sK = sQ + kBlockM * kHeadDim;
    T* sV = sK + kKvStages * kTileElements;
    T* sOnes = sV + kKvStages * kTileElements;
    T* sO = kPersistent ? sOnes + kOnesElements : sQ;
    ForwardBarriers& bars =
        *reinterpret_cast<ForwardBarriers*>(sOnes + kOnesElements + (kPersistent ? kBlockM * kHeadDim : 0));

    if (threadIdx.x == 0) {
        bars.k.init(128 * kConsumerGroups);
        bars.v.init(128 * kConsumerGroups);
        ptx::mbarrier_init(&bars.q_landed, 1);
        ptx::mbarrier_init(&bars.q_free, 128 * kConsumerGroups);
        ptx::mbarrier_init(&bars.work_posted, 1);
        ptx::mbarrier_init(&bars.work_read, 128 * kConsumerGroups);
        ptx::fence_mbarrier_init();
    }
    if constexpr (kTensorRowSums) {  // the ones, which wgmma reads (through the async proxy) after the barrier below
        const uint4 ones = {pack_pair<T>(1.f, 1.f), pack_pair<T>(1.f, 1.f), pack_pair<T>(1.f, 1.f),
                            pack_pair<T>(1.f, 1.f)};
        for (unsigned i = threadIdx.x; i < kOnesElements / 8; i += kWsThreads) {
            ATTN_STORE_SHARED(sOnes + 8 * i, 16);
            reinterpret_cast<uint4*>(sOnes)[i] = ones;
        }
        ptx::fence_proxy_async();  // each thread's stores of the ones
    }
    __syncthreads();  // the barriers are initialised, the ones stored; the last block-wide barrier (the producer's threads exit)

    if (threadIdx.x < 128) {
        ptx::set_max_registers<kProducerRegisters, false>();
        // Q, K and V go in whole boxes, zero-filled past the tensor (keys past seq_k, rows past
        // seq_q, dims past the head); keys between a batch entry's length and seq_k are read,
        // and masked, as the cp.async kernels do. Each full barrier learns the whole boxes' bytes.
        // A work tile's first K goes before its Q, which waits until the consumers are done with
        // the previous Q tile: it then lands while they finish that tile.
        if (threadIdx.x < 32 && ptx::elect_one()) {
            StageCursor<kKvStages> at;
            // read_phase: of work_read, the consumers having read the last next_work; a fresh
            // barrier's phase before the first counts as complete (as for the rings' producer).
            unsigned q_tiles = 0, read_phase = 1;
            for (unsigned w = blockIdx.x; w < work.total;) {
                const BlockPlace place = work.query_place(p, w);
                const BlockInfo b(p, place.head, place.batch);
                const int m0 = place.tile * kBlockM;
                for (TileWalk loads = b.key_walk(p, m0, kBlockM, kBlockN); loads.more(); loads.advance(), at.advance()) {
                    producer_acquire(bars.k, at, sizeof(T) * kTileElements);
                    load_tile<KvTile, kHeadDim>(sK + at.stage * kTileElements, k_map, loads.tile * kBlockN, b.bidh_kv,
                                                b.bidb, &bars.k.full[at.stage]);
                    if (loads.visits() == 0) {
                        if (q_tiles > 0) ptx::mbarrier_wait(&bars.q_free, (q_tiles - 1) & 1);
                        ptx::mbarrier_arrive_expect_tx(&bars.q_landed, sizeof(T) * kBlockM * kHeadDim);
                        load_tile<QTile, kHeadDim>(sQ, q_map, m0, b.bidh, b.bidb, &bars.q_landed);
                        ++q_tiles;
                    }
                    producer_acquire(bars.v, at, sizeof(T) * kTileElements);
                    load_tile<KvTile, kHeadDim>(sV + at.stage * kTileElements, v_map, loads.tile * kBlockN, b.bidh_kv,
                                                b.bidb, &bars.v.full[at.stage]);
                }
                // The block's next work tile, claimed once this one's loads are issued (about two
                // key tiles before its consumers finish it), so the claim's round trip hides behind
                // the wait for a free stage. The consumers learn it through next_work, once they
                // have all read the last one.
                if constexpr (kPersistent) {
                    w = work.claim();
                    ptx::mbarrier_wait(&bars.work_read, read_phase);
                    read_phase ^= 1;
                    bars.next_work = w;
                    ptx::mbarrier_arrive(&bars.work_posted);  // releases the write to the waiting consumers
                } else {
                    w = work.total;
                }
            }
        }
        return;
    }
    ptx::set_max_registers<kConsumerRegisters, true>();

    const int group = threadIdx.x / 128 - 1;  // consumer group: query rows 64·group .. + 63 of the block
    const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32, t = lane % 4;
    const int group_row0 = 64 * group;
    // Descriptors built once per block; a tile's stage and a k-step's columns are offsets added to
    // them.
    const unsigned long long q_desc = ptx::wgmma_descriptor(sQ + QTile::offset(group_row0, 0), QTile::kKMajorLbo,
                                                            QTile::kKMajorSbo, ptx::Swizzle::B128);
    const unsigned long long k_desc0 =
        ptx::wgmma_descriptor(sK, KvTile::kKMajorLbo, KvTile::kKMajorSbo, ptx::Swizzle::B128);
    // V's leading byte offset: to its next box of 64 head dims, or at D = 64 to its stage's ones.
    constexpr unsigned kVStageBytes = sizeof(T) * kTileElements;
    const unsigned long long v_desc0 = ptx::wgmma_descriptor(
        sV, kTensorRowSums ? kKvStages * kVStageBytes : KvTile::kMnMajorLbo, KvTile::kMnMajorSbo, ptx::Swizzle::B128);
    StageCursor<kKvStages> k_at, v_at;
    unsigned q_tiles = 0, next = work.total, posted_phase = 0;

    for (unsigned w = blockIdx.x; w < work.total; w = next) {
        const BlockPlace place = work.query_place(p, w);
        const BlockInfo b(p, place.head, place.batch);
        const int m0 = place.tile * kBlockM;
        const TileWalk keys = b.key_walk(p, m0, kBlockM, kBlockN);
        const int row_lo = m0 + group_row0 + warp * 16 + lane / 4;  // this lane's two rows: row_lo and row_lo + 8
        const ScoreTransform score(p, b);
        const Dropout dropout(p, b);
        const HeadView at = head_view(p, b, strides);

        float o[kDTiles + kSumTiles][4];  // O, then the rows' sums of P (kTensorRowSums)
#pragma unroll
        for (int d = 0; d < kDTiles + kSumTiles; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
        float(&o_flat)[4 * (kDTiles + kSumTiles)] = reinterpret_cast<float(&)[4 * (kDTiles + kSumTiles)]>(o);
        TcSoftmaxOf<!kTensorRowSums> softmax[2];
        float s[kNTiles][4];
        float(&s_flat)[4 * kNTiles] = reinterpret_cast<float(&)[4 * kNTiles]>(s);
        unsigned pa[kBlockN / 16][4];  // P of the previous tile as A fragments (16 keys each)
        unsigned(&pa_flat)[kBlockN / 4] = reinterpret_cast<unsigned(&)[kBlockN / 4]>(pa);
        const TileSpan interior = b.interior_key_tiles(p, m0, kBlockM, kBlockN);

        // Turns: a group waits on its own barrier (its 128 threads sync, the other group's 128
        // arrive) before issuing a tile's products, and hands the turn over once they are issued,
        // from one work tile to the next (so one group's epilogue runs while the other's products
        // do). Group 1 hands group 0 the block's first turn, and group 0 takes a last one that
        // only completes group 1's last hand-over: every barrier generation is complete at exit.
        auto take_turn = [&] { ptx::named_barrier_sync(kTurnBarrier + group, 256); };
        auto pass_turn = [&] { ptx::named_barrier_arrive(kTurnBarrier + (group + 1) % 2, 256); };
        auto issue_s = [&] {
            const unsigned long long k_desc = ptx::descriptor_plus(k_desc0, sizeof(T) * k_at.stage * kTileElements);
            // From D = 128 the k-steps' descriptors of Q, hoisted out of the key loop, would hold
            // 16 or 32 registers for the whole loop and spill (NVRTC 13.5); recomputed per tile
            // they cost a uniform add per k-step. D = 64 keeps its four hoisted, but for 176 keys
            // (S and P 44 registers more than at 128), where the build spilled 16 bytes with them.
            const unsigned long long q_tile = kHeadDim >= 128 || kBlockN > 128 ? ptx::opaque(q_desc) : q_desc;
            ptx::fence_operands(s_flat);
            ptx::wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kHeadDim / 16; ++kk)
                ptx::wgmma_m64k16_ss<T, kBlockN, ptx::Major::K>(
                    s_flat, ptx::descriptor_plus(q_tile, sizeof(T) * QTile::offset(0, 16 * kk)),
                    ptx::descriptor_plus(k_desc, sizeof(T) * KvTile::offset(0, 16 * kk)), kk > 0);
            ptx::wgmma_commit();
        };
        auto issue_pv = [&] {
            const unsigned long long v_desc = ptx::descriptor_plus(v_desc0, v_at.stage * kVStageBytes);
            ptx::fence_operands(pa_flat);
            ptx::fence_operands(o_flat);
            ptx::wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk)
#pragma unroll
                for (int c = 0; c < kHeadDim / kPvDims; ++c)
                    ptx::wgmma_m64k16_rs<T, kPvN, ptx::Major::MN>(
                        reinterpret_cast<float(&)[kPvN / 2]>(o_flat[c * kPvDims / 2]), pa[kk],
                        ptx::descriptor_plus(v_desc, sizeof(T) * KvTile::offset(16 * kk, c * kPvDims)), 1);
            ptx::wgmma_commit();
        };
        // S of tile n_block, in registers and done with its stage of K, to probabilities (then O
        // must be rescaled, rescale_rows, before P·V of this tile adds to it).
        auto softmax_of = [&](int n_block) {
            ptx::fence_operands(s_flat);
            consumer_release(bars.k, k_at);
            k_at.advance();
            const int n0 = n_block * kBlockN;
            unsigned keeps[kNTiles];
            dropout.tile_keeps(keeps, row_lo, n0, t);
            softmax_scores<!ScoreTransform::kPlain, kPolynomialEvery, kBoundaryPolynomialEvery, kPolynomialOf>(
                s, softmax, p, b, score, dropout, keeps, row_lo, n0, t,
                b.tile_checks(p, interior.contains(n_block), place.tile, n_block));
        };
        auto pack_p = [&] {
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk) accumulators_as_a<T>(pa[kk], s[2 * kk], s[2 * kk + 1]);
        };
        // P·V of the previous tile is in O: its stage of V is free and O may be rescaled.
        auto pv_done = [&] {
            ptx::fence_operands(o_flat);
            ptx::fence_operands(pa_flat);
            consumer_release(bars.v, v_at);
            v_at.advance();
        };

        // On this group's turn, once the tile's K landed: S = Q·Kᵀ issued.
        auto start_s = [&] {
            take_turn();
            consumer_wait(bars.k, k_at);
            issue_s();
        };
        // This thread's products that read Q are in: Q may be overwritten by the next work tile's
        // once every consumer thread says so (a persistent block's producer waits for it).
        auto q_done = [&] { ptx::mbarrier_arrive(&bars.q_free); };
        // P·V of the last tile softmax_of saw, issued once its V landed, and waited for.
        auto finish_pv = [&] {
            consumer_wait(bars.v, v_at);
            issue_pv();
            ptx::wgmma_wait<0>();
            pv_done();
        };

        if (keys.more()) {
            if (group == 1 && q_tiles == 0) pass_turn();  // group 0 goes first
            ptx::mbarrier_wait(&bars.q_landed, q_tiles & 1);
            // S of each tile issued with P·V of the one before
            TileWalk at_tile = keys;
            start_s();
            pass_turn();
            ptx::wgmma_wait<0>();
            softmax_of(at_tile.tile);  // O is 0: its rescale is moot
            pack_p();
            for (at_tile.advance(); at_tile.more(); at_tile.advance()) {
                start_s();
                consumer_wait(bars.v, v_at);
                issue_pv();
                pass_turn();
                ptx::wgmma_wait<1>();  // S is in; P·V of the previous tile may still run
                softmax_of(at_tile.tile);
                ptx::wgmma_wait<0>();
                pv_done();
                rescale_rows(o, softmax);
                pack_p();
            }
            q_done();  // the last S is in (P·V of the last tile does not read Q)
            finish_pv();
            ++q_tiles;
        }

        if constexpr (kPersistent) {  // the block's next work tile, which the producer claimed
            ptx::mbarrier_wait(&bars.work_posted, posted_phase);
            posted_phase ^= 1;
            next = bars.next_work;
            ptx::mbarrier_arrive(&bars.work_read);
        }
        const bool last_tile = next >= work.total;  // the block's last

        // O through this group's rows of its staging tile (swizzled as TMA reads them), then out
        // by TMA. Persistent: O's own tile, free once the previous work tile's store read it.
        // Else Q's rows: Q is dead there once the group's last S is in, and no TMA copy into them
        // is in flight (Q was loaded only when the block has key tiles, and waited for).
        if constexpr (kTensorRowSums)  // every column of the sums' tile holds its row's whole sum
            for (int r = 0; r < 2; ++r) softmax[r].row_sum = o[kDTiles][2 * r];
        float inv[2];
        finish_rows(p, b, at, lse, softmax, row_lo, t, inv);
        // Group 1's last hand-over. (After finish_rows: placed before it, with the next work tile
        // read from shared memory, ptxas kept the key loop's descriptors in vector registers, 39
        // more instructions per key tile at D = 128; NVRTC 13.5.)
        if (last_tile && group == 0 && q_tiles > 0) take_turn();
        if constexpr (kPersistent) {
            if (threadIdx.x % 128 == 0) ptx::bulk_wait_read<0>();
            ptx::named_barrier_sync(kStagedBarrier + group, 128);
        }
        // At D = 64 the lane through opaque: its staging offsets are then worked out here, not once
        // before the work loop and held (ptxas spilled them with 176 keys and a bool mask, 8 bytes,
        // and with 128 keys and dropout, 4-76; NVRTC 13.5). At D = 128 and 256 that moved the key
        // loop's code by an instruction or two.
        const int staging_lane = kHeadDim == 64 ? static_cast<int>(ptx::opaque(lane)) : lane;
        stage_pairs<T>(reinterpret_cast<const float(&)[kDTiles][4]>(o), inv, staging_lane, sO, [&](int row, int col) {
            return QTile::swizzled(group_row0 + 16 * warp + row, col);
        });
        ptx::fence_proxy_async();  // the group's stores, visible to the TMA store
        ptx::named_barrier_sync(kStagedBarrier + group, 128);
        if (threadIdx.x % 128 == 0) {
            for (int c = 0; c < kHeadDim / QTile::kBoxCols; ++c) {
                const int box[4] = {c * QTile::kBoxCols, m0 + group_row0, b.bidh, b.bidb};
                ptx::tma_store<4>(o_map, box, sO + QTile::offset(group_row0, c * QTile::kBoxCols));
            }
            ptx::bulk_commit();
            // Shared memory must outlive the last store's reads of it. (Waited for inside the loop:
            // with code after the loop, ptxas held the consumers to the launch's 168 registers, not
            // setmaxnreg's, and spilled; NVRTC 13.5.)
            if (last_tile) ptx::bulk_wait_read<0>();
        }
    }
}

}  // namespace attn

// grid (blocks), one dimension: persistent builds (kPersistent) as many blocks as the GPU runs at
// once (one per SM), at most `work_total`; the others `work_total`. work_pairs x work_tiles x
// sections (= work_total) is the sectioned grid of query tiles of 128 rows (WorkTiles);
// work_claims, one zeroed counter per launch, counts the work tiles claimed past the grid's own
// (persistent builds; the others leave it untouched). Block 384 threads (a producer warpgroup and
// two consumers), dynamic shared memory: Q (128 x kHeadDim), two stages of K and of V (kBlockN x
// kHeadDim each), at D = 64 ones (kBlockN x 64 per stage of V), if persistent O's staging tile (128
// x kHeadDim), 16-bit, then the barriers. q_map, k_map, v_map, o_map: TMA maps of q, k, v and out
// (head dims, rows, heads, batch) with 128-byte swizzle and boxes of 64 head dims x 128 query rows
// (q), kBlockN keys (k, v) and 64 query rows (out: one consumer group's); q, k, v and out are read
// and written through them only (their pointers and strides in ATTN_PARAMS go unused; lse is
// written directly). Compiled for sm_90a only.
template <class T, int kHeadDim, int kBlockN>
__global__ void __launch_bounds__(attn::kWsThreads, 1)
attention_fwd_wgmma(const T* q, const T* k, const T* v, T* out, float* lse,
                    const __grid_constant__ ptx::TensorMap q_map, const __grid_constant__ ptx::TensorMap k_map,
                    const __grid_constant__ ptx::TensorMap v_map, const __grid_constant__ ptx::TensorMap o_map,
                    int work_pairs, int work_tiles, int work_total, unsigned* work_claims, ATTN_PARAMS) {
    ATTN_UNPACK_PARAMS;
    const attn::WorkTiles work{static_cast<unsigned>(work_pairs), static_cast<unsigned>(work_tiles),
                               static_cast<unsigned>(work_total), work_claims};
    attn::forward_wgmma_block<T, kHeadDim, kBlockN>(p, work, lse, strides, q_map, k_map, v_map, o_map);
}
