"""cupy_attn for JAX: attention and attention_varlen as jax.custom_vjp functions.

    import cupy_attn.jax
    out = cupy_attn.jax.attention(q, k, v, causal=True)
    grads = jax.grad(lambda q: cupy_attn.jax.attention(q, k, v).sum())(q)
    out = cupy_attn.jax.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)  # packed sequences

What works:
- eager calls and jax.grad on CPU and GPU arrays (GPU arrays run the CUDA kernels, exchanged
  zero-copy through DLPack);
- jax.jit (and vmap) on the CPU, through jax.pure_callback into the NumPy backend;
- under jax.jit on a GPU backend the call raises NotImplementedError: a callback would copy
  every input to the host and back, and cupy_attn does not do that silently.
Array keywords (mask, q_lengths, kv_lengths, alibi_slopes, sinks, cu_seqlens) may be JAX arrays;
sinks get their gradient, the others none (differentiating with respect to a mask or ALiBi slopes
is refused with a TypeError, rather than given a zero gradient). Dropout takes dropout_p and a
jax.random key, dropout_key, from which the seed is drawn (traceable, so a new key under jax.jit gives a new mask). return_lse is not offered: its gradient would be silently dropped.
Importing this module imports jax; importing cupy_attn does not.
"""
from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from . import api
from ._arrays import check_flag, describe, is_integer
from ._problem import _bhsd, _packed

_ARRAY_KEYWORDS = ("mask", "q_lengths", "kv_lengths", "alibi_slopes", "sinks", "cu_seqlens_q", "cu_seqlens_k",
                   "dropout_seed")


def _api_keywords(names: tuple, extras) -> dict:
    """The array keywords as the functional API takes them: dropout_seed travels as two uint32
    words (traceable) and becomes the int seed."""
    keywords = dict(zip(names, extras))
    if "dropout_seed" in keywords:
        low, high = (int(w) for w in np.asarray(keywords["dropout_seed"]))
        keywords["dropout_seed"] = (high << 32) | low
    return keywords


def _traced(*arrays) -> bool:
    return any(isinstance(a, jax.core.Tracer) for a in arrays)


def _result_shapes(q, v, layout: str):
    """out and lse of `attention` (layout "bhsd"/"bshd") or `attention_varlen` (None), with the
    API's error for an array of the wrong rank (reading the shapes comes before the API's checks)."""
    lse_dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    if layout is None:  # packed: q (total_q, H, D), lse (H, total_q)
        total_q, heads, _ = _packed("q", q, "H")
        _packed("v", v, "Hkv")
        lse = jax.ShapeDtypeStruct((heads, total_q), lse_dtype)
    else:
        b, heads, sq, _ = _bhsd("q", q, layout)
        _bhsd("v", v, layout)
        lse = jax.ShapeDtypeStruct((b, heads, sq), lse_dtype)
    return jax.ShapeDtypeStruct(q.shape[:-1] + (v.shape[-1],), q.dtype), lse


# The function pairs an adapter wraps: forward and backward.
_FUNCTIONS = {
    "attention": (api.attention, api.attention_backward),
    "attention_varlen": (api.attention_varlen, api.attention_varlen_backward),
}


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
def _build(function: str, names: tuple, static: tuple, deterministic: bool):
    """A custom_vjp of one of _FUNCTIONS for one set of static keywords and array-keyword names."""
    keywords = dict(static)
    layout = keywords.get("layout", "bhsd") if function == "attention" else None
    api_forward, api_backward = _FUNCTIONS[function]

    def forward(q, k, v, *extras):
        def fn(q, k, v, *extras):
            return api_forward(q, k, v, return_lse=True, **keywords, **_api_keywords(names, extras))

        return _run(fn, _result_shapes(q, v, layout), q, k, v, *extras)

    @jax.custom_vjp
    def attention(q, k, v, *extras):
        return forward(q, k, v, *extras)[0]

    def attention_fwd(*primals):
        # symbolic_zeros: each primal says whether the call is differentiated with respect to it.
        # Only q, k, v and sinks have gradients; for another array the returned zero would be
        # wrong without a word (a learned bias that never learns), so that is refused.
        lost = [name for name, x in zip(names, primals[3:]) if x.perturbed and name != "sinks"]
        if lost:
            raise TypeError(f"cupy_attn.jax.{function} computes no gradient for {lost[0]} (only for q, k, v and "
                            f"sinks), but it is differentiated with respect to it: pass "
                            f"jax.lax.stop_gradient({lost[0]}) to use it as a constant")
        q, k, v, *extras = (x.value for x in primals)
        out, lse = forward(q, k, v, *extras)
        return out, (q, k, v, tuple(extras), out, lse)

    def attention_bwd(residuals, dout):
        q, k, v, extras, out, lse = residuals
        if isinstance(dout, SymbolicZero):  # out's cotangent is zero, symbolically
            dout = jnp.zeros(dout.shape, dout.dtype)

        def fn(dout, q, k, v, out, lse, *extras):
            return api_backward(dout, q, k, v, out, lse, deterministic=deterministic, **keywords,
                                **_api_keywords(names, extras))

        shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
        if "sinks" in names:  # the backward returns dsinks (H,) after dq, dk, dv
            shapes += (jax.ShapeDtypeStruct(extras[names.index("sinks")].shape, lse.dtype),)
        grads = _run(fn, shapes, dout, q, k, v, out, lse, *extras)
        # Sinks get their gradient; masks, lengths and slopes none: None, custom_vjp's symbolic
        # zero, which allocates nothing (an explicit zero array would double a large mask).
        rest = tuple(jnp.asarray(grads[3], e.dtype) if name == "sinks" else None for name, e in zip(names, extras))
        return tuple(grads[:3]) + rest

    attention.defvjp(attention_fwd, attention_bwd, symbolic_zeros=True)
    return attention


