"""TMA in ptx.cuh and its emulated twin: tensor maps (cupy_attn._tensor_map) checked against the
driver's rules, box loads and stores with each swizzle and out-of-bounds elements against a NumPy
model of the layout, wgmma reading the swizzled boxes, deliberately wrong uses, and the real
instructions through NVRTC and SASS."""
import ctypes
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cupy_attn import _nvrtc, _paths, _sass, _tensor_map
from cupy_attn._tensor_map import TensorMapError, TensorMapSpec
from cupy_attn.emulator import EmulatorError, RawModule

HERE = Path(__file__).parent / "emulator_kernels"
SOURCE = (HERE / "tma.cu").read_text()
SCHEDULES = ["forward", "reverse", "random", "warps", "warps_reverse"]
NAMES = ["tma_box<2>", "tma_box<3>", "tma_store_box<2, false>", "tma_store_box<3, false>", "tma_store_box<2, true>",
         *(f"tma_wgmma<{a}, {b}>" for a in ("false", "true") for b in ("false", "true")),
         *(f"tma_wgmma_wide<{r}, {n}>" for r in ("false", "true") for n in (128, 72))]
BOX_AT = 1024  # where the kernels put the box in shared memory
I32 = np.int32


def module(*options):
    return RawModule(SOURCE, options=("-I" + str(_paths.kernel_dir()), *options), name_expressions=NAMES)


@pytest.fixture(scope="module")
def tma():
    return module()


