"""The NumPy backend: the tiled online-softmax algorithm of the CUDA kernels, on the CPU.

Queries of one key/value head are folded into the row dimension: a query tile of q becomes
(B, Hkv, G·m, D) with G = H / Hkv, so GQA/MQA needs no copy of K or V and the backward's sum of
dK/dV over a head group falls out of one matrix product. Work is split into tiles of
``BLOCK_M`` query positions × ``BLOCK_N`` keys (all batch entries and heads at once); only one
score tile exists at any time, so memory is O(B·H·Sq·D + B·H·BLOCK_M·BLOCK_N)
rather than O(B·H·Sq·Sk). Causal, window and length masks are generated per tile from indices,
and tiles nobody may attend are skipped (about half of them under causal masking).

Tiles run one after another: BLAS already spreads each matrix product over the cores, and
worker threads on top of it measured slower (they oversubscribe the cores).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import mods
from ._arrays import minus_infinity_below
from ._problem import Problem

# Tile sizes, read at call time so tests can shrink them to cross many tiles on small inputs.
# At (B, H, D) = (1, 8, 64), S = 4096 on 2 cores, 512 × 256 was among the fastest; 128-query
# tiles were 35% slower (Python overhead per tile) and larger tiles no faster. A float32 score
# tile of B·H = 8 is then 4 MiB.
BLOCK_M = 512
BLOCK_N = 256


def _to_bhsd(problem: Problem, x):
    return x if problem.layout == "bhsd" else x.transpose(0, 2, 1, 3)


def _from_bhsd(problem: Problem, x, dtype):
    """(B, H, S, D) in the compute dtype -> the caller's layout and dtype, C-contiguous."""
    if problem.layout == "bshd":
        x = x.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(x, dtype=dtype)


def _grouped(problem: Problem, x, scale=None):
    """(B, H, Sq, X) in the caller's layout -> (B, Hkv, G, Sq, X) C-contiguous, compute dtype."""
    p = problem
    x = np.ascontiguousarray(_to_bhsd(p, x), dtype=p.compute_dtype)
    if scale is not None:
        x = x * x.dtype.type(scale)
    return x.reshape(p.batch, p.kv_heads, p.groups, p.seq_q, x.shape[-1])


def _query_tiles(problem: Problem):
    m = BLOCK_M
    return [(i0, min(i0 + m, problem.seq_q)) for i0 in range(0, problem.seq_q, m)]


