"""Every misuse raises ValueError or TypeError naming the argument."""
import sys

import numpy as np
import pytest

import cupy_attn
from cupy_attn import distributed, masks
from helpers import random_qkv


@pytest.fixture
def qkv(rng):
    return random_qkv(rng, b=2, h=4, hkv=2, sq=7, sk=9, d=16, dv=8)


def replace(qkv, **changes):
    q, k, v = qkv
    arrays = dict(q=q, k=k, v=v)
    arrays.update({n: changes.pop(n) for n in list(changes) if n in arrays})
    return arrays, changes


F32 = np.float32
BAD_FORWARD = [
    # (description, make changes from (q, k, v), exception, message fragment)
    ("q list", lambda q, k, v: dict(q=q.tolist()), TypeError, "q must be a NumPy or CuPy array, got list"),
    ("k scalar", lambda q, k, v: dict(k=1.0), TypeError, "k must be a NumPy or CuPy array, got float"),
    ("q rank", lambda q, k, v: dict(q=q[0]), ValueError, "q must be 4-D"),
    ("v rank", lambda q, k, v: dict(v=v[..., None]), ValueError, "v must be 4-D"),
    ("int dtype", lambda q, k, v: dict(q=q.astype(np.int32), k=k.astype(np.int32), v=v.astype(np.int32)), TypeError, "q has dtype int32"),
    ("complex dtype", lambda q, k, v: dict(q=q.astype(np.complex64)), TypeError, "q has dtype complex64"),
    ("mixed dtypes", lambda q, k, v: dict(k=k.astype(np.float16)), TypeError, "k has dtype float16 but q has float32"),
    ("batch mismatch", lambda q, k, v: dict(k=k[:1], v=v[:1]), ValueError, "batch sizes differ"),
    ("head mismatch kv", lambda q, k, v: dict(v=v[:, :1]), ValueError, "k has 2 heads but v has 1"),
    ("seq mismatch", lambda q, k, v: dict(v=v[:, :, :5]), ValueError, "k has sequence length 9 but v has 5"),
    ("head dim mismatch", lambda q, k, v: dict(k=k[..., :8]), ValueError, "q has head dim 16 but k has 8"),
    ("gqa not multiple", lambda q, k, v: dict(k=np.concatenate([k, k[:, :1]], 1), v=np.concatenate([v, v[:, :1]], 1)), ValueError, "multiple of k/v's 3 heads"),
    ("zero head dim", lambda q, k, v: dict(q=q[..., :0], k=k[..., :0]), ValueError, "head dims must be at least 1"),
    ("mask int", lambda q, k, v: dict(mask=np.ones((7, 9), np.int8)), TypeError, "mask must be bool"),
    ("mask list", lambda q, k, v: dict(mask=[[True]]), TypeError, "mask must be a NumPy or CuPy array"),
    ("mask shape", lambda q, k, v: dict(mask=np.ones((7, 8), bool)), ValueError, "mask of shape (7, 8) does not broadcast"),
    ("mask rank", lambda q, k, v: dict(mask=np.ones((1, 1, 1, 7, 9), bool)), ValueError, "does not broadcast"),
    ("mask nan", lambda q, k, v: dict(mask=np.full((7, 9), np.nan, F32)), ValueError, "not NaN or +inf"),
    ("mask +inf", lambda q, k, v: dict(mask=np.full((7, 9), np.inf, F32)), ValueError, "not NaN or +inf"),
    ("causal string", lambda q, k, v: dict(causal="upper"), ValueError, "causal must be True, False"),
    ("causal int", lambda q, k, v: dict(causal=1), ValueError, "causal must be"),
    ("window scalar", lambda q, k, v: dict(window=3), ValueError, "window must be a pair"),
    ("window triple", lambda q, k, v: dict(window=(1, 2, 3)), ValueError, "window must be a pair"),
    ("window negative", lambda q, k, v: dict(window=(-1, 0)), ValueError, "window left must be a non-negative int"),
    ("window float", lambda q, k, v: dict(window=(1, 2.5)), TypeError, "window right must be a non-negative int or None, got float"),
    ("q_lengths negative", lambda q, k, v: dict(q_lengths=[-1, 3]), ValueError, "q_lengths must be non-negative"),
    ("kv_lengths too long", lambda q, k, v: dict(kv_lengths=[9, 10]), ValueError, "kv_lengths must not exceed Sk = 9"),
    ("q_lengths too long", lambda q, k, v: dict(q_lengths=np.array([8, 1])), ValueError, "q_lengths must not exceed Sq = 7"),
    ("kv_lengths count", lambda q, k, v: dict(kv_lengths=[1, 2, 3]), ValueError, "kv_lengths must have shape (2,)"),
    ("kv_lengths float", lambda q, k, v: dict(kv_lengths=np.array([1.0, 2.0])), TypeError, "kv_lengths must hold integers"),
    ("kv_lengths float list", lambda q, k, v: dict(kv_lengths=[1.5, 2]), TypeError, "kv_lengths must be an integer array"),
    ("layout", lambda q, k, v: dict(layout="bsdh"), ValueError, "layout must be one of 'bhsd', 'bshd', got 'bsdh'"),
    ("backend", lambda q, k, v: dict(backend="torch"), ValueError, "backend must be one of"),
    ("scale zero", lambda q, k, v: dict(scale=0.0), ValueError, "scale must be finite and positive"),
    ("scale nan", lambda q, k, v: dict(scale=float("nan")), ValueError, "scale must be finite and positive"),
    ("scale inf", lambda q, k, v: dict(scale=float("inf")), ValueError, "scale must be finite"),
    ("scale string", lambda q, k, v: dict(scale="1"), TypeError, "scale must be a real number, got str"),
    ("softcap negative", lambda q, k, v: dict(softcap=-1.0), ValueError, "softcap must be finite and positive"),
    ("softcap bool", lambda q, k, v: dict(softcap=True), TypeError, "softcap must be a real number"),
    ("alibi shape", lambda q, k, v: dict(alibi_slopes=np.ones(3)), ValueError, "alibi_slopes must have shape (4,) or (2, 4)"),
    ("alibi nan", lambda q, k, v: dict(alibi_slopes=np.full(4, np.nan)), ValueError, "alibi_slopes must be finite"),
    ("alibi string", lambda q, k, v: dict(alibi_slopes="0.5"), TypeError, "alibi_slopes must be a float array"),
    ("alibi strings", lambda q, k, v: dict(alibi_slopes=["a"] * 4), TypeError, "alibi_slopes must be a float array"),
    ("sinks ragged", lambda q, k, v: dict(sinks=[[1.0], [2.0, 3.0]]), TypeError, "sinks must be a float array"),
    ("window dict", lambda q, k, v: dict(window={1: 0, 2: 0}), ValueError, "window must be a pair"),
    ("kv_lengths past int64", lambda q, k, v: dict(kv_lengths=[2 ** 64, 1]), ValueError,
     "kv_lengths holds a value outside the range of int64"),
    ("scale past float", lambda q, k, v: dict(scale=10 ** 400), ValueError, "too large for a float"),
    # Finite as Python floats, but inf (or 0) in the float32 the scores of float32 inputs are
    # computed in, or once the kernels multiply by log2 e.
    ("scale past float32", lambda q, k, v: dict(scale=1e39), ValueError,
     "scale must lie in [1.175e-38, 1.701e+38] for float32 inputs"),
    ("scale past base 2", lambda q, k, v: dict(scale=3e38), ValueError, "scale must lie in [1.175e-38, 1.701e+38]"),
    ("scale below float32", lambda q, k, v: dict(scale=1e-300), ValueError, "scale must lie in [1.175e-38"),
    ("softcap past float32", lambda q, k, v: dict(softcap=1e39), ValueError, "softcap must lie in [1.175e-38, 1.701e+38]"),
    # each in range, but the softcap's tanh factor 2·log2 e·scale / softcap inf in float32 (a q·k
    # of 0 gave NaN on the kernels)
    ("scale over softcap past float32", lambda q, k, v: dict(scale=100.0, softcap=1e-37), ValueError,
     "with softcap, scale, softcap and scale / softcap must each be below 1.179e+38 for float32 inputs"),
    ("scale with softcap past float32", lambda q, k, v: dict(scale=1.5e38, softcap=1e10), ValueError,
     "scale, softcap and scale / softcap must each be below 1.179e+38"),
    ("softcap past twice base 2", lambda q, k, v: dict(softcap=1.5e38), ValueError,  # out 0, lse -inf on the kernels
     "scale, softcap and scale / softcap must each be below 1.179e+38"),
    ("mask past float32", lambda q, k, v: dict(mask=np.full((7, 9), 1e39)), ValueError,
     "a float mask may hold -inf and finite values up to 1.701e+38"),
    ("mask past base 2", lambda q, k, v: dict(mask=np.full((7, 9), 3e38, F32)), ValueError, "values up to 1.701e+38"),
    ("sinks past base 2", lambda q, k, v: dict(sinks=np.full(4, 3e38, F32)), ValueError,
     "sinks must be finite, within ±1.701e+38"),
    ("alibi past base 2", lambda q, k, v: dict(alibi_slopes=np.full(4, 3e38, F32)), ValueError,
     "alibi_slopes must be finite, within ±1.701e+38"),
]


