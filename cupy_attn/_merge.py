"""Merging partial attention results computed over disjoint key sets, exactly.

For the P parts of one query row, lse = log Σ_p exp(lse_p) and out = Σ_p exp(lse_p − lse)·out_p:
the building block of split-KV decoding, cascade attention and context parallelism. `combine`
merges rows laid out as (P, R, Dv) on any backend; `merge_attention`, the public function, takes
the library's layouts, validates them and brings them to that form and back.
"""
from __future__ import annotations

import math

import numpy as np

from . import _backends, _config, _interop, _kernel_backend
from ._arrays import compute_dtype, magnitude_besides_minus_inf, require_array, require_float_dtype, score_bound
from ._problem import BACKENDS, check_choice

I32, I64 = np.int32, np.int64

# Per layout: out's shape in words, and the permutation of lse's axes that lists its rows in the
# order of out's leading axes (each its own inverse: applied again, it turns rows back into lse).
LAYOUTS = {"bhsd": ("(B, H, S, Dv)", (0, 1, 2)), "bshd": ("(B, S, H, Dv)", (0, 2, 1)), "thd": ("(T, H, Dv)", (1, 0))}
LSE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def combine(target: str, out_parts, lse_parts, out_dtype):
    """Merge P partial results row by row on ``target`` ("numpy", "cuda" or "emulator").

    out_parts: (P, R, Dv), float32 or ``out_dtype``; lse_parts: (P, R) float32 (float64 is
    accepted on "numpy"), finite or −inf. NumPy arrays for "numpy" and "emulator", CuPy arrays
    for "cuda". Returns (out (R, Dv) in ``out_dtype``, lse (R,) float32, or float64 when
    ``out_dtype`` is float64, which only "numpy" takes). A part whose lse is −inf contributes
    exactly nothing, whatever its out holds; a row whose parts are all −inf gives out 0 and
    lse −inf.
    """
    out_dtype = np.dtype(out_dtype)
    if target == "numpy":
        return _combine_numpy(out_parts, lse_parts, out_dtype)
    xp = require_array("out_parts", out_parts)
    parts, rows, dims = out_parts.shape
    out_parts = xp.ascontiguousarray(out_parts)
    lse_parts = xp.ascontiguousarray(lse_parts, dtype=np.float32)
    out = _kernel_backend._empty(xp, (rows, dims), out_dtype)
    lse = _kernel_backend._empty(xp, (rows,), np.float32)
    grid = (_kernel_backend._blocks(rows, _config.COMBINE_ROWS_PER_BLOCK),)
    _kernel_backend._launch(target, _config.COMBINE_FILE, _config.combine_name(out_parts.dtype, out_dtype), grid,
                            (out_parts, lse_parts, out, lse, I32(parts), I64(rows), I32(dims)))
    return out, lse


def _combine_numpy(out_parts, lse_parts, out_dtype):
    """The kernel's arithmetic in NumPy, in float32 (float64 for float64)."""
    dtype = compute_dtype(out_dtype)
    lse_parts = lse_parts.astype(dtype, copy=False)
    row_max = lse_parts.max(axis=0)
    shift = np.where(row_max == -np.inf, 0, row_max)  # all parts −inf: exp(−inf − −inf) would be NaN
    weights = np.exp(lse_parts - shift)  # (P, R): exp(lse_p − max), 0 for an empty part
    total = weights.sum(axis=0)  # >= 1 unless every part is empty
    with np.errstate(divide="ignore"):
        lse = shift + np.log(total)  # −inf where every part is empty
    out = np.zeros(out_parts.shape[1:], dtype)
    for weight, live, part in zip(weights, lse_parts != -np.inf, out_parts):
        # A select, not a product with weight 0: an empty part's out may hold anything, NaN too.
        out += weight[:, None] * np.where(live[:, None], part.astype(dtype, copy=False), 0)
    out /= np.maximum(total, 1)[:, None]  # total is 0 (out is 0 there) or at least 1, the max's own weight
    return out.astype(out_dtype, copy=False), lse


