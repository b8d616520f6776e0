"""The NumPy backend's forward pass against the naive float64 reference."""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import reference
from helpers import BF16, DTYPES, assert_close, random_qkv

SEQ_PAIRS = [(1, 1), (1, 257), (7, 7), (7, 64), (64, 7), (113, 203), (203, 113), (255, 257), (257, 255)]


def check_forward(q, k, v, dtype, **kw):
    out, lse = cupy_attn.attention(q, k, v, return_lse=True, **kw)
    want_out, want_lse = reference.attention(q, k, v, **kw)
    assert out.dtype == dtype and out.shape == want_out.shape
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert out.flags.c_contiguous
    assert_close(out, want_out, dtype, what="out")
    assert_close(lse, want_lse, dtype, what="lse")
    return out, lse


@pytest.mark.parametrize("sq,sk", SEQ_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_awkward_sequence_lengths(rng, sq, sk, causal):
    q, k, v = random_qkv(rng, b=2, h=3, sq=sq, sk=sk, d=40, dv=24)
    check_forward(q, k, v, np.float32, causal=causal)


@pytest.mark.parametrize("d", [16, 40, 64, 80, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_dims_and_dtypes(rng, d, dtype):
    q, k, v = random_qkv(rng, b=2, h=2, sq=113, sk=203, d=d, dtype=dtype)
    check_forward(q, k, v, dtype)


@pytest.mark.parametrize("dv", [1, 8, 72])
def test_value_dim_differs(rng, dv):
    q, k, v = random_qkv(rng, sq=64, sk=113, d=40, dv=dv)
    out = check_forward(q, k, v, np.float32)[0]
    assert out.shape == (2, 2, 64, dv)


@pytest.mark.parametrize("h,hkv", [(4, 2), (6, 1), (8, 4)])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gqa_and_mqa(rng, h, hkv, layout):
    q, k, v = random_qkv(rng, b=3, h=h, hkv=hkv, sq=7, sk=113, d=16, layout=layout)
    check_forward(q, k, v, np.float32, layout=layout, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layouts_agree(rng, dtype):
    q, k, v = random_qkv(rng, b=2, h=4, hkv=2, sq=113, sk=203, d=40, dv=24, dtype=dtype)
    kw = dict(causal=True, window=(64, 3), softcap=7.5)
    bhsd = cupy_attn.attention(q, k, v, **kw)
    t = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    bshd = cupy_attn.attention(t(q), t(k), t(v), layout="bshd", **kw)
    assert bshd.shape == (2, 113, 4, 24)
    np.testing.assert_array_equal(t(bshd), bhsd)
    check_forward(t(q), t(k), t(v), dtype, layout="bshd", **kw)


def test_non_contiguous_inputs(rng):
    q, k, v = random_qkv(rng, b=2, h=2, sq=64, sk=113, d=32)
    # bshd views of bhsd storage, and every other key.
    kw = dict(layout="bshd", causal=True)
    check_forward(q.transpose(0, 2, 1, 3), k[:, :, ::2].transpose(0, 2, 1, 3), v[:, :, ::2].transpose(0, 2, 1, 3), np.float32, **kw)


FEATURES = {
    "causal": dict(causal=True),
    "top_left": dict(causal="top_left"),
    "window_both": dict(window=(20, 5)),
    "window_left": dict(window=(10, None)),
    "window_right": dict(window=(None, 0)),
    "window_zero": dict(window=(0, 0)),
    "causal_window": dict(causal=True, window=(30, None)),
    "top_left_window": dict(causal="top_left", window=(15, 4)),
    "scale": dict(scale=0.37),
    "softcap": dict(softcap=2.5),
    "alibi_h": dict(alibi_slopes=np.array([0.5, 0.125, 0.0625, 0.25])),
    "alibi_bh": "alibi_bh",
    "kv_lengths": dict(kv_lengths=np.array([203, 50, 1])),
    "q_lengths": dict(q_lengths=np.array([113, 7, 0])),
    "both_lengths": dict(q_lengths=[100, 60, 113], kv_lengths=[203, 30, 113]),
    "lengths_causal": dict(q_lengths=[100, 60, 113], kv_lengths=[150, 30, 1], causal=True),
    "bool_mask": "bool_mask",
    "float_mask": "float_mask",
    "padding_mask_broadcast": "padding_mask_broadcast",
    "everything": "everything",
}


def feature_keywords(name, rng, b=3, h=4, sq=113, sk=203):
    kw = FEATURES[name]
    if isinstance(kw, dict):
        return kw
    if name == "alibi_bh":
        return dict(alibi_slopes=rng.uniform(0, 0.3, (b, h)))
    if name == "bool_mask":
        return dict(mask=rng.random((b, h, sq, sk)) < 0.7)
    if name == "float_mask":
        m = rng.standard_normal((b, 1, sq, sk))
        m[rng.random(m.shape) < 0.2] = -np.inf
        return dict(mask=m.astype(np.float32))
    if name == "padding_mask_broadcast":
        return dict(mask=cupy_attn.masks.padding_mask(np.array([5, 203, 77]), sk))
    return dict(causal=True, window=(90, None), softcap=4.0, alibi_slopes=rng.uniform(0, 0.1, h),
                q_lengths=[113, 90, 50], kv_lengths=[203, 120, 40], scale=0.2,
                mask=rng.standard_normal((sq, sk)).astype(np.float32) - 5 * (rng.random((1, h, 1, sk)) < 0.1))


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=str)
def test_features(rng, feature, layout, dtype):
    q, k, v = random_qkv(rng, b=3, h=4, hkv=2, sq=113, sk=203, d=40, dv=24, dtype=dtype, layout=layout)
    check_forward(q, k, v, dtype, layout=layout, **feature_keywords(feature, rng))


def test_default_tile_size_matches_small_tiles(rng, default_tiles):
    q, k, v = random_qkv(rng, b=2, h=4, hkv=2, sq=300, sk=600, d=64)
    check_forward(q, k, v, np.float32, causal=True, window=(200, 0), kv_lengths=[600, 257])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_float_mask_dtypes(rng, dtype):
    q, k, v = random_qkv(rng, sq=7, sk=64)
    check_forward(q, k, v, np.float32, mask=rng.standard_normal((7, 64)).astype(dtype))


def test_empty_sequences(rng):
    q, k, v = random_qkv(rng, sq=5, sk=0)
    out, lse = cupy_attn.attention(q, k, v, return_lse=True)
    assert (out == 0).all() and (lse == -np.inf).all()
    q, k, v = random_qkv(rng, sq=0, sk=5)
    assert cupy_attn.attention(q, k, v).shape == (2, 2, 0, 16)
