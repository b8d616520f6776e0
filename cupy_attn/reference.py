"""The naive float64 reference the tests compare every backend against.

It materialises the full (B, H, Sq, Sk) score matrix and builds every mask from explicit
per-batch index comparisons, written independently of the tiled backends. Use it for small
problems only: memory is O(B·H·Sq·Sk) in float64.
"""
from __future__ import annotations

import numpy as np

from . import mods
from ._arrays import minus_infinity_below, require_array
from ._philox import dropout_mask
from ._problem import make_problem


def _problem_and_inputs(q, k, v, kwargs):
    p = make_problem(q, k, v, **kwargs)
    if p.xp is not np:
        raise TypeError("cupy_attn.reference works on NumPy arrays only")

    def bhsd(x):
        x = np.asarray(x, dtype=np.float64)
        return x if p.layout == "bhsd" else x.transpose(0, 2, 1, 3)

    k64 = np.repeat(bhsd(k), p.groups, axis=1)  # kv head of query head h is h // G
    v64 = np.repeat(bhsd(v), p.groups, axis=1)
    return p, bhsd(q), k64, v64, bhsd


def _allowed_and_biases(p):
    """Bool (B, H, Sq, Sk) of allowed pairs and the additive float64 biases: ALiBi's and the float
    mask's (a score_mod comes between them)."""
    allowed = np.ones((p.batch, p.heads, p.seq_q, p.seq_k), dtype=bool)
    bias = np.zeros(allowed.shape)
    mask_bias = 0.0
    for b in range(p.batch):
        q_len = p.seq_q if p.q_lengths is None else int(p.q_lengths[b])
        kv_len = p.seq_k if p.kv_lengths is None else int(p.kv_lengths[b])
        off = 0 if p.causal == "top_left" else kv_len - q_len
        i = np.arange(p.seq_q)[:, None]
        j = np.arange(p.seq_k)[None, :]
        ok = (i < q_len) & (j < kv_len)
        if p.causal is not None:
            ok &= j <= i + off
        if p.window is not None:
            left, right = p.window
            if left is not None:
                ok &= j >= i + off - left
            if right is not None:
                ok &= j <= i + off + right
        allowed[b] &= ok
        if p.alibi_slopes is not None:
            bias[b] -= np.asarray(p.alibi_slopes[b], np.float64)[:, None, None] * np.abs(i + off - j)
    if p.mask is not None:
        if p.mask.dtype == bool:
            allowed &= p.mask
        else:
            mask_bias = np.asarray(p.mask, dtype=np.float64)
    if p.mask_mod is not None:
        allowed &= mods.twin(p.mask_mod, *_indices(p), shape=allowed.shape)
    return allowed, bias, mask_bias


def _indices(p):
    """b, h, q_idx, kv_idx broadcasting to (B, H, Sq, Sk)."""
    return (np.arange(p.batch)[:, None, None, None], np.arange(p.heads)[None, :, None, None],
            np.arange(p.seq_q)[:, None], np.arange(p.seq_k))


def _probabilities(p, q64, k64):
    """P (B, H, Sq, Sk), lse (B, H, Sq) and d(score)/d(q·kᵀ·scale) for the softcap chain rule."""
    raw = np.einsum("bhid,bhjd->bhij", q64, k64) * p.scale
    capped = raw if p.softcap is None else p.softcap * np.tanh(raw / p.softcap)
    slope = np.ones_like(raw) if p.softcap is None else 1 - np.tanh(raw / p.softcap) ** 2
    allowed, bias, mask_bias = _allowed_and_biases(p)
    modified = capped + bias
    if p.score_mod is not None:  # the oracle differentiates the twin whatever grad says
        slope = slope * mods.derivative(p.score_mod, modified, *_indices(p))
        modified = mods.twin(p.score_mod, modified, *_indices(p), shape=modified.shape, scores_dtype=p.compute_dtype,
                             where=allowed).astype(np.float64)
    s = np.where(allowed, modified + mask_bias, -np.inf)
    if p.score_mod is not None or (p.mask is not None and p.mask.dtype != bool):
        s[s < minus_infinity_below(p.dtype)] = -np.inf  # as the kernels' base 2 takes them
    row_max = s.max(axis=-1, keepdims=True, initial=-np.inf)
    sink = None if p.sinks is None else np.asarray(p.sinks, np.float64)[None, :, None, None]
    if sink is not None:  # a sink joins the denominator only: exp(sink) with no value
        row_max = np.maximum(row_max, sink)
    # A row that attends nothing has max -inf: probabilities 0, lse -inf. A NaN or +inf score (NaN
    # or inf in the inputs) makes its row's sum NaN: probabilities and lse NaN, never a row taken
    # for empty (kernels/softmax.cuh, lse).
    alive = row_max != -np.inf
    with np.errstate(invalid="ignore"):
        e = np.where(alive, np.exp(s - np.where(alive, row_max, 0)), 0.0)
        total = e.sum(axis=-1, keepdims=True)
        if sink is not None:
            total = total + np.exp(sink - row_max)
    seen = total != 0
    prob = np.divide(e, total, out=np.zeros_like(e), where=seen)
    with np.errstate(divide="ignore"):
        lse = np.where(seen[..., 0], row_max[..., 0] + np.log(np.where(seen, total, 1)[..., 0]), -np.inf)
    return prob, lse, slope


