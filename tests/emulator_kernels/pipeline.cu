#include "pipeline.cuh"
// A warp-specialised copy through pipeline.cuh's ring of kStages TMA stages, as a FlashAttention-3
// forward moves K and V: warpgroup 0 produces (lowers its registers; one elected thread loads
// tile i, 8 rows of 64 fp16 with 128-byte swizzle, into stage i % kStages), warpgroup 1 consumes
// (raises its registers, copies each stage's bytes to out[tile], releases the stage). The same
// file compiles with NVRTC for sm_90a. Deliberately wrong uses, each of which a test expects to
// fail: -DNO_EMPTY_WAIT (the producer overwrites stages still being read), -DNO_FULL_WAIT (the
// consumers read before the data landed), -DWRONG_PARITY (the consumers wait for the wrong lap).
constexpr int kStages = 3, kTileBytes = 8 * 64 * 2, kConsumers = 128;

extern "C" __global__ void __launch_bounds__(256, 1)
pipelined_copy(const __grid_constant__ ptx::TensorMap map, int tiles, unsigned char* out) {
    extern __shared__ __align__(1024) unsigned char smem[];
    StageRing<kStages>& ring = *reinterpret_cast<StageRing<kStages>*>(smem);
    unsigned char* stages = smem + 1024;  // kStages x 1 KB, each one swizzle atom
    if (threadIdx.x == 0) {
        ring.init(kConsumers);
        ptx::fence_mbarrier_init();
    }
    __syncthreads();
    StageCursor<kStages> at;
    if (threadIdx.x < 128) {
        ptx::set_max_registers<40, false>();
        if (threadIdx.x < 32 && ptx::elect_one()) {
            for (int tile = 0; tile < tiles; ++tile, at.advance()) {
#ifdef NO_EMPTY_WAIT
                ptx::mbarrier_arrive_expect_tx(&ring.full[at.stage], kTileBytes);
#else
                producer_acquire(ring, at, kTileBytes);
#endif
                ptx::tma_load<2>(stages + at.stage * kTileBytes, map, {0, 8 * tile}, &ring.full[at.stage]);
            }
        }
    } else {
        ptx::set_max_registers<232, true>();
        for (int tile = 0; tile < tiles; ++tile, at.advance()) {
#if defined(WRONG_PARITY)
            ptx::mbarrier_wait(&ring.full[at.stage], at.phase ^ 1);
#elif !defined(NO_FULL_WAIT)
            consumer_wait(ring, at);
#endif
            for (int i = threadIdx.x - 128; i < kTileBytes; i += kConsumers)
                out[tile * kTileBytes + i] = stages[at.stage * kTileBytes + i];
            ptx::fence_proxy_async();  // these generic reads, before TMA's next write of the stage
            consumer_release(ring, at);
        }
    }
}
