"""PyTorch tensors through cupy_attn (CPU here; CUDA tensors in test_gpu_interop.py)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupy_attn  # noqa: E402
import cupy_attn.torch  # noqa: E402
from cupy_attn import _interop, reference  # noqa: E402
from helpers import assert_close  # noqa: E402

TORCH_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64}


def tensors(dtype=torch.float32, layout="bhsd", requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, 4, 37, 16), (2, 2, 50, 16), (2, 2, 50, 8)]
    if layout == "bshd":
        shapes = [(b, s, h, d) for b, h, s, d in shapes]
    return [torch.randn(s, generator=g, dtype=torch.float32).to(dtype).requires_grad_(requires_grad) for s in shapes]


def numpy_of(t):
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.detach().float().numpy().astype(ml_dtypes.bfloat16)
    return t.detach().numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_attention_and_backward(dtype, layout):
    q, k, v = tensors(dtype, layout)
    kw = dict(causal=True, layout=layout, kv_lengths=torch.tensor([50, 31]), mask=torch.rand(37, 50) < 0.9)
    out, lse = cupy_attn.attention(q, k, v, return_lse=True, **kw)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.device.type == "cpu"
    assert isinstance(lse, torch.Tensor) and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    np_kw = dict(kw, kv_lengths=kw["kv_lengths"].numpy(), mask=kw["mask"].numpy())
    want_out, want_lse = reference.attention(*map(numpy_of, (q, k, v)), **np_kw)
    np_dtype = numpy_of(q).dtype
    assert_close(numpy_of(out), want_out, np_dtype)
    assert_close(lse.numpy(), want_lse, np_dtype)
    dout = torch.randn(out.shape, dtype=torch.float32).to(dtype)
    grads = cupy_attn.attention_backward(dout, q, k, v, out, lse, **kw)
    want = reference.attention_gradients(numpy_of(dout), *map(numpy_of, (q, k, v)), **np_kw)
    for g, w in zip(grads, want):
        assert isinstance(g, torch.Tensor) and g.dtype == dtype
        assert_close(numpy_of(g), w, np_dtype, grad=True)


def test_gradcheck_float64():
    q, k, v = (t[:1, :, :6, :4].detach().clone().double().requires_grad_() for t in tensors())
    for kw in (dict(causal=True), dict(softcap=2.0, alibi_slopes=torch.tensor([0.3, 0.1, 0.2, 0.5])),
               dict(window=(2, 1), q_lengths=torch.tensor([5]), layout="bhsd")):
        assert torch.autograd.gradcheck(lambda q, k, v: cupy_attn.torch.attention(q, k, v, **kw), (q, k, v))


def test_autograd_adapter_trains():
    """A tiny model with cupy_attn.torch.attention inside learns (the README example)."""
    torch.manual_seed(0)
    x = torch.randn(4, 10, 32)
    target = torch.randn(4, 10, 32)
    proj = torch.nn.Linear(32, 3 * 32)
    opt = torch.optim.Adam(proj.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        q, k, v = proj(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(4, 10, 4, 8) for t in (q, k, v))
        out = cupy_attn.torch.attention(q, k, v, causal=True, layout="bshd")
        loss = ((out.reshape(4, 10, 32) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]


def test_adapter_matches_functional_gradients():
    q, k, v = tensors(requires_grad=True)
    out, lse = cupy_attn.torch.attention(q, k, v, return_lse=True, window=(8, 0), deterministic=True)
    dout = torch.randn_like(out)
    (out * dout).sum().backward()
    want = cupy_attn.attention_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, window=(8, 0))
    for t, w in zip((q, k, v), want):
        torch.testing.assert_close(t.grad, w)
    assert not lse.requires_grad


def test_zero_copy_both_ways():
    t = torch.randn(3, 5)
    a = _interop.to_backend(t)
    assert a.ctypes.data == t.data_ptr()
    b16 = torch.randn(3, 5).to(torch.bfloat16)
    a16 = _interop.to_backend(b16)
    assert str(a16.dtype) == "bfloat16" and a16.ctypes.data == b16.data_ptr()
    back = _interop.to_framework("torch", a16)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == a16.ctypes.data
    n = np.ones((2, 3), np.float32)
    assert _interop.to_framework("torch", n).data_ptr() == n.ctypes.data


def test_head_helpers_take_tensors():
    x = torch.randn(2, 9, 24)
    for layout in ("bhsd", "bshd"):
        heads = cupy_attn.split_heads(x, 3, layout)
        assert isinstance(heads, torch.Tensor) and heads.data_ptr() == x.data_ptr()  # a view
        torch.testing.assert_close(cupy_attn.merge_heads(heads, layout), x)
    w = [torch.randn(24, 24) / 5 for _ in range(4)]
    y = cupy_attn.multi_head_attention(x, *w, 3, causal=True)
    want = cupy_attn.multi_head_attention(x.numpy(), *(t.numpy() for t in w), 3, causal=True)
    assert isinstance(y, torch.Tensor)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-6)


def test_head_helpers_and_the_layer_keep_autograd():
    """split_heads and merge_heads reshape in torch (views autograd follows), and
    multi_head_attention on tensors that require grad runs cupy_attn.torch's attention: in a
    residual block their gradients equal those of torch's own composition with SDPA, where a trip
    through DLPack had silently dropped the attention branch's."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 12, generator=g, dtype=torch.float64, requires_grad=True)
    w = [torch.randn(12, 12, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    split = lambda t: t.view(2, 5, 3, 4).transpose(1, 2)  # noqa: E731
    merge = lambda o: o.transpose(1, 2).reshape(2, 5, 12)  # noqa: E731
    sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    ours = x + cupy_attn.merge_heads(cupy_attn.torch.attention(*[cupy_attn.split_heads(x, 3)] * 3, causal=True))
    theirs = x + merge(sdpa(*[split(x)] * 3))
    for got, want in zip(torch.autograd.grad(ours.square().sum(), x), torch.autograd.grad(theirs.square().sum(), x)):
        torch.testing.assert_close(got, want)
    ours = x + cupy_attn.multi_head_attention(x, *w, 3, causal=True)
    theirs = x + merge(sdpa(*(split(x @ m) for m in w[:3]))) @ w[3]
    torch.testing.assert_close(ours, theirs)
    for got, want in zip(torch.autograd.grad(ours.square().sum(), [x, *w]),
                         torch.autograd.grad(theirs.square().sum(), [x, *w])):
        torch.testing.assert_close(got, want)
    with pytest.raises(RuntimeError, match="in-place"):  # torch's own refusal, for a view of a leaf
        cupy_attn.split_heads(x, 3).mul_(0)
    with torch.no_grad():  # without autograd, the layer goes through DLPack as before
        torch.testing.assert_close(cupy_attn.multi_head_attention(x, *w, 3, causal=True), ours.detach() - x.detach())
    # attention's keywords alone, its dropout seed included (0 unless given), with grad on and off
    with pytest.raises(TypeError, match="unexpected keyword argument 'deterministic'"):
        cupy_attn.multi_head_attention(x, *w, 3, deterministic=True)
    dropped = cupy_attn.multi_head_attention(x, *w, 3, dropout_p=0.5)
    with torch.no_grad():
        torch.testing.assert_close(dropped.detach(), cupy_attn.multi_head_attention(x, *w, 3, dropout_p=0.5))


@pytest.mark.parametrize("dynamic", [False, True])
def test_head_helpers_trace_into_a_compiled_graph(dynamic):
    """split_heads and merge_heads are torch reshapes: torch.compile traces them with the
    attention operator into one graph (fullgraph=True), and torch.export records them."""
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)

    def block(x):
        heads = cupy_attn.split_heads(x, 3)
        return cupy_attn.merge_heads(cupy_attn.torch.attention(heads, heads, heads, causal=True)) + x

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    torch.testing.assert_close(compiled(x), block(x), rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(compiled(x).sum(), x), torch.autograd.grad(block(x).sum(), x))

    class Block(torch.nn.Module):
        def forward(self, x):
            return block(x)

    targets = [n.target for n in torch.export.export(Block(), (x.detach(),)).graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.swapaxes.default in targets and torch.ops.cupy_attn.attention.default in targets


def test_plain_functions_refuse_tensors_that_need_autograd():
    """As torch's Tensor.numpy() does: the plain API's result would not carry a gradient."""
    q, k, v = tensors(requires_grad=True)
    with pytest.raises(TypeError, match="q requires grad.*cupy_attn.torch.attention, which is differentiable.*no_grad"):
        cupy_attn.attention(q, k, v)
    with pytest.raises(TypeError, match="v requires grad"):
        cupy_attn.attention(q.detach(), k.detach(), v)
    with pytest.raises(TypeError, match=r"outs\[0\] requires grad, and cupy_attn.merge_attention .*: call it under"):
        cupy_attn.merge_attention([q, q], [q[..., 0].detach()] * 2)
    with torch.no_grad():
        out = cupy_attn.attention(q, k, v)
    torch.testing.assert_close(out, cupy_attn.attention(q.detach(), k.detach(), v.detach()))
    assert cupy_attn.precompile(q, k, v, backend="numpy") == []  # shapes and dtypes alone: nothing is lost


def test_meta_tensors_are_refused_naming_the_argument():
    """A meta tensor has no DLPack device either (the refusal came from the stream's setup)."""
    q, k, v = (t.to("meta") for t in tensors())
    with pytest.raises(TypeError, match="q is a Tensor without data .*cupy_attn.torch.attention"):
        cupy_attn.attention(q, k, v)


def test_the_eager_node_sees_its_tensors_changed_in_place():
    """A list among the arguments takes the autograd node: its mask and sinks, saved for the
    backward, are version-checked as the operators' inputs are."""
    q, k, v = (t[:1, :2, :4, :3].detach().clone().double().requires_grad_() for t in tensors())
    for path in (dict(), dict(kv_lengths=[4])):  # the operator, then the node
        mask, sinks = torch.zeros(1, 1, 4, 4, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
        out = cupy_attn.torch.attention(q, k, v, mask=mask, sinks=sinks, **path)
        mask[..., 0] = -5.0
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(out.sum(), q)
    with torch.inference_mode():  # cannot be saved, nor changed in place outside inference mode
        mask = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    out = cupy_attn.torch.attention(q, k, v, mask=mask, kv_lengths=[4])
    torch.testing.assert_close(torch.autograd.grad(out.sum(), q)[0],
                               torch.autograd.grad(cupy_attn.torch.attention(q, k, v).sum(), q)[0])


def test_adapter_flags_are_checked():
    q, k, v = tensors()
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        cupy_attn.torch.attention(q, k, v, return_lse="yes")
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None, got int"):
        cupy_attn.torch.attention(q, k, v, dropout_p=0.1, generator=3)


def test_traced_values_are_refused_clearly():
    q, k, v = tensors()
    out = cupy_attn.attention(q, k, v, backend="numpy")
    assert isinstance(out, torch.Tensor)
    with pytest.raises(TypeError, match="q must be a NumPy or CuPy array"):
        cupy_attn.attention([1.0], k, v)


def test_varlen_gradcheck_and_emulator_agree():
    """The varlen autograd node: float64 gradcheck on the NumPy backend, and fp16 tensors through
    the kernels (emulator) against the functional API's gradients."""
    g = torch.Generator().manual_seed(3)
    cu_q, cu_k = torch.tensor([0, 3, 3, 8], dtype=torch.int32), torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    q, k, v = (torch.randn(n, h, 4, generator=g, dtype=torch.float64).requires_grad_() for n, h in ((8, 2), (11, 1), (11, 1)))
    kw = dict(causal=True, softcap=3.0)
    assert torch.autograd.gradcheck(
        lambda q, k, v: cupy_attn.torch.attention_varlen(q, k, v, cu_q, cu_k, 5, 5, **kw), (q, k, v))
    q16, k16, v16 = (x.detach().half().requires_grad_() for x in (q, k, v))
    out = cupy_attn.torch.attention_varlen(q16, k16, v16, cu_q, cu_k, 5, 5, backend="emulator", **kw)
    dout = torch.randn(out.shape, generator=g).half()
    out.backward(dout)
    with torch.no_grad():  # the plain API refuses tensors that require grad under autograd
        _, lse = cupy_attn.attention_varlen(q16, k16, v16, cu_q, cu_k, 5, 5, return_lse=True, backend="emulator", **kw)
        want = cupy_attn.attention_varlen_backward(dout, q16, k16, v16, out, lse, cu_q, cu_k, 5, 5,
                                                   backend="emulator", **kw)
    for x, w in zip((q16, k16, v16), want):
        assert torch.equal(x.grad, w)


def test_sinks_get_their_gradient():
    q, k, v = (t[:1, :, :6, :4].detach().clone().double().requires_grad_() for t in tensors())
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: cupy_attn.torch.attention(q, k, v, sinks=s, causal=True), (q, k, v, sinks))


def test_sinks_as_a_list_an_array_or_a_tensor_without_grad_take_no_gradient():
    q, k, v = (t[:1, :, :6, :4].detach().clone().requires_grad_() for t in tensors())
    for sinks in ([0.5, -1.0, 0.0, 2.0], np.array([0.5, -1.0, 0.0, 2.0], np.float32), torch.tensor([0.5, -1.0, 0.0, 2.0])):
        cupy_attn.torch.attention(q, k, v, sinks=sinks).sum().backward()
        constant = np.asarray(sinks, np.float32)
        want = cupy_attn.attention_backward(np.ones((1, 4, 6, 4), np.float32), *(numpy_of(t) for t in (q, k, v)),
                                            *cupy_attn.attention(*(numpy_of(t) for t in (q, k, v)), sinks=constant,
                                                                 return_lse=True), sinks=constant)
        np.testing.assert_allclose(numpy_of(q.grad), want[0], rtol=1e-5, atol=1e-6)
        q.grad = k.grad = v.grad = None


def test_a_mask_or_slopes_that_require_grad_are_refused():
    """No gradient is computed for a mask or ALiBi slopes: one that requires grad would keep a
    grad of None without a word (a learned bias that never learns), on the operator's path and
    the eager node's alike. Refused while autograd records; detached, or under no_grad, taken."""
    q, k, v = (t[:1, :, :6, :4].detach().clone().double().requires_grad_() for t in tensors())
    mask = torch.zeros(1, 1, 6, 6, dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64, requires_grad=True)
    mod = cupy_attn.MaskMod("q_idx >= kv_idx", lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    for extra in ({}, {"mask_mod": mod}):  # the operator, then the eager node
        for name, value in (("mask", mask), ("alibi_slopes", slopes)):
            with pytest.raises(TypeError, match=rf"{name} requires grad.*{name}\.detach\(\)"):
                cupy_attn.torch.attention(q, k, v, **{name: value}, **extra)
            out = cupy_attn.torch.attention(q, k, v, **{name: value.detach()}, **extra)
            out.sum().backward()
            assert q.grad is not None
            q.grad = k.grad = v.grad = None
            with torch.no_grad():
                cupy_attn.torch.attention(q, k, v, **{name: value}, **extra)
    packed = [t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)]
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(TypeError, match="alibi_slopes requires grad"):
        cupy_attn.torch.attention_varlen(*packed, cu, cu, 4, 4, alibi_slopes=slopes)


def test_arrays_of_one_library_only():
    """A NumPy array beside torch tensors (or the reverse) among q, k, v, dout, out, lse is refused:
    the result's type would otherwise follow whichever came first."""
    q, k, v = tensors()
    n = q.numpy()
    for args, message in (((n, k, v), "q is a numpy array, but k is a torch array"),
                          ((q, n, v), "k is a numpy array, but q is a torch array")):
        with pytest.raises(TypeError, match=message):
            cupy_attn.attention(*args)
    out, lse = cupy_attn.attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="dout is a numpy array, but q is a torch array"):
        cupy_attn.attention_backward(out.numpy(), q, k, v, out, lse)
    with pytest.raises(TypeError, match=r"lses\[1\] is a numpy array, but outs\[0\] is a torch array"):
        cupy_attn.merge_attention([q, q], [torch.zeros(q.shape[:3]), np.zeros(q.shape[:3], np.float32)])
    # masks (cupy_attn.masks builds NumPy ones), lengths and per-head arrays may be NumPy beside CPU tensors
    causal = cupy_attn.attention(q, k, v, mask=cupy_attn.masks.causal_mask(37, 50), q_lengths=[2] * q.shape[0],
                                 sinks=np.zeros(q.shape[1], np.float32))
    assert isinstance(causal, torch.Tensor)


def test_a_lazily_negated_tensor_is_read_as_its_values():
    q, k, v = tensors()
    lazy = k.neg()._neg_view()  # its values are k's, its memory holds -k's
    assert lazy.is_neg() and torch.equal(lazy, k)
    assert torch.equal(cupy_attn.attention(q, lazy, v), cupy_attn.attention(q, k, v))


def test_a_backward_that_would_need_its_own_graph_is_refused():
    """create_graph=True (double backward, a gradient penalty) must not give a gradient silently
    missing its second-order term."""
    q, k, v = (t[:1, :, :6, :4].detach().clone().double().requires_grad_() for t in tensors())
    out = cupy_attn.torch.attention(q, k, v)
    with pytest.raises(NotImplementedError, match="create_graph=True"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


def test_dropout_seed_comes_from_the_generator_and_reaches_the_backward():
    q, k, v = (t.detach().clone().double().requires_grad_() for t in tensors())
    fixed = lambda q, k, v: cupy_attn.torch.attention(q, k, v, dropout_p=0.3, dropout_seed=11, causal=True)  # noqa: E731
    small = tuple(t[:1, :2, :5, :3].detach().clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(fixed, small)  # one mask in the forward and the backward

    first = cupy_attn.torch.attention(q, k, v, dropout_p=0.3, generator=torch.Generator().manual_seed(5))
    again = cupy_attn.torch.attention(q, k, v, dropout_p=0.3, generator=torch.Generator().manual_seed(5))
    other = cupy_attn.torch.attention(q, k, v, dropout_p=0.3)
    assert torch.equal(first, again) and not torch.allclose(first, other)
    torch.manual_seed(7)
    default = cupy_attn.torch.attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(7)
    seed = int(torch.randint(0, 2 ** 63 - 1, (), dtype=torch.int64))
    want, _ = reference.attention(*(numpy_of(t) for t in (q, k, v)), dropout_p=0.3, dropout_seed=seed)
    assert_close(default.detach().numpy(), want, np.float64)
    default.sum().backward()
    grads = reference.attention_gradients(np.ones(want.shape), *(numpy_of(t) for t in (q, k, v)), dropout_p=0.3,
                                          dropout_seed=seed)
    for t, w in zip((q, k, v), grads):
        assert_close(t.grad.numpy(), w, np.float64, grad=True)


# ---- torch.compile: the custom operators ---------------------------------------------------------
def compile_case(requires_grad=True):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_(requires_grad)
               for shape in ((2, 4, 7, 8), (2, 2, 11, 8), (2, 2, 11, 5)))
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=torch.float64, requires_grad=requires_grad)
    keywords = dict(causal="top_left", window=(4, None), kv_lengths=torch.tensor([11, 6]), softcap=3.0,
                    alibi_slopes=torch.tensor([0.3, 0.1, 0.2, 0.5]), mask=torch.rand(7, 11, generator=g) < 0.8)
    return q, k, v, sinks, keywords


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_keeps_the_operators_in_one_graph(dynamic):
    """fullgraph=True fails on any graph break, so this passes only if Dynamo traced the call as
    the operators; values and gradients (sinks' included) equal the functional API's."""
    q, k, v, sinks, keywords = compile_case()
    weights = torch.randn(2, 4, 7, 5, dtype=torch.float64)

    def loss(q, k, v, sinks):
        return (cupy_attn.torch.attention(q, k, v, sinks=sinks, **keywords) * weights).sum()

    compiled = torch.compile(loss, fullgraph=True, dynamic=dynamic)
    compiled(q, k, v, sinks).backward()
    out, lse = cupy_attn.attention(q.detach(), k.detach(), v.detach(), sinks=sinks.detach(), return_lse=True,
                                   **keywords)
    # the loss's sum is Inductor's own, so only the last bits may differ
    torch.testing.assert_close(compiled(q, k, v, sinks).detach(), (out * weights).sum(), rtol=1e-13, atol=0)
    want = cupy_attn.attention_backward(weights, *(t.detach() for t in (q, k, v)), out, lse, sinks=sinks.detach(),
                                        **keywords)
    for t, w in zip((q, k, v, sinks), want):
        assert torch.equal(t.grad, w)


def test_torch_compile_varlen_in_one_graph():
    g = torch.Generator().manual_seed(5)
    cu_q, cu_k = torch.tensor([0, 3, 3, 8], dtype=torch.int32), torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    q, k, v = (torch.randn(n, h, 4, generator=g, dtype=torch.float64).requires_grad_() for n, h in ((8, 2), (11, 1), (11, 1)))
    keywords = dict(causal=True, window=(None, 1), scale=0.7)
    compiled = torch.compile(lambda q, k, v: cupy_attn.torch.attention_varlen(q, k, v, cu_q, cu_k, 5, 5, **keywords),
                             fullgraph=True)
    out = compiled(q, k, v)
    out.sum().backward()
    _, lse = cupy_attn.attention_varlen(q.detach(), k.detach(), v.detach(), cu_q, cu_k, 5, 5, return_lse=True,
                                        **keywords)
    want = cupy_attn.attention_varlen_backward(torch.ones_like(out), q.detach(), k.detach(), v.detach(), out.detach(),
                                               lse, cu_q, cu_k, 5, 5, **keywords)
    for t, w in zip((q, k, v), want):
        assert torch.equal(t.grad, w)


def test_torch_compile_draws_a_fresh_dropout_seed_per_call():
    """A drawn seed is an input of the compiled graph, not a constant baked into it."""
    q = torch.randn(1, 2, 9, 8)
    compiled = torch.compile(lambda q: cupy_attn.torch.attention(q, q, q, dropout_p=0.5), fullgraph=True)
    first, second = compiled(q), compiled(q)
    assert not torch.equal(first, second)
    fixed = torch.compile(lambda q: cupy_attn.torch.attention(q, q, q, dropout_p=0.5, dropout_seed=9), fullgraph=True)
    assert torch.equal(fixed(q), cupy_attn.attention(q, q, q, dropout_p=0.5, dropout_seed=9))


def test_torch_compile_breaks_the_graph_for_what_no_schema_holds():
    """A score_mod, or a NumPy mask, cannot be an operator's argument: such calls run the eager
    autograd node, which torch.compile leaves out of its graph, with the same results."""
    q, k, v, _, _ = compile_case()
    double = cupy_attn.ScoreMod("score * 2.0f", lambda s, b, h, q_idx, kv_idx: s * 2, grad="2.0f")
    mask = np.tril(np.ones((7, 11), bool), 4)
    for keywords in (dict(score_mod=double), dict(mask=mask)):
        loss = lambda q, k, v: cupy_attn.torch.attention(q, k, v, **keywords).sum()  # noqa: E731
        compiled = torch.compile(loss)
        compiled(q, k, v).backward()
        got = [t.grad for t in (q, k, v)]
        q.grad = k.grad = v.grad = None
        loss(q, k, v).backward()
        for t, g in zip((q, k, v), got):
            assert torch.equal(t.grad, g)
        q.grad = k.grad = v.grad = None
        torch._dynamo.reset()  # else the graph-broken compilation above is reused
        with pytest.raises(Exception, match="schema does not hold"):
            torch.compile(loss, fullgraph=True)(q, k, v)


def test_operators_pass_torch_library_opcheck():
    """torch.library.opcheck: schema, fake implementation (shapes, strides, dtypes), autograd
    registration and AOTAutograd agree with the real implementation."""
    from cupy_attn import _torch_ops

    q, k, v, sinks, keywords = compile_case()
    arguments = _torch_ops.operator_arguments(dict(keywords, sinks=sinks, dropout_p=0.25, dropout_seed=3), None)
    torch.library.opcheck(_torch_ops.attention_op, (q, k, v), dict(arguments, deterministic=False))
    q16, k16, v16 = (t.detach().to(torch.bfloat16) for t in (q, k, v))
    torch.library.opcheck(_torch_ops.attention_op, (q16, k16, v16),
                          dict(_torch_ops.operator_arguments(dict(layout="bhsd"), torch.tensor(5)), deterministic=True))
    out, lse = _torch_ops.attention_op(q, k, v, **arguments, deterministic=False)
    # the backward operator has no gradient of its own (a double backward is refused)
    constants = [t.detach() for t in (q, k, v)]
    torch.library.opcheck(_torch_ops.attention_backward_op, (torch.ones_like(out), *constants, out.detach(), lse),
                          dict(arguments, sinks=sinks.detach(), deterministic=True))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    packed = [t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k[:, :, :7], v[:, :, :7])]
    varlen = _torch_ops.varlen_operator_arguments(dict(causal=True, window=(2, None)))
    torch.library.opcheck(_torch_ops.attention_varlen_op, (*packed, cu, cu, 4, 4), dict(varlen, deterministic=False))
    out, lse = _torch_ops.attention_varlen_op(*packed, cu, cu, 4, 4, **varlen, deterministic=False)
    constants = [t.detach() for t in packed]
    torch.library.opcheck(_torch_ops.attention_varlen_backward_op,
                          (torch.ones_like(out), *constants, out.detach(), lse, cu, cu, 4, 4),
                          dict(varlen, deterministic=True))
    for op in (_torch_ops.attention_op, _torch_ops.attention_backward_op, _torch_ops.attention_varlen_op,
               _torch_ops.attention_varlen_backward_op):
        assert torch.Tag.cudagraph_unsafe in op._opoverload.tags  # host checks: not for CUDA graphs


