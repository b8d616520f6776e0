"""The NumPy backend: the tiled online-softmax algorithm of the CUDA kernels, on the CPU.

Queries of one key/value head are folded into the row dimension: q (B, H, Sq, D) becomes
(B, Hkv, G·Sq, D) with G = H / Hkv, so GQA/MQA needs no copy of K or V and the backward's
sum of dK/dV over a head group falls out of one matrix product. Keys are visited in blocks of
``block_n``; only a (B, Hkv, G·Sq, block_n) score tile exists at any time, so memory is
O(B·H·Sq·(D + block_n)) rather than O(B·H·Sq·Sk). Causal, window and length masks are generated
per tile from indices, and tiles nobody may attend are skipped.
"""
from __future__ import annotations

import numpy as np

from ._problem import Problem

# Keys per tile: large enough that the Python loop is cheap, small enough for the cache. Read at
# call time, so tests can shrink it to exercise many tiles on small inputs.
BLOCK_N = 256


def _to_bhsd(problem: Problem, x):
    return x if problem.layout == "bhsd" else x.transpose(0, 2, 1, 3)


def _from_bhsd(problem: Problem, x, dtype):
    """(B, H, S, D) in the compute dtype -> the caller's layout and dtype, C-contiguous."""
    if problem.layout == "bshd":
        x = x.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(x, dtype=dtype)


class _Tiles:
    """Everything a key tile needs to produce its scores; shared by forward and backward."""

    def __init__(self, problem: Problem, q, k, v, block_n: int):
        p = problem
        self.p, self.block_n = p, block_n
        ct = p.compute_dtype
        b, hkv, g, sq = p.batch, p.kv_heads, p.groups, p.seq_q
        self.q = np.ascontiguousarray(_to_bhsd(p, q), dtype=ct).reshape(b, hkv, g * sq, p.head_dim)
        self.k = np.ascontiguousarray(_to_bhsd(p, k), dtype=ct)  # (B, Hkv, Sk, D)
        self.v = np.ascontiguousarray(_to_bhsd(p, v), dtype=ct)  # (B, Hkv, Sk, Dv)
        q_len = sq if p.q_lengths is None else p.q_lengths
        kv_len = p.seq_k if p.kv_lengths is None else p.kv_lengths
        # Query i lines up with key i + off: bottom-right alignment on the valid lengths.
        off = 0 if p.causal == "top_left" else np.asarray(kv_len) - np.asarray(q_len)
        self.diag = np.arange(sq)[None, :, None] + np.reshape(off, (-1, 1, 1))  # (B|1, Sq, 1)
        self.q_len = None if p.q_lengths is None else p.q_lengths[:, None, None]
        self.kv_len = None if p.kv_lengths is None else p.kv_lengths[:, None, None]
        self.slopes = None if p.alibi_slopes is None else p.alibi_slopes.reshape(b, hkv, g, 1, 1)
        self.mask = None
        if p.mask is not None:
            full = p.mask.reshape((1,) * (4 - p.mask.ndim) + p.mask.shape)
            # A broadcast view: splitting H into (Hkv, G) keeps it a view, nothing is materialised.
            self.mask = np.broadcast_to(full, (b, p.heads, sq, p.seq_k)).reshape(b, hkv, g, sq, p.seq_k)
        self.mask_is_bool = self.mask is not None and self.mask.dtype == np.bool_

    def allowed(self, j0: int, j1: int):
        """Bool (B|1, Hkv|1, G|1, Sq, n) of who may attend keys [j0, j1), or None if everyone may."""
        p, j = self.p, np.arange(j0, j1)
        keep = None

        def both(a, b):
            return b if a is None else a & b

        if p.causal:
            keep = both(keep, j <= self.diag)
        if p.window is not None:
            left, right = p.window
            if left is not None:
                keep = both(keep, j >= self.diag - left)
            if right is not None:
                keep = both(keep, j <= self.diag + right)
        if self.kv_len is not None:
            keep = both(keep, j < self.kv_len)
        if self.q_len is not None:
            keep = both(keep, np.arange(p.seq_q)[None, :, None] < self.q_len)
        if keep is not None:
            keep = keep[:, None, None]
        if self.mask_is_bool:
            keep = both(keep, self.mask[..., j0:j1])
        return keep

    def scores(self, j0: int, j1: int):
        """Scores of keys [j0, j1) as (B, Hkv, G·Sq, n), masked entries -inf, and the softcap's
        tanh (for the backward's chain rule) or None; None instead of both if nothing may attend."""
        p = self.p
        keep = self.allowed(j0, j1)
        if keep is not None and not keep.any():
            return None
        s = self.q @ self.k[:, :, j0:j1].swapaxes(-1, -2)
        s *= p.scale
        s5 = s.reshape(p.batch, p.kv_heads, p.groups, p.seq_q, j1 - j0)  # a view of s
        tanh = None
        if p.softcap is not None:
            tanh = np.tanh(s5 / p.softcap)
            np.multiply(tanh, p.softcap, out=s5)
            tanh = tanh.reshape(s.shape)
        if self.slopes is not None:
            distance = np.abs(self.diag - np.arange(j0, j1)).astype(s.dtype)  # |i + off - j|
            s5 -= self.slopes * distance[:, None, None]
        if self.mask is not None and not self.mask_is_bool:
            s5 += self.mask[..., j0:j1]
        if keep is not None:
            np.copyto(s5, -np.inf, where=~keep)
        return s, tanh

    def tiles(self):
        for j0 in range(0, self.p.seq_k, self.block_n):
            j1 = min(j0 + self.block_n, self.p.seq_k)
            tile = self.scores(j0, j1)
            if tile is not None:
                yield j0, j1, tile


