"""The Hopper primitives on a real H100/H200 (marked gpu): the same test kernels and NumPy models as
the emulator's tests (test_emulator_hopper.py, test_emulator_tma.py), with tensor maps encoded by
the CUDA driver, so a difference between the emulated twins and the hardware shows here."""
from pathlib import Path

import numpy as np
import pytest

from cupy_attn import _paths
from cupy_attn._source import inline_local_includes
from cupy_attn._tensor_map import TensorMapSpec
from test_emulator import check_exp2_polynomial, check_max_nan
from test_emulator_tma import (BOX_AT, BOX_CASES, NAMES, PIPELINE, STAGES, TILE_ROWS, TILES, box_model, reduce_add_case,
                               swizzled_bytes)

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
HERE = Path(__file__).parent / "emulator_kernels"
I32 = np.int32


@pytest.fixture(scope="module", autouse=True)
def hopper():
    if int(cupy.cuda.Device().compute_capability) != 90:
        pytest.skip("TMA, mbarrier phases and wgmma are sm_90a instructions: compute capability 9.0 only")
    pytest.importorskip("cuda.bindings", reason="tensor maps are encoded through cuda-bindings (the cuda12/cuda13 extras)")


def gpu_module(filename, names=()):
    path = HERE / filename
    code = inline_local_includes(path.read_text(), [_paths.kernel_dir(), HERE], origin=str(path))
    return cupy.RawModule(code=code, options=("-std=c++17", "-arch=sm_90a"), name_expressions=list(names))


@pytest.fixture(scope="module")
def tma():
    return gpu_module("tma.cu", NAMES)


@pytest.mark.parametrize("case", sorted(BOX_CASES))
def test_tma_load(tma, case):
    shape, dtype, box, coords, swizzle = BOX_CASES[case]
    array = np.random.default_rng(len(case)).standard_normal(shape).astype(dtype)
    device = cupy.asarray(array)
    spec = TensorMapSpec.of_array(device, box, swizzle=swizzle)
    out = cupy.zeros(spec.box_bytes, np.uint8)
    tma.get_function(f"tma_box<{array.ndim}>")((1,), (64,), (spec.encoded(), cupy.asarray(np.array(coords[::-1], I32)),
                                                              I32(spec.box_bytes), out), shared_mem=BOX_AT + spec.box_bytes)
    np.testing.assert_array_equal(out.get(), box_model(array, coords, box, swizzle))


def test_tma_store(tma):
    box, coords = (8, 64), (33, 72)  # the box's first element 16-byte aligned, as the PTX ISA requires
    values = np.random.default_rng(5).standard_normal(box).astype(np.float16)
    data = swizzled_bytes(values, 128)
    target = cupy.full((37, 104), -1, np.float16)
    spec = TensorMapSpec.of_array(target, box, swizzle=128)
    tma.get_function("tma_store_box<2, false>")((1,), (64,), (spec.encoded(), cupy.asarray(np.array(coords[::-1], I32)),
                                                              I32(spec.box_bytes), cupy.asarray(data)),
                                                shared_mem=BOX_AT + spec.box_bytes)
    want = np.full((37, 104), -1, np.float16)
    want[33:37, 72:104] = values[:4, :32]
    np.testing.assert_array_equal(target.get(), want)


def test_tma_reduce_add(tma):
    """cp.reduce.async.bulk.tensor .add on the hardware, as the wgmma dK/dV adds a GQA group's
    float32 dK and dV: three blocks add the same partly clipped box."""
    target, values, coords, want = reduce_add_case()
    device = cupy.asarray(target)
    spec = TensorMapSpec.of_array(device, values.shape, swizzle=128)
    tma.get_function("tma_store_box<2, true>")((3,), (64,), (spec.encoded(), cupy.asarray(np.array(coords[::-1], I32)),
                                                             I32(spec.box_bytes), cupy.asarray(swizzled_bytes(values, 128))),
                                               shared_mem=BOX_AT + spec.box_bytes)
    np.testing.assert_array_equal(device.get(), want)


