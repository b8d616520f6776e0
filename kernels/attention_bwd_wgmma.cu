// The Hopper (sm_90a) dK/dV kernel for fp16/bf16: FlashAttention-3's backward structure on wgmma
// and TMA.
//
// One block per (128 keys, query head, batch entry), three warpgroups with their roles fixed at
// the start (warp specialisation):
//   producer   warpgroup 0 gives up registers (setmaxnreg.dec 24). Its first warp loads the
//              block's K and V once (TMA, 128-byte-swizzled boxes of 64 head dims) and, for each
//              query tile of kBlockM rows that can see the block's keys, fills a stage of a two-
//              stage ring (pipeline.cuh): Q and dO by TMA (an elected lane), the rows' lse (base
//              2) and delta by the warp's own loads and stores (+inf and 0 past the sequence,
//              backward_stats.cuh), so the full barrier counts the warp's 32 arrivals and the
//              TMA bytes. Its other warps exit.
//   consumers  warpgroups 1 and 2 take the registers (setmaxnreg.inc 240) and own 64 keys each;
//              the accumulators of wgmma (M = 64 keys) give warp w of a group keys 16w..16w+15
//              in mma.sync's layout, so P/dS and dQ (tc_backward.cuh) are shared with the
//              mma.sync backward.
// Per query tile each consumer group computes, from the same stage,
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ      wgmma SS, N = kBlockM: its 64 rows of K, V and the stage's Q, dO,
//                               all K-major in their swizzled boxes (head dims reduced); at
//                               D = 64 (builds without softcap) RS, K and V's fragments loaded
//                               into registers once per block
//   Pᵀ, dSᵀ                     in registers
//   dV += Pᵀ·dO, dK += dSᵀ·Q    wgmma RS: Pᵀ and dSᵀ from registers, dO and Q MN-major from the
//                               same boxes (no transpose); up to 128 head dims per instruction
//   dQ += dS·K                  wgmma SS over the block's 128 keys, once both groups stored
//                               their dS (a barrier of both per tile): dS as the packed dSᵀ
//                               registers store it (keys x queries, one swizzled box per group,
//                               two buffers), an MN-major A operand; K MN-major; 64 head dims
//                               per product, at D = 128 one product per group, at D = 64 the
//                               groups in turn, so each element of a tile's dQ is reduced once
//                               per block; float32 reductions of pairs (unscaled: the
//                               launcher's conversion multiplies by the scale), unless the
//                               deterministic dQ kernel runs after
// and releases the stage once its dK, dV products are in. The group's other work overlaps its
// own wgmma, as FlashAttention-3's does: Pᵀ (and what dSᵀ needs of the scores: tc_backward.cuh
// DsFactors) while dPᵀ multiplies, dSᵀ while dV does, and dQ's reductions while dK does (the
// stage's last rows' dK issued after the dQ product). At the end each group stages its dK and dV
// (swizzled; in the input type, or float32 for a GQA group) in shared memory the loop no longer
// needs and one of its threads stores them with TMA, or adds them to its kv head's with TMA
// reductions (DkdvOut).
// Head dims up to 128: dK and dV of 64 keys take D floats per thread, so D = 256 stays on the
// mma.sync kernel, which splits its dims over two warps. The launcher uses this kernel where TMA
// can address q, k, v and dout (cupy_attn/_tensor_map.py) and the mma.sync kernel elsewhere.
#include "backward_stats.cuh"
#include "block_info.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "numeric.cuh"
#include "pipeline.cuh"
#include "ptx.cuh"
#include "tc_backward.cuh"
#include "tc_tile.cuh"