def test_operator_path_validates_as_the_api_does():
    """Values of the schema's types reach the API's own checks through the operator, eagerly and
    compiled with fullgraph=True; values no schema holds take the eager node, whose API call
    names them too."""
    q, k, v, _, _ = compile_case(requires_grad=False)
    for keywords, error, message in ((dict(causal="sideways"), ValueError, "causal must be"),
                                     (dict(window=(-1, 2)), ValueError, "window left"),
                                     (dict(scale=-1.0), ValueError, "scale"),
                                     (dict(scale=float("nan")), ValueError, "scale"),
                                     (dict(layout="hsbd"), ValueError, "layout"),
                                     (dict(mask=torch.ones(3, 3, dtype=torch.bool)), ValueError, "mask"),
                                     (dict(dropout_p=1.5), ValueError, "dropout_p"),
                                     (dict(dropout_p=0.1, dropout_seed=-1), ValueError, "dropout_seed"),
                                     (dict(backend="gpu"), ValueError, "backend")):
        torch._dynamo.reset()  # each case compiles anew, not as a recompilation of the last
        for call in (cupy_attn.torch.attention, torch.compile(cupy_attn.torch.attention, fullgraph=True)):
            with pytest.raises(error, match=message):
                call(q, k, v, **keywords)
    for keywords, error, message in ((dict(causal=""), ValueError, "causal must be"),
                                     (dict(window=(-2 ** 63, 2)), ValueError, "window left"),
                                     (dict(dropout_p=None), TypeError, "dropout_p must be"),
                                     (dict(dropout_p=0.1, dropout_seed=None), TypeError, "dropout_seed must be"),
                                     (dict(layout=None), ValueError, "layout"),
                                     (dict(bogus=1), TypeError, "bogus")):
        with pytest.raises(error, match=message):
            cupy_attn.torch.attention(q, k, v, **keywords)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cupy_attn.torch.attention(q, k, v, deterministic="yes")