class _Tiles:
    """Everything a (query tile, key tile) pair needs to produce its scores; shared by the
    forward and the backward."""

    def __init__(self, problem: Problem, q, k, v, *, backward: bool = False):
        p = self.p = problem
        self.backward = backward  # the scores' chain-rule factor is then needed
        b, hkv, g, sq = p.batch, p.kv_heads, p.groups, p.seq_q
        # The scale is folded into q once (O(S·D)) instead of into every score (O(S²)).
        self.q = _grouped(p, q, p.scale)  # (B, Hkv, G, Sq, D)
        self.k = np.ascontiguousarray(_to_bhsd(p, k), dtype=p.compute_dtype)  # (B, Hkv, Sk, D)
        self.v = np.ascontiguousarray(_to_bhsd(p, v), dtype=p.compute_dtype)  # (B, Hkv, Sk, Dv)
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
        # A float mask's or a score_mod's scores below this are -inf, as in the kernels' base 2.
        self.masking_floor = minus_infinity_below(p.dtype) if (
            p.score_mod is not None or (self.mask is not None and not self.mask_is_bool)) else None
        # b and the query head h for score_mod and mask_mod, whose twins see a tile as (B, H, m, n),
        # as the reference shows them the whole (B, H, Sq, Sk): query head h = kv head · G + g, the
        # order of (B, Hkv, G, m, n), so the two shapes are reshapes of each other.
        self.b4 = np.arange(b)[:, None, None, None]
        self.h4 = np.arange(p.heads)[None, :, None, None]

    def mod_indices(self, i0: int, i1: int, j0: int, j1: int):
        """b, h, q_idx, kv_idx as arrays broadcasting to a tile's (B, H, m, n)."""
        return self.b4, self.h4, np.arange(i0, i1)[:, None], np.arange(j0, j1)

    def rows(self, x5, i0: int, i1: int):
        """(B, Hkv, G, Sq, X) -> the query tile's rows (B, Hkv, G·m, X)."""
        b, hkv, g = x5.shape[:3]
        return x5[:, :, :, i0:i1].reshape(b, hkv, g * (i1 - i0), x5.shape[-1])

    def allowed(self, i0: int, i1: int, j0: int, j1: int):
        """Bool (B|1, Hkv|1, G|1, m, n) of who may attend whom in the tile, None if all may."""
        p, j = self.p, np.arange(j0, j1)
        diag = self.diag[:, i0:i1]
        keep = None

        def both(a, b):
            return b if a is None else a & b

        if p.causal:
            keep = both(keep, j <= diag)
        if p.window is not None:
            left, right = p.window
            if left is not None:
                keep = both(keep, j >= diag - left)
            if right is not None:
                keep = both(keep, j <= diag + right)
        if self.kv_len is not None:
            keep = both(keep, j < self.kv_len)
        if self.q_len is not None:
            keep = both(keep, np.arange(i0, i1)[None, :, None] < self.q_len)
        if keep is not None:
            keep = keep[:, None, None]
        if self.mask_is_bool:
            keep = both(keep, self.mask[:, :, :, i0:i1, j0:j1])
        if p.mask_mod is not None:
            shape = (p.batch, p.heads, i1 - i0, j1 - j0)
            allowed = mods.twin(p.mask_mod, *self.mod_indices(i0, i1, j0, j1), shape=shape)
            keep = both(keep, allowed.reshape(p.batch, p.kv_heads, p.groups, i1 - i0, j1 - j0))
        return keep

    def scores(self, q_rows, i0: int, i1: int, j0: int, j1: int):
        """Scores of the tile as (B, Hkv, G·m, n) with masked entries -inf, and (in the backward)
        d score / d(q·k·scale) through the softcap and the score_mod, or None where that is 1;
        None instead of both if nobody may attend."""
        p = self.p
        keep = self.allowed(i0, i1, j0, j1)
        if keep is not None and not keep.any():
            return None
        s = q_rows @ self.k[:, :, j0:j1].swapaxes(-1, -2)
        s5 = s.reshape(p.batch, p.kv_heads, p.groups, i1 - i0, j1 - j0)  # a view of s
        chain = None
        if p.softcap is not None:
            tanh = np.tanh(s5 / p.softcap)
            np.multiply(tanh, p.softcap, out=s5)
            chain = 1 - tanh * tanh  # d/dx c·tanh(x/c)
        if self.slopes is not None:
            distance = np.abs(self.diag[:, i0:i1] - np.arange(j0, j1)).astype(s.dtype)  # |i + off - j|
            s5 -= self.slopes * distance[:, None, None]
        if p.score_mod is not None:
            indices = self.mod_indices(i0, i1, j0, j1)
            s4 = s.reshape(p.batch, p.heads, i1 - i0, j1 - j0)  # a view of s, as the twin sees the tile
            if self.backward and p.score_mod.grad != "additive":
                slope = mods.derivative(p.score_mod, s4.astype(np.float64), *indices).reshape(s5.shape)
                chain = slope if chain is None else chain * slope
            where = None if keep is None else np.broadcast_to(keep, s5.shape).reshape(s4.shape)
            s4[...] = mods.twin(p.score_mod, s4, *indices, shape=s4.shape, scores_dtype=s4.dtype, where=where)
        if chain is not None:
            chain = np.broadcast_to(chain, s5.shape).astype(s.dtype).reshape(s.shape)
        if self.mask is not None and not self.mask_is_bool:
            with np.errstate(over="ignore"):  # a float64 mask below float32's range: -inf, which masks
                s5 += self.mask[:, :, :, i0:i1, j0:j1]
        if self.masking_floor is not None:
            np.copyto(s5, -np.inf, where=s5 < self.masking_floor)
        if keep is not None:
            np.copyto(s5, -np.inf, where=~keep)
        return s, chain

    def dropout_factor(self, i0: int, i1: int, j0: int, j1: int):
        """Z / (1 − p) of the tile as (B, Hkv, G·m, n) in the compute dtype (Z the keep-mask of
        cupy_attn._philox), or None without dropout."""
        p = self.p
        if p.dropout is None:
            return None
        keep = p.dropout.keep_tile(p.batch, p.heads, i0, i1, j0, j1)  # (B, H, m, n)
        factor = np.where(keep, p.compute_dtype.type(p.dropout.scale), p.compute_dtype.type(0))
        return factor.reshape(p.batch, p.kv_heads, p.groups * (i1 - i0), j1 - j0)

    def key_tiles(self, q_rows, i0: int, i1: int):
        """(j0, j1, scores, chain-rule factor) for every key tile this query tile may attend (with a
        block mask, only the key tiles some (b, h) of it needs)."""
        starts = range(0, self.p.seq_k, BLOCK_N)
        if self.p.block_mask is not None:
            nonempty = self.p.block_mask.tiles(BLOCK_M, BLOCK_N)[0][:, :, i0 // BLOCK_M]
            starts = [j0 for j0, needed in zip(starts, nonempty.any(axis=(0, 1))) if needed]
        for j0 in starts:
            j1 = min(j0 + BLOCK_N, self.p.seq_k)
            tile = self.scores(q_rows, i0, i1, j0, j1)
            if tile is not None:
                yield (j0, j1) + tile


def entry_problem(problem: Problem, b: int, **fields) -> Problem:
    """Batch entry b of ``problem`` on its own (B = 1, its ALiBi slopes, no lengths: ``fields``
    give its sequence lengths and layout), for the paths that attend entry by entry."""
    slopes = None if problem.alibi_slopes is None else problem.alibi_slopes[b:b + 1]
    return dataclasses.replace(problem, batch=1, q_lengths=None, kv_lengths=None, alibi_slopes=slopes, **fields)


def _sequences(problem: Problem):
    """A packed batch as one single-sequence problem per sequence: (problem, q rows, kv rows)."""
    p = problem
    cu_q, cu_k = (np.asarray(cu, dtype=np.int64) for cu in (p.packing.cu_seqlens_q, p.packing.cu_seqlens_k))
    for b in range(p.batch):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = entry_problem(p, b, layout="bshd", seq_q=int(cu_q[b + 1] - cu_q[b]), seq_k=int(cu_k[b + 1] - cu_k[b]),
                            packing=None)
        yield one, rows_q, rows_k


def _packed_forward(problem: Problem, q, k, v):
    """Sequence by sequence: nothing is padded, and no sequence sees another's rows."""
    p = problem
    out = np.empty(p.out_shape, dtype=p.dtype)
    lse = np.empty(p.lse_shape, dtype=p.compute_dtype)
    for one, rows_q, rows_k in _sequences(p):
        o, l = forward(one, q[None, rows_q], k[None, rows_k], v[None, rows_k])
        out[rows_q], lse[:, rows_q] = o[0], l[0]
    return out, lse


def _packed_backward(problem: Problem, dout, q, k, v, out, lse):
    p = problem
    dq, dk, dv = (np.empty(x.shape, dtype=p.dtype) for x in (q, k, v))
    for one, rows_q, rows_k in _sequences(p):
        dq[rows_q], dk[rows_k], dv[rows_k] = (g[0] for g in backward(
            one, dout[None, rows_q], q[None, rows_q], k[None, rows_k], v[None, rows_k], out[None, rows_q],
            lse[None, :, rows_q]))
    return dq, dk, dv


def forward(problem: Problem, q, k, v):
    if problem.packing is not None:
        return _packed_forward(problem, q, k, v)
    p = problem
    t = _Tiles(p, q, k, v)
    out = np.empty((p.batch, p.kv_heads, p.groups, p.seq_q, p.head_dim_v), dtype=p.compute_dtype)
    lse = np.empty((p.batch, p.kv_heads, p.groups, p.seq_q, 1), dtype=p.compute_dtype)
    for i0, i1 in _query_tiles(p):
        q_rows = t.rows(t.q, i0, i1)
        rows = q_rows.shape[:3]
        row_max = np.full(rows + (1,), -np.inf, dtype=p.compute_dtype)
        row_sum = np.zeros(rows + (1,), dtype=p.compute_dtype)
        if p.sinks is not None:  # each row starts with its head's sink: max = sink, sum = exp(0)
            heads = p.sinks.reshape(1, p.kv_heads, p.groups, 1)
            row_max[...] = np.broadcast_to(heads, (p.batch, p.kv_heads, p.groups, i1 - i0)).reshape(rows + (1,))
            row_sum[...] = 1
        acc = np.zeros(rows + (p.head_dim_v,), dtype=p.compute_dtype)
        for j0, j1, s, _ in t.key_tiles(q_rows, i0, i1):
            new_max = np.maximum(row_max, s.max(axis=-1, keepdims=True))
            # A row that has seen only masked keys keeps max -inf; shifting by 0 instead avoids
            # exp(-inf - -inf) = NaN, and its exps are exp(-inf) = 0 either way.
            shift = np.where(new_max == -np.inf, 0, new_max)
            s -= shift
            np.exp(s, out=s)
            rescale = np.exp(row_max - shift)
            row_sum *= rescale
            row_sum += s.sum(axis=-1, keepdims=True)
            acc *= rescale
            factor = t.dropout_factor(i0, i1, j0, j1)
            if factor is not None:  # after the row sum: the softmax is that of every key
                s *= factor
            acc += s @ t.v[:, :, j0:j1]
            row_max = new_max
        # Fully masked rows have row_sum 0 and acc 0 (all their exps were 0): dividing by 1
        # instead keeps their output 0 rather than 0/0 = NaN, and their lse is -inf. A NaN sum
        # (NaN or inf in the row's inputs) stays NaN, lse too (kernels/softmax.cuh, lse).
        seen = row_sum != 0
        safe_sum = np.where(seen, row_sum, 1)
        acc /= safe_sum
        shape5 = (p.batch, p.kv_heads, p.groups, i1 - i0)
        out[:, :, :, i0:i1] = acc.reshape(shape5 + (p.head_dim_v,))
        with np.errstate(divide="ignore"):
            lse[:, :, :, i0:i1] = np.where(seen, row_max + np.log(safe_sum), -np.inf).reshape(shape5 + (1,))
    bhsd = (p.batch, p.heads, p.seq_q)
    return _from_bhsd(p, out.reshape(bhsd + (p.head_dim_v,)), p.dtype), lse.reshape(bhsd)


def backward(problem: Problem, dout, q, k, v, out, lse):
    if problem.packing is not None:
        return _packed_backward(problem, dout, q, k, v, out, lse)
    p = problem
    t = _Tiles(p, q, k, v, backward=True)
    ct = p.compute_dtype
    dout = _grouped(p, dout)  # (B, Hkv, G, Sq, Dv)
    delta = np.einsum("...d,...d->...", dout, _grouped(p, out))[..., None]  # rowsum(dO ∘ O)
    # Fully masked rows have lse -inf and only -inf scores; shifting by 0 gives P = 0, not NaN.
    lse = np.asarray(lse, dtype=ct).reshape(p.batch, p.kv_heads, p.groups, p.seq_q, 1)
    lse = np.where(lse == -np.inf, 0, lse)
    dq = np.empty(t.q.shape, dtype=ct)
    dk = np.zeros(t.k.shape, dtype=ct)
    dv = np.zeros(t.v.shape, dtype=ct)
    for i0, i1 in _query_tiles(p):
        q_rows, do_rows = t.rows(t.q, i0, i1), t.rows(dout, i0, i1)
        lse_rows, delta_rows = t.rows(lse, i0, i1), t.rows(delta, i0, i1)
        dq_rows = np.zeros(q_rows.shape, dtype=ct)
        for j0, j1, s, chain in t.key_tiles(q_rows, i0, i1):
            s -= lse_rows
            prob = np.exp(s, out=s)  # P = exp(s - lse), recomputed from the saved lse
            factor = t.dropout_factor(i0, i1, j0, j1)  # out = (P ∘ factor)·V
            dropped = prob if factor is None else prob * factor
            dv[:, :, j0:j1] += dropped.swapaxes(-1, -2) @ do_rows  # also sums over a head group
            ds = do_rows @ t.v[:, :, j0:j1].swapaxes(-1, -2)  # dP
            if factor is not None:
                ds *= factor
            ds -= delta_rows
            ds *= prob  # dS = P ∘ (dP - delta)
            if chain is not None:
                ds *= chain  # through the softcap and the score_mod
            dq_rows += ds @ t.k[:, :, j0:j1]
            dk[:, :, j0:j1] += ds.swapaxes(-1, -2) @ q_rows  # q_rows carries the scale
        dq[:, :, :, i0:i1] = dq_rows.reshape(p.batch, p.kv_heads, p.groups, i1 - i0, p.head_dim)
    dq *= ct.type(p.scale)
    bhsd = (p.batch, p.heads, p.seq_q, p.head_dim)
    grads = _from_bhsd(p, dq.reshape(bhsd), p.dtype), _from_bhsd(p, dk, p.dtype), _from_bhsd(p, dv, p.dtype)
    if p.sinks is None:
        return grads
    return grads + (sink_gradient(np, p.sinks, lse.reshape(p.batch, p.heads, p.seq_q), delta.reshape(p.batch, p.heads, p.seq_q)),)


def sink_gradient(xp, sinks, lse, delta):
    """dL/dsinks (H,) from the forward's lse and delta = rowsum(dO ∘ O), both (B, H, Sq): a sink
    takes the share P_sink = exp(sink − lse) of its row and carries no value, so
    dL/dsink_h = −Σ_{b,i} P_sink · delta (as for any score: dS = P·(dP − delta), with dP = 0).
    Both backends use it; lse is finite wherever a sink is (lse >= sink). The kernels' lse, taken
    in base 2, may lie an ulp below the sink, which near the sinks' bound (1.7e38) is a distance
    of 1e31: exp of that would be inf, and inf · delta (0 in a dead row) NaN, so P_sink is taken
    at most 1, as the exact lse makes it."""
    return -(xp.exp(xp.minimum(sinks[None, :, None] - lse, 0)) * delta).sum(axis=(0, 2))
