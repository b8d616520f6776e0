"""score_mod and mask_mod (cupy_attn.mods): the C snippets compiled into every kernel family and
the NumPy twins, forward and backward, against the float64 reference (whose mods run the twins on
the dense problem) and against the same attention with an explicit dense mask or bias."""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import _compile, _config, _kernel_backend, reference
from cupy_attn.mods import ModCompileError
from helpers import BF16, assert_close, check_forward_and_backward, random_qkv
from test_kernel_forward import poisoned_outputs, schedule  # noqa: F401 (fixtures)

B, H, HKV, SQ, SK = 2, 4, 2, 37, 50


def document_mask(rng):
    doc = np.sort(rng.integers(0, 5, (B, SK)), axis=1).astype(np.int32)
    mod = cupy_attn.MaskMod("doc(b, q_idx) == doc(b, kv_idx)",
                            lambda b, h, q_idx, kv_idx, doc: doc[b, q_idx] == doc[b, kv_idx], tensors={"doc": doc})
    return mod, doc[:, None, :SQ, None] == doc[:, None, None, :]


def head_bias(rng):
    """An additive bias read from a (H, Sq, Sk) float16 table through a transposed view."""
    table = rng.standard_normal((H, SK, SQ)).astype(np.float16).transpose(0, 2, 1)
    mod = cupy_attn.ScoreMod("score + bias(h, q_idx, kv_idx)",
                             lambda s, b, h, q_idx, kv_idx, bias: s + bias[h, q_idx, kv_idx].astype(np.float32),
                             tensors={"bias": table}, grad="additive")
    return mod, table.astype(np.float32)[None]


def scaled_tanh(rng):
    """A non-additive score_mod, with its derivative in C; no dense equivalent."""
    mod = cupy_attn.ScoreMod("scale * tanhf(score / 3.0f) + shift",
                             lambda s, b, h, q_idx, kv_idx, scale, shift: scale * np.tanh(s / 3.0) + shift,
                             scalars={"scale": 2.5, "shift": -1}, grad="scale / 3.0 * (1.0f - tanhf(score / 3.0f) * tanhf(score / 3.0f))")
    return mod, None


MODS = {"document_mask": document_mask, "head_bias": head_bias, "scaled_tanh": scaled_tanh}


def keywords(rng, name):
    mod, _ = MODS[name](rng)
    return {"mask_mod" if isinstance(mod, cupy_attn.MaskMod) else "score_mod": mod}


@pytest.mark.parametrize("name", ["document_mask", "head_bias"])  # scaled_tanh has no dense equivalent
@pytest.mark.parametrize("backend", ["numpy", "emulator"])
def test_mods_equal_their_dense_equivalent(rng, name, backend):
    mod, dense = MODS[name](rng)
    q, k, v = random_qkv(rng, b=B, h=H, hkv=HKV, sq=SQ, sk=SK, d=32)
    kw = {"mask_mod" if isinstance(mod, cupy_attn.MaskMod) else "score_mod": mod}
    got = cupy_attn.attention(q, k, v, causal=True, backend=backend, **kw)
    want, _ = reference.attention(q, k, v, causal=True, mask=dense)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


CASES = [(80, dtype, name) for dtype in (np.dtype(np.float32), np.dtype(np.float16), BF16) for name in MODS] + \
    [(90, np.dtype(np.float16), "head_bias"), (90, BF16, "scaled_tanh")]


@pytest.mark.parametrize("capability, dtype, name", CASES)
def test_kernels(rng, schedule, monkeypatch, capability, dtype, name):
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", capability)
    q, k, v = random_qkv(rng, b=B, h=H, hkv=HKV, sq=SQ, sk=SK, d=64 if capability == 90 else 32, dtype=dtype)
    kw = dict(keywords(rng, name), causal="top_left", kv_lengths=[50, 29], softcap=6.0)
    check_forward_and_backward("emulator", rng, q, k, v, kw, dtype, deterministic=name == "scaled_tanh")


@pytest.mark.parametrize("dtype", [np.dtype(np.float64), np.dtype(np.float32)], ids=str)
def test_numpy_backend_with_every_other_feature(rng, dtype):
    q, k, v = random_qkv(rng, b=B, h=H, hkv=HKV, sq=SQ, sk=SK, d=16, dtype=dtype, layout="bshd")
    mask, _ = document_mask(rng)
    score, _ = scaled_tanh(rng)
    kw = dict(layout="bshd", mask_mod=mask, score_mod=score, window=(9, 3), alibi_slopes=[0.1, 0.2, 0.3, 0.4],
              sinks=np.array([0.0, 1.0, -1.0, 0.5], dtype), mask=rng.standard_normal((SQ, SK)).astype(dtype),
              dropout_p=0.1, dropout_seed=5)
    check_forward_and_backward("numpy", rng, q, k, v, kw, dtype)


