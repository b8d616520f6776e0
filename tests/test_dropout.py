"""Dropout: Philox4x32-10 against Random123's known answers and the 64-bit form against
numpy.random.Philox; the keep-mask read back bit for bit from every kernel family; outputs and
gradients of every backend against the float64 reference, which applies `dropout_mask`."""
import itertools

import numpy as np
import pytest

import cupy_attn
from cupy_attn import _kernel_backend, _numpy_backend, reference
from cupy_attn._philox import philox
from helpers import BF16, DTYPES, assert_close, check_forward_and_backward, random_qkv
from test_kernel_forward import poisoned_outputs, schedule  # noqa: F401 (fixtures)

# Random123's tests/kat_vectors, "philox4x32 10": counter, key, expected words.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_philox4x32_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox(counter, key)) == expected


def test_a_wrong_round_count_misses_the_known_answer():
    counter, key, expected = KNOWN_ANSWERS[2]
    assert tuple(int(w) for w in philox(counter, key, rounds=7)) != expected


def test_the_round_function_matches_numpy_random_philox(rng):
    """The same code at 64-bit words is NumPy's Philox4x64-10, which increments its counter before
    each block of 4 outputs."""
    for _ in range(5):
        counter = [int(x) for x in rng.integers(0, 2 ** 63, 4, dtype=np.uint64)]
        key = [int(x) for x in rng.integers(0, 2 ** 63, 2, dtype=np.uint64)]
        raw = np.random.Philox(counter=counter, key=key).random_raw(4)
        ours = philox([counter[0] + 1] + counter[1:], key, bits=64)
        assert [int(w) for w in ours] == [int(w) for w in raw]


