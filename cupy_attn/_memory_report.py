"""Shared-memory wavefronts and global sectors of the tensor-core kernels and the decoding kernel,
measured on the emulator (`python -m cupy_attn kernels --memory`): each kernel runs once on a small problem with
the emulator's memory counters on (cupy_attn.emulator.counting), and every counted access site
reports what its warp-wide accesses took against the conflict-free (coalesced) minimum.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from . import _kernel_backend, api, emulator

# B = 1, H = 2 over one KV head (GQA), 128 queries and keys: two query and two key tiles of 64,
# so the steady state of every loop runs; fp16.
SHAPE = dict(batch=1, heads=2, kv_heads=1, seq=128)
FAMILIES = {"mma.sync": 80, "wgmma": 90}


@contextmanager
def _family(capability: int):
    saved = _kernel_backend.EMULATOR_COMPUTE_CAPABILITY
    _kernel_backend.EMULATOR_COMPUTE_CAPABILITY = capability
    try:
        yield
    finally:
        _kernel_backend.EMULATOR_COMPUTE_CAPABILITY = saved


def _inputs(head_dim: int):
    rng = np.random.default_rng(head_dim)
    b, h, hkv, s = SHAPE["batch"], SHAPE["heads"], SHAPE["kv_heads"], SHAPE["seq"]
    q = rng.standard_normal((b, h, s, head_dim)).astype(np.float16)
    k, v = (rng.standard_normal((b, hkv, s, head_dim)).astype(np.float16) for _ in range(2))
    return q, k, v, rng.standard_normal(q.shape).astype(np.float16)


def memory_report(head_dims=(64, 128), families=tuple(FAMILIES), decode: bool = True) -> list[dict]:
    """One row per (family, head dim, pass, kernel): totals and per-site counts; the tensor-core
    families, and with ``decode`` the decoding kernel (family "decode")."""
    rows = []
    for family in families:
        for d in head_dims:
            q, k, v, dout = _inputs(d)
            with _family(FAMILIES[family]):
                runs = {}
                with emulator.counting() as runs["forward"]:
                    out, lse = api.attention(q, k, v, return_lse=True, backend="emulator")
                for mode, deterministic in (("backward, atomic dQ", False), ("backward, deterministic dQ", True)):
                    with emulator.counting() as runs[mode]:
                        api.attention_backward(dout, q, k, v, out, lse, backend="emulator", deterministic=deterministic)
            for pass_, counters in runs.items():
                rows += _rows(family, d, pass_, counters)
    if decode:
        for d in head_dims:
            rows += _rows("decode", d, "one step, paged cache", _decode_counters(d))
    return rows


def _rows(family: str, head_dim: int, pass_: str, counters) -> list[dict]:
    """One row per kernel of a counted run."""
    rows = []
    for kernel in counters.kernels():
        totals = counters.totals(kernel)
        sites = [s for s in counters.sites if s.kernel == kernel]
        rows.append({
            "family": family, "head_dim": head_dim, "pass": pass_, "kernel": kernel,
            "smem_wavefronts": totals["shared"]["actual"], "smem_ideal": totals["shared"]["ideal"],
            "gmem_sectors": totals["global"]["actual"], "gmem_ideal": totals["global"]["ideal"],
            "sites": [{"site": s.site, "space": s.space, "accesses": s.accesses, "actual": s.actual,
                       "ideal": s.ideal} for s in sites],
        })
    return rows


def _decode_counters(head_dim: int):
    """The decoding kernel (attention_with_kvcache) counted on one fp16 decoding step: B = 1, 8
    query heads on one kv head, 128 cached keys in shuffled pages of 16, one split."""
    from .kvcache import attention_with_kvcache

    rng = np.random.default_rng(head_dim)
    k_cache, v_cache = (rng.standard_normal((8, 16, 1, head_dim)).astype(np.float16) for _ in range(2))
    q = rng.standard_normal((1, 1, 8, head_dim)).astype(np.float16)
    table = rng.permutation(8)[None].astype(np.int32)
    with emulator.counting() as counters:
        attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=128, block_table=table, num_splits=1,
                               backend="emulator")
    return counters


def ratio(actual: int, ideal: int) -> float:
    return actual / ideal if ideal else 1.0