def test_both_mods_and_every_feature_on_the_kernels(rng):
    q, k, v = random_qkv(rng, b=B, h=H, hkv=HKV, sq=SQ, sk=SK, d=16, dtype=np.float16)
    mask, _ = document_mask(rng)
    score, _ = head_bias(rng)
    kw = dict(mask_mod=mask, score_mod=score, window=(9, 3), alibi_slopes=[0.1, 0.2, 0.3, 0.4],
              sinks=np.array([0.0, 1.0, -1.0, 0.5], np.float32), mask=rng.random((SQ, SK)) < 0.9,
              dropout_p=0.1, dropout_seed=5)
    check_forward_and_backward("emulator", rng, q, k, v, kw, np.dtype(np.float16), deterministic=True)


def test_a_module_is_reused_for_new_tensor_contents_and_scalars(rng, monkeypatch):
    q, k, v = random_qkv(rng, b=1, h=2, sq=8, sk=8, d=16)
    built = []
    real = _compile.function
    monkeypatch.setattr(_compile, "function", lambda *a, **kw: built.append(kw.get("mods")) or real(*a, **kw))
    for shift, weight in ((1.0, 0.5), (3.0, 2.0)):
        mod = cupy_attn.ScoreMod("score * shift * w(h)", lambda s, b, h, q_idx, kv_idx, shift, w: s * shift * w[h],
                                 tensors={"w": np.full(2, weight, np.float32)}, scalars={"shift": shift}, grad="shift * w(h)")
        out = cupy_attn.attention(q, k, v, score_mod=mod, backend="emulator")
        want = cupy_attn.attention(q, k, v, scale=0.25 * shift * weight)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert len(built) == 2 and built[0] == built[1] and built[0] is not None


def test_the_backward_needs_a_derivative(rng):
    q, k, v = random_qkv(rng)
    mod = cupy_attn.ScoreMod("score * 2.0f", lambda s, b, h, q_idx, kv_idx: s * 2)
    out, lse = cupy_attn.attention(q, k, v, score_mod=mod, return_lse=True)
    with pytest.raises(ValueError, match="the backward needs the score_mod's derivative: build it with grad="):
        cupy_attn.attention_backward(out, q, k, v, out, lse, score_mod=mod)


def test_a_snippet_that_does_not_compile_shows_the_message_and_the_snippet(rng):
    q, k, v = random_qkv(rng, b=1, h=1, sq=4, sk=4, d=8)
    mod = cupy_attn.MaskMod("q_idx >= 0 &&\n  undefined_name(kv_idx)", lambda b, h, q_idx, kv_idx: q_idx >= 0)
    with pytest.raises(ModCompileError, match=r"(?s)undefined_name.*mask_mod   2 \|   undefined_name\(kv_idx\)"):
        cupy_attn.attention(q, k, v, mask_mod=mod, backend="emulator")


