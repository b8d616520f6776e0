"""Hopper synchronisation in ptx.cuh and its emulated twins: mbarriers (arrivals, transaction
counts, phases), named barriers, elect.sync, setmaxnreg and the async proxy's fence, each against a
hand-computed case and a deliberately wrong use; and the real instructions through NVRTC and SASS."""
from pathlib import Path

import numpy as np
import pytest

from cupy_attn import _nvrtc, _paths, _sass
from cupy_attn.emulator import EmulatorCompileError, EmulatorError, RawModule

HERE = Path(__file__).parent / "emulator_kernels"
SCHEDULES = ["forward", "reverse", "random", "warps", "warps_reverse"]
I32 = np.int32
SOURCE = (HERE / "hopper_sync.cu").read_text()


def module(*options):
    return RawModule(SOURCE, options=("-I" + str(_paths.kernel_dir()), *options))


@pytest.fixture(scope="module")
def sync():
    return module()


# ---- mbarrier: one thread's scripts against hand-computed phases -------------------------------
INIT, ARRIVE, ARRIVE_EXPECT_TX, COMPLETE_TX, TEST_WAIT, WAIT, OVERWRITE, ARRIVE_MISALIGNED = range(8)


def run_script(mod, steps):
    script = np.array(steps, np.int32).ravel()
    results = np.full(64, -1, np.int32)
    mod.get_function("mbarrier_script")(1, 1, (script, I32(len(steps)), results), shared_mem=16)
    return [int(r) for r in results[results >= 0]]


def test_mbarrier_phase_completes_after_arrivals_and_transactions(sync):
    steps = [
        (INIT, 2),
        (TEST_WAIT, 1),             # parity 1: the phase "before the first" counts as complete -> 1
        (TEST_WAIT, 0),             # phase 0 in progress -> 0
        (ARRIVE_EXPECT_TX, 48),     # 1 of 2 arrivals, 48 bytes announced
        (TEST_WAIT, 0),             # -> 0
        (ARRIVE, 0),                # 2 of 2 arrivals, but 48 bytes outstanding
        (TEST_WAIT, 0),             # -> 0
        (COMPLETE_TX, 32),
        (TEST_WAIT, 0),             # 16 bytes outstanding -> 0
        (COMPLETE_TX, 16),          # phase 0 completes; phase 1 expects 2 arrivals again
        (TEST_WAIT, 0),             # -> 1
        (TEST_WAIT, 1),             # phase 1 in progress -> 0
        (ARRIVE, 0), (ARRIVE, 0),   # phase 1 completes without transactions
        (TEST_WAIT, 1),             # -> 1
        (ARRIVE, 0), (ARRIVE, 0),   # phase 2 completes
        (WAIT, 0),                  # returns at once
        (TEST_WAIT, 1),             # phase 3 in progress -> 0
    ]
    assert run_script(sync, steps) == [1, 0, 0, 0, 0, 1, 0, 1, 0]


def test_mbarrier_transactions_may_complete_before_they_are_announced(sync):
    # The count goes below zero first (a copy landed before the producer's expect-tx): no completion
    # until the arrival brings both to zero.
    steps = [(INIT, 1), (COMPLETE_TX, 64), (TEST_WAIT, 0), (ARRIVE_EXPECT_TX, 64), (TEST_WAIT, 0)]
    assert run_script(sync, steps) == [0, 1]


TX_LIMIT = 2**20 - 1  # the transaction count's range is [-TX_LIMIT, TX_LIMIT]


def test_mbarrier_transaction_count_reaches_both_ends_of_its_range(sync):
    steps = [(INIT, 2), (ARRIVE_EXPECT_TX, TX_LIMIT - 16), (ARRIVE_EXPECT_TX, 16), (TEST_WAIT, 0),
             (COMPLETE_TX, TX_LIMIT), (TEST_WAIT, 0),
             (COMPLETE_TX, TX_LIMIT), (TEST_WAIT, 1), (ARRIVE_EXPECT_TX, TX_LIMIT), (ARRIVE, 0), (TEST_WAIT, 1)]
    assert run_script(sync, steps) == [0, 1, 0, 1]