def test_torch_compile_takes_none_for_a_mod_and_breaks_the_graph_only_where_it_must():
    """score_mod=None (a model passing its optional block mask along) stays in the graph; a
    generator= or a seed past int64 breaks it, with a reason naming it under fullgraph."""
    q = torch.randn(1, 2, 9, 8)
    for keywords in (dict(score_mod=None), dict(mask_mod=None, block_mask=None)):
        torch.compile(lambda q: cupy_attn.torch.attention(q, q, q, **keywords), fullgraph=True)(q)
    for keywords, reason in ((lambda: dict(generator=torch.Generator().manual_seed(1)), "torch.Generator"),
                             (lambda: dict(dropout_seed=2 ** 63 + 1), "past int64")):
        def call(q, keywords):
            return cupy_attn.torch.attention(q, q, q, dropout_p=0.5, **keywords)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(call)(q, keywords()), call(q, keywords()))  # the same mask either way
        torch._dynamo.reset()
        with pytest.raises(Exception, match=reason):
            torch.compile(call, fullgraph=True)(q, keywords())


def test_torch_compile_varlen_with_lengths_computed_in_the_graph():
    """FlashAttention's pattern: max_seqlen from cu_seqlens inside the compiled function, a
    symbolic int there (capture_scalar_outputs), stays in the graph."""
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q = torch.randn(8, 2, 4)

    def packed(q, cu):
        longest = int((cu[1:] - cu[:-1]).max())
        return cupy_attn.torch.attention_varlen(q, q, q, cu, cu, longest, longest, causal=True)

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        got = torch.compile(packed, fullgraph=True)(q, cu)
    assert torch.equal(got, packed(q, cu))