@pytest.mark.parametrize("make,error,message", [c[1:] for c in BAD_FORWARD], ids=[c[0] for c in BAD_FORWARD])
def test_bad_forward_input(qkv, make, error, message):
    arrays, keywords = replace(qkv, **make(*qkv))
    with pytest.raises(error) as info:
        cupy_attn.attention(arrays["q"], arrays["k"], arrays["v"], **keywords)
    assert message in str(info.value)


@pytest.mark.parametrize("make,error,message", [c[1:] for c in BAD_FORWARD], ids=[c[0] for c in BAD_FORWARD])
def test_bad_backward_keywords(qkv, make, error, message):
    q, k, v = qkv
    out, lse = cupy_attn.attention(q, k, v, return_lse=True)
    arrays, keywords = replace(qkv, **make(*qkv))
    with pytest.raises(error) as info:
        cupy_attn.attention_backward(out, arrays["q"], arrays["k"], arrays["v"], out, lse, **keywords)
    assert message in str(info.value)


BAD_BACKWARD = [
    ("dout shape", lambda o, l: dict(dout=o[:, :, :3]), ValueError, "dout must have the forward output's shape (2, 4, 7, 8)"),
    ("dout dtype", lambda o, l: dict(dout=o.astype(np.float64)), TypeError, "dout must have q's dtype float32"),
    ("out shape", lambda o, l: dict(out=o[..., :4]), ValueError, "out must have the forward output's shape"),
    ("out list", lambda o, l: dict(out=o.tolist()), TypeError, "out must be a NumPy or CuPy array"),
    ("lse shape", lambda o, l: dict(lse=l[..., None]), ValueError, "lse must have shape (B, H, Sq) = (2, 4, 7)"),
    ("lse dtype", lambda o, l: dict(lse=l.astype(np.float64)), TypeError, "lse must be float32"),
]


