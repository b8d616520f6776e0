"""The CUDA backward kernels, run on the CPU by the emulator, against the float64 reference.

Every output buffer is poisoned with NaN before the kernels run."""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import _kernel_backend, reference
from helpers import BF16, assert_close, random_qkv
from test_forward import FEATURES, feature_keywords


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


def check(rng, q, k, v, dtype, deterministic, **kw):
    dout = rng.standard_normal(cupy_attn.attention(q, k, v, **kw).shape).astype(dtype)
    grads = gradients(q, k, v, dout, deterministic, **kw)
    want = reference.attention_gradients(dout, q, k, v, **kw)
    for name, g, w, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert g.dtype == dtype and g.shape == x.shape, name
        assert_close(g, w, dtype, grad=True, what=name)
    return grads


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
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    rng = np.random.default_rng(d * 100 + dv + 1)
    q, k, v = random_qkv(rng, b=2, h=2, hkv=1, sq=77, sk=150, d=d, dv=dv, dtype=dtype)
    check(rng, q, k, v, dtype, deterministic, causal=True)


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
