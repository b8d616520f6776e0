"""attention_varlen and its backward: packed sequences against the float64 reference on the padded
equivalent, on the NumPy backend and on the kernels (emulator, every family), with the rows around
each sequence poisoned so a read across a boundary shows."""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import _compile, _config, _kernel_backend, _nvrtc, reference
from helpers import BF16, DTYPES, assert_close
from test_compile_report import PLAIN_ONLY
from test_kernel_forward import poisoned_outputs, schedule  # noqa: F401 (fixtures)

KERNEL_DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "top_left": dict(causal="top_left"),
    "window": dict(window=(5, 2)),
    "softcap_alibi": dict(softcap=3.0, alibi_slopes=[0.3, 0.1, 0.05, 0.2], causal=True),
}


def cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed_inputs(rng, lens_q, lens_k, *, h=4, hkv=2, d=16, dv=None, dtype=np.float32):
    """q, k, v packed, each a view into a NaN-filled buffer with rows before and after it, so a
    kernel that read outside the packed rows would produce NaN."""
    dv = d if dv is None else dv

    def tensor(total, heads, dims):
        buffer = np.full((total + 6, heads, dims), np.nan, dtype=dtype)
        buffer[3:3 + total] = rng.standard_normal((total, heads, dims))
        return buffer[3:3 + total]

    tq, tk = sum(lens_q), sum(lens_k)
    return tensor(tq, h, d), tensor(tk, hkv, d), tensor(tk, hkv, dv)


def padded(x, cu_seqlens, width):
    """(total, H, D) -> (B, width, H, D) with zero padding, and the lengths."""
    lengths = np.diff(cu_seqlens)
    out = np.zeros((len(lengths), width) + x.shape[1:], dtype=x.dtype)
    for b, n in enumerate(lengths):
        out[b, :n] = x[cu_seqlens[b]:cu_seqlens[b + 1]]
    return out, lengths


def unpadded(x, cu_seqlens):
    """(B, S, ...) -> (total, ...): the valid rows of each entry, one after another."""
    return np.concatenate([x[b, :n] for b, n in enumerate(np.diff(cu_seqlens))])


def reference_varlen(q, k, v, cu_q, cu_k, dout=None, **kw):
    """The float64 reference run on the padded equivalent (lengths = the sequences')."""
    sq, sk = max(1, int(np.diff(cu_q).max(initial=0))), max(1, int(np.diff(cu_k).max(initial=0)))
    (qp, lq), (kp, lk), (vp, _) = padded(q, cu_q, sq), padded(k, cu_k, sk), padded(v, cu_k, sk)
    args = dict(q_lengths=lq, kv_lengths=lk, layout="bshd", **kw)
    out, lse = reference.attention(qp, kp, vp, **args)
    result = [unpadded(out, cu_q), np.concatenate([lse[b, :, :n] for b, n in enumerate(lq)], axis=1)]
    if dout is not None:
        dq, dk, dv = reference.attention_gradients(padded(dout, cu_q, sq)[0], qp, kp, vp, **args)
        result += [unpadded(dq, cu_q), unpadded(dk, cu_k), unpadded(dv, cu_k)]
    return result


def check_varlen(backend, rng, lens_q, lens_k, dtype, *, grads=True, deterministic=False, h=4, hkv=2, d=16, dv=None,
                 **kw):
    q, k, v = packed_inputs(rng, lens_q, lens_k, h=h, hkv=hkv, d=d, dv=dv, dtype=dtype)
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    max_q, max_k = max(lens_q, default=0), max(lens_k, default=0)
    out, lse = cupy_attn.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, backend=backend, **kw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    want = reference_varlen(q, k, v, cu_q, cu_k, dout if grads else None, **kw)
    assert out.shape == (sum(lens_q), h, v.shape[2]) and out.dtype == dtype
    assert lse.shape == (h, sum(lens_q))
    assert_close(out, want[0], dtype, what="out")
    assert_close(lse, want[1], dtype, what="lse")
    if grads:
        got = cupy_attn.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, backend=backend,
                                                  deterministic=deterministic, **kw)
        for name, g, w, x in zip(("dq", "dk", "dv"), got, want[2:], (q, k, v)):
            assert g.shape == x.shape and g.dtype == dtype
            assert_close(g, w, dtype, grad=True, what=name)
    return out


