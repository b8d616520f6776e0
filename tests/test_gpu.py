"""The CUDA backend on a real GPU (marked gpu: run when CuPy reaches a GPU, skipped otherwise)."""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import _config, _kernel_backend, reference
from helpers import BF16, assert_close, random_qkv, recorded_launches
from test_forward import FEATURES, feature_keywords

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(_kernel_backend, "POISON_OUTPUTS", True)


@pytest.fixture(params=["default", "wgmma"])
def tensor_core_kernels(request, monkeypatch):
    """The GPU's default kernels (mma.sync for fp16/bf16 on every GPU from compute capability 8.0,
    H100/H200 included, where they measured faster) and, on compute capability 9.0, the wgmma
    kernels (the fp16/bf16 forward, and dK/dV up to D = 128)."""
    if request.param != "wgmma":
        yield request.param
        return
    if int(cupy.cuda.Device().compute_capability) != 90:
        pytest.skip("the wgmma kernels are built for sm_90a: compute capability 9.0 only")
    if getattr(request.node, "callspec", None) and request.node.callspec.params.get("dtype") == np.float32:
        # float32 runs the CUDA-core kernels whatever the family: the default twin is the same test
        pytest.skip("the wgmma kernels take fp16 and bf16: this float32 case is its default twin's")
    monkeypatch.setattr(_kernel_backend, "CUDA_COMPUTE_CAPABILITY", 90)
    said = []
    monkeypatch.setattr(_kernel_backend, "_say_once", said.append)
    yield request.param
    # Calls TMA cannot address (rows of 14 bytes at d = 7, packed batches) run the mma.sync kernels
    # by design; any other fallback (cuda-bindings missing, the driver refusing a map) would have
    # tested them under the wgmma name.
    assert [m for m in said if not any(reason in m for reason in _LAYOUTS_TMA_CANNOT_ADDRESS)] == []


_LAYOUTS_TMA_CANNOT_ADDRESS = ("must be a positive multiple of 16", "a packed (varlen) batch")


def on_gpu(*arrays):
    return [cupy.asarray(a) for a in arrays]


