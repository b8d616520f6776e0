"""attention_with_kvcache: attention over contiguous and paged KV caches with an in-place append,
against the float64 reference on the equivalent dense batch (each entry's keys gathered through its
block table, kv_lengths = cache_seqlens + Snew, bottom-right alignment), on the NumPy backend and
on the decoding kernel (emulator, outputs poisoned, two thread schedules). Cache rows no entry
owns hold NaN and block-table entries past an entry's pages hold -1, so reading either shows."""
from dataclasses import dataclass, replace

import numpy as np
import pytest

import cupy_attn
from cupy_attn import _config, _decode, _kernel_backend, reference
from cupy_attn.kvcache import attention_with_kvcache
from helpers import BF16, DTYPES, assert_close
from test_kernel_forward import poisoned_outputs, schedule  # noqa: F401 (fixtures)
from test_readme import python_blocks

KERNEL_DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32)]
FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "everything": dict(causal=True, window=(40, 0), softcap=4.0, alibi_slopes=[0.3, 0.1, 0.05, 0.2]),
    "top_left": dict(causal="top_left", scale=0.3),
}
# Cached lengths: empty, one token, non-multiples of the 32-key tile, several tiles.
LENGTHS = [0, 1, 37, 150]


@dataclass
class Cache:
    """A KV cache and where entry b's position j lives: page table[b, j // page_size], row
    j % page_size (a contiguous cache: page_size S_cache, table = cache_batch_idx[:, None])."""

    k: np.ndarray
    v: np.ndarray
    table: np.ndarray
    page_size: int
    paged: bool

    def arguments(self) -> dict:
        return dict(block_table=self.table) if self.paged else dict(cache_batch_idx=self.table[:, 0].copy())

    def slot(self, b: int, positions):
        positions = np.asarray(positions)
        return self.table[b, positions // self.page_size], positions % self.page_size

    def entry(self, b: int, n: int):
        """Entry b's first n keys and values, (n, Hkv, ·)."""
        slot = self.slot(b, np.arange(n))
        return self.k[slot], self.v[slot]


def make_cache(rng, lengths, *, page_size=16, capacity=None, final=None, hkv=2, d=32, dv=None, dtype=np.float16,
               shared_pages=0):
    """Entries holding `lengths` random keys; every other row NaN. page_size None: contiguous, with
    a permuted cache_batch_idx into a larger cache. Block-table columns past `final` (the lengths
    after the append) hold -1. shared_pages: the first pages of every entry are entry 0's."""
    lengths = np.asarray(lengths)
    final = lengths if final is None else np.asarray(final)
    dv = d if dv is None else dv
    batch = len(lengths)
    capacity = capacity or int(max(final.max(initial=0), 1)) + 9
    if page_size is None:
        table = rng.permutation(batch + 2)[:batch, None].astype(np.int32)
        pages, rows, paged, page_size = batch + 2, capacity, False, capacity
    else:
        per_entry = -(-capacity // page_size)
        pages, rows, paged = batch * per_entry + 3, page_size, True
        table = rng.permutation(pages)[:batch * per_entry].reshape(batch, per_entry).astype(np.int32)
        table[:, :shared_pages] = table[0, :shared_pages]
        for b in range(batch):
            table[b, -(-final[b] // page_size):] = -1
    k = np.full((pages, rows, hkv, d), np.nan, dtype=dtype)
    v = np.full((pages, rows, hkv, dv), np.nan, dtype=dtype)
    cache = Cache(k, v, table, page_size, paged)
    for b, n in enumerate(lengths):
        slot = cache.slot(b, np.arange(n))
        k[slot] = rng.standard_normal((n, hkv, d))
        v[slot] = rng.standard_normal((n, hkv, dv))
    return cache


def reference_kvcache(q, cache, kv_lengths, layout="bshd", **kw):
    """The float64 reference on the dense equivalent: entry b's kv_lengths[b] keys, zero-padded."""
    kv_lengths = np.asarray(kv_lengths)
    width = max(1, int(kv_lengths.max(initial=0)))
    _, _, hkv, d = cache.k.shape
    keys = np.zeros((len(kv_lengths), width, hkv, d), cache.k.dtype)
    values = np.zeros((len(kv_lengths), width, hkv, cache.v.shape[-1]), cache.v.dtype)
    for b, n in enumerate(kv_lengths):
        keys[b, :n], values[b, :n] = cache.entry(b, n)
    if layout == "bhsd":
        keys, values = keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)
    return reference.attention(q, keys, values, kv_lengths=kv_lengths, layout=layout, **kw)


def to_layout(layout, x):
    """(B, S, H, D) -> the layout's order."""
    return x if layout == "bshd" else x.transpose(0, 2, 1, 3)


def bits(x):
    return np.ascontiguousarray(x).view(np.uint8)


def appended(cache, lengths, k_new, v_new):
    """The caches as they must be after appending (B, Snew, Hkv, ·) new rows, computed row by row."""
    want_k, want_v = cache.k.copy(), cache.v.copy()
    for b, n in enumerate(lengths):
        for t in range(k_new.shape[1]):
            slot = cache.slot(b, n + t)
            want_k[slot], want_v[slot] = k_new[b, t], v_new[b, t]
    return want_k, want_v


def check(backend, rng, lengths, *, snew=0, sq=1, h=4, hkv=2, d=32, dv=None, dtype=np.float16, layout="bshd",
          page_size=16, num_splits=0, shared_pages=0, **kw):
    """One call against the reference, with the caches after it compared bit for bit to what
    the append must leave. Returns (out, lse, cache)."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype=np.int32)
    dv = d if dv is None else dv
    cache = make_cache(rng, lengths, page_size=page_size, final=lengths + snew, hkv=hkv, d=d, dv=dv, dtype=dtype,
                       shared_pages=shared_pages)
    batch = len(lengths)
    q = to_layout(layout, rng.standard_normal((batch, sq, h, d)).astype(dtype))
    new = None
    if snew:
        k_new = rng.standard_normal((batch, snew, hkv, d)).astype(dtype)
        v_new = rng.standard_normal((batch, snew, hkv, dv)).astype(dtype)
        want_k, want_v = appended(cache, lengths, k_new, v_new)
        new = (to_layout(layout, k_new), to_layout(layout, v_new))
    out, lse = attention_with_kvcache(q, cache.k, cache.v, *(new or ()), cache_seqlens=lengths, layout=layout,
                                      num_splits=num_splits, return_lse=True, backend=backend, **cache.arguments(),
                                      **kw)
    if snew:
        np.testing.assert_array_equal(bits(cache.k), bits(want_k))
        np.testing.assert_array_equal(bits(cache.v), bits(want_v))
    want_out, want_lse = reference_kvcache(q, cache, lengths + snew, layout, **kw)
    assert out.dtype == dtype and out.shape == to_layout(layout, np.empty((batch, sq, h, dv))).shape
    assert lse.shape == (batch, h, sq) and lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert_close(out, want_out, dtype, what="out")
    assert_close(lse, want_lse, dtype, what="lse")
    return out, lse, cache


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [None, 1, 7, 16, 256], ids=lambda p: "contiguous" if p is None else f"page{p}")
@pytest.mark.parametrize("feature", FEATURES)
def test_numpy_backend(rng, dtype, page_size, feature):
    check("numpy", rng, LENGTHS, snew=2, sq=3, dtype=dtype, page_size=page_size, **FEATURES[feature])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("feature", FEATURES)
def test_kernel(rng, schedule, dtype, feature):
    """One split (plain), and three (the partials merged by the combine kernel)."""
    check("emulator", rng, LENGTHS, snew=2, sq=3, dtype=dtype, num_splits=1 if feature == "plain" else 3,
          **FEATURES[feature])


@pytest.mark.parametrize("page_size", [None, 1, 7, 16, 48, 256], ids=lambda p: "contiguous" if p is None else f"page{p}")
def test_kernel_page_sizes(rng, schedule, page_size):
    check("emulator", rng, [70, 0, 33, 129], snew=1, page_size=page_size, causal=True)


@pytest.mark.parametrize("d,dv,h,hkv", [(64, 64, 8, 1), (128, 128, 16, 2), (256, 256, 2, 1), (40, 72, 4, 4),
                                        (7, 3, 6, 3)])
def test_kernel_head_dims_and_groups(rng, d, dv, h, hkv):
    """GQA 8:1, MHA, Dv != D, head dims padded to their tile; D = 256 kept to one small case."""
    lengths = [5, 80] if d == 256 else [0, 37, 100]
    check("emulator", rng, lengths, snew=1, sq=2, h=h, hkv=hkv, d=d, dv=dv, causal=True)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_layouts(rng, layout):
    for backend in ("numpy", "emulator"):
        check(backend, rng, [3, 40], snew=2, sq=2, layout=layout, causal=True)


def test_float32_head_dim_256_runs_with_one_stage(rng):
    """Its two K/V stages would not fit 99 KB of shared memory (_config.DecodeTile.stages)."""
    assert _config.decode_tile(256, 256).stages(np.float32) == 1
    check("emulator", rng, [70, 9], snew=1, h=2, hkv=1, d=256, dtype=np.float32, causal=True)


def test_splits_agree_with_one_split(rng, monkeypatch):
    """Every num_splits from 1 to past the key tiles (clamped there) gives the reference's result
    and, up to rounding, the result of one split; more than one split runs the combine."""
    from cupy_attn import _merge

    merged = []
    real = _merge.combine
    monkeypatch.setattr(_merge, "combine", lambda target, out, lse, dtype: merged.append(out.shape[0])
                        or real(target, out, lse, dtype))
    lengths, tiles = [200, 0, 31, 95], -(-201 // 32)
    results = {}
    for n in range(1, tiles + 3):
        out, lse, _ = check("emulator", np.random.default_rng(0), lengths, snew=1, sq=2, num_splits=n,
                            dtype=np.float32, causal=True, window=(150, 0))
        results[n] = out, lse
    assert merged == [min(n, tiles) for n in range(2, tiles + 3)]
    for n, (out, lse) in results.items():
        np.testing.assert_allclose(out, results[1][0], atol=2e-6, rtol=2e-6, err_msg=f"num_splits={n}")
        np.testing.assert_allclose(lse, results[1][1], atol=2e-6, rtol=2e-6, err_msg=f"num_splits={n}")


@pytest.mark.parametrize("backend", ["numpy", "emulator"])
def test_a_nan_key_is_nan_in_every_split(rng, backend):
    """One NaN key among 200 gives out and lse NaN with one split and with four: the split that
    holds it has lse NaN, not -inf, which would mark it empty and have the combine drop it (a
    finite result over the other splits' keys alone)."""
    cache = make_cache(rng, [200, 40], hkv=1, dtype=np.float32)
    page, row = cache.slot(0, 10)
    cache.k[page, row, 0, 3] = np.nan
    q = rng.standard_normal((2, 1, 2, 32)).astype(np.float32)
    for splits in (1, 4):
        out, lse = attention_with_kvcache(q, cache.k, cache.v, cache_seqlens=np.array([200, 40], np.int32),
                                          num_splits=splits, return_lse=True, backend=backend, **cache.arguments())
        assert np.isnan(lse[0]).all() and np.isnan(out[0]).all(), splits
        want_out, want_lse = reference_kvcache(q[1:], replace(cache, table=cache.table[1:]), [40])
        assert_close(out[1:], want_out, np.float32, what=f"out, {splits} splits")
        assert_close(lse[1:], want_lse, np.float32, what=f"lse, {splits} splits")


def test_a_head_dim_past_the_decoding_tiles_is_refused_before_the_append():
    """D = 300 runs on the NumPy backend alone: the kernels' refusal comes before the append would
    write the caches (it came after). No other refusal can come later: every decoding tile's
    shared memory fits the least a GPU the kernels run on offers."""
    q, new = np.ones((1, 1, 1, 300), np.float32), np.ones((2, 1, 1, 1, 300), np.float32)
    caches = np.zeros((2, 1, 16, 1, 300), np.float32)
    with pytest.raises(ValueError, match="head dims up to 256 are supported by these CUDA kernels, got D = 300"):
        attention_with_kvcache(q, *caches, *new, cache_seqlens=3, backend="emulator")
    assert not caches.any()
    assert max(t.shared_bytes(dtype) for t in _config.DECODE_TILES for dtype in KERNEL_DTYPES) \
        <= _config.LEAST_SHARED_LIMIT


def test_split_heuristic():
    """_config.decode_splits: ~2 blocks per SM, at least 4 key tiles per split, at most 128."""
    assert _config.decode_splits(blocks=8, key_tiles=1024, sm_count=132) == 33  # 2 · 132 / 8
    assert _config.decode_splits(blocks=1, key_tiles=4096, sm_count=132) == 128
    assert _config.decode_splits(blocks=8, key_tiles=40, sm_count=132) == 10  # 4 tiles per split
    assert _config.decode_splits(blocks=8, key_tiles=3, sm_count=132) == 1
    assert _config.decode_splits(blocks=512, key_tiles=1024, sm_count=132) == 1  # a full grid already


def test_heuristic_splits_a_long_context_on_the_emulator(rng, monkeypatch):
    """The emulator stands in for an H200's 132 SMs: one entry of 1000 keys on one kv head gets
    its 32 key tiles in 8 splits, and the combined result matches the reference."""
    chosen = []
    real = _decode.splits
    monkeypatch.setattr(_decode, "splits", lambda *a, **kw: chosen.append(real(*a, **kw)) or chosen[-1])
    check("emulator", rng, [1000], h=8, hkv=1, page_size=64, causal=True)
    assert chosen == [8]


def test_append_then_attend_equals_attending_the_concatenation(rng):
    """Appending k, v and attending equals attending, without k, v, a cache that already holds
    them (bit for bit: the kernel sees the same keys); everything but the appended rows is
    untouched."""
    for backend in ("numpy", "emulator"):
        lengths = np.array([0, 33, 64], np.int32)
        cache = make_cache(rng, lengths, page_size=16, final=lengths + 3)
        before_k, before_v = cache.k.copy(), cache.v.copy()
        q = rng.standard_normal((3, 3, 4, 32)).astype(np.float16)
        k_new, v_new = (rng.standard_normal((3, 3, 2, 32)).astype(np.float16) for _ in range(2))
        args = dict(causal=True, backend=backend, return_lse=True, block_table=cache.table)
        out, lse = attention_with_kvcache(q, cache.k, cache.v, k_new, v_new, cache_seqlens=lengths, **args)
        changed = np.zeros(cache.k.shape[:2], bool)
        for b, n in enumerate(lengths):
            changed[cache.slot(b, np.arange(n, n + 3))] = True
        np.testing.assert_array_equal(bits(cache.k[~changed]), bits(before_k[~changed]))
        np.testing.assert_array_equal(bits(cache.v[~changed]), bits(before_v[~changed]))
        again = attention_with_kvcache(q, cache.k, cache.v, cache_seqlens=lengths + 3, **args)
        np.testing.assert_array_equal(out, again[0])
        np.testing.assert_array_equal(lse, again[1])


def test_decoding_loop_matches_attention_over_the_sequence(rng):
    """Prefill 5 tokens, then append one at a time: each step's output is causal attention's
    last row over everything so far."""
    keys, values = (rng.standard_normal((1, 12, 2, 16)).astype(np.float32) for _ in range(2))
    queries = rng.standard_normal((1, 12, 4, 16)).astype(np.float32)
    k_cache, v_cache = np.zeros((1, 12, 2, 16), np.float32), np.zeros((1, 12, 2, 16), np.float32)
    attention_with_kvcache(queries[:, :5], k_cache, v_cache, keys[:, :5], values[:, :5], cache_seqlens=0,
                           backend="emulator")
    for n in range(5, 12):
        out = attention_with_kvcache(queries[:, n:n + 1], k_cache, v_cache, keys[:, n:n + 1], values[:, n:n + 1],
                                     cache_seqlens=n, causal=True, backend="emulator")
        full = cupy_attn.attention(queries[:, :n + 1], keys[:, :n + 1], values[:, :n + 1], causal=True, layout="bshd")
        assert_close(out, full[:, -1:], np.float32)


def test_shared_pages_when_attending_only(rng, schedule):
    """Entries may share pages (a common prefix) when nothing is appended."""
    _, _, cache = check("emulator", rng, [40, 40, 47], page_size=16, shared_pages=2, causal=True)
    assert (cache.table[:, :2] == cache.table[0, :2]).all()


def test_contiguous_cache_with_permuted_batch_index(rng, schedule):
    """make_cache's contiguous caches take a random cache_batch_idx into a larger cache; swapping
    two entries and their indices swaps the results."""
    check("emulator", rng, [20, 0, 65], snew=2, page_size=None, causal=True)
    lengths = np.array([5, 9], np.int32)
    k_cache = rng.standard_normal((2, 16, 2, 32)).astype(np.float16)
    v_cache = rng.standard_normal((2, 16, 2, 32)).astype(np.float16)
    q = rng.standard_normal((2, 1, 4, 32)).astype(np.float16)
    swapped = attention_with_kvcache(q[::-1], k_cache, v_cache, cache_seqlens=lengths[::-1].copy(),
                                     cache_batch_idx=np.array([1, 0], np.int32), backend="emulator")
    default = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, backend="emulator")
    np.testing.assert_array_equal(swapped[::-1], default)


def test_prefill_over_a_cache(rng, schedule):
    """A long Sq (chunked prefill) runs on the kernel with its rows in several tiles."""
    check("emulator", rng, [30, 0], snew=40, sq=40, h=4, hkv=2, page_size=None, causal=True)


def test_unaligned_cache_rows_are_copied_element_by_element(rng):
    """16-byte chunks need 16-byte-aligned rows; a cache view at an odd offset takes the other path."""
    buffer = rng.standard_normal(2 * 20 * 2 * 24 + 1).astype(np.float16)
    k_cache = buffer[1:].reshape(2, 20, 2, 24)
    v_cache = np.ascontiguousarray(k_cache[::-1])
    assert not _kernel_backend._copies_in_16_bytes(k_cache)
    q = rng.standard_normal((2, 2, 4, 24)).astype(np.float16)
    lengths = np.array([20, 13], np.int32)
    out = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True, backend="emulator")
    cache = Cache(k_cache, v_cache, np.array([[0], [1]], np.int32), 20, False)
    assert_close(out, reference_kvcache(q, cache, lengths, causal=True)[0], np.float16)


def test_a_call_runs_the_build_of_the_features_it_uses(rng, monkeypatch):
    from cupy_attn import _compile

    built = []
    real = _compile.function
    monkeypatch.setattr(_compile, "function", lambda target, f, name, **kw: built.append((f, kw["features"]))
                        or real(target, f, name, **kw))
    check("emulator", rng, [10], causal=True)
    check("emulator", rng, [10], softcap=3.0)
    assert built == [("attention_decode.cu", _config.PLAIN_FEATURES), ("attention_decode.cu", _config.SOFTCAP)]


# ---- errors: each leaves the caches bit for bit as they were ----

def error_case(rng):
    lengths = np.array([3, 10], np.int32)
    cache = make_cache(rng, lengths, page_size=8, capacity=16, final=lengths + 2)
    q = rng.standard_normal((2, 1, 4, 32)).astype(np.float16)
    k_new, v_new = (rng.standard_normal((2, 2, 2, 32)).astype(np.float16) for _ in range(2))
    return cache, dict(q=q, k_cache=cache.k, v_cache=cache.v, k=k_new, v=v_new, cache_seqlens=lengths,
                       block_table=cache.table)


def table_with(cache, at, value):
    table = cache.table.copy()
    table[at] = value
    return table


ERRORS = [
    (lambda c: dict(cache_seqlens=np.array([-1, 3], np.int32)), ValueError,
     r"cache_seqlens must be non-negative, got cache_seqlens\[0\] = -1"),
    (lambda c: dict(cache_seqlens=np.array([3, 10], np.int64)), TypeError, "cache_seqlens must have dtype int32"),
    (lambda c: dict(cache_seqlens=np.array([3, 10, 1], np.int32)), ValueError, r"cache_seqlens must have shape \(2,\)"),
    (lambda c: dict(cache_seqlens=[3, 10]), TypeError, "cache_seqlens must be an int32 array"),
    (lambda c: dict(cache_seqlens=2**70), ValueError, "cache_seqlens must be a non-negative int32, got 1180591620717411303424"),
    (lambda c: dict(cache_seqlens=-2**70), ValueError, "cache_seqlens must be a non-negative int32, got -1180591620717411303424"),
    (lambda c: dict(cache_seqlens=np.array([3, 15], np.int32)), ValueError,
     r"must not exceed the capacity, max_blocks_per_seq · page_size = 2 · 8 = 16; entry 1 has 15 \+ 2 = 17"),
    (lambda c: dict(block_table=table_with(c, (1, 1), -1)), ValueError,
     r"block_table\[1, 1\] = -1 is not a page of k_cache \(num_blocks = 7\), but entry 1 keeps keys 8..11 there"),
    (lambda c: dict(block_table=table_with(c, (0, 0), 7)), ValueError, r"block_table\[0, 0\] = 7 is not a page"),
    (lambda c: dict(block_table=c.table.astype(np.int64)), TypeError, "block_table must have dtype int32"),
    (lambda c: dict(block_table=c.table[:1]), ValueError, r"block_table must have shape \(B, max_blocks_per_seq\)"),
    (lambda c: dict(block_table=table_with(c, (1, 1), c.table[0, 0])), ValueError,
     "would both be written to page"),
    (lambda c: dict(block_table=table_with(c, (1, 0), c.table[0, 0])), ValueError,  # entry 1 reads keys 0..7 there
     r"batch entry 0 would append into page \d+, row 3 of the cache, which entry 1 attends \(its keys 0..7"),
    (lambda c: dict(cache_batch_idx=np.array([0, 1], np.int32)), ValueError,
     "block_table and cache_batch_idx are exclusive"),
    (lambda c: dict(v=None), ValueError, "k was given without v"),
    (lambda c: dict(k=None), ValueError, "v was given without k"),
    (lambda c: dict(k=np.zeros((2, 2, 1, 32), np.float16)), ValueError,
     r"k must be \(B, Snew, Hkv, D\) = \(2, 2, 2, 32\)"),
    (lambda c: dict(v=np.zeros((2, 3, 2, 32), np.float16)), ValueError, r"k has 2 new rows \(Snew\) but v has 3"),
    (lambda c: dict(k_cache=c.k.astype(np.float32)), TypeError, "k_cache has dtype float32 but q has float16"),
    (lambda c: dict(k_cache=None), TypeError, "k_cache must be a NumPy or CuPy array, got NoneType"),
    (lambda c: dict(v_cache=None), TypeError, "v_cache must be a NumPy or CuPy array, got NoneType"),
    (lambda c: dict(v_cache=c.v[:, :4]), ValueError, "k_cache has page_size 8 but v_cache has 4"),
    (lambda c: dict(v_cache=c.v[:6]), ValueError, r"k_cache has 7 pages \(num_blocks\) but v_cache has 6"),
    (lambda c: dict(q=np.zeros((2, 1, 4, 16), np.float16)), ValueError, "q has head dim 16 but k_cache has 32"),
    (lambda c: dict(q=np.zeros((2, 1, 3, 32), np.float16)), ValueError, r"multiple of k_cache/v_cache's 2 heads"),
    (lambda c: dict(k_cache=c.k[0]), ValueError, r"k_cache must be 4-D \(num_blocks, page_size, Hkv, D\)"),
    (lambda c: dict(num_splits=-1), ValueError, "num_splits must be >= 0"),
    (lambda c: dict(num_splits=1.5), TypeError, "num_splits must be an int"),
    (lambda c: dict(num_splits=True), TypeError, "num_splits must be an int"),
    (lambda c: dict(layout="sbhd"), ValueError, "layout must be one of"),
    (lambda c: dict(alibi_slopes=[0.1, 0.2]), ValueError, "alibi_slopes must have shape"),
    (lambda c: dict(q=np.zeros((2, 1, 4, 32), np.float64)), TypeError, "k_cache has dtype float16 but q has float64"),
]


@pytest.mark.parametrize("change,error,message", ERRORS, ids=[e[2][:40] for e in ERRORS])
def test_errors_leave_the_caches_untouched(rng, change, error, message):
    cache, args = error_case(rng)
    before = bits(cache.k).copy(), bits(cache.v).copy()
    args.update(change(cache))
    with pytest.raises(error, match=message):
        attention_with_kvcache(**args, backend="emulator")
    np.testing.assert_array_equal(bits(cache.k), before[0])
    np.testing.assert_array_equal(bits(cache.v), before[1])


def test_contiguous_cache_errors(rng):
    lengths = np.array([3, 10], np.int32)
    k_cache = np.zeros((3, 12, 2, 32), np.float16)
    v_cache = k_cache.copy()
    q = rng.standard_normal((2, 1, 4, 32)).astype(np.float16)
    k_new = v_new = np.ones((2, 3, 2, 32), np.float16)
    cases = [
        (dict(cache_seqlens=lengths), ValueError, r"the capacity, the cache's S_cache = 12; entry 1 has 10 \+ 3 = 13"),
        (dict(cache_batch_idx=np.array([0, 3], np.int32)), ValueError, r"cache_batch_idx\[1\] = 3 is not an entry"),
        (dict(cache_seqlens=np.array([3, 3], np.int32), cache_batch_idx=np.array([1, 1], np.int32)), ValueError,
         "would both be written"),
        (dict(cache_seqlens=np.array([0, 4], np.int32), cache_batch_idx=np.array([1, 1], np.int32)), ValueError,
         r"batch entry 0 would append into page 1, row 0 of the cache, which entry 1 attends \(its keys 0..6"),
        (dict(cache_batch_idx=np.array([0, 1], np.int64)), TypeError, "cache_batch_idx must have dtype int32"),
        (dict(cache_batch_idx=np.array([0], np.int32)), ValueError, r"cache_batch_idx must have shape \(2,\)"),
    ]
    for change, error, message in cases:
        args = dict(cache_seqlens=np.array([3, 9], np.int32))
        args.update(change)
        with pytest.raises(error, match=message):
            attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, **args)
        assert not k_cache.any() and not v_cache.any()
    read_only = k_cache.copy()
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="k_cache is read-only"):
        attention_with_kvcache(q, read_only, v_cache, k_new, v_new, cache_seqlens=0)
    assert not v_cache.any()
    # attending a read-only cache is fine
    attention_with_kvcache(q, read_only, v_cache, cache_seqlens=3)


