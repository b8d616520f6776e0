"""Structured masks against their explicit equivalents, and rows that can attend to nothing."""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import _kernel_backend, masks, reference
from helpers import DTYPES, assert_close, random_qkv


def both(q, k, v, structured, explicit, **common):
    got = cupy_attn.attention(q, k, v, return_lse=True, **structured, **common)
    want = cupy_attn.attention(q, k, v, return_lse=True, **explicit, **common)
    assert_close(got[0], want[0], np.float32, what="out")
    assert_close(got[1], want[1], np.float32, what="lse")


@pytest.mark.parametrize("sq,sk", [(7, 7), (113, 203), (203, 113), (1, 64)])
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_causal_equals_causal_mask(rng, sq, sk, align):
    q, k, v = random_qkv(rng, sq=sq, sk=sk)
    causal = True if align == "bottom_right" else "top_left"
    both(q, k, v, dict(causal=causal), dict(mask=masks.causal_mask(sq, sk, align)))


@pytest.mark.parametrize("left,right", [(0, 0), (5, None), (None, 3), (17, 2)])
@pytest.mark.parametrize("sq,sk", [(113, 203), (203, 113)])
def test_window_equals_window_mask(rng, left, right, sq, sk):
    q, k, v = random_qkv(rng, sq=sq, sk=sk)
    both(q, k, v, dict(window=(left, right)), dict(mask=masks.window_mask(sq, sk, left, right)))


def test_top_left_window_equals_window_mask(rng):
    q, k, v = random_qkv(rng, sq=113, sk=203)
    both(q, k, v, dict(window=(9, 4), causal="top_left"),
         dict(mask=masks.combine(masks.window_mask(113, 203, 9, 4, "top_left"), masks.causal_mask(113, 203, "top_left"))))


def test_kv_lengths_equal_padding_mask(rng):
    q, k, v = random_qkv(rng, b=4, sq=64, sk=113)
    lengths = np.array([113, 1, 64, 50])
    both(q, k, v, dict(kv_lengths=lengths), dict(mask=masks.padding_mask(lengths, 113)))


def test_lengths_align_causal_on_valid_lengths(rng):
    """Bottom-right causal with lengths equals slicing each entry to its valid part."""
    q, k, v = random_qkv(rng, b=2, sq=64, sk=113)
    q_len, kv_len = [40, 64], [100, 30]
    out = cupy_attn.attention(q, k, v, causal=True, q_lengths=q_len, kv_lengths=kv_len)
    for b in range(2):
        part = cupy_attn.attention(q[b:b + 1, :, :q_len[b]], k[b:b + 1, :, :kv_len[b]],
                                   v[b:b + 1, :, :kv_len[b]], causal=True)
        assert_close(out[b:b + 1, :, :q_len[b]], part, np.float32)
        assert (out[b, :, q_len[b]:] == 0).all()


def test_alibi_equals_float_mask(rng):
    q, k, v = random_qkv(rng, b=2, h=3, sq=64, sk=113)
    slopes = np.array([0.3, 0.1, 0.05])
    i, j = np.arange(64)[:, None], np.arange(113)[None, :]
    bias = -slopes[:, None, None] * np.abs(i + (113 - 64) - j)
    both(q, k, v, dict(alibi_slopes=slopes), dict(mask=bias.astype(np.float32)))


def test_bool_mask_equals_additive_mask(rng):
    q, k, v = random_qkv(rng, sq=64, sk=113)
    mask = rng.random((2, 1, 64, 113)) < 0.5
    both(q, k, v, dict(mask=mask), dict(mask=masks.to_additive(mask, np.float32)))


FULLY_MASKED = {
    # name: (keywords, sq, sk, rows of entry 0 that see nothing)
    "causal_sq_gt_sk": (dict(causal=True), 9, 4, slice(0, 5)),
    "q_lengths": (dict(q_lengths=[3, 9]), 9, 4, slice(3, 9)),
    "kv_lengths_zero": (dict(kv_lengths=[0, 4]), 9, 4, slice(0, 9)),
    "bool_mask_row": ("bool", 9, 4, slice(2, 3)),
    "float_mask_row": ("float", 9, 4, slice(2, 3)),
    "window_left_of_keys": (dict(window=(0, 0)), 9, 4, slice(0, 5)),
}