def test_torch_compile_reports_a_wrong_rank_as_the_api_does():
    """The fake implementations run first under torch.compile: a q of the wrong rank gets the
    API's message there, not an IndexError from indexing its shape."""
    cu = torch.tensor([0, 1], dtype=torch.int32)
    for fn, q in ((lambda q: cupy_attn.torch.attention(q, q, q), torch.randn(7, 8)),
                  (lambda q: cupy_attn.torch.attention_varlen(q, q, q, cu, cu, 1, 1), torch.randn(8))):
        for call in (fn, torch.compile(fn, fullgraph=True)):
            with pytest.raises(Exception, match=r"q must be [34]-D .*, got shape \((7, )?8,?\)"):
                call(q)


def test_torch_export_records_the_operator():
    """torch.export traces a module through the operator: the exported program holds one
    cupy_attn.attention node and computes what the module does."""

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return cupy_attn.torch.attention(q, k, v, causal=True, window=(3, None), softcap=5.0)

    q, k, v = (t.detach() for t in compile_case()[:3])
    program = torch.export.export(Attend(), (q, k, v))
    calls = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert torch.ops.cupy_attn.attention.default in calls
    assert torch.equal(program.module()(q, k, v), Attend()(q, k, v))


def test_the_plain_api_on_tensors_inside_a_compiled_function_is_a_graph_break():
    """torch.compile does not trace into cupy_attn's plain functions (it failed inside Dynamo on
    their DLPack exchange): each call is a graph break, run as eagerly, a KV cache written as
    eagerly, a score_mod's NumPy twin run by Python, not compiled; under fullgraph=True the error
    names the function; torch.export refuses it, pointing to cupy_attn.torch."""
    q, k, v, _, keywords = compile_case(requires_grad=False)
    attend = lambda q, k, v: cupy_attn.attention(q, k, v, **keywords) + 1  # noqa: E731
    torch._dynamo.reset()
    assert torch.equal(torch.compile(attend)(q, k, v), attend(q, k, v))
    k_cache, v_cache = torch.zeros(2, 16, 2, 8, dtype=torch.float64), torch.zeros(2, 16, 2, 5, dtype=torch.float64)
    new_k, new_v = k.transpose(1, 2)[:, :3], v.transpose(1, 2)[:, :3]

    def decode(q):
        return cupy_attn.attention_with_kvcache(q, k_cache, v_cache, new_k, new_v, cache_seqlens=torch.tensor(
            [4, 0], dtype=torch.int32), causal=True)

    got = torch.compile(decode)(q.transpose(1, 2)[:, :3])
    for cache, new in ((k_cache, new_k), (v_cache, new_v)):  # entry 0 appends at 4, entry 1 at 0
        assert torch.equal(cache[0, 4:7], new[0]) and torch.equal(cache[1, :3], new[1])
    assert torch.equal(got, decode(q.transpose(1, 2)[:, :3]))

    traced = []  # whether Dynamo was tracing the twin: it must run as plain Python
    halve = cupy_attn.ScoreMod("score * 0.5f", lambda s, b, h, q_idx, kv_idx: traced.append(
        torch.compiler.is_compiling()) or s * 0.5)
    modded = lambda q: cupy_attn.attention(q, q, q, score_mod=halve) * 2  # noqa: E731
    assert torch.equal(torch.compile(modded)(q), modded(q)) and traced and not any(traced)

    keep = lambda x: x * torch.from_numpy(cupy_attn.dropout_mask((2, 4, 7, 8), 0.5, 3))  # noqa: E731
    assert torch.equal(torch.compile(keep)(q), keep(q))  # NumPy inside: Dynamo failed on it too

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"(?s)torch.compiler.disable.*<function attention "):
        torch.compile(attend, fullgraph=True)(q, k, v)

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return attend(q, k, v)

    with pytest.raises(TypeError, match=r"q is a FakeTensor without data .*cupy_attn.torch.attention"):
        torch.export.export(Attend(), (q, k, v), strict=False)
    with pytest.raises(Exception, match=r"<function attention "):
        torch.export.export(Attend(), (q, k, v), strict=True)