def forward(problem: Problem, q, k, v):
    p = problem
    t = _Tiles(p, q, k, v, BLOCK_N)
    rows = t.q.shape[:3]
    row_max = np.full(rows, -np.inf, dtype=p.compute_dtype)
    row_sum = np.zeros(rows, dtype=p.compute_dtype)
    acc = np.zeros(rows + (p.head_dim_v,), dtype=p.compute_dtype)
    for j0, j1, (s, _) in t.tiles():
        new_max = np.maximum(row_max, s.max(axis=-1))
        # A row that has seen only masked keys keeps max -inf; shifting by 0 instead avoids
        # exp(-inf - -inf) = NaN, and its exps are exp(-inf) = 0 either way.
        shift = np.where(new_max == -np.inf, 0, new_max)
        s -= shift[..., None]
        np.exp(s, out=s)
        rescale = np.exp(row_max - shift)
        row_sum *= rescale
        row_sum += s.sum(axis=-1)
        acc *= rescale[..., None]
        acc += s @ t.v[:, :, j0:j1]
        row_max = new_max
    # Fully masked rows have row_sum 0 and acc 0 (all their exps were 0): dividing by 1 instead
    # keeps their output 0 rather than 0/0 = NaN, and their lse is -inf.
    seen = row_sum > 0
    safe_sum = np.where(seen, row_sum, 1)
    acc /= safe_sum[..., None]
    with np.errstate(divide="ignore"):
        lse = np.where(seen, row_max + np.log(safe_sum), -np.inf)
    shape = (p.batch, p.heads, p.seq_q)
    out = _from_bhsd(p, acc.reshape(shape + (p.head_dim_v,)), p.dtype)
    return out, lse.reshape(shape).astype(p.compute_dtype)


def backward(problem: Problem, dout, q, k, v, out, lse):
    p = problem
    t = _Tiles(p, q, k, v, BLOCK_N)
    ct, rows = p.compute_dtype, t.q.shape[:3]
    dout = np.ascontiguousarray(_to_bhsd(p, dout), dtype=ct).reshape(rows + (p.head_dim_v,))
    out = np.ascontiguousarray(_to_bhsd(p, out), dtype=ct).reshape(rows + (p.head_dim_v,))
    delta = np.einsum("...d,...d->...", dout, out)[..., None]  # rowsum(dO ∘ O)
    # Fully masked rows have lse -inf and only -inf scores; shifting by 0 gives P = 0, not NaN.
    lse = np.asarray(lse, dtype=ct).reshape(rows)
    lse = np.where(lse == -np.inf, 0, lse)[..., None]
    dq = np.zeros(t.q.shape, dtype=ct)
    dk = np.zeros(t.k.shape, dtype=ct)
    dv = np.zeros(t.v.shape, dtype=ct)
    for j0, j1, (s, tanh) in t.tiles():
        s -= lse
        prob = np.exp(s, out=s)  # P = exp(s - lse), recomputed from the saved lse
        dv[:, :, j0:j1] = prob.swapaxes(-1, -2) @ dout  # sums over the G heads of a group too
        ds = dout @ t.v[:, :, j0:j1].swapaxes(-1, -2)  # dP
        ds -= delta
        ds *= prob  # dS = P ∘ (dP - delta)
        if tanh is not None:
            ds *= 1 - tanh * tanh  # d/dx c·tanh(x/c) = 1 - tanh²
        ds *= p.scale
        dq += ds @ t.k[:, :, j0:j1]
        dk[:, :, j0:j1] = ds.swapaxes(-1, -2) @ t.q
    bhsd = (p.batch, p.heads, p.seq_q, p.head_dim)
    return (_from_bhsd(p, dq.reshape(bhsd), p.dtype), _from_bhsd(p, dk, p.dtype), _from_bhsd(p, dv, p.dtype))
