"""Which array library an input lives in, and the dtypes cupy_attn accepts.

CuPy is never imported here unless the caller already handed us a CuPy object, so
``import cupy_attn`` works on machines without CuPy or without a GPU.
"""
from __future__ import annotations

import importlib
import math
import numbers

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64))
FLOAT_DTYPE_NAMES = "float16, bfloat16, float32 or float64"


def is_cupy_array(x) -> bool:
    return type(x).__module__.split(".")[0] == "cupy" and hasattr(x, "__cuda_array_interface__")


def module_of(x):
    """numpy for NumPy arrays, cupy for CuPy arrays, None for anything else."""
    if isinstance(x, np.ndarray):
        return np
    if is_cupy_array(x):
        return importlib.import_module("cupy")
    return None


def describe(x) -> str:
    """A short description of what was passed, for error messages."""
    xp = module_of(x)
    if xp is not None:
        return f"{xp.__name__} array of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__module__}.{type(x).__qualname__}".removeprefix("builtins.")


def check_flag(name: str, value) -> None:
    """A flag argument (return_lse, deterministic, ...): a bool, not anything truthy."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {describe(value)}")


def require_array(name: str, x, xp=None):
    """Return the array module of ``x``; raise TypeError if it is not an array of ``xp``."""
    module = module_of(x)
    if module is None:
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {describe(x)}")
    if xp is not None and module is not xp:
        raise TypeError(
            f"{name} is a {module.__name__} array but the other inputs are {xp.__name__} arrays; "
            "pass all arrays from one library"
        )
    if module is not np:
        # The kernels launch on CuPy's current device (the framework adapters make the first
        # tensor's device current first), and, as CuPy's own kernels, take arrays there only: a
        # pointer into another GPU's memory faults, or is read across the bus.
        current = module.cuda.Device().id
        if x.device.id != current:
            raise ValueError(f"{name} is on GPU {x.device.id}, but the call runs on GPU {current} (CuPy's current "
                             "device, or the first framework tensor's): pass every array on one GPU (CuPy arrays of "
                             f"another GPU under `with cupy.cuda.Device({x.device.id}):`)")
    return module


def require_float_dtype(name: str, x) -> np.dtype:
    dtype = np.dtype(x.dtype)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {dtype}; expected {FLOAT_DTYPE_NAMES}")
    return dtype


def host_ints(xp, x) -> np.ndarray:
    """An integer array of ``xp`` (numpy or cupy) as an int64 NumPy array on the host (for
    validation; a copy from a GPU waits for it)."""
    return np.asarray(x if xp is np else x.get(), dtype=np.int64)


def score_bound(dtype) -> float:
    """The largest value that may join the scores (scale, softcap, a float mask's entries, a
    score_mod's results, ALiBi slopes, sinks, an lse to merge) for inputs of ``dtype``: half the
    largest value of the compute dtype, since the kernels work in base 2 and multiply such
    values by log2 e = 1.44 first (a float32 past 2.4e38 would become inf there)."""
    return float(np.finfo(compute_dtype(dtype)).max) / 2


def minus_infinity_below(dtype) -> float:
    """The most negative score the kernels keep finite for inputs of ``dtype``: the compute
    dtype's largest value / log2 e, past which the conversion to base 2 gives -inf, which masks
    the pair (a mask of finfo(float32).min, as transformers builds them, masks). The NumPy
    backend and the reference take scores below it as -inf too."""
    return -float(np.finfo(compute_dtype(dtype)).max) / math.log2(math.e)


def magnitude_besides_minus_inf(xp, x) -> float:
    """The largest |x| over the entries of x (non-empty, float) that are not -inf, in one
    reduction: NaN when one is NaN (it propagates), inf when one is +inf."""
    return float(xp.abs(xp.where(xp.isneginf(x), 0, x)).max())


def whole_element_strides(x) -> bool:
    """Whether every byte stride of x is a whole number of its elements, as the kernels address
    arrays (a field of a structured array may step by any number of bytes)."""
    return all(st % x.itemsize == 0 for st in x.strides)


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """fp16/bf16/fp32 accumulate in float32; float64 stays float64."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def is_real_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def is_integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def count_argument(name: str, value, minimum: int = 0) -> int:
    """``value`` as an int of at least ``minimum`` (0 or 1): a TypeError naming ``name`` unless it is
    an integer (Python's or NumPy's: not a bool, a float, a string or a 0-d array or tensor), a
    ValueError below ``minimum``."""
    kind = "positive" if minimum == 1 else "non-negative"
    if not is_integer(value):
        raise TypeError(f"{name} must be a {kind} int, got {describe(value)}")
    if value < minimum:
        raise ValueError(f"{name} must be a {kind} int, got {value!r}")
    return int(value)
