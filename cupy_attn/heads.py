"""Multi-head reshaping and a complete multi-head attention layer."""
from __future__ import annotations

import inspect

from . import _interop
from ._arrays import count_argument, require_array
from ._problem import LAYOUTS, check_choice
from .api import attention

_ATTENTION_KEYWORDS = frozenset(inspect.signature(attention).parameters)


# The head helpers reshape in the array's own library (NumPy, CuPy, PyTorch or JAX: each has
# reshape and swapaxes), so a torch tensor's result stays in autograd's graph and a JAX array's
# traces under jax.jit, where a round trip through DLPack would detach the one and refuse the other.
def _heads_input(x):
    if _interop.framework_of(x) is None:
        require_array("x", x)
    return x


def split_heads(x, num_heads, layout="bhsd"):
    """(B, S, H·D) -> (B, H, S, D) for "bhsd" or (B, S, H, D) for "bshd"; for NumPy, CuPy and
    torch a view, no copy (of a torch tensor that requires grad, a view autograd follows); JAX
    arrays are immutable values, so eager JAX makes new ones (layout="bshd" saves attention's
    transposing copies there)."""
    return _split_heads(_heads_input(x), num_heads, layout)


def _split_heads(x, num_heads, layout):
    layout = check_choice("layout", layout, LAYOUTS)
    num_heads = count_argument("num_heads", num_heads, 1)
    if x.ndim != 3:
        raise ValueError(f"x must be 3-D (B, S, H·D), got shape {tuple(x.shape)}")
    b, s, width = x.shape
    if width % num_heads:
        raise ValueError(f"x's last dimension {width} is not divisible by num_heads = {num_heads}")
    x = x.reshape(b, s, num_heads, width // num_heads)
    return x if layout == "bshd" else x.swapaxes(1, 2)


def merge_heads(x, layout="bhsd"):
    """The inverse of `split_heads`: (B, H, S, D) or (B, S, H, D) -> (B, S, H·D)."""
    return _merge_heads(_heads_input(x), layout)


def _merge_heads(x, layout):
    layout = check_choice("layout", layout, LAYOUTS)
    if x.ndim != 4:
        raise ValueError(f"x must be 4-D, got shape {tuple(x.shape)}")
    if layout == "bhsd":
        x = x.swapaxes(1, 2)
    b, s, h, d = x.shape
    return x.reshape(b, s, h * d)


def _projection(name: str, w, rows: int, heads: int, xp, dtype):
    if xp is not None:  # None: torch tensors, whose library the caller checked
        require_array(name, w, xp)
    if w.ndim != 2 or w.shape[0] != rows or w.shape[1] % heads:
        raise ValueError(
            f"{name} must be 2-D ({rows}, heads·head_dim) with a width divisible by {heads}, "
            f"got shape {tuple(w.shape)}"
        )
    if w.dtype != dtype:
        raise TypeError(f"{name} has dtype {w.dtype} but x has {dtype}; they must match")
    return w


@_interop.outside_torch_compile
def multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads, *, num_kv_heads=None, context=None,
                         **attention_keywords):
    """Multi-head (self- or cross-) attention with its projections.

    x (B, S, E); context (B, Sk, E_ctx) for cross-attention (default: x).
    w_q (E, H·D), w_k (E_ctx, Hkv·D), w_v (E_ctx, Hkv·Dv), w_o (H·Dv, E_out); H = num_heads,
    Hkv = num_kv_heads (default H; GQA/MQA when smaller). Computes
    merge_heads(attention(split(x·w_q), split(ctx·w_k), split(ctx·w_v), ...))·w_o and returns
    (B, S, E_out) in x's library and dtype (with lse too when return_lse=True). Every keyword of
    `cupy_attn.attention` passes through; "layout" picks the internal head layout.
    """
    framework, lead = _interop.lead(x)
    tensors = dict(x=x, w_q=w_q, w_k=w_k, w_v=w_v, w_o=w_o, context=context)
    if _interop.needs_autograd(framework, *tensors.values(), *attention_keywords.values()):
        # The whole layer in torch, its attention through cupy_attn.torch's autograd node: a
        # gradient reaches x, the weights and context (through DLPack it would be lost).
        from . import torch as differentiable

        _interop.check_libraries(framework, **tensors)
        for name in attention_keywords:  # the adapter's own (generator, deterministic) are not attention's
            if name not in _ATTENTION_KEYWORDS:
                raise TypeError(f"multi_head_attention() got an unexpected keyword argument {name!r}")
        if attention_keywords.get("dropout_p") and "dropout_seed" not in attention_keywords:
            # attention's default seed, not a drawn one: the same elements drop with grad on and off
            attention_keywords = dict(attention_keywords, dropout_seed=0)
        return _multi_head_attention(*tensors.values(), num_heads, num_kv_heads, attention_keywords, None,
                                     differentiable.attention)
    with _interop.caller_stream(framework, lead):
        converted = _interop.backend_arrays(framework, **tensors, **attention_keywords)
        arrays, keywords = converted[:6], dict(zip(attention_keywords, converted[6:]))
        result = _multi_head_attention(*arrays, num_heads, num_kv_heads, keywords, require_array("x", arrays[0]),
                                       attention)
        if isinstance(result, tuple):
            return tuple(_interop.to_framework(framework, r) for r in result)
        return _interop.to_framework(framework, result)


