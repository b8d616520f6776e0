"""Shared test helpers: the tolerance table (the one place tolerances are stated) and inputs."""
from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]

# Against the float64 reference evaluated on the same (rounded) inputs: |got - want| <= atol +
# rtol·|want|. fp16/bf16 outputs are rounded to their format (eps 2^-10 / 2^-7) after float32
# accumulation; their gradients also see the rounded out and dout, hence the looser grad column.
# For gradients atol is relative to the largest |want| (when above 1): each element is a sum of
# terms as large as the gradient's scale, and the rounding of out feeds every element through
# delta = rowsum(dO·O), so an element near 0 carries an absolute error proportional to that
# scale, not to itself (the NumPy backend, which rounds only out and the results, shows it too).
TOLERANCES = {
    #                       out/lse (atol, rtol)  gradients (atol, rtol)
    np.dtype(np.float64): ((1e-10, 1e-10), (1e-9, 1e-9)),
    np.dtype(np.float32): ((2e-5, 2e-5), (1e-4, 1e-4)),
    np.dtype(np.float16): ((2e-3, 2e-3), (1e-2, 1e-2)),
    BF16: ((1.6e-2, 1.6e-2), (8e-2, 8e-2)),
}


def assert_close(got, want, dtype, *, grad=False, what=""):
    atol, rtol = TOLERANCES[np.dtype(dtype)][1 if grad else 0]
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert not np.isnan(got).any(), f"{what}: NaN in result"
    same_inf = np.isinf(got) == np.isinf(want)
    assert same_inf.all(), f"{what}: infinities differ at {np.argwhere(~same_inf)[:5].tolist()}"
    finite = np.isfinite(want)
    assert (got[~finite] == want[~finite]).all(), f"{what}: infinities of different sign"
    err = np.abs(got[finite] - want[finite])
    if grad and finite.any():
        atol *= max(1.0, float(np.abs(want[finite]).max()))
    bound = atol + rtol * np.abs(want[finite])
    if err.size:
        worst = np.argmax(err - bound)
        assert (err <= bound).all(), f"{what}: max error {err.max():.3e} (worst {err[worst]:.3e} > bound {bound[worst]:.3e})"


def shape_of(layout, b, h, s, d):
    return (b, h, s, d) if layout == "bhsd" else (b, s, h, d)


def random_qkv(rng, *, b=2, h=2, hkv=None, sq=7, sk=9, d=16, dv=None, dtype=np.float32, layout="bhsd"):
    hkv = h if hkv is None else hkv
    dv = d if dv is None else dv
    q = rng.standard_normal(shape_of(layout, b, h, sq, d)).astype(dtype)
    k = rng.standard_normal(shape_of(layout, b, hkv, sk, d)).astype(dtype)
    v = rng.standard_normal(shape_of(layout, b, hkv, sk, dv)).astype(dtype)
    return q, k, v


def check_forward_and_backward(backend, rng, q, k, v, kw, dtype, *, deterministic=False):
    """attention and attention_backward on ``backend`` against the float64 reference, with the
    keywords ``kw``; returns the gradients."""
    import cupy_attn
    from cupy_attn import reference

    out, lse = cupy_attn.attention(q, k, v, return_lse=True, backend=backend, **kw)
    want_out, want_lse = reference.attention(q, k, v, **kw)
    assert_close(out, want_out, dtype, what="out")
    assert_close(lse, want_lse, dtype, what="lse")
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = cupy_attn.attention_backward(dout, q, k, v, out, lse, backend=backend, deterministic=deterministic, **kw)
    want = reference.attention_gradients(dout, q, k, v, **kw)
    assert len(grads) == len(want)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), grads, want):
        assert_close(g, w, dtype, grad=True, what=name)
    return grads


def tma_addressable(x):
    """x (16-bit) in storage whose rows are a multiple of 16 bytes long (a view of a wider array),
    as TMA needs them."""
    wide = np.zeros(x.shape[:-1] + (-(-x.shape[-1] // 8) * 8,), x.dtype)
    wide[..., :x.shape[-1]] = x
    return wide[..., :x.shape[-1]]


def recorded_launches(monkeypatch) -> list:
    """The (kernel name, grid) of every kernel launch from here on (_kernel_backend._launch), each
    launched as before."""
    from cupy_attn import _kernel_backend

    launches, launch = [], _kernel_backend._launch
    monkeypatch.setattr(_kernel_backend, "_launch", lambda target, filename, name, grid, *args, **keywords:
                        launches.append((name, grid)) or launch(target, filename, name, grid, *args, **keywords))
    return launches
