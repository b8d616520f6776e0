"""PyTorch CUDA tensors and JAX GPU arrays through cupy_attn (marked gpu)."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
pytest.importorskip("cupy")

import cupy_attn  # noqa: E402
import cupy_attn.torch  # noqa: E402

needs_torch_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="PyTorch has no CUDA device")


@needs_torch_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_torch_cuda_against_sdpa(dtype, causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 777, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    out = cupy_attn.torch.attention(q, k, v, causal=causal)
    assert out.device.type == "cuda" and out.dtype == dtype
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    # SDPA in float32 (top-left causal equals bottom-right here: Sq = Sk)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=causal)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
    tol = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r, atol=5 * tol, rtol=5 * tol)


@needs_torch_cuda
def test_torch_compile_on_cuda_tensors():
    """The custom operators in a compiled graph on the GPU (fullgraph: no graph break), values and
    gradients equal to the eager adapter's. aot_eager runs Dynamo, the fake implementations and
    AOTAutograd, as Inductor does, without spending device minutes compiling Triton kernels."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    keywords = dict(causal=True, kv_lengths=torch.tensor([300, 123], device="cuda"), deterministic=True)
    loss = lambda q, k, v: cupy_attn.torch.attention(q, k, v, **keywords).float().square().sum()  # noqa: E731
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(loss(q, k, v), (q, k, v))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@needs_torch_cuda
def test_torch_non_default_stream():
    torch.manual_seed(1)
    q, k, v = (torch.randn(4, 8, 2048, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        q2 = q * 1  # work queued on the side stream that the attention must wait for
        out = cupy_attn.attention(q2, k, v)
        result = out.float() + 0  # consumed on the same stream without synchronising
    torch.cuda.synchronize()
    torch.testing.assert_close(result, want, atol=4e-3, rtol=4e-3)


@needs_torch_cuda
def test_pinned_host_tensors():
    """Pinned CPU tensors (DLPack's CUDA-host device: a DataLoader's pin_memory batches) run on
    the NumPy backend as any CPU tensor, bfloat16 included; a pinned lengths tensor beside CUDA
    tensors is refused by name (the small arrays live where the tensors do)."""
    torch.manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, 2, 40, 16, dtype=dtype).pin_memory() for _ in range(3))
        lengths = torch.tensor([33]).pin_memory()
        assert q.__dlpack_device__()[0] == 3
        out = cupy_attn.attention(q, k, v, kv_lengths=lengths)
        assert out.device.type == "cpu" and out.dtype == dtype
        torch.testing.assert_close(out, cupy_attn.attention(q.clone(), k.clone(), v.clone(), kv_lengths=[33]))
    with pytest.raises(TypeError, match="kv_lengths is a numpy array but the other inputs are cupy arrays"):
        cupy_attn.attention(*(x.cuda() for x in (q, k, v)), kv_lengths=lengths)


def test_jax_gpu_arrays():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    import jax.numpy as jnp

    import cupy_attn.jax

    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 4, 300, 64)).astype(np.float32)) for _ in range(3))
    out = cupy_attn.attention(q, k, v, causal=True)
    assert isinstance(out, jax.Array) and out.devices() == q.devices()
    want = cupy_attn.reference.attention(*(np.asarray(x) for x in (q, k, v)), causal=True)[0]
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)
    g = jax.grad(lambda q: cupy_attn.jax.attention(q, k, v, causal=True).sum())(q)
    assert g.shape == q.shape
    with pytest.raises(NotImplementedError, match="outside jax.jit on the GPU"):
        jax.jit(lambda q: cupy_attn.jax.attention(q, k, v))(q)