@pytest.mark.parametrize("steps,message", [
    ([(ARRIVE, 0)], "mbarrier.arrive: no mbarrier is initialised at shared offset 0"),
    ([(INIT, 1), (ARRIVE_MISALIGNED, 0)], "not 8-byte aligned"),
    ([(INIT, 1), (OVERWRITE, 0), (ARRIVE, 0)], "was overwritten by a store to its 8 bytes"),
    ([(INIT, 0)], r"arrival count 0 is outside \[1, 2\^20 - 1\]"),
    # Phases 0 and 1 complete while the thread last saw none: parity 0 now names phase 2.
    ([(INIT, 1), (ARRIVE, 0), (ARRIVE, 0), (TEST_WAIT, 0)],
     "invalid phase use: parity 0 means phase 0 to this thread, but the mbarrier at shared offset 0 has "
     "completed phases up to 1"),
    # The thread saw phase 0; phases 1 and 2 complete; parity 1 means phase 1, which is two behind.
    ([(INIT, 1), (ARRIVE, 0), (WAIT, 0), (ARRIVE, 0), (ARRIVE, 0), (WAIT, 1)], "invalid phase use: parity 1 means phase 1"),
    # Two arrivals where the phase expects one (the first leaves 16 bytes outstanding).
    ([(INIT, 1), (ARRIVE_EXPECT_TX, 16), (ARRIVE, 0)], "an arrival beyond the 1 the phase expects"),
    # A second init of a valid mbarrier (PTX: undefined without mbarrier.inval, which ptx.cuh lacks).
    ([(INIT, 1), (ARRIVE, 0), (INIT, 1)], "mbarrier.init: shared offset 0 holds a valid mbarrier already"),
    # The transaction count leaves [-(2^20 - 1), 2^20 - 1]: summed over two announcements, or two
    # copies that landed before their announcements.
    ([(INIT, 2), (ARRIVE_EXPECT_TX, TX_LIMIT), (ARRIVE_EXPECT_TX, 1)],
     f"mbarrier.arrive.expect_tx: the transaction count of the mbarrier at shared offset 0 would be {TX_LIMIT + 1}"),
    ([(INIT, 1), (COMPLETE_TX, TX_LIMIT), (COMPLETE_TX, 1)],
     f"mbarrier.complete_tx: the transaction count of the mbarrier at shared offset 0 would be {-TX_LIMIT - 1}"),
    # A store over a valid mbarrier that nothing uses afterwards: found at the block's end.
    ([(INIT, 1), (OVERWRITE, 0)], "at the block's end, the mbarrier at shared offset 0 was overwritten"),
    # A wait that nothing completes.
    ([(INIT, 1), (WAIT, 0)], r"thread\(s\) \[0\] wait for phase 0 of the mbarrier at shared offset 0 \(1 of 1 "
                             r"arrivals pending, transaction count 0\)"),
])
def test_mbarrier_misuse_is_reported(sync, steps, message):
    with pytest.raises(EmulatorError, match=message):
        run_script(sync, steps)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("threads", [32, 96])
def test_mbarrier_rounds_exchange_through_shared_memory(sync, schedule, threads):
    rounds = 5
    x = np.random.default_rng(threads).standard_normal((rounds, threads)).astype(np.float32)
    out = np.full_like(x, np.nan)
    sync.get_function("mbarrier_rounds")(1, threads, (x, out, I32(rounds)), shared_mem=16 + 8 * threads,
                                         schedule=schedule, seed=3)
    want = sum(np.roll(x.astype(np.float64), -j, axis=1) for j in range(8))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_mbarrier_wrong_parity_fails():
    mod = module("-DWRONG_PARITY")
    rounds, threads = 5, 64
    x = np.random.default_rng(1).standard_normal((rounds, threads)).astype(np.float32)
    want = sum(np.roll(x.astype(np.float64), -j, axis=1) for j in range(8))
    for schedule in SCHEDULES:
        out = np.full_like(x, np.nan)
        try:
            mod.get_function("mbarrier_rounds")(1, threads, (x, out, I32(rounds)), shared_mem=16 + 8 * threads,
                                                schedule=schedule)
        except EmulatorError as error:
            assert "invalid phase use" in str(error) or "deadlock" in str(error)
            continue
        assert not np.allclose(out, want, rtol=1e-5, atol=1e-5), schedule