def check(q, k, v, dtype, **kw):
    gpu_kw = {n: cupy.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    out, lse = cupy_attn.attention(*on_gpu(q, k, v), return_lse=True, **gpu_kw)
    assert isinstance(out, cupy.ndarray) and out.dtype == dtype
    want_out, want_lse = reference.attention(q, k, v, **kw)
    assert_close(out.get(), want_out, dtype, what="out")
    assert_close(lse.get(), want_lse, dtype, what="lse")


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("d", [16, 40, 64, 80, 96, 128, 256, 7, 200])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(tensor_core_kernels, dtype, d, causal):
    rng = np.random.default_rng(d)
    q, k, v = random_qkv(rng, b=2, h=4, hkv=2, sq=513, sk=1031, d=d, dtype=dtype)
    check(q, k, v, dtype, causal=causal)


def launched_kernels(monkeypatch) -> list:
    from cupy_attn import _compile

    launched = []
    real_function = _compile.function
    monkeypatch.setattr(_compile, "function", lambda target, f, name, **kw: launched.append(name) or real_function(target, f, name, **kw))
    return launched


@pytest.mark.parametrize("requested", [None, "90"], ids=["default", "environment_90"])
def test_hopper_gpus_run_mma_sync_unless_wgmma_is_asked_for(monkeypatch, requested):
    if int(cupy.cuda.Device().compute_capability) != 90:
        pytest.skip("the wgmma kernels are built for sm_90a: compute capability 9.0 only")
    if requested:
        monkeypatch.setenv(_kernel_backend.CAPABILITY_VARIABLE, requested)
    family = 90 if requested else 80
    launched = launched_kernels(monkeypatch)
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, b=1, h=2, sq=300, sk=300, d=128, dtype=BF16)
    check(q, k, v, BF16, causal=True)
    assert launched == [_config.forward_tile(128, 128, BF16, family).name_expression(BF16)]
    assert ("wgmma" in launched[0]) == (family == 90)
    gq, gk, gv = on_gpu(q, k, v)
    out, lse = cupy_attn.attention(gq, gk, gv, causal=True, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(BF16)
    launched.clear()
    grads = cupy_attn.attention_backward(cupy.asarray(dout), gq, gk, gv, out, lse, causal=True)
    # the H100/H200's 227 KB: the mma.sync dK/dV at D = 128 takes its 128-key tile
    tile = _config.backward_tile(128, 128, BF16, family, _kernel_backend.shared_limit("cuda"))
    name = tile.name_expression(BF16, accumulate_dq=True) if family == 90 else tile.name_expression(BF16)
    assert name in launched and (family == 90 or tile.block_n == 128)
    for g, w in zip(grads, reference.attention_gradients(dout, q, k, v, causal=True)):
        assert_close(g.get(), w, BF16, grad=True)


def test_environment_cannot_ask_for_kernels_the_gpu_cannot_run(monkeypatch):
    device = int(cupy.cuda.Device().compute_capability)
    q, k, v = on_gpu(*random_qkv(np.random.default_rng(6), d=64, dtype=np.float16))
    monkeypatch.setenv("CUPY_ATTN_COMPUTE_CAPABILITY", str(device + 1 if device != 90 else 100))
    with pytest.raises(ValueError, match="asks for kernels this GPU"):
        cupy_attn.attention(q, k, v)
    if device != 90:
        monkeypatch.setenv("CUPY_ATTN_COMPUTE_CAPABILITY", "90")
        with pytest.raises(ValueError, match="asks for kernels this GPU"):
            cupy_attn.attention(q, k, v)


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_features(tensor_core_kernels, feature, layout):
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, b=3, h=4, hkv=2, sq=113, sk=203, d=64, dtype=np.float16, layout=layout)
    check(q, k, v, np.float16, layout=layout, **feature_keywords(feature, rng))


@pytest.mark.parametrize("sq, sk, causal", [(1, 1, False), (7, 64, False), (65, 129, False), (200, 385, True),
                                             (300, 70, True), (70, 300, "top_left")])
