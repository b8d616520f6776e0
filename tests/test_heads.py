"""split_heads / merge_heads and multi_head_attention against a plain NumPy composition."""
import numpy as np
import pytest

import cupy_attn
from helpers import assert_close


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_split_merge_round_trip(rng, layout):
    x = rng.standard_normal((2, 7, 24))
    heads = cupy_attn.split_heads(x, 3, layout)
    assert heads.shape == ((2, 3, 7, 8) if layout == "bhsd" else (2, 7, 3, 8))
    assert np.shares_memory(heads, x)  # a view
    h = 1 if layout == "bhsd" else 2
    np.testing.assert_array_equal(np.take(heads, 1, axis=h), x[..., 8:16])
    np.testing.assert_array_equal(cupy_attn.merge_heads(heads, layout), x)


def plain_mha(x, context, w_q, w_k, w_v, w_o, h, hkv, causal):
    """Written without cupy_attn: explicit loops over heads, full softmax."""
    b, s, _ = x.shape
    sk = context.shape[1]
    d, dv = w_q.shape[1] // h, w_v.shape[1] // hkv
    q, k, v = x @ w_q, context @ w_k, context @ w_v
    out = np.empty((b, s, h * dv))
    for head in range(h):
        g = head // (h // hkv)
        sc = q[..., head * d:(head + 1) * d] @ k[..., g * d:(g + 1) * d].transpose(0, 2, 1) / np.sqrt(d)
        if causal:
            sc = np.where(np.arange(sk)[None, :] <= np.arange(s)[:, None] + sk - s, sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        out[..., head * dv:(head + 1) * dv] = (p / p.sum(-1, keepdims=True)) @ v[..., g * dv:(g + 1) * dv]
    return out @ w_o


@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_multi_head_attention(rng, h, hkv, cross, layout):
    x = rng.standard_normal((2, 13, 32))
    context = rng.standard_normal((2, 29, 20)) if cross else x
    e_ctx = context.shape[2]
    w_q = rng.standard_normal((32, h * 8)) / 6
    w_k = rng.standard_normal((e_ctx, hkv * 8)) / 6
    w_v = rng.standard_normal((e_ctx, hkv * 5)) / 6
    w_o = rng.standard_normal((h * 5, 17))
    y = cupy_attn.multi_head_attention(x, w_q, w_k, w_v, w_o, h, num_kv_heads=hkv, causal=True,
                                       context=context if cross else None, layout=layout)
    assert y.shape == (2, 13, 17) and isinstance(y, np.ndarray)
    assert_close(y, plain_mha(x, context, w_q, w_k, w_v, w_o, h, hkv, True), np.float64)


def test_multi_head_attention_float32_and_lse(rng):
    x = rng.standard_normal((1, 9, 16)).astype(np.float32)
    w = (rng.standard_normal((16, 16)) / 4).astype(np.float32)
    y, lse = cupy_attn.multi_head_attention(x, w, w, w, w, 2, return_lse=True)
    assert y.dtype == np.float32 and lse.shape == (1, 2, 9)
    assert_close(y, plain_mha(*(a.astype(np.float64) for a in (x, x, w, w, w, w)), 2, 2, False), np.float32)