@pytest.mark.parametrize("make,error,message", [c[1:] for c in BAD_BACKWARD], ids=[c[0] for c in BAD_BACKWARD])
def test_bad_backward_input(qkv, make, error, message):
    q, k, v = qkv
    out, lse = cupy_attn.attention(q, k, v, return_lse=True)
    args = dict(dout=out, out=out, lse=lse)
    args.update(make(out, lse))
    with pytest.raises(error) as info:
        cupy_attn.attention_backward(args["dout"], q, k, v, args["out"], args["lse"])
    assert message in str(info.value)


def test_cuda_backend_on_numpy_arrays_is_an_error_not_a_fallback(qkv):
    # Without a GPU it cannot run; with one, NumPy inputs must be moved to it first.
    with pytest.raises(cupy_attn.BackendUnavailableError, match="backend 'cuda'"):
        cupy_attn.attention(*qkv, backend="cuda")


def test_bad_head_helpers(rng):
    x = rng.standard_normal((2, 5, 12))
    with pytest.raises(ValueError, match="not divisible by num_heads = 5"):
        cupy_attn.split_heads(x, 5)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        cupy_attn.split_heads(x, 0)
    with pytest.raises(ValueError, match="x must be 3-D"):
        cupy_attn.split_heads(x[0], 2)
    with pytest.raises(TypeError, match="x must be a NumPy or CuPy array"):
        cupy_attn.split_heads(x.tolist(), 2)
    with pytest.raises(ValueError, match="layout must be one of"):
        cupy_attn.merge_heads(x[None], layout="hsd")
    with pytest.raises(ValueError, match="x must be 4-D"):
        cupy_attn.merge_heads(x)


