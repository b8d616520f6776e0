"""Barrier mutations: removing any __syncthreads / __syncwarp (or cp.async / wgmma / mbarrier wait,
the fence.proxy.async that makes generic writes of shared memory visible to wgmma, the wgmma.fence
that orders a thread's register accesses before a wgmma, or the producer's setmaxnreg.dec that the
consumers' setmaxnreg.inc waits for) from an attention kernel must make some emulated case fail in
some schedule. Not listed: fence.mbarrier_init, which the kernels of one block keep only so that
they stay correct in a cluster (ptx.cuh). A file's mutants are all built into one module and
chosen at run time (mutant_schema), not built one by one."""
import collections
import ctypes
import functools
import re

import numpy as np
import pytest

import cupy_attn
from cupy_attn import _compile, _config, _kernel_backend
from cupy_attn.emulator import EmulatorCompileError, EmulatorError, RawModule
from helpers import random_qkv

BARRIERS = ("__syncthreads();", "__syncwarp();", "ptx::cp_async_wait<0>();", "ptx::wgmma_wait<0>();",
            # the mma.sync forward at D = 256: Q's copies landed (its own group) before its rows go
            # to registers
            "ptx::cp_async_wait<1>();",
            "ptx::wgmma_wait<1>();", "ptx::fence_proxy_async();",
            # the warp-specialised wgmma forward: Q's TMA copies landed, and the consumers done
            # with the previous work tile's Q before the next one's overwrites it; the stage ring's
            # waits (kernels/pipeline.cuh: a consumer's for the data, the producer's for a free
            # stage); a consumer group's O staged before its TMA store, whose reads of it must be
            # done before the block exits and, persistent, before the next work tile's O is staged
            # (its storing thread waits, then the group); the consumer groups' turns at the tensor
            # cores (a protocol: without the wait the other group's arrivals pile up, which the
            # emulator reports); the block's next work tile posted by the producer before the
            # consumers read it, and read by all of them before the producer posts the one after
            "ptx::mbarrier_wait(&bars.q_landed, q_tiles & 1);",
            "ptx::mbarrier_wait(&bars.q_free, (q_tiles - 1) & 1);",
            "ptx::mbarrier_wait(&bars.work_posted, posted_phase);",
            "ptx::mbarrier_wait(&bars.work_read, read_phase);",
            "ptx::mbarrier_wait(&ring.full[at.stage], at.phase);",
            "ptx::mbarrier_wait(&ring.empty[at.stage], at.phase ^ 1);",
            "ptx::named_barrier_sync(kStagedBarrier + group, 128);", "ptx::bulk_wait_read<0>();",
            "ptx::named_barrier_sync(kTurnBarrier + group, 256);",
            # the warp-specialised wgmma dK/dV: K and V landed; both consumer groups' dS stored
            # before either reads them for dQ, and both done with K, V and the stages before
            # either stages dK, dV over them (its dK, dV staged before the TMA store: the
            # forward's kStagedBarrier line above)
            "ptx::mbarrier_wait(&bars.kv_landed, 0);",
            "ptx::named_barrier_sync(kGroupsBarrier, 128 * kBwdConsumerGroups);",
            # both warp-specialised kernels: the producer's registers, which the consumers take
            "ptx::set_max_registers<kProducerRegisters, false>();",
            "ptx::set_max_registers<kBwdProducerRegisters, false>();",
            # every wgmma kernel: a wgmma needs a wgmma.fence since the thread's last wgmma wait
            "ptx::wgmma_fence();")
KERNEL_FILES = ("attention_fwd.cu", "attention_fwd_tc.cu", "attention_fwd_wgmma.cu", "attention_bwd.cu",
                "attention_bwd_tc.cu", "attention_bwd_wgmma.cu", "attention_decode.cu")


def barrier_sites(filename):
    source = _compile.kernel_source(filename)
    return [(filename, at, b) for b in BARRIERS for at in range(len(source)) if source.startswith(b, at)]


SITES = [site for f in KERNEL_FILES for site in barrier_sites(f)]


