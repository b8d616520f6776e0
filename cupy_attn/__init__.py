"""cupy_attn: FlashAttention-style scaled dot-product attention for NumPy and CuPy arrays.

    out = cupy_attn.attention(q, k, v, causal=True)

See `attention` for shapes and semantics. Importing this package never imports CuPy or any
deep-learning framework.
"""
from . import masks, reference
from ._backends import BackendUnavailableError
from .api import attention, attention_backward
from .heads import merge_heads, multi_head_attention, split_heads

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "attention",
    "attention_backward",
    "masks",
    "merge_heads",
    "multi_head_attention",
    "reference",
    "split_heads",
]