def test_the_plain_api_under_torch_compile_compiles_no_frame_of_its_own():
    """Dynamo must not compile the wrappers' shared frame: its guards (function, dtype, shape)
    would use up the recompile limit for every cupy_attn function together."""
    from cupy_attn import _interop

    def f(x):
        heads = cupy_attn.split_heads(x, 2)
        return cupy_attn.merge_heads(cupy_attn.attention(heads, heads, heads) + 1) * 2

    compiled = torch.compile(f)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for rows in (3, 4, 5):
            x = torch.randn(1, rows, 8, dtype=dtype)
            assert torch.equal(compiled(x), f(x))
    assert not torch._dynamo.eval_frame._debug_get_cache_entry_list(_interop._wrapper_code)


COLD_PROCESS = """
import sys, torch, cupy_attn
q = torch.randn(1, 2, 5, 4)
attend = lambda q: cupy_attn.attention(q, q, q, causal=True) * 2
if sys.argv[1] == "fullgraph":
    import cupy_attn.torch  # makes the graph break's copies, so the error names the function
    try:
        torch.compile(attend, fullgraph=True)(q)
    except Exception as e:
        print("refused:", "<function attention " in str(e))
else:
    print("equal:", torch.equal(torch.compile(attend)(q), attend(q)))
"""


