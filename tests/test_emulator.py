"""The emulator: CUDA execution semantics on the CPU, checked against NumPy."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cupy_attn import _paths
from cupy_attn.emulator import EmulatorCompileError, EmulatorError, RawModule

HERE = Path(__file__).parent / "emulator_kernels"
SCHEDULES = ["forward", "reverse", "random", "warps", "warps_reverse"]


def module(name, options=(), names=None):
    return RawModule((HERE / name).read_text(), options=("-I" + str(_paths.kernel_dir()),) + tuple(options),
                     name_expressions=names)


@pytest.fixture(scope="module")
def basics():
    return module("basics.cu")


@pytest.fixture(scope="module")
def warp():
    return module("warp.cu")


I32 = np.int32


def test_indices_3d(basics):
    grid, block = (3, 2, 2), (4, 3, 2)
    n = np.prod(grid) * np.prod(block)
    out = np.full(6 * n, -1, np.int32)
    basics.get_function("indices")(grid, block, (out,))
    got = out.reshape(grid[::-1] + block[::-1] + (6,))
    bz, by, bx, tz, ty, tx = np.indices(grid[::-1] + block[::-1])
    want = np.stack([tx, ty, tz, bx, by, bz], axis=-1)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kernel", ["reverse_static", "reverse_dynamic"])
def test_shared_memory_with_barrier(basics, kernel, schedule):
    x = np.random.default_rng(0).standard_normal(4 * 256).astype(np.float32)
    out = np.full_like(x, np.nan)
    basics.get_function(kernel)(4, 256, (x, out), shared_mem=256 * 4, schedule=schedule, seed=3)
    np.testing.assert_array_equal(out, x.reshape(4, 256)[:, ::-1].ravel())


def test_missing_barrier_is_caught_by_some_schedule():
    mod = module("basics.cu", ["-DMISSING_BARRIER"])
    x = np.arange(256, dtype=np.float32)
    wrong = 0
    for schedule in SCHEDULES:
        out = np.full_like(x, np.nan)
        mod.get_function("reverse_static")(1, 256, (x, out), schedule=schedule, seed=1)
        wrong += not np.array_equal(out, x[::-1])
    assert wrong >= 1


def test_dynamic_shared_memory_is_poisoned(basics):
    out = np.zeros(64, np.float32)
    basics.get_function("read_unwritten")(1, 64, (out,), shared_mem=64 * 4)
    assert np.isnan(out).all()


def test_exited_threads_do_not_block_barriers(basics):
    out = np.zeros(64, np.int32)
    basics.get_function("early_exit")(1, 64, (out,), schedule="reverse")
    assert (out[::2] == 7).all() and (out[1::2] == 0).all()


@pytest.mark.parametrize("pred", [[1] * 64, [0] * 64, [1, 0] * 32])
def test_barrier_votes(basics, pred):
    out = np.zeros(3, np.int32)
    basics.get_function("barrier_votes")(1, 64, (np.array(pred, np.int32), out))
    assert out.tolist() == [sum(pred), int(all(pred)), int(any(pred))]


def shuffle_sources(mask, mode, arg, width):
    """CUDA's documented shuffle semantics: the lane each participating lane reads."""
    sources = {}
    for lane in range(32):
        if not mask >> lane & 1:
            continue
        seg = lane // width * width
        if mode == 0:
            src = seg + arg % width
        elif mode == 1:
            src = lane - arg if lane - seg - arg >= 0 else lane
        elif mode == 2:
            src = lane + arg if lane - seg + arg < width else lane
        else:
            src = lane ^ arg
            src = lane if src >= seg + width else src
        sources[lane] = src
    return sources


# Partial masks with every combination whose reads stay inside the mask (reading a lane outside
# it is undefined on hardware, and an error in the emulator: tested separately).
SHUFFLE_CASES = [(mask, mode, arg, width)
                 for mask in (0xFFFFFFFF, 0x0000FFFF, 0xF0F0F0F0)
                 for mode, arg in ((0, 3), (0, 13), (1, 1), (1, 5), (2, 2), (2, 7), (3, 1), (3, 6))
                 for width in (32, 16, 8, 4)
                 if all(mask >> s & 1 for s in shuffle_sources(mask, mode, arg, width).values())]


@pytest.mark.parametrize("mask,mode,arg,width", SHUFFLE_CASES)
def test_shuffles(warp, mask, mode, arg, width):
    values = np.random.default_rng(mode * 97 + arg).integers(0, 1000, 32).astype(np.int32)
    want = np.full(32, -1)
    for lane, src in shuffle_sources(mask, mode, arg, width).items():
        want[lane] = values[src]
    out = np.zeros(32, np.int32)
    warp.get_function("shuffle")(1, 32, (values, out, np.uint32(mask), I32(mode), I32(arg), I32(width)))
    np.testing.assert_array_equal(out, want)


