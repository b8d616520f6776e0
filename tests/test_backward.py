"""Gradients of the NumPy backend: against the analytic float64 reference, and against finite
differences (which also validate the reference)."""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import reference
from helpers import BF16, DTYPES, assert_close, random_qkv
from test_forward import FEATURES, feature_keywords


def check_backward(rng, q, k, v, dtype, **kw):
    out, lse = cupy_attn.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = cupy_attn.attention_backward(dout, q, k, v, out, lse, **kw)
    want = reference.attention_gradients(dout, q, k, v, **kw)
    for name, g, w, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert g.dtype == dtype and g.shape == x.shape, name
        assert_close(g, w, dtype, grad=True, what=name)
    return grads


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_features(rng, feature, layout):
    q, k, v = random_qkv(rng, b=3, h=4, hkv=2, sq=113, sk=203, d=40, dv=24, layout=layout)
    check_backward(rng, q, k, v, np.float32, layout=layout, **feature_keywords(feature, rng))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,dv", [(16, 16), (64, 40), (128, 128), (256, 80)])
def test_dtypes_and_head_dims(rng, dtype, d, dv):
    q, k, v = random_qkv(rng, b=2, h=2, hkv=1, sq=64, sk=113, d=d, dv=dv, dtype=dtype)
    check_backward(rng, q, k, v, dtype, causal=True)


@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 257), (7, 64), (203, 113), (257, 255)])
def test_awkward_sequence_lengths(rng, sq, sk):
    q, k, v = random_qkv(rng, b=2, h=3, sq=sq, sk=sk, d=16)
    check_backward(rng, q, k, v, np.float32, causal=True, softcap=3.0)


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=str)
def test_half_precision_everything(rng, dtype):
    q, k, v = random_qkv(rng, b=3, h=4, hkv=2, sq=113, sk=203, d=40, dv=24, dtype=dtype)
    check_backward(rng, q, k, v, dtype, **feature_keywords("everything", rng))


FD_CASES = {
    "plain": {},
    "causal_gqa_softcap_alibi": dict(causal=True, softcap=2.0, alibi_slopes=[0.3, 0.7]),
    "window_lengths_mask": "mask",
}


@pytest.mark.parametrize("case", FD_CASES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_finite_differences(rng, case, layout):
    """Central differences of L = sum(out · dout) in float64, on every input entry."""
    q, k, v = random_qkv(rng, b=2, h=2, hkv=1, sq=5, sk=7, d=3, dv=2, dtype=np.float64, layout=layout)
    kw = FD_CASES[case]
    if kw == "mask":
        kw = dict(window=(3, 1), q_lengths=[5, 4], kv_lengths=[6, 7],
                  mask=rng.standard_normal((2, 1, 5, 7)) - 10 * (rng.random((2, 1, 5, 7)) < 0.2))
    kw = dict(kw, layout=layout)
    out, lse = cupy_attn.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape)
    grads = cupy_attn.attention_backward(dout, q, k, v, out, lse, **kw)
    analytic = reference.attention_gradients(dout, q, k, v, **kw)
    eps = 1e-6
    for x, g, a in zip((q, k, v), grads, analytic):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            orig = x[idx]
            x[idx] = orig + eps
            plus = (cupy_attn.attention(q, k, v, **kw) * dout).sum()
            x[idx] = orig - eps
            minus = (cupy_attn.attention(q, k, v, **kw) * dout).sum()
            x[idx] = orig
            numeric[idx] = (plus - minus) / (2 * eps)
        np.testing.assert_allclose(g, numeric, atol=1e-7, rtol=1e-6)
        np.testing.assert_allclose(a, numeric, atol=1e-7, rtol=1e-6)
    assert any(np.abs(g).max() > 1e-3 for g in grads)  # the check compared real gradients
