#include "ptx.cuh"
// Hopper synchronisation primitives of ptx.cuh: mbarriers, named barriers, elect.sync, setmaxnreg.
// The same file compiles with NVRTC for sm_90a (test_emulator_hopper.py checks the SASS), so it
// uses nothing the GPU lacks. -DWRONG_PARITY, -DWRONG_COUNT and -DILLEGAL_COUNT build deliberately
// wrong uses that the tests expect to fail.

// The operations of mbarrier_script: one thread runs a list of (op, argument) pairs on one
// mbarrier and records what each test_wait returned, so a test can compare with a hand-computed
// sequence of phases.
enum ScriptOp { kInit, kArrive, kArriveExpectTx, kCompleteTx, kTestWait, kWait, kOverwrite, kArriveMisaligned };

extern "C" __global__ void mbarrier_script(const int* script, int steps, int* results) {
    extern __shared__ __align__(16) unsigned long long bars[];
    int recorded = 0;
    for (int i = 0; i < steps; ++i) {
        const int op = script[2 * i], argument = script[2 * i + 1];
        if (op == kInit) ptx::mbarrier_init(bars, argument);
        else if (op == kArrive) ptx::mbarrier_arrive(bars);
        else if (op == kArriveExpectTx) ptx::mbarrier_arrive_expect_tx(bars, argument);
        else if (op == kCompleteTx) ptx::mbarrier_complete_tx(bars, argument);
        else if (op == kTestWait) results[recorded++] = ptx::mbarrier_test_wait(bars, argument);
        else if (op == kWait) ptx::mbarrier_wait(bars, argument);
        else if (op == kOverwrite) bars[0] = 0;
        else if (op == kArriveMisaligned)
            ptx::mbarrier_arrive(reinterpret_cast<unsigned long long*>(reinterpret_cast<char*>(bars) + 4));
    }
}

// Every round, each thread publishes in[round][thread] in shared memory, arrives on an mbarrier
// that expects the whole block and waits for the round's phase; then out[round][thread] is the
// sum of the round's values of threads thread..thread+7 (mod n). Two slots alternate: a thread
// can be at most one round ahead of the slowest, which the barrier's phases guarantee.
extern "C" __global__ void mbarrier_rounds(const float* in, float* out, int rounds) {
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned long long* bar = reinterpret_cast<unsigned long long*>(smem);
    float* slots = reinterpret_cast<float*>(smem + 16);  // (2, n)
    const int n = blockDim.x, t = threadIdx.x;
    if (t == 0) ptx::mbarrier_init(bar, n);
    __syncthreads();
    for (int round = 0; round < rounds; ++round) {
        float* slot = slots + (round % 2) * n;
        slot[t] = in[round * n + t];
        ptx::mbarrier_arrive(bar);
#ifdef WRONG_PARITY
        ptx::mbarrier_wait(bar, (round + 1) & 1);
#else
        ptx::mbarrier_wait(bar, round & 1);
#endif
        float sum = 0.f;
        for (int j = 0; j < 8; ++j) sum += slot[(t + j) % n];
        out[round * n + t] = sum;
    }
}

// Lane 0 initialises for its warp, whose __syncwarp orders the init before the warp's arrivals;
// with `both_warps`, warp 1 (whose own __syncwarp orders nothing for it) arrives too: a misuse.
extern "C" __global__ void mbarrier_in_one_warp(int both_warps, int* out) {
    extern __shared__ __align__(16) unsigned long long bars[];
    if (threadIdx.x == 0) ptx::mbarrier_init(bars, both_warps ? 64 : 32);
    __syncwarp();
    if (threadIdx.x < 32 || both_warps) {
        ptx::mbarrier_arrive(bars);
        ptx::mbarrier_wait(bars, 0);
    }
    out[threadIdx.x] = 1;
}

// Thread 0 initialises; named barrier 1 of both warps orders the init before warp 1's arrivals,
// which wait at it (bar.sync), or, with `arrive_only`, go on at once (bar.arrive): a misuse.
extern "C" __global__ void mbarrier_after_named_barrier(int arrive_only, int* out) {
    extern __shared__ __align__(16) unsigned long long bars[];
    if (threadIdx.x == 0) ptx::mbarrier_init(bars, 32);
    if (threadIdx.x < 32 || !arrive_only) ptx::named_barrier_sync(1, 64);
    else ptx::named_barrier_arrive(1, 64);
    if (threadIdx.x >= 32) ptx::mbarrier_arrive(bars);
    ptx::mbarrier_wait(bars, 0);
    out[threadIdx.x] = 1;
}

// Two arrivals expected, one made: every thread waits forever.
extern "C" __global__ void mbarrier_deadlock(int* out) {
    extern __shared__ __align__(16) unsigned long long bars[];
    if (threadIdx.x == 0) ptx::mbarrier_init(bars, 2);
    __syncthreads();
    if (threadIdx.x == 0) ptx::mbarrier_arrive(bars);
    ptx::mbarrier_wait(bars, 0);
    out[threadIdx.x] = 1;
}