def test_bad_multi_head_attention(rng):
    x = rng.standard_normal((2, 5, 12))
    w = rng.standard_normal((12, 12))
    with pytest.raises(ValueError, match=r"w_k must be 2-D \(12, heads·head_dim\)"):
        cupy_attn.multi_head_attention(x, w, w[:5], w, w, 3)
    with pytest.raises(TypeError, match="w_v has dtype float32 but x has float64"):
        cupy_attn.multi_head_attention(x, w, w, w.astype(np.float32), w, 3)
    with pytest.raises(ValueError, match=r"w_o must be 2-D \(12, E_out\)"):
        cupy_attn.multi_head_attention(x, w, w, w, w[:6], 3)
    with pytest.raises(ValueError, match="w_q gives head dim 4 but w_k gives 6"):
        cupy_attn.multi_head_attention(x, w, w, w, w, 3, num_kv_heads=2)
    with pytest.raises(ValueError, match="context has batch 1 but x has 2"):
        cupy_attn.multi_head_attention(x, w, w, w, w, 3, context=x[:1])
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
        cupy_attn.multi_head_attention(x, w, w, w, w, 3, num_kv_heads=0)


CAUSAL = cupy_attn.MaskMod("kv_idx <= q_idx", lambda b, h, q_idx, kv_idx: kv_idx <= q_idx)


@pytest.mark.parametrize("call, name", [
    (lambda x: cupy_attn.split_heads(x, 2.0), "num_heads"),
    (lambda x: cupy_attn.split_heads(x, np.array(2)), "num_heads"),  # a 0-d array is not an int
    (lambda x: cupy_attn.multi_head_attention(x, *[np.eye(12)] * 4, 3, num_kv_heads="1"), "num_kv_heads"),
    (lambda x: masks.causal_mask(3.0, 3), "sq"),
    (lambda x: masks.window_mask(2, 3, True, 0), "left"),
    (lambda x: cupy_attn.block_mask(CAUSAL, 1, 2, "8", 8), "Sq"),
    (lambda x: cupy_attn.attention_varlen(x[0], x[0], x[0], [0, 5], [0, 5], 5.0, 5), "max_seqlen_q"),
    (lambda x: distributed.positions(0, 2.0, 8), "size"),
    (lambda x: distributed.positions(None, 2, 8), "rank"),
], ids=["float", "0-d array", "str", "mask size", "bool", "block mask", "max_seqlen", "ranks", "rank"])
def test_counts_of_another_type_are_type_errors(rng, call, name):
    x = rng.standard_normal((2, 5, 12))
    with pytest.raises(TypeError, match=f"{name} must be a (positive|non-negative) int, got "):
        call(x.reshape(2, 5, 3, 4) if name.startswith("max_seqlen") else x)