def swizzled(offset, span):
    """The shared-memory byte a box byte at `offset` goes to (CUTLASS's Swizzle<1|2|3, 4, 3>)."""
    return offset if span == 0 else offset ^ ((offset >> 3) & ((span // 16 - 1) << 4))


def box_model(array, coords, box, swizzle, oob_nan=False):
    """The box's bytes as TMA lays them in shared memory at BOX_AT. `coords` and `box` outermost
    first, as the array's axes."""
    fill = np.nan if oob_nan else 0
    values = np.full(box, fill, array.dtype)
    index = np.indices(box).reshape(len(box), -1).T + np.array(coords)
    inside = np.all((index >= 0) & (index < np.array(array.shape)), axis=1)
    values.reshape(-1)[inside] = array[tuple(index[inside].T)]
    raw = np.frombuffer(values.tobytes(), np.uint8)
    out = np.empty_like(raw)
    at = np.array([swizzled(BOX_AT + o, swizzle) - BOX_AT for o in range(raw.size)])
    out[at] = raw
    return out


def load(mod, array, coords, box, swizzle, *, oob_nan=False, schedule="forward", view=None):
    spec = TensorMapSpec.of_array(array if view is None else view, box, swizzle=swizzle, oob_nan=oob_nan)
    out = np.zeros(spec.box_bytes, np.uint8)
    mod.get_function(f"tma_box<{array.ndim}>")(1, 64, (spec.emulated(), np.array(coords[::-1], np.int32),
                                                        I32(spec.box_bytes), out),
                                               shared_mem=BOX_AT + spec.box_bytes, schedule=schedule, seed=2)
    return out


# (shape, dtype, box, coords): boxes partly outside the tensor on every side.
BOX_CASES = {
    "f16-sw128": ((37, 104), np.float16, (8, 64), (33, 48), 128),
    "f16-sw64": ((37, 104), np.float16, (8, 32), (-3, 80), 64),
    "bf16-sw32": ((37, 104), ml_dtypes.bfloat16, (16, 16), (30, -8), 32),
    # Lines of 48 bytes without swizzle, inside the tensor and past its last column.
    "f16-none-inside": ((37, 104), np.float16, (8, 24), (5, 40), 0),
    "f16-none-aligned": ((37, 104), np.float16, (8, 24), (5, 88), 0),
    "f32-3d-sw128": ((5, 9, 32), np.float32, (2, 4, 32), (4, -2, 0), 128),
    # wholly past the last column, as the boxes of head dims past Dv are at D = 64, Dv = 128: the
    # box's bytes complete its barrier all the same
    "f16-sw128-outside": ((37, 104), np.float16, (8, 64), (3, 104), 128),
}


@pytest.mark.parametrize("case", sorted(BOX_CASES))
@pytest.mark.parametrize("oob_nan", [False, True])
def test_tma_load_matches_the_swizzled_layout(tma, case, oob_nan):
    shape, dtype, box, coords, swizzle = BOX_CASES[case]
    array = np.random.default_rng(len(case)).standard_normal(shape).astype(dtype)
    got = load(tma, array, coords, box, swizzle, oob_nan=oob_nan)
    np.testing.assert_array_equal(got, box_model(array, coords, box, swizzle, oob_nan))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tma_load_on_every_schedule_and_through_strides(tma, schedule):
    # A view whose rows are 256 bytes apart (the array's first 100 of 128 columns).
    base = np.random.default_rng(3).standard_normal((37, 128)).astype(np.float16)
    view = base[:, :100]
    got = load(tma, np.ascontiguousarray(view), (33, 40), (8, 64), 128, schedule=schedule, view=view)
    np.testing.assert_array_equal(got, box_model(view, (33, 40), (8, 64), 128))


@pytest.mark.parametrize("option", ["-DNO_WAIT", "-DNO_EXPECT_TX"])
def test_tma_load_read_before_it_landed_fails_on_some_schedule(option):
    mod = module(option)
    array = np.random.default_rng(4).standard_normal((37, 104)).astype(np.float16)
    want = box_model(array, (0, 0), (8, 64), 128)
    wrong = []
    for schedule in SCHEDULES:
        try:
            wrong.append(not np.array_equal(load(mod, array, (0, 0), (8, 64), 128, schedule=schedule), want))
        except EmulatorError as error:  # the load never landed: nothing waited for its phase
            assert "TMA load(s) no thread waited for" in str(error), error
            wrong.append(True)
    assert any(wrong)


# Boxes whose first element is not 16-byte aligned in global memory, which the PTX ISA forbids
# ("Tensor", "Bounding Box"): the first H200 run's "f16-none" (a 48-byte line at byte 180 of its
# row) stopped with an illegal instruction. Byte 180 past the tensor, byte 90 inside, and a
# swizzled box one column in.
UNALIGNED_BOX_CASES = {
    "f16-none-180": ((37, 104), np.float16, (8, 24), (5, 90), 0),
    "f16-none-64b-90": ((37, 104), np.float16, (8, 32), (5, 45), 0),
    "f16-sw128-2": ((37, 104), np.float16, (8, 64), (0, 1), 128),
}


@pytest.mark.parametrize("case", sorted(UNALIGNED_BOX_CASES))
def test_tma_load_of_a_box_not_16_byte_aligned_fails(tma, case):
    shape, dtype, box, coords, swizzle = UNALIGNED_BOX_CASES[case]
    with pytest.raises(EmulatorError, match=rf"coordinate {coords[1]} of the innermost dimension, "
                                            rf"{coords[1] * 2} bytes into its line\) is not 16-byte aligned"):
        load(tma, np.zeros(shape, dtype), coords, box, swizzle)


def test_tma_load_to_a_misaligned_swizzled_box_fails():
    array = np.zeros((8, 64), np.float16)
    with pytest.raises(EmulatorError, match="a 128-byte swizzled box must start at a multiple of 1024 bytes, not at 1152"):
        load(module("-DMISALIGNED"), array, (0, 0), (8, 64), 128)


def test_tma_load_refuses_a_map_not_encoded_for_the_emulator(tma):
    forged = np.frombuffer(np.arange(16, dtype=np.uint64).tobytes(), np.dtype((np.void, 128)))[0]
    with pytest.raises(EmulatorError, match="the tensor map was not encoded for the emulator"):
        tma.get_function("tma_box<2>")(1, 32, (forged, np.zeros(2, np.int32), I32(1024), np.zeros(1024, np.uint8)),
                                       shared_mem=2048)


def store(mod, target, coords, box, swizzle, data, schedule="forward", *, add_blocks=0):
    """TMA-store the box `data` (its bytes as they lie in shared memory) at coords of target, or
    with add_blocks, have that many blocks each add it there."""
    spec = TensorMapSpec.of_array(target, box, swizzle=swizzle)
    mod.get_function(f"tma_store_box<{target.ndim}, {str(bool(add_blocks)).lower()}>")(
        max(add_blocks, 1), 64, (spec.emulated(), np.array(coords[::-1], np.int32), I32(spec.box_bytes), data),
        shared_mem=BOX_AT + spec.box_bytes, schedule=schedule)


def swizzled_bytes(values, swizzle):
    """values' bytes as a box of them lies in shared memory at BOX_AT with that swizzle."""
    raw = np.frombuffer(values.tobytes(), np.uint8)
    data = np.empty(raw.size, np.uint8)
    data[[swizzled(BOX_AT + o, swizzle) - BOX_AT for o in range(raw.size)]] = raw
    return data


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("swizzle,box", [(128, (8, 64)), (0, (8, 24))])
def test_tma_store_writes_the_box_inside_the_tensor(tma, schedule, swizzle, box):
    rng = np.random.default_rng(5)
    values = rng.standard_normal(box).astype(np.float16)
    target = np.full((37, 104), -1, np.float16)
    coords = (33, 72)  # 144 bytes into the row: a box's first element must be 16-byte aligned
    store(tma, target, coords, box, swizzle, swizzled_bytes(values, swizzle), schedule)
    want = np.full_like(target, -1)
    rows, cols = min(box[0], 37 - coords[0]), min(box[1], 104 - coords[1])
    want[coords[0]:coords[0] + rows, coords[1]:coords[1] + cols] = values[:rows, :cols]
    np.testing.assert_array_equal(target, want)


def reduce_add_case():
    """(target, values, coords, want): three blocks each add a float32 box of 8 rows x 32 (one
    128-byte swizzled line) at (33, 20) of a (37, 40) tensor, partly past its last rows and
    columns; the elements outside are not added. Small integers, so that any order of the adds
    gives the same float32 sums."""
    rng = np.random.default_rng(8)
    target = rng.integers(-50, 50, (37, 40)).astype(np.float32)
    values = rng.integers(-50, 50, (8, 32)).astype(np.float32)
    want = target.copy()
    want[33:37, 20:40] += 3 * values[:4, :20]
    return target, values, (33, 20), want


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tma_reduce_add_adds_the_box_inside_the_tensor(tma, schedule):
    target, values, coords, want = reduce_add_case()
    store(tma, target, coords, values.shape, 128, swizzled_bytes(values, 128), schedule, add_blocks=3)
    np.testing.assert_array_equal(target, want)


def test_tma_reduce_add_of_a_16_bit_box_is_refused():
    """The emulator's twin adds float32 (the only 4-byte type of cupy_attn's maps) and refuses the
    16-bit types rather than add their bits as something else."""
    with pytest.raises(EmulatorError, match="adds float32 elements only, and this map's are 2 bytes"):
        store(module(), np.zeros((8, 64), np.float16), (0, 0), (8, 64), 128, np.zeros(1024, np.uint8), add_blocks=1)


def test_tma_reduce_add_without_the_proxy_fence_adds_poison():
    target = np.zeros((8, 32), np.float32)
    store(module("-DNO_FENCE"), target, (0, 0), (8, 32), 128, np.zeros(1024, np.uint8), add_blocks=2)
    assert np.isnan(target).all()


def test_tma_store_without_the_proxy_fence_stores_poison():
    target = np.zeros((8, 64), np.float16)
    store(module("-DNO_FENCE"), target, (0, 0), (8, 64), 128, np.zeros(1024, np.uint8))
    assert np.isnan(target).all()


def test_tma_store_not_waited_for_is_reported():
    with pytest.raises(EmulatorError, match=r"exits with 1 TMA store\(s\) whose reads of shared memory it did not wait"):
        store(module("-DNO_STORE_WAIT"), np.zeros((8, 64), np.float16), (0, 0), (8, 64), 128, np.zeros(1024, np.uint8))


def run_wgmma(mod, mn_major, schedule="forward", a_mn_major=False):
    rng = np.random.default_rng(6)
    a = rng.standard_normal((64, 64)).astype(np.float16)  # K-major: A (m, k); MN-major: A's transpose (k, m)
    b = rng.standard_normal((64, 64)).astype(np.float16)  # K-major: B's transpose (n, k); MN-major: B (k, n)
    d = np.full((64, 64), np.nan, np.float32)
    maps = [TensorMapSpec.of_array(x, (64, 64), swizzle=128).emulated() for x in (a, b)]
    # 16 KB more than the boxes take: a wrong layout reads poison there, not past shared memory.
    mod.get_function(f"tma_wgmma<{str(a_mn_major).lower()}, {str(mn_major).lower()}>")(
        1, 128, (*maps, d), shared_mem=1024 + 4 * 8192, schedule=schedule)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = (a64.T if a_mn_major else a64) @ (b64 if mn_major else b64.T)
    return d, want


@pytest.mark.parametrize("mn_major", [False, True], ids=["k_major", "mn_major"])
@pytest.mark.parametrize("a_mn_major", [False, True], ids=["a_k_major", "a_mn_major"])
@pytest.mark.parametrize("schedule", ["forward", "warps_reverse"])
def test_wgmma_reads_boxes_tma_swizzled(tma, mn_major, a_mn_major, schedule):
    d, want = run_wgmma(tma, mn_major, schedule, a_mn_major)
    np.testing.assert_allclose(d, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mn_major", [False, True], ids=["k_major", "mn_major"])
@pytest.mark.parametrize("a_mn_major", [False, True], ids=["a_k_major", "a_mn_major"])
def test_wgmma_with_the_wrong_swizzle_is_wrong(mn_major, a_mn_major):
    d, want = run_wgmma(module("-DWRONG_SWIZZLE"), mn_major, a_mn_major=a_mn_major)
    assert not np.allclose(d, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("a_mn_major", [False, True], ids=["a_k_major", "a_mn_major"])
def test_wgmma_told_the_wrong_major_ness_of_a_is_wrong(a_mn_major):
    d, want = run_wgmma(module("-DWRONG_MAJOR_A"), True, a_mn_major=a_mn_major)
    assert not np.allclose(d, want, rtol=1e-4, atol=1e-4)


def test_wgmma_without_its_fence_fails():
    with pytest.raises(EmulatorError, match=r"wgmma.mma_async \(SS\) issued without a wgmma.fence since the thread's "
                                            "start or its last wgmma.wait_group"):
        run_wgmma(module("-DNO_WGMMA_FENCE"), True)


@pytest.mark.parametrize("register_a,operand", [(True, "A fragment"), (False, "accumulator")])
def test_wgmma_register_written_after_its_fence_fails(register_a, operand):
    """PTX ISA, wgmma.fence: a fence must come between a thread's access to a wgmma's registers
    and the wgmma; a register of a pinned array (fence_operands) that changed since the fence is
    reported at the wgmma's issue."""
    with pytest.raises(EmulatorError, match=rf"wgmma.mma_async \({'RS' if register_a else 'SS'}\): its {operand} "
                                            "registers were written after the thread's last wgmma.fence"):
        run_wide_wgmma(module("-DWRITE_AFTER_FENCE"), register_a)


@pytest.mark.parametrize("a_mn_major", [False, True], ids=["a_k_major", "a_mn_major"])
def test_wgmma_operand_starting_past_its_atoms_first_line_fails(a_mn_major):
    # The hardware takes the swizzle's phase from the descriptor's base offset (0), not from the
    # address, so a start one line into the atom reads other rows than the emulator's absolute
    # swizzle would: reported rather than emulated.
    with pytest.raises(EmulatorError, match="wgmma: A's 128-byte swizzled operand starts 128 bytes into its 1024-byte atom"):
        run_wgmma(module("-DMID_ATOM_START"), True, a_mn_major=a_mn_major)


def run_wide_wgmma(mod, register_a, schedule="forward", n=128):
    """tma_wgmma_wide: A (64 x 64) · B (64 x n), B MN-major in two boxes (of which n = 72 reads 8
    columns of the second), A from its box or from registers."""
    rng = np.random.default_rng(8)
    a = rng.standard_normal((64, 64)).astype(np.float16)
    b = rng.standard_normal((64, 128)).astype(np.float16)
    maps = [TensorMapSpec.of_array(x, (64, 64), swizzle=128).emulated() for x in (a, b)]
    d = np.full((64, n), np.nan, np.float32)
    mod.get_function(f"tma_wgmma_wide<{str(register_a).lower()}, {n}>")(
        1, 128, (*maps, a.astype(np.float32), d), shared_mem=1024 + 5 * 8192, schedule=schedule)
    return d, a.astype(np.float64) @ b[:, :n].astype(np.float64)


@pytest.mark.parametrize("n", [128, 72])
@pytest.mark.parametrize("register_a", [False, True], ids=["a_shared", "a_registers"])
@pytest.mark.parametrize("schedule", ["forward", "warps_reverse"])
def test_wgmma_reads_an_mn_major_operand_of_two_boxes(tma, register_a, schedule, n):
    d, want = run_wide_wgmma(tma, register_a, schedule, n)
    np.testing.assert_allclose(d, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [128, 72])
@pytest.mark.parametrize("register_a", [False, True], ids=["a_shared", "a_registers"])
def test_wgmma_with_the_wrong_leading_byte_offset_is_wrong(register_a, n):
    d, want = run_wide_wgmma(module("-DWRONG_LBO"), register_a, n=n)
    assert np.allclose(d[:, :64], want[:, :64], rtol=1e-4, atol=1e-4)  # the first box needs no step
    assert not np.allclose(d[:, 64:], want[:, 64:], rtol=1e-4, atol=1e-4)


# ---- tensor maps ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,message", [
    (dict(dtype=np.int32), "dtype must be float16, bfloat16 or float32, got int32"),
    (dict(address=0x1008), "address must be 16-byte aligned, got 0x1008"),
    (dict(dims=(64, 8, 1, 1, 1, 1), strides=(128,) * 5, box=(64,) * 6), "dims must have 1 to 5 entries, got 6"),
    (dict(dims=(64, 2**31 + 1)), r"dims\[1\] must lie in \[1, 2\^31\], got 2147483649"),
    (dict(strides=(130,)), r"strides\[0\] \(bytes, of dims\[1\]\) must be a positive multiple of 16 below 2\^40, got 130"),
    (dict(box=(64, 257)), r"box\[1\] must lie in \[1, 256\], got 257"),
    (dict(box=(4, 8), swizzle=0), "the box's innermost extent must span a multiple of 16 bytes, got 8"),
    (dict(box=(32, 8)), r"a 128-byte swizzle needs a box line of exactly 128 bytes \(64 elements\), got 64"),
    (dict(swizzle=16), r"swizzle must be one of \(0, 32, 64, 128\) \(bytes\), got 16"),
    (dict(strides=()), "a rank-2 map takes 1 strides and 2 box extents, got 0 and 2"),
])
def test_tensor_map_rules(kwargs, message):
    spec = dict(dtype=np.float16, address=0x1000, dims=(64, 8), strides=(128,), box=(64, 8), swizzle=128)
    with pytest.raises(TensorMapError, match=message):
        TensorMapSpec(**{**spec, **kwargs})


def test_tensor_map_of_an_array_needs_a_contiguous_last_axis():
    array = np.zeros((8, 128), np.float16)[:, ::2]
    with pytest.raises(TensorMapError, match="the array's last axis must be contiguous"):
        TensorMapSpec.of_array(array, (8, 64))


def test_tensor_map_of_an_array_lists_dims_innermost_first():
    array = np.zeros((3, 5, 64), np.float32)
    spec = TensorMapSpec.of_array(array, (1, 2, 32), swizzle=128)
    assert (spec.dims, spec.strides, spec.box) == ((64, 5, 3), (256, 1280), (32, 2, 1))
    assert spec.address == array.ctypes.data and spec.box_bytes == 256


# ---- the real instructions ------------------------------------------------------------------------
SASS_OPCODES = {
    "tma_box<2>": ["UTMALDG.2D", "SYNCS.PHASECHK"],
    "tma_box<3>": ["UTMALDG.3D"],
    "tma_store_box<2, false>": ["UTMASTG.2D", "FENCE.VIEW.ASYNC.S"],
    "tma_store_box<2, true>": ["UTMAREDG.2D.ADD", "FENCE.VIEW.ASYNC.S"],
    "tma_wgmma<false, true>": ["UTMALDG.2D", "HGMMA.64x64x16.F32"],
    "tma_wgmma<true, true>": ["UTMALDG.2D", "HGMMA.64x64x16.F32"],
    "tma_wgmma_wide<false, 128>": ["UTMALDG.2D", "HGMMA.64x128x16.F32"],
    "tma_wgmma_wide<true, 128>": ["UTMALDG.2D", "HGMMA.64x128x16.F32"],
    "tma_wgmma_wide<true, 72>": ["UTMALDG.2D", "HGMMA.64x72x16.F32"],
}


@pytest.mark.parametrize("kernel", sorted(SASS_OPCODES))
def test_tma_compiles_for_sm90a_to_the_hopper_instructions(kernel):
    compiled = _nvrtc.compile_kernel(SOURCE, kernel, "sm_90a", ("-std=c++17", f"-I{_paths.kernel_dir()}"))
    opcodes = {i.opcode for i in _sass.disassemble(compiled.cubin)[0]}
    for wanted in SASS_OPCODES[kernel]:
        assert any(op.startswith(wanted) for op in opcodes), (wanted, sorted(opcodes))


# ---- the producer/consumer pipeline (pipeline.cuh) ------------------------------------------------
PIPELINE = (HERE / "pipeline.cu").read_text()
TILES, STAGES, TILE_ROWS = 7, 3, 8


def pipelined_copy(schedule, *options):
    """7 tiles of 8 rows through 3 stages; the last tile half outside the 52-row tensor."""
    mod = RawModule(PIPELINE, options=("-I" + str(_paths.kernel_dir()), *options))
    array = np.random.default_rng(7).standard_normal((52, 64)).astype(np.float16)
    out = np.zeros((TILES, 1024), np.uint8)
    spec = TensorMapSpec.of_array(array, (TILE_ROWS, 64), swizzle=128)
    mod.get_function("pipelined_copy")(1, 256, (spec.emulated(), I32(TILES), out), shared_mem=1024 + STAGES * 1024,
                                       schedule=schedule, seed=1)
    want = np.stack([box_model(array, (TILE_ROWS * t, 0), (TILE_ROWS, 64), 128) for t in range(TILES)])
    return out, want


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_passes_every_tile_through_the_ring(schedule):
    # "warps": the producer's warp runs until the ring is full (far ahead); "warps_reverse": the
    # consumers run first and wait for every stage (the producer starves them).
    out, want = pipelined_copy(schedule)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("option", ["-DNO_EMPTY_WAIT", "-DNO_FULL_WAIT", "-DWRONG_PARITY"])
def test_pipeline_misuse_fails_on_some_schedule(option):
    failed = []
    for schedule in SCHEDULES:
        try:
            out, want = pipelined_copy(schedule, option)
        except EmulatorError as error:  # the emulator named the misuse
            reported = ("invalid phase use", "deadlock", "an arrival beyond", "no thread waited for")
            assert any(words in str(error) for words in reported), error
            failed.append(True)
            continue
        failed.append(not np.array_equal(out, want))
    assert any(failed)


def test_pipeline_compiles_for_sm90a_to_the_hopper_instructions():
    compiled = _nvrtc.compile_kernel(PIPELINE, "pipelined_copy", "sm_90a", ("-std=c++17", f"-I{_paths.kernel_dir()}"))
    opcodes = {i.opcode for i in _sass.disassemble(compiled.cubin)[0]}
    for wanted in ("UTMALDG.2D", "SYNCS.PHASECHK.TRANS64.TRYWAIT", "SYNCS.ARRIVE.TRANS64", "USETMAXREG", "ELECT"):
        assert any(op.startswith(wanted) for op in opcodes), (wanted, sorted(opcodes))


class _Enum(types.SimpleNamespace):
    """An enum of cuda.bindings.driver: members by name, each an int with a name."""

    def __init__(self, *names, start=0):
        super().__init__(**{name: _Member(start + i, name) for i, name in enumerate(names)})

    def __call__(self, value):
        return next(m for m in vars(self).values() if m == value)


class _Member(int):
    def __new__(cls, value, name):
        member = super().__new__(cls, value)
        member.name = name
        return member


# cuTensorMapEncodeTiled as CUDA 13's cuda.h declares it, written out here rather than taken from
# _tensor_map: a slip in the width of what an array argument points to fails the encoding tests,
# and test_the_encoding_prototype_is_cuda_hs compares every argument (on x86-64 a scalar of the
# wrong width would reach the fake alike, in its register).
_CUDA_H_ENCODE_TILED = ctypes.CFUNCTYPE(
    ctypes.c_int,                     # CUresult
    ctypes.c_void_p,                  # CUtensorMap *tensorMap
    ctypes.c_int,                     # CUtensorMapDataType tensorDataType
    ctypes.c_uint32,                  # cuuint32_t tensorRank
    ctypes.c_void_p,                  # void *globalAddress
    ctypes.POINTER(ctypes.c_uint64),  # const cuuint64_t *globalDim
    ctypes.POINTER(ctypes.c_uint64),  # const cuuint64_t *globalStrides
    ctypes.POINTER(ctypes.c_uint32),  # const cuuint32_t *boxDim
    ctypes.POINTER(ctypes.c_uint32),  # const cuuint32_t *elementStrides
    ctypes.c_int,                     # CUtensorMapInterleave interleave
    ctypes.c_int,                     # CUtensorMapSwizzle swizzle
    ctypes.c_int,                     # CUtensorMapL2promotion l2Promotion
    ctypes.c_int)                     # CUtensorMapFloatOOBfill oobFill


class _FakeDriver(types.ModuleType):
    """cuda.bindings.driver as _tensor_map uses it: enums, cuInit, and cuGetProcAddress handing out
    a C function (a ctypes callback) that records each encode's arguments, checks the map's
    alignment and writes the call's number into every word of the map."""

    def __init__(self):
        super().__init__("cuda.bindings.driver")
        self.calls, self.status = [], 0
        self.CUresult = _Enum("CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE")
        self.CUdriverProcAddress_flags = _Enum("CU_GET_PROC_ADDRESS_DEFAULT")
        self.CUtensorMapDataType = _Enum(*(f"CU_TENSOR_MAP_DATA_TYPE_{t}" for t in ("FLOAT16", "FLOAT32", "BFLOAT16")),
                                         start=5)
        self.CUtensorMapInterleave = _Enum("CU_TENSOR_MAP_INTERLEAVE_NONE", start=10)
        self.CUtensorMapSwizzle = _Enum(*(f"CU_TENSOR_MAP_SWIZZLE_{s}" for s in ("NONE", "32B", "64B", "128B")),
                                        start=20)
        self.CUtensorMapL2promotion = _Enum("CU_TENSOR_MAP_L2_PROMOTION_L2_128B", start=30)
        self.CUtensorMapFloatOOBfill = _Enum("CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE",
                                             "CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA", start=40)
        self.encode_tiled = _CUDA_H_ENCODE_TILED(self._encode_tiled)  # kept alive with the driver

    def cuInit(self, flags):
        return (self.CUresult.CUDA_SUCCESS,)

    def cuGetProcAddress(self, symbol, version, flags):
        assert symbol == b"cuTensorMapEncodeTiled" and version >= 12000
        return self.CUresult.CUDA_SUCCESS, ctypes.cast(self.encode_tiled, ctypes.c_void_p).value, 0

    def _encode_tiled(self, tensor_map, dtype, rank, address, dims, strides, box, element_strides, interleave,
                      swizzle, l2_promotion, oob_fill):
        self.calls.append(dict(
            aligned=tensor_map % _tensor_map.MAP_ALIGNMENT == 0, dtype=self.CUtensorMapDataType(dtype).name,
            address=address, dims=tuple(dims[:rank]), strides=tuple(strides[:rank - 1]), box=tuple(box[:rank]),
            element_strides=tuple(element_strides[:rank]), interleave=self.CUtensorMapInterleave(interleave).name,
            swizzle=self.CUtensorMapSwizzle(swizzle).name, l2=self.CUtensorMapL2promotion(l2_promotion).name,
            fill=self.CUtensorMapFloatOOBfill(oob_fill).name))
        words = (ctypes.c_uint64 * 16).from_address(tensor_map)
        words[:] = [len(self.calls)] * 16
        return self.status


@pytest.fixture
def fake_driver(monkeypatch):
    driver = _FakeDriver()
    package = types.ModuleType("cuda.bindings")
    package.driver = driver
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", package)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)
    _tensor_map._encode.cache_clear()
    _tensor_map._driver_encode_tiled.cache_clear()
    yield driver
    _tensor_map._encode.cache_clear()
    _tensor_map._driver_encode_tiled.cache_clear()


def test_the_encoding_prototype_is_cuda_hs():
    assert _tensor_map._ENCODE_TILED._argtypes_ == _CUDA_H_ENCODE_TILED._argtypes_
    assert _tensor_map._ENCODE_TILED._restype_ == _CUDA_H_ENCODE_TILED._restype_


def test_the_driver_encodes_each_map_with_its_fields_into_aligned_memory(fake_driver):
    """What reaches the driver's function: the spec's fields innermost first, element strides of 1,
    the enums' values, and a map address aligned as cuTensorMapEncodeTiled requires; what comes
    back is the 128 bytes it wrote there."""
    spec = TensorMapSpec(np.dtype(ml_dtypes.bfloat16), 1 << 20, (64, 300, 3), (256, 76800), (64, 128, 1),
                         swizzle=128, oob_nan=True)
    encoded = spec.encoded()
    assert fake_driver.calls == [dict(
        aligned=True, dtype="CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", address=1 << 20, dims=(64, 300, 3),
        strides=(256, 76800), box=(64, 128, 1), element_strides=(1, 1, 1), interleave="CU_TENSOR_MAP_INTERLEAVE_NONE",
        swizzle="CU_TENSOR_MAP_SWIZZLE_128B", l2="CU_TENSOR_MAP_L2_PROMOTION_L2_128B",
        fill="CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA")]
    assert encoded.dtype == _tensor_map.ARGUMENT and list(encoded["opaque"]) == [1] * 16
    TensorMapSpec(np.float32, 1 << 20, (300,), (), (4,)).encoded()
    assert fake_driver.calls[1]["dims"] == (300,) and fake_driver.calls[1]["strides"] == ()
    assert fake_driver.calls[1]["swizzle"] == "CU_TENSOR_MAP_SWIZZLE_NONE"
    assert fake_driver.calls[1]["fill"] == "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE"


def test_encoded_maps_are_cached_per_map(fake_driver, monkeypatch):
    """The driver encodes each distinct map once: the same array and box again reuse it (a copy),
    another address or box is encoded anew, and a refusal is not remembered."""
    spec = dict(dtype=np.float16, address=1 << 20, dims=(64, 300), strides=(128,), box=(64, 128), swizzle=128)
    first = TensorMapSpec(**spec).encoded()
    again = TensorMapSpec(**spec).encoded()
    assert len(fake_driver.calls) == 1 and bytes(first) == bytes(again) and first is not again
    other = TensorMapSpec(**{**spec, "address": 2 << 20}).encoded()
    TensorMapSpec(**{**spec, "box": (64, 64)}).encoded()
    assert len(fake_driver.calls) == 3 and bytes(other) != bytes(first)
    fake_driver.status = int(fake_driver.CUresult.CUDA_ERROR_INVALID_VALUE)
    wrong = TensorMapSpec(**{**spec, "address": 3 << 20})
    for _ in range(2):
        with pytest.raises(TensorMapError, match="refused .* CUDA_ERROR_INVALID_VALUE"):
            wrong.encoded()
    assert len(fake_driver.calls) == 5


def test_checked_specs_are_remembered_per_fields_and_refusals_raise_each_time(fake_driver):
    """_tensor_map.checked: the same fields give the same spec (checked and, once encoded, sent to
    the driver once), other fields another; a spec the rules refuse raises on every call."""
    fields = (np.dtype(np.float16), 1 << 20, (64, 300), (128,), (64, 128), 128)
    first = _tensor_map.checked(*fields)
    assert _tensor_map.checked(*fields) is first and first == TensorMapSpec(*fields)
    assert _tensor_map.checked(*fields[:1], 2 << 20, *fields[2:]) is not first
    first.encoded(), _tensor_map.checked(*fields).encoded()
    assert len(fake_driver.calls) == 1
    for _ in range(2):
        with pytest.raises(TensorMapError, match="strides\\[0\\] .* must be a positive multiple of 16"):
            _tensor_map.checked(*fields[:3], (100,), *fields[4:])


def test_a_driver_without_the_encoder_is_refused(fake_driver, monkeypatch):
    monkeypatch.setattr(fake_driver, "cuGetProcAddress",
                        lambda *args: (fake_driver.CUresult.CUDA_ERROR_INVALID_VALUE, 0, 0))
    with pytest.raises(TensorMapError, match="no cuTensorMapEncodeTiled: CUDA_ERROR_INVALID_VALUE"):
        TensorMapSpec(np.float16, 1 << 20, (64,), (), (64,)).encoded()