# Empty sequences (queries without keys, keys without queries), one row, tile-crossing lengths.
LENGTHS = [([7, 0, 1, 70, 3], [9, 4, 0, 66, 3]), ([113], [203]), ([1, 1, 1], [1, 2, 130])]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("lengths", LENGTHS, ids=["mixed", "113x203", "decode_like"])
def test_numpy_backend(rng, dtype, feature, lengths):
    check_varlen("numpy", rng, *lengths, dtype, **FEATURES[feature])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("feature", FEATURES)
def test_kernels(rng, schedule, dtype, feature):
    check_varlen("emulator", rng, *LENGTHS[0], dtype, deterministic=feature == "causal", **FEATURES[feature])


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
def test_wgmma_kernels(rng, monkeypatch, dtype):
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    check_varlen("emulator", rng, [65, 0, 3], [70, 5, 0], dtype, causal=True)
    check_varlen("emulator", rng, [65, 0, 3], [70, 5, 0], dtype, window=(9, 0), deterministic=True)


def test_a_packed_backward_on_sm90_makes_the_mma_sync_kernels_buffers_alone(rng, monkeypatch):
    """TMA cannot address a packed batch: the backward takes the mma.sync kernel before it makes
    (and, for a GQA group's adds, zero-fills) dk and dv buffers for the wgmma one."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    made = []
    real = _kernel_backend._per_head
    monkeypatch.setattr(_kernel_backend, "_per_head", lambda *a, **kw: made.append(kw) or real(*a, **kw))
    check_varlen("emulator", rng, [20, 9], [33, 5], np.dtype(np.float16), h=4, hkv=2, causal=True)
    assert [(kw.get("zeroed"), kw.get("heads")) for kw in made] == [(True, None), (True, 2), (True, 2)]  # dq, dk, dv


def test_a_packed_forward_on_sm90_makes_the_mma_sync_kernels_output_alone(rng, monkeypatch):
    """Nor does the forward make an output for the wgmma kernel's TMA store (rows padded to 8
    elements where Dv is not a multiple of 8) before it takes the mma.sync kernel."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    made = []
    real = _kernel_backend._output
    monkeypatch.setattr(_kernel_backend, "_output", lambda p, tma: made.append(tma) or real(p, tma))
    check_varlen("emulator", rng, [20, 9], [33, 5], np.dtype(np.float16), h=4, hkv=2, d=64, dv=24, grads=False)
    assert made == [False]


@pytest.mark.parametrize("d,dv,hkv", [(64, 64, 1), (128, 128, 8), (256, 256, 2), (40, 72, 4)])
def test_head_dims_and_groups(rng, d, dv, hkv):
    check_varlen("emulator", rng, [33, 2], [40, 17], np.dtype(np.float16), h=8, hkv=hkv, d=d, dv=dv, causal=True,
                 grads=d <= 128)


