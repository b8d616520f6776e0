"""Head dims up to 576 (MLA's D; Dv alike), D and Dv independent, on every kernel family (fp32
CUDA cores, mma.sync, wgmma where the table sends them) and the NumPy backend, forward and both
backward modes, against the float64 reference; and the limits around them."""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import _config, _kernel_backend
from helpers import BF16, check_forward_and_backward, random_qkv
from test_kernel_forward import poisoned_outputs  # noqa: F401 (fixture)

# The shapes: the MLA and Gemma-class widths, a wide value head with a narrower key head,
# and the smallest.
HEAD_DIMS = [(512, 512), (576, 512), (192, 128), (256, 512), (8, 8), (1, 1)]
KERNEL_DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]


@pytest.mark.parametrize("d, dv", HEAD_DIMS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_kernels(rng, d, dv, dtype):
    q, k, v = random_qkv(rng, b=1, h=2, hkv=1, sq=21, sk=35, d=d, dv=dv, dtype=dtype)
    kw = dict(causal=True, sinks=np.array([0.3, -0.5], np.float32), scale=1.0 / np.sqrt(d))
    for deterministic in (False, True):
        check_forward_and_backward("emulator", rng, q, k, v, kw, dtype, deterministic=deterministic)


@pytest.mark.parametrize("d, dv", [(576, 512), (320, 64)])
def test_wide_heads_with_every_feature_on_sm90(rng, monkeypatch, d, dv):
    """On compute capability 9.0 heads above 256 leave the wgmma kernels for the mma.sync ones."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    assert isinstance(_config.forward_tile(d, dv, BF16, 90), _config.TensorCoreTile)
    q, k, v = random_qkv(rng, b=2, h=2, sq=9, sk=40, d=d, dv=dv, dtype=BF16, layout="bshd")
    kw = dict(layout="bshd", window=(7, 2), softcap=20.0, alibi_slopes=[0.1, 0.3], kv_lengths=[40, 17],
              mask=rng.random((2, 1, 9, 40)) < 0.8, dropout_p=0.2, dropout_seed=9)
    check_forward_and_backward("emulator", rng, q, k, v, kw, BF16)


@pytest.mark.parametrize("d, dv", [(576, 512), (1000, 3)])
def test_numpy_backend_takes_any_head_dim(rng, d, dv):
    q, k, v = random_qkv(rng, b=1, h=2, sq=6, sk=11, d=d, dv=dv, dtype=np.float32)
    check_forward_and_backward("numpy", rng, q, k, v, dict(causal=True), np.dtype(np.float32))


def test_value_dims_run_in_slices_of_the_tile(rng, monkeypatch):
    """Dv = 512 on the wide tensor-core tile: two launches of 256 value dims, each writing its half
    of out (the poisoned output shows any element left unwritten) and the same lse."""
    launched = []
    original = _kernel_backend._launch

    def spy(target, filename, name, grid, args, *rest, **kw):
        if name.startswith("attention_fwd_tc"):
            launched.append((name, args[2].shape[-1], args[3].shape[-1]))  # v's and out's slices
        return original(target, filename, name, grid, args, *rest, **kw)

    monkeypatch.setattr(_kernel_backend, "_launch", spy)
    q, k, v = random_qkv(rng, b=1, h=1, sq=5, sk=7, d=576, dv=512, dtype=np.float16)
    check_forward_and_backward("emulator", rng, q, k, v, {}, np.dtype(np.float16))
    assert launched == [(_config.TENSOR_CORE_TILES[-1].name_expression(np.float16), 256, 256)] * 2


def test_head_dims_above_the_widest_tile_are_refused(rng):
    q, k, v = random_qkv(rng, b=1, h=1, sq=3, sk=3, d=577, dv=8, dtype=np.float16)
    with pytest.raises(ValueError, match=r"head dims up to 576 .* got D = 577, Dv = 8; use backend='numpy'"):
        cupy_attn.attention(q, k, v, backend="emulator")
    q, k, v = random_qkv(rng, b=1, h=1, sq=3, sk=3, d=8, dv=600, dtype=np.float32)
    with pytest.raises(ValueError, match="got D = 8, Dv = 600"):
        cupy_attn.attention(q, k, v, backend="emulator")


def test_the_decoding_kernel_keeps_its_own_limit(rng):
    q = rng.standard_normal((1, 1, 2, 320)).astype(np.float16)
    cache = np.zeros((1, 8, 1, 320), np.float16)
    with pytest.raises(ValueError, match=r"head dims up to 256 are supported by these CUDA kernels, got D = 320"):
        cupy_attn.attention_with_kvcache(q, cache, cache, cache_seqlens=np.array([4], np.int32), backend="emulator")