def test_shuffle_of_lane_outside_mask_is_an_error(warp):
    with pytest.raises(EmulatorError, match="reads lane 20, which is not in the mask 0x0000ffff"):
        warp.get_function("shuffle")(1, 32, (np.arange(32, dtype=np.int32), np.zeros(32, np.int32),
                                             np.uint32(0xFFFF), I32(0), I32(20), I32(32)))


def test_shuffle_of_doubles(warp):
    x = np.random.default_rng(1).standard_normal(64)
    out = np.zeros(64)
    warp.get_function("shuffle_double")(1, 64, (x, out))
    np.testing.assert_array_equal(out, x[np.arange(64) ^ 5])


@pytest.mark.parametrize("mask", [0xFFFFFFFF, 0x00FF00FF, 0x80000001])
def test_votes(warp, mask):
    pred = np.random.default_rng(mask % 1000).integers(0, 2, 64).astype(np.int32)
    out = np.zeros(3 * 64, np.uint32)
    warp.get_function("votes")(1, 64, (pred, out, np.uint32(mask)), schedule="random")
    out = out.reshape(64, 3)
    for t in range(64):
        lane, w = t % 32, t // 32
        if not mask >> lane & 1:
            assert (out[t] == 0xDEADBEEF).all()
            continue
        members = [l for l in range(32) if mask >> l & 1]
        ballot = sum(1 << l for l in members if pred[w * 32 + l])
        assert out[t].tolist() == [ballot, int(ballot != 0), int(ballot == mask)]


def test_warp_reduction_across_blocks(warp):
    x = np.random.default_rng(2).standard_normal(8 * 64).astype(np.float32)
    out = np.zeros_like(x)
    warp.get_function("warp_sum")(8, 64, (x, out), workers=3)
    np.testing.assert_allclose(out, np.repeat(x.reshape(-1, 32).sum(1), 32), rtol=1e-5, atol=1e-5)


def test_atomics_across_parallel_blocks(warp):
    blocks, threads = 24, 96
    fsum, isum, imax = np.zeros(1, np.float32), np.zeros(1, np.int32), np.zeros(1, np.int32)
    usum, cas = np.zeros(1, np.uint64), np.zeros(1, np.int32)
    warp.get_function("atomics")(blocks, threads, (fsum, isum, imax, usum, cas), workers=4, schedule="random")
    n = blocks * threads
    ids = np.arange(n)
    assert fsum[0] == 0.5 * n and isum[0] == ids.sum() and usum[0] == n and cas[0] == n
    assert imax[0] == ((ids * 7919) % 1000).max()


def test_deadlock_names_block_warp_and_lanes(basics):
    with pytest.raises(EmulatorError) as info:
        basics.get_function("deadlock_exit")((2, 1, 1), 64, (np.zeros(64, np.float32),))
    message = str(info.value)
    assert "deadlock in block (0, 0, 0)" in message or "deadlock in block (1, 0, 0)" in message
    assert "warp 0 waits in __shfl_sync with mask 0xffffffff; missing lanes [0] (exited or absent: [0])" in message


def test_deadlock_between_barrier_and_collective(basics):
    with pytest.raises(EmulatorError, match=r"missing lanes \[3\] \(at __syncthreads: \[3\]\)"):
        basics.get_function("deadlock_barrier")(1, 32, (np.zeros(32, np.float32),))


def test_partial_warp_collective_deadlocks(warp):
    # 48 threads: warp 1 has only 16 lanes, so a full-mask shuffle can never complete.
    with pytest.raises(EmulatorError, match=r"warp 1 waits in __shfl_xor_sync .* missing lanes \[16, 17"):
        warp.get_function("warp_sum")(1, 48, (np.zeros(48, np.float32), np.zeros(48, np.float32)))


def test_collective_misuse(basics):
    with pytest.raises(EmulatorError, match="warp 0 diverged"):
        basics.get_function("diverged")(1, 32, (np.zeros(32, np.float32),))
    with pytest.raises(EmulatorError, match="excludes the calling lane"):
        basics.get_function("bad_mask")(1, 32, (np.zeros(32, np.float32),))
    with pytest.raises(EmulatorError, match=r"block \(2, 0, 0\), thread \(5, 0, 0\): __trap\(\) called"):
        basics.get_function("trap_kernel")(4, 32, (np.zeros(1, np.float32),))


def test_argument_checks(basics):
    typed = basics.get_function("typed")
    d, f = np.zeros(1), np.ones(1, np.float32)
    good = (d, f, I32(2), np.float32(3), np.int64(4), np.uint8(1))
    typed(1, 1, good)
    assert d[0] == 3 + 2 + 4 + 1
    bad = [
        ((d, f, 2, *good[3:]), r"argument 2 \(integer, 4 bytes\): got a Python int; pass a NumPy scalar"),
        ((d, f, np.int64(2), *good[3:]), r"argument 2 \(integer, 4 bytes\): got numpy.int64 \(8 bytes\)"),
        ((d, f, good[2], np.float64(3), *good[4:]), r"argument 3 \(float, 4 bytes\): got numpy.float64"),
        ((d, f, good[2], I32(3), *good[4:]), r"argument 3 \(float, 4 bytes\): got numpy.int32"),
        ((d, d, *good[2:]), "points to 4-byte elements but the array has dtype float64"),
        ((d, [1.0], *good[2:]), "expected a NumPy array or None, got list"),
        ((np.broadcast_to(d, (3,)), f, *good[2:]), "the array is read-only"),
        (good[:5], "takes 6 arguments, got 5"),
    ]
    for args, message in bad:
        with pytest.raises(TypeError, match=message):
            typed(1, 1, args)