@pytest.mark.parametrize("make, error, match", [
    (lambda: cupy_attn.ScoreMod(3, lambda *a: a[0]), TypeError, "cuda must be a non-empty string"),
    (lambda: cupy_attn.ScoreMod("score", "np.tanh"), TypeError, "numpy must be a callable"),
    (lambda: cupy_attn.ScoreMod("score", abs, grad=1), TypeError, "grad must be None, 'additive' or a C expression"),
    (lambda: cupy_attn.MaskMod("true", abs, tensors={"q_idx": np.zeros(2)}), ValueError, "tensor name 'q_idx' is taken"),
    (lambda: cupy_attn.MaskMod("true", abs, tensors={"2x": np.zeros(2)}), ValueError, "tensor names must be identifiers"),
    (lambda: cupy_attn.MaskMod("true", abs, scalars={"float": 1.0}), ValueError, "neither Python nor C\\+\\+ keywords"),
    # an operator word or `defined` as a macro name failed only when a kernel compiled
    (lambda: cupy_attn.MaskMod("true", abs, scalars={"bitand": 1.0}), ValueError, "neither Python nor C\\+\\+ keywords"),
    (lambda: cupy_attn.MaskMod("true", abs, tensors={"defined": np.zeros(2)}), ValueError, "tensor names must be"),
    (lambda: cupy_attn.MaskMod("true", abs, tensors={"t": [1, 2]}), TypeError, "tensor 't' must be a NumPy or CuPy array"),
    (lambda: cupy_attn.MaskMod("true", abs, tensors={"t": np.zeros(2, np.int64)}), TypeError, "tensor 't' must have one of"),
    (lambda: cupy_attn.MaskMod("true", abs, scalars={"s": "x"}), TypeError, "scalar 's' must be a bool, int or float"),
    (lambda: cupy_attn.MaskMod("true", abs, scalars={"attn_x": 1}), ValueError, "scalar name 'attn_x' is taken"),
    (lambda: cupy_attn.MaskMod("true", abs, tensors={"x": np.zeros(1, np.int32)}, scalars={"x": 1}), ValueError,
     r"\['x'\] named both as a tensor and as a scalar"),
    (lambda: cupy_attn.MaskMod("true", abs, tensors={"t": np.zeros(3, [("x", np.int32), ("pad", np.uint8)])["x"]}),
     ValueError, r"tensor 't' has byte strides \(5,\) that are not whole 4-byte elements"),
])
def test_bad_mods(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_mods_of_the_wrong_kind_are_refused(rng):
    q, k, v = random_qkv(rng)
    mask = cupy_attn.MaskMod("true", lambda b, h, q_idx, kv_idx: True)
    with pytest.raises(TypeError, match="score_mod must be a cupy_attn.ScoreMod, got cupy_attn.mods.MaskMod"):
        cupy_attn.attention(q, k, v, score_mod=mask)
    with pytest.raises(TypeError, match="mask_mod must be a cupy_attn.MaskMod"):
        cupy_attn.attention(q, k, v, mask_mod="j <= i")


SCORE, MASK = cupy_attn.ScoreMod, cupy_attn.MaskMod
BAD_TWINS = [
    # (a mod whose NumPy twin misbehaves, the error, its message)
    (SCORE("score", lambda s, b, h, q_idx, kv_idx: None), TypeError, "must return a numpy array, got NoneType"),
    (SCORE("score", lambda s, b, h, q_idx, kv_idx: s * np.nan), ValueError, "returned NaN, \\+inf or a value past"),
    (SCORE("score", lambda s, b, h, q_idx, kv_idx: np.where(q_idx == kv_idx, np.inf, s)), ValueError, "NaN, \\+inf"),
    # finite in float64, inf in the float32 the scores of float32 inputs are computed in
    (SCORE("score", lambda s, b, h, q_idx, kv_idx: s + np.float64(1e39)), ValueError, "past 1.701e\\+38 \\(the scores' range in base 2, in float32\\)"),
    (SCORE("score", lambda s, b, h, q_idx, kv_idx: s > 0), TypeError, "must return real numbers .* got dtype bool"),
    (SCORE("score", lambda s, b, h, q_idx, kv_idx: s + 0j), TypeError, "must return real numbers .* got dtype complex"),
    (SCORE("score", lambda s, b, h, q_idx, kv_idx: np.ones(3)), ValueError, "returned shape \\(3,\\), which does not broadcast"),
    (SCORE("score", lambda s, b, h, q_idx, kv_idx: [][1]), ValueError, "raised IndexError: list index out of range"),
    (MASK("true", lambda b, h, q_idx, kv_idx: None), TypeError, "mask_mod's numpy twin MaskMod\\('true'\\) must return a numpy"),
    (MASK("true", lambda b, h, q_idx, kv_idx: kv_idx * 1.0), TypeError, "must return bools .* got dtype float64"),
    (MASK("true", lambda b, h, q_idx, kv_idx: np.ones((2, 2), bool)), ValueError, "which does not broadcast"),
]


@pytest.mark.parametrize("mod, error, match", BAD_TWINS, ids=range(len(BAD_TWINS)))
def test_a_twin_that_misbehaves_is_an_error_naming_the_mod(rng, mod, error, match):
    """Never scores made of what a twin returned wrong: NaN, None read as False, bools read as 0/1."""
    q, k, v = random_qkv(rng, b=1, h=2, sq=5, sk=7, d=8)
    keyword = {"score_mod" if isinstance(mod, SCORE) else "mask_mod": mod}
    for run in (cupy_attn.attention, cupy_attn.reference.attention):
        with pytest.raises(error, match=match):
            run(q, k, v, **keyword)
    if isinstance(mod, MASK):
        with pytest.raises(error, match=match):
            cupy_attn.block_mask(mod, 1, 2, 5, 7).tiles(4, 4)  # the block mask evaluates the twin itself


def test_what_a_twin_returns_for_pairs_that_cannot_attend_is_not_checked(rng):
    """A mod defined only where a pair may attend (log(1 + i - j) under causal), and NaN inputs past
    kv_lengths, give what the same scores give without the check."""
    q, k, v = random_qkv(rng, b=1, h=2, sq=6, sk=6, d=8)
    decay = SCORE("score - log1pf((float)(q_idx - kv_idx))", lambda s, b, h, q_idx, kv_idx: s - np.log1p(q_idx - kv_idx),
                  grad="additive")
    with np.errstate(divide="ignore", invalid="ignore"):
        out, lse = cupy_attn.attention(q, k, v, causal=True, score_mod=decay, return_lse=True)
        want, _ = cupy_attn.reference.attention(q, k, v, causal=True, score_mod=decay)
        grads = cupy_attn.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True, score_mod=decay)
    assert_close(out, want, np.dtype(np.float32))
    assert all(np.isfinite(g).all() for g in grads)
    k[:, :, 4:] = np.nan  # padding
    bias = SCORE("score + 0.1f * kv_idx", lambda s, b, h, q_idx, kv_idx: s + 0.1 * kv_idx, grad="additive")
    assert np.isfinite(cupy_attn.attention(q, k, v, kv_lengths=[4], score_mod=bias)).all()
    # NaN scores from NaN inputs are the inputs' doing: NaN out, as without a mod, not an error blaming it
    k[:, :, 0] = np.nan
    assert np.isnan(cupy_attn.attention(q, k, v, kv_lengths=[4], score_mod=bias)).all()
    # and so are scores out of range before the mod (one of 3e38): an identity mod changes nothing
    q, k, v = random_qkv(rng, b=1, h=1, sq=2, sk=2, d=8)
    q[0, 0, 0] = k[0, 0, 0] = np.sqrt(3e38 / 8)
    same = SCORE("score", lambda s, b, h, q_idx, kv_idx: s, grad="additive")
    np.testing.assert_array_equal(cupy_attn.attention(q, k, v, scale=1.0, score_mod=same),
                                  cupy_attn.attention(q, k, v, scale=1.0))


