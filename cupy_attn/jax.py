"""cupy_attn for JAX: attention as a jax.custom_vjp function.

    import cupy_attn.jax
    out = cupy_attn.jax.attention(q, k, v, causal=True)
    grads = jax.grad(lambda q: cupy_attn.jax.attention(q, k, v).sum())(q)

What works:
- eager calls and jax.grad on CPU and GPU arrays (GPU arrays run the CUDA kernels, exchanged
  zero-copy through DLPack);
- jax.jit (and vmap) on the CPU, through jax.pure_callback into the NumPy backend;
- under jax.jit on a GPU backend the call raises NotImplementedError: a callback would copy
  every input to the host and back, and cupy_attn does not do that silently.
Array keywords (mask, q_lengths, kv_lengths, alibi_slopes) may be JAX arrays; they get no
gradient. return_lse is not offered: its gradient would be silently dropped.
Importing this module imports jax; importing cupy_attn does not.
"""
from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from . import api

_ARRAY_KEYWORDS = ("mask", "q_lengths", "kv_lengths", "alibi_slopes")


def _traced(*arrays) -> bool:
    return any(isinstance(a, jax.core.Tracer) for a in arrays)


def _result_shapes(q, v, layout: str):
    b, x, y, _ = q.shape
    heads, sq = (x, y) if layout == "bhsd" else (y, x)
    out = jax.ShapeDtypeStruct(q.shape[:3] + (v.shape[3],), q.dtype)
    lse_dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    return out, jax.ShapeDtypeStruct((b, heads, sq), lse_dtype)


def _run(fn, result_shapes, *arrays):
    """Run ``fn`` on concrete arrays directly (zero-copy), or on the CPU through a callback."""
    if not _traced(*arrays):
        return fn(*arrays)
    if jax.default_backend() != "cpu":
        raise NotImplementedError(
            "cupy_attn.jax.attention under jax.jit runs through jax.pure_callback, which would copy "
            "GPU arrays to the host and back; call it outside jax.jit on the GPU"
        )
    host = lambda *xs: tuple(np.asarray(r) for r in fn(*xs))  # noqa: E731
    return jax.pure_callback(host, result_shapes, *arrays, vmap_method="sequential")


@lru_cache(maxsize=128)
def _build(names: tuple, static: tuple, deterministic: bool):
    """A custom_vjp attention for one set of static keywords and array-keyword names."""
    keywords = dict(static)
    layout = keywords.get("layout", "bhsd")

    def forward(q, k, v, *extras):
        def fn(q, k, v, *extras):
            return api.attention(q, k, v, return_lse=True, **keywords, **dict(zip(names, extras)))

        return _run(fn, _result_shapes(q, v, layout), q, k, v, *extras)

    @jax.custom_vjp
    def attention(q, k, v, *extras):
        return forward(q, k, v, *extras)[0]

    def attention_fwd(q, k, v, *extras):
        out, lse = forward(q, k, v, *extras)
        return out, (q, k, v, extras, out, lse)

    def attention_bwd(residuals, dout):
        q, k, v, extras, out, lse = residuals

        def fn(dout, q, k, v, out, lse, *extras):
            return api.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **keywords,
                                          **dict(zip(names, extras)))

        shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
        dq, dk, dv = _run(fn, shapes, dout, q, k, v, out, lse, *extras)
        # Masks, lengths and slopes get no gradient (float0 for the integer ones).
        zeros = tuple(np.zeros(e.shape, jax.dtypes.float0) if not jnp.issubdtype(e.dtype, jnp.floating)
                      else jnp.zeros_like(e) for e in extras)
        return (dq, dk, dv) + zeros

    attention.defvjp(attention_fwd, attention_bwd)
    return attention


def attention(q, k, v, *, deterministic=False, **keywords):
    """Differentiable `cupy_attn.attention` on JAX arrays (see the module docstring)."""
    if "return_lse" in keywords:
        raise TypeError("cupy_attn.jax.attention does not take return_lse; use cupy_attn.attention for lse")
    names = tuple(n for n in _ARRAY_KEYWORDS if keywords.get(n) is not None)
    extras = [jnp.asarray(keywords.pop(n)) for n in names]
    for n in _ARRAY_KEYWORDS:
        keywords.pop(n, None)
    static = tuple(sorted((n, tuple(v) if isinstance(v, list) else v) for n, v in keywords.items()))
    return _build(names, static, bool(deterministic))(q, k, v, *extras)