def test_a_zero_d_tensor_as_a_count_is_a_type_error(rng):
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="num_heads must be a positive int, got torch.Tensor"):
        cupy_attn.split_heads(torch.zeros(2, 5, 12), torch.tensor(2))


def test_bad_mask_builder_input():
    with pytest.raises(ValueError, match="sq must be a non-negative int"):
        masks.causal_mask(-1, 3)
    with pytest.raises(ValueError, match="align must be one of"):
        masks.causal_mask(2, 3, align="left")
    with pytest.raises(ValueError, match="left must be a non-negative int"):
        masks.window_mask(2, 3, -2, 0)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, max_len = 3\]"):
        masks.padding_mask([1, 4], 3)
    with pytest.raises(ValueError, match="lengths must be a 1-D integer array"):
        masks.padding_mask(np.array([1.0]), 3)
    with pytest.raises(TypeError, match=r"masks\[1\] must be bool"):
        masks.combine(np.ones(2, bool), np.ones(2))
    with pytest.raises(ValueError, match="combine needs at least one mask"):
        masks.combine()
    for dtype in (np.int32, np.longdouble):
        with pytest.raises(TypeError, match="dtype must be float16, bfloat16, float32 or float64"):
            masks.to_additive(np.ones(2, bool), dtype)
    with pytest.raises(TypeError, match="like must be a NumPy or CuPy array"):
        masks.causal_mask(2, 2, like=[1])
    with pytest.raises(TypeError, match="xp must be the numpy or cupy module, got 'numpy'"):
        masks.causal_mask(2, 2, xp="numpy")
    # padding_mask checks them with array lengths too (it did with a list only)
    with pytest.raises(TypeError, match="xp must be the numpy or cupy module, got 'numpy'"):
        masks.padding_mask(np.array([1, 2]), 3, xp="numpy")
    with pytest.raises(TypeError, match="like must be a NumPy or CuPy array"):
        masks.padding_mask(np.array([1, 2]), 3, like=[1])
    with pytest.raises(ValueError, match=r"masks\[1\] of shape \(4,\) does not broadcast .* \(2, 3\)"):
        masks.combine(np.ones((2, 3), bool), np.ones(4, bool))
    with pytest.raises(ValueError, match="lengths must be a 1-D integer array, got shape"):
        masks.padding_mask([1.5], 3)
    assert masks.padding_mask([], 3).shape == (0, 1, 1, 3)  # B = 0, which attention takes too
    np.testing.assert_array_equal(masks.padding_mask(range(1, 3), 3), masks.padding_mask(np.array([1, 2]), 3))
    with pytest.raises(ValueError, match="lengths must be a 1-D integer array, got"):
        masks.padding_mask([[1], [1, 2]], 4)


def test_a_window_is_any_pair(qkv):
    want = cupy_attn.attention(*qkv, window=(2, 1))
    for window in ([2, 1], np.array([2, 1]), range(2, 0, -1)):
        np.testing.assert_array_equal(cupy_attn.attention(*qkv, window=window), want)


def test_a_window_without_a_length_is_named():
    q = np.zeros((1, 1, 2, 4), np.float32)
    for window in (np.array(3), 3, {1: 0, 2: 0}.keys()):
        with pytest.raises(ValueError, match="window must be a pair"):
            cupy_attn.attention(q, q, q, window=window)


def test_window_sides_past_every_key_are_unbounded(qkv):
    # Clamped to Sq + Sk before any backend adds them to positions, where int64 would wrap.
    for huge in (sys.maxsize, 2 ** 64):
        for window, unbounded in (((0, huge), (0, None)), ((huge, 2), (None, 2))):
            want = cupy_attn.attention(*qkv, window=unbounded, return_lse=True)
            got = cupy_attn.attention(*qkv, window=window, return_lse=True)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)
            np.testing.assert_array_equal(cupy_attn.reference.attention(*qkv, window=window)[1],
                                          cupy_attn.reference.attention(*qkv, window=unbounded)[1])