@pytest.mark.parametrize("d", [64, 128])
def test_tile_counts_and_blocks_without_work(tensor_core_kernels, sq, sk, causal, d):
    """One to four key tiles per block, and blocks with nothing to do: query blocks that see no
    key (bottom-right causal, Sq > Sk: the first Sq - Sk rows) and key blocks that no query sees
    (top-left, Sk > Sq: keys from Sq on), forward and backward. The warp-specialised kernels'
    producer and consumers must agree on every count, zero included, or the block hangs."""
    rng = np.random.default_rng(sq * 1000 + sk)
    q, k, v = random_qkv(rng, b=2, h=4, hkv=2, sq=sq, sk=sk, d=d, dtype=BF16)
    check_with_gradients(q, k, v, BF16, rng, causal=causal)


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_tiles_in_sections_of_pairs(monkeypatch, tensor_core_kernels, dtype, deterministic):
    """The tensor-core kernels' grid (pairs per section, tiles, sections; kernels/block_info.cuh
    query_block_place, key_block_place) with the L2 taken as one kv head's K and V: the forward's
    and dQ's 6 sections of 2 of the 12 (batch entry, head) pairs, dK/dV's 12 of 1 (a head's Q and
    dO, 700 x 264 bytes, fit once), in (batch, seq, head) rows with lengths per entry, so that a
    block given another pair reads other rows."""
    from cupy_attn import _schedule

    monkeypatch.setattr(_schedule, "L2_SHARE", 1.0)
    monkeypatch.setattr(_kernel_backend, "_device_l2_bytes", lambda device: 1031 * 2 * 64 * dtype.itemsize)
    # The sectioned grids as the launcher shapes them (the persistent wgmma forward then hands
    # their blocks out as work tiles on a grid of its own).
    grids = []
    for shape in ("_query_grid", "_key_grid"):
        real = getattr(_kernel_backend, shape)
        monkeypatch.setattr(_kernel_backend, shape, lambda *a, real=real, shape=shape:
                            grids.append((shape, real(*a))) or grids[-1][1])
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, b=2, h=6, hkv=3, sq=700, sk=1031, d=64, dtype=dtype, layout="bshd")
    check_with_gradients(q, k, v, dtype, rng, deterministic=deterministic, causal=True, layout="bshd",
                         q_lengths=np.array([700, 433]), kv_lengths=np.array([1031, 612]))
    query_tiled = [grid for shape, grid in grids if shape == "_query_grid"]  # the forward and the dQ kernel
    key_tiled = [grid for shape, grid in grids if shape == "_key_grid"]
    assert len(query_tiled) == 1 + deterministic and all(g[0] == 2 and g[2] == 6 for g in query_tiled), grids
    assert len(key_tiled) == 1 and key_tiled[0][0] == 1 and key_tiled[0][2] == 12, grids


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_more_work_tiles_than_sms(monkeypatch, tensor_core_kernels, d, causal):
    """More query tiles than an H100/H200 has SMs (3 entries x 24 heads x 6 tiles of 128 rows = 432
    on 132): the persistent wgmma forward's blocks claim the work tiles past their first
    (kernels/block_info.cuh WorkTiles::claim), of differing work under the causal mask, with an
    entry without keys among them (its tiles hand on their next at once); twice in a row, each
    launch on a counter of its own."""
    grids = recorded_launches(monkeypatch)
    rng = np.random.default_rng(d + causal)
    q, k, v = random_qkv(rng, b=3, h=24, hkv=8, sq=700, sk=650, d=d, dtype=BF16)
    for _ in range(2):
        check(q, k, v, BF16, causal=causal, kv_lengths=np.array([650, 0, 333], np.int32))
    if tensor_core_kernels == "wgmma":
        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        assert [g for n, g in grids if n.startswith("attention_fwd_wgmma")] == [(min(432, sms), 1, 1)] * 2, grids


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward(tensor_core_kernels, dtype, deterministic, d):
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, b=2, h=8, hkv=2, sq=700, sk=1031, d=d, dtype=dtype)
    kw = dict(causal=True, softcap=10.0, kv_lengths=np.array([1031, 600]))
    gq, gk, gv = on_gpu(q, k, v)
    gkw = dict(kw, kv_lengths=cupy.asarray(kw["kv_lengths"]))
    out, lse = cupy_attn.attention(gq, gk, gv, return_lse=True, **gkw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = cupy_attn.attention_backward(cupy.asarray(dout), gq, gk, gv, out, lse, deterministic=deterministic, **gkw)
    want = reference.attention_gradients(dout, q, k, v, **kw)
    for g, w in zip(grads, want):
        assert_close(g.get(), w, dtype, grad=True)
    if deterministic:
        again = cupy_attn.attention_backward(cupy.asarray(dout), gq, gk, gv, out, lse, deterministic=True, **gkw)
        for a, b in zip(grads, again):
            assert bool((a.view(cupy.uint8) == b.view(cupy.uint8)).all())


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("least", [False, True], ids=["this_gpus_limit", "99KB_limit"])
def test_both_mma_sync_dkdv_tiles_at_d128(monkeypatch, dtype, least):
    """The mma.sync dK/dV at D = 128 in the tile this GPU's shared memory takes (128 keys in 8
    warps where a block may have 111 KB: A100, H100, H200) and in the 64-key one of 99 KB GPUs
    (sm_86, sm_89, sm_120), chosen here by the limit the launcher is told."""
    limit = _config.LEAST_SHARED_LIMIT if least else _kernel_backend.shared_limit("cuda")
    monkeypatch.setattr(_kernel_backend, "shared_limit", lambda target: limit)
    monkeypatch.setattr(_kernel_backend, "CUDA_COMPUTE_CAPABILITY", 80)
    launched = launched_kernels(monkeypatch)
    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, b=2, h=4, hkv=2, sq=333, sk=517, d=128, dtype=dtype)
    kw = dict(causal=True, kv_lengths=np.array([517, 260]))
    gkw = dict(kw, kv_lengths=cupy.asarray(kw["kv_lengths"]))
    out, lse = cupy_attn.attention(*on_gpu(q, k, v), return_lse=True, **gkw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = cupy_attn.attention_backward(cupy.asarray(dout), *on_gpu(q, k, v), out, lse, **gkw)
    for g, w in zip(grads, reference.attention_gradients(dout, q, k, v, **kw)):
        assert_close(g.get(), w, dtype, grad=True)
    tile = _config.backward_tile(128, 128, dtype, 80, limit)
    assert tile.name_expression(dtype) in launched and tile.shared_bytes <= limit


def test_cupy_compiles_with_the_options_the_report_uses(monkeypatch, tmp_path):
    """CuPy's NVRTC call gets exactly _compile.gpu_build_options plus options that change no code
    (include paths, its -arch for this device, cache and PCH flags): a CuPy release that adds a
    code-changing option fails here, before the compile report drifts from the code that runs."""
    from cupy.cuda import _compiler_cache, compiler

    from cupy_attn import _compile

    seen = []  # (name expressions, options) of each NVRTC program CuPy compiles
    real_compile = compiler._NVRTCProgram.compile
    monkeypatch.setattr(compiler._NVRTCProgram, "compile", lambda self, options=(), *a, **k:
                        seen.append((self.name_expressions or (), options)) or real_compile(self, options, *a, **k))
    # A cold cache, so NVRTC must build the kernel: CuPy reads CUPY_CACHE_DIR once, at import, into
    # its cache backend (cupy/cuda/_compiler_cache.py), and gpu_check.sh's precompile has filled
    # that one. (With a warm cache the only compile seen was CuPy's empty-file version probe, which
    # is built without --device-as-default-execution-space: the first H200 run failed on that.)
    monkeypatch.setattr(compiler, "_kernel_cache_backend", _compiler_cache.DiskKernelCacheBackend(str(tmp_path)))
    # CuPy also keeps each process's modules by source and options (cupy/_core/raw.pyx): a source
    # of its own, so that an earlier test of this process that built the kernel does not serve it.
    source = _compile.kernel_source
    monkeypatch.setattr(_compile, "kernel_source", lambda filename: source(filename) + f"\n// {tmp_path}\n")
    _compile._function.cache_clear()
    filename = "attention_fwd_wgmma.cu" if int(cupy.cuda.Device().compute_capability) == 90 else "attention_fwd_tc.cu"
    name = (_config.HOPPER_TILES if "wgmma" in filename else _config.TENSOR_CORE_TILES)[1].name_expression(np.float16)
    try:
        _compile.function("cuda", filename, name)
    finally:
        _compile._function.cache_clear()
    builds = [options for names, options in seen if name in names]
    assert len(builds) == 1, seen
    options = builds[0]
    expected = _compile.gpu_build_options(filename)
    assert set(expected) <= set(options)
    no_code_change = ("-I", "-arch=sm_", "-arch=compute_", "--pch", "--std=", "-DCUPY_USE_JITIFY")
    assert [o for o in options if o not in expected and not o.startswith(no_code_change)] == []


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_varlen(tensor_core_kernels, dtype, deterministic):
    """attention_varlen's packed builds on the GPU, forward and backward, against the padded
    reference (the helpers of tests/test_varlen.py); empty and tile-crossing sequences."""
    from test_varlen import cu, packed_inputs, reference_varlen

    rng = np.random.default_rng(7)
    lens_q, lens_k = [130, 0, 1, 517, 64], [200, 9, 0, 600, 64]
    q, k, v = packed_inputs(rng, lens_q, lens_k, h=8, hkv=2, d=128, dtype=dtype)
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    args = (cupy.asarray(cu_q), cupy.asarray(cu_k), max(lens_q), max(lens_k))
    out, lse = cupy_attn.attention_varlen(*on_gpu(q, k, v), *args, causal=True, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(dtype)
    want = reference_varlen(q, k, v, cu_q, cu_k, dout, causal=True)
    assert_close(out.get(), want[0], dtype, what="out")
    assert_close(lse.get(), want[1], dtype, what="lse")
    grads = cupy_attn.attention_varlen_backward(cupy.asarray(dout), *on_gpu(q, k, v), out, lse, *args, causal=True,
                                                deterministic=deterministic)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want[2:]):
        assert_close(g.get(), w, dtype, grad=True, what=name)


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
def test_sinks(tensor_core_kernels, dtype):
    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, b=2, h=4, hkv=2, sq=300, sk=517, d=128, dtype=dtype)
    sinks = (rng.standard_normal(4) * 2).astype(np.float32)
    kw = dict(causal=True, q_lengths=np.array([300, 120]), sinks=sinks)
    check(q, k, v, dtype, **kw)
    gpu_kw = {n: cupy.asarray(x) for n, x in kw.items() if n != "causal"}
    out, lse = cupy_attn.attention(*on_gpu(q, k, v), causal=True, return_lse=True, **gpu_kw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = cupy_attn.attention_backward(cupy.asarray(dout), *on_gpu(q, k, v), out, lse, causal=True, **gpu_kw)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), grads, reference.attention_gradients(dout, q, k, v, **kw)):
        assert_close(g.get(), w, dtype, grad=True, what=name)


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
def test_lse_of_long_rows(tensor_core_kernels, dtype):
    """Rows of 128K keys with small scores (P near 1 everywhere). The mma.sync forward, and the
    wgmma forward at D = 64, sum P on the tensor cores, whose float32 additions were measured (on
    A100s, in published work) to
    truncate: at most one ulp per 16 keys, so lse might come out low by up to about 1e-3 here.
    lse must stay within 2e-3 of the reference, tighter than the dtypes' tolerances (0.03 and 0.2
    at lse = 11.8), and out within them."""
    rng = np.random.default_rng(22)
    q, k, v = random_qkv(rng, b=1, h=2, sq=64, sk=131072, d=64, dtype=np.float32)
    q, k, v = (q * 0.25).astype(dtype), k.astype(dtype), v.astype(dtype)
    out, lse = cupy_attn.attention(*on_gpu(q, k, v), return_lse=True)
    want_out, want_lse = reference.attention(q, k, v)
    assert_close(out.get(), want_out, dtype, what="out")
    assert np.abs(lse.get() - want_lse).max() <= 2e-3