def test_launch_checks(basics):
    fn = basics.get_function("reverse_dynamic")
    x = np.zeros(256, np.float32)
    with pytest.raises(ValueError, match="at most 1024"):
        fn(1, (64, 32), (x, x))
    with pytest.raises(ValueError, match="schedule must be one of"):
        fn(1, 256, (x, x), schedule="sideways")
    with pytest.raises(ValueError, match="grid must be a positive int"):
        fn(0, 256, (x, x))
    with pytest.raises(ValueError, match="set max_dynamic_shared_size_bytes first"):
        fn(1, 256, (x, x), shared_mem=64 * 1024)
    fn.max_dynamic_shared_size_bytes = 64 * 1024
    fn(1, 256, (x, x.copy()), shared_mem=64 * 1024)


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_a_bad_thread_count_in_the_environment_is_named(basics, monkeypatch, value):
    monkeypatch.setenv("CUPY_ATTN_EMULATOR_THREADS", value)
    x = np.zeros(256, np.float32)
    with pytest.raises(ValueError, match=f"CUPY_ATTN_EMULATOR_THREADS must be a positive integer .* got {value!r}"):
        basics.get_function("reverse_dynamic")(1, 256, (x, x))


def test_name_expressions(basics):
    mod = module("basics.cu", names=["scaled<3>"])
    out = np.zeros(8, np.float32)
    mod.get_function("scaled<3>")(1, 8, (out,))
    np.testing.assert_array_equal(out, 3 * np.arange(8))


def test_options_and_compile_errors():
    with pytest.raises(ValueError, match="option '--bogus' is not understood"):
        RawModule("", options=("--bogus",)).get_function("k")
    mod = RawModule('extern "C" __global__ void k(int* o) { o[0] = VALUE; }', options=("-DVALUE=41", "-arch=sm_90", "--use_fast_math"))
    out = np.zeros(1, np.int32)
    mod.get_function("k")(1, 1, (out,))
    assert out[0] == 41
    with pytest.raises(EmulatorCompileError, match="undeclared|not declared"):
        RawModule('extern "C" __global__ void k(int* o) { o[0] = nope; }').get_function("k")


def test_a_global_set_through_its_address_is_what_the_kernel_reads():
    import ctypes

    mod = RawModule('extern "C" __attribute__((visibility("default"))) int chosen = -1;\n'
                    'extern "C" __global__ void k(int* o) { o[threadIdx.x] = chosen + threadIdx.x; }')
    out = np.zeros(4, np.int32)
    mod.get_function("k")(1, 4, (out,))
    np.testing.assert_array_equal(out, np.arange(4) - 1)
    ctypes.c_int.from_address(mod.get_global("chosen")).value = 40
    mod.get_function("k")(1, 4, (out,))
    np.testing.assert_array_equal(out, np.arange(4) + 40)
    with pytest.raises(EmulatorError, match="no global variable named 'unchosen'"):
        mod.get_global("unchosen")