def _dropout_factor(p):
    """Z / (1 − p) (B, H, Sq, Sk): what each probability is multiplied by after the softmax (1
    without dropout); the keep-mask Z is `cupy_attn.dropout_mask`'s."""
    if p.dropout is None:
        return 1.0
    keep = dropout_mask((p.batch, p.heads, p.seq_q, p.seq_k), p.dropout.p, p.dropout.seed, p.dropout.offset)
    return keep / (1.0 - p.dropout.p)


def _to_layout(p, x):
    return x if p.layout == "bhsd" else x.transpose(0, 2, 1, 3)


def attention(q, k, v, **kwargs):
    """Naive float64 attention: returns (out, lse) with out in q's layout, both float64.

    Takes the keywords of `cupy_attn.attention` (except return_lse and backend).
    """
    p, q64, k64, v64, _ = _problem_and_inputs(q, k, v, kwargs)
    prob, lse, _ = _probabilities(p, q64, k64)
    return _to_layout(p, (prob * _dropout_factor(p)) @ v64), lse


def attention_gradients(dout, q, k, v, **kwargs):
    """Analytic float64 gradients (dq, dk, dv) of sum(out · dout), in the inputs' layout, and
    dsinks (H,) after them when sinks are given."""
    p, q64, k64, v64, bhsd = _problem_and_inputs(q, k, v, kwargs)
    require_array("dout", dout, np)
    if tuple(dout.shape) != p.out_shape:
        raise ValueError(f"dout must have the output's shape {p.out_shape}, got {tuple(dout.shape)}")
    prob, lse, slope = _probabilities(p, q64, k64)
    do = bhsd(dout)
    factor = _dropout_factor(p)  # out = (P ∘ factor)·v: dv and dP each carry the factor once
    dv = np.einsum("bhij,bhid->bhjd", prob * factor, do)
    dp = np.einsum("bhid,bhjd->bhij", do, v64) * factor
    ds = prob * (dp - (dp * prob).sum(axis=-1, keepdims=True)) * slope * p.scale
    dq = np.einsum("bhij,bhjd->bhid", ds, k64)
    dk = np.einsum("bhij,bhid->bhjd", ds, q64)

    def group_sum(x):  # (B, H, Sk, D) -> (B, Hkv, Sk, D): a kv head serves G query heads
        return x.reshape(p.batch, p.kv_heads, p.groups, *x.shape[2:]).sum(axis=2)

    grads = _to_layout(p, dq), _to_layout(p, group_sum(dk)), _to_layout(p, group_sum(dv))
    if p.sinks is None:
        return grads
    # d lse_i / d sink = P_sink,i = exp(sink − lse_i), and out_i = Σ_j P_ij v_j loses that share:
    # dL/dsink = −Σ_i P_sink,i · Σ_j P_ij dP_ij = −Σ_i P_sink,i · rowsum(dO ∘ O)_i.
    delta = (dp * prob).sum(axis=-1)
    p_sink = np.exp(np.asarray(p.sinks, np.float64)[None, :, None] - lse)
    return grads + (-(p_sink * delta).sum(axis=(0, 2)),)