def test_entries_sharing_a_prefix_append_to_pages_of_their_own(rng):
    # Page 0 holds both entries' first 4 keys; each appends on a page nobody else reads.
    k_cache, v_cache = (rng.standard_normal((6, 4, 2, 8)).astype(np.float32) for _ in range(2))
    q, k_new, v_new = (rng.standard_normal((2, 1, 2, 8)).astype(np.float32) for _ in range(3))
    table = np.array([[0, 1, 2], [0, 4, 5]], np.int32)
    pages = k_cache.copy()
    attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=np.array([4, 5], np.int32),
                           block_table=table)
    pages[1, 0], pages[4, 1] = k_new[0, 0], k_new[1, 0]  # positions 4 and 5
    np.testing.assert_array_equal(k_cache, pages)


def test_a_backend_that_cannot_run_writes_nothing(rng):
    _, args = error_case(rng)
    args = {n: x.astype(np.float64) if n in ("q", "k_cache", "v_cache", "k", "v") else x for n, x in args.items()}
    before = bits(args["k_cache"]).copy()
    with pytest.raises(TypeError, match="float64 inputs run on the NumPy backend only"):
        attention_with_kvcache(**args, backend="emulator")
    np.testing.assert_array_equal(bits(args["k_cache"]), before)


# ---- frameworks ----