namespace attn {

constexpr int kBwdConsumerGroups = 2;                       // warpgroups computing, 64 keys each
constexpr int kBwdKeys = 64 * kBwdConsumerGroups;           // keys per block
constexpr int kBwdThreads = 128 * (1 + kBwdConsumerGroups);  // and the producer's
constexpr int kQueryStages = 2;
// Named barriers (0 is __syncthreads'): consumer group g's dK and dV are staged for TMA; both
// groups' dS are in shared memory (for dQ), and at the end both groups are done with K, V and
// every stage. All eight consumer warps pass the same sequence of the latter (one per tile where
// the block reduces dQ, then one), so one id serves both uses.
constexpr unsigned kStagedBarrier = 1, kGroupsBarrier = kStagedBarrier + kBwdConsumerGroups;
// The register split of attention_fwd_wgmma.cu: 24 + 2 x 240 per lane-triple, from a launch of
// 168 per thread.
constexpr int kBwdProducerRegisters = 24, kBwdConsumerRegisters = 240;
static_assert(register_split_fits(kBwdThreads, kBwdProducerRegisters, kBwdConsumerRegisters),
              "the split must fit the launch");

struct BackwardBarriers {
    StageRing<kQueryStages> queries;  // Q, dO, lse2, delta of a query tile
    unsigned long long kv_landed;
};

// The kernel's TMA maps: q, k, v and dout read (16-bit), dk and dv written (per query head in the
// input type or float32, or per kv head in float32, added to: DkdvOut), each (head dims, rows,
// heads, batch).
struct BackwardMaps {
    const ptx::TensorMap &q, &k, &v, &dout, &dk, &dv;
};

// kAccumulateDq: dQ by reductions here (else the deterministic dQ kernel computes it), a
// compile-time switch so that neither loop tests it per score.
template <class T, int kHeadDim, int kBlockM, bool kAccumulateDq>
__device__ __forceinline__ void dkdv_wgmma_block(const Params& p, const float* lse, const float* delta, float* dq_accum,
                                                 DkdvOut dkdv_out, const long long (&strides)[12],
                                                 const BackwardMaps& maps) {
    static_assert(kHeadDim % 64 == 0 && kHeadDim <= 128, "head-dim tiles 64 and 128");
    static_assert(kBlockM == 64 || kBlockM == 128, "Sᵀ and dPᵀ m64n64k16 or m64n128k16; dQ in m64 products");
    // Query rows per Sᵀ and dPᵀ product (their N): the stage's, except in builds with score
    // features at D = 128, whose state beside 64 + 64 floats of Sᵀ, dPᵀ and 128 of dK, dV spilled
    // at 240 registers (NVRTC 13.5: 108 bytes with softcap, ALiBi and a float mask): those take
    // the stage's rows 32 at a time.
    constexpr int kSubM = ScoreTransform::kPlain || kHeadDim < 128 ? kBlockM : 32;
    // Whether a tile's last dK may still be multiplying while the next tile starts (its stage
    // released after the next tile's first wait, not at the end of its own): the loop's tail and
    // the next tile's head then overlap it. That holds dK and dV (kHeadDim floats), dSᵀ's
    // fragments (kSubM / 4) and the next Sᵀ, dPᵀ (kSubM) at once: 144 at D = 64 and 168 at D = 128
    // with 32 rows at a time, where no build spills; at D = 128 with 64 rows, 208, ptxas spilled
    // 8-16 bytes and serialised the wgmma (C7512; NVRTC 13.5), so that build waits for its dK.
    constexpr bool kCarryDk = kHeadDim + 5 * kSubM / 4 <= 176;
    constexpr int kQTiles = kSubM / 8, kDTiles = kHeadDim / 8;
    constexpr int kQueryRowTiles = kBlockM / 64;  // M = 64 query rows per dQ instruction
    constexpr int kDqDims = 64;                   // and N = 64 head dims: a whole box of K
    // A tile's dQ is kHeadDim / 64 products of 64 head dims over the block's 128 keys (both
    // groups' dSᵀ), shared out between the groups: at D = 128 one each, at D = 64 the one to each
    // group in turn. So each element of a tile's dQ is reduced once per block, as FlashAttention-2
    // and 3 reduce it, not once per group (half the reductions); and a product's B operand, 64
    // dims of K, is a whole box (MN-major from the start of a swizzle atom; 32 dims would not be).
    constexpr int kDqProducts = kHeadDim / kDqDims;
    static_assert(kDqProducts <= kBwdConsumerGroups, "at most one dQ product per group and tile");
    constexpr int kStatsPerLane = (kBlockM + 31) / 32;
    using KvTile = SwizzledBoxLayout<kBwdKeys, kHeadDim>;  // K, V: keys x head dims
    using QTile = SwizzledBoxLayout<kBlockM, kHeadDim>;    // Q, dO: query rows x head dims
    using DsTile = SwizzledBoxLayout<64, kBlockM>;         // a group's dSᵀ: its keys x query rows
    constexpr unsigned kQElements = kBlockM * kHeadDim, kKvElements = kBwdKeys * kHeadDim;
    extern __shared__ __align__(1024) unsigned char smem_bytes[];
    constexpr unsigned kDsElements = kBlockM * 64;
    // K, V, per stage Q, dO, per group two dS buffers (all multiples of 1024 bytes: every box
    // starts a swizzle atom), per stage lse2, delta (kBlockM floats each), the barriers. Stages
    // and buffers by arithmetic: a run-time index into a pointer array would be local memory.
    T* sK = reinterpret_cast<T*>(smem_bytes);
    T* sV = sK + kKvElements;
    T* sQ0 = sV + kKvElements;
    T* sDS0 = sQ0 + kQueryStages * 2 * kQElements;
    float* sStats0 = reinterpret_cast<float*>(sDS0 + kBwdConsumerGroups * 2 * kDsElements);
    BackwardBarriers& bars = *reinterpret_cast<BackwardBarriers*>(sStats0 + kQueryStages * 2 * kBlockM);
    auto sQ = [&](int stage) { return sQ0 + stage * 2 * kQElements; };
    auto sDO = [&](int stage) { return sQ(stage) + kQElements; };
    auto sLse2 = [&](int stage) { return sStats0 + stage * 2 * kBlockM; };
    auto sDelta = [&](int stage) { return sLse2(stage) + kBlockM; };

    const BlockPlace place = key_block_place(p);
    const BlockInfo b(p, place.head, place.batch);
    const HeadView at = head_view(p, b, strides);  // .stats indexes lse, delta and dq rows
    const int n0 = place.tile * kBwdKeys;
    const TileWalk rows = b.row_walk(p, n0, kBwdKeys, kBlockM);
    if (threadIdx.x == 0) {
        bars.queries.init(128 * kBwdConsumerGroups, 32);
        ptx::mbarrier_init(&bars.kv_landed, 1);
        ptx::fence_mbarrier_init();
    }
    __syncthreads();  // the barriers are initialised; the last block-wide barrier (the producer's threads exit)

    if (threadIdx.x < 128) {
        ptx::set_max_registers<kBwdProducerRegisters, false>();
        if (threadIdx.x >= 32 || !rows.more()) return;
        // Whole boxes, zero-filled past the tensor (rows past seq_q or seq_k, dims past the head);
        // each barrier learns the whole boxes' bytes.
        const int lane = threadIdx.x;
        const bool elected = ptx::elect_one();
        if (elected) {
            ptx::mbarrier_arrive_expect_tx(&bars.kv_landed, 2 * sizeof(T) * kKvElements);
            for (int c = 0; c < kHeadDim / KvTile::kBoxCols; ++c) {
                const int box[4] = {c * KvTile::kBoxCols, n0, b.bidh_kv, b.bidb};
                ptx::tma_load<4>(sK + KvTile::offset(0, c * KvTile::kBoxCols), maps.k, box, &bars.kv_landed);
                ptx::tma_load<4>(sV + KvTile::offset(0, c * KvTile::kBoxCols), maps.v, box, &bars.kv_landed);
            }
        }
        StageCursor<kQueryStages> stage_at;
        for (TileWalk loads = rows; loads.more(); loads.advance(), stage_at.advance()) {
            const int m0 = loads.tile * kBlockM;
            float lse2[kStatsPerLane], row_delta[kStatsPerLane];  // loaded before the stage is free
#pragma unroll
            for (int i = 0; i < kStatsPerLane; ++i)
                if (lane + 32 * i < kBlockM)
                    row_stats(lse, delta, at.stats + m0, lane + 32 * i, b.q_rows(p) - m0, lse2[i], row_delta[i]);
            producer_wait(bars.queries, stage_at);  // every lane: each stores into the stage
            const int stage = stage_at.stage;
#pragma unroll
            for (int i = 0; i < kStatsPerLane; ++i)
                if (lane + 32 * i < kBlockM) {
                    ATTN_STORE_SHARED(sLse2(stage) + lane + 32 * i, 4);
                    ATTN_STORE_SHARED(sDelta(stage) + lane + 32 * i, 4);
                    sLse2(stage)[lane + 32 * i] = lse2[i];
                    sDelta(stage)[lane + 32 * i] = row_delta[i];
                }
            unsigned long long* full = &bars.queries.full[stage];
            if (!elected) {
                ptx::mbarrier_arrive(full);  // this lane's statistics are stored
                continue;
            }
            ptx::mbarrier_arrive_expect_tx(full, 2 * sizeof(T) * kQElements);
            for (int c = 0; c < kHeadDim / QTile::kBoxCols; ++c) {
                const int box[4] = {c * QTile::kBoxCols, m0, b.bidh, b.bidb};
                ptx::tma_load<4>(sQ(stage) + QTile::offset(0, c * QTile::kBoxCols), maps.q, box, full);
                ptx::tma_load<4>(sDO(stage) + QTile::offset(0, c * QTile::kBoxCols), maps.dout, box, full);
            }
        }
        return;
    }
    ptx::set_max_registers<kBwdConsumerRegisters, true>();

    const int group = threadIdx.x / 128 - 1;  // consumer group: keys 64·group .. + 63 of the block
    const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int group_n0 = n0 + 64 * group;
    const ScoreTransform score(p, b);
    const Dropout dropout(p, b);

    // Descriptors built once per block; a stage and a k-step's columns are offsets added to them.
    // Q and dO are read K-major for Sᵀ and dPᵀ and MN-major (head dims, N there, consecutive) for
    // dK and dV.
    const unsigned long long k_desc = ptx::wgmma_descriptor(sK + KvTile::offset(64 * group, 0), KvTile::kKMajorLbo,
                                                            KvTile::kKMajorSbo, ptx::Swizzle::B128);
    const unsigned long long v_desc = ptx::wgmma_descriptor(sV + KvTile::offset(64 * group, 0), KvTile::kKMajorLbo,
                                                            KvTile::kKMajorSbo, ptx::Swizzle::B128);
    const unsigned long long q_desc0 =
        ptx::wgmma_descriptor(sQ(0), QTile::kKMajorLbo, QTile::kKMajorSbo, ptx::Swizzle::B128);
    const unsigned long long q_mn_desc0 =
        ptx::wgmma_descriptor(sQ(0), QTile::kMnMajorLbo, QTile::kMnMajorSbo, ptx::Swizzle::B128);
    // dQ's operands: the dSᵀ buffers (group g's two at 2g, 2g + 1) and K, both MN-major (keys
    // reduced).
    T* sDS = sDS0 + 2 * group * kDsElements;
    const unsigned long long ds_desc0 =
        ptx::wgmma_descriptor(sDS0, DsTile::kMnMajorLbo, DsTile::kMnMajorSbo, ptx::Swizzle::B128);
    const unsigned long long k_mn_desc =
        ptx::wgmma_descriptor(sK, KvTile::kMnMajorLbo, KvTile::kMnMajorSbo, ptx::Swizzle::B128);
    constexpr unsigned kDoOffset = sizeof(T) * kQElements, kStageBytes = 2 * kDoOffset;

    float dk[kDTiles][4], dv[kDTiles][4];
#pragma unroll
    for (int d = 0; d < kDTiles; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = 0.f;
    float(&dk_flat)[4 * kDTiles] = reinterpret_cast<float(&)[4 * kDTiles]>(dk);
    float(&dv_flat)[4 * kDTiles] = reinterpret_cast<float(&)[4 * kDTiles]>(dv);

    if (rows.more()) ptx::mbarrier_wait(&bars.kv_landed, 0);
    // K and V are the A operands of Sᵀ and dPᵀ for every query tile of the block. At D = 64 each
    // warp loads its 16 keys' fragments once (ldmatrix from the swizzled boxes, conflict-free:
    // a matrix's 8 rows hold its chunk at 8 different positions; 16 registers each) and those
    // products read A from registers: an m64n64k16 with both operands in shared memory takes as
    // many cycles of the SM's shared-memory bandwidth as of its tensor cores (the SASS audit's
    // shared_per_tensor: 1.08 for this loop with A from shared memory, 0.92 so). Not at D = 128,
    // where the 64 registers they would take are not there (kCarryDk), nor in builds with softcap,
    // whose state beside them spilled (NVRTC 13.5: 24-272 bytes in 8 of the 12 feature sets with
    // softcap, none without), nor with dropout and a mask (8 bytes with a bool mask, its Philox
    // rounds unrolled).
    constexpr bool kKvInRegisters = kHeadDim == 64 && !kSoftcapBuilt && !(kDropoutBuilt && kMaskBuilt != kMaskNone);
    constexpr int kKvFragments = kKvInRegisters ? kHeadDim / 16 : 1;
    unsigned k_frag[kKvFragments][4], v_frag[kKvFragments][4];
    if (kKvInRegisters && rows.more()) {
#pragma unroll
        for (int kk = 0; kk < kKvFragments; ++kk) {
            // matrices (rows 0-7, 8-15) x (dims 0-7, 8-15) of the warp's keys: the A fragment's order
            const int at_kv = KvTile::swizzled(64 * group + 16 * warp + lane % 16, 16 * kk + 8 * (lane / 16));
            ptx::ldmatrix<4>(k_frag[kk], sK + at_kv);
            ptx::ldmatrix<4>(v_frag[kk], sV + at_kv);
        }
    }
    // Pᵀ and dSᵀ as A fragments (16 queries each), read by the dV and dK products until a wait
    // retires them (the next Sᵀ's, which may be the next tile's; dQ's; the last): declared out
    // here, so that they keep their registers until then.
    unsigned pa[kSubM / 16][4], da[kSubM / 16][4];
    unsigned(&pa_flat)[kSubM / 4] = reinterpret_cast<unsigned(&)[kSubM / 4]>(pa);
    unsigned(&da_flat)[kSubM / 4] = reinterpret_cast<unsigned(&)[kSubM / 4]>(da);
    // stage_at: the stage this tile reads; release_at (kCarryDk): the previous tile's, released
    // once its dK and dV are in, which this tile's first wait tells.
    StageCursor<kQueryStages> stage_at, release_at;
    for (TileWalk at_tile = rows; at_tile.more(); at_tile.advance(), stage_at.advance()) {
        const int m0 = at_tile.tile * kBlockM, stage = stage_at.stage;
        const unsigned long long q_desc = ptx::descriptor_plus(q_desc0, stage * kStageBytes);
        const unsigned long long do_desc = ptx::descriptor_plus(q_desc, kDoOffset);
        const unsigned long long q_mn_desc = ptx::descriptor_plus(q_mn_desc0, stage * kStageBytes);
        const unsigned long long do_mn_desc = ptx::descriptor_plus(q_mn_desc, kDoOffset);
        consumer_wait(bars.queries, stage_at);

        const int ds_buffer = at_tile.visits() % 2;
        T* ds_tile = sDS + ds_buffer * kDsElements;
        // Checks for the block's 128 keys (a block mask's tiles are the block's).
        const int checks = b.tile_checks(p, m0, kBlockM, n0, kBwdKeys);
        // acc += Aᵀ·B over the stage's rows q0..q0 + kSubM - 1 as one commit group: dV (A = Pᵀ,
        // B = dO) or dK (dSᵀ, Q); A's fragments packed since the last wgmma.fence, B MN-major from
        // b_desc's stage.
        auto issue_rows_product = [&](float(&acc)[4 * kDTiles], unsigned(&a)[kSubM / 16][4],
                                      unsigned long long b_desc, int q0) {
            ptx::fence_operands(reinterpret_cast<unsigned(&)[kSubM / 4]>(a));
            ptx::fence_operands(acc);
            ptx::wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kSubM / 16; ++kk) {
                const unsigned rows = sizeof(T) * QTile::offset(q0 + 16 * kk, 0);  // queries q0 + 16kk..
                ptx::wgmma_m64k16_rs<T, kHeadDim, ptx::Major::MN>(acc, a[kk], ptx::descriptor_plus(b_desc, rows), 1);
            }
            ptx::wgmma_commit();
        };
        auto issue_dk = [&](int q0) { issue_rows_product(dk_flat, da, q_mn_desc, q0); };
#pragma unroll
        for (int q0 = 0; q0 < kBlockM; q0 += kSubM) {  // the stage's rows, kSubM at a time
            // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (64 keys x kSubM queries), 16 head dims per instruction.
            float st[kQTiles][4], dpt[kQTiles][4];
            float(&st_flat)[4 * kQTiles] = reinterpret_cast<float(&)[4 * kQTiles]>(st);
            float(&dpt_flat)[4 * kQTiles] = reinterpret_cast<float(&)[4 * kQTiles]>(dpt);
            ptx::fence_operands(st_flat);
            ptx::fence_operands(dpt_flat);
            ptx::wgmma_fence();
            // acc = A·Bᵀ over the head dims, A the group's keys of K or V (kv_desc, or their
            // fragments), B the stage's rows q0.. of Q or dO (b_desc), K-major both.
            auto issue_keys_product = [&](float(&acc)[4 * kQTiles], const unsigned(&a)[kKvFragments][4],
                                          unsigned long long kv_desc, unsigned long long b_desc) {
#pragma unroll
                for (int kk = 0; kk < kHeadDim / 16; ++kk) {
                    const unsigned long long b_dims = ptx::descriptor_plus(b_desc, sizeof(T) * QTile::offset(q0, 16 * kk));
                    if constexpr (kKvInRegisters)
                        ptx::wgmma_m64k16_rs<T, kSubM, ptx::Major::K>(acc, a[kk], b_dims, kk > 0);
                    else
                        ptx::wgmma_m64k16_ss<T, kSubM, ptx::Major::K>(
                            acc, ptx::descriptor_plus(kv_desc, sizeof(T) * KvTile::offset(0, 16 * kk)), b_dims, kk > 0);
                }
                ptx::wgmma_commit();
            };
            issue_keys_product(st_flat, k_frag, k_desc, q_desc);  // Sᵀ a group of its own: Pᵀ is worked out while dPᵀ is multiplied
            issue_keys_product(dpt_flat, v_frag, v_desc, do_desc);
            // Sᵀ is in; so are the previous rows' dV and dK (this tile's, or the previous tile's):
            // their fragments are free, and at q0 = 0 the previous tile's stage.
            ptx::wgmma_wait<1>();
            ptx::fence_operands(st_flat);
            ptx::fence_operands(pa_flat);
            ptx::fence_operands(da_flat);
            ptx::fence_operands(dk_flat);
            ptx::fence_operands(dv_flat);
            if (kCarryDk && q0 == 0 && at_tile.visits() > 0) {
                consumer_release(bars.queries, release_at);
                release_at.advance();
            }

            // Pᵀ in place of Sᵀ, packed, and dV += Pᵀ·dO issued, while dPᵀ is multiplied; then
            // dSᵀ in place of dPᵀ while dV is.
            DsFactors<kQTiles> ds;
            probabilities<true>(st, ds, p, b, score, dropout, sLse2(stage) + q0, m0 + q0, group_n0, warp * 16, g, t,
                                checks);
#pragma unroll
            for (int kk = 0; kk < kSubM / 16; ++kk) accumulators_as_a<T>(pa[kk], st[2 * kk], st[2 * kk + 1]);
            issue_rows_product(dv_flat, pa, do_mn_desc, q0);
            ptx::wgmma_wait<1>();  // dPᵀ is in
            ptx::fence_operands(dpt_flat);
            ds_from_probabilities(ds, dpt, sDelta(stage) + q0, t);

            // For dQ, dSᵀ's fragments also go to this group's buffer of the tile's parity as they
            // are: register r of 16-query step kk holds key 16·warp + g (+ 8 for odd r), queries
            // q0 + 16kk + 2t, + 1 (+ 8 from r = 2), one 4-byte store each, without bank conflicts
            // in the swizzled box. A warp writes a buffer again two tiles on, past the dQ barrier
            // of the tile between, which every warp reaches only once its dQ product of the buffer
            // (if it had one) is complete.
#pragma unroll
            for (int kk = 0; kk < kSubM / 16; ++kk) {
                accumulators_as_a<T>(da[kk], dpt[2 * kk], dpt[2 * kk + 1]);
                if constexpr (kAccumulateDq) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        T* slot = ds_tile + DsTile::swizzled(16 * warp + g + 8 * (r & 1), q0 + 16 * kk + 8 * (r >> 1) + 2 * t);
                        ATTN_STORE_SHARED(slot, 4);
                        *reinterpret_cast<unsigned*>(slot) = da[kk][r];
                    }
                }
            }
            // The stage's last rows' dK waits for the tile's dQ product (below), so that dQ's
            // reductions overlap dK's multiply-adds.
            if (!kAccumulateDq || q0 + kSubM < kBlockM) issue_dk(q0);
        }