@pytest.mark.parametrize("mode", ["fullgraph", "graph break"])
def test_a_process_whose_first_call_is_inside_torch_compile(mode):
    """The first tensor cupy_attn ever sees may come while Dynamo traces: the call is still a
    graph break (run as eagerly), and with cupy_attn.torch imported, fullgraph's error names it."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", COLD_PROCESS, mode], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == ("refused: True" if mode == "fullgraph" else "equal: True"), result.stderr[-3000:]


def test_pinned_host_tensors_run_on_the_numpy_backend(monkeypatch):
    """torch reports a pinned CPU tensor (pin_memory(), a DataLoader's pinned batches) as DLPack's
    CUDA-host device: host memory, which the NumPy backend reads as any (pinning itself needs
    CUDA: here every CPU tensor reports itself pinned). bfloat16 crosses as its int16 bits."""
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, 2, 5, 8).to(dtype) for _ in range(3))
        want = cupy_attn.torch.attention(q, k, v, kv_lengths=torch.tensor([4]))
        with monkeypatch.context() as patched:
            patched.setattr(torch.Tensor, "is_pinned", lambda self, *args, **kwargs: self.device.type == "cpu")
            assert q.__dlpack_device__()[0] == 3
            got = cupy_attn.attention(q, k, v, kv_lengths=torch.tensor([4]))
        assert got.dtype == dtype and torch.equal(got, want)