def test_bad_reference_gradient_input(qkv):
    q, k, v = qkv
    out, _ = cupy_attn.reference.attention(q, k, v)
    with pytest.raises(ValueError, match=r"dout must have the output's shape \(2, 4, 7, 8\), got \(2, 4, 7, 9\)"):
        cupy_attn.reference.attention_gradients(np.ones((2, 4, 7, 9)), q, k, v)
    with pytest.raises(TypeError, match="dout must be a NumPy or CuPy array, got list"):
        cupy_attn.reference.attention_gradients(out.tolist(), q, k, v)


def fake_cupy(monkeypatch, *, devices=1, nvrtc=(13, 0), headers="/site/nvidia/cu13/include"):
    """A stand-in CuPy (and cuda.pathfinder) to check what cuda_status says without a GPU."""
    import importlib.machinery
    import types

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    def get_version():
        if isinstance(nvrtc, Exception):
            raise nvrtc
        return nvrtc

    runtime = types.SimpleNamespace(getDeviceCount=lambda: devices, runtimeGetVersion=lambda: 13000)
    module("cupy", cuda=types.SimpleNamespace(runtime=runtime, nvrtc=types.SimpleNamespace(getVersion=get_version)))
    module("cuda", __path__=[])
    module("cuda.pathfinder", find_nvidia_header_directory=lambda lib: headers if lib == "cudart" else None)


def test_a_cupy_array_on_another_gpu_than_the_calls_is_refused(monkeypatch):
    """The kernels launch on CuPy's current device (for framework tensors, the first tensor's), so
    an array on another GPU is refused by name, as CuPy's own kernels refuse one (a stand-in CuPy:
    its current device 0, arrays on devices 0 and 1)."""
    import types

    from cupy_attn import _arrays

    fake_cupy(monkeypatch, devices=2)
    sys.modules["cupy"].cuda.Device = lambda: types.SimpleNamespace(id=0)
    array = type("ndarray", (), {"__module__": "cupy._core.core", "__cuda_array_interface__": {}, "shape": (2,),
                                 "dtype": np.dtype(np.float16)})
    here, there = array(), array()
    here.device, there.device = types.SimpleNamespace(id=0), types.SimpleNamespace(id=1)
    assert _arrays.require_array("q", here) is sys.modules["cupy"]
    with pytest.raises(ValueError, match=r"k is on GPU 1, but the call runs on GPU 0 \(CuPy's current device, or the "
                                         r"first framework tensor's\): pass every array on one GPU"):
        _arrays.require_array("k", there, sys.modules["cupy"])


def test_cuda_status_says_what_to_install_when_headers_are_missing(monkeypatch):
    from cupy_attn import _backends

    fake_cupy(monkeypatch, headers=None)
    usable, why = _backends.cuda_status()
    assert not usable
    assert "no CUDA headers" in why and "pip install 'cupy-cuda13x[ctk]'" in why and "NVRTC 13.0" in why


def test_cuda_status_says_what_to_install_when_nvrtc_is_missing(monkeypatch):
    from cupy_attn import _backends

    fake_cupy(monkeypatch, nvrtc=OSError("libnvrtc.so.13: cannot open shared object file"))
    usable, why = _backends.cuda_status()
    assert not usable
    assert "cannot load NVRTC" in why and "libnvrtc.so.13" in why and "cupy-cuda13x[ctk]" in why


def test_cuda_status_reports_nvrtc_and_headers_when_found(monkeypatch):
    from cupy_attn import _backends

    fake_cupy(monkeypatch)
    usable, why = _backends.cuda_status()
    assert usable
    assert why == "1 CUDA device(s) visible to CuPy; NVRTC 13.0, CUDA headers in /site/nvidia/cu13/include"
    fake_cupy(monkeypatch, devices=0)
    assert _backends.cuda_status() == (False, "CuPy found no CUDA device")