def test_twins_may_return_scalars_and_minus_infinity(rng):
    q, k, v = random_qkv(rng, b=1, h=2, sq=5, sk=7, d=8)
    everyone = cupy_attn.attention(q, k, v, mask_mod=MASK("true", lambda b, h, q_idx, kv_idx: True))
    np.testing.assert_array_equal(everyone, cupy_attn.attention(q, k, v))
    flat = cupy_attn.attention(q, k, v, score_mod=SCORE("0.0f", lambda s, b, h, q_idx, kv_idx: 0.0))
    np.testing.assert_allclose(flat, np.broadcast_to(v.mean(axis=2, keepdims=True), flat.shape), rtol=1e-6)
    table = rng.standard_normal((2, 5, 7)).astype(BF16)  # a bfloat16 tensor read as the scores
    read = SCORE("table(h, q_idx, kv_idx)", lambda s, b, h, q_idx, kv_idx, table: table[h, q_idx, kv_idx],
                 tensors={"table": table})
    biased = cupy_attn.attention(q, k, v, score_mod=read)
    np.testing.assert_allclose(biased, cupy_attn.reference.attention(q, k, v, score_mod=read)[0], rtol=1e-5, atol=1e-6)


def test_a_twin_sees_a_tile_as_the_reference_sees_the_problem(rng):
    """The NumPy backend calls a twin per tile with score (B, H, m, n) and index arrays that
    broadcast to it, as the reference calls it with the whole (B, H, Sq, Sk): a twin written for
    one runs in the other (GQA: query heads h, not kv heads), forward and backward."""
    q, k, v = random_qkv(rng, b=B, h=H, hkv=HKV, sq=SQ, sk=SK, d=8)
    seen = []

    def shapes(*arrays):
        seen.append(np.broadcast_shapes(*(a.shape for a in arrays)))

    score_mod = SCORE("score * (1.0f + 0.1f * h)", lambda s, b, h, q_idx, kv_idx: shapes(s, b, h, q_idx, kv_idx)
                      or s * (1 + 0.1 * h), grad="1.0f + 0.1f * h")
    mask_mod = MASK("kv_idx <= q_idx + 5 * h", lambda b, h, q_idx, kv_idx: shapes(b, h, q_idx, kv_idx)
                    or kv_idx <= q_idx + 5 * h)
    kw = dict(score_mod=score_mod, mask_mod=mask_mod)
    check_forward_and_backward("numpy", rng, q, k, v, kw, np.dtype(np.float32))
    assert seen and all(len(s) == 4 and s[:2] == (B, H) for s in seen), set(seen)


def test_mods_compile_under_nvrtc_for_the_gpu_without_spills(rng):
    """What a GPU build compiles (NVRTC, CuPy's options): every kind of tensor and scalar a snippet
    can read, in the tensor-core forward and dK/dV kernels, with a block mask and without (its
    walk counts the tiles it visits), without spills."""
    from cupy_attn import _config, _mods_source, _nvrtc

    tensors = {"half_t": np.zeros((2, 3), np.float16), "bf_t": np.zeros(4, BF16), "int_t": np.zeros((1, 2, 3), np.int32),
               "bool_t": np.zeros(5, bool), "float_t": np.zeros(2, np.float32)}
    score = cupy_attn.ScoreMod("score * ratio + half_t(b, h) + bf_t(q_idx) + float_t(h) + (flag ? 1.0f : 0.0f)",
                               abs, tensors=tensors, scalars={"ratio": 0.5, "flag": True}, grad="ratio")
    mask = cupy_attn.MaskMod("bool_t(kv_idx) || int_t(0, b, h) < limit", abs, tensors=tensors, scalars={"limit": 3})
    for source in (_mods_source.mod_source(score, mask), _mods_source.mod_source(score, mask, True)):
        for filename, name in (("attention_fwd_tc.cu", _config.TENSOR_CORE_TILES[1].name_expression(np.float16)),
                               ("attention_bwd_tc.cu", _config.TENSOR_CORE_BACKWARD_TILES[1].name_expression(np.float16))):
            c = _nvrtc.compile_kernel(_compile.kernel_source(filename) + source.code, name, "sm_80",
                                      _compile.gpu_build_options(filename) + source.options)
            assert c.spill_stores == c.spill_loads == 0 and "mods" not in c.log, (name, source.options, c.log)


