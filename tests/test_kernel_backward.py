"""The CUDA backward kernels, run on the CPU by the emulator, against the float64 reference.

Every output buffer is poisoned with NaN before the kernels run."""
import logging

import numpy as np
import pytest

import cupy_attn
from cupy_attn import _compile, _config, _kernel_backend, _paths, emulator, reference
from helpers import BF16, assert_close, random_qkv, tma_addressable
from test_forward import FEATURES, feature_keywords
from test_kernel_forward import strided_key_masks


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(_kernel_backend, "POISON_OUTPUTS", True)


@pytest.fixture(params=[80, 90], ids=["mma_sync", "wgmma"])
def tensor_core_kernel(request, monkeypatch):
    """fp16/bf16 inputs on the mma.sync kernels (compute capability 8.x) or the Hopper ones (9.0:
    wgmma forward, and wgmma dK/dV up to D = 128), which the emulator runs when it stands in for
    an sm_90 device."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", request.param)
    return request.param


def gradients(q, k, v, dout, deterministic, **kw):
    out, lse = cupy_attn.attention(q, k, v, return_lse=True, **kw)
    return cupy_attn.attention_backward(dout, q, k, v, out, lse, backend="emulator", deterministic=deterministic, **kw)


def check(rng, q, k, v, dtype, deterministic, addressable=False, **kw):
    """The kernels' gradients against the reference's; with `addressable`, dout in rows TMA can
    read (as q, k, v then should be)."""
    dout = rng.standard_normal(cupy_attn.attention(q, k, v, **kw).shape).astype(dtype)
    if addressable:
        dout = tma_addressable(dout)
    grads = gradients(q, k, v, dout, deterministic, **kw)
    want = reference.attention_gradients(dout, q, k, v, **kw)
    for name, g, w, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert g.dtype == dtype and g.shape == x.shape, name
        assert_close(g, w, dtype, grad=True, what=name)
    return grads


@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("sq,sk", [(1, 203), (7, 7), (113, 203), (203, 113), (257, 31)])
@pytest.mark.parametrize("causal", [False, True, "top_left"])
@pytest.mark.parametrize("schedule", ["random", "warps"])
def test_row_tiles_of_the_128_row_deterministic_dq(monkeypatch, schedule, d, sq, sk, causal):
    """The deterministic dQ at D <= 64 takes 128 query rows per block, two row tiles of 16 rows per
    warp, 64 rows apart (as the mma.sync forward): blocks whose second row tile is partly or wholly
    past the sequence, causal rows of one warp that see different key tiles, and (D = 64) tiles of
    32 keys; a mask in some, read by each row tile's rows."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_SCHEDULE", schedule)
    assert _config.tensor_core_dq_tile(d, d).dq_block_m == 128
    launched = spy_launches(monkeypatch)
    rng = np.random.default_rng(sq * 13 + sk + d)
    for dtype in (np.dtype(np.float16), BF16):
        q, k, v = random_qkv(rng, b=1, h=2, hkv=1, sq=sq, sk=sk, d=d, dtype=dtype)
        mask = rng.random((1, 2, sq, sk)) < 0.8 if sq == 113 else None
        check(rng, q, k, v, dtype, True, causal=causal, mask=mask)
    assert _config.tensor_core_dq_tile(d, d).dq_name(BF16) in launched, launched


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_features(feature, layout, deterministic):
    rng = np.random.default_rng(len(feature) * 7 + deterministic)
    q, k, v = random_qkv(rng, b=3, h=4, hkv=2, sq=113, sk=203, d=40, dv=24, layout=layout)
    check(rng, q, k, v, np.float32, deterministic, layout=layout, **feature_keywords(feature, rng))


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("d,dv", [(16, 16), (64, 64), (80, 80), (128, 128), (256, 256), (7, 33), (130, 3)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_dtypes_and_head_dims(dtype, d, dv, deterministic):
    rng = np.random.default_rng(d * 100 + dv)
    q, k, v = random_qkv(rng, b=2, h=2, hkv=1, sq=37, sk=70, d=d, dv=dv, dtype=dtype)
    check(rng, q, k, v, dtype, deterministic, causal=True)


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("d,dv", [(16, 16), (64, 64), (80, 80), (128, 128), (7, 33), (130, 3)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_wgmma_dtypes_and_head_dims(monkeypatch, dtype, d, dv, deterministic):
    """q, k, v and dout in rows TMA can read (padded to 16 bytes), so every case up to D = 128
    runs the wgmma dK/dV (asserted); 130 dims run the mma.sync one."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    launched = spy_launches(monkeypatch)
    rng = np.random.default_rng(d * 100 + dv + 1)
    q, k, v = random_qkv(rng, b=2, h=2, hkv=1, sq=77, sk=150, d=d, dv=dv, dtype=dtype)
    check(rng, *(tma_addressable(x) for x in (q, k, v)), dtype, deterministic, addressable=True, causal=True)
    dkdv = [name for name in launched if "dkdv" in name]
    assert len(dkdv) == 1 and dkdv[0].startswith("attention_bwd_dkdv_wgmma<" if max(d, dv) <= 128 else
                                                  "attention_bwd_dkdv_tc<"), launched


def spy_launches(monkeypatch):
    """The name expressions of the kernels launched from now on, in order."""
    launched = []
    real_function = _compile.function
    monkeypatch.setattr(_compile, "function",
                        lambda target, f, name, **kw: launched.append(name) or real_function(target, f, name, **kw))
    return launched


@pytest.mark.parametrize("limit,keys", [(_config.LEAST_SHARED_LIMIT, 64), (163 * 1024, 128)],
                         ids=["99KB_gpu", "163KB_gpu"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("schedule", ["forward", "warps_reverse"])
def test_mma_sync_dkdv_at_d128_takes_the_tile_the_gpus_shared_memory_fits(monkeypatch, limit, keys, deterministic,
                                                                          schedule):
    """The mma.sync dK/dV at D = 128: blocks of 128 keys in 8 warps (111 KB of shared memory) on
    GPUs that let a block have them, of 64 keys in 4 warps on those of 99 KB (sm_86, sm_89,
    sm_120); both against the reference with causal masks, lengths and key blocks cut short
    (203 keys: one and a half blocks of 128), in the order of their launches."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_SHARED_LIMIT", limit)
    monkeypatch.setattr(_kernel_backend, "EMULATOR_SCHEDULE", schedule)
    launched = spy_launches(monkeypatch)
    rng = np.random.default_rng(keys + deterministic)
    q, k, v = random_qkv(rng, b=2, h=2, hkv=1, sq=113, sk=203, d=128, dtype=np.float16)
    check(rng, q, k, v, np.float16, deterministic, causal=True, kv_lengths=[203, 150])
    tile = _config.backward_tile(128, 128, np.float16, 80, limit)
    assert (tile.block_n, tile.threads) == (keys, 256 if keys == 128 else 128) and tile.shared_bytes <= limit
    assert [n for n in launched if "dkdv" in n] == [tile.name_expression(np.float16)], launched


@pytest.mark.parametrize("schedule", ["forward", "reverse", "random", "warps", "warps_reverse"])
@pytest.mark.parametrize("d,sq,sk,kw", [
    (64, 600, 130, {}),
    (128, 610, 200, dict(causal=True, kv_lengths=[200, 77])),
    (64, 503, 257, dict(causal="top_left", softcap=3.0, q_lengths=[503, 390])),
    # D = 128, a dQ product per group: the second group's dSᵀ (its keys 192.. of 130: none) read by the first
    (128, 300, 130, dict(q_lengths=[300, 190])),
])
def test_wgmma_backward_over_many_query_tiles(monkeypatch, schedule, d, sq, sk, kw):
    """Up to ten query tiles per block: the producer's stage ring goes round up to five times, on
    every schedule, the producer far ahead of the consumers (warps) and starving them
    (warps_reverse); key blocks whose second consumer group has a few keys or none (130, 257
    keys), causal both alignments, lengths, softcap; atomic and deterministic dQ."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    monkeypatch.setattr(_kernel_backend, "EMULATOR_SCHEDULE", schedule)
    launched = spy_launches(monkeypatch)
    rng = np.random.default_rng(sq + sk + d)
    q, k, v = random_qkv(rng, b=2, h=2, hkv=1, sq=sq, sk=sk, d=d, dtype=np.float16)
    check(rng, q, k, v, np.float16, schedule in ("reverse", "warps"), **kw)
    assert any(name.startswith("attention_bwd_dkdv_wgmma<") for name in launched), launched


@pytest.mark.parametrize("schedule", ["forward", "reverse", "random", "warps", "warps_reverse"])
@pytest.mark.parametrize("features", ["alibi_mask", "softcap"])
@pytest.mark.parametrize("d", [64, 128])
def test_wgmma_backward_overlaps_the_softmax_with_its_tensor_work(monkeypatch, schedule, features, d):
    """Each consumer group works out Pᵀ (and dS's factors) while dPᵀ is multiplied, dSᵀ while dV
    is, and dQ's reductions while dK is (kernels/attention_bwd_wgmma.cu): in builds with score
    features at D = 128 a stage's rows 32 at a time, so each tile takes every wait twice. ALiBi
    and a float mask with -inf entries (dS = P ∘ (dP − δ)), or softcap (dS through its
    derivative, a factor of its own); causal with both lengths, 150 queries × 203 keys (three
    query tiles, two key blocks); atomic and deterministic dQ. (Dropout: tests/test_dropout.py.)"""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    monkeypatch.setattr(_kernel_backend, "EMULATOR_SCHEDULE", schedule)
    launched = spy_launches(monkeypatch)
    rng = np.random.default_rng(d + len(schedule) + len(features))
    sq, sk = 150, 203
    q, k, v = random_qkv(rng, b=2, h=2, hkv=1, sq=sq, sk=sk, d=d, dtype=np.float16)
    if features == "softcap":
        kw = dict(softcap=2.5)
    else:
        mask = rng.standard_normal((2, 1, sq, sk)).astype(np.float32)
        mask[rng.random(mask.shape) < 0.2] = -np.inf
        kw = dict(alibi_slopes=rng.uniform(0, 0.1, 2), mask=mask)
    check(rng, q, k, v, np.float16, schedule in ("reverse", "warps"), causal=True, q_lengths=[150, 97],
          kv_lengths=[203, 140], **kw)
    assert any(name.startswith("attention_bwd_dkdv_wgmma<") for name in launched), launched


@pytest.mark.parametrize("d", [64, 128])
def test_wgmma_dq_is_reduced_once_per_key_block(monkeypatch, d):
    """Each element of a query tile's dQ leaves a block of 128 keys in one float32 reduction (the
    groups share the dQ product out by head dims, or by turns at D = 64), not one per consumer
    group: the emulator's global sectors at the reductions (tc_backward.cuh, whole 32-byte sectors
    of a tile whose rows are all inside) are 2 key blocks x 2 query tiles x 64 rows x D floats."""
    from cupy_attn import emulator

    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    rng = np.random.default_rng(d)
    q, k, v = random_qkv(rng, b=1, h=1, sq=128, sk=256, d=d, dtype=np.float16)
    out, lse = cupy_attn.attention(q, k, v, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(np.float16)
    with emulator.counting() as counters:
        grads = cupy_attn.attention_backward(dout, q, k, v, out, lse, backend="emulator")
    assert_close(grads[0], reference.attention_gradients(dout, q, k, v)[0], np.float16, grad=True, what="dq")
    reductions = [s for s in counters.sites if s.kernel.startswith("attention_bwd_dkdv_wgmma<")
                  and s.space == "global" and s.site.startswith("tc_backward.cuh:")]
    assert reductions, counters.sites
    assert sum(s.actual for s in reductions) == 2 * 2 * 64 * d * 4 // 32


MMA_SYNC_DKDV_64 = _config.backward_tile(64, 64, np.float16, 80).name_expression(np.float16)


@pytest.mark.parametrize("case,kernel", [
    ("padded_rows", "attention_bwd_dkdv_wgmma<__half, 64, 64, true>"),  # rows 144 bytes apart: TMA reads them
    ("unaligned_k", MMA_SYNC_DKDV_64),     # k's rows 136 bytes apart
    ("unaligned_dout", MMA_SYNC_DKDV_64),  # dout's rows 136 bytes apart
    ("packed", MMA_SYNC_DKDV_64),          # a box would reach into the next sequence
    ("no_queries", MMA_SYNC_DKDV_64),      # dK = dV = 0: nothing for TMA to read
])
def test_wgmma_backward_runs_where_tma_can_address_its_operands(monkeypatch, caplog, case, kernel):
    """The wgmma dK/dV reads q, k, v and dout through TMA maps; where TMA cannot address them the
    call runs the mma.sync dK/dV, which reads any strides, and says so in the log (a call without
    query rows runs it silently: there is nothing to read)."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    monkeypatch.setattr(_kernel_backend, "_SAID", set())
    caplog.set_level(logging.WARNING, logger="cupy_attn")
    rng = np.random.default_rng(15)
    if case == "packed":
        lengths = [70, 13]
        q, k, v, dout = (rng.standard_normal((sum(lengths), 2, 64)).astype(np.float16) for _ in range(4))
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        out, lse = cupy_attn.attention_varlen(q, k, v, cu, cu, 70, 70, causal=True, return_lse=True, backend="emulator")
        launched = spy_launches(monkeypatch)
        grads = cupy_attn.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, 70, 70, causal=True,
                                                    backend="emulator")
        for s0, s1 in zip(cu[:-1], cu[1:]):
            want = reference.attention_gradients(*(x[s0:s1].transpose(1, 0, 2)[None] for x in (dout, q, k, v)),
                                                 causal=True)
            for g, w in zip(grads, want):
                assert_close(g[s0:s1], w[0].transpose(1, 0, 2), np.float16, grad=True)
    else:
        q, k, v = random_qkv(rng, b=2, h=2, sq=0 if case == "no_queries" else 70, sk=150, d=64, dtype=np.float16)
        launched = spy_launches(monkeypatch)
        if case == "no_queries":
            grads = check(rng, q, k, v, np.float16, False, causal=True)
            assert not grads[1].any() and not grads[2].any()
        elif case == "unaligned_dout":
            out, lse = cupy_attn.attention(q, k, v, return_lse=True, causal=True)
            dout = rng.standard_normal(out.shape).astype(np.float16)
            wide = np.zeros(dout.shape[:-1] + (68,), np.float16)
            wide[..., :64] = dout
            grads = cupy_attn.attention_backward(wide[..., :64], q, k, v, out, lse, causal=True, backend="emulator")
            for g, w in zip(grads, reference.attention_gradients(dout, q, k, v, causal=True)):
                assert_close(g, w, np.float16, grad=True)
        else:
            wide = np.zeros(k.shape[:-1] + (72 if case == "padded_rows" else 68,), np.float16)
            wide[..., :64] = k
            check(rng, q, wide[..., :64], v, np.float16, False, causal=True)
    assert [name for name in launched if "dkdv" in name] == [kernel]
    warned = "the mma.sync backward runs instead" in caplog.text
    assert warned == (case in ("unaligned_k", "unaligned_dout", "packed")), caplog.text


@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 203), (7, 64), (203, 113), (257, 31), (0, 5), (5, 0)])
def test_sequence_lengths(sq, sk):
    rng = np.random.default_rng(sq + 1000 * sk)
    q, k, v = random_qkv(rng, b=2, h=3, sq=sq, sk=sk, d=32)
    for deterministic in (False, True):
        check(rng, q, k, v, np.float32, deterministic, causal=True, softcap=3.0)


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("d,dv", [(72, 56), (200, 256)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_half_precision_everything(tensor_core_kernel, dtype, d, dv, deterministic):
    rng = np.random.default_rng(21)
    q, k, v = random_qkv(rng, b=3, h=4, hkv=2, sq=113, sk=203, d=d, dv=dv, dtype=dtype)
    check(rng, q, k, v, dtype, deterministic, **feature_keywords("everything", rng))


def test_masks_with_strided_or_broadcast_keys(monkeypatch, tensor_core_kernel):
    """Each backward kernel family reads the key-contiguous copy of such masks (the forward's test:
    test_kernel_forward.py) as the forward does."""
    rng = np.random.default_rng(24)
    q, k, v = (tma_addressable(x) for x in random_qkv(rng, b=2, h=3, sq=33, sk=77, d=16, dtype=np.float16))
    launched = spy_launches(monkeypatch)
    for mask, _ in strided_key_masks(rng, 2, 3, 33, 77):
        check(rng, q, k, v, np.float16, False, addressable=True, mask=mask)
    dkdv = {name.split("<")[0] for name in launched if "dkdv" in name}
    assert dkdv == {"attention_bwd_dkdv_wgmma" if tensor_core_kernel == 90 else "attention_bwd_dkdv_tc"}, dkdv


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("hkv", [3, 1], ids=["mha", "gqa"])
@pytest.mark.parametrize("d,dv", [(64, 64), (80, 48), (7, 33), (200, 256)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gradients_are_written_in_the_input_type_where_nothing_is_summed_after(monkeypatch, tensor_core_kernel, layout,
                                                                               hkv, d, dv, deterministic):
    """Without GQA each query head's dK, dV is its kv head's: both kernel families write them in
    the input type and in the caller's layout (through strides, or the TMA store's maps), and the
    call gets back the very arrays they wrote (no conversion pass and no transposing copy; except
    rows of the wgmma kernel that are not a multiple of 16 bytes, which it pads). With GQA they
    write float32: a group's heads add theirs to one per kv head, or in deterministic mode each
    writes its own, summed over each group after; then converted. dQ: float32 summed by atomics,
    or in the input type and the caller's layout from the deterministic dQ kernel."""
    buffers = []  # (dq, dk or dv as the kernels wrote it, as returned)
    real = _kernel_backend._from_per_head
    monkeypatch.setattr(_kernel_backend, "_from_per_head", lambda p, x, dtype, **kw: buffers.append(
        (x, real(p, x, dtype, **kw))) or buffers[-1][1])
    rng = np.random.default_rng(d + dv + hkv)
    q, k, v = random_qkv(rng, b=2, h=3, hkv=hkv, sq=77, sk=150, d=d, dv=dv, dtype=np.float16, layout=layout)
    if tensor_core_kernel == 90:
        q, k, v = (tma_addressable(x) for x in (q, k, v))
    check(rng, q, k, v, np.float16, deterministic, addressable=tensor_core_kernel == 90, layout=layout, causal=True)
    dq_buffers, dk_buffers, dv_buffers = buffers
    assert dq_buffers[0].dtype == (np.float16 if deterministic else np.float32)
    assert np.shares_memory(*dq_buffers) == deterministic
    wgmma = tensor_core_kernel == 90 and max(d, dv) <= 128  # D = 256: the mma.sync dK/dV
    for (written, returned), dims in ((dk_buffers, d), (dv_buffers, dv)):
        assert written.dtype == (np.float16 if hkv == 3 else np.float32)
        assert written.shape[1] == (3 if deterministic else hkv)
        unpadded = not wgmma or dims % 8 == 0
        assert np.shares_memory(written, returned) == (hkv == 3 and unpadded)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_the_float32_kernel_adds_a_groups_dk_dv_per_kv_head(monkeypatch, layout, deterministic):
    """The CUDA-core dK/dV (float32): a GQA group's query heads add theirs to a float32 buffer per
    kv head (atomics into zeros; padding rows of the shorter entry included), or in deterministic
    mode each writes its own, summed over each group after."""
    buffers = []  # (dq, dk or dv as the kernel wrote it, as returned)
    real = _kernel_backend._from_per_head
    monkeypatch.setattr(_kernel_backend, "_from_per_head", lambda p, x, dtype, **kw: buffers.append(
        (x, real(p, x, dtype, **kw))) or buffers[-1][1])
    monkeypatch.setattr(_kernel_backend, "EMULATOR_SCHEDULE", "random")
    rng = np.random.default_rng(31)
    q, k, v = random_qkv(rng, b=2, h=6, hkv=2, sq=77, sk=150, d=40, dv=24, dtype=np.float32, layout=layout)
    check(rng, q, k, v, np.float32, deterministic, layout=layout, causal=True, kv_lengths=[150, 97])
    _, (dk_written, _), (dv_written, _) = buffers
    assert dk_written.shape[:2] == dv_written.shape[:2] == (2, 6 if deterministic else 2)


@pytest.mark.parametrize("schedule", ["forward", "reverse", "warps"])
def test_deterministic_dq_of_query_tiles_that_see_no_key(monkeypatch, tensor_core_kernel, schedule):
    """Causal, 200 queries over 40 keys (bottom-right): the first two query tiles of 64 rows see no
    key, so the deterministic dQ kernel's blocks for them run no key tile; their dQ rows (in the
    input type) are written as 0 all the same (the outputs are poisoned)."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_SCHEDULE", schedule)
    rng = np.random.default_rng(23)
    q, k, v = random_qkv(rng, b=1, h=2, sq=200, sk=40, d=64, dtype=np.float16)
    grads = check(rng, q, k, v, np.float16, True, causal=True)
    assert (grads[0][:, :, :160] == 0).all()


def test_fully_masked_rows_give_zero_gradients():
    rng = np.random.default_rng(22)
    q, k, v = random_qkv(rng, b=2, sq=90, sk=40, d=16)
    grads = check(rng, q, k, v, np.float32, False, causal=True, q_lengths=[80, 90])
    assert (grads[0][0, :, :40] == 0).all() and (grads[0][0, :, 80:] == 0).all()


def test_deterministic_mode_is_bit_identical_across_runs_and_schedules(monkeypatch):
    rng = np.random.default_rng(23)
    q, k, v = random_qkv(rng, b=2, h=4, hkv=1, sq=150, sk=203, d=48, dtype=BF16)
    dout = rng.standard_normal((2, 4, 150, 48)).astype(BF16)
    kw = dict(causal=True, softcap=5.0, kv_lengths=[203, 170])
    runs = []
    for schedule, workers in (("forward", "1"), ("random", "2"), ("reverse", "4"), ("random", "3")):
        monkeypatch.setattr(_kernel_backend, "EMULATOR_SCHEDULE", schedule)
        monkeypatch.setenv("CUPY_ATTN_EMULATOR_THREADS", workers)
        runs.append(gradients(q, k, v, dout, True, **kw))
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def test_atomic_mode_is_within_tolerance_of_deterministic():
    rng = np.random.default_rng(24)
    q, k, v = random_qkv(rng, b=2, h=2, sq=150, sk=300, d=32)
    dout = rng.standard_normal((2, 2, 150, 32)).astype(np.float32)
    for a, d in zip(gradients(q, k, v, dout, False), gradients(q, k, v, dout, True)):
        assert_close(a, d, np.float32, grad=True)


def test_deterministic_must_be_bool():
    q, k, v = random_qkv(np.random.default_rng(0))
    out, lse = cupy_attn.attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="deterministic must be a bool, got str"):
        cupy_attn.attention_backward(out, q, k, v, out, lse, deterministic="yes")


def _chunk_load_lines() -> set:
    """The lines of attention_bwd.cu where the preprocess counts its 16-byte loads."""
    lines = (_paths.kernel_dir() / "attention_bwd.cu").read_text().splitlines()
    return {f"attention_bwd.cu:{n}" for n, line in enumerate(lines, 1) if "_row + d, 16)" in line}


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("dv", [1, 7, 8, 24, 33, 64, 136])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("aligned", [True, False], ids=["rows_16_byte_aligned", "rows_misaligned"])
def test_row_deltas_are_each_rows_dout_dot_out(dtype, dv, layout, aligned):
    """The backward's preprocess (delta = rowsum(dO ∘ O), 8 lanes a row in 16-byte chunks where
    both rows start 16-byte aligned, else element by element) against float64, on every row of
    a poisoned delta: head dims with and without a tail past the last whole chunk, rows whose
    start is one element past 16 bytes, 37 rows (not a multiple of a block's 16). Aligned rows
    of at least a chunk are read in chunks, the others not."""
    rng = np.random.default_rng(dv * 4 + aligned * 2 + (layout == "bshd"))
    b, h, sq = 2, 3, 37
    chunk = 16 // dtype.itemsize
    shape = (b, h, sq, dv) if layout == "bhsd" else (b, sq, h, dv)

    def rows():
        # rows of whole chunks in 16-byte aligned storage; the view starts at an element 0 or 1
        width = (dv // chunk + 2) * chunk
        storage = np.empty(np.prod(shape[:-1]) * width * dtype.itemsize + 16, np.uint8)
        skip = -storage.ctypes.data % 16
        wide = storage[skip:skip + np.prod(shape[:-1]) * width * dtype.itemsize].view(dtype).reshape(shape[:-1] + (width,))
        wide[...] = rng.standard_normal(wide.shape)
        return wide[..., :dv] if aligned else wide[..., 1:dv + 1]

    dout, out = rows(), rows()
    q, k, v = random_qkv(rng, b=b, h=h, sq=sq, sk=5, d=16, dv=dv, dtype=dtype, layout=layout)
    problem = cupy_attn._problem.make_problem(q, k, v, layout=layout, backend="emulator")
    products = dout.astype(np.float64) * out.astype(np.float64)
    if layout == "bshd":
        products = products.transpose(0, 2, 1, 3)
    want, scale = products.sum(-1), np.abs(products).sum(-1)
    for schedule in ("forward", "warps_reverse"):
        _kernel_backend.EMULATOR_SCHEDULE = schedule
        try:
            with emulator.counting() as counters:
                delta = _kernel_backend.row_deltas(problem, dout, out, target="emulator")
        finally:
            _kernel_backend.EMULATOR_SCHEDULE = "forward"
        assert delta.shape == (b, h, sq) and delta.dtype == np.float32
        assert np.all(np.abs(delta - want) <= 1e-6 * scale + 1e-30), (schedule, np.abs(delta - want).max())
        in_chunks = {s.site for s in counters.sites} & _chunk_load_lines()
        assert len(in_chunks) == (2 if aligned and dv >= chunk else 0), in_chunks