def check_with_gradients(q, k, v, dtype, rng, deterministic=False, **kw):
    """Forward and backward on the GPU against the reference; the keywords' NumPy arrays go to the
    device."""
    gpu_kw = {n: cupy.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    out, lse = cupy_attn.attention(*on_gpu(q, k, v), return_lse=True, **gpu_kw)
    want_out, want_lse = reference.attention(q, k, v, **kw)
    assert_close(out.get(), want_out, dtype, what="out")
    assert_close(lse.get(), want_lse, dtype, what="lse")
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = cupy_attn.attention_backward(cupy.asarray(dout), *on_gpu(q, k, v), out, lse, deterministic=deterministic,
                                         **gpu_kw)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), grads, reference.attention_gradients(dout, q, k, v, **kw)):
        assert_close(g.get(), w, dtype, grad=True, what=name)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16), BF16], ids=str)
def test_dropout(tensor_core_kernels, dtype):
    """The keep-mask read back from the GPU (q = k = 0, v = I: out = Z / ((1 − p)·Sk)) is
    dropout_mask's, bit for bit; outputs and gradients match the reference."""
    b, h, sq, sk, p = 2, 3, 77, 130, 0.3
    v = np.broadcast_to(np.eye(sk, dtype=dtype), (b, 1, sk, sk)).copy()
    q, k = np.zeros((b, h, sq, 16), dtype), np.zeros((b, 1, sk, 16), dtype)
    out = cupy_attn.attention(*on_gpu(q, k, v), dropout_p=p, dropout_seed=2 ** 50 + 7, dropout_offset=3)
    np.testing.assert_array_equal(out.get().astype(np.float64) * (1 - p) * sk > 0.5,
                                  cupy_attn.dropout_mask((b, h, sq, sk), p, 2 ** 50 + 7, 3))
    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, b=2, h=4, hkv=2, sq=300, sk=517, d=64, dtype=dtype)
    check_with_gradients(q, k, v, dtype, rng, causal=True, dropout_p=0.2, dropout_seed=11, deterministic=True)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("d, dv", [(576, 512), (512, 512), (320, 96)])
