"""attention_with_kvcache's arguments validated into one description, `KVCache`; the in-place
append of new keys and values; and the NumPy backend, which gathers each batch entry's keys from
the cache and runs the NumPy attention on them.

Every check runs before anything is written, so a call that raises leaves the caches as they were.
A contiguous cache is described as a paged one: page_size = S_cache and one page per batch entry
(its cache_batch_idx), so the kernels and the NumPy backend have one way to find key j of entry b:
page block_table[b, j // page_size], row j % page_size.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _numpy_backend
from ._arrays import describe, host_ints, is_integer, module_of, require_array, require_float_dtype
from ._problem import BACKENDS, LAYOUTS, Problem, _bhsd, _check_heads_and_dims, _features, check_choice


@dataclass(frozen=True)
class KVCache:
    """One attention_with_kvcache call. ``attention`` is the attention over the cache as a padded
    batch: seq_k the capacity, kv_lengths = cache_seqlens + Snew, q_lengths None (all Sq queries
    sit at the end of each entry)."""

    attention: Problem
    block_table: object        # (B, pages per entry) int32 array of the inputs' library
    page_size: int
    num_pages: int             # k_cache.shape[0]
    seq_new: int               # Snew: new keys per entry, 0 when k, v are not given
    appends: bool              # k and v were given
    kv_lengths: np.ndarray     # (B,) int64 on the host: cache_seqlens + Snew
    num_splits: int            # 0: the heuristic
    slots: tuple | None        # (pages, rows), (B, Snew) int64 host arrays: where new row t of entry b goes

    @property
    def xp(self):
        return self.attention.xp


def _int32_array(name: str, x, xp, shape_words: str):
    if module_of(x) is None:
        raise TypeError(f"{name} must be an int32 array of shape {shape_words}, got {describe(x)}")
    require_array(name, x, xp)
    if x.dtype != np.int32:
        raise TypeError(f"{name} must have dtype int32 (as FlashAttention's), got {x.dtype}")
    return x


def _cache_seqlens(cache_seqlens, xp, batch: int) -> np.ndarray:
    """(B,) int64 on the host, checked non-negative."""
    if is_integer(cache_seqlens):
        value = int(cache_seqlens)
        if not -2**31 <= value < 2**31:  # the array form's int32; np.full would raise OverflowError past int64
            raise ValueError(f"cache_seqlens must be a non-negative int32, got {value}")
        seqlens = np.full(batch, value, dtype=np.int64)
    else:
        seqlens = host_ints(xp, _int32_array("cache_seqlens", cache_seqlens, xp, f"({batch},) or an int"))
        if seqlens.shape != (batch,):
            raise ValueError(f"cache_seqlens must have shape ({batch},) (one length per batch entry), got "
                             f"{tuple(seqlens.shape)}")
    if batch and seqlens.min() < 0:
        at = int(np.argmin(seqlens))
        raise ValueError(f"cache_seqlens must be non-negative, got cache_seqlens[{at}] = {seqlens[at]}")
    return seqlens


def _cache_shapes(q_shape, k_cache, v_cache, paged: bool) -> tuple[int, int, int, int]:
    """(num_pages, page_size, Hkv, Dv) of the caches, checked against each other and q."""
    _, h, _, d = q_shape
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            words = "(num_blocks, page_size, Hkv, D)" if paged else "(B_cache, S_cache, Hkv, D)"
            raise ValueError(f"{name} must be 4-D {words}, got shape {tuple(x.shape)}")
    (n, s, hkv, dk), (nv, sv, hv, dv) = k_cache.shape, v_cache.shape
    if nv != n:
        what = "pages (num_blocks)" if paged else "cache entries (B_cache)"
        raise ValueError(f"k_cache has {n} {what} but v_cache has {nv}; they must match")
    _check_heads_and_dims("page_size" if paged else "S_cache", (h, 0, d), (hkv, s, dk), (hv, sv, dv),
                          names=("k_cache", "v_cache"))
    if paged and s == 0:
        raise ValueError("k_cache's page_size (axis 1) must be at least 1")
    return n, s, hkv, dv


def _new_keys(k, v, xp, layout: str, b: int, hkv: int, d: int, dv: int) -> int:
    """Snew, after checking the new k and v against the caches (0 when neither is given)."""
    if (k is None) != (v is None):
        given, missing = ("k", "v") if v is None else ("v", "k")
        raise ValueError(f"{given} was given without {missing}: pass both new keys and new values, or neither")
    if k is None:
        return 0
    shapes = {}
    for name, x, dims in (("k", k, d), ("v", v, dv)):
        require_array(name, x, xp)
        bx, hx, sx, dx = shapes[name] = _bhsd(name, x, layout)
        if (bx, hx, dx) != (b, hkv, dims):
            words = ("(B, Snew, Hkv, {})" if layout == "bshd" else "(B, Hkv, Snew, {})").format("D" if name == "k" else "Dv")
            want = (b, sx, hkv, dims) if layout == "bshd" else (b, hkv, sx, dims)
            raise ValueError(f"{name} must be {words} = {want} (q's batch, the caches' heads and head dim) for layout "
                             f"{layout!r}, got {tuple(x.shape)}")
    if shapes["k"][2] != shapes["v"][2]:
        raise ValueError(f"k has {shapes['k'][2]} new rows (Snew) but v has {shapes['v'][2]}; they must match")
    return shapes["k"][2]


def _pages(block_table, cache_batch_idx, xp, batch: int, num_pages: int, page_size: int):
    """(block table, page_size, capacity): the paged table as given, or a contiguous cache's
    cache_batch_idx as a table of one page of S_cache rows per entry."""
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("block_table and cache_batch_idx are exclusive: a paged cache's block table already says "
                             "where each entry's keys are")
        table = _int32_array("block_table", block_table, xp, "(B, max_blocks_per_seq)")
        if table.ndim != 2 or table.shape[0] != batch:
            raise ValueError(f"block_table must have shape (B, max_blocks_per_seq) = ({batch}, ...), got "
                             f"{tuple(table.shape)}")
        return table, page_size, table.shape[1] * page_size
    # A contiguous cache: one page of S_cache rows per entry (a page size of at least 1, so that an
    # empty cache divides nothing by 0; its capacity stays 0).
    if cache_batch_idx is None:
        if batch > num_pages:
            raise ValueError(f"k_cache holds {num_pages} cache entries (B_cache) but q has batch {batch}; pass "
                             "cache_batch_idx to say which entry each batch entry uses")
        return xp.arange(batch, dtype=np.int32)[:, None], max(page_size, 1), page_size
    index = _int32_array("cache_batch_idx", cache_batch_idx, xp, f"({batch},)")
    if index.shape != (batch,):
        raise ValueError(f"cache_batch_idx must have shape ({batch},) (one cache entry per batch entry), got "
                         f"{tuple(index.shape)}")
    host = host_ints(xp, index)
    bad = np.flatnonzero((host < 0) | (host >= num_pages))
    if bad.size:
        raise ValueError(f"cache_batch_idx[{bad[0]}] = {host[bad[0]]} is not an entry of k_cache (B_cache = "
                         f"{num_pages})")
    return xp.ascontiguousarray(index[:, None]), max(page_size, 1), page_size


def _check_table(used: np.ndarray, kv_lengths: np.ndarray, page_size: int, num_pages: int) -> None:
    """Every page that holds one of an entry's kv_lengths[b] keys must be a page of the cache
    (the table's other entries are never read and may hold anything). ``used``: the table's
    columns that hold keys, on the host."""
    needed = np.arange(used.shape[1])[None, :] < (-(-kv_lengths // page_size))[:, None]
    missing = needed & ((used < 0) | (used >= num_pages))
    if missing.any():
        b, j = (int(x) for x in np.argwhere(missing)[0])
        last = min(kv_lengths[b], (j + 1) * page_size) - 1
        raise ValueError(f"block_table[{b}, {j}] = {used[b, j]} is not a page of k_cache (num_blocks = "
                         f"{num_pages}), but entry {b} keeps keys {j * page_size}..{last} there (cache_seqlens + Snew "
                         f"= {kv_lengths[b]}): a missing page")


def _append_slots(used: np.ndarray, seqlens: np.ndarray, seq_new: int, page_size: int):
    """(pages, rows): where new row t of entry b is written, (B, Snew) host arrays; no cache row
    may receive two of them (two entries appending into one page row would race), nor be one
    another entry attends."""
    positions = seqlens[:, None] + np.arange(seq_new)[None, :]
    pages = used[np.arange(len(seqlens))[:, None], positions // page_size]
    rows = positions % page_size
    slots = (pages * page_size + rows).ravel()
    unique, counts = np.unique(slots, return_counts=True)
    if (counts > 1).any():
        twice = np.flatnonzero(slots == unique[counts > 1][0])
        (b0, t0), (b1, t1) = (divmod(int(x), seq_new) for x in twice[:2])
        raise ValueError(f"new k, v row {t0} of batch entry {b0} and row {t1} of entry {b1} would both be written to "
                         f"page {pages[b0, t0]}, row {rows[b0, t0]} of the cache; entries that append must not share "
                         "cache rows (check block_table / cache_batch_idx)")
    _check_no_append_is_read_by_another(used, seqlens + seq_new, pages, rows, page_size)
    return pages, rows


def _check_no_append_is_read_by_another(used: np.ndarray, kv_lengths: np.ndarray, pages, rows,
                                        page_size: int) -> None:
    """No entry may append into a row that another entry attends (a page they share, a prefix):
    whether that entry read the old k, v or the new would depend on the order of the writes and
    the reads."""
    seq_new = pages.shape[1]
    kept = np.arange(used.shape[1])[None, :] < (-(-kv_lengths // page_size))[:, None]
    reader, column = np.nonzero(kept & np.isin(used, pages))  # the cells of the table holding a written page
    read_page = used[reader, column]
    read_rows = np.minimum(page_size, kv_lengths[reader] - column * page_size)  # rows [0, read_rows) of the page
    # Pair every such cell with every write into its page (writes sorted by page).
    order = np.argsort(pages.ravel(), kind="stable")
    written_page, writer, written_row = (x[order] for x in (pages.ravel(), np.arange(pages.size) // seq_new,
                                                            rows.ravel()))
    first = np.searchsorted(written_page, read_page, "left")
    count = np.searchsorted(written_page, read_page, "right") - first
    cell = np.repeat(np.arange(len(read_page)), count)
    write = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count) + np.repeat(first, count)
    clash = np.flatnonzero((writer[write] != reader[cell]) & (written_row[write] < read_rows[cell]))
    if clash.size:
        w, c = write[clash[0]], cell[clash[0]]
        raise ValueError(f"batch entry {writer[w]} would append into page {written_page[w]}, row {written_row[w]} of "
                         f"the cache, which entry {reader[c]} attends (its keys {column[c] * page_size}.."
                         f"{column[c] * page_size + read_rows[c] - 1} are on that page); entries may share pages only "
                         "where none of them appends (check block_table / cache_batch_idx)")


def _elements_apart(x) -> bool:
    """Whether no two elements of x share memory, by a sufficient test: taken from the smallest
    stride up, each axis's stride passes the extent of the axes inside it (as for any layout of
    distinct elements that NumPy, CuPy or PyTorch make short of as_strided)."""
    if 0 in x.shape:
        return True
    extent = x.itemsize
    for stride, n in sorted((abs(st), n) for st, n in zip(x.strides, x.shape) if n > 1):
        if stride < extent:
            return False
        extent += stride * (n - 1)
    return True


def _num_splits(num_splits) -> int:
    if not is_integer(num_splits):
        raise TypeError(f"num_splits must be an int (0: chosen by a heuristic), got {describe(num_splits)}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0: chosen by a heuristic), got {num_splits}")
    return int(num_splits)


def make_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, cache_batch_idx=None, block_table=None,
                 causal=False, window=None, scale=None, softcap=None, alibi_slopes=None, layout="bshd",
                 num_splits=0, backend="auto") -> KVCache:
    layout = check_choice("layout", layout, LAYOUTS)
    backend = check_choice("backend", backend, BACKENDS)
    num_splits = _num_splits(num_splits)
    xp = require_array("q", q)
    dtype = require_float_dtype("q", q)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if x is not None or name.endswith("_cache"):  # the caches are required, the new k, v not
            require_array(name, x, xp)
            if np.dtype(x.dtype) != dtype:
                raise TypeError(f"{name} has dtype {x.dtype} but q has {dtype}; q, the caches and the new k, v must "
                                "share one dtype")
    b, h, sq, d = _bhsd("q", q, layout)
    paged = block_table is not None
    num_pages, page_size, hkv, dv = _cache_shapes((b, h, sq, d), k_cache, v_cache, paged)
    seq_new = _new_keys(k, v, xp, layout, b, hkv, d, dv)
    table, page_size, capacity = _pages(block_table, cache_batch_idx, xp, b, num_pages, page_size)
    seqlens = _cache_seqlens(cache_seqlens, xp, b)
    kv_lengths = seqlens + seq_new
    if b and kv_lengths.max() > capacity:
        at = int(np.argmax(kv_lengths))
        where = (f"max_blocks_per_seq · page_size = {table.shape[1]} · {page_size}" if paged
                 else "the cache's S_cache")
        raise ValueError(f"cache_seqlens + Snew must not exceed the capacity, {where} = {capacity}; entry {at} has "
                         f"{seqlens[at]} + {seq_new} = {kv_lengths[at]}")
    # The table's columns that hold keys, copied to the host once: every check reads them there.
    used = host_ints(xp, table[:, :int(-(-kv_lengths.max() // page_size))]) if b else np.zeros((0, 0), np.int64)
    _check_table(used, kv_lengths, page_size, num_pages)
    slots = None
    if seq_new and b:
        slots = _append_slots(used, seqlens, seq_new, page_size)
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not _elements_apart(x):
                raise ValueError(f"{name} has elements that share memory (shape {tuple(x.shape)}, byte strides {x.strides}: "
                                 "an expanded or as_strided view), so appending would write several cache rows at "
                                 "once; pass a cache of its own memory")
            if xp is np and not x.flags.writeable:
                raise ValueError(f"{name} is read-only, but new k, v are to be written into it")
    fields = dict(xp=xp, layout=layout, batch=b, heads=h, kv_heads=hkv, seq_q=sq, seq_k=capacity, head_dim=d,
                  head_dim_v=dv, dtype=dtype, q_lengths=None, kv_lengths=xp.asarray(kv_lengths), mask=None,
                  backend=backend)
    problem = Problem(**_features(fields, xp, b, h, dtype, d, causal=causal, window=window, scale=scale,
                                  softcap=softcap, alibi_slopes=alibi_slopes))
    return KVCache(problem, table, page_size, num_pages, seq_new, k is not None, kv_lengths, num_splits, slots)


def append(kv: KVCache, k_cache, v_cache, k, v) -> None:
    """Write the new keys and values into the caller's caches, in place: new row t of entry b at
    position cache_seqlens[b] + t of that entry (through the block table)."""
    if kv.slots is None:
        return
    xp, layout = kv.xp, kv.attention.layout
    pages, rows = (xp.asarray(x) for x in kv.slots)
    for cache, new in ((k_cache, k), (v_cache, v)):
        cache[pages, rows] = new if layout == "bshd" else new.transpose(0, 2, 1, 3)  # (B, Snew, Hkv, ·)


def _entry_keys(kv: KVCache, cache, b: int):
    """Entry b's kv_lengths[b] rows of ``cache``, gathered through the block table: (n, Hkv, ·)."""
    j = np.arange(kv.kv_lengths[b])
    pages = np.asarray(kv.block_table[b], dtype=np.int64)[j // kv.page_size]
    return cache[pages, j % kv.page_size]


def numpy_forward(kv: KVCache, q, k_cache, v_cache):
    """Entry by entry: its keys gathered from the cache, then the NumPy backend's attention on them."""
    p = kv.attention
    out = np.empty(p.out_shape, dtype=p.dtype)
    lse = np.empty(p.lse_shape, dtype=p.compute_dtype)
    for b in range(p.batch):
        keys, values = (_entry_keys(kv, cache, b)[None] for cache in (k_cache, v_cache))  # (1, n, Hkv, ·)
        if p.layout == "bhsd":
            keys, values = keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)
        one = _numpy_backend.entry_problem(p, b, seq_k=int(kv.kv_lengths[b]))
        o, l = _numpy_backend.forward(one, q[b:b + 1], keys, values)
        out[b], lse[b] = o[0], l[0]
    return out, lse
