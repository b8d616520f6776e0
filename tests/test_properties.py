"""Hypothesis: random shapes, features and masks against the reference, forward and backward."""
import numpy as np
from hypothesis import given, settings, strategies as st

import cupy_attn
from cupy_attn import _kernel_backend, reference
from helpers import BF16, assert_close

HEAD_DIMS = st.one_of(st.integers(1, 20), st.sampled_from([64, 100, 128, 200, 256]))


@st.composite
def problems(draw, head_dims=st.integers(1, 20), dtype=np.float32):
    b = draw(st.integers(1, 3))
    hkv = draw(st.integers(1, 3))
    h = hkv * draw(st.integers(1, 3))
    sq, sk = draw(st.integers(1, 70)), draw(st.integers(1, 110))
    d, dv = draw(head_dims), draw(head_dims)
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
    if draw(st.booleans()):  # up to twice the default 1/sqrt(D): sharper is not a half-precision regime
        kw["scale"] = draw(st.floats(0.01, 2)) / np.sqrt(d)
    mask_kind = draw(st.sampled_from([None, "bool", "float"]))
    if mask_kind:
        shape = tuple(draw(st.sampled_from([1, n])) for n in (b, h, sq, sk))[draw(st.integers(0, 2)):]
        m = rng.random(shape) < 0.8
        kw["mask"] = m if mask_kind == "bool" else np.where(m, rng.standard_normal(shape), -np.inf).astype(np.float32)
    shape = (lambda a, s, dd: (b, a, s, dd) if layout == "bhsd" else (b, s, a, dd))
    q = rng.standard_normal(shape(h, sq, d)).astype(dtype)
    k = rng.standard_normal(shape(hkv, sk, d)).astype(dtype)
    v = rng.standard_normal(shape(hkv, sk, dv)).astype(dtype)
    dout = rng.standard_normal(shape(h, sq, dv)).astype(dtype)
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


@st.composite
def kernel_problems(draw):
    """A random problem for the CUDA kernels (emulated): any dtype they take, head dims on and
    off the tiles, and the compute capability the kernels are chosen for (9.0: wgmma forward)."""
    dtype = draw(st.sampled_from([np.dtype(np.float16), BF16, np.dtype(np.float32)]))
    return draw(problems(HEAD_DIMS, dtype)), dtype, draw(st.sampled_from([80, 90])), draw(st.booleans())


@settings(max_examples=60, deadline=None)
@given(kernel_problems())
def test_kernels_match_reference(problem):
    (q, k, v, dout, kw), dtype, capability, deterministic = problem
    saved = _kernel_backend.EMULATOR_COMPUTE_CAPABILITY, _kernel_backend.POISON_OUTPUTS
    _kernel_backend.EMULATOR_COMPUTE_CAPABILITY, _kernel_backend.POISON_OUTPUTS = capability, True
    try:
        out, lse = cupy_attn.attention(q, k, v, return_lse=True, backend="emulator", **kw)
        grads = cupy_attn.attention_backward(dout, q, k, v, out, lse, backend="emulator",
                                             deterministic=deterministic, **kw)
    finally:
        _kernel_backend.EMULATOR_COMPUTE_CAPABILITY, _kernel_backend.POISON_OUTPUTS = saved
    want_out, want_lse = reference.attention(q, k, v, **kw)
    assert_close(out, want_out, dtype, what="out")
    assert_close(lse, want_lse, dtype, what="lse")
    for name, g, w in zip(("dq", "dk", "dv"), grads, reference.attention_gradients(dout, q, k, v, **kw)):
        assert_close(g, w, dtype, grad=True, what=name)
