"""Every set of score features the launcher can choose (_config.FEATURE_SETS: softcap, ALiBi, a
bool or a float mask, dropout, in any combination) is its own build. Each one compiles under
NVRTC for the mma.sync forward and dK/dV kernels, differs from every other (no bit is ignored),
and runs the fp16 mma.sync forward on the emulator against the float64 reference. The features'
code is one pair of headers (kernels/mask.cuh, dropout.cuh) for every kernel family; each family's
own tests run the features on it."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import cupy_attn
from cupy_attn import _compile, _config, _kernel_backend, _nvrtc, _problem, reference
from helpers import assert_close, random_qkv

B, H, SQ, SK, D = 1, 2, 33, 150, 32  # three key tiles of 64: interior and boundary ones
FORWARD = _config.forward_tile(D, D, np.float16)
DKDV = _config.backward_tile(D, D, np.float16)
IDS = [_config.feature_words(f) for f in _config.FEATURE_SETS]


def keywords(features: int, rng) -> dict:
    """A call that uses exactly these features."""
    kw = {}
    if features & _config.SOFTCAP:
        kw["softcap"] = 3.0
    if features & _config.ALIBI:
        kw["alibi_slopes"] = rng.uniform(0, 0.3, H)
    if features & _config.BOOL_MASK:
        kw["mask"] = rng.random((SQ, SK)) < 0.7
    if features & _config.FLOAT_MASK:
        mask = rng.standard_normal((1, H, SQ, SK))
        mask[rng.random(mask.shape) < 0.2] = -np.inf
        kw["mask"] = mask.astype(np.float32)
    if features & _config.DROPOUT:
        kw.update(dropout_p=0.2, dropout_seed=11)
    return kw


def test_the_sets_are_every_combination_with_at_most_one_mask_kind():
    bits = list(_config.FEATURE_BITS.values())
    assert sorted(_config.FEATURE_SETS) == sorted(
        sum(b for i, b in enumerate(bits) if n >> i & 1) for n in range(2 ** len(bits))
        if not (n >> bits.index(_config.BOOL_MASK) & 1 and n >> bits.index(_config.FLOAT_MASK) & 1))
    for bad in (_config.BOOL_MASK | _config.FLOAT_MASK, 32, -1):
        with pytest.raises(ValueError, match="features must be"):
            _compile.feature_options(bad)


@pytest.mark.parametrize("filename, name", [(FORWARD.filename, FORWARD.name_expression(np.float16)),
                                            (DKDV.filename, DKDV.name_expression(np.float16))])
def test_every_set_compiles_and_changes_the_code(filename, name):
    """PTX for a virtual architecture (NVVM, no ptxas: the compile report checks registers and
    spills of its representative builds), two programs at a time."""
    def ptx(features):
        options = _compile.gpu_build_options(filename, features)
        return _nvrtc.compile_kernel(_compile.kernel_source(filename), name, "compute_80", options).ptx

    with ThreadPoolExecutor(2) as pool:
        texts = list(pool.map(ptx, _config.FEATURE_SETS))
    assert all(".entry" in t and "trap;" in t for t in texts)
    assert len(set(texts)) == len(texts), "two feature sets built the same code"


@pytest.fixture(scope="module")
def forward_builds():
    """The forward's emulator build of every set, two g++ runs at a time."""
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda f: _compile.function("emulator", FORWARD.filename, FORWARD.name_expression(np.float16),
                                                  features=f), _config.FEATURE_SETS))


@pytest.mark.parametrize("features", _config.FEATURE_SETS, ids=IDS)
def test_every_set_runs_on_the_emulator(forward_builds, features):
    rng = np.random.default_rng(features)
    q, k, v = random_qkv(rng, b=B, h=H, sq=SQ, sk=SK, d=D, dtype=np.float16)
    kw = dict(keywords(features, rng), causal=True, kv_lengths=[131])
    assert _kernel_backend.score_features(_problem.make_problem(q, k, v, backend="emulator", **kw)) == features
    out, lse = cupy_attn.attention(q, k, v, backend="emulator", return_lse=True, **kw)
    want_out, want_lse = reference.attention(q, k, v, **kw)
    assert_close(out, want_out, np.float16, what="out")
    assert_close(lse, want_lse, np.float16, what="lse")