@pytest.mark.parametrize("hkv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_kernels_write_gradients_in_the_packed_layout(rng, monkeypatch, hkv, deterministic):
    """The tensor-core backward writes through strides: where nothing is summed or converted after,
    dq (the deterministic dQ kernel's), dk and dv come back as the (total, H, D) arrays the
    kernels wrote, with no transposing copy; a GQA group's dk, dv as float32 per kv head, added
    to (converted after), or in deterministic mode per query head (summed after)."""
    buffers = []  # (as the kernels wrote it, as returned): dq, dk, dv
    real = _kernel_backend._from_per_head
    monkeypatch.setattr(_kernel_backend, "_from_per_head", lambda p, x, dtype, **kw: buffers.append(
        (x, real(p, x, dtype, **kw))) or buffers[-1][1])
    check_varlen("emulator", rng, [70, 0, 9], [33, 5, 80], np.dtype(np.float16), h=4, hkv=hkv, d=40, dv=24,
                 deterministic=deterministic, causal=True)
    (dq, dq_returned), *dkdv = buffers
    assert np.shares_memory(dq, dq_returned) == deterministic
    for written, returned in dkdv:
        assert written.shape[0] == (4 if deterministic else hkv)
        assert np.shares_memory(written, returned) == (hkv == 4)


def test_sequences_do_not_see_each_other(rng):
    """Changing one sequence's inputs (even to NaN) changes nothing in the others' results."""
    lens = [20, 5, 31]
    q, k, v = packed_inputs(rng, lens, lens, dtype=np.float16)
    args = (cu(lens), cu(lens), 31, 31)
    base = cupy_attn.attention_varlen(q, k, v, *args, causal=True, backend="emulator")
    k[20:25] = np.nan
    v[20:25] = np.nan
    got = cupy_attn.attention_varlen(q, k, v, *args, causal=True, backend="emulator")
    np.testing.assert_array_equal(got[:20], base[:20])
    np.testing.assert_array_equal(got[25:], base[25:])
    assert np.isnan(got[20:25].astype(np.float32)).all()


def test_equal_lengths_match_padded_attention(rng):
    """A packed batch of equal lengths is exactly a (B, S, H, D) batch."""
    q, k, v = packed_inputs(rng, [16] * 3, [24] * 3, dtype=np.float32)
    out = cupy_attn.attention_varlen(q, k, v, cu([16] * 3), cu([24] * 3), 16, 24, causal=True, backend="emulator")
    want = cupy_attn.attention(q.reshape(3, 16, 4, 16), k.reshape(3, 24, 2, 16), v.reshape(3, 24, 2, 16),
                               causal=True, layout="bshd", backend="emulator")
    np.testing.assert_array_equal(out, want.reshape(out.shape))


def test_cu_seqlens_of_any_strides(rng):
    """The kernels index cu_seqlens as a plain int array: a strided or reversed view of the same
    values gives the same result (it once read the wrong starts, or crashed)."""
    lens = [5, 0, 12, 3]
    q, k, v = packed_inputs(rng, lens, lens, dtype=np.float16)
    starts = cu(lens)
    strided = np.zeros(2 * len(starts), np.int32)[::2]
    strided[:] = starts
    reversed_view = np.ascontiguousarray(starts[::-1])[::-1]
    want = cupy_attn.attention_varlen(q, k, v, starts, starts, 12, 12, causal=True, backend="emulator")
    for view in (strided, reversed_view):
        got = cupy_attn.attention_varlen(q, k, v, view, view, 12, 12, causal=True, backend="emulator")
        np.testing.assert_array_equal(got, want)


def test_no_sequences(rng):
    q, k, v = (np.zeros((0, 2, 8), np.float16) for _ in range(3))
    for backend in ("numpy", "emulator"):
        out, lse = cupy_attn.attention_varlen(q, k, v, cu([]), cu([]), 0, 0, return_lse=True, backend=backend)
        assert out.shape == (0, 2, 8) and lse.shape == (2, 0)


def test_longer_max_seqlen_is_allowed(rng):
    """max_seqlen only bounds the sequences: a larger one gives the same result, even one past
    the kernels' grid limits (65535 query tiles of fp16, 2^31 rows in all), since the grids are
    sized by the longest sequence."""
    q, k, v = packed_inputs(rng, [5, 9], [5, 9], dtype=np.float16)
    exact = cupy_attn.attention_varlen(q, k, v, cu([5, 9]), cu([5, 9]), 9, 9, backend="emulator")
    for loose in ((200, 300), (5_000_000, 2**31 - 1)):
        np.testing.assert_array_equal(exact, cupy_attn.attention_varlen(q, k, v, cu([5, 9]), cu([5, 9]), *loose,
                                                                        backend="emulator"))


ERRORS = [
    (dict(cu_seqlens_q=np.array([1, 5, 9], np.int32)), ValueError, "cu_seqlens_q must start at 0"),
    (dict(cu_seqlens_k=np.array([0, 7, 5], np.int32)), ValueError, "cu_seqlens_k must be non-decreasing"),
    (dict(cu_seqlens_q=np.array([0, 4, 9], np.int64)), TypeError, "must have dtype int32"),
    (dict(cu_seqlens_q=np.array([0, 9], np.int32)), ValueError, r"both have B \+ 1 entries"),
    (dict(cu_seqlens_q=np.array([0, 4, 8], np.int32)), ValueError, r"cu_seqlens_q\[-1\] = 8 must equal q.shape\[0\] = 9"),
    (dict(cu_seqlens_q=np.zeros((1, 3), np.int32)), ValueError, r"shape \(B \+ 1,\)"),
    (dict(cu_seqlens_q="0,4,9"), TypeError, "int32 array"),
    (dict(max_seqlen_q=4), ValueError, r"max_seqlen_q = 4 is less than the longest sequence in cu_seqlens_q \(5\)"),
    (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be a non-negative int"),
    (dict(q=np.zeros((1, 9, 4, 16), np.float16)), ValueError, r"q must be 3-D \(total, H, D\)"),
    (dict(v=np.zeros((8, 2, 16), np.float16)), ValueError, "k has total rows 9 but v has 8"),
    (dict(k=np.zeros((9, 3, 16), np.float16), v=np.zeros((9, 3, 16), np.float16)), ValueError, "multiple of k/v's 3"),
    (dict(alibi_slopes=[0.1, 0.2]), ValueError, "alibi_slopes must have shape"),
]


@pytest.mark.parametrize("change,error,message", ERRORS)
def test_errors(rng, change, error, message):
    q, k, v = packed_inputs(rng, [4, 5], [4, 5], dtype=np.float16)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu([4, 5]), cu_seqlens_k=cu([4, 5]), max_seqlen_q=5, max_seqlen_k=5)
    args.update(change)
    with pytest.raises(error, match=message):
        cupy_attn.attention_varlen(**args)


def test_backward_checks_saved_results(rng):
    q, k, v = packed_inputs(rng, [4, 5], [4, 5], dtype=np.float16)
    args = (cu([4, 5]), cu([4, 5]), 5, 5)
    out, lse = cupy_attn.attention_varlen(q, k, v, *args, return_lse=True)
    with pytest.raises(ValueError, match=r"lse must have shape \(H, total_q\) = \(4, 9\)"):
        cupy_attn.attention_varlen_backward(out, q, k, v, out, lse.T, *args)
    with pytest.raises(ValueError, match="dout must have the forward output's shape"):
        cupy_attn.attention_varlen_backward(out[:5], q, k, v, out, lse, *args)


@pytest.mark.parametrize("packed_call", [True, False], ids=["varlen_on_padded_build", "padded_on_packed_build"])
def test_a_build_refuses_the_other_layout(rng, packed_call):
    """Launched by hand with the other batch layout's module, a kernel traps instead of reading
    rows at the wrong offsets."""
    from cupy_attn import _compile, _config, _problem, emulator

    tile = _config.forward_tile(16, 16, np.float16)
    wrong = _compile.function("emulator", tile.filename, tile.name_expression(np.float16),
                              features=_config.PLAIN_FEATURES, packed=not packed_call)
    if packed_call:
        q, k, v = packed_inputs(rng, [5, 9], [5, 9], dtype=np.float16)
        problem = _problem.make_varlen_problem(q, k, v, cu([5, 9]), cu([5, 9]), 9, 9, backend="emulator")
    else:
        q, k, v = (x.reshape(2, 7, *x.shape[1:]) for x in packed_inputs(rng, [7, 7], [7, 7], dtype=np.float16))
        problem = _problem.make_problem(q, k, v, layout="bshd", backend="emulator")
    built = []

    def build(target, filename, name, **kw):
        built.append(kw["packed"])
        return wrong

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_compile, "function", build)
        with pytest.raises(emulator.EmulatorError, match="__trap"):
            _kernel_backend.forward(problem, q, k, v, target="emulator")
    assert built == [packed_call]  # what the launcher asked for


