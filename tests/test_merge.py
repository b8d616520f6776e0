"""merge_attention and _merge.combine: partial results over disjoint key sets, merged, equal
attention over all the keys (the float64 NumPy backend on the full key set is the reference).

The kernel runs on the emulator with NaN-poisoned outputs, so an element it fails to write shows.
"""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import _kernel_backend, _merge
from helpers import BF16, DTYPES, assert_close, random_qkv
from test_readme import python_blocks

LAYOUTS = ["bhsd", "bshd", "thd"]
BACKENDS = ["numpy", "emulator"]
KERNEL_DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32)]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(_kernel_backend, "POISON_OUTPUTS", True)


def attend(q, k, v, layout, **kw):
    """float64 (out, lse) of attention on the NumPy backend, in ``layout``; "thd" packs the batch
    entries' sequences one after another along T: out (B·S, H, Dv), lse (H, B·S)."""
    out, lse = cupy_attn.attention(q, k, v, return_lse=True, backend="numpy",
                                   layout="bshd" if layout == "bshd" else "bhsd", **kw)
    if layout == "thd":
        b, h, s, dv = out.shape
        return out.transpose(0, 2, 1, 3).reshape(b * s, h, dv), lse.transpose(1, 0, 2).reshape(h, b * s)
    return out, lse


def qkv(rng, layout, *, sk=37, dv=40):
    """float64 inputs: B = 2, H = 3, Sq = 7 (42 rows: not a multiple of the kernel's 4 per block)."""
    return random_qkv(rng, b=2, h=3, sq=7, sk=sk, d=16, dv=dv, dtype=np.float64,
                      layout="bshd" if layout == "bshd" else "bhsd")


def split_by_slices(q, k, v, layout, parts):
    """(full (out, lse), per-part outs, per-part lses): the keys cut into ``parts`` consecutive
    slices along S, as split-KV decoding cuts them."""
    axis = 1 if layout == "bshd" else 2
    pieces = np.array_split(np.arange(k.shape[axis]), parts)
    results = [attend(q, k.take(i, axis), v.take(i, axis), layout) for i in pieces]
    return attend(q, k, v, layout), [r[0] for r in results], [r[1] for r in results]


def split_by_masks(q, k, v, layout, live, rng):
    """As split_by_slices, with every key assigned to one of P parts at random and part p
    removed from the rows where live[p] (B, H, Sq) is False, by bool masks; the full result
    sees the union of the parts' keys, row by row."""
    assignment = rng.integers(0, len(live), k.shape[1 if layout == "bshd" else 2])
    masks = [(assignment == p) & alive[..., None] for p, alive in enumerate(live)]
    results = [attend(q, k, v, layout, mask=m) for m in masks]
    full = attend(q, k, v, layout, mask=np.logical_or.reduce(masks))
    return full, [r[0] for r in results], [r[1] for r in results]


def rows_of_lse(lse, layout):
    """lse in the order of out's leading axes (so out[rows_of_lse(lse) == x] selects rows)."""
    return lse.T if layout == "thd" else lse.transpose(0, 2, 1) if layout == "bshd" else lse


def merge(outs, lses, dtype, *, layout, backend):
    out, lse = cupy_attn.merge_attention(outs, lses, layout=layout, backend=backend)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    assert out.dtype == dtype and lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    return out, lse


def check(outs, lses, full, dtype, *, layout, backend):
    out, lse = merge(outs, lses, dtype, layout=layout, backend=backend)
    assert_close(out, full[0], dtype, what="out")
    assert_close(lse, full[1], dtype, what="lse")
    return out, lse


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_merged_key_slices_are_attention_over_all_keys(rng, backend, layout, parts):
    dtype = np.dtype(np.float64 if backend == "numpy" else np.float32)
    full, outs, lses = split_by_slices(*qkv(rng, layout), layout, parts)
    check([o.astype(dtype) for o in outs], [x.astype(dtype) for x in lses], full, dtype, layout=layout, backend=backend)


@pytest.mark.parametrize("backend,dtype", [("numpy", d) for d in DTYPES] + [("emulator", d) for d in KERNEL_DTYPES],
                         ids=str)
@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_dtypes(rng, backend, dtype, stacked):
    full, outs, lses = split_by_slices(*qkv(rng, "bhsd"), "bhsd", 3)
    outs = [o.astype(dtype) for o in outs]
    lses = [x.astype(np.float64 if dtype == np.float64 else np.float32) for x in lses]
    if stacked:
        outs, lses = np.stack(outs), np.stack(lses)
    check(outs, lses, full, dtype, layout="bhsd", backend=backend)