def test_mbarrier_deadlock_names_the_waiters(sync):
    with pytest.raises(EmulatorError, match=r"deadlock in block \(0, 0, 0\): thread\(s\) \[0, 1, .*31\] wait for "
                                            r"phase 0 of the mbarrier at shared offset 0 \(1 of 2 arrivals pending"):
        sync.get_function("mbarrier_deadlock")(1, 32, (np.zeros(32, np.int32),), shared_mem=8)


@pytest.mark.parametrize("schedule,message", [
    # thread 31 runs first and finds no mbarrier
    ("reverse", "no mbarrier is initialised at shared offset 0"),
    # thread 0 initialises first, and thread 1 uses the mbarrier before a barrier published the init
    ("forward", "mbarrier.arrive: the mbarrier at shared offset 0, initialised by thread 0, is used by thread 1 before "
                "a barrier published its init"),
])
def test_mbarrier_init_without_a_barrier_before_use_fails(schedule, message):
    # mbarrier_rounds without its __syncthreads after init.
    source = SOURCE.replace("    if (t == 0) ptx::mbarrier_init(bar, n);\n    __syncthreads();",
                            "    if (t == 0) ptx::mbarrier_init(bar, n);")
    assert source != SOURCE
    mod = RawModule(source, options=("-I" + str(_paths.kernel_dir()),))
    x = np.zeros((1, 32), np.float32)
    with pytest.raises(EmulatorError, match=message):
        mod.get_function("mbarrier_rounds")(1, 32, (x, np.zeros_like(x), I32(1)), shared_mem=16 + 8 * 32,
                                            schedule=schedule)