def _multi_head_attention(x, w_q, w_k, w_v, w_o, context, num_heads, num_kv_heads, attention_keywords, xp,
                          attention_function):
    """The layer on NumPy or CuPy arrays (``xp``, with `attention`) or on torch tensors (``xp``
    None, with cupy_attn.torch's differentiable attention)."""
    num_heads = count_argument("num_heads", num_heads, 1)
    num_kv_heads = num_heads if num_kv_heads is None else count_argument("num_kv_heads", num_kv_heads, 1)
    context = x if context is None else context
    if xp is not None:
        require_array("context", context, xp)
    for name, a in (("x", x), ("context", context)):
        if a.ndim != 3:
            raise ValueError(f"{name} must be 3-D (B, S, E), got shape {tuple(a.shape)}")
    if context.shape[0] != x.shape[0]:
        raise ValueError(f"context has batch {context.shape[0]} but x has {x.shape[0]}")
    if context.dtype != x.dtype:
        raise TypeError(f"context has dtype {context.dtype} but x has {x.dtype}; they must match")
    _projection("w_q", w_q, x.shape[2], num_heads, xp, x.dtype)
    _projection("w_k", w_k, context.shape[2], num_kv_heads, xp, x.dtype)
    _projection("w_v", w_v, context.shape[2], num_kv_heads, xp, x.dtype)
    if w_q.shape[1] // num_heads != w_k.shape[1] // num_kv_heads:
        raise ValueError(
            f"w_q gives head dim {w_q.shape[1] // num_heads} but w_k gives {w_k.shape[1] // num_kv_heads}"
        )
    dv_width = w_v.shape[1] // num_kv_heads * num_heads
    if xp is not None:
        require_array("w_o", w_o, xp)
    if w_o.ndim != 2 or w_o.shape[0] != dv_width:
        raise ValueError(f"w_o must be 2-D ({dv_width}, E_out) = (H·Dv, E_out), got shape {tuple(w_o.shape)}")
    if w_o.dtype != x.dtype:
        raise TypeError(f"w_o has dtype {w_o.dtype} but x has {x.dtype}; they must match")
    layout = attention_keywords.get("layout", "bhsd")
    q = _split_heads(x @ w_q, num_heads, layout)
    k = _split_heads(context @ w_k, num_kv_heads, layout)
    v = _split_heads(context @ w_v, num_kv_heads, layout)
    result = attention_function(q, k, v, **attention_keywords)
    out, lse = result if attention_keywords.get("return_lse") else (result, None)
    y = _merge_heads(out, layout) @ w_o
    return (y, lse) if lse is not None else y
