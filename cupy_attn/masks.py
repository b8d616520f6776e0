"""Explicit mask builders (True = may attend), for NumPy or CuPy.

`cupy_attn.attention` generates causal, window and length masks itself, tile by tile, without
materialising them; these builders are for combining them with masks of your own, or for
other libraries. Each takes ``xp`` (an array module) or ``like`` (an array whose library to use);
the default is NumPy.
"""
from __future__ import annotations

import numpy as np

from ._arrays import count_argument, module_of, require_array
from ._problem import CAUSAL_ALIGNMENTS, check_choice


def _module(xp, like):
    if like is not None:
        module = module_of(like)
        if module is None:
            raise TypeError(f"like must be a NumPy or CuPy array, got {type(like).__name__}")
        return module
    if xp is None:
        return np
    if xp is not np and getattr(xp, "__name__", None) != "cupy":
        raise TypeError(f"xp must be the numpy or cupy module, got {xp!r}")
    return xp


def _diagonal(sq: int, sk: int, align: str, xp):
    """(sq, sk) int array of j - (i + off): 0 on the diagonal query i lines up with."""
    align = check_choice("align", align, CAUSAL_ALIGNMENTS)
    off = sk - sq if align == "bottom_right" else 0
    return xp.arange(sk)[None, :] - (xp.arange(sq)[:, None] + off)


def causal_mask(sq, sk, align="bottom_right", *, xp=None, like=None):
    """Bool (sq, sk): query i may attend key j iff j <= i + off.

    off = sk - sq for "bottom_right" (FlashAttention's convention; the last query sees every
    key) and 0 for "top_left" (PyTorch's ``is_causal``). For sq=2, sk=5 (1 = may attend)::

        bottom_right   top_left
        1 1 1 1 0      1 0 0 0 0
        1 1 1 1 1      1 1 0 0 0

    With sq > sk under "bottom_right" the first sq - sk rows attend nothing.
    """
    return _diagonal(count_argument("sq", sq), count_argument("sk", sk), align, _module(xp, like)) <= 0


def window_mask(sq, sk, left, right, align="bottom_right", *, xp=None, like=None):
    """Bool (sq, sk): query i may attend key j iff i + off - left <= j <= i + off + right.

    ``left`` / ``right`` are non-negative ints or None (unbounded on that side); off as in
    `causal_mask`. ``window_mask(sq, sk, w, 0)`` is a causal sliding window of w + 1 keys.
    """
    d = _diagonal(count_argument("sq", sq), count_argument("sk", sk), align, _module(xp, like))
    keep = d == d  # all True, in the right library
    if left is not None:
        keep &= d >= -count_argument("left", left)
    if right is not None:
        keep &= d <= count_argument("right", right)
    return keep


def padding_mask(lengths, max_len, *, xp=None, like=None):
    """Bool (B, 1, 1, max_len) from key lengths (B,): key j of entry b may be attended iff
    j < lengths[b]. Broadcasts against (B, H, Sq, Sk) scores."""
    max_len = count_argument("max_len", max_len)
    target = _module(xp, like)  # checked whether or not lengths is an array
    if module_of(lengths) is None:
        try:
            lengths = np.asarray(lengths)
        except ValueError:  # ragged
            raise ValueError(f"lengths must be a 1-D integer array, got {lengths!r:.80}") from None
        if not lengths.size:  # [] is B = 0, not float64
            lengths = lengths.astype(np.int64)
        lengths = target.asarray(lengths)
    module = require_array("lengths", lengths)
    if (xp is not None or like is not None) and module is not target:
        raise TypeError(f"lengths is a {module.__name__} array, but {'like' if like is not None else 'xp'} asks for "
                        f"{target.__name__}; pass lengths from that library (or drop {'like' if like is not None else 'xp'})")
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu":
        raise ValueError(f"lengths must be a 1-D integer array, got shape {tuple(lengths.shape)} dtype {lengths.dtype}")
    if lengths.size and (int(lengths.min()) < 0 or int(lengths.max()) > max_len):
        raise ValueError(f"lengths must lie in [0, max_len = {max_len}]")
    return (module.arange(max_len)[None, :] < lengths[:, None])[:, None, None, :]


def combine(*masks):
    """Logical and of bool masks, with NumPy broadcasting; None entries are ignored."""
    present = [m for m in masks if m is not None]
    if not present:
        raise ValueError("combine needs at least one mask")
    xp = require_array("masks[0]", present[0])
    result = present[0]
    for i, m in enumerate(present):
        require_array(f"masks[{i}]", m, xp)
        if m.dtype != bool:
            raise TypeError(f"masks[{i}] must be bool (True = may attend), got dtype {m.dtype}")
        if i:
            try:
                result = result & m
            except ValueError:
                raise ValueError(f"masks[{i}] of shape {tuple(m.shape)} does not broadcast with the masks before it "
                                 f"(together of shape {tuple(result.shape)})") from None
    return result


def to_additive(mask, dtype):
    """A bool mask as an additive float mask: 0 where True, -inf where False."""
    xp = require_array("mask", mask)
    if mask.dtype != bool:
        raise TypeError(f"mask must be bool, got dtype {mask.dtype}")
    dtype = np.dtype(dtype)
    if dtype.name not in ("float16", "bfloat16", "float32", "float64"):
        raise TypeError(f"dtype must be float16, bfloat16, float32 or float64 (the float masks attention "
                        f"takes), got {dtype}")
    return xp.where(mask, xp.zeros((), dtype=dtype), xp.full((), -np.inf, dtype=dtype))