def test_precompile_builds_what_the_calls_then_use(rng):
    q, k, v = random_qkv(rng, b=1, h=2, sq=5, sk=9, d=48, dtype=np.float16)
    mask, _ = document_mask(rng)
    kw = dict(causal=True, mask_mod=mask, dropout_p=0.2, dropout_seed=1, backend="emulator")
    built = cupy_attn.precompile(q[:, :, :2], k[:, :, :3], v[:, :, :3], deterministic=True, **kw)
    assert any(n.startswith("attention_fwd_tc<__half, 64,") for n in built)
    assert any(n.startswith("attention_bwd_dq_tc") for n in built) and any("preprocess" in n for n in built)
    misses = _compile._function.cache_info().misses
    out, lse = cupy_attn.attention(q, k, v, return_lse=True, **kw)
    cupy_attn.attention_backward(out, q, k, v, out, lse, deterministic=True, **kw)
    assert _compile._function.cache_info().misses == misses  # nothing left to build
    assert cupy_attn.precompile(q, k, v, causal=True) == []  # the NumPy backend compiles nothing


def test_score_mod_derivative_only_where_a_pair_counts(rng):
    """The kernels evaluate grad only for pairs with a probability: padding rows read no tensor
    element past q_len (here NaN just past the view's end), so every gradient stays finite."""
    base = np.full((2, 64), np.nan, np.float32)
    base[:, :5] = rng.random((2, 5)) + 0.5
    w = base[:, :5]
    mod = cupy_attn.ScoreMod("score * w(h, q_idx)", lambda s, b, h, q_idx, kv_idx, w: s * w[h, q_idx],
                             tensors={"w": w}, grad="w(h, q_idx)")
    q, k, v = random_qkv(rng, b=1, h=2, sq=5, sk=7, d=16)
    for backend in ("numpy", "emulator"):
        check_forward_and_backward(backend, rng, q, k, v, dict(score_mod=mod), np.dtype(np.float32))


def test_a_score_mod_that_masks_with_minus_infinity(rng):
    """A score_mod may mask (FlexAttention's idiom): those pairs get no probability and no
    gradient on every backend, never NaN."""
    mod = cupy_attn.ScoreMod("kv_idx <= q_idx ? score : -INFINITY",
                             lambda s, b, h, q_idx, kv_idx: np.where(kv_idx <= q_idx, s, -np.inf),
                             grad="kv_idx <= q_idx ? 1.0f : 0.0f")
    q, k, v = random_qkv(rng, b=1, h=2, sq=9, sk=9, d=16)
    want = cupy_attn.attention(q, k, v, causal=True)
    for backend in ("numpy", "emulator"):
        np.testing.assert_allclose(cupy_attn.attention(q, k, v, score_mod=mod, backend=backend), want, rtol=1e-5, atol=1e-6)
        check_forward_and_backward(backend, rng, q, k, v, dict(score_mod=mod), np.dtype(np.float32))


def documents(rng, batch, seq, longest):
    """(batch, seq) int32 ids of consecutive documents of random lengths up to ``longest``."""
    ids = np.empty((batch, seq), np.int32)
    for b in range(batch):
        at, doc = 0, 0
        while at < seq:
            n = int(rng.integers(1, longest + 1))
            ids[b, at:at + n], at, doc = doc, at + n, doc + 1
    return ids