        // This group's dQ product of the tile (kBlockM queries, 64 dims, the block's 128 keys
        // reduced), if it has one: product j goes to group (j + visits · kDqProducts) mod 2, once
        // both groups stored their dS and made it visible to wgmma. Then the last rows' dK, and
        // dQ's reductions once dQ is in (FlashAttention-3's order: the reductions overlap dK's
        // multiply-adds); a group without a product (at D = 64, every other tile) issues that
        // dK before the barrier. A wgmma.fence before dQ although it reads no register: the first
        // wgmma since a wait (the emulator's rule, stricter than the PTX ISA's). dq_product is
        // lane 0's, so that ptxas knows the branch to be uniform in the warp (at D = 64 it
        // serialised the dropout build's wgmma in a divergent path otherwise).
        if constexpr (kAccumulateDq) {
            const int dq_product =
                __shfl_sync(0xffffffffu, (group + at_tile.visits() * kDqProducts) % kBwdConsumerGroups, 0);
            // Both groups' dS stored and visible to wgmma (the barrier in each arm: the SASS
            // audit's paths then see the arms as the alternatives they are).
            auto ds_stored = [&] {
                ptx::fence_proxy_async();
                ptx::named_barrier_sync(kGroupsBarrier, 128 * kBwdConsumerGroups);
            };
            if (dq_product >= kDqProducts) {
                issue_dk(kBlockM - kSubM);
                ds_stored();
            } else {
                ds_stored();
                const unsigned long long ds_desc = ptx::descriptor_plus(ds_desc0, ds_buffer * sizeof(T) * kDsElements);
                // At D = 128 the k-steps' descriptors of K for dQ, hoisted out of the loop, spilled 12
                // bytes (NVRTC 13.5); recomputed per tile they cost a uniform add each.
                const unsigned long long k_dq = ptx::descriptor_plus(kHeadDim >= 128 ? ptx::opaque(k_mn_desc) : k_mn_desc,
                                                                     sizeof(T) * KvTile::offset(0, kDqDims * dq_product));
                float dq[kQueryRowTiles][kDqDims / 8][4];
                float(&dq_flat)[kQueryRowTiles * kDqDims / 2] = reinterpret_cast<float(&)[kQueryRowTiles * kDqDims / 2]>(dq);
                ptx::wgmma_fence();
#pragma unroll
                for (int r = 0; r < kQueryRowTiles; ++r)
#pragma unroll
                    for (int kk = 0; kk < kBwdKeys / 16; ++kk) {
                        // keys 16kk..: those of group kk / 4's dSᵀ (its buffers 2 apart)
                        const unsigned ds_at = 2 * (kk / 4) * kDsElements + DsTile::offset(16 * (kk % 4), 64 * r);
                        ptx::wgmma_m64k16_ss<T, kDqDims, ptx::Major::MN, ptx::Major::MN>(
                            reinterpret_cast<float(&)[kDqDims / 2]>(dq_flat[r * kDqDims / 2]),
                            ptx::descriptor_plus(ds_desc, sizeof(T) * ds_at),
                            ptx::descriptor_plus(k_dq, sizeof(T) * KvTile::offset(16 * kk, 0)), kk > 0);
                    }
                ptx::wgmma_commit();
                issue_dk(kBlockM - kSubM);
                ptx::wgmma_wait<1>();  // dQ is in (and the last rows' dV); dK may not be
                ptx::fence_operands(dq_flat);
                const DqTile dq_tile(p, b, at, dq_accum, m0);
#pragma unroll
                for (int r = 0; r < kQueryRowTiles; ++r)
                    add_dq_fragments<kHeadDim, kBlockM>(p, dq_tile, dq[r], 64 * r + 16 * warp, kDqDims * dq_product, g, t);
            }
        }
        if constexpr (!kCarryDk) {  // dK and dV are in registers, and the stage is free
            ptx::wgmma_wait<0>();
            ptx::fence_operands(dk_flat);
            ptx::fence_operands(dv_flat);
            consumer_release(bars.queries, stage_at);
        }
    }
    if constexpr (kCarryDk) {
        // The last tile's dK and dV are in registers, and its stage is free. (The wait whether or
        // not the block had a tile: ptxas cannot tell that a block without one has no wgmma in
        // flight, and injects a wait of its own, C7517.)
        ptx::wgmma_wait<0>();
        ptx::fence_operands(dk_flat);
        ptx::fence_operands(dv_flat);
        if (rows.more()) consumer_release(bars.queries, release_at);
    }

    // dK (times scale) and dV out through shared memory and TMA, which clips keys past seq_k and
    // dims past the head. Once both groups are done with K, V and the last stage, group 0 stages
    // its rows in K and V's place and group 1 in the stages' (dK, then dV, in swizzled boxes of
    // 128-byte lines: float32 for a GQA group, else the input type); one thread per group stores
    // them (or adds them to its kv head's).
    ptx::named_barrier_sync(kGroupsBarrier, 128 * kBwdConsumerGroups);
    unsigned char* staging = reinterpret_cast<unsigned char*>(group == 0 ? sK : sQ0);
    auto store_staged = [&](auto* s_dk, auto* s_dv, auto layout) {
        using Layout = decltype(layout);
        ptx::fence_proxy_async();  // the group's stores, visible to the TMA store
        ptx::named_barrier_sync(kStagedBarrier + group, 128);
        if (threadIdx.x % 128 == 0) {
            const bool add = dkdv_out == kDkdvFloatAdded;
            for (int c = 0; c < kHeadDim / Layout::kBoxCols; ++c) {
                const int box[4] = {c * Layout::kBoxCols, group_n0, add ? b.bidh_kv : b.bidh, b.bidb};
                const auto* at_dk = s_dk + Layout::offset(0, c * Layout::kBoxCols);
                const auto* at_dv = s_dv + Layout::offset(0, c * Layout::kBoxCols);
                if (add) {
                    ptx::tma_reduce_add<4>(maps.dk, box, at_dk);
                    ptx::tma_reduce_add<4>(maps.dv, box, at_dv);
                } else {
                    ptx::tma_store<4>(maps.dk, box, at_dk);
                    ptx::tma_store<4>(maps.dv, box, at_dv);
                }
            }
            ptx::bulk_commit();
            ptx::bulk_wait_read<0>();  // shared memory must outlive the stores' reads of it
        }
    };
    constexpr unsigned kOutElements = 64 * kHeadDim;
    static_assert(2 * sizeof(float) * kOutElements <= sizeof(T) * 2 * kKvElements &&
                  2 * sizeof(float) * kOutElements <= sizeof(T) * kQueryStages * 2 * kQElements,
                  "a group's dK and dV fit in K and V's, and in the stages', shared memory");
    if (dkdv_out == kDkdvInputType) {
        // 16-bit pairs of the accumulator layout: one 4-byte store each, 32 banks per warp.
        using OutTile = SwizzledBoxLayout<64, kHeadDim>;
        T* s_dk = reinterpret_cast<T*>(staging);
        T* s_dv = s_dk + kOutElements;
        const auto rows = [&](int row, int col) { return OutTile::swizzled(16 * warp + row, col); };
        stage_pairs<T>(dk, {p.scale, p.scale}, lane, s_dk, rows);
        stage_pairs<T>(dv, {1.f, 1.f}, lane, s_dv, rows);
        store_staged(s_dk, s_dv, OutTile{});
        return;
    }
    using OutTile = SwizzledBoxLayout<64, kHeadDim, 4>;
    float* s_dk = reinterpret_cast<float*>(staging);
    float* s_dv = s_dk + kOutElements;
    // Each store writes, in lanes t = 2, 3, the pair of 8-dim tile d ^ 2 instead of d (a select,
    // not an index: the tiles stay in registers): 8-byte stores go in half-warps, and with the
    // swizzle's chunk order the lanes t = 0, 1 and t = 2, 3 of a half-warp would otherwise hit
    // the same 4 chunks of 16 bytes (two wavefronts each; now one).
    static_assert(kDTiles % 4 == 0, "tiles d and d ^ 2 both exist");
    const bool other_half = t & 2;