def test_head_dims_above_256(dtype, d, dv):
    """The wide tiles on GPUs that give a block 163 KB of shared memory, a clear error elsewhere."""
    rng = np.random.default_rng(d + dv)
    q, k, v = random_qkv(rng, b=1, h=4, hkv=2, sq=200, sk=333, d=d, dv=dv, dtype=dtype)
    if cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"] < _config.WIDE_SHARED_LIMIT:
        with pytest.raises(ValueError, match="head dims above 256 need one with at least"):
            cupy_attn.attention(*on_gpu(q, k, v))
        return
    for deterministic in (False, True):
        check_with_gradients(q, k, v, dtype, rng, causal=True, deterministic=deterministic)


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
def test_mods(tensor_core_kernels, dtype):
    rng = np.random.default_rng(10)
    q, k, v = random_qkv(rng, b=2, h=4, hkv=2, sq=300, sk=517, d=128, dtype=dtype)
    doc = cupy.asarray(np.sort(rng.integers(0, 6, (2, 517)), axis=1).astype(np.int32))
    mask = cupy_attn.MaskMod("doc(b, q_idx) == doc(b, kv_idx)",
                             lambda b, h, q_idx, kv_idx, doc: doc[b, q_idx] == doc[b, kv_idx], tensors={"doc": doc})
    score = cupy_attn.ScoreMod("c * tanhf(score / c)", lambda s, b, h, q_idx, kv_idx, c: c * np.tanh(s / c),
                               scalars={"c": 4.0}, grad="1.0f - tanhf(score / c) * tanhf(score / c)")
    host_mask = cupy_attn.MaskMod(mask.cuda, mask.numpy, tensors={"doc": doc.get()})
    gpu_kw = dict(causal=True, mask_mod=mask, score_mod=score)
    out, lse = cupy_attn.attention(*on_gpu(q, k, v), return_lse=True, **gpu_kw)
    want_out, _ = reference.attention(q, k, v, causal=True, mask_mod=host_mask, score_mod=score)
    assert_close(out.get(), want_out, dtype, what="out")
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = cupy_attn.attention_backward(cupy.asarray(dout), *on_gpu(q, k, v), out, lse, **gpu_kw)
    want = reference.attention_gradients(dout, q, k, v, causal=True, mask_mod=host_mask, score_mod=score)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert_close(g.get(), w, dtype, grad=True, what=name)
    # The same with a block mask evaluated on the GPU.
    gpu_kw["block_mask"] = cupy_attn.block_mask(mask, 2, 4, 300, 517, like=doc)
    blocked, _ = cupy_attn.attention(*on_gpu(q, k, v), return_lse=True, **gpu_kw)
    assert_close(blocked.get(), want_out, dtype, what="out with block_mask")
    grads = cupy_attn.attention_backward(cupy.asarray(dout), *on_gpu(q, k, v), blocked, lse, **gpu_kw)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert_close(g.get(), w, dtype, grad=True, what=name)