// Ping-pong on two named barriers, as two consumer warpgroups take turns (here two warps): warp g
// waits at barrier 1 + g for its turn (its own 32 threads and the other warp's 32 arrivals), takes
// a ticket, then signals the other warp's barrier. order[2 * round + g] is the ticket warp g took in
// `round`: 0, 1, 2, ... when the turns alternate.
extern "C" __global__ void ping_pong(int* order, int rounds) {
    extern __shared__ __align__(16) int ticket[];
    const int warp = threadIdx.x / 32, other = 1 - warp;
#ifdef WRONG_COUNT
    const unsigned count = 32;
#else
    const unsigned count = 64;
#endif
    if (threadIdx.x == 0) ticket[0] = 0;
    __syncthreads();
    if (warp == 1) ptx::named_barrier_arrive(1, count);  // warp 0 goes first
    for (int round = 0; round < rounds; ++round) {
        ptx::named_barrier_sync(1 + warp, count);
        if (threadIdx.x % 32 == 0) order[2 * round + warp] = ticket[0]++;
        __syncwarp();
        if (round + 1 < rounds || warp == 0) ptx::named_barrier_arrive(1 + other, count);
    }
}

// Misuses of named barriers, one per mode (64 or more threads).
extern "C" __global__ void named_barrier_misuse(int mode) {
    const int warp = threadIdx.x / 32;
    if (mode == 0) ptx::named_barrier_sync(0, 64);                    // id 0 is __syncthreads'
    else if (mode == 1) ptx::named_barrier_sync(1, 48);               // not whole warps
    else if (mode == 2) ptx::named_barrier_sync(1, warp ? 96 : 64);   // counts disagree
    else if (mode == 3 && warp == 0) {                                // warp 0 arrives twice
        ptx::named_barrier_arrive(2, 64);
        ptx::named_barrier_arrive(2, 64);
    } else if (mode == 4 && warp == 0) ptx::named_barrier_sync(3, 64);  // warp 1 never comes
    else if (mode == 5 && warp == 0) ptx::named_barrier_arrive(4, 64);   // a hand-over nobody takes
    else if (mode == 6) {  // warp 0's lanes at two bar.sync instructions (not .aligned), warp 1 at a third
        if (warp == 1) ptx::named_barrier_sync(5, 64);
        else if (threadIdx.x < 16) ptx::named_barrier_sync(5, 64);
        else ptx::named_barrier_sync(5, 64);
    } else if (mode == 7) {  // the same instruction for every lane of a warp, warps at instructions of their own
        if (warp == 0) ptx::named_barrier_sync(6, 64);
        else ptx::named_barrier_arrive(6, 64);
    }
}

// out[m][lane] = 1 where lane was elected for masks[m] (twice, to check it is the same lane), 0
// where it was not, -1 outside the mask.
extern "C" __global__ void elect_lanes(const unsigned* masks, int count, int* out) {
    const unsigned lane = threadIdx.x % 32;
    for (int m = 0; m < count; ++m) {
        int result = -1;
        if (masks[m] >> lane & 1u) {
            const bool first = ptx::elect_one(masks[m]);
            const bool again = ptx::elect_one(masks[m]);
            result = first == again ? first : 2;
        }
        out[m * 32 + lane] = result;
    }
}

// A lane elects from a mask that leaves it out.
extern "C" __global__ void elect_outside_mask(int* out) {
    out[threadIdx.x] = ptx::elect_one(0xfffffffeu);
}

// setmaxnreg by warpgroup, as a producer/consumer kernel does (mode 0, 384 threads: the producer
// warpgroup lowers to 24, the two consumer warpgroups raise to 240, 64512 registers, all the launch
// gives; a consumer warp that gets there first waits for the producer's registers; mode 4: the
// consumers raise to 232 and the producer, after a barrier of its warpgroup, to 32 again), and
// misuses: 1 warps of one warpgroup disagree; 2 every warpgroup raises to 256 (98304 registers);
// 3 a consumer "raises" from 240 to 232; 5 the producer raises to 32 again once the consumers hold
// 240 (65536: more than the launch's 64512); 6 the consumers raise and the producer warpgroup
// exits without lowering; 7 the producer "lowers" to 240 from the launch's 168; 8 mode 4 without
// the barrier between the producer's two setmaxnreg. In 2, 5 and 6 an .inc waits forever.
// out[thread] = 1 once it passed.
extern "C" __global__ void __launch_bounds__(384, 1) max_registers(int mode, int* out) {
    const int warpgroup = threadIdx.x / 128, warp = threadIdx.x / 32;
    if (mode == 0 || mode == 3 || mode == 4 || mode == 5 || mode == 8) {
        if (warpgroup == 0) ptx::set_max_registers<24, false>();
        else if (mode == 4 || mode == 8) ptx::set_max_registers<232, true>();
        else ptx::set_max_registers<240, true>();
        if (mode == 3 && warpgroup == 1) ptx::set_max_registers<232, true>();
        if ((mode == 4 || mode == 5 || mode == 8) && warpgroup == 0) {
            if (mode != 8) ptx::named_barrier_sync(1, 128);  // the warpgroup synchronises in between
            ptx::set_max_registers<32, true>();
        }
    } else if (mode == 1) {
        if (warp == 0) ptx::set_max_registers<24, false>();
        else ptx::set_max_registers<32, false>();
    } else if (mode == 2) {
        ptx::set_max_registers<256, true>();
    } else if (mode == 6) {
        if (warpgroup == 0) return;
        ptx::set_max_registers<240, true>();
    } else if (mode == 7) {
        if (warpgroup == 0) ptx::set_max_registers<240, false>();
    }
#ifdef ILLEGAL_COUNT
    ptx::set_max_registers<20, false>();
#endif
    out[threadIdx.x] = 1;
}