def test_cache_covers_local_headers(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_ATTN_EMULATOR_CACHE", str(tmp_path / "cache"))
    header = tmp_path / "value.cuh"
    code = '#include "value.cuh"\nextern "C" __global__ void k(int* o) { o[0] = VALUE; }'
    out = np.zeros(1, np.int32)
    for value in (5, 6):
        header.write_text(f"#define VALUE {value}\n")
        RawModule(code, options=(f"-I{tmp_path}",)).get_function("k")(1, 1, (out,))
        assert out[0] == value
    built = sorted((tmp_path / "cache").glob("*.so"))
    runtime = [p for p in built if p.name.startswith("libemu_runtime_")]
    assert len(built) == 3 and len(runtime) == 1  # two kernel modules and the runtime library, built once
    assert all(runtime[0].name.encode() in p.read_bytes() for p in built if p not in runtime)  # which both link
    RawModule(code, options=(f"-I{tmp_path}",)).get_function("k")
    assert sorted((tmp_path / "cache").glob("*.so")) == built  # a cache hit, no new build


def test_kernel_builds_read_the_precompiled_header(tmp_path):
    """g++ silently parses cuda_emu.h itself when its precompiled header does not fit a build's
    options: -H lists the header files a build reads, "! " marking a precompiled one it used."""
    from cupy_attn.emulator import _build

    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void k(int* o) { o[0] = VALUE; }')
    flags, includes = _build.translate_options(("-DVALUE=3", "-arch=sm_90", f"-I{tmp_path}"))
    used = _build.precompiled_header() / f"{_build.SHIM}.gch"
    for extra in ([], ["-O0"]):  # the build's options, and ones the header was not precompiled with
        result = subprocess.run([_build.compiler(), *_build.BASE_FLAGS, *_build.kernel_flags(flags, includes), *extra,
                                 "-H", "-fsyntax-only", "-x", "c++", str(src)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert (f"! {used}" in result.stderr) == (not extra), result.stderr[:2000]


# ---- numerics ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def numerics():
    return module("numerics.cu")


def interesting_floats():
    rng = np.random.default_rng(7)
    random_bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    h = np.arange(2**16, dtype=np.uint32)
    # every half and bfloat16 value, and the midpoints between neighbours (ties round to even)
    half_values = h.astype(np.uint16).view(np.float16).astype(np.float32)
    bf16_values = (h << 16).view(np.float32)
    with np.errstate(invalid="ignore"):  # midpoints next to inf and NaN are NaN: harmless
        half_mid = ((half_values[:-1].astype(np.float64) + half_values[1:]) / 2).astype(np.float32)
    bf16_mid = (bf16_values.view(np.uint32) + np.uint32(0x8000)).view(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65520, 65519.99, 2**-24, 2**-25, 2**-26,
                         3 * 2**-26, 1e-45, 3.4e38], np.float32)
    return np.concatenate([random_bits, half_values, bf16_values, half_mid, bf16_mid, specials])


def test_float_to_half_and_bfloat16_is_bit_exact(numerics):
    x = interesting_floats()
    h, b = np.zeros(x.size, np.uint16), np.zeros(x.size, np.uint16)
    numerics.get_function("to_half")((x.size + 255) // 256, 256, (x, h, b, I32(x.size)))
    nan = np.isnan(x)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(h[~nan], x[~nan].astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(b[~nan], x[~nan].astype(ml_dtypes.bfloat16).view(np.uint16))
    assert np.isnan(h.view(np.float16)[nan]).all() and np.isnan(b.view(ml_dtypes.bfloat16)[nan].astype(np.float32)).all()


def test_half_and_bfloat16_to_float_is_exact(numerics):
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    hf, bf = np.zeros(bits.size, np.float32), np.zeros(bits.size, np.float32)
    numerics.get_function("from_half")(256, 256, (bits.view(np.float16), bits.view(ml_dtypes.bfloat16), hf, bf, I32(bits.size)))
    np.testing.assert_array_equal(hf, bits.view(np.float16).astype(np.float32))
    np.testing.assert_array_equal(bf, bits.view(ml_dtypes.bfloat16).astype(np.float32))


def test_half_arithmetic_rounds_like_numpy(numerics):
    rng = np.random.default_rng(3)
    a = (rng.standard_normal(4096) * 30).astype(np.float16)
    b = (rng.standard_normal(4096) * 30).astype(np.float16)
    s, p = np.zeros_like(a), np.zeros_like(a)
    pair = np.zeros(2 * a.size, np.float16)
    numerics.get_function("half_arith")(16, 256, (a, b, s, p, pair, I32(a.size)))
    np.testing.assert_array_equal(s, a + b)
    np.testing.assert_array_equal(p, a * b)
    np.testing.assert_array_equal(pair[0::2], a * np.float16(2))
    np.testing.assert_array_equal(pair[1::2], b * np.float16(0.5))


def test_math_functions(numerics):
    x = np.linspace(-20, 20, 1001, dtype=np.float32)
    out = np.zeros(8 * x.size, np.float32)
    numerics.get_function("math")(4, 256, (x, out, I32(x.size)))
    out = out.reshape(-1, 8)
    want = np.stack([np.exp2(x), np.exp(x), np.log(np.abs(x) + 1), np.maximum(x, 0.25), 1 / np.sqrt(np.abs(x) + 1),
                     np.tanh(x), np.abs(x), np.where(x > 0, np.inf, -np.inf)], axis=1)
    np.testing.assert_allclose(out, want, rtol=2e-6)


# ---- PTX primitives -----------------------------------------------------------------------------

PRIMITIVE_NAMES = ["mma<__half>", "mma<__nv_bfloat16>"] + [
    f"ldmatrix<{c}, {t}>" for c in (1, 2, 4) for t in ("false", "true")]


@pytest.fixture(scope="module", params=[False, True], ids=["layout", "wrong_layout"])
def primitives(request):
    options = ["-DWRONG_LAYOUT"] if request.param else []
    return request.param, module("primitives.cu", options, names=PRIMITIVE_NAMES)


def check_or_expect_failure(wrong, check):
    if wrong:
        with pytest.raises(AssertionError):
            check()
    else:
        check()


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["f16", "bf16"])
def test_mma_m16n8k16(primitives, dtype):
    wrong, mod = primitives
    rng = np.random.default_rng(4)
    A = rng.standard_normal((16, 16)).astype(dtype)
    B = rng.standard_normal((16, 8)).astype(dtype)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    D = np.full((16, 8), np.nan, np.float32)
    name = "mma<__half>" if dtype == np.float16 else "mma<__nv_bfloat16>"
    mod.get_function(name)(1, 32, (A, B, C, D))
    want = A.astype(np.float64) @ B.astype(np.float64) + C
    check_or_expect_failure(wrong, lambda: np.testing.assert_allclose(D, want, rtol=1e-5, atol=1e-5))


@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix(primitives, count, trans):
    wrong, mod = primitives
    tiles = np.arange(count * 64, dtype=np.uint16) * 3 + 1
    out = np.zeros(32 * 4, np.uint32)
    mod.get_function(f"ldmatrix<{count}, {'true' if trans else 'false'}>")(1, 32, (tiles, out))
    got = out.reshape(32, 4)[:, :count]
    m = tiles.reshape(count, 8, 8)
    want = np.zeros((32, count), np.uint32)
    for lane in range(32):
        for k in range(count):
            mat = m[k].T if trans else m[k]
            row, col = lane // 4, 2 * (lane % 4)
            want[lane, k] = int(mat[row, col]) | int(mat[row, col + 1]) << 16
    check_or_expect_failure(wrong, lambda: np.testing.assert_array_equal(got, want))


WGMMA_NAMES = [f"wgmma<{t}, {r}, {n}, {m}>" for t in ("__half", "__nv_bfloat16") for r in ("false", "true")
               for n in (32, 64, 128, 176) for m in ("false", "true")]


@pytest.fixture(scope="module", params=[None, "-DWRONG_LAYOUT", "-DWRONG_MAJOR"],
                ids=["layout", "wrong_layout", "wrong_major"])
def wgmma_module(request):
    options = [request.param] if request.param else []
    return request.param is not None, module("wgmma.cu", options, names=WGMMA_NAMES)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("a_from", ["shared", "registers"])
@pytest.mark.parametrize("n", [32, 64, 128, 176])
@pytest.mark.parametrize("b_major", ["k", "mn"])
def test_wgmma_m64k16(wgmma_module, dtype, a_from, n, b_major):
    wrong, mod = wgmma_module
    rng = np.random.default_rng(6)
    A = rng.standard_normal((64, 16)).astype(dtype)
    B = rng.standard_normal((16, n)).astype(dtype)
    C = rng.standard_normal((64, n)).astype(np.float32)
    D = np.full((64, n), np.nan, np.float32)
    name = (f"wgmma<{'__half' if dtype == np.float16 else '__nv_bfloat16'}, {str(a_from == 'registers').lower()}, {n}, "
            f"{str(b_major == 'mn').lower()}>")
    # 72 KB: the operands take at most 10 KB; a wrong layout reads into the (poisoned) rest, up to
    # 62 KB in (LBO and SBO of B swapped at N = 176).
    fn = mod.get_function(name)
    fn.max_dynamic_shared_size_bytes = 73728
    fn(1, 128, (A, B, C, D, I32(1)), shared_mem=73728)
    want = A.astype(np.float64) @ B.astype(np.float64) + C
    check_or_expect_failure(wrong, lambda: np.testing.assert_allclose(D, want, rtol=1e-5, atol=1e-5))


def test_wgmma_results_land_only_at_the_wait():
    mod = module("wgmma.cu", names=WGMMA_NAMES)
    rng = np.random.default_rng(7)
    A, B = (rng.standard_normal(shape).astype(np.float16) for shape in ((64, 16), (16, 64)))
    C = rng.standard_normal((64, 64)).astype(np.float32)
    D = np.full((64, 64), np.nan, np.float32)
    mod.get_function("wgmma<__half, false, 64, false>")(1, 128, (A, B, C, D, I32(0)), shared_mem=8192)
    np.testing.assert_array_equal(D, C)  # without wgmma.wait_group the accumulators are not written


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_wgmma_without_the_proxy_fence_reads_poison(schedule):
    # Generic stores of the operands are invisible to wgmma's async proxy until fence.proxy.async.
    mod = module("wgmma.cu", ["-DNO_FENCE"], names=WGMMA_NAMES)
    A, B = np.ones((64, 16), np.float16), np.ones((16, 64), np.float16)
    C, D = np.zeros((64, 64), np.float32), np.zeros((64, 64), np.float32)
    mod.get_function("wgmma<__half, false, 64, false>")(1, 128, (A, B, C, D, I32(1)), shared_mem=8192,
                                                        schedule=schedule)
    assert np.isnan(D).all()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_thread_fence_publishes_its_own_named_stores_only(schedule):
    # Stores the kernels name (ATTN_STORE_SHARED) reach the async proxy at their own thread's fence.
    product, C, D = run_wgmma_once(["-DNAMED_STORES"], schedule=schedule)
    np.testing.assert_allclose(D, product + C, rtol=1e-5, atol=1e-5)
    _, _, D = run_wgmma_once(["-DNAMED_STORES", "-DONE_THREAD_FENCES"], schedule=schedule)
    assert np.isnan(D).all()  # every output row reads an operand some other thread stored


def run_wgmma_once(options, a_from="shared", schedule="forward"):
    mod = module("wgmma.cu", options, names=WGMMA_NAMES)
    rng = np.random.default_rng(9)
    A, B = (rng.standard_normal(shape).astype(np.float16) for shape in ((64, 16), (16, 64)))
    C = rng.standard_normal((64, 64)).astype(np.float32)
    D = np.full((64, 64), np.nan, np.float32)
    mod.get_function(f"wgmma<__half, {str(a_from == 'registers').lower()}, 64, false>")(
        1, 128, (A, B, C, D, I32(1)), shared_mem=8192, schedule=schedule)
    return A.astype(np.float64) @ B.astype(np.float64), C, D


@pytest.mark.parametrize("a_from", ["shared", "registers"])
def test_wgmma_accumulators_written_before_the_wait_fail(a_from):
    with pytest.raises(EmulatorError, match="wgmma: lane 0 wrote its accumulators between the wgmma's issue and the wait"):
        run_wgmma_once(["-DWRITE_D_BEFORE_WAIT"], a_from)


def test_wgmma_a_registers_written_before_the_wait_fail():
    with pytest.raises(EmulatorError, match="wgmma: lane 0 wrote its A registers before the wait"):
        run_wgmma_once(["-DWRITE_A_BEFORE_WAIT"], "registers")


@pytest.mark.parametrize("a_from", ["shared", "registers"])
def test_wgmma_accumulating_over_two_waited_groups_is_not_reported(a_from):
    # The second group's accumulators, at the first wait, hold what the first group wrote: the
    # check must follow them, not the values at the second issue.
    product, C, D = run_wgmma_once(["-DTWO_GROUPS"], a_from)
    np.testing.assert_allclose(D, 2 * product + C, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", ["forward", "reverse", "random"])
def test_wgmma_descriptors_that_differ_between_the_warps_of_a_warpgroup_fail(schedule):
    # Each warp points A's descriptor at its own 16 rows: the warps' shares of one instruction
    # disagree, whichever warp's share runs first.
    with pytest.raises(EmulatorError, match="wgmma: the warps of warpgroup 0 issued different wgmma.mma_async"):
        run_wgmma_once(["-DPER_WARP_A"], schedule=schedule)


def test_wgmma_operand_beyond_shared_memory_fails():
    # With LBO and SBO swapped, B's descriptor reaches past the 8 KB the operands occupy.
    mod = module("wgmma.cu", ["-DWRONG_LAYOUT"], names=WGMMA_NAMES)
    A, B = np.ones((64, 16), np.float16), np.ones((16, 64), np.float16)
    C, D = np.zeros((64, 64), np.float32), np.zeros((64, 64), np.float32)
    with pytest.raises(EmulatorError, match="wgmma operand reads shared bytes .* beyond the block's 8192"):
        mod.get_function("wgmma<__half, false, 64, false>")(1, 128, (A, B, C, D, I32(1)), shared_mem=8192)


def test_red_add_pair_adds_enabled_pairs_atomically():
    mod = module("primitives.cu")
    rng = np.random.default_rng(8)
    slot = rng.integers(0, 8, 32).astype(np.int32)  # collisions: several lanes add to one pair
    values = rng.standard_normal(64).astype(np.float32)
    enabled = (rng.random(32) < 0.75).astype(np.int32)
    dst = np.zeros(17, np.float32)
    mod.get_function("red_pairs")(1, 32, (dst, slot, values, enabled, I32(0)))
    want = np.zeros(17, np.float64)
    for lane in np.flatnonzero(enabled):
        want[2 * slot[lane]:2 * slot[lane] + 2] += values[2 * lane:2 * lane + 2]
    np.testing.assert_allclose(dst, want, rtol=1e-6, atol=1e-6)


def test_red_add_pair_refuses_an_unaligned_address():
    mod = module("primitives.cu")
    ones = np.ones(64, np.float32)
    with pytest.raises(EmulatorError, match="red.global.add.v2.f32: address not 8-byte aligned"):
        mod.get_function("red_pairs")(1, 32, (np.zeros(17, np.float32), np.zeros(32, np.int32), ones,
                                               np.ones(32, np.int32), I32(1)))


@pytest.mark.parametrize("waits", [0, 1, 2])
def test_cp_async_lands_only_after_its_wait(waits):
    """In the reverse schedules a copy lands at the wait that covers it: reads before see poison."""
    mod = module("primitives.cu")
    x = np.random.default_rng(5).standard_normal(64 * 4).astype(np.float32)
    out = np.zeros_like(x)
    mod.get_function("copy_async")(1, 32, (x, out, I32(waits)), shared_mem=64 * 16, schedule="reverse")
    first, second = out[:128], out[128:]
    if waits == 2:
        assert np.isnan(out).all()
    else:
        np.testing.assert_array_equal(first, x[:128])
        assert np.isnan(second).all() if waits == 1 else np.array_equal(second, x[128:])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cp_async_lands_at_issue_in_some_schedules(schedule):
    """In the forward and warp schedules a copy lands at issue: reloading a buffer before every
    thread has read it (no barrier between) changes what some read there; reading, a barrier, then
    reloading is right on every schedule."""
    mod = module("primitives.cu")
    x = np.random.default_rng(6).standard_normal(64 * 4).astype(np.float32)
    for guarded in (1, 0):
        out = np.full(32 * 4, np.nan, np.float32)
        mod.get_function("reload_async")(1, 32, (x, out, I32(guarded)), shared_mem=32 * 16, schedule=schedule)
        if guarded:
            np.testing.assert_array_equal(out, x[:128])
        elif schedule in ("forward", "warps"):
            assert not np.array_equal(out, x[:128])
        elif schedule in ("reverse", "warps_reverse"):  # landing at the waits, after every read
            np.testing.assert_array_equal(out, x[:128])


# max_nan and exp2_polynomial (numeric.cuh), each as a check of a runner: primitives.cu's kernel on
# the emulator here, on the GPU in test_gpu_hopper.py (so the hardware's max.NaN and rounded add
# show).

def run_max_nan(mod, a, b):
    y = np.zeros_like(a)
    mod.get_function("max_nan")((a.size + 255) // 256, 256, (a, b, y, I32(a.size)))
    return y


def run_exp2_polynomial(mod, x):
    """exp2_polynomial(x), and x + 1.5·2^23 rounded toward -inf (the add its floor rests on)."""
    y, shifted = np.zeros_like(x), np.zeros_like(x)
    mod.get_function("exp2_polynomial")((x.size + 255) // 256, 256, (x, y, shifted, I32(x.size)))
    return y, shifted


def check_max_nan(max_nan):
    rng = np.random.default_rng(11)
    a, b = (rng.standard_normal(1000).astype(np.float32) for _ in range(2))
    a[::7], b[3::11] = np.nan, np.nan
    a[1::13], b[2::17] = -np.inf, np.inf
    y = max_nan(a, b)
    np.testing.assert_array_equal(y, np.maximum(a, b))  # NumPy's maximum propagates NaN too
    nan = np.isnan(a) ^ np.isnan(b)
    assert nan.sum() > 100 and not np.isnan(np.fmax(a, b)[nan]).any()  # what fmaxf would give there


def check_exp2_polynomial(exp2_polynomial):
    x = np.concatenate([np.linspace(-126, 127.99, 400001, dtype=np.float32),
                        np.random.default_rng(12).uniform(-8, 8, 100000).astype(np.float32)])
    y, _ = exp2_polynomial(x)
    relative = np.abs(y / np.exp2(x.astype(np.float64)) - 1)
    assert relative.max() < 8.7e-5  # the fit's bound (numeric.cuh)
    assert relative.max() > 8e-5     # and a cubic's: not exp2 itself
    integers = np.arange(-126, 128, dtype=np.float32)
    np.testing.assert_array_equal(exp2_polynomial(integers)[0], np.ldexp(np.float32(1), integers.astype(int)))
    # ex2.approx.ftz's special values: 0 (bitwise +0) below -126, where 2^x is not a normal float,
    # and for a masked score's -inf; NaN stays NaN (fmaxf's clamp would have given 0)
    below = np.array([-np.inf, -1e30, -1000, -127.5, -127, -126.5, -126.0001], np.float32)
    np.testing.assert_array_equal(exp2_polynomial(below)[0].view(np.uint32), 0)
    y, _ = exp2_polynomial(np.array([np.nan, 0, -0.0], np.float32))
    assert np.isnan(y[0]) and (y[1:] == 1).all()
    # x + 1.5·2^23 rounded toward -inf holds floor(x) (to nearest, 0.75 would give 1 and the
    # fraction would be negative)
    x = np.array([0.75, 0.25, -0.25, -0.75, -126.9, 127.5, 3], np.float32)
    np.testing.assert_array_equal(exp2_polynomial(x)[1] - np.float32(1.5 * 2**23), np.floor(x))
    assert not np.array_equal(np.round(x.astype(np.float64) + 1.5 * 2**23) - 1.5 * 2**23, np.floor(x))


def test_max_nan_propagates_nan_where_fmax_drops_it():
    mod = module("primitives.cu")
    check_max_nan(lambda a, b: run_max_nan(mod, a, b))


def test_exp2_polynomial_against_exp2_its_special_values_and_its_floor():
    mod = module("primitives.cu")
    check_exp2_polynomial(lambda x: run_exp2_polynomial(mod, x))


def test_exp2_polynomial_with_an_add_to_nearest_fails_the_check():
    """The check sees the rounding of the floor's add: with __fadd_rn in its place it fails."""
    mod = module("primitives.cu", ["-DADD_TO_NEAREST"])
    with pytest.raises(AssertionError):
        check_exp2_polynomial(lambda x: run_exp2_polynomial(mod, x))


# ---- AddressSanitizer -----------------------------------------------------------------------

def test_address_sanitizer_catches_out_of_bounds_write():
    libasan = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    script = textwrap.dedent(f"""
        import numpy as np
        from cupy_attn.emulator import RawModule
        mod = RawModule(open({str(HERE / 'basics.cu')!r}).read(), sanitize=True)
        out = np.zeros(4096, np.float32)
        mod.get_function("oob_write")(1, 32, (out, np.int32(4096 - 8)))
        print("NOT CAUGHT")
    """)
    env = dict(os.environ, LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert "NOT CAUGHT" not in result.stdout
    assert "heap-buffer-overflow" in result.stderr, result.stderr[-3000:]


def test_a_register_pin_that_outlived_its_array_passes_address_sanitizer():
    """An array pinned for wgmma (ptx::fence_operands) after a wait, in a scope that ends before
    the thread's next wgmma.fence (as the wgmma dK/dV's dq): the fence's snapshot of the pins
    leaves it out rather than read a dead stack frame, which AddressSanitizer would stop."""
    libasan = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    source = textwrap.dedent("""
        #include "ptx.cuh"
        extern "C" __global__ void stale_pin(float* out) {
            if (out[0] > 0.f) {
                float dq[8];
                for (int i = 0; i < 8; ++i) dq[i] = out[i];
                ptx::fence_operands(dq);
                out[threadIdx.x] = dq[threadIdx.x % 8];
            }
            ptx::wgmma_fence();
        }
    """)
    script = textwrap.dedent(f"""
        import numpy as np
        from cupy_attn import _paths
        from cupy_attn.emulator import RawModule
        mod = RawModule({source!r}, options=("-I" + str(_paths.kernel_dir()),), sanitize=True)
        mod.get_function("stale_pin")(1, 32, (np.ones(32, np.float32),))
        print("RAN")
    """)
    env = dict(os.environ, LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert "RAN" in result.stdout and "AddressSanitizer" not in result.stderr.replace("WARNING: ASan", ""), \
        result.stderr[-3000:]


def test_sanitize_without_runtime_is_a_clear_error():
    with pytest.raises(EmulatorError, match="LD_PRELOAD"):
        RawModule((HERE / "basics.cu").read_text(), sanitize=True).get_function("oob_write")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_warps_lanes_are_ordered_by_syncwarp_alone(schedule):
    """emu_lanes.h: one lane's store and another lane's load or store of the same shared byte need
    a __syncwarp (or a barrier) between them, as compute-sanitizer's racecheck holds on the GPU:
    each kernel of lanes.cu passes as written and fails without its __syncwarp, in every schedule
    (the emulator cannot reorder the lanes of an ldmatrix, so only the check can see it)."""
    rng = np.random.default_rng(21)
    rows = rng.integers(0, 1 << 16, 64).astype(np.uint16)
    matrix = rows.reshape(8, 8).astype(np.uint32)
    lanes = np.arange(32)
    want = matrix[lanes // 4, 2 * (lanes % 4)] | matrix[lanes // 4, 2 * (lanes % 4) + 1] << 16
    good, bad = module("lanes.cu"), module("lanes.cu", ["-DNO_SYNC"])
    out = np.zeros(32, np.uint32)
    good.get_function("rows_then_restage")(1, 32, (rows, out), shared_mem=128, schedule=schedule)
    np.testing.assert_array_equal(out, want)
    out = np.zeros(32, np.int32)
    good.get_function("store_then_load")(1, 32, (I32(77), out), shared_mem=16, schedule=schedule)
    np.testing.assert_array_equal(out, np.where(lanes == 1, 77, -1))
    out = np.zeros(32, np.int32)
    good.get_function("across_warps")(1, 64, (out,), shared_mem=128, schedule=schedule)
    np.testing.assert_array_equal(out, 100 + 31 - lanes)
    with pytest.raises(EmulatorError, match=r"lane [0-7] of warp 0 stores to shared memory at offset \d+ \(<kernel source>:\d+\), "
                                            r"which lane [0-7] of the same warp loaded \(.*\) since the warp's last "
                                            r"__syncwarp or barrier"):
        bad.get_function("rows_then_restage")(1, 32, (rows, np.zeros(32, np.uint32)), shared_mem=128, schedule=schedule)
    # lane 0's store first (forward schedules: lane 1 then loads it) or lane 1's load (it then stores over it)
    with pytest.raises(EmulatorError, match=r"lane [01] of warp 0 (loads|stores to) shared memory at offset 0 .*which "
                                            r"lane [01] of the same warp (stored|loaded)"):
        bad.get_function("store_then_load")(1, 32, (I32(77), np.zeros(32, np.int32)), shared_mem=16, schedule=schedule)