def test_float64_lses_are_taken_with_any_outs(rng):
    full, outs, lses = split_by_slices(*qkv(rng, "bshd"), "bshd", 2)
    for backend in BACKENDS:
        check([o.astype(np.float32) for o in outs], lses, full, np.dtype(np.float32), layout="bshd", backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.filterwarnings("error")  # no NumPy warning either (0·inf, −inf − −inf, log 0)
def test_empty_parts_contribute_nothing_whatever_their_out_holds(rng, backend, layout):
    dtype = np.dtype(np.float64 if backend == "numpy" else np.float32)
    q, k, v = qkv(rng, layout)
    live = rng.random((3, 2, 3, 7)) < 0.6  # (P, B, H, Sq): part p saw keys in this row
    live[:, 0, 1, :3] = False  # rows no part saw: out 0, lse −inf
    live[2] = False  # a part empty everywhere
    full, outs, lses = split_by_masks(q, k, v, layout, live, rng)
    for p, (o, x) in enumerate(zip(outs, lses)):
        assert (o[rows_of_lse(x, layout) == -np.inf] == 0).all()  # attention gives 0 there ...
        o[rows_of_lse(x, layout) == -np.inf] = np.nan if p % 2 else np.inf  # ... merge must not read it
    outs = [o.astype(dtype) for o in outs]
    out, lse = check(outs, [x.astype(dtype) for x in lses], full, dtype, layout=layout, backend=backend)
    empty = rows_of_lse(full[1], layout) == -np.inf
    assert empty.sum() >= 3 and (out[empty] == 0).all() and (rows_of_lse(lse, layout)[empty] == -np.inf).all()
    assert (~empty).sum() > 20  # and most rows have keys


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_parts_empty_everywhere(backend):
    outs = np.full((4, 2, 3, 5, 8), np.nan, np.float32)
    out, lse = merge(outs, np.full((4, 2, 3, 5), -np.inf, np.float32), np.float32, layout="bhsd", backend=backend)
    assert (out == 0).all() and out.shape == (2, 3, 5, 8)
    assert (lse == -np.inf).all() and lse.shape == (2, 3, 5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_parts_than_a_warp_has_lanes(monkeypatch, rng, backend):
    """The kernel takes 32 parts at a time, rescaling what it has summed when a later chunk
    raises the max; rows live only in the second chunk, or only in the first, included."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_SCHEDULE", "random")
    dtype = np.dtype(np.float64 if backend == "numpy" else np.float32)
    q, k, v = qkv(rng, "bhsd", sk=90, dv=33)
    live = rng.random((40, 2, 3, 7)) < 0.9
    live[:32, 0, 0, 0] = False
    live[32:, 0, 0, 1] = False
    full, outs, lses = split_by_masks(q, k, v, "bhsd", live, rng)
    check(np.stack(outs).astype(dtype), np.stack(lses).astype(dtype), full, dtype, layout="bhsd", backend=backend)


@pytest.mark.parametrize("dv", [1, 32, 70])
def test_kernel_head_dims(rng, dv):
    """One output dim, exactly one warp's worth, and three passes with a partial last one."""
    full, outs, lses = split_by_slices(*qkv(rng, "bhsd", dv=dv), "bhsd", 3)
    check([o.astype(np.float32) for o in outs], [x.astype(np.float32) for x in lses], full, np.dtype(np.float32),
          layout="bhsd", backend="emulator")


@pytest.mark.parametrize("backend", BACKENDS)
def test_degenerate_shapes(rng, backend):
    lses = rng.standard_normal((2, 1, 2, 3)).astype(np.float32)
    out, lse = merge(np.zeros((2, 1, 2, 3, 0), np.float32), lses, np.float32, layout="bhsd", backend=backend)
    assert out.shape == (1, 2, 3, 0)
    np.testing.assert_allclose(lse, np.logaddexp(lses[0], lses[1]), rtol=1e-6)
    out, lse = merge(np.zeros((2, 0, 3, 8), np.float16), np.zeros((2, 3, 0), np.float32), np.float16, layout="thd",
                     backend=backend)
    assert out.shape == (0, 3, 8) and lse.shape == (3, 0)


@pytest.mark.parametrize("out_dtype", KERNEL_DTYPES, ids=str)
def test_combine_on_float32_rows(rng, out_dtype):
    """The internal entry point split-KV decoding calls: (P, R, Dv) float32 parts, any output dtype;
    the kernel and the NumPy version agree, and both equal a float64 evaluation of the formula."""
    out_parts = rng.standard_normal((3, 50, 24)).astype(np.float32)
    lse_parts = (5 * rng.standard_normal((3, 50))).astype(np.float32)
    lse_parts[1, ::3] = -np.inf
    lse_parts[:, 7] = -np.inf
    out_parts[lse_parts == -np.inf] = np.nan
    lse64 = lse_parts.astype(np.float64)
    want_lse = np.logaddexp.reduce(lse64, axis=0)
    weights = np.exp(lse64 - np.where(np.isfinite(want_lse), want_lse, 0))
    want_out = np.nansum(weights[..., None] * out_parts, axis=0)
    for target in BACKENDS:
        out, lse = _merge.combine(target, out_parts, lse_parts, out_dtype)
        assert out.shape == (50, 24) and out.dtype == out_dtype and lse.shape == (50,) and lse.dtype == np.float32
        assert_close(out, want_out, out_dtype, what=f"{target} out")
        assert_close(lse, want_lse, np.float32, what=f"{target} lse")
        assert (out[7] == 0).all() and lse[7] == -np.inf


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_tensors_come_back_as_torch_tensors(rng, dtype):
    torch = pytest.importorskip("torch")
    full, outs, lses = split_by_slices(*qkv(rng, "bshd"), "bshd", 3)
    t_outs = [torch.from_numpy(o).to(getattr(torch, dtype)) for o in outs]
    t_lses = torch.from_numpy(np.stack(lses).astype(np.float32))
    for backend in BACKENDS:
        out, lse = cupy_attn.merge_attention(t_outs, t_lses, layout="bshd", backend=backend)
        assert isinstance(out, torch.Tensor) and out.dtype == getattr(torch, dtype) and out.shape == full[0].shape
        assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and lse.shape == full[1].shape
        np_dtype = BF16 if dtype == "bfloat16" else np.dtype(np.float32)
        assert_close(out.float().numpy(), full[0], np_dtype, what="out")
        assert_close(lse.numpy(), full[1], np_dtype, what="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("parts", [3, 40])
def test_cuda_backend(rng, dtype, parts):
    cupy = pytest.importorskip("cupy")
    live = rng.random((parts, 2, 3, 7)) < 0.8
    live[:, 1, 2, :2] = False
    full, outs, lses = split_by_masks(*qkv(rng, "bshd", sk=90, dv=72), "bshd", live, rng)
    outs = [cupy.asarray(o.astype(dtype)) for o in outs]
    lses = cupy.asarray(np.stack(lses).astype(np.float32))
    for parts_as in (outs, cupy.stack(outs)):
        out, lse = cupy_attn.merge_attention(parts_as, lses, layout="bshd")
        assert isinstance(out, cupy.ndarray) and out.dtype == dtype and lse.dtype == np.float32
        assert_close(out.get(), full[0], dtype, what="out")
        assert_close(lse.get(), full[1], dtype, what="lse")


F32 = np.float32
GOOD = dict(outs=[np.zeros((2, 3, 7, 8), F32)] * 2, lses=[np.zeros((2, 3, 7), F32)] * 2)
BAD = [
    # (description, changes to GOOD's arguments, exception, message fragment)
    ("empty list", dict(outs=[]), ValueError, "outs must hold at least one part, got an empty list"),
    ("empty tuple", dict(lses=()), ValueError, "lses must hold at least one part, got an empty tuple"),
    ("empty stack", dict(outs=np.zeros((0, 2, 3, 7, 8), F32)), ValueError, "outs must hold at least one part along its"),
    ("not arrays", dict(outs=[[1.0]]), TypeError, "outs[0] must be a NumPy or CuPy array, got list"),
    ("not an array", dict(lses="lse"), TypeError, "lses must be a NumPy or CuPy array, got str"),
    ("part shapes", dict(outs=[np.zeros((2, 3, 7, 8), F32), np.zeros((2, 3, 7, 4), F32)]), ValueError,
     "outs[1] has shape (2, 3, 7, 4) but outs[0] has (2, 3, 7, 8); all parts must share one shape"),
    ("part dtypes", dict(outs=[np.zeros((2, 3, 7, 8), F32), np.zeros((2, 3, 7, 8), np.float16)]), TypeError,
     "outs[1] has dtype float16 but outs[0] has float32; all parts must share one dtype"),
    ("lse part dtypes", dict(lses=[np.zeros((2, 3, 7), F32), np.zeros((2, 3, 7), np.float64)]), TypeError,
     "lses[1] has dtype float64 but lses[0] has float32"),
    ("part counts", dict(lses=[np.zeros((2, 3, 7), F32)] * 3), ValueError, "outs has 2 parts but lses has 3"),
    ("int outs", dict(outs=[np.zeros((2, 3, 7, 8), np.int32)] * 2), TypeError,
     "outs has dtype int32; expected float16, bfloat16, float32 or float64"),
    ("float16 lses", dict(lses=[np.zeros((2, 3, 7), np.float16)] * 2), TypeError,
     "lses has dtype float16; expected float32 or float64"),
    ("outs rank", dict(outs=[np.zeros((3, 7, 8), F32)] * 2), ValueError,
     "each part of outs must be 4-D (B, H, S, Dv) for layout 'bhsd', got shape (3, 7, 8)"),
    ("thd rank", dict(layout="thd"), ValueError, "each part of outs must be 3-D (T, H, Dv) for layout 'thd'"),
    ("lse shape", dict(lses=[np.zeros((2, 3, 6), F32)] * 2), ValueError,
     "each part of lses must have shape (B, H, S) = (2, 3, 7) for outs parts of shape (2, 3, 7, 8) in layout 'bhsd', "
     "got (2, 3, 6)"),
    ("bshd lse in out's order", dict(layout="bshd"), ValueError,
     "each part of lses must have shape (B, H, S) = (2, 7, 3) for outs parts of shape (2, 3, 7, 8) in layout 'bshd'"),
    ("thd lse in out's order", dict(outs=[np.zeros((7, 3, 8), F32)] * 2, lses=[np.zeros((7, 3), F32)] * 2,
                                    layout="thd"), ValueError, "each part of lses must have shape (H, T) = (3, 7)"),
    ("lse nan", dict(lses=np.full((2, 2, 3, 7), np.nan, F32)), ValueError,
     "lses may hold -inf (a part that saw no keys) and finite values within ±1.701e+38 (the range the merge computes "
     "in, base 2, for float32 outs), not NaN or +inf"),
    # finite, but inf once the kernel multiplies by log2 e (float32), or once cast to float32 (float64)
    ("lse past base 2", dict(lses=np.full((2, 2, 3, 7), 3e38, F32)), ValueError, "within ±1.701e+38"),
    ("lse past float32", dict(lses=np.full((2, 2, 3, 7), -1e39)), ValueError, "within ±1.701e+38"),
    ("lse +inf", dict(lses=[np.zeros((2, 3, 7), F32), np.full((2, 3, 7), np.inf, F32)]), ValueError, "not NaN or +inf"),
    ("layout", dict(layout="bsdh"), ValueError, "layout must be one of 'bhsd', 'bshd', 'thd', got 'bsdh'"),
    ("backend", dict(backend="torch"), ValueError, "backend must be one of 'auto', 'numpy', 'cuda', 'emulator'"),
    ("float64 on the emulator", dict(outs=[np.zeros((2, 3, 7, 8))] * 2, backend="emulator"), TypeError,
     "float64 inputs run on the NumPy backend only; backend 'emulator' takes float16, bfloat16 or float32"),
]


@pytest.mark.parametrize("changes,error,message", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input(changes, error, message):
    with pytest.raises(error) as info:
        cupy_attn.merge_attention(**dict(GOOD, **changes))
    assert message in str(info.value)


def test_good_input_of_the_error_table_runs():
    out, lse = cupy_attn.merge_attention(**GOOD)
    assert (out == 0).all() and np.allclose(lse, np.log(2))


def test_readme_example_runs():
    (code,) = python_blocks("Merging partial results")
    exec(compile(code, "README.md (Merging partial results)", "exec"), {})


def test_cuda_backend_on_numpy_arrays_is_an_error_not_a_fallback():
    with pytest.raises(cupy_attn.BackendUnavailableError, match="backend 'cuda'"):
        cupy_attn.merge_attention(**GOOD, backend="cuda")