def _call(function: str, q, k, v, deterministic, keywords):
    check_flag("deterministic", deterministic)
    if "return_lse" in keywords:
        raise TypeError(f"cupy_attn.jax.{function} does not take return_lse; use cupy_attn.{function} for lse")
    key = keywords.pop("dropout_key", None)
    if key is not None:
        if "dropout_seed" in keywords:
            raise TypeError("give dropout_key or dropout_seed, not both")
        keywords["dropout_seed"] = jax.random.bits(key, (2,), jnp.uint32)  # the seed's low and high words
    elif keywords.get("dropout_seed") is not None:
        seed = keywords["dropout_seed"]
        if not is_integer(seed):
            raise TypeError(f"dropout_seed must be an int in [0, 2**64) (or pass dropout_key), got {describe(seed)}")
        seed = int(seed)
        if not 0 <= seed < 2 ** 64:
            raise ValueError(f"dropout_seed must be in [0, 2**64), got {seed}")
        keywords["dropout_seed"] = np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32)
    elif keywords.get("dropout_p", 0):
        raise TypeError("dropout_p > 0 needs dropout_key, a jax.random key (or an int dropout_seed)")
    names = tuple(n for n in _ARRAY_KEYWORDS if keywords.get(n) is not None)
    extras = [jnp.asarray(keywords.pop(n)) for n in names]
    for n in _ARRAY_KEYWORDS:
        keywords.pop(n, None)
    static = tuple(sorted((n, _static(n, v)) for n, v in keywords.items()))
    return _build(function, names, static, bool(deterministic))(q, k, v, *extras)


def _static(name: str, value):
    """A keyword that is not an array of _ARRAY_KEYWORDS (scale, causal, window, ...) as the
    hashable value the custom_vjp is built for: a list as a tuple, a concrete 0-d array (scale=
    1 / jnp.sqrt(d)) as its number. A traced one cannot be: the kernels are built for its value."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{name} is a traced JAX value: cupy_attn.jax takes it as a static Python value (under "
                        f"jax.jit, pass it as a static argument or compute it outside the traced function)")
    if isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0:
        return value.item()
    if isinstance(value, (list, tuple)):  # window=(jnp.int32(4), None)
        return tuple(_static(name, v) for v in value)
    try:
        hash(value)
    except TypeError:
        raise TypeError(f"{name} must be a Python value (a number, string, bool, tuple or None), got "
                        f"{describe(value)}") from None
    return value


def attention(q, k, v, *, deterministic=False, **keywords):
    """Differentiable `cupy_attn.attention` on JAX arrays (see the module docstring)."""
    return _call("attention", q, k, v, deterministic, keywords)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, deterministic=False,
                     **keywords):
    """Differentiable `cupy_attn.attention_varlen` on JAX arrays: packed q (total_q, H, D), k, v
    (total_k, Hkv, ·); cu_seqlens_q, cu_seqlens_k int32 (B + 1,) arrays (no gradient);
    max_seqlen_q, max_seqlen_k Python ints (static under jax.jit)."""
    keywords.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=int(max_seqlen_q),
                    max_seqlen_k=int(max_seqlen_k))
    return _call("attention_varlen", q, k, v, deterministic, keywords)
