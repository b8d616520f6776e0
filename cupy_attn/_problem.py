"""Validation of every attention argument into one normalised description, `Problem`.

All backends consume a `Problem`, so each misuse is caught once, here, with an error that names
the argument, what was expected and what came.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Set
from dataclasses import dataclass

import numpy as np

from ._arrays import (
    BFLOAT16,
    compute_dtype,
    count_argument,
    describe,
    host_ints,
    is_integer,
    is_real_number,
    module_of,
    score_bound,
    require_array,
    require_float_dtype,
)
from ._philox import Dropout, check_dropout
from ._block_mask import BlockMask
from .mods import MaskMod, ScoreMod

LAYOUTS = ("bhsd", "bshd")
PACKED_LAYOUT = "thd"  # attention_varlen: (total, H, D), sequences one after another
CAUSAL_ALIGNMENTS = ("bottom_right", "top_left")
BACKENDS = ("auto", "numpy", "cuda", "emulator")


@dataclass(frozen=True)
class Packing:
    """Where each sequence of a packed (variable-length) batch lies: sequence b owns rows
    [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and out, and the same of cu_seqlens_k in k, v."""

    cu_seqlens_q: object  # (B + 1,) int32 array of the inputs' library
    cu_seqlens_k: object
    total_q: int
    total_k: int


@dataclass(frozen=True)
class Problem:
    """One attention call with validated, normalised arguments (shapes in 'bhsd' terms)."""

    xp: object  # numpy or cupy
    layout: str
    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    head_dim_v: int
    dtype: np.dtype
    causal: str | None  # None, "bottom_right" or "top_left"
    window: tuple[int | None, int | None] | None  # (left, right); None means unbounded
    q_lengths: object | None  # (B,) int64 array of the input's library, or None
    kv_lengths: object | None
    scale: float
    softcap: float | None
    alibi_slopes: object | None  # (B, H) array in the compute dtype, or None
    mask: object | None  # bool or float array broadcastable to (B, H, Sq, Sk)
    backend: str
    # A packed batch (layout "thd"): seq_q, seq_k are then the longest lengths, q_lengths and
    # kv_lengths the lengths of every sequence.
    packing: Packing | None = None
    sinks: object | None = None  # (H,) logits in the compute dtype joining each row's denominator
    dropout: Dropout | None = None  # None when dropout_p is 0
    score_mod: ScoreMod | None = None  # cupy_attn.mods
    mask_mod: MaskMod | None = None
    block_mask: BlockMask | None = None  # its mask_mod is mask_mod

    @property
    def groups(self) -> int:
        """Query heads per key/value head (GQA group size)."""
        return self.heads // self.kv_heads

    @property
    def compute_dtype(self) -> np.dtype:
        return compute_dtype(self.dtype)

    @property
    def out_shape(self) -> tuple[int, ...]:
        if self.packing is not None:
            return (self.packing.total_q, self.heads, self.head_dim_v)
        return self.to_layout((self.batch, self.heads, self.seq_q, self.head_dim_v))

    @property
    def lse_shape(self) -> tuple[int, ...]:
        if self.packing is not None:
            return (self.heads, self.packing.total_q)
        return (self.batch, self.heads, self.seq_q)

    def to_layout(self, bhsd_shape):
        b, h, s, d = bhsd_shape
        return (b, h, s, d) if self.layout == "bhsd" else (b, s, h, d)


def _bhsd(name: str, x, layout: str) -> tuple[int, int, int, int]:
    if x.ndim != 4:
        order = "(B, H, S, D)" if layout == "bhsd" else "(B, S, H, D)"
        raise ValueError(f"{name} must be 4-D {order} for layout {layout!r}, got shape {tuple(x.shape)}")
    b, a, c, d = x.shape
    return (b, a, c, d) if layout == "bhsd" else (b, c, a, d)


def check_choice(name: str, value, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def _causal(causal) -> str | None:
    if causal is None or causal is False:
        return None
    if causal is True:
        return "bottom_right"
    if isinstance(causal, (bool, np.bool_)):
        return "bottom_right" if causal else None
    if isinstance(causal, str) and causal in CAUSAL_ALIGNMENTS:
        return causal
    raise ValueError(
        f"causal must be True, False, 'bottom_right' or 'top_left', got {causal!r}"
    )


def _window(window, reach: int):
    """(left, right) with None for an unbounded side, or None for no window. A side of at least
    ``reach`` (Sq + Sk: more than any query's distance to any key) reaches every key, and is
    clamped there, so that a backend's band arithmetic (row + offset ± side) stays below
    2·reach (the kernels' 32-bit arithmetic: _kernel_backend.check_supported)."""
    if window is None:
        return None
    try:
        pair = not isinstance(window, (str, bytes, Mapping, Set)) and len(window) == 2
    except TypeError:  # no length: an int, a 0-d array
        pair = False
    if not pair:
        raise ValueError(f"window must be a pair (left, right) of non-negative ints or None, got {window!r}")
    sides = []
    for side, value in zip(("left", "right"), window):
        if value is None:
            sides.append(None)
        elif not is_integer(value):
            raise TypeError(f"window {side} must be a non-negative int or None, got {describe(value)}")
        elif value < 0:
            raise ValueError(f"window {side} must be a non-negative int or None, got {value!r}")
        else:
            sides.append(min(int(value), reach))
    return None if sides == [None, None] else tuple(sides)


def _positive_real(name: str, value, dtype: np.dtype) -> float:
    """A positive number that stays a normal, base-2-convertible number in the compute dtype of
    ``dtype``, where the scores are computed (1e39 passes as a float but is inf in float32, and
    1e-300 is 0 there)."""
    if not is_real_number(value):
        raise TypeError(f"{name} must be a real number, got {describe(value)}")
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite and positive, got {value!r:.40}, too large for a float") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and positive, got {value!r}")
    scores = compute_dtype(dtype)
    low, high = float(np.finfo(scores).tiny), score_bound(dtype)
    if not low <= value <= high:
        raise ValueError(f"{name} must lie in [{low:.4g}, {high:.4g}] for {dtype} inputs (from the smallest normal "
                         f"{scores} to half the largest, the scores' range in base 2), got {value!r}")
    return value


def _integer_array(name: str, x, xp, list_dtype, expected: str):
    """x as an array of ``xp``: a list or tuple of ints becomes one (of ``list_dtype``); anything
    else that is not an array of ``xp`` is a TypeError saying what was ``expected``."""
    if module_of(x) is None:
        if isinstance(x, (list, tuple)) and all(is_integer(v) for v in x):
            try:
                return xp.asarray(np.asarray(x, dtype=list_dtype))
            except OverflowError:
                raise ValueError(f"{name} holds a value outside the range of {np.dtype(list_dtype)}, got "
                                 f"{min(x)}..{max(x)}") from None
        raise TypeError(f"{name} must be {expected}, got {describe(x)}")
    require_array(name, x, xp)
    return x


def _lengths(name: str, lengths, xp, batch: int, max_len: int, seq_name: str):
    if lengths is None:
        return None
    lengths = _integer_array(name, lengths, xp, np.int64, f"an integer array of shape ({batch},)")
    if lengths.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {lengths.dtype}")
    if lengths.shape != (batch,):
        raise ValueError(f"{name} must have shape ({batch},) (one length per batch entry), got {tuple(lengths.shape)}")
    if batch:
        low, high = int(lengths.min()), int(lengths.max())
        if low < 0:
            raise ValueError(f"{name} must be non-negative, got a minimum of {low}")
        if high > max_len:
            raise ValueError(f"{name} must not exceed {seq_name} = {max_len}, got a maximum of {high}")
    return lengths.astype(np.int64)


def _per_head(name: str, values, xp, heads: int, dtype: np.dtype, *, batch: int | None, kinds: str, kind_name: str):
    """Finite per-head values in the compute dtype: shape (H,), or with ``batch`` (H,) or (B, H),
    returned as (B, H); lists are accepted; array dtypes must be of ``kinds``."""
    shapes = f"({heads},)" if batch is None else f"({heads},) or ({batch}, {heads})"
    if module_of(values) is None:
        if not isinstance(values, (list, tuple)):
            raise TypeError(f"{name} must be a float array of shape {shapes}, got {describe(values)}")
        try:
            values = xp.asarray(np.asarray(values, dtype=np.float64))
        except (TypeError, ValueError, OverflowError):
            raise TypeError(f"{name} must be a float array of shape {shapes}, got a {type(values).__name__} "
                            f"that is not a rectangular list of numbers: {values!r:.80}") from None
    require_array(name, values, xp)
    if values.dtype.kind not in kinds and values.dtype != BFLOAT16:  # ml_dtypes' bfloat16 is of kind "V"
        raise TypeError(f"{name} must hold {kind_name}, got dtype {values.dtype}")
    if batch is not None and values.shape == (heads,):
        values = xp.broadcast_to(values[None, :], (batch, heads))
    elif values.shape != ((heads,) if batch is None else (batch, heads)):
        raise ValueError(f"{name} must have shape {shapes}, got {tuple(values.shape)}")
    values = values.astype(compute_dtype(dtype))
    if values.size and not bool((xp.abs(values) <= score_bound(dtype)).all()):
        raise ValueError(f"{name} must be finite, within ±{score_bound(dtype):.4g} (the scores' range in base 2 for "
                         f"{dtype} inputs)")
    return values


def _alibi(slopes, xp, batch: int, heads: int, dtype: np.dtype):
    if slopes is None:
        return None
    return _per_head("alibi_slopes", slopes, xp, heads, dtype, batch=batch, kinds="fiu", kind_name="real numbers")


def _sinks(sinks, xp, heads: int, dtype: np.dtype):
    if sinks is None:
        return None
    return _per_head("sinks", sinks, xp, heads, dtype, batch=None, kinds="f", kind_name="floats (one logit per query head)")


def _mod(name: str, mod, cls, q):
    """A ScoreMod or MaskMod whose tensors live where q does (the same library, and for CuPy the
    same GPU), or None."""
    if mod is None:
        return None
    if not isinstance(mod, cls):
        raise TypeError(f"{name} must be a cupy_attn.{cls.__name__}, got {describe(mod)}")
    xp = module_of(q)
    for tensor, x in mod.tensors.items():
        if module_of(x) is not xp:
            raise TypeError(f"{name}'s tensor {tensor!r} is a {describe(x)}, but q is a {xp.__name__} array; "
                            "they must live where q does")
        if xp is not np and x.device.id != q.device.id:
            raise ValueError(f"{name}'s tensor {tensor!r} is on GPU {x.device.id}, but q is on GPU {q.device.id}")
    return mod


def _block_mask(block_mask, mask_mod, xp, shape: tuple):
    """(block_mask, the mask_mod it brings) checked against the call: its mask_mod, shape and array
    library must be the call's."""
    if block_mask is None:
        return None, mask_mod
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must come from cupy_attn.block_mask, got {describe(block_mask)}")
    if mask_mod is not None and mask_mod is not block_mask.mask_mod:
        raise ValueError("block_mask was built for another mask_mod; pass the same MaskMod (or only block_mask)")
    if block_mask.shape != shape:
        raise ValueError(f"block_mask was built for (B, H, Sq, Sk) = {block_mask.shape}, but the call has {shape}")
    if block_mask.xp is not xp:
        raise TypeError(f"block_mask was evaluated with {block_mask.xp.__name__}, but q is a {xp.__name__} array; "
                        "build it with like=q")
    block_mask.require_unchanged()
    return block_mask, block_mask.mask_mod


def _mask(mask, xp, target: tuple[int, int, int, int], q_dtype: np.dtype):
    if mask is None:
        return None
    require_array("mask", mask, xp)
    dtype = np.dtype(mask.dtype)
    if dtype != np.bool_:
        try:
            require_float_dtype("mask", mask)
        except TypeError:
            raise TypeError(f"mask must be bool (True = may attend) or a float additive mask, got dtype {dtype}") from None
    if mask.ndim > 4 or any(m not in (1, t) for m, t in zip(mask.shape[::-1], target[::-1])):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to (B, H, Sq, Sk) = {target}"
        )
    if dtype != np.bool_ and mask.size:
        # One reduction, no temporaries: NaN propagates through max, and +inf is past any bound.
        # Negative values of any size mask (minus_infinity_below).
        largest = float(mask.max())
        if not largest <= score_bound(q_dtype):
            raise ValueError(f"a float mask may hold -inf and finite values up to {score_bound(q_dtype):.4g} (the "
                             f"scores' range in base 2 for {q_dtype} inputs), not NaN or +inf; its largest is "
                             f"{largest:.4g}")
    return mask


def _tensors(q, k, v):
    """The array module and dtype q, k and v share."""
    xp = require_array("q", q)
    require_array("k", k, xp)
    require_array("v", v, xp)
    dtype = require_float_dtype("q", q)
    for name, x in (("k", k), ("v", v)):
        if np.dtype(x.dtype) != dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but q has {dtype}; q, k and v must share one dtype")
    return xp, dtype


def _check_heads_and_dims(rows_name: str, q_shape, k_shape, v_shape, names=("k", "v")) -> None:
    """(heads, rows, head dim) of q, k, v (named ``names``: k_cache, v_cache for a KV cache): k
    and v agree, heads group evenly, dims match."""
    (h, _, d), (hkv, sk, dk), (hv, sv, dv), (k, v) = q_shape, k_shape, v_shape, names
    if hkv != hv:
        raise ValueError(f"{k} has {hkv} heads but {v} has {hv}; they must match")
    if sk != sv:
        raise ValueError(f"{k} has {rows_name} {sk} but {v} has {sv}; they must match")
    if d != dk:
        raise ValueError(f"q has head dim {d} but {k} has {dk}; they must match")
    if d == 0 or dv == 0:
        raise ValueError(f"head dims must be at least 1, got D = {d}, Dv = {dv}")
    if hkv == 0 or h % hkv:
        raise ValueError(f"q's {h} heads must be a multiple of {k}/{v}'s {hkv} heads (GQA/MQA)")


def _features(problem_fields: dict, xp, batch: int, heads: int, dtype, head_dim: int, *, causal, window, scale,
              softcap, alibi_slopes) -> dict:
    """The keywords every attention function shares, validated."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else _positive_real("scale", scale, dtype)
    softcap = None if softcap is None else _positive_real("softcap", softcap, dtype)
    if softcap is not None:
        _check_tanh_factor(scale, softcap, dtype)
    return dict(
        problem_fields,
        causal=_causal(causal),
        window=_window(window, problem_fields["seq_q"] + problem_fields["seq_k"]),
        scale=scale,
        softcap=softcap,
        alibi_slopes=_alibi(alibi_slopes, xp, batch, heads, dtype),
    )


def _check_tanh_factor(scale: float, softcap: float, dtype) -> None:
    """The softcap's tanh takes q·k times 2·log2 e·scale / softcap, and its result is scaled by
    2·log2 e·softcap, each worked out as the kernels do in the compute dtype: past its range a
    factor is inf, and a q·k of 0 would give 0·inf = NaN (each of scale and softcap may be in
    range while their ratio, or twice the cap in base 2, is not)."""
    scores = compute_dtype(dtype).type
    twice_log2e = scores(2 * math.log2(math.e))
    with np.errstate(over="ignore"):
        factors = (twice_log2e * scores(scale) / scores(softcap), twice_log2e * scores(softcap))
    if not all(np.isfinite(f) for f in factors):
        bound = float(np.finfo(scores).max) / (2 * math.log2(math.e))
        raise ValueError(f"with softcap, scale, softcap and scale / softcap must each be below {bound:.4g} for {dtype} "
                         f"inputs (the softcap's tanh takes q·k·2·log2 e·scale / softcap and gives a score of up to "
                         f"2·log2 e·softcap, in {np.dtype(scores)}), got scale = {scale!r} and softcap = {softcap!r}")


def _packed(name: str, x, heads_name: str) -> tuple[int, int, int]:
    if x.ndim != 3:
        raise ValueError(f"{name} must be 3-D (total, {heads_name}, D) for packed sequences, got shape {tuple(x.shape)}")
    return tuple(int(n) for n in x.shape)


def _cu_seqlens(name: str, cu, xp, total: int, total_name: str):
    """Validated cumulative sequence starts, (B + 1,) int32, and the lengths they imply."""
    cu = _integer_array(name, cu, xp, np.int32, "an int32 array of shape (B + 1,)")
    if cu.dtype != np.int32:
        raise TypeError(f"{name} must have dtype int32 (as FlashAttention's cu_seqlens), got {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must have shape (B + 1,) with B >= 0, got {tuple(cu.shape)}")
    host = host_ints(xp, cu)
    if host[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {host[0]}")
    steps = np.diff(host)
    if steps.size and steps.min() < 0:
        at = int(np.argmin(steps))
        raise ValueError(f"{name} must be non-decreasing, got {name}[{at}] = {host[at]} > {name}[{at + 1}] = {host[at + 1]}")
    if host[-1] != total:
        raise ValueError(f"{name}[-1] = {host[-1]} must equal {total_name} = {total}")
    return xp.ascontiguousarray(cu), xp.asarray(steps)  # the kernels index it as a plain int array


def _max_seqlen(name: str, value, lengths, cu_name: str) -> int:
    """The longest sequence, after checking that ``value`` bounds it: the grids are sized by the
    longest, which cu_seqlens (read on the host to be checked) give, so a generous max_seqlen (a
    constant, as FlashAttention's callers often pass) launches no blocks that find nothing and
    meets no grid limit that the sequences themselves do not."""
    value = count_argument(name, value)
    longest = int(lengths.max()) if lengths.size else 0
    if value < longest:
        raise ValueError(f"{name} = {value} is less than the longest sequence in {cu_name} ({longest})")
    if value >= 2**31:  # no sequence is longer than cu_seqlens' int32 offsets reach
        raise ValueError(f"{name} must be below 2^31 (as {cu_name}'s int32 offsets are), got {value}")
    return longest


def make_varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                        window=None, scale=None, softcap=None, alibi_slopes=None, backend="auto") -> Problem:
    """A packed batch: q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv)."""
    backend = check_choice("backend", backend, BACKENDS)
    xp, dtype = _tensors(q, k, v)
    total_q, h, d = _packed("q", q, "H")
    total_k, hkv, dk = _packed("k", k, "Hkv")
    total_v, hv, dv = _packed("v", v, "Hkv")
    _check_heads_and_dims("total rows", (h, total_q, d), (hkv, total_k, dk), (hv, total_v, dv))
    cu_q, q_lengths = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, xp, total_q, "q.shape[0]")
    cu_k, kv_lengths = _cu_seqlens("cu_seqlens_k", cu_seqlens_k, xp, total_k, "k.shape[0]")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have B + 1 entries, got {cu_q.shape[0]} and {cu_k.shape[0]}")
    batch = cu_q.shape[0] - 1
    fields = dict(
        xp=xp, layout=PACKED_LAYOUT, batch=batch, heads=h, kv_heads=hkv,
        seq_q=_max_seqlen("max_seqlen_q", max_seqlen_q, q_lengths, "cu_seqlens_q"),
        seq_k=_max_seqlen("max_seqlen_k", max_seqlen_k, kv_lengths, "cu_seqlens_k"),
        head_dim=d, head_dim_v=dv, dtype=dtype, q_lengths=q_lengths, kv_lengths=kv_lengths, mask=None,
        backend=backend, packing=Packing(cu_q, cu_k, total_q, total_k),
    )
    return Problem(**_features(fields, xp, batch, h, dtype, d, causal=causal, window=window, scale=scale,
                               softcap=softcap, alibi_slopes=alibi_slopes))


def make_problem(q, k, v, *, mask=None, causal=False, window=None, q_lengths=None, kv_lengths=None,
                 scale=None, softcap=None, alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=0,
                 dropout_offset=0, score_mod=None, mask_mod=None, block_mask=None, layout="bhsd",
                 backend="auto") -> Problem:
    layout = check_choice("layout", layout, LAYOUTS)
    backend = check_choice("backend", backend, BACKENDS)
    xp, dtype = _tensors(q, k, v)
    b, h, sq, d = _bhsd("q", q, layout)
    bk, hkv, sk, _ = _bhsd("k", k, layout)
    bv, _, _, dv = _bhsd("v", v, layout)
    if not b == bk == bv:
        raise ValueError(f"batch sizes differ: q has {b}, k has {bk}, v has {bv}")
    _check_heads_and_dims("sequence length", (h, sq, d), _bhsd("k", k, layout)[1:], _bhsd("v", v, layout)[1:])
    fields = dict(
        xp=xp, layout=layout, batch=b, heads=h, kv_heads=hkv, seq_q=sq, seq_k=sk, head_dim=d, head_dim_v=dv,
        dtype=dtype,
        q_lengths=_lengths("q_lengths", q_lengths, xp, b, sq, "Sq"),
        kv_lengths=_lengths("kv_lengths", kv_lengths, xp, b, sk, "Sk"),
        mask=_mask(mask, xp, (b, h, sq, sk), dtype), backend=backend, sinks=_sinks(sinks, xp, h, dtype),
        dropout=check_dropout(dropout_p, dropout_seed, dropout_offset, b * h),
    )
    block_mask, mask_mod = _block_mask(block_mask, mask_mod, xp, (b, h, sq, sk))
    fields.update(score_mod=_mod("score_mod", score_mod, ScoreMod, q), mask_mod=_mod("mask_mod", mask_mod, MaskMod, q),
                  block_mask=block_mask)
    return Problem(**_features(fields, xp, b, h, dtype, d, causal=causal, window=window, scale=scale,
                               softcap=softcap, alibi_slopes=alibi_slopes))


def check_backward_inputs(problem: Problem, dout, out, lse) -> None:
    """The saved forward results and the incoming gradient must match the forward's shapes, and a
    score_mod must say how to differentiate it."""
    xp = problem.xp
    if problem.score_mod is not None and problem.score_mod.grad is None:
        raise ValueError("the backward needs the score_mod's derivative: build it with grad='additive' (a bias, "
                         "d/dscore = 1) or grad='<C expression of d score_mod / d score>'")
    for name, x in (("dout", dout), ("out", out)):
        require_array(name, x, xp)
        if tuple(x.shape) != problem.out_shape:
            raise ValueError(f"{name} must have the forward output's shape {problem.out_shape}, got {tuple(x.shape)}")
        if np.dtype(x.dtype) != problem.dtype:
            raise TypeError(f"{name} must have q's dtype {problem.dtype}, got {x.dtype}")
    require_array("lse", lse, xp)
    if tuple(lse.shape) != problem.lse_shape:
        names = "(H, total_q)" if problem.packing is not None else "(B, H, Sq)"
        raise ValueError(f"lse must have shape {names} = {problem.lse_shape}, got {tuple(lse.shape)}")
    if np.dtype(lse.dtype) != problem.compute_dtype:
        raise TypeError(f"lse must be {problem.compute_dtype} (as returned by attention), got {lse.dtype}")
