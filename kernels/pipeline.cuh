// The producer/consumer pipeline of warp-specialised Hopper kernels: a ring of kStages shared-
// memory stages that a producer fills (with TMA) and consumers read, each stage guarded by two
// mbarriers (ptx.cuh). `full` completes when the stage's data landed: the producer's arrival
// with the bytes it announced, the TMA copies completing them, and the arrivals of any producer
// threads that store into the stage themselves (StageRing::init's `producers`). `empty`
// completes when every consumer thread released the stage. Each side walks the ring with its own
// StageCursor; the parity it waits for flips every lap, which is what keeps a side from
// mistaking the previous lap's completion for this one's (the emulator reports a wait two phases
// behind).
#pragma once
#include "ptx.cuh"

// Whether a warp-specialised block's register split fits its launch: under
// __launch_bounds__(threads, 1) each thread starts with 65536 / threads registers, rounded down to
// 8 (the compile report asserts the kernels get exactly that), and setmaxnreg.inc waits until the
// block's pool holds what the consumers ask for, so a split over the launch's total would hang
// them. One producer warpgroup at `producer`, the other threads at `consumer`.
__host__ __device__ constexpr bool register_split_fits(int threads, int producer, int consumer) {
    return 128 * producer + (threads - 128) * consumer <= threads * (65536 / threads / 8 * 8);
}

template <int kStages>
struct StageRing {
    unsigned long long full[kStages];
    unsigned long long empty[kStages];

    // One thread, then ptx::fence_mbarrier_init (once after all its inits) and a block barrier:
    // `consumers` threads release each stage, `producers` threads arrive on its full barrier (one
    // announcing the bytes, the others once their own stores into the stage are done; in any
    // order: the phase needs every arrival and byte).
    __device__ __forceinline__ void init(unsigned consumers, unsigned producers = 1) {
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            ptx::mbarrier_init(&full[s], producers);
            ptx::mbarrier_init(&empty[s], consumers);
        }
    }
};

// A side's position in the ring: the stage it uses next and the parity of that stage's phase in
// the current lap.
template <int kStages>
struct StageCursor {
    int stage = 0;
    unsigned phase = 0;

    __device__ __forceinline__ void advance() {
        if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
        }
    }
};

// Producer: wait until the consumers released the stage (in the first lap it is free: waiting for
// the other parity passes at once).
template <int kStages>
__device__ __forceinline__ void producer_wait(StageRing<kStages>& ring, const StageCursor<kStages>& at) {
    ptx::mbarrier_wait(&ring.empty[at.stage], at.phase ^ 1);
}

// Producer: wait for the stage, then announce the bytes its copies will land and arrive.
template <int kStages>
__device__ __forceinline__ void producer_acquire(StageRing<kStages>& ring, const StageCursor<kStages>& at, unsigned bytes) {
    producer_wait(ring, at);
    ptx::mbarrier_arrive_expect_tx(&ring.full[at.stage], bytes);
}

// Consumer: wait until the stage's data landed.
template <int kStages>
__device__ __forceinline__ void consumer_wait(StageRing<kStages>& ring, const StageCursor<kStages>& at) {
    ptx::mbarrier_wait(&ring.full[at.stage], at.phase);
}

// Consumer: this thread is done reading the stage (its reads completed: wgmma's waited for; generic
// loads followed by ptx::fence_proxy_async, since TMA's next write of the stage goes through the
// async proxy, as CUTLASS's and FlashAttention-3's epilogues fence).
template <int kStages>
__device__ __forceinline__ void consumer_release(StageRing<kStages>& ring, const StageCursor<kStages>& at) {
    ptx::mbarrier_arrive(&ring.empty[at.stage]);
}