def results(filename):
    """What the kernels of ``filename`` compute on cases with several query and key tiles."""
    rng = np.random.default_rng(13)
    if filename == "attention_decode.cu":
        return decode_results(rng)
    dtype = np.float32 if filename in ("attention_fwd.cu", "attention_bwd.cu") else np.float16  # fp16: tensor cores
    if filename.startswith("attention_fwd"):
        # The wgmma forward's 176-key tiles (D = 32 pads to 64): three, so the third reloads the
        # first one's stage.
        q, k, v = random_qkv(rng, b=1, h=2, sq=150, sk=400 if "wgmma" in filename else 200, d=32, dtype=dtype)
        outs = [cupy_attn.attention(q, k, v, backend="emulator")]
        if filename == "attention_fwd_tc.cu":  # D = 256: each warp's rows of Q loaded into registers once
            q, k, v = random_qkv(rng, b=1, h=2, sq=70, sk=40, d=256, dtype=dtype)
            outs.append(cupy_attn.attention(q, k, v, backend="emulator"))
        if "wgmma" in filename:  # a build with a score feature: tiles of 128 keys, rows one after the other
            outs.append(cupy_attn.attention(q, k, v, softcap=5.0, backend="emulator"))
            # work tiles without keys, whose next work tile the consumers read at once, among
            # others: 8 on the emulator's 3 SMs
            q, k, v = random_qkv(rng, b=2, h=2, sq=150, sk=200, d=32, dtype=dtype)
            outs.append(cupy_attn.attention(q, k, v, kv_lengths=np.array([200, 0], np.int32), backend="emulator"))
        return outs
    # D = 256 too: its tensor-core dK/dV tile splits key groups over two warps, which exchange
    # partial sums through shared memory (and D = 128, whose deterministic dQ kernel holds its rows
    # of Q in registers); the wgmma dK/dV at D = 128, where each consumer group
    # takes one of dQ's two products of 64 head dims every tile (at D = 32 they take turns), over
    # three query tiles (a dS buffer written again) and a key block whose second group has none.
    extra = {"attention_bwd_tc.cu": [dict(sq=40, sk=70, d=256), dict(sq=40, sk=70, d=128)], "attention_bwd_wgmma.cu": [dict(sq=150, sk=130, d=128)]}
    cases = [dict(sq=150, sk=200, d=32)] + extra.get(filename, [])
    grads = []
    for case in cases:
        q, k, v = random_qkv(rng, b=1, h=2, dtype=dtype, **case)
        out, lse = cupy_attn.attention(q, k, v, return_lse=True)
        dout = rng.standard_normal(out.shape).astype(dtype)
        for deterministic in (False, True):
            grads += cupy_attn.attention_backward(dout, q, k, v, out, lse, backend="emulator", deterministic=deterministic)
    return grads


@functools.lru_cache(maxsize=None)
def unmutated_results(filename):
    """What the source's kernels compute (results), and by build options the kernels of
    ``filename`` that ran: a mutated source is built once per options with all of them (one g++ run
    per kernel took 1.6 times as long for attention_bwd_tc.cu's six)."""
    kernels = collections.defaultdict(set)
    real_function = _compile.function

    def recording(target, name, name_expression, features=_config.PLAIN_FEATURES, packed=False, mods=None):
        if name == filename:
            kernels[features, packed].add(name_expression)
        return real_function(target, name, name_expression, features=features, packed=packed, mods=mods)

    _compile.function = recording
    try:
        return results(filename), {options: sorted(names) for options, names in kernels.items()}
    finally:
        _compile.function = real_function


def decode_results(rng):
    """attention_with_kvcache over a paged cache of several key tiles, 8 query heads on one kv head
    and 2 queries (every row of a block): fp16 in two K/V stages, with one split and with three;
    fp32 at D = 256, whose one stage is reloaded behind a barrier."""
    outs = []
    for dtype, d, splits in ((np.float16, 32, 1), (np.float16, 32, 3), (np.float32, 256, 1)):
        k_cache, v_cache = (rng.standard_normal((12, 16, 1, d)).astype(dtype) for _ in range(2))
        table = rng.permutation(12).reshape(2, 6).astype(np.int32)
        q = rng.standard_normal((2, 2, 8, d)).astype(dtype)
        outs.append(cupy_attn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.array([90, 41], np.int32),
                                                     block_table=table, causal=True, num_splits=splits,
                                                     backend="emulator"))
    return outs


def test_every_kernel_has_barriers():
    assert {f for f, _, _ in SITES} == set(KERNEL_FILES)