def test_a_call_asks_for_its_backend_alone_and_keeps_a_usable_gpu(monkeypatch):
    """_backends.status: a call resolves its own backend only (the emulator's compiler search cost
    every CuPy call 40 µs), and CUDA, once usable, stays so without asking again; an unusable
    one is asked again each time, with the reason of now."""
    from cupy_attn import _backends, emulator

    monkeypatch.setattr(_backends, "_CUDA_USABLE", [])
    monkeypatch.setattr(emulator, "available", lambda: pytest.fail("the emulator's status was asked for"))
    asked = []
    monkeypatch.setattr(_backends, "cuda_status", lambda: asked.append(1) or (False, "no GPU here"))
    assert _backends.resolve("auto", np) == "numpy"
    with pytest.raises(_backends.BackendUnavailableError, match="no GPU here"):
        _backends.resolve("cuda", np)
    assert _backends.status("cuda") == (False, "no GPU here") and len(asked) == 2
    monkeypatch.setattr(_backends, "cuda_status", lambda: asked.append(1) or (True, "1 CUDA device(s)"))
    assert _backends.status("cuda") == (True, "1 CUDA device(s)") and len(asked) == 3
    monkeypatch.setattr(_backends, "cuda_status", lambda: pytest.fail("asked again"))
    assert _backends.status("cuda") == (True, "1 CUDA device(s)")


def test_the_unused_arguments_are_made_once_and_read_only():
    """_kernel_backend._constant: the arguments a launch does not use and an unpadded batch's
    lengths, one array per (device, dtype, length, value), which no kernel may write through."""
    from cupy_attn import _kernel_backend

    lengths = _kernel_backend._constant(np, np.int32, 3, 70)
    assert lengths is _kernel_backend._constant(np, np.int32, 3, 70)
    assert lengths.dtype == np.int32 and lengths.tolist() == [70, 70, 70] and not lengths.flags.writeable
    assert _kernel_backend._constant(np, np.float32).tolist() == [0.0]
    assert _kernel_backend._constant(np, np.int32, 3, 71) is not lengths


def test_a_warp_specialised_kernel_built_with_other_registers_is_refused():
    """With fewer registers at launch than its setmaxnreg split hands on, a wgmma kernel's consumers
    would wait forever: the launcher refuses it, naming the kernel and both counts."""
    from cupy_attn import _config
    from cupy_attn._kernel_backend import check_register_split

    check_register_split(_config.WS_LAUNCH_REGISTERS, "attention_fwd_wgmma<__half, 64, 128>")
    for registers in (128, _config.WS_LAUNCH_REGISTERS - 8, 255):
        with pytest.raises(RuntimeError, match=rf"attention_fwd_wgmma<__half, 64, 128> was built with {registers} "
                                               rf"registers .* needs exactly {_config.WS_LAUNCH_REGISTERS}"):
            check_register_split(registers, "attention_fwd_wgmma<__half, 64, 128>")


def test_precompile_takes_attention_keywords_only(qkv):
    q, k, v = qkv
    assert cupy_attn.precompile(q, k, v, causal=True, return_lse=True, backward=np.bool_(True)) == []  # NumPy: none
    with pytest.raises(TypeError, match="precompile takes attention's keywords; causl is not one of them"):
        cupy_attn.precompile(q, k, v, causl=True)
    with pytest.raises(TypeError, match="deterministic must be a bool, got int"):
        cupy_attn.precompile(q, k, v, deterministic=1)


def test_return_lse_must_be_a_bool(qkv):
    """A truthy string or 1 is refused, not taken for True: return_lse decides what comes back."""
    q, k, v = qkv
    calls = {
        "attention": lambda flag: cupy_attn.attention(q, k, v, return_lse=flag),
        "attention_varlen": lambda flag: cupy_attn.attention_varlen(
            q[0].transpose(1, 0, 2), k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2), np.array([0, q.shape[2]], np.int32),
            np.array([0, k.shape[2]], np.int32), q.shape[2], k.shape[2], return_lse=flag),
        "attention_with_kvcache": lambda flag: cupy_attn.attention_with_kvcache(
            q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), cache_seqlens=k.shape[2], layout="bhsd",
            return_lse=flag),
    }
    for name, call in calls.items():
        assert len(call(np.bool_(True))) == 2, name
        for flag in ("yes", 1, None):
            with pytest.raises(TypeError, match=f"return_lse must be a bool, got {type(flag).__name__}"):
                call(flag)


