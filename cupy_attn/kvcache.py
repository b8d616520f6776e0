"""Attention over a KV cache, with an optional in-place append: FlashAttention's flash_attn_with_kvcache."""
from __future__ import annotations

from . import _backends, _decode, _interop, _kvcache
from ._arrays import check_flag


@_interop.outside_torch_compile
def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, cache_batch_idx=None,
                           block_table=None, causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
                           layout="bshd", num_splits=0, return_lse=False, backend="auto"):
    """Attention of new queries over a KV cache (decoding, speculative verification, chunked
    prefill), after appending new keys and values to it in place.

    Shapes (layout "bshd", the default here as in FlashAttention; "bhsd" swaps the S and H axes of
    q, k, v and out, never of the caches):
        q (B, Sq, H, D); new k (B, Snew, Hkv, D) and v (B, Snew, Hkv, Dv), both or neither.
        Contiguous cache: k_cache (B_cache, S_cache, Hkv, D), v_cache (B_cache, S_cache, Hkv, Dv);
            cache_batch_idx int32 (B,) says which cache entry batch entry b uses (default b).
        Paged cache: k_cache (num_blocks, page_size, Hkv, D), v_cache likewise, block_table int32
            (B, max_blocks_per_seq): position j of entry b is row j % page_size of page
            block_table[b, j // page_size]. Any page_size >= 1. Exclusive with cache_batch_idx.
        cache_seqlens: int32 (B,), or an int for every entry: the valid cached tokens of each
            entry before the append.
        H a multiple of Hkv (GQA/MQA); Dv may differ from D.

    What is written where: new row t of entry b goes to position cache_seqlens[b] + t of that
    entry (through the block table when paged), into the caller's k_cache and v_cache, before
    attending; nothing else in the caches changes, and cache_seqlens itself is not modified (add
    Snew to it for the next step). The keys attended by entry b are its positions
    [0, cache_seqlens[b] + Snew).

    Alignment: the Sq queries are the last Sq tokens of each entry, bottom-right aligned: query i
    lines up with key i + kv_len − Sq (kv_len = cache_seqlens[b] + Snew), so with causal=True it
    sees keys j <= i + kv_len − Sq. For Sq = 2, kv_len = 5 (1 = may attend):

            k0 k1 k2 k3 k4
        q0   1  1  1  1  0
        q1   1  1  1  1  1

    causal="top_left", window, scale, softcap and alibi_slopes ((H,) or (B, H)) mean what they
    mean in `attention`, on these lengths. A query row with no key to attend (an empty entry, or
    masked out) gives output 0 and lse −inf, never NaN.

    Returns out (q's layout and dtype, Dv last), or (out, lse) when return_lse, lse (B, H, Sq)
    natural log, float32 (float64 for float64 inputs, which run on the NumPy backend only).
    Forward only.

    num_splits: the CUDA kernels split each entry's keys over this many thread blocks, whose
        partial results are merged exactly (FlashDecoding); 0 chooses from the batch, the kv
        heads, the longest entry and the GPU's SM count (README, "KV cache"); values above the
        longest entry's key tiles are clamped. Results agree for every value up to rounding.
    backend: "auto" (NumPy arrays: "numpy", CuPy: "cuda"), "numpy", "cuda" or "emulator".
        The kernel is built for decoding (Sq·H/Hkv up to 16 rows per kv head share one block);
        a long Sq (prefill over a cache) runs on it correctly, in more blocks, but is not tuned.

    Bad arguments raise ValueError or TypeError naming the argument (cache_seqlens + Snew past
    the capacity, block-table entries that are not pages where keys are read or written, shape,
    dtype or page-size mismatches, num_splits < 0, ...) and leave the caches untouched. PyTorch
    caches are written in place through DLPack; JAX arrays are immutable, so JAX caches can only
    be attended (without k, v). Validation copies cache_seqlens and the block table's used
    columns (or cache_batch_idx) to the host: two or three small copies that wait for the GPU.
    """
    check_flag("return_lse", return_lse)
    framework, lead = _interop.lead(q, k_cache, v_cache, k, v)
    if k is not None and "jax" in (_interop.framework_of(k_cache), _interop.framework_of(v_cache)):
        raise TypeError("k_cache and v_cache are JAX arrays, which are immutable: attention_with_kvcache cannot "
                        "append k, v into them in place. Call it without k, v, after writing the new keys into the "
                        "caches yourself (e.g. with .at[].set()), or use PyTorch, CuPy or NumPy caches")
    with _interop.caller_stream(framework, lead):
        q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes = _interop.backend_arrays(
            framework, ("k_cache", "v_cache") if k is not None else (), function="attention_with_kvcache", q=q,
            k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
            block_table=block_table, alibi_slopes=alibi_slopes)
        kv = _kvcache.make_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                   cache_batch_idx=cache_batch_idx, block_table=block_table, causal=causal,
                                   window=window, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
                                   layout=layout, num_splits=num_splits, backend=backend)
        name = _backends.select(kv.attention)  # may still refuse: before anything is written
        if name != "numpy":
            _decode.check_supported(kv)
        _kvcache.append(kv, k_cache, v_cache, k, v)
        if name == "numpy":
            out, lse = _kvcache.numpy_forward(kv, q, k_cache, v_cache)
        else:
            out, lse = _decode.forward(kv, q, k_cache, v_cache, target=name)
        out, lse = (_interop.to_framework(framework, x) for x in (out, lse))
    return (out, lse) if return_lse else out