def test_torch_caches_are_written_in_place(rng):
    torch = pytest.importorskip("torch")
    for dtype in (torch.float32, torch.bfloat16):
        lengths = np.array([4, 0], np.int32)
        cache = make_cache(rng, lengths, page_size=4, final=lengths + 2, dtype=np.float32)
        k_cache, v_cache = (torch.from_numpy(np.nan_to_num(x)).to(dtype) for x in (cache.k, cache.v))
        q, k_new, v_new = (torch.randn(*shape).to(dtype) for shape in ((2, 1, 4, 32), (2, 2, 2, 32), (2, 2, 2, 32)))
        out = attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=torch.from_numpy(lengths),
                                     block_table=torch.from_numpy(cache.table), causal=True)
        assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == (2, 1, 4, 32)
        for b, n in enumerate(lengths):
            pages, rows = cache.slot(b, np.arange(n, n + 2))
            assert torch.equal(k_cache[torch.from_numpy(pages), torch.from_numpy(rows)], k_new[b])
            assert torch.equal(v_cache[torch.from_numpy(pages), torch.from_numpy(rows)], v_new[b])


def test_torch_caches_that_cannot_take_an_append_are_refused(rng):
    """Written in place through DLPack, a cache must be its tensor's own, distinct memory: an
    expanded cache would write one row for several entries, a lazily negated one the wrong sign,
    and a cache requiring grad would change under autograd's feet."""
    torch = pytest.importorskip("torch")
    q, k_new, v_new = (torch.randn(2, 1, 1, 8) for _ in range(3))
    own = torch.zeros(2, 4, 1, 8)
    cases = [(torch.zeros(1, 4, 1, 8).expand(2, 4, 1, 8), ValueError, "k_cache has elements that share memory"),
             (torch.zeros(2, 4, 1, 8)._neg_view(), TypeError, "k_cache has its negative or conjugate bit set"),
             (torch.zeros(2, 4, 1, 8, requires_grad=True), TypeError, r"k_cache requires grad"),
             (torch.zeros(2, 4, 1, 8).to_sparse(), TypeError, "k_cache must be a dense torch tensor")]
    for k_cache, error, message in cases:
        with pytest.raises(error, match=message):
            attention_with_kvcache(q, k_cache, own, k_new, v_new, cache_seqlens=0)
        assert not own.any()
    # attending alone reads them: a lazy negation as the values it stands for, not its memory's
    keys, values = torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8)
    lazy = keys.neg()._neg_view()  # its values are keys, its memory holds -keys
    want = attention_with_kvcache(q, keys, values, cache_seqlens=4)
    assert not torch.equal(want, attention_with_kvcache(q, -keys, values, cache_seqlens=4))
    assert torch.equal(attention_with_kvcache(q, lazy, values, cache_seqlens=4), want)