def test_block_mask_tables_match_a_brute_force_count(rng):
    doc = documents(rng, 2, 200, 40)
    # Documents, causal in odd heads, and five global keys: rows of tiles with gaps.
    mod = cupy_attn.MaskMod("doc(b, q_idx) == doc(b, kv_idx) && (h % 2 == 0 || kv_idx <= q_idx) || kv_idx < 5",
                            lambda b, h, q_idx, kv_idx, doc:
                            (doc[b, q_idx] == doc[b, kv_idx]) & ((h % 2 == 0) | (kv_idx <= q_idx)) | (kv_idx < 5),
                            tensors={"doc": doc})
    blocks = cupy_attn.block_mask(mod, 2, 3, 150, 200)
    assert cupy_attn.block_mask(mod, 2, 3, 150, 200) is blocks  # cached by mask_mod and shape
    i, j = np.arange(150)[:, None], np.arange(200)
    dense = (doc[:, None, :150, None] == doc[:, None, None, :]) & ((np.arange(3)[:, None, None] % 2 == 0) | (j <= i)) \
        | (j < 5)
    gaps = 0  # rows of tiles with empty tiles between non-empty ones
    for bm, bn in ((64, 64), (16, 48)):
        kv, q, full = blocks.kernel_tables(bm, bn)
        mt, nt = -(-150 // bm), -(-200 // bn)
        tiles = np.zeros((2, 3, mt * bm, nt * bn), bool)
        tiles[:, :, :150, :200] = dense
        everywhere = np.ones_like(tiles)  # pairs outside (Sq, Sk) do not stop a tile from being full
        everywhere[:, :, :150, :200] = dense
        np.testing.assert_array_equal(full.reshape(2, 3, mt, nt), everywhere.reshape(2, 3, mt, bm, nt, bn).all(axis=(3, 5)))
        tiles = tiles.reshape(2, 3, mt, bm, nt, bn).any(axis=(3, 5))
        gaps += sum(np.ptp(np.flatnonzero(r)) + 1 > r.sum() for r in tiles.reshape(-1, nt) if r.any())
        for table, t in ((kv.reshape(2, 3, mt, nt), tiles), (q.reshape(2, 3, nt, mt), tiles.swapaxes(2, 3))):
            for index in np.ndindex(t.shape):
                hit = np.flatnonzero(t[index[:3]][index[3]:])
                assert table[index] == (index[3] + hit[0] if hit.size else t.shape[3]), (bm, bn, index)
    assert gaps > 0


@pytest.mark.parametrize("capability, dtype", [(80, np.dtype(np.float32)), (80, np.dtype(np.float16)), (90, BF16)])
def test_block_mask_changes_which_tiles_run_not_the_result(rng, schedule, monkeypatch, capability, dtype):
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", capability)
    """150 tokens in documents of 70, 10, 70 and 20, 130 tokens: of 3 x 3 tiles of 64, some empty
    (skipped), some full (no mask_mod evaluated), the rest partial (the NumPy backend's 40 x 48
    tiles likewise)."""
    doc = np.stack([np.repeat([0, 1, 2], [70, 10, 70]), np.repeat([0, 1], [20, 130])]).astype(np.int32)
    mod = cupy_attn.MaskMod("doc(b, q_idx) == doc(b, kv_idx)",
                            lambda b, h, q_idx, kv_idx, doc: doc[b, q_idx] == doc[b, kv_idx], tensors={"doc": doc})
    q, k, v = random_qkv(rng, b=B, h=H, hkv=HKV, sq=150, sk=150, d=64, dtype=dtype)
    blocks = cupy_attn.block_mask(mod, B, H, 150, 150)
    nonempty, full = blocks.tiles(64, 64)
    assert not nonempty.all() and full.any()  # tiles skipped, and tiles computed without the mask_mod
    for backend in ("numpy", "emulator"):
        kw = dict(causal=True, kv_lengths=[150, 97], block_mask=blocks)
        check_forward_and_backward(backend, rng, q, k, v, kw, dtype, deterministic=capability == 80)


@pytest.mark.parametrize("capability, dtype", [(80, np.dtype(np.float32)), (80, np.dtype(np.float16)), (90, BF16)])
def test_a_block_mask_steps_over_gaps(rng, schedule, monkeypatch, capability, dtype):
    """Documents with 8 global keys and 8 global queries (Longformer's pattern), 300 tokens: the
    last document's query tiles need key tile 0 and their own, not those between, and its key
    tiles query tile 0 and their own, at every family's tiles (up to 128 x 128); the kernels step
    over the gaps, and the result is the reference's."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", capability)
    doc = np.stack([np.repeat([0, 1, 2], [128, 128, 44]), np.repeat([0, 1], [20, 280])]).astype(np.int32)
    mod = cupy_attn.MaskMod("doc(b, q_idx) == doc(b, kv_idx) || q_idx < 8 || kv_idx < 8",
                            lambda b, h, q_idx, kv_idx, doc: (doc[b, q_idx] == doc[b, kv_idx]) | (q_idx < 8) | (kv_idx < 8),
                            tensors={"doc": doc})
    q, k, v = random_qkv(rng, b=2, h=2, hkv=1, sq=300, sk=300, d=64, dtype=dtype)
    blocks = cupy_attn.block_mask(mod, 2, 2, 300, 300)
    for bm, bn in ((128, 128), (64, 64)):  # the wgmma and mma.sync tiles
        nonempty = blocks.tiles(bm, bn)[0][0, 0]
        assert nonempty[-1].tolist() == [True] + [False] * (nonempty.shape[1] - 2) + [True]  # a gap each way
        assert nonempty[:, -1].tolist() == [True] + [False] * (nonempty.shape[0] - 2) + [True]
    for backend in ("numpy", "emulator"):
        kw = dict(kv_lengths=[300, 217], block_mask=blocks)
        check_forward_and_backward(backend, rng, q, k, v, kw, dtype, deterministic=capability == 80)


@pytest.mark.parametrize("kw", [dict(causal=True, kv_lengths=[100]), dict(window=(16, 0), q_lengths=[100])],
                         ids=["causal_short_keys", "window_short_queries"])
@pytest.mark.parametrize("capability, dtype", [(80, np.dtype(np.float32)), (80, np.dtype(np.float16)), (90, BF16)])
def test_a_block_mask_where_the_structure_leaves_tiles_nothing(rng, monkeypatch, capability, dtype, kw):
    """Key tiles of padding under causal, query tiles of padding under a window: the structure
    leaves them no partner, and their range of tiles can start a tile past the tensor's last; the
    walks stay inside the block mask's tables (before, they read another row's entries there, and
    could visit excluded tiles in a cycle that never ended)."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", capability)
    mod = cupy_attn.MaskMod("kv_idx < 128", lambda b, h, q_idx, kv_idx: kv_idx < 128)
    q, k, v = random_qkv(rng, b=1, h=2, hkv=1, sq=256, sk=256, d=64, dtype=dtype)
    kw = dict(kw, block_mask=cupy_attn.block_mask(mod, 1, 2, 256, 256))
    check_forward_and_backward("emulator", rng, q, k, v, kw, dtype, deterministic=capability == 80)


