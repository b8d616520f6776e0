"""Attention sinks (gpt-oss): one logit per query head joining each row's denominator, with its
gradient, on the NumPy backend and the kernels (emulator, every family), against the float64
reference, whose sink is written independently (an extra score column with no value)."""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import _kernel_backend, reference
from helpers import BF16, DTYPES, check_forward_and_backward, random_qkv
from test_kernel_forward import poisoned_outputs, schedule  # noqa: F401 (fixtures)

FEATURES = {
    "plain": {},
    "causal_lengths": dict(causal=True, q_lengths=[37, 20], kv_lengths=[50, 3]),  # rows with no key
    "window_softcap_alibi": dict(window=(6, 1), softcap=4.0, alibi_slopes=[0.2, 0.1, 0.3, 0.05]),
    "mask": "mask",
}


def keywords(rng, feature, h=4):
    kw = FEATURES[feature]
    if kw == "mask":
        kw = dict(mask=rng.random((2, 1, 37, 50)) < 0.7)
    return dict(kw, sinks=(rng.standard_normal(h) * 2).astype(np.float32))


def check(backend, rng, dtype, feature, *, deterministic=False, **shape):
    shape = dict(dict(b=2, h=4, hkv=2, sq=37, sk=50, d=32), **shape)
    q, k, v = random_qkv(rng, dtype=dtype, **shape)
    kw = keywords(rng, feature, shape["h"])
    grads = check_forward_and_backward(backend, rng, q, k, v, kw, dtype, deterministic=deterministic)
    assert len(grads) == 4 and grads[3].shape == (shape["h"],)
    assert grads[3].dtype == (np.float64 if dtype == np.float64 else np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feature", FEATURES)
def test_numpy_backend(rng, dtype, feature):
    check("numpy", rng, dtype, feature)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("feature", FEATURES)
def test_kernels(rng, schedule, dtype, feature):
    check("emulator", rng, dtype, feature, deterministic=feature == "plain")


@pytest.mark.parametrize("d", [64, 128])
def test_wgmma_kernels(rng, monkeypatch, d):
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    check("emulator", rng, np.dtype(np.float16), "causal_lengths", d=d)


@pytest.mark.parametrize("backend", ["numpy", "emulator"])
def test_rows_with_nothing_to_attend_give_zero_and_the_sink(rng, backend):
    """Padding rows and rows before the first key (causal, Sq > Sk): out 0, lse = the sink."""
    q, k, v = random_qkv(rng, b=1, h=2, hkv=1, sq=9, sk=4, d=16, dtype=np.float16)
    sinks = np.array([1.5, -0.5], np.float32)
    out, lse = cupy_attn.attention(q, k, v, causal=True, q_lengths=[8], sinks=sinks, return_lse=True, backend=backend)
    dead = np.r_[0:4, 8]  # bottom-right: queries 0-3 of the 8 valid ones see no key; row 8 is padding
    assert (out[:, :, dead] == 0).all()
    np.testing.assert_array_equal(lse[0][:, dead], np.repeat(sinks[:, None], dead.size, axis=1))
    assert np.isfinite(lse).all()


def test_sinks_change_the_result_and_a_very_negative_sink_changes_nothing(rng):
    q, k, v = random_qkv(rng, b=1, h=2, sq=8, sk=8, d=16)
    plain, plain_lse = cupy_attn.attention(q, k, v, return_lse=True)
    low = cupy_attn.attention(q, k, v, sinks=np.full(2, -1e4, np.float32), return_lse=True)
    high = cupy_attn.attention(q, k, v, sinks=np.full(2, 3.0, np.float32))
    np.testing.assert_allclose(low[0], plain, rtol=1e-6)
    np.testing.assert_allclose(low[1], plain_lse, rtol=1e-6)
    assert np.abs(high).sum() < np.abs(plain).sum()  # the sink takes a share of every row


def test_sink_gradient_by_finite_differences(rng):
    q, k, v = random_qkv(rng, b=1, h=2, hkv=1, sq=5, sk=6, d=8, dtype=np.float64)
    sinks = np.array([0.3, -1.0])
    dout = rng.standard_normal((1, 2, 5, 8))

    def loss(s):
        return float((cupy_attn.attention(q, k, v, sinks=s, causal=True) * dout).sum())

    out, lse = cupy_attn.attention(q, k, v, sinks=sinks, causal=True, return_lse=True)
    dsinks = cupy_attn.attention_backward(dout, q, k, v, out, lse, sinks=sinks, causal=True)[3]
    eps = 1e-6
    numeric = [(loss(sinks + eps * e) - loss(sinks - eps * e)) / (2 * eps) for e in np.eye(2)]
    np.testing.assert_allclose(dsinks, numeric, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("sinks,error,message", [
    (np.zeros(3, np.float32), ValueError, r"sinks must have shape \(4,\), got \(3,\)"),
    (np.zeros((2, 4), np.float32), ValueError, r"sinks must have shape \(4,\)"),
    (np.zeros(4, np.int32), TypeError, "sinks must hold floats"),
    (np.array([0, 0, np.nan, 0], np.float32), ValueError, "sinks must be finite"),
    ("1.0", TypeError, "sinks must be a float array of shape"),
])
def test_errors(rng, sinks, error, message):
    q, k, v = random_qkv(rng, b=2, h=4, hkv=2, sq=5, sk=6, d=8)
    with pytest.raises(error, match=message):
        cupy_attn.attention(q, k, v, sinks=sinks)


def test_sinks_and_slopes_may_be_bfloat16(rng):
    """A bf16 model's sink logits and slopes come as bfloat16 (ml_dtypes' type, of kind "V", not
    "f"): taken as the float32 values they hold."""
    q, k, v = random_qkv(rng, b=1, h=2, sq=5, sk=6, d=8, dtype=BF16)
    sinks, slopes = np.array([0.5, -1.25], BF16), np.array([0.25, 0.125], BF16)
    got = cupy_attn.attention(q, k, v, sinks=sinks, alibi_slopes=slopes)
    want = cupy_attn.attention(q, k, v, sinks=sinks.astype(np.float32), alibi_slopes=slopes.astype(np.float32))
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


@pytest.mark.parametrize("backend", ["numpy", "emulator"])
def test_a_sink_at_its_bound_has_a_finite_gradient(rng, backend):
    """A sink of 1.7e38 (the bound for float32 scores) dominates its rows: their lse is the sink
    (the kernels' base-2 lse an ulp below it, 1e31 less) and its gradient is -Σ delta, never
    exp(1e31) · delta = NaN."""
    q, k, v = random_qkv(rng, b=1, h=2, sq=4, sk=6, d=16)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    sinks = np.array([1.7e38, 0.5], np.float32)
    out, lse = cupy_attn.attention(q, k, v, sinks=sinks, return_lse=True, backend=backend)
    dsinks = cupy_attn.attention_backward(dout, q, k, v, out, lse, sinks=sinks, backend=backend)[3]
    want = reference.attention_gradients(dout, q, k, v, sinks=sinks)[3]
    assert np.isfinite(dsinks).all() and dsinks[0] == 0  # its rows' out is 0, so delta = 0
    np.testing.assert_allclose(dsinks, want, rtol=1e-4, atol=1e-5)