MUTANT = "cupy_attn_mutant"
MUTANT_DECLARATION = f'extern "C" __attribute__((visibility("default"))) int {MUTANT} = -1;\n'
SCHEDULES = ("forward", "reverse", "random", "warps", "warps_reverse")


def fences_for_syncthreads(filename, at):
    """Whether the fence at `at` comes right before a __syncthreads (past the end of its block):
    the wgmma forward's fence of the ones it stores at D = 64, before the block's first use of the
    async proxy, whose stores the emulator lets any thread's later fence publish (emu_async.cpp).
    There one thread fencing after the barrier is not told apart from every thread fencing before
    it; removing the fence is (test_removing_a_barrier_breaks_a_kernel)."""
    source = _compile.kernel_source(filename)
    return source[source.index("\n", at):].lstrip().lstrip("}").lstrip().startswith("__syncthreads();")


FENCE = "ptx::fence_proxy_async();"
FENCE_SITES = [(f, at) for f, at, b in SITES if b == FENCE and not fences_for_syncthreads(f, at)]


def mutants(filename):
    """The mistakes made in ``filename``, numbered: each barrier removed (SITES), then each fence
    moved after its barrier into one thread per warpgroup (FENCE_SITES)."""
    return ([("remove", at, barrier) for f, at, barrier in SITES if f == filename]
            + [("fence after", at, FENCE) for f, at in FENCE_SITES if f == filename])


@functools.lru_cache(maxsize=None)
def mutant_schema(filename):
    """The source of ``filename`` with every mutant in it, each behind a test of the global MUTANT
    (-1: none), so that one g++ build serves them all (a build per mutant took 5 of each test's
    6.5 s). A removed barrier becomes an empty statement, so that a condition guarding it guards
    nothing rather than the statement after it; a moved fence is skipped before its barrier and
    issued after it, by one thread per warpgroup."""
    source = _compile.kernel_source(filename)
    edits = []  # (start, end, replacement), not overlapping
    conditions = collections.defaultdict(list)  # the mutants that skip the statement at an offset
    for number, (kind, at, barrier) in enumerate(mutants(filename)):
        conditions[at, barrier].append(number)
        if kind == "fence after":
            line_end = source.index("\n", at)
            fence_barrier = source.index("ptx::named_barrier_sync(", line_end)  # the fence's barrier, next
            assert source[line_end:fence_barrier].strip() == ""
            after = source.index(";", fence_barrier) + 1
            edits.append((after, after, f" if ({MUTANT} == {number} && threadIdx.x % 128 == 0) {FENCE}"))
    for (at, barrier), numbers in conditions.items():
        kept = " && ".join(f"{MUTANT} != {n}" for n in numbers)
        edits.append((at, at + len(barrier), f"{{ if ({kept}) {barrier} }}"))
    edits.sort(reverse=True)
    assert all(later[0] >= end for later, (_, end, _) in zip(edits, edits[1:])), "mutants overlap"
    for start, end, replacement in edits:
        source = source[:start] + replacement + source[end:]
    return MUTANT_DECLARATION + source


def choose(module, mutant):
    ctypes.c_int.from_address(module.get_global(MUTANT)).value = mutant


def schema_runner(monkeypatch, filename):
    """What the source's kernels compute (results) and a function of (mutant, schedule) that
    computes it with the kernels of ``filename`` built from its mutant schema, ``mutant`` chosen,
    in ``schedule``, with outputs poisoned."""
    if "wgmma" in filename:  # the emulator stands in for an sm_90 device
        monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    want, kernels = unmutated_results(filename)
    real_function = _compile.function
    modules = {}

    def function(target, name, name_expression, features=_config.PLAIN_FEATURES, packed=False, mods=None):
        if name != filename:
            return real_function(target, name, name_expression, features=features, packed=packed, mods=mods)
        assert mods is None and name_expression in kernels[features, packed], (name_expression, features, packed)
        if (features, packed) not in modules:
            modules[features, packed] = RawModule(mutant_schema(filename), options=_compile.feature_options(features, packed),
                                                  name_expressions=kernels[features, packed])
        module = modules[features, packed]
        choose(module, chosen[0])
        return module.get_function(name_expression)

    chosen = [-1]
    monkeypatch.setattr(_compile, "function", function)
    monkeypatch.setattr(_kernel_backend, "POISON_OUTPUTS", True)

    def run(mutant, schedule):
        chosen[0] = mutant
        monkeypatch.setattr(_kernel_backend, "EMULATOR_SCHEDULE", schedule)
        try:
            return results(filename)
        finally:  # a module's library is loaded once, for all the file's tests
            for module in modules.values():
                choose(module, -1)

    return want, run