def _packed_build(variant):
    filename, name, arch, features = variant
    c, _ = _nvrtc.compile_kernel_least_spills(_compile.kernel_source(filename), name, arch,
                                              _compile.gpu_build_options(filename, features, packed=True))
    return variant, c.registers, c.spill_stores + c.spill_loads


def test_packed_builds_compile_without_spills():
    """The attention kernels' packed (attention_varlen) builds, -DATTN_PACKED=1, for every tile
    and report build attention_varlen can select (it takes no dropout; the wgmma forward and dK/dV,
    whose TMA boxes would reach into the next sequence, never run a packed batch): they compile under NVRTC
    and hold no spills either. The fp16 and fp32 ones on sm_80, by test_compile_report's reasoning."""
    from concurrent.futures import ThreadPoolExecutor

    variants = [(filename, name, "sm_80", features) for filename, name, dtype in _config.kernel_variants("sm_80")
                if filename.startswith(("attention_fwd", "attention_bwd")) and "preprocess" not in name
                and str(dtype) not in PLAIN_ONLY
                for features in _config.FEATURE_LEVELS if features != _config.DROPOUT_FEATURES]  # no varlen dropout
    assert not any("wgmma" in filename for filename, *_ in variants)
    assert len(variants) > 50
    # Threads: NVRTC runs outside the GIL, and a forked process would inherit JAX's threads (the
    # test files share a process under pytest-xdist).
    with ThreadPoolExecutor(2) as pool:
        for variant, registers, spills in pool.map(_packed_build, variants):
            assert 0 < registers <= 255 and spills == 0, variant