def test_a_block_mask_skips_the_empty_tiles(rng):
    """Documents of 32 tokens in 256, with 8 global keys (forward) or 8 global queries (backward):
    with the block mask, each query tile reads K and V of the key tiles of 64 its documents span
    and of key tile 0, and each key block reads Q and dO of its documents' query tiles and of
    query tile 0, stepping over the tiles between; without it, of every tile (the emulator's counters of
    the global sectors the mma.sync kernels stage)."""
    from cupy_attn.emulator._counters import counting

    forward_tile, backward_tile = _config.forward_tile(64, 64, np.float16), _config.backward_tile(64, 64, np.float16)
    assert forward_tile.block_n == 64 and forward_tile.block_m in (64, 128)
    assert backward_tile.block_m == 64 and backward_tile.block_n in (64, 128)
    # Key tiles of 64 each query tile needs: 0 and those of its rows (e.g. {0, 1}, {0, 2, 3} for 128 rows),
    # and query tiles of 64 each key block needs: 0 and those of its keys.
    rows, keys = forward_tile.block_m, backward_tile.block_n
    needed_by_query_tiles = sum(len({0} | set(range(t * rows // 64, (t + 1) * rows // 64))) for t in range(256 // rows))
    needed_by_key_blocks = sum(len({0} | set(range(t * keys // 64, (t + 1) * keys // 64))) for t in range(256 // keys))
    tile_sectors = 64 * 64 * 2 // 32  # one tile of 64 rows, D = 64, fp16
    doc = np.repeat(np.arange(8, dtype=np.int32), 32)[None]
    same_doc = "doc(0, q_idx) == doc(0, kv_idx)"
    global_keys = cupy_attn.MaskMod(same_doc + " || kv_idx < 8", lambda b, h, q_idx, kv_idx, doc:
                                    (doc[0, q_idx] == doc[0, kv_idx]) | (kv_idx < 8), tensors={"doc": doc})
    global_queries = cupy_attn.MaskMod(same_doc + " || q_idx < 8", lambda b, h, q_idx, kv_idx, doc:
                                       (doc[0, q_idx] == doc[0, kv_idx]) | (q_idx < 8), tensors={"doc": doc})
    q, k, v = random_qkv(rng, b=1, h=1, sq=256, sk=256, d=64, dtype=np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    out, lse = cupy_attn.attention(q, k, v, mask_mod=global_queries, return_lse=True)

    def forward(**kw):
        return [cupy_attn.attention(q, k, v, mask_mod=global_keys, **kw)]

    def backward(**kw):
        return cupy_attn.attention_backward(dout, q, k, v, out, lse, mask_mod=global_queries, deterministic=False, **kw)

    # (pass, its mask_mod, the block's own tiles of 64 rows read (Q; K and V), the tiles of 64 rows
    # walked without the block mask and with it, 2 matrices each)
    for run, mod, own, walked in ((forward, global_keys, 4, (4 * (256 // rows), needed_by_query_tiles)),
                                  (backward, global_queries, 8, (4 * (256 // keys), needed_by_key_blocks))):
        counts = []
        for blocks in (None, cupy_attn.block_mask(mod, 1, 1, 256, 256)):
            with counting() as counters:
                result = run(block_mask=blocks, backend="emulator")
            counts.append(sum(s.actual for s in counters.sites if s.space == "global" and s.site.startswith("tc_tile.cuh")))
            for got, want in zip(result, run()):
                np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
        assert counts == [(own + 2 * n) * tile_sectors for n in walked], (counts, walked)


def test_bad_block_masks(rng):
    q, k, v = random_qkv(rng, b=1, h=2, sq=8, sk=8, d=16)
    mod = cupy_attn.MaskMod("kv_idx <= q_idx", lambda b, h, q_idx, kv_idx: kv_idx <= q_idx)
    other = cupy_attn.MaskMod("kv_idx <= q_idx", lambda b, h, q_idx, kv_idx: kv_idx <= q_idx)
    with pytest.raises(ValueError, match=r"block_mask was built for \(B, H, Sq, Sk\) = \(1, 2, 8, 9\)"):
        cupy_attn.attention(q, k, v, block_mask=cupy_attn.block_mask(mod, 1, 2, 8, 9))
    with pytest.raises(ValueError, match="block_mask was built for another mask_mod"):
        cupy_attn.attention(q, k, v, mask_mod=other, block_mask=cupy_attn.block_mask(mod, 1, 2, 8, 8))
    with pytest.raises(TypeError, match="block_mask must come from cupy_attn.block_mask"):
        cupy_attn.attention(q, k, v, block_mask=np.ones((1, 1), bool))
    with pytest.raises(ValueError, match="Sk must be a positive int"):
        cupy_attn.block_mask(mod, 1, 2, 8, 0)
    with pytest.raises(TypeError, match="mask_mod must be a cupy_attn.MaskMod"):
        cupy_attn.block_mask("kv_idx <= q_idx", 1, 2, 8, 8)


def test_a_block_mask_follows_its_mask_mods_values(rng):
    """A step's document ids written into the mask_mod's tensor in place (the compiled modules
    stay): block_mask builds the tables again, and the old block mask, whose tables would skip
    and take as full the old mask's tiles (the kernels attended forbidden pairs), is refused."""
    q, k, v = random_qkv(rng, b=1, h=1, sq=128, sk=128, d=16)
    doc, weights = np.zeros((1, 128), np.int32), np.array([np.nan, 1.0], np.float32)
    mod = cupy_attn.MaskMod("doc(b, q_idx) == doc(b, kv_idx) && limit >= 0",
                            lambda b, h, q_idx, kv_idx, doc, weights, limit: (doc[b, q_idx] == doc[b, kv_idx]) & (limit >= 0),
                            tensors={"doc": doc, "weights": weights}, scalars={"limit": 0})
    first = cupy_attn.block_mask(mod, 1, 1, 128, 128)
    assert cupy_attn.block_mask(mod, 1, 1, 128, 128) is first  # unchanged (a NaN equals itself)
    assert first.tiles(64, 64)[0].all()
    doc[0] = np.repeat(np.arange(4), 32)
    second = cupy_attn.block_mask(mod, 1, 1, 128, 128)
    assert second is not first and second.tiles(64, 64)[0].tolist() == [[[[True, False], [False, True]]]]
    want, _ = reference.attention(q, k, v, mask=doc[:, None, :, None] == doc[:, None, None, :])
    assert_close(cupy_attn.attention(q, k, v, block_mask=second), want, np.float32)
    with pytest.raises(ValueError, match="block_mask was built when the mask_mod's 'doc' held other values"):
        cupy_attn.attention(q, k, v, block_mask=first)
    mod.scalars["limit"] = 1
    with pytest.raises(ValueError, match="the mask_mod's 'limit' held other values"):
        cupy_attn.attention(q, k, v, block_mask=second)


def test_a_block_mask_goes_with_its_mask_mod():
    """A training loop makes a MaskMod per batch (its document ids): once the mod and its block
    masks are dropped, both are freed, tensors and tables with them. (The cache used to be keyed
    by weak references to the mods, but a block mask refers to its mod, so no entry was freed.)"""
    import gc
    import weakref

    doc = np.repeat(np.arange(4), 32)[None].astype(np.int32)
    mod = cupy_attn.MaskMod("doc(b, q_idx) == doc(b, kv_idx)",
                            lambda b, h, q_idx, kv_idx, doc: doc[b, q_idx] == doc[b, kv_idx], tensors={"doc": doc})
    blocks = cupy_attn.block_mask(mod, 1, 1, 128, 128)
    blocks.kernel_tables(64, 64)
    assert cupy_attn.block_mask(mod, 1, 1, 128, 128) is blocks  # still reused while the mod lives
    mod_alive, blocks_alive = weakref.ref(mod), weakref.ref(blocks)
    del mod, blocks
    gc.collect()
    assert mod_alive() is None and blocks_alive() is None


def test_full_tiles_skip_the_mask_mod(rng):
    """White-box: a MaskMod whose C expression also removes key 5, which its twin (what the block
    mask is built from) does not. Key 5 lies in a tile the block mask calls full for entry 0, so
    the kernels there never evaluate the C expression and attend key 5; entry 1's tile with key 5
    is partial, so there the C expression removes it."""
    tile = _config.forward_tile(64, 64, np.float16)
    m = tile.block_m  # entry 0's first document covers the first query tile and a bit more
    doc = np.stack([np.repeat([0, 1], [m + 2, 148 - m]), np.repeat([0, 1], [3, 147])]).astype(np.int32)
    mod = cupy_attn.MaskMod("doc(b, q_idx) == doc(b, kv_idx) && kv_idx != 5",
                            lambda b, h, q_idx, kv_idx, doc: doc[b, q_idx] == doc[b, kv_idx], tensors={"doc": doc})
    q, k, v = random_qkv(rng, b=2, h=1, sq=150, sk=150, d=64, dtype=np.float16)
    blocks = cupy_attn.block_mask(mod, 2, 1, 150, 150)
    assert blocks.tiles(m, tile.block_n)[1][:, 0, 0, 0].tolist() == [True, False]
    out = cupy_attn.attention(q, k, v, block_mask=blocks, backend="emulator")
    twin_only, _ = reference.attention(q, k, v, mask_mod=mod)
    c_too, _ = reference.attention(q, k, v, mask=(doc[:, None, :, None] == doc[:, None, None, :]) & (np.arange(150) != 5))
    np.testing.assert_allclose(out[0, :, :m], twin_only[0, :, :m], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(out[1, :, 3:m], c_too[1, :, 3:m], rtol=2e-3, atol=2e-3)
    assert not np.allclose(twin_only[0, :, :m], c_too[0, :, :m], rtol=2e-3, atol=2e-3)