@_interop.outside_torch_compile
def merge_attention(outs, lses, *, layout="bhsd", backend="auto"):
    """Merge attention results computed over disjoint sets of keys into the result over their union.

    For P parts, per query row and head:
        lse = log Σ_p exp(lse_p),    out = Σ_p exp(lse_p − lse) · out_p,
    exactly the out and lse that `attention` would return on all the keys together (up to
    rounding): the combine step of split-KV decoding, cascade attention and context parallelism.

    outs: a list or tuple of P >= 1 arrays of one shape and dtype, or one array with a leading
        P axis. Per part, layout "bhsd": (B, H, S, Dv); "bshd": (B, S, H, Dv); "thd" (packed
        variable-length sequences): (T, H, Dv). float16, bfloat16, float32 or float64.
    lses: the parts' lse, the same way: (B, H, S) in "bhsd" and "bshd", (H, T) in "thd"
        (what `attention(..., return_lse=True)` returns); float32 or float64, each value finite
        or −inf.
    backend: "auto" (NumPy arrays: "numpy"; CuPy: "cuda"), "numpy", "cuda" or "emulator".

    Returns (out, lse): out in the parts' shape and dtype; lse in the parts' lse shape, float32
    (float64 when outs are float64, which only the NumPy backend takes). Computed in float32
    (float64 for float64).

    A part with lse −inf (it saw no keys) contributes exactly nothing, whatever its out holds
    (even NaN); a row whose parts all have lse −inf gives out 0 and lse −inf, never NaN.
    Results are arrays of the inputs' library (NumPy, CuPy; PyTorch and JAX arrays go in and
    come back zero-copy through DLPack). Bad arguments raise ValueError or TypeError naming
    the argument.
    """
    layout = check_choice("layout", layout, tuple(LAYOUTS))
    backend = check_choice("backend", backend, BACKENDS)
    out_items, lse_items = _items(outs), _items(lses)
    framework, lead = _interop.lead(*out_items, *lse_items)
    with _interop.caller_stream(framework, lead):
        named = {f"{what}[{i}]": x for what, items in (("outs", out_items), ("lses", lse_items)) for i, x in enumerate(items)}
        converted = _interop.backend_arrays(framework, function="merge_attention", **named)
        out_items, lse_items = converted[:len(out_items)], converted[len(out_items):]
        outs, lses = _stacked("outs", outs, out_items), _stacked("lses", lses, lse_items)
        xp = require_array("outs", outs)
        require_array("lses", lses, xp)
        out_dtype = _check(xp, outs, lses, layout)
        target = _backends.resolve(backend, xp)
        if target != "numpy" and out_dtype == np.float64:
            raise TypeError(f"float64 inputs run on the NumPy backend only; backend {target!r} takes float16, bfloat16 "
                            "or float32")
        parts, rows_shape, dims, perm = outs.shape[0], outs.shape[1:-1], outs.shape[-1], LAYOUTS[layout][1]
        rows = math.prod(rows_shape)
        out_rows = xp.ascontiguousarray(outs).reshape(parts, rows, dims)  # a copy only if outs is not contiguous
        lse_rows = xp.ascontiguousarray(lses.transpose(0, *(1 + a for a in perm))).reshape(parts, rows)
        out, lse = combine(target, out_rows, lse_rows, out_dtype)
        out = out.reshape(outs.shape[1:])
        lse = xp.ascontiguousarray(lse.reshape(rows_shape).transpose(perm))
        return tuple(_interop.to_framework(framework, x) for x in (out, lse))


def _items(value) -> list:
    """The parts of a list or tuple, or [value] for one stacked array."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _stacked(name: str, value, items: list):
    """One array with a leading P axis: the parts of a list or tuple stacked (checked to share one
    library, shape and dtype), or the stacked array itself."""
    if not isinstance(value, (list, tuple)):
        (array,) = items
        require_array(name, array)
        if array.ndim == 0 or array.shape[0] == 0:
            raise ValueError(f"{name} must hold at least one part along its leading P axis, got shape {tuple(array.shape)}")
        return array
    if not items:
        raise ValueError(f"{name} must hold at least one part, got an empty {type(value).__name__}")
    xp = require_array(f"{name}[0]", items[0])
    for i, x in enumerate(items[1:], 1):
        require_array(f"{name}[{i}]", x, xp)
        if x.dtype != items[0].dtype:
            raise TypeError(f"{name}[{i}] has dtype {x.dtype} but {name}[0] has {items[0].dtype}; all parts must "
                            "share one dtype")
        if x.shape != items[0].shape:
            raise ValueError(f"{name}[{i}] has shape {tuple(x.shape)} but {name}[0] has {tuple(items[0].shape)}; all "
                             "parts must share one shape")
    return xp.stack(items)


def _check(xp, outs, lses, layout: str):
    """The dtype of stacked outs (P, ...), after checking them and stacked lses (P, ...)."""
    words, perm = LAYOUTS[layout]
    out_dtype = require_float_dtype("outs", outs)
    if np.dtype(lses.dtype) not in LSE_DTYPES:
        raise TypeError(f"lses has dtype {lses.dtype}; expected float32 or float64")
    if outs.ndim != len(perm) + 2:
        raise ValueError(f"each part of outs must be {len(perm) + 1}-D {words} for layout {layout!r}, got shape "
                         f"{tuple(outs.shape[1:])}")
    if lses.shape[0] != outs.shape[0]:
        raise ValueError(f"outs has {outs.shape[0]} parts but lses has {lses.shape[0]}; they must match")
    rows_shape = outs.shape[1:-1]
    want = tuple(rows_shape[a] for a in perm)
    if tuple(lses.shape[1:]) != want:
        lse_words = "(H, T)" if layout == "thd" else "(B, H, S)"
        raise ValueError(f"each part of lses must have shape {lse_words} = {want} for outs parts of shape "
                         f"{tuple(outs.shape[1:])} in layout {layout!r}, got {tuple(lses.shape[1:])}")
    bound = score_bound(outs.dtype)
    if lses.size and not magnitude_besides_minus_inf(xp, lses) <= bound:
        raise ValueError(f"lses may hold -inf (a part that saw no keys) and finite values within ±{bound:.4g} (the "
                         f"range the merge computes in, base 2, for {outs.dtype} outs), not NaN or +inf")
    return out_dtype