def assert_breaks(monkeypatch, filename, mutant, what):
    """The kernels of ``filename`` with ``mutant`` give another result than the source's in some
    schedule, or the emulator reports the misuse."""
    want, run = schema_runner(monkeypatch, filename)

    def breaks(schedule):
        try:
            got = run(mutant, schedule)
        except EmulatorCompileError:  # the schema must compile
            raise
        except EmulatorError:  # the emulator caught the misuse itself (e.g. an mbarrier used before its init)
            return True
        return any(not np.allclose(g, w, atol=1e-3) for g, w in zip(got, want))

    # the first schedule that shows the mistake is enough
    assert any(breaks(s) for s in SCHEDULES), \
        f"{what} changed nothing in any schedule"


@pytest.mark.parametrize("filename", KERNEL_FILES)
def test_each_mutant_guards_its_own_site(filename):
    """Mutant n's test stands at its own site (the same occurrence of its barrier as in the
    source), and without the tests the schema is the source."""
    source, schema = _compile.kernel_source(filename), mutant_schema(filename)
    guard = re.compile(rf"\{{ if \(((?:{MUTANT} != \d+(?: && )?)+)\) (.*?) \}}")
    moved = re.compile(rf" if \({MUTANT} == (\d+) && threadIdx.x % 128 == 0\) {re.escape(FENCE)}")
    guards = list(guard.finditer(schema))
    for number, (kind, at, barrier) in enumerate(mutants(filename)):
        [site] = [g for g in guards if str(number) in re.findall(r"\d+", g[1])]
        assert site[2] == barrier
        assert [g.start() for g in guards if g[2] == barrier].index(site.start()) \
            == [a for f, a, b in SITES if f == filename and b == barrier].index(at)
        if kind == "fence after":
            [after] = [m for m in moved.finditer(schema) if int(m[1]) == number]
            # right after the fence's barrier, the statement of the next line (guarded too if it is a site)
            assert re.fullmatch(r"(\{ if \([^)]*\) )?ptx::named_barrier_sync\([^;]*\);( \})?",
                                schema[site.end():after.start()].split("\n", 1)[1].strip())
    unguarded = moved.sub("", guard.sub(lambda g: g[2], schema))
    assert unguarded == MUTANT_DECLARATION + source


@pytest.mark.parametrize("filename", KERNEL_FILES)
def test_the_schema_without_a_mutant_computes_what_the_source_does(monkeypatch, filename):
    want, run = schema_runner(monkeypatch, filename)
    # two of the schedules a mutant's test tries: with its tests taken out the schema is the source
    # (test_each_mutant_guards_its_own_site), which the kernels' own tests run in every schedule
    for schedule in ("forward", "warps_reverse"):
        got = run(-1, schedule)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-3)


@pytest.mark.parametrize("filename,at,barrier", SITES, ids=[f"{f}@{at}:{b[:-3]}" for f, at, b in SITES])
def test_removing_a_barrier_breaks_a_kernel(monkeypatch, filename, at, barrier):
    assert_breaks(monkeypatch, filename, mutants(filename).index(("remove", at, barrier)),
                  f"removing {barrier} at offset {at} of {filename}")


@pytest.mark.parametrize("filename,at", FENCE_SITES, ids=[f"{f}@{at}" for f, at in FENCE_SITES])
def test_a_fence_by_one_thread_of_each_warpgroup_breaks_a_kernel(monkeypatch, filename, at):
    """Every thread that stored what wgmma or a TMA store reads fences its own stores before the
    barrier, not one thread of the warpgroup after it: the emulator holds the kernels to that
    convention (the CUDA Programming Guide's and CUTLASS's; emu_async.cpp)."""
    assert_breaks(monkeypatch, filename, mutants(filename).index(("fence after", at, FENCE)),
                  f"fencing after the barrier in one thread per warpgroup at offset {at} of {filename}")
