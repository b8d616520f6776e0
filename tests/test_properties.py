"""Hypothesis: random shapes, features and masks against the reference, forward and backward."""
import numpy as np
from hypothesis import given, settings, strategies as st

import cupy_attn
from cupy_attn import reference
from helpers import assert_close


@st.composite
def problems(draw):
    b = draw(st.integers(1, 3))
    hkv = draw(st.integers(1, 3))
    h = hkv * draw(st.integers(1, 3))
    sq, sk = draw(st.integers(1, 70)), draw(st.integers(1, 110))
    d, dv = draw(st.integers(1, 20)), draw(st.integers(1, 20))
    layout = draw(st.sampled_from(["bhsd", "bshd"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    kw = dict(layout=layout, causal=draw(st.sampled_from([False, True, "top_left"])))
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.integers(0, 40))
        kw["window"] = (draw(side), draw(side))
    if draw(st.booleans()):
        kw["q_lengths"] = [draw(st.integers(0, sq)) for _ in range(b)]
    if draw(st.booleans()):
        kw["kv_lengths"] = [draw(st.integers(0, sk)) for _ in range(b)]
    if draw(st.booleans()):
        kw["softcap"] = draw(st.floats(0.5, 30))
    if draw(st.booleans()):
        kw["alibi_slopes"] = rng.uniform(0, 0.5, draw(st.sampled_from([(h,), (b, h)])))
    if draw(st.booleans()):
        kw["scale"] = draw(st.floats(0.01, 2))
    mask_kind = draw(st.sampled_from([None, "bool", "float"]))
    if mask_kind:
        shape = tuple(draw(st.sampled_from([1, n])) for n in (b, h, sq, sk))[draw(st.integers(0, 2)):]
        m = rng.random(shape) < 0.8
        kw["mask"] = m if mask_kind == "bool" else np.where(m, rng.standard_normal(shape), -np.inf).astype(np.float32)
    shape = (lambda a, s, dd: (b, a, s, dd) if layout == "bhsd" else (b, s, a, dd))
    q = rng.standard_normal(shape(h, sq, d)).astype(np.float32)
    k = rng.standard_normal(shape(hkv, sk, d)).astype(np.float32)
    v = rng.standard_normal(shape(hkv, sk, dv)).astype(np.float32)
    dout = rng.standard_normal(shape(h, sq, dv)).astype(np.float32)
    return q, k, v, dout, kw


@settings(max_examples=150, deadline=None)
@given(problems())
def test_matches_reference(problem):
    q, k, v, dout, kw = problem
    out, lse = cupy_attn.attention(q, k, v, return_lse=True, **kw)
    want_out, want_lse = reference.attention(q, k, v, **kw)
    assert_close(out, want_out, np.float32, what="out")
    assert_close(lse, want_lse, np.float32, what="lse")
    grads = cupy_attn.attention_backward(dout, q, k, v, out, lse, **kw)
    for g, w in zip(grads, reference.attention_gradients(dout, q, k, v, **kw)):
        assert_close(g, w, np.float32, grad=True, what="grad")
