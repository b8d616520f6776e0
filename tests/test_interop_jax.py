"""JAX arrays through cupy_attn: eager calls, jax.grad, and jax.jit on the CPU."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import cupy_attn  # noqa: E402
import cupy_attn.jax  # noqa: E402
from cupy_attn import _interop, reference  # noqa: E402
from helpers import BF16, assert_close  # noqa: E402


def arrays(dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 4, 37, 16)).astype(dtype)
    k = rng.standard_normal((2, 2, 50, 16)).astype(dtype)
    v = rng.standard_normal((2, 2, 50, 8)).astype(dtype)
    return (q, k, v), tuple(jnp.asarray(x) for x in (q, k, v))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=str)
def test_attention_and_backward(dtype):
    (q, k, v), (jq, jk, jv) = arrays(dtype)
    kw = dict(causal=True, kv_lengths=np.array([50, 31]))
    out, lse = cupy_attn.attention(jq, jk, jv, return_lse=True, **dict(kw, kv_lengths=jnp.asarray(kw["kv_lengths"])))
    assert isinstance(out, jax.Array) and out.dtype == jq.dtype
    want_out, want_lse = reference.attention(q, k, v, **kw)
    assert_close(np.asarray(out), want_out, np.dtype(dtype))
    assert_close(np.asarray(lse), want_lse, np.dtype(dtype))
    dout = jnp.asarray(np.random.default_rng(1).standard_normal(out.shape).astype(dtype))
    grads = cupy_attn.attention_backward(dout, jq, jk, jv, out, lse, **kw)
    for g, w in zip(grads, reference.attention_gradients(np.asarray(dout), q, k, v, **kw)):
        assert isinstance(g, jax.Array)
        assert_close(np.asarray(g), w, np.dtype(dtype), grad=True)


def loss(q, k, v, mask):
    return (cupy_attn.jax.attention(q, k, v, causal=True, mask=mask, softcap=4.0) ** 2).sum()


def test_grad_eager_and_jit_agree_with_reference():
    (q, k, v), (jq, jk, jv) = arrays()
    mask = np.random.default_rng(2).random((37, 50)) < 0.9
    eager = jax.grad(loss, argnums=(0, 1, 2))(jq, jk, jv, jnp.asarray(mask))
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jq, jk, jv, jnp.asarray(mask))
    out, _ = reference.attention(q, k, v, causal=True, mask=mask, softcap=4.0)
    want = reference.attention_gradients(2 * out, q, k, v, causal=True, mask=mask, softcap=4.0)
    for e, j, w in zip(eager, jitted, want):
        np.testing.assert_array_equal(np.asarray(e), np.asarray(j))
        assert_close(np.asarray(e), w, np.dtype(np.float32), grad=True)


def test_jit_forward_and_vmap():
    (q, k, v), (jq, jk, jv) = arrays()
    f = jax.jit(lambda q, k, v: cupy_attn.jax.attention(q, k, v, window=(4, 4)))
    want, _ = reference.attention(q, k, v, window=(4, 4))
    assert_close(np.asarray(f(jq, jk, jv)), want, np.dtype(np.float32))
    batched = jax.vmap(lambda q, k, v: cupy_attn.jax.attention(q[None], k[None], v[None])[0])(jq, jk, jv)
    assert_close(np.asarray(batched), reference.attention(q, k, v)[0], np.dtype(np.float32))


def test_plain_attention_refuses_tracers_clearly():
    (_, (jq, jk, jv)) = arrays()
    with pytest.raises(TypeError, match="q is a traced JAX value .*use cupy_attn.jax.attention"):
        jax.jit(lambda q: cupy_attn.attention(q, jk, jv))(jq)
    # the head helpers reshape in JAX itself, so they trace
    np.testing.assert_array_equal(jax.jit(lambda x: cupy_attn.split_heads(x, 2))(jq[0]),
                                  cupy_attn.split_heads(jq[0], 2))


def test_arguments_are_checked_as_the_api_checks_them():
    (_, (jq, jk, jv)) = arrays()
    for run in (cupy_attn.jax.attention, jax.jit(cupy_attn.jax.attention)):  # before any shape is read
        with pytest.raises(ValueError, match=r"q must be 4-D \(B, H, S, D\) for layout 'bhsd', got shape"):
            run(jq[0], jk, jv)
    np.testing.assert_array_equal(cupy_attn.jax.attention(jq, jk, jv, scale=1 / jnp.sqrt(4.0)),
                                  cupy_attn.jax.attention(jq, jk, jv, scale=0.5))  # a concrete 0-d array
    np.testing.assert_array_equal(cupy_attn.jax.attention(jq, jk, jv, window=(jnp.int32(2), None)),
                                  cupy_attn.jax.attention(jq, jk, jv, window=(2, None)))
    with pytest.raises(TypeError, match="scale is a traced JAX value"):
        jax.jit(lambda q, s: cupy_attn.jax.attention(q, jk, jv, scale=s))(jq, 0.5)
    with pytest.raises(TypeError, match="window must be a Python value"):
        cupy_attn.jax.attention(jq, jk, jv, window=np.array([2, 2]))
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cupy_attn.jax.attention(jq, jk, jv, deterministic="no")


def test_return_lse_is_refused():
    (_, (jq, jk, jv)) = arrays()
    with pytest.raises(TypeError, match="does not take return_lse"):
        cupy_attn.jax.attention(jq, jk, jv, return_lse=True)


def test_zero_copy_on_the_cpu():
    j = jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4)
    assert _interop.to_backend(j).ctypes.data == j.unsafe_buffer_pointer()
    # JAX imports a NumPy buffer in place when it is 64-byte aligned (its own requirement).
    raw = np.zeros(64 * 4 + 64, np.uint8)
    n = raw[-raw.ctypes.data % 64:][:64 * 4].view(np.float32).reshape(4, 16)
    assert n.ctypes.data % 64 == 0
    assert _interop.to_framework("jax", n).unsafe_buffer_pointer() == n.ctypes.data


def test_head_helpers_take_jax_arrays():
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 9, 24)).astype(np.float32))
    heads = cupy_attn.split_heads(x, 3)
    assert isinstance(heads, jax.Array) and heads.shape == (2, 3, 9, 8)
    np.testing.assert_array_equal(np.asarray(cupy_attn.merge_heads(heads)), np.asarray(x))
    w = [jnp.asarray(np.random.default_rng(i).standard_normal((24, 24)).astype(np.float32) / 5) for i in range(4)]
    y = cupy_attn.multi_head_attention(x, *w, 3)
    assert isinstance(y, jax.Array) and y.shape == (2, 9, 24)


def test_varlen_grad_eager_and_jit_agree_with_reference():
    rng = np.random.default_rng(4)
    cu_q, cu_k = np.array([0, 5, 5, 12], np.int32), np.array([0, 7, 9, 9], np.int32)
    q, k, v = (rng.standard_normal((n, h, 8)).astype(np.float32) for n, h in ((12, 4), (9, 2), (9, 2)))

    def loss(q, k, v, cu_q, cu_k):
        return (cupy_attn.jax.attention_varlen(q, k, v, cu_q, cu_k, 7, 7, causal=True) ** 2).sum()

    args = tuple(jnp.asarray(x) for x in (q, k, v, cu_q, cu_k))
    eager = jax.grad(loss, argnums=(0, 1, 2))(*args)
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    out, lse = cupy_attn.attention_varlen(q, k, v, cu_q, cu_k, 7, 7, causal=True, return_lse=True)
    want = cupy_attn.attention_varlen_backward(2 * out, q, k, v, out, lse, cu_q, cu_k, 7, 7, causal=True)
    for e, j, w in zip(eager, jitted, want):
        np.testing.assert_array_equal(np.asarray(e), np.asarray(j))
        assert_close(np.asarray(e), w, np.dtype(np.float32), grad=True)


def test_sinks_get_their_gradient_eager_and_jit():
    (q, k, v), (jq, jk, jv) = arrays()
    sinks = np.array([0.5, -1.0, 0.0, 2.0], np.float32)

    def loss(q, sinks):
        return (cupy_attn.jax.attention(q, jk, jv, causal=True, sinks=sinks) ** 2).sum()

    eager = jax.grad(loss, argnums=(0, 1))(jq, jnp.asarray(sinks))
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1)))(jq, jnp.asarray(sinks))
    out, _ = reference.attention(q, k, v, causal=True, sinks=sinks)
    want = reference.attention_gradients(2 * out, q, k, v, causal=True, sinks=sinks)
    for e, j, w in zip(eager, jitted, (want[0], want[3])):
        np.testing.assert_array_equal(np.asarray(e), np.asarray(j))
        assert_close(np.asarray(e), w, np.dtype(np.float32), grad=True)


def test_differentiating_a_mask_or_slopes_is_refused_eager_and_jit():
    """jax.grad with respect to a mask or ALiBi slopes would get a zero that is not their gradient
    (none is computed): refused, naming the array; constant ones, and gradients for q beside them,
    are unaffected."""
    (q, k, v), (jq, jk, jv) = arrays()
    mask = jnp.asarray(np.random.default_rng(1).standard_normal((1, 4, 37, 50)).astype(np.float32))
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625])

    def loss(q, mask, slopes):
        return (cupy_attn.jax.attention(q, jk, jv, mask=mask, alibi_slopes=slopes) ** 2).sum()

    for argnum, name in ((1, "mask"), (2, "alibi_slopes")):
        for grad in (jax.grad(loss, argnums=argnum), jax.jit(jax.grad(loss, argnums=argnum))):
            with pytest.raises(TypeError, match=rf"no gradient for {name} .*stop_gradient\({name}\)"):
                grad(jq, mask, slopes)
    # a mask computed from a differentiated value is differentiated too
    with pytest.raises(TypeError, match="no gradient for mask"):
        jax.grad(lambda t: loss(jq, mask * t, slopes))(1.0)
    eager = jax.grad(loss)(jq, mask, slopes)
    stopped = jax.grad(lambda q, m: loss(q, jax.lax.stop_gradient(m), slopes), argnums=(0, 1))(jq, mask)
    np.testing.assert_array_equal(np.asarray(stopped[0]), np.asarray(eager))
    assert not np.asarray(stopped[1]).any()
    out, _ = reference.attention(q, k, v, mask=np.asarray(mask), alibi_slopes=np.asarray(slopes))
    want = reference.attention_gradients(2 * out, q, k, v, mask=np.asarray(mask), alibi_slopes=np.asarray(slopes))
    assert_close(np.asarray(eager), want[0], np.dtype(np.float32), grad=True)


def test_dropout_key_eager_and_jit_agree_with_reference():
    (q, k, v), (jq, jk, jv) = arrays()
    key = jax.random.key(3)

    def loss(q, key):
        return (cupy_attn.jax.attention(q, jk, jv, causal=True, dropout_p=0.2, dropout_key=key) ** 2).sum()

    low, high = (int(w) for w in np.asarray(jax.random.bits(key, (2,), jnp.uint32)))
    kw = dict(causal=True, dropout_p=0.2, dropout_seed=(high << 32) | low)
    out, _ = reference.attention(q, k, v, **kw)
    want = reference.attention_gradients(2 * out, q, k, v, **kw)[0]
    eager = jax.grad(loss)(jq, key)
    jitted = jax.jit(jax.grad(loss))(jq, key)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))
    assert_close(np.asarray(eager), want, np.dtype(np.float32), grad=True)
    forward = jax.jit(lambda key: cupy_attn.jax.attention(jq, jk, jv, dropout_p=0.2, dropout_key=key))
    assert not np.allclose(forward(jax.random.key(3)), forward(jax.random.key(4)))
    np.testing.assert_array_equal(cupy_attn.jax.attention(jq, jk, jv, dropout_p=0.2, dropout_seed=kw["dropout_seed"]),
                                  forward(key))
    # any integer type, as cupy_attn.attention takes it
    np.testing.assert_array_equal(cupy_attn.jax.attention(jq, jk, jv, dropout_p=0.2,
                                                          dropout_seed=np.uint64(kw["dropout_seed"])), forward(key))


def test_dropout_needs_a_key():
    _, (jq, jk, jv) = arrays()
    with pytest.raises(TypeError, match="dropout_p > 0 needs dropout_key"):
        cupy_attn.jax.attention(jq, jk, jv, dropout_p=0.1)
    with pytest.raises(TypeError, match="dropout_key or dropout_seed, not both"):
        cupy_attn.jax.attention(jq, jk, jv, dropout_p=0.1, dropout_key=jax.random.key(0), dropout_seed=1)
    with pytest.raises(TypeError, match=r"dropout_seed must be an int in \[0, 2\*\*64\) \(or pass dropout_key\), got float"):
        cupy_attn.jax.attention(jq, jk, jv, dropout_p=0.1, dropout_seed=1.0)
    with pytest.raises(ValueError, match=r"dropout_seed must be in \[0, 2\*\*64\), got -1"):
        cupy_attn.jax.attention(jq, jk, jv, dropout_p=0.1, dropout_seed=-1)
