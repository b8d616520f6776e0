"""The CUDA backend on a real GPU (marked gpu: run when CuPy reaches a GPU, skipped otherwise)."""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import _kernel_backend, reference
from helpers import BF16, assert_close, random_qkv
from test_forward import FEATURES, feature_keywords

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(_kernel_backend, "POISON_OUTPUTS", True)


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
def test_head_dims(dtype, d, causal):
    rng = np.random.default_rng(d)
    q, k, v = random_qkv(rng, b=2, h=4, hkv=2, sq=513, sk=1031, d=d, dtype=dtype)
    check(q, k, v, dtype, causal=causal)


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_features(feature, layout):
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, b=3, h=4, hkv=2, sq=113, sk=203, d=64, dtype=np.float16, layout=layout)
    check(q, k, v, np.float16, layout=layout, **feature_keywords(feature, rng))


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_backward(dtype, deterministic):
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, b=2, h=8, hkv=2, sq=700, sk=1031, d=64, dtype=dtype)
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
