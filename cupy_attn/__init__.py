"""cupy_attn: FlashAttention-style scaled dot-product attention for NumPy and CuPy arrays.

    out = cupy_attn.attention(q, k, v, causal=True)

See `attention` for shapes and semantics. Importing this package never imports CuPy or any
deep-learning framework.
"""
from . import masks, reference
from ._backends import BackendUnavailableError
from ._block_mask import BlockMask, block_mask
from ._merge import merge_attention
from ._philox import dropout_mask
from .api import attention, attention_backward, attention_varlen, attention_varlen_backward, precompile
from .heads import merge_heads, multi_head_attention, split_heads
from .kvcache import attention_with_kvcache
from .mods import MaskMod, ScoreMod

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "BlockMask",
    "MaskMod",
    "ScoreMod",
    "attention",
    "attention_backward",
    "attention_varlen",
    "attention_varlen_backward",
    "attention_with_kvcache",
    "block_mask",
    "dropout_mask",
    "masks",
    "merge_attention",
    "merge_heads",
    "multi_head_attention",
    "precompile",
    "reference",
    "split_heads",
]