@pytest.mark.parametrize("case", FULLY_MASKED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fully_masked_rows_give_zero(rng, case, dtype):
    kw, sq, sk, rows = FULLY_MASKED[case]
    if kw in ("bool", "float"):
        m = np.ones((2, 1, sq, sk), dtype=bool)
        m[0, :, rows] = False
        kw = dict(mask=m if kw == "bool" else masks.to_additive(m, np.float32))
    q, k, v = random_qkv(rng, sq=sq, sk=sk, dtype=dtype)
    out, lse = cupy_attn.attention(q, k, v, return_lse=True, **kw)
    assert not np.isnan(out.astype(np.float64)).any() and not np.isnan(lse).any()
    assert (out[0, :, rows] == 0).all()
    assert (lse[0, :, rows] == -np.inf).all()
    want_out, want_lse = cupy_attn.reference.attention(q, k, v, **kw)
    assert_close(out, want_out, dtype)
    assert_close(lse, want_lse, dtype)
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = cupy_attn.attention_backward(dout, q, k, v, out, lse, **kw)
    for g in grads:
        assert not np.isnan(g.astype(np.float64)).any()
    assert (grads[0][0, :, rows] == 0).all()


def test_skipped_tiles_leave_no_trace(rng):
    """A window touching only one 48-key tile out of five gives the same result as slicing."""
    q, k, v = random_qkv(rng, b=1, sq=1, sk=240)
    out = cupy_attn.attention(q, k, v, window=(10, 0))
    want = cupy_attn.attention(q, k[:, :, 229:], v[:, :, 229:])
    assert_close(out, want, np.float32)


@pytest.mark.parametrize("dtype,backend", [(np.float16, "reference"), (np.float16, "numpy"), (np.float32, "emulator-80"),
                                           (np.float16, "emulator-80"), (np.float16, "emulator-90")])
def test_a_nan_input_makes_the_rows_that_see_it_nan_not_empty(rng, monkeypatch, dtype, backend):
    """NaN in one query element (entry 0, head 0, row 3) and one key element (entry 1, head 1,
    key 5, causal): out and lse are NaN in the rows that see it, finite elsewhere (a masked NaN
    score is no score). Its lse must not be -inf, which marks a row that saw no keys: a merge of
    split rows (the decoding kernel's splits, merge_attention, ring attention) drops such a part,
    and the NaN with it."""
    q, k, v = random_qkv(rng, b=2, h=2, sq=7, sk=9, d=16, dtype=dtype)
    q[0, 0, 3, 2] = np.nan
    k[1, 1, 5, 0] = np.nan
    if backend == "reference":
        out, lse = reference.attention(q, k, v, causal=True)
    else:
        if backend.startswith("emulator"):
            monkeypatch.setattr(_kernel_backend, "POISON_OUTPUTS", True)
            monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", int(backend[-2:]))
        out, lse = cupy_attn.attention(q, k, v, causal=True, return_lse=True, backend=backend.split("-")[0])
    nan_rows = np.zeros(lse.shape, bool)
    nan_rows[0, 0, 3] = True
    nan_rows[1, 1, 3:] = True  # causal, bottom-right (Sq = 7, Sk = 9): row i sees keys up to i + 2
    assert (np.isnan(lse) == nan_rows).all(), np.argwhere(np.isnan(lse) != nan_rows)
    assert (np.isnan(out.astype(np.float32)).all(axis=-1) == nan_rows).all()
    if backend != "reference":
        want_out, want_lse = reference.attention(np.nan_to_num(q), np.nan_to_num(k), v, causal=True)
        assert_close(np.where(nan_rows[..., None], 0, out), np.where(nan_rows[..., None], 0, want_out), dtype)
        assert_close(np.where(nan_rows, 0, lse), np.where(nan_rows, 0, want_lse), dtype)