@pytest.mark.parametrize("mn_major", [False, True], ids=["k_major", "mn_major"])
@pytest.mark.parametrize("a_mn_major", [False, True], ids=["a_k_major", "a_mn_major"])
def test_wgmma_reads_boxes_tma_swizzled(tma, mn_major, a_mn_major):
    """The emulator's layouts on the hardware: B K- or MN-major (K and V), A K- or MN-major (Q, and
    dSᵀ for dQ = dS·K)."""
    rng = np.random.default_rng(6)
    a, b = (rng.standard_normal((64, 64)).astype(np.float16) for _ in range(2))
    on_gpu = [cupy.asarray(x) for x in (a, b)]
    maps = [TensorMapSpec.of_array(x, (64, 64), swizzle=128).encoded() for x in on_gpu]
    d = cupy.full((64, 64), np.nan, np.float32)
    tma.get_function(f"tma_wgmma<{str(a_mn_major).lower()}, {str(mn_major).lower()}>")(
        (1,), (128,), (*maps, d), shared_mem=1024 + 2 * 8192)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = (a64.T if a_mn_major else a64) @ (b64 if mn_major else b64.T)
    np.testing.assert_allclose(d.get(), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("n", [128, 72])
@pytest.mark.parametrize("register_a", [False, True], ids=["a_shared", "a_registers"])
def test_wgmma_reads_an_mn_major_operand_of_two_boxes(tma, register_a, n):
    """m64n128k16 with B MN-major across two boxes (the leading byte offset, as V's at D = 128), and
    m64n72k16 reading only the second box's first 8 columns (as P·V at D = 64 reads its ones); A
    from shared memory or from registers packed as P is (the RS form of P·V)."""
    rng = np.random.default_rng(8)
    a = rng.standard_normal((64, 64)).astype(np.float16)
    b = rng.standard_normal((64, 128)).astype(np.float16)
    on_gpu = [cupy.asarray(x) for x in (a, b)]
    maps = [TensorMapSpec.of_array(x, (64, 64), swizzle=128).encoded() for x in on_gpu]
    d = cupy.full((64, n), np.nan, np.float32)
    tma.get_function(f"tma_wgmma_wide<{str(register_a).lower()}, {n}>")(
        (1,), (128,), (*maps, cupy.asarray(a.astype(np.float32)), d), shared_mem=1024 + 3 * 8192)
    np.testing.assert_allclose(d.get(), a.astype(np.float64) @ b[:, :n].astype(np.float64), rtol=1e-3, atol=1e-3)


def test_pipeline():
    mod = gpu_module("pipeline.cu")
    array = np.random.default_rng(7).standard_normal((52, 64)).astype(np.float16)
    device = cupy.asarray(array)
    spec = TensorMapSpec.of_array(device, (TILE_ROWS, 64), swizzle=128)
    out = cupy.zeros((TILES, 1024), np.uint8)
    mod.get_function("pipelined_copy")((1,), (256,), (spec.encoded(), I32(TILES), out), shared_mem=1024 + STAGES * 1024)
    want = np.stack([box_model(array, (TILE_ROWS * t, 0), (TILE_ROWS, 64), 128) for t in range(TILES)])
    np.testing.assert_array_equal(out.get(), want)


def test_named_barriers_and_mbarriers():
    mod = gpu_module("hopper_sync.cu")
    order = cupy.full(12, -1, np.int32)
    mod.get_function("ping_pong")((1,), (64,), (order, I32(6)), shared_mem=16)
    np.testing.assert_array_equal(order.get(), np.arange(12))
    x = np.random.default_rng(1).standard_normal((5, 96)).astype(np.float32)
    out = cupy.full(x.shape, np.nan, np.float32)
    mod.get_function("mbarrier_rounds")((1,), (96,), (cupy.asarray(x), out, I32(5)), shared_mem=16 + 8 * 96)
    want = sum(np.roll(x.astype(np.float64), -j, axis=1) for j in range(8))
    np.testing.assert_allclose(out.get(), want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def primitives():
    return gpu_module("primitives.cu")


def test_max_nan(primitives):
    def max_nan(a, b):
        y = cupy.zeros(a.size, np.float32)
        primitives.get_function("max_nan")(((a.size + 255) // 256,), (256,),
                                           (cupy.asarray(a), cupy.asarray(b), y, I32(a.size)))
        return y.get()
    check_max_nan(max_nan)


def test_exp2_polynomial(primitives):
    """The wgmma forward's exp2 off the MUFU unit (numeric.cuh) with the hardware's max.NaN and
    rounded add: the emulator's bounds, special values and floor."""
    def exp2_polynomial(x):
        y, shifted = cupy.zeros(x.size, np.float32), cupy.zeros(x.size, np.float32)
        primitives.get_function("exp2_polynomial")(((x.size + 255) // 256,), (256,),
                                                   (cupy.asarray(x), y, shifted, I32(x.size)))
        return y.get(), shifted.get()
    check_exp2_polynomial(exp2_polynomial)
