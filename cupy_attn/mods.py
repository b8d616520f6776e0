"""Programmable attention: score and mask modifications written as CUDA C expressions, compiled
into the kernels at run time, each with a NumPy twin for the NumPy backend.

    doc = numpy.array([[0, 0, 0, 1, 1, 2]])                 # (B, S) document ids
    same_doc = cupy_attn.MaskMod("doc(b, q_idx) == doc(b, kv_idx)",
                                 lambda b, h, q_idx, kv_idx, doc: doc[b, q_idx] == doc[b, kv_idx],
                                 tensors={"doc": doc})
    out = cupy_attn.attention(q, k, v, mask_mod=same_doc)

Names a snippet sees: ``score`` (ScoreMod only: the scaled score after softcap and ALiBi, natural
log units), ``b``, ``h`` (the query head), ``q_idx``, ``kv_idx`` (ints: positions in the padded
(B, H, Sq, Sk) problem), every tensor of ``tensors`` as ``name(i0, i1, ...)`` (one index per axis,
read through its strides: float16/bfloat16/float32 read as float, int32 as int, bool as bool) and
every scalar of ``scalars`` by name (floats as double, ints as long long, bools as bool). The NumPy
twin is called as ``numpy(score, b, h, q_idx, kv_idx, **tensors, **scalars)`` (MaskMod: without
score) on broadcastable index arrays and must be vectorised over them.
"""
from __future__ import annotations

import keyword
import re

import numpy as np

from ._arrays import BFLOAT16, describe, is_integer, is_real_number, module_of, score_bound, whole_element_strides

# What a snippet may call its own names; the rest are taken by the snippet's context.
RESERVED = ("score", "b", "h", "q_idx", "kv_idx")
# Storage types an auxiliary tensor may have, and how a snippet reads an element (C type, read).
TENSOR_TYPES = {
    np.dtype(np.float16): ("__half", "attn::to_float({})"),
    BFLOAT16: ("__nv_bfloat16", "attn::to_float({})"),
    np.dtype(np.float32): ("float", "{}"),
    np.dtype(np.int32): ("int", "{}"),
    np.dtype(np.bool_): ("unsigned char", "({} != 0)"),
}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# C++ keywords, the operator words and the preprocessor's `defined`, and the type names the
# generated code spells: a tensor or scalar becomes a macro of its name, so none of these may be one.
_CPP_WORDS = frozenset("""alignas alignof and asm auto bool break case catch char class const constexpr const_cast
    continue decltype default delete do double dynamic_cast else enum explicit extern false float for friend goto if
    inline int long mutable namespace new noexcept not nullptr operator or private protected public register
    reinterpret_cast return short signed sizeof static static_assert static_cast struct switch template this throw
    true try typedef typeid typename union unsigned using virtual void volatile while xor to_float
    bitand bitor compl and_eq or_eq xor_eq not_eq defined""".split())


def _check_name(kind: str, name) -> str:
    if not isinstance(name, str) or not _IDENTIFIER.match(name) or keyword.iskeyword(name) or name in _CPP_WORDS:
        raise ValueError(f"{kind} names must be identifiers that are neither Python nor C++ keywords, got {name!r}")
    if name in RESERVED or name.startswith(("attn", "__")):
        raise ValueError(f"{kind} name {name!r} is taken (reserved: {', '.join(RESERVED)}, and names starting with "
                         "attn or __)")
    return name


def _check_tensor(name: str, x) -> None:
    if module_of(x) is None:
        raise TypeError(f"tensor {name!r} must be a NumPy or CuPy array, got {describe(x)}")
    if np.dtype(x.dtype) not in TENSOR_TYPES:
        allowed = ", ".join(str(d) for d in TENSOR_TYPES)
        raise TypeError(f"tensor {name!r} must have one of the dtypes {allowed}, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"tensor {name!r} must have at least one axis (pass a 0-d value as a scalar)")
    if not whole_element_strides(x):
        raise ValueError(f"tensor {name!r} has byte strides {x.strides} that are not whole {x.itemsize}-byte elements "
                         "(a field of a structured array?), which the kernels cannot address; pass a copy")


def _check_scalar(name: str, value) -> None:
    if not (isinstance(value, (bool, np.bool_)) or is_real_number(value)):
        raise TypeError(f"scalar {name!r} must be a bool, int or float, got {describe(value)}")
    if is_integer(value) and not -2 ** 63 <= int(value) < 2 ** 63:
        raise ValueError(f"scalar {name!r} must fit a 64-bit signed integer, got {value}")


def _named(kind: str, items, check, expected: str) -> dict:
    """``items`` (a dict of name -> value, or None) with every name and value checked."""
    if items is None:
        return {}
    if not isinstance(items, dict):
        raise TypeError(f"{kind}s must be a dict of name -> {expected}, got {describe(items)}")
    for name, value in items.items():
        _check_name(kind, name)
        check(name, value)
    return dict(items)


class ModCompileError(ValueError):
    """A score_mod or mask_mod snippet that does not compile: the compiler's message and the
    snippets with line numbers."""


class _Mod:
    """What ScoreMod and MaskMod share: a C expression, its NumPy twin, named tensors and scalars."""

    def __init__(self, cuda, numpy, *, tensors=None, scalars=None):
        if not isinstance(cuda, str) or not cuda.strip():
            raise TypeError(f"cuda must be a non-empty string holding a C expression, got {describe(cuda)}")
        if not callable(numpy):
            raise TypeError(f"numpy must be a callable (the NumPy twin of the C expression), got {describe(numpy)}")
        self.cuda, self.numpy = cuda, numpy
        self.tensors = _named("tensor", tensors, _check_tensor, "array")
        self.scalars = _named("scalar", scalars, _check_scalar, "number")
        both = self.tensors.keys() & self.scalars.keys()
        if both:
            raise ValueError(f"{sorted(both)} named both as a tensor and as a scalar")

    @property
    def arguments(self) -> dict:
        """The twin's keyword arguments: tensors and scalars by name."""
        return {**self.tensors, **self.scalars}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.cuda!r})"