def test_dropout_mask_follows_the_documented_counter_layout():
    b, h, i, j, heads, seed, offset, p = 1, 2, 5, 11, 3, (7 << 32) | 9, 4, 0.4
    mask = cupy_attn.dropout_mask((2, heads, 6, 13), p, seed, offset)
    word = philox((j // 4, i, b * heads + h, offset), (9, 7))[j % 4]
    assert mask[b, h, i, j] == (int(word) >= int(p * 2 ** 32))
    assert mask.dtype == np.bool_ and mask.shape == (2, heads, 6, 13)


def test_keep_rate_and_independence():
    p = 0.3
    mask = cupy_attn.dropout_mask((2, 4, 128, 256), p, seed=1234, offset=5)
    n = mask.size
    assert abs(mask.mean() - (1 - p)) < 4 * np.sqrt(p * (1 - p) / n)
    z = mask.astype(np.float64) - mask.mean()
    # Neighbours along every index (and across the seed and offset) are uncorrelated.
    pairs = [(z[..., 1:], z[..., :-1]), (z[:, :, 1:], z[:, :, :-1]), (z[:, 1:], z[:, :-1]), (z[1:], z[:1])]
    other_offset = cupy_attn.dropout_mask(mask.shape, p, seed=1234, offset=6).astype(np.float64)
    other_seed = cupy_attn.dropout_mask(mask.shape, p, seed=1235, offset=5).astype(np.float64)
    pairs += [(z, other_offset - other_offset.mean()), (z, other_seed - other_seed.mean())]
    for a, b in pairs:
        correlation = (a * b).mean() / np.sqrt((a * a).mean() * (b * b).mean())
        assert abs(correlation) < 4 / np.sqrt(a.size), correlation
    assert not (mask[..., 0::4] == mask[..., 1::4]).all()  # the 4 words of one call differ


def test_p_zero_keeps_everything_and_is_no_dropout(rng):
    assert cupy_attn.dropout_mask((1, 2, 3, 5), 0.0, 99).all()
    q, k, v = random_qkv(rng, sq=20, sk=33)
    for backend in ("numpy", "emulator"):
        plain = cupy_attn.attention(q, k, v, backend=backend)
        np.testing.assert_array_equal(cupy_attn.attention(q, k, v, dropout_p=0.0, dropout_seed=5, backend=backend), plain)


def _read_back_mask(backend, dtype, p, seed, offset, *, b=2, h=3, sq=37, sk=70):
    """The keep-mask a forward applied: with q = k = 0 every probability is 1/Sk, and v = I makes
    out[b, h, i, j] = Z_ij / ((1 − p)·Sk)."""
    q = np.zeros((b, h, sq, 8), dtype)
    k = np.zeros((b, 1, sk, 8), dtype)
    v = np.broadcast_to(np.eye(sk, dtype=dtype), (b, 1, sk, sk)).copy()
    out = cupy_attn.attention(q, k, v, dropout_p=p, dropout_seed=seed, dropout_offset=offset, backend=backend)
    kept = np.asarray(out, np.float64) * (1 - p) * sk
    assert np.all((np.abs(kept) < 1e-6) | (np.abs(kept - 1) < 1e-2))
    return kept > 0.5


@pytest.mark.parametrize("capability, dtype", [(80, np.dtype(np.float32)), (80, np.dtype(np.float16)), (80, BF16),
                                               (90, np.dtype(np.float16)), (90, BF16)],
                         ids=["fp32", "mma_sync-fp16", "mma_sync-bf16", "wgmma-fp16", "wgmma-bf16"])
def test_every_kernel_applies_the_documented_mask(monkeypatch, capability, dtype):
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", capability)
    p, seed, offset = 0.35, 2 ** 40 + 3, 17
    want = cupy_attn.dropout_mask((2, 3, 37, 70), p, seed, offset)
    np.testing.assert_array_equal(_read_back_mask("emulator", dtype, p, seed, offset), want)
    np.testing.assert_array_equal(_read_back_mask("numpy", dtype, p, seed, offset), want)


def test_the_mask_does_not_depend_on_the_numpy_tiles(monkeypatch):
    p, seed = 0.5, 77
    first = _read_back_mask("numpy", np.float32, p, seed, 0)
    monkeypatch.setattr(_numpy_backend, "BLOCK_M", 7)
    monkeypatch.setattr(_numpy_backend, "BLOCK_N", 5)
    np.testing.assert_array_equal(_read_back_mask("numpy", np.float32, p, seed, 0), first)


FEATURES = {
    "plain": {},
    "causal_lengths_gqa": dict(causal=True, q_lengths=[37, 20], kv_lengths=[50, 3]),
    "window_softcap_alibi_sinks": dict(window=(6, 1), softcap=4.0, alibi_slopes=[0.2, 0.1, 0.3, 0.05],
                                       sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32)),
    "mask_top_left": "mask",
}


def check(backend, rng, dtype, feature, *, deterministic=False, p=0.25, **shape):
    shape = dict(dict(b=2, h=4, hkv=2, sq=37, sk=50, d=32), **shape)
    q, k, v = random_qkv(rng, dtype=dtype, **shape)
    kw = FEATURES[feature]
    if kw == "mask":
        kw = dict(mask=rng.random((2, 1, shape["sq"], shape["sk"])) < 0.7, causal="top_left")
    kw = dict(kw, dropout_p=p, dropout_seed=int(rng.integers(0, 2 ** 63)), dropout_offset=int(rng.integers(0, 2 ** 31)))
    check_forward_and_backward(backend, rng, q, k, v, kw, dtype, deterministic=deterministic)


@pytest.mark.parametrize("dtype, feature", list(itertools.product(DTYPES, FEATURES)))
def test_numpy_backend(rng, dtype, feature):
    check("numpy", rng, dtype, feature)


# Every feature on the fp32 and mma.sync kernels (compute capability 8.x); the wgmma kernels (9.0)
# at both of their backward tile sizes, with atomic dQ and ("plain": test_kernels) the
# deterministic dQ kernel after, and the wgmma forward's tile of 32 keys at D = 256.
KERNEL_CASES = [(80, dtype, feature, 32) for dtype in (np.dtype(np.float32), np.dtype(np.float16), BF16)
                for feature in FEATURES] + [(90, np.dtype(np.float16), "causal_lengths_gqa", 64),
                                            (90, BF16, "window_softcap_alibi_sinks", 128),
                                            (90, np.dtype(np.float16), "plain", 64),
                                            (90, BF16, "plain", 128),
                                            (90, np.dtype(np.float16), "mask_top_left", 256)]


@pytest.mark.parametrize("capability, dtype, feature, d", KERNEL_CASES)
def test_kernels(rng, schedule, monkeypatch, capability, dtype, feature, d):
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", capability)
    check("emulator", rng, dtype, feature, deterministic=feature == "plain", d=d)


@pytest.mark.parametrize("d, dv", [(1, 1), (7, 20), (256, 256)])
def test_awkward_head_dims_on_the_kernels(rng, d, dv):
    check("emulator", rng, np.dtype(np.float16), "plain", d=d, dv=dv, sq=9, sk=21, deterministic=True, p=0.6)


def test_bshd_layout_indexes_the_mask_by_head(rng):
    q, k, v = random_qkv(rng, b=1, h=3, sq=6, sk=10, d=8, layout="bshd")
    kw = dict(dropout_p=0.5, dropout_seed=3)
    out = cupy_attn.attention(q, k, v, layout="bshd", **kw)
    want, _ = reference.attention(q, k, v, layout="bshd", **kw)
    assert_close(out, want, np.float32)
    assert not np.allclose(out, cupy_attn.attention(q, k, v, layout="bshd"))


def test_backward_with_another_seed_is_not_the_gradient(rng):
    """The backward regenerates the mask from its own arguments: a different seed (a caller bug)
    gives a different, wrong gradient, which the test would catch."""
    q, k, v = random_qkv(rng, sq=12, sk=16)
    out, lse = cupy_attn.attention(q, k, v, return_lse=True, dropout_p=0.3, dropout_seed=1)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    right = cupy_attn.attention_backward(dout, q, k, v, out, lse, dropout_p=0.3, dropout_seed=1)
    wrong = cupy_attn.attention_backward(dout, q, k, v, out, lse, dropout_p=0.3, dropout_seed=2)
    assert not np.allclose(right[2], wrong[2])


@pytest.mark.parametrize("keywords, error, match", [
    (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p must be in"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p must be a real number"),
    (dict(dropout_p=float("nan")), ValueError, "dropout_p must be in"),
    (dict(dropout_p=0.1, dropout_seed=1.5), TypeError, "dropout_seed must be an int, got float"),
    (dict(dropout_p=0.1, dropout_seed=True), TypeError, "dropout_seed must be an int"),
    (dict(dropout_p=0.1, dropout_seed=-1), ValueError, r"dropout_seed must be in \[0, 2\*\*64\)"),
    (dict(dropout_p=0.1, dropout_seed=2 ** 64), ValueError, "dropout_seed must be in"),
    (dict(dropout_p=0.1, dropout_offset=2 ** 32), ValueError, r"dropout_offset must be in \[0, 2\*\*32\)"),
    (dict(dropout_p=0.1, dropout_offset=None), TypeError, "dropout_offset must be an int"),
])
def test_bad_dropout_arguments(rng, keywords, error, match):
    q, k, v = random_qkv(rng)
    with pytest.raises(error, match=match):
        cupy_attn.attention(q, k, v, **keywords)
    out = np.zeros((2, 2, 7, 16), np.float32)
    with pytest.raises(error, match=match):
        cupy_attn.attention_backward(out, q, k, v, out, np.zeros((2, 2, 7), np.float32), **keywords)


def test_dropout_mask_rejects_bad_shapes():
    for shape in [(2, 3, 4), (1, 2, 3, -1), (1, 2, 3, 4.0), "abcd"]:
        with pytest.raises(ValueError, match="shape must be 4 non-negative ints"):
            cupy_attn.dropout_mask(shape, 0.1, 0)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        cupy_attn.dropout_mask((1, 1, 1, 1), 1.5, 0)


@pytest.mark.parametrize("shape", [(0, 2, 3, 4), (1, 0, 3, 4), (1, 2, 0, 4), (1, 2, 3, 0)])
def test_dropout_with_an_empty_axis(rng, shape):
    b, h, sq, sk = shape
    assert cupy_attn.dropout_mask(shape, 0.5, 1).shape == shape
    q = rng.standard_normal((b, h, sq, 8)).astype(np.float32)
    k, v = (rng.standard_normal((b, max(h, 1), sk, 8)).astype(np.float32) for _ in range(2))  # H = 0: Hkv = 1
    out, lse = cupy_attn.attention(q, k, v, dropout_p=0.1, return_lse=True)
    grads = cupy_attn.attention_backward(np.ones_like(out), q, k, v, out, lse, dropout_p=0.1)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert not out.size or not out.any()  # Sk = 0: every row attends nothing
    assert cupy_attn.reference.attention(q, k, v, dropout_p=0.1)[0].shape == out.shape