@pytest.mark.parametrize("kernel", ["mbarrier_in_one_warp", "mbarrier_after_named_barrier"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_mbarrier_init_ordered_by_a_barrier_serves_the_threads_it_orders(sync, kernel, schedule):
    # __syncwarp for its warp; a named barrier for the threads waiting at it
    out = np.zeros(64, np.int32)
    sync.get_function(kernel)(1, 64, (I32(0), out), shared_mem=16, schedule=schedule)
    assert (out == 1).all()


def test_mbarrier_init_ordered_by_syncwarp_does_not_serve_another_warp(sync):
    with pytest.raises(EmulatorError,
                       match=r"initialised by thread 0, is used by thread (3[2-9]|[45]\d|6[0-3]) before a barrier published"):
        sync.get_function("mbarrier_in_one_warp")(1, 64, (I32(1), np.zeros(64, np.int32)), shared_mem=16)


def test_mbarrier_init_does_not_serve_threads_that_only_arrived_at_the_barrier(sync):
    # The reverse schedule runs warp 1 first: it arrives and goes on before thread 0 initialised
    # (no mbarrier yet); the forward one, after (not ordered after the init).
    for schedule, message in (("forward", r"initialised by thread 0, is used by thread \d+ before a barrier published"),
                              ("reverse", "no mbarrier is initialised at shared offset 0")):
        with pytest.raises(EmulatorError, match=message):
            sync.get_function("mbarrier_after_named_barrier")(1, 64, (I32(1), np.zeros(64, np.int32)), shared_mem=16,
                                                              schedule=schedule)


# ---- named barriers -----------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_named_barriers_alternate_two_warps(sync, schedule):
    rounds = 6
    order = np.full(2 * rounds, -1, np.int32)
    sync.get_function("ping_pong")(1, 64, (order, I32(rounds)), shared_mem=16, schedule=schedule, seed=5)
    np.testing.assert_array_equal(order, np.arange(2 * rounds))


def test_named_barriers_with_too_small_a_count_do_not_alternate():
    mod = module("-DWRONG_COUNT")
    rounds = 6
    broken = []
    for schedule in SCHEDULES:
        order = np.full(2 * rounds, -1, np.int32)
        mod.get_function("ping_pong")(1, 64, (order, I32(rounds)), shared_mem=16, schedule=schedule)
        broken.append(not np.array_equal(order, np.arange(2 * rounds)))
    assert any(broken)


@pytest.mark.parametrize("mode,threads,message", [
    (0, 64, r"bar.sync: barrier id 0 is not in 1..15 \(0 is __syncthreads'\)"),
    (1, 64, r"bar.sync 1: the thread count 48 is not a multiple of 32 in \[32, 64\]"),
    (2, 128, "bar.sync 1: this thread arrives with count (96|64) while .* arrived with count (64|96)"),
    (3, 64, r"bar.arrive 2: this thread arrives a second time before the barrier completed \(\d+ of 64 arrived\)"),
    (4, 64, r"thread\(s\) \[0, 1, .*31\] wait at named barrier 3 \(32 of 64 arrived\)"),
    # stricter than the PTX ISA: the kernels complete every generation (the persistent forward's
    # last turn completes group 1's last hand-over)
    (5, 64, r"at the block's end, named barrier 4 holds 32 of its 64 arrivals \(a generation no thread completed\)"),
    (6, 64, r"bar.sync 5: lanes of warp 0 reach different barrier instructions \(bar.sync at <kernel source>:\d+, "
            r"this lane bar.sync at <kernel source>:\d+\)"),
])
def test_named_barrier_misuse_is_reported(sync, mode, threads, message):
    with pytest.raises(EmulatorError, match=message):
        sync.get_function("named_barrier_misuse")(1, threads, (I32(mode),))


def test_warps_may_reach_a_named_barrier_at_instructions_of_their_own(sync):
    sync.get_function("named_barrier_misuse")(1, 64, (I32(7),))


# ---- elect.sync ----------------------------------------------------------------------------------
MASKS = np.array([0xFFFFFFFF, 0x0000FFFF, 0x80000001, 0x00F00F00, 0x00000004], np.uint32)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_elect_picks_one_lane_of_each_mask(sync, seed):
    out = np.zeros((len(MASKS), 32), np.int32)
    sync.get_function("elect_lanes")(1, 32, (MASKS, I32(len(MASKS)), out), seed=seed)
    for m, mask in enumerate(MASKS):
        inside = np.array([(int(mask) >> lane) & 1 for lane in range(32)], bool)
        assert (out[m][~inside] == -1).all()
        assert set(out[m][inside]) <= {0, 1}, "a lane was elected once and not the second time"
        assert out[m][inside].sum() == 1


def test_elect_does_not_always_pick_the_lowest_lane(sync):
    # Code that assumes lane 0 leads must fail on some seed.
    leaders = set()
    for seed in range(8):
        out = np.zeros((1, 32), np.int32)
        sync.get_function("elect_lanes")(1, 32, (MASKS[:1], I32(1), out), seed=seed)
        leaders.add(int(np.flatnonzero(out[0] == 1)[0]))
    assert len(leaders) > 1


def test_elect_from_a_mask_without_the_calling_lane_fails(sync):
    with pytest.raises(EmulatorError, match="elect.sync called with mask 0xfffffffe, which excludes the calling lane 0"):
        sync.get_function("elect_outside_mask")(1, 32, (np.zeros(32, np.int32),))


# ---- setmaxnreg -----------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["forward", "warps", "reverse", "warps_reverse"])
@pytest.mark.parametrize("mode", [0, 4])
def test_setmaxnreg_producer_and_consumers(sync, mode, schedule):
    # "warps": warp 0 lowers and waits at the barrier before its second setmaxnreg until warps 1-3
    # lowered. The reverse schedules run the consumers' .inc first, which waits until the
    # producer's .dec returned the registers.
    out = np.zeros(384, np.int32)
    sync.get_function("max_registers")(1, 384, (I32(mode), out), schedule=schedule)
    assert (out == 1).all()


@pytest.mark.parametrize("mode,threads,message", [
    (1, 384, r"warps of warpgroup 0 execute setmaxnreg.dec (24|32) and setmaxnreg.dec (32|24)"),
    (2, 384, r"warp \d+ waits in setmaxnreg.inc 256: the block's warps hold \d+ of the launch's 64512 registers "
             r"\(168 per thread of 384\)"),
    (5, 384, r"warp [0-3] waits in setmaxnreg.inc 32: the block's warps hold 6[45]\d{3} of the launch's 64512"),
    (6, 384, r"warp ([4-9]|1[01]) waits in setmaxnreg.inc 240: the block's warps hold 64512 of the launch's 64512"),
    (7, 384, "setmaxnreg.dec 240: warp [0-3] holds at most the launch's 168 registers per thread"),
    (3, 384, "setmaxnreg.inc 232: warp [4-7] holds 240 registers per thread already"),
    (0, 96, "setmaxnreg: the block's 96 threads are not whole warpgroups of 128"),
])
def test_setmaxnreg_misuse_is_reported(sync, mode, threads, message):
    with pytest.raises(EmulatorError, match=message):
        sync.get_function("max_registers")(1, threads, (I32(mode), np.zeros(threads, np.int32)))


def test_setmaxnreg_without_the_warpgroup_synchronising_in_between_fails_on_some_schedule(sync):
    # Mode 8: warp 0 runs ahead in the "warps" schedule; round-robin ones happen to keep the warps
    # in step.
    out = np.zeros(384, np.int32)
    sync.get_function("max_registers")(1, 384, (I32(8), out), schedule="forward")
    with pytest.raises(EmulatorError, match="setmaxnreg: warp 0 executes its warpgroup's setmaxnreg number 2 before "
                                            "warp 1 executed number 1"):
        sync.get_function("max_registers")(1, 384, (I32(8), out), schedule="warps")


def test_setmaxnreg_refuses_an_illegal_count_at_compile_time():
    with pytest.raises(EmulatorCompileError, match="setmaxnreg takes 24..256 registers, a multiple of 8"):
        module("-DILLEGAL_COUNT").get_function("max_registers")


# ---- the real instructions ------------------------------------------------------------------------
# What each kernel's SASS must hold on sm_90a: ptxas accepted our inline PTX and lowered it to the
# Hopper synchronisation units.
SASS_OPCODES = {
    "mbarrier_script": ["SYNCS.EXCH.64", "SYNCS.ARRIVE.TRANS64", "SYNCS.PHASECHK.TRANS64"],
    "mbarrier_rounds": ["SYNCS.EXCH.64", "SYNCS.ARRIVE.TRANS64", "SYNCS.PHASECHK.TRANS64.TRYWAIT"],
    "ping_pong": ["BAR.SYNC", "BAR.ARV"],
    "elect_lanes": ["ELECT"],
    "max_registers": ["USETMAXREG"],
}


@pytest.mark.parametrize("kernel", sorted(SASS_OPCODES))
def test_primitives_compile_for_sm90a_to_the_hopper_instructions(kernel):
    pytest.importorskip("cupy_attn._nvrtc")
    compiled = _nvrtc.compile_kernel(SOURCE, kernel, "sm_90a", ("-std=c++17", f"-I{_paths.kernel_dir()}"))
    instructions, _ = _sass.disassemble(compiled.cubin)
    opcodes = {i.opcode for i in instructions}
    for wanted in SASS_OPCODES[kernel]:
        assert any(op.startswith(wanted) for op in opcodes), (wanted, sorted(opcodes))