def test_lengths_whose_tiles_or_window_bands_pass_32_bits_are_refused():
    """The kernels round a length up to whole tiles and add a row, its offset and a window's side
    in 32 bits: a length within a tile of 2^31 gave no key tile (out 0, lse -inf) and a window
    side of 2^30 beside 2^30 keys an empty band, silently. Refused now, before anything runs (k
    and v are stride-0 views: no memory); one less is taken (checked by the refusal's absence
    alone: running 2^31 keys is not a test)."""
    f16 = np.float16
    one = np.ones((1, 1, 1, 8), f16)
    keys = lambda n: np.broadcast_to(one, (1, 1, n, 8))  # noqa: E731
    with pytest.raises(ValueError, match=r"seq_q \+ seq_k must be at most 2\^31 - 1024, got 2147483586"):
        cupy_attn.attention(one, keys(2**31 - 63), keys(2**31 - 63), backend="emulator")
    with pytest.raises(ValueError, match=r"at most 2\^30 - 512 with a window, got 1073741825"):
        cupy_attn.attention(one, keys(2**30), keys(2**30), window=(0, 2**31), backend="emulator")
    # accepted: built, not run
    assert cupy_attn.precompile(one, keys(2**31 - 1025), keys(2**31 - 1025), backward=False, backend="emulator")
    assert cupy_attn.precompile(one, keys(2**30 - 513), keys(2**30 - 513), window=(0, 2**31), backward=False,
                                backend="emulator")
    # the decoding kernel's rows: (query, head of the group) pairs of a kv head
    q = np.broadcast_to(np.ones((1, 1, 1, 1), np.float32), (1, 2**22, 1024, 1))
    cache = np.broadcast_to(np.ones((1, 1, 1, 1), np.float32), (1, 8, 1, 1))
    with pytest.raises(ValueError, match=r"Sq x H / Hkv must be at most 2\^31 - 1024, got 4194304 x 1024"):
        cupy_attn.attention_with_kvcache(q, cache, cache, cache_seqlens=8, backend="emulator")


def test_rows_past_32_bit_indices_are_refused_before_a_cache_is_written():
    """The kernels index rows with int32: a paged cache's capacity of 2^31 rows or more is a
    ValueError naming the sizes (not an OverflowError from the launch), raised before
    attention_with_kvcache appends anything; a packed batch's max_seqlen must be below 2^31 (its
    grids are sized by the longest sequence: test_varlen.py::test_longer_max_seqlen_is_allowed)."""
    f32 = np.float32
    q, k, v = np.ones((10, 2, 16), f32), np.ones((12, 1, 16), f32), np.ones((12, 1, 16), f32)
    cu_q, cu_k = np.array([0, 3, 3, 10], np.int32), np.array([0, 5, 12, 12], np.int32)
    with pytest.raises(ValueError, match=r"max_seqlen_k must be below 2\^31 \(as cu_seqlens_k's int32 offsets are\), "
                                         r"got 2147483648"):
        cupy_attn.attention_varlen(q, k, v, cu_q, cu_k, 7, 2**31)
    caches = np.zeros((2, 1, 8192, 1, 16), f32)
    new = np.ones((2, 1, 1, 1, 16), f32)
    with pytest.raises(ValueError, match=r"seq_q \+ seq_k must be at most 2\^31 - 1024, got 4294967297"):
        cupy_attn.attention_with_kvcache(np.ones((1, 1, 1, 16), f32), *caches, *new, cache_seqlens=5,
                                         block_table=np.zeros((1, 2**19), np.int32), backend="emulator")
    assert not caches.any()