def test_jax_caches_attend_but_refuse_an_append(rng):
    jnp = pytest.importorskip("jax.numpy")
    lengths = np.array([4, 9], np.int32)
    cache = make_cache(rng, lengths, page_size=4, dtype=np.float32)
    q = rng.standard_normal((2, 1, 4, 32)).astype(np.float32)
    k_cache, v_cache = jnp.asarray(cache.k), jnp.asarray(cache.v)
    out = attention_with_kvcache(jnp.asarray(q), k_cache, v_cache, cache_seqlens=jnp.asarray(lengths),
                                 block_table=jnp.asarray(cache.table))
    assert_close(np.asarray(out), reference_kvcache(q, cache, lengths)[0], np.float32)
    new = jnp.zeros((2, 1, 2, 32), np.float32)
    with pytest.raises(TypeError, match="JAX arrays, which are immutable"):
        attention_with_kvcache(jnp.asarray(q), k_cache, v_cache, new, new, cache_seqlens=jnp.asarray(lengths),
                               block_table=jnp.asarray(cache.table))


# ---- the README's example, the export, the GPU ----

def test_readme_example():
    blocks = python_blocks("KV cache")
    assert blocks
    for code in blocks:
        exec(compile(code, "README.md (KV cache)", "exec"), {})


def test_exported():
    assert cupy_attn.attention_with_kvcache is attention_with_kvcache
    assert "attention_with_kvcache" in cupy_attn.__all__


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [None, 1, 16, 48, 256], ids=lambda p: "contiguous" if p is None else f"page{p}")
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_cuda_backend(rng, dtype, page_size, num_splits):
    """On CuPy arrays: the caches written in place on the device, results against the reference."""
    cupy = pytest.importorskip("cupy")
    lengths = np.array([0, 1, 37, 1500], np.int32)
    cache = make_cache(rng, lengths, page_size=page_size, final=lengths + 2, hkv=2, d=128, dtype=dtype)
    q = rng.standard_normal((4, 2, 16, 128)).astype(dtype)
    k_new, v_new = (rng.standard_normal((4, 2, 2, 128)).astype(dtype) for _ in range(2))
    want_k, want_v = appended(cache, lengths, k_new, v_new)
    k_cache, v_cache = cupy.asarray(cache.k), cupy.asarray(cache.v)
    table = {n: cupy.asarray(x) for n, x in cache.arguments().items()}
    out, lse = attention_with_kvcache(cupy.asarray(q), k_cache, v_cache, cupy.asarray(k_new), cupy.asarray(v_new),
                                      cache_seqlens=cupy.asarray(lengths), causal=True, num_splits=num_splits,
                                      return_lse=True, **table)
    assert isinstance(out, cupy.ndarray)
    np.testing.assert_array_equal(bits(k_cache.get()), bits(want_k))
    np.testing.assert_array_equal(bits(v_cache.get()), bits(want_v))
    cache.k, cache.v = want_k, want_v
    want_out, want_lse = reference_kvcache(q, cache, lengths + 2, causal=True)
    assert_close(out.get(), want_out, dtype, what="out")
    assert_close(lse.get(), want_lse, dtype, what="lse")

