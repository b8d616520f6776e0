"""Launching the split-KV decoding kernel (kernels/attention_decode.cu) for attention_with_kvcache,
on "cuda" (CuPy arrays) or "emulator" (NumPy arrays), and merging its splits with the combine
kernel (cupy_attn._merge.combine)."""
from __future__ import annotations

import numpy as np

from . import _config, _merge
from ._kernel_backend import (_ROW_LIMIT, I32, I64, _blocks, _common_args, _constant, _device_attribute, _empty,
                              _kernel_addressable, _launch, _vector_flags, score_features)
from ._kvcache import KVCache


def sm_count(target: str) -> int:
    """The GPU's SM count, or the emulator's stand-in (an H200's: _config.EMULATOR_SM_COUNT)."""
    if target == "emulator":
        return _config.EMULATOR_SM_COUNT
    import cupy

    return int(_device_attribute(cupy.cuda.Device().id, "MultiProcessorCount"))


def splits(kv: KVCache, tile: _config.DecodeTile, row_tiles: int, target: str) -> int:
    """num_splits as given, clamped to the longest entry's key tiles (and to a grid x of at most
    2^31 - 1 blocks, row_tiles x splits), or the heuristic's choice (_config.decode_splits) for 0."""
    longest = int(kv.kv_lengths.max()) if kv.kv_lengths.size else 0
    key_tiles = _blocks(longest, tile.block_n)
    if kv.num_splits:
        return max(1, min(kv.num_splits, key_tiles, (2**31 - 1) // max(row_tiles, 1)))
    p = kv.attention
    return _config.decode_splits(row_tiles * p.kv_heads * p.batch, key_tiles, sm_count(target))


def check_supported(kv: KVCache) -> None:
    """Refuse head dims past the decoding kernel's tiles before attention_with_kvcache appends
    anything to the caches. (Its tiles' shared memory, 84 KB at most, fits every GPU it runs on.)"""
    p = kv.attention
    _config.decode_tile(p.head_dim, p.head_dim_v)
    # The kernel's rows are (query, head of the kv head's group) pairs, counted in 32 bits.
    if p.seq_q * p.groups > _ROW_LIMIT:
        raise ValueError(f"the decoding kernel counts (query, head) rows of a kv head with 32-bit integers: "
                         f"Sq x H / Hkv must be at most 2^31 - 1024, got {p.seq_q} x {p.groups}")


def forward(kv: KVCache, q, k_cache, v_cache, *, target: str):
    """(out, lse) of attention over the caches (the new keys already appended)."""
    p, xp = kv.attention, kv.xp
    tile = _config.decode_tile(p.head_dim, p.head_dim_v)
    q, k_cache, v_cache = (_kernel_addressable(xp, x) for x in (q, k_cache, v_cache))
    row_tiles = _blocks(p.seq_q * p.groups, tile.block_m)
    n = splits(kv, tile, row_tiles, target)
    table = xp.ascontiguousarray(kv.block_table)
    # The caches seen in q's layout, so that the k, v strides of ATTN_PARAMS are (page, head, row).
    k_view, v_view = (c if p.layout == "bshd" else c.transpose(0, 2, 1, 3) for c in (k_cache, v_cache))
    bhsd = (p.batch, p.heads, p.seq_q)
    if n == 1:  # the final out and lse, directly
        out, lse = _empty(xp, p.out_shape, p.dtype), _empty(xp, p.lse_shape, np.float32)
        unused = _constant(xp, np.float32, writable=True)  # the partials, not written with one split
        outputs, fourth = (out, lse, unused, unused, I64(0), I64(0)), out
    else:  # float32 partials per split, rows (b, h, i) as combine takes them
        out_parts = _empty(xp, (n,) + bhsd + (p.head_dim_v,), np.float32)
        lse_parts = _empty(xp, (n,) + bhsd, np.float32)
        fourth = out_parts[0] if p.layout == "bhsd" else out_parts[0].transpose(0, 2, 1, 3)
        outputs = (_constant(xp, p.dtype, writable=True), _constant(xp, np.float32, writable=True),  # out, lse: not written
                   out_parts, lse_parts, I64(out_parts.strides[0] // 4), I64(lse_parts.strides[0] // 4))
    args = (q, k_cache, v_cache, table, I32(table.shape[1]), I32(kv.page_size), *outputs, I32(n),
            _vector_flags(k_cache, v_cache), *_common_args(p, q, k_view, v_view, fourth))
    _launch(target, tile.filename, tile.name_expression(p.dtype), (row_tiles * n, p.kv_heads, p.batch), args,
            tile.shared_bytes(p.dtype), features=score_features(p))
    if n == 1:
        return out, lse
    out, lse = _merge.combine(target, out_parts.reshape(n, -1, p.head_dim_v), lse_parts.reshape(n, -1), p.dtype)
    out = out.reshape(bhsd + (p.head_dim_v,))
    return xp.ascontiguousarray(out if p.layout == "bhsd" else out.transpose(0, 2, 1, 3)), lse.reshape(bhsd)