#pragma unroll
    for (int d = 0; d < kDTiles; ++d)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = 16 * warp + g + 8 * r, dim = 8 * (other_half ? d ^ 2 : d) + 2 * t;
            // Values selected, not pointers: a pointer into dk or dv would put them in local memory.
            auto pick = [&](const float (&acc)[kDTiles][4], int e) { return other_half ? acc[d ^ 2][e] : acc[d][e]; };
            float* at_dk = s_dk + OutTile::swizzled(key, dim);
            float* at_dv = s_dv + OutTile::swizzled(key, dim);
            ATTN_STORE_SHARED(at_dk, 8);
            *reinterpret_cast<float2*>(at_dk) = make_float2(pick(dk, 2 * r) * p.scale, pick(dk, 2 * r + 1) * p.scale);
            ATTN_STORE_SHARED(at_dv, 8);
            *reinterpret_cast<float2*>(at_dv) = make_float2(pick(dv, 2 * r), pick(dv, 2 * r + 1));
        }
    store_staged(s_dk, s_dv, OutTile{});
}

}  // namespace attn

// grid (pairs per section, ceil(Sk / 128), sections) (key_block_place), block 384 threads (a
// producer warpgroup and two consumers), dynamic shared memory as laid out in dkdv_wgmma_block
// (HopperBackwardTile.shared_bytes). q_map, k_map, v_map, do_map: TMA maps of q, k, v and dout
// (head dims, rows, heads, batch) with 128-byte swizzle and boxes of 64 head dims x kBlockM query
// rows (q, dout) or 128 keys (k, v); dk_map, dv_map: of dK, dV (head dims, keys, heads, batch) as
// dkdv_out (attn::DkdvOut) says: T or float32 per query head, or float32 per kv head, zeroed, to
// add to; 128-byte swizzle, boxes of one 128-byte line (32 or 64 dims) x 64 keys. Those six are read and written through them
// only (the pointers and strides of q, k, v and dout in ATTN_PARAMS go unused). With kAccumulateDq,
// dS·K (without the scale) is added to dq_accum (float32, per query head, zeroed); without, the
// deterministic dQ kernel runs after and dq_accum goes unused. A template argument, not a run-time
// one: ptxas allocating one kernel for both loops spilled 124 bytes at D = 128 (NVRTC 13.5),
// either alone none. Compiled for sm_90a only.
template <class T, int kHeadDim, int kBlockM, bool kAccumulateDq>
__global__ void __launch_bounds__(attn::kBwdThreads, 1)
attention_bwd_dkdv_wgmma(const float* lse, const float* delta, float* dq_accum, int dkdv_out,
                         const __grid_constant__ ptx::TensorMap q_map, const __grid_constant__ ptx::TensorMap k_map,
                         const __grid_constant__ ptx::TensorMap v_map, const __grid_constant__ ptx::TensorMap do_map,
                         const __grid_constant__ ptx::TensorMap dk_map, const __grid_constant__ ptx::TensorMap dv_map,
                         ATTN_PARAMS) {
    ATTN_UNPACK_PARAMS;
    const attn::BackwardMaps maps{q_map, k_map, v_map, do_map, dk_map, dv_map};
    attn::dkdv_wgmma_block<T, kHeadDim, kBlockM, kAccumulateDq>(p, lse, delta, dq_accum,
                                                                static_cast<attn::DkdvOut>(dkdv_out), strides, maps);
}