class ScoreMod(_Mod):
    """A modification of each score: ``cuda`` a C float expression over score, b, h, q_idx, kv_idx
    and the named tensors and scalars; ``numpy`` its vectorised NumPy twin. ``grad``: None (no
    backward), "additive" (d/dscore = 1: biases) or a C expression for d score_mod / d score over
    the same names. Auxiliary tensors get no gradient."""

    def __init__(self, cuda, numpy, *, tensors=None, scalars=None, grad=None):
        super().__init__(cuda, numpy, tensors=tensors, scalars=scalars)
        if grad is not None and not (isinstance(grad, str) and grad.strip()):
            raise TypeError(f"grad must be None, 'additive' or a C expression string, got {describe(grad)}")
        self.grad = grad


class MaskMod(_Mod):
    """Which keys each query may attend: ``cuda`` a C boolean expression over b, h, q_idx, kv_idx
    and the named tensors and scalars (true = may attend); ``numpy`` its vectorised NumPy twin,
    called without a score."""

    def __init__(self, cuda, numpy, *, tensors=None, scalars=None):
        super().__init__(cuda, numpy, tensors=tensors, scalars=scalars)
        # cupy_attn.block_mask's results for this mod, by (shape, array module): kept by the mod
        # itself, so that they go with it (a block mask refers to its mod, so a table keyed by
        # weak references to mods would have kept every mod, tensors included, alive).
        self._block_masks = {}


def twin(mod: _Mod, *args, shape: tuple, xp=np, scores_dtype=None, where=None):
    """``mod``'s NumPy twin evaluated at ``args`` (score and the index arrays, or the index arrays
    alone for a MaskMod) with its tensors and scalars, checked and broadcast to ``shape``: a
    ScoreMod's must be real numbers, a MaskMod's bools. With ``scores_dtype`` (the dtype the
    scores are computed in) a ScoreMod's values must also be at most `score_bound` (so not NaN or
    +inf; any negative value masks) wherever ``where`` (bool, broadcasting to ``shape``: the pairs
    that count; all when None) holds and the score came in within that bound. Whatever the twin
    does wrong is an error naming the mod, never scores made of it."""
    name = "score_mod" if isinstance(mod, ScoreMod) else "mask_mod"
    try:
        result = mod.numpy(*args, **mod.arguments)
    except Exception as error:
        raise ValueError(f"{name}'s numpy twin {mod!r} raised {type(error).__name__}: {error}") from error
    if isinstance(result, (bool, int, float, np.generic)):
        result = xp.asarray(result)
    if module_of(result) is not xp:
        raise TypeError(f"{name}'s numpy twin {mod!r} must return a {xp.__name__} array, got {describe(result)}")
    if isinstance(mod, ScoreMod) and result.dtype.kind not in "fiu" and result.dtype != BFLOAT16:
        raise TypeError(f"{name}'s numpy twin {mod!r} must return real numbers (the modified scores), got dtype "
                        f"{result.dtype}")
    if isinstance(mod, MaskMod) and result.dtype != np.bool_:
        raise TypeError(f"{name}'s numpy twin {mod!r} must return bools (True = may attend), got dtype {result.dtype}")
    try:
        result = xp.broadcast_to(result, shape)
    except ValueError:
        raise ValueError(f"{name}'s numpy twin {mod!r} returned shape {tuple(result.shape)}, which does not "
                         f"broadcast to the scores' {shape}") from None
    if isinstance(mod, ScoreMod) and scores_dtype is not None:
        largest = score_bound(scores_dtype)
        # NaN, +inf or past the bound (negative values of any size mask: minus_infinity_below), where
        # the score came in within it: what arrives NaN or out of range is the inputs' doing.
        wrong = ~(result <= largest) & (args[0] <= largest)
        if where is not None:
            wrong &= where
        if bool(wrong.any()):
            raise ValueError(f"{name}'s numpy twin {mod!r} returned NaN, +inf or a value past {largest:.4g} (the "
                             f"scores' range in base 2, in {np.dtype(scores_dtype)}) for a pair that may attend; scores "
                             "must be at most that, or -inf to mask a pair")
    return result


def derivative(mod: ScoreMod, score, *indices):
    """d score_mod / d score of ``mod``'s NumPy twin at ``score`` (float64 array) and the index
    arrays: 1 for an additive mod, else a fourth-order central difference (the C grad expression
    is for the kernels; the NumPy backend and the reference differentiate the twin). 0 where the
    twin is not finite around ``score`` (a score_mod that masks with -inf: those pairs get no
    probability, and 0 keeps the chain rule free of NaN)."""
    if mod.grad == "additive":
        return 1.0
    step = 1e-3 * np.maximum(1.0, np.abs(np.where(np.isfinite(score), score, 0.0)))

    def at(shift):  # a shifted score may leave the twin's domain: NaN there becomes a slope of 0
        return twin(mod, score + shift * step, *indices, shape=score.shape).astype(np.float64)

    with np.errstate(invalid="ignore"):
        slope = (8 * (at(1) - at(-1)) - (at(2) - at(-2))) / (12 * step)
    return np.where(np.isfinite(slope), slope, 0.0)
