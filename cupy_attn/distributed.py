"""Context parallelism: ring attention over a sequence sharded across ranks (MPI or NCCL).

Each of P ranks holds a shard of the sequence, q (B, H, S/P, D), k (B, Hkv, S/P, D), v (B, Hkv,
S/P, Dv) (or the same in layout "bshd"), cut from the full sequence by `shard`. K/V blocks travel
around the ring, rank r → r + 1, in P − 1 steps; each rank attends its queries to every block
with `cupy_attn.attention(..., return_lse=True)` while the next block is in flight, and merges
the partial (out, lse) exactly (`cupy_attn._merge`). The backward runs the same ring with dK/dV
travelling with their blocks and returning to their owner. Results equal single-process
`attention` / `attention_backward` on the whole sequence, up to rounding.

Causal attention on contiguous shards leaves rank 0 almost idle and rank P − 1 with all the
work; the default layout, "zigzag", cuts the sequence into 2P chunks and gives rank r chunks r
and 2P − 1 − r, so that every rank does the same work. "striped" deals tokens round-robin
(rank r holds tokens r, r + P, r + 2P, …), balanced as well; "contiguous" gives rank r the r-th
of P equal chunks.

Importing this module imports neither mpi4py nor CuPy.
"""
from __future__ import annotations

import numpy as np

from . import _backends, _merge, _ring
from ._arrays import FLOAT_DTYPES, check_flag, compute_dtype, count_argument, describe, require_array
from ._problem import check_backward_inputs, check_choice, make_problem
from .api import attention, attention_backward

LOAD_BALANCES = ("zigzag", "contiguous", "striped")
SEQ_AXIS = {"bhsd": 2, "bshd": 1}
_ALL = slice(None)


def positions(rank, size, seq_len, *, load_balance="zigzag") -> np.ndarray:
    """The global positions (int64, ascending) of the tokens rank ``rank`` of ``size`` holds, in
    the order its shard holds them: e.g. for rotary embeddings of a sharded sequence.

    seq_len must be a multiple of 2·size for "zigzag" (2·size equal chunks, rank r holds chunks r
    and 2·size − 1 − r) and of size for "contiguous" (rank r holds chunk r of size) and
    "striped" (rank r holds positions r, r + size, r + 2·size, …); ValueError otherwise.
    """
    load_balance = check_choice("load_balance", load_balance, LOAD_BALANCES)
    size, seq_len = count_argument("size", size, 1), count_argument("seq_len", seq_len)
    if not count_argument("rank", rank) < size:
        raise ValueError(f"rank must be an int in [0, {size}), got {rank!r}")
    chunks = 2 * size if load_balance == "zigzag" else size
    if seq_len % chunks:
        raise ValueError(f"a sequence of length {seq_len} cannot be sharded over {size} ranks with load_balance="
                         f"{load_balance!r}: the length must be a multiple of {chunks}"
                         + (" (2 · ranks equal chunks)" if load_balance == "zigzag" else " (one equal part per rank)"))
    if load_balance == "striped":
        return np.arange(rank, seq_len, size, dtype=np.int64)
    c = seq_len // chunks
    owned = (rank, 2 * size - 1 - rank) if load_balance == "zigzag" else (rank,)
    return np.concatenate([np.arange(i * c, (i + 1) * c, dtype=np.int64) for i in owned])


def shard(x, rank, size, *, layout="bhsd", load_balance="zigzag"):
    """The part of x, a full sequence, that rank ``rank`` of ``size`` holds (a new contiguous
    array of x's library and dtype).

    x: (B, H, S, D) in layout "bhsd", (B, S, H, D) in "bshd"; lse (B, H, S) is sharded with
    layout "bhsd" in either layout (its S axis is axis 2). The shard holds the S/P positions
    `positions` lists, in that order. S must divide as `positions` says (ValueError otherwise).
    """
    layout = check_choice("layout", layout, tuple(SEQ_AXIS))
    xp = require_array("x", x)
    axis = _seq_axis("x", x, layout)
    index = positions(rank, size, x.shape[axis], load_balance=load_balance)
    return xp.take(x, xp.asarray(index), axis=axis)


def unshard(shards, *, layout="bhsd", load_balance="zigzag"):
    """The full sequence from the shards of every rank (a list or tuple in rank order): the
    inverse of `shard`. Returns a new array of the shards' library and dtype."""
    layout = check_choice("layout", layout, tuple(SEQ_AXIS))
    if not isinstance(shards, (list, tuple)) or not shards:
        raise TypeError(f"shards must be a non-empty list or tuple of arrays (one per rank), got {describe(shards)}")
    xp = require_array("shards[0]", shards[0])
    axis = _seq_axis("shards[0]", shards[0], layout)
    for i, s in enumerate(shards[1:], 1):
        require_array(f"shards[{i}]", s, xp)
        if s.shape != shards[0].shape or s.dtype != shards[0].dtype:
            raise ValueError(f"shards[{i}] is {describe(s)} but shards[0] is {describe(shards[0])}; every rank's shard "
                             "must have one shape and dtype")
    size = len(shards)
    seq_len = size * shards[0].shape[axis]
    held = np.concatenate([positions(r, size, seq_len, load_balance=load_balance) for r in range(size)])
    return xp.take(xp.concatenate(shards, axis=axis), xp.asarray(np.argsort(held)), axis=axis)


def _seq_axis(name: str, x, layout: str) -> int:
    if x.ndim != 4 and not (x.ndim == 3 and layout == "bhsd"):
        order = "(B, H, S, D)" if layout == "bhsd" else "(B, S, H, D)"
        raise ValueError(f"{name} must be 4-D {order} (or an lse (B, H, S) with layout 'bhsd'), got shape "
                         f"{tuple(x.shape)}")
    return SEQ_AXIS[layout]


def _pieces(causal: bool, load_balance: str, rank: int, source: int, n: int):
    """What rank ``rank``'s queries see of rank ``source``'s keys: a list of (query rows, key
    rows, causal) in local positions (n of each), each one call of `attention` — the whole
    block, its causal diagonal, or nothing (an empty list: the block is skipped). Never a mask.

    Key at global position j is visible to the query at i iff j <= i."""
    if not causal:
        return [(_ALL, _ALL, False)]
    if source == rank:
        # In every layout a shard's global positions increase with its local index, so j <= i
        # globally iff locally: the block is its own causal diagonal (for zigzag, chunk
        # 2P − 1 − r sees all of chunk r and chunk r none of chunk 2P − 1 − r, as local causal says).
        return [(_ALL, _ALL, True)]
    if load_balance == "contiguous":  # an earlier rank's chunk is wholly before, a later one wholly after
        return [(_ALL, _ALL, False)] if source < rank else []
    if load_balance == "zigzag":
        half = n // 2
        if source < rank:  # its chunk s precedes both of ours; its chunk 2P − 1 − s follows both
            return [(_ALL, slice(None, half), False)]
        # s > r: our chunk r precedes both of its chunks; our chunk 2P − 1 − r follows both
        return [(slice(half, None), _ALL, False)]
    # striped: query i·P + r, key j·P + s. s < r: visible iff j <= i (causal). s > r: visible iff
    # j <= i − 1, which is causal with bottom-right alignment over the first n − 1 keys (offset
    # (n − 1) − n = −1); query 0 then sees none of them (lse −inf, which the merge skips).
    if source < rank:
        return [(_ALL, _ALL, True)]
    return [(_ALL, slice(None, n - 1), "bottom_right")] if n > 1 else []


def _context(q, k, v, comm, *, causal, layout, load_balance, scale, softcap, alibi_slopes, window, backend,
             saved=None):
    """Validate the arguments every rank passes, and the backward's (dout, out, lse) as ``saved``,
    before any communication (so that a bad call raises rather than leaving other ranks
    waiting); check that the ranks agree; return (problem of the local shards, ring, combine
    target)."""
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes is not supported by ring attention: the ALiBi bias depends on the distance "
                         "between global positions, and attention's alignment cannot express the offset between this "
                         "rank's queries and another rank's keys")
    if window is not None:
        raise ValueError("window is not supported by ring attention: a window is defined on global positions, and "
                         "attention's alignment cannot express the offset between this rank's queries and another "
                         "rank's keys")
    load_balance = check_choice("load_balance", load_balance, LOAD_BALANCES)
    problem = make_problem(q, k, v, causal=causal, scale=scale, softcap=softcap, layout=layout, backend=backend)
    p = problem
    if p.causal and p.seq_q != p.seq_k:
        raise ValueError(f"causal ring attention needs q and k shards of one sequence, of one length; got {p.seq_q} "
                         f"queries and {p.seq_k} keys")
    if p.causal and load_balance == "zigzag" and p.seq_q % 2:
        raise ValueError(f"load_balance='zigzag' needs an even shard length (two equal chunks per rank), got "
                         f"{p.seq_q}; shard a sequence whose length is a multiple of 2 · ranks")
    if saved is not None:
        check_backward_inputs(problem, *saved)
    ring = _ring.ring_of(comm, p.xp)
    target = _backends.resolve(p.backend, p.xp)
    names = ("B", "H", "Hkv", "Sq", "Sk", "D", "Dv", "dtype", "causal", "load_balance")
    ring.check_same("the shards' shapes and dtype, causal and load_balance", names,
                    (p.batch, p.heads, p.kv_heads, p.seq_q, p.seq_k, p.head_dim, p.head_dim_v,
                     FLOAT_DTYPES.index(p.dtype), p.causal is not None, LOAD_BALANCES.index(load_balance)))
    return problem, ring, target


def _bhsd(x, layout: str):
    """A (B, H, S, ·) view of an array in ``layout``."""
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def _from_bhsd(x, layout: str, dtype):
    """A (B, H, S, ·) result as a new contiguous array in ``layout`` and ``dtype``."""
    xp = require_array("x", x)
    return xp.ascontiguousarray(_bhsd(x, layout).astype(dtype, copy=False))


def _circulate(ring, blocks):
    """Yield (source rank, blocks) P times: this rank's own blocks, then rank − 1's, rank − 2's,
    …, each received from the previous rank. The transfer of the next blocks is under way
    while the caller computes on the current ones.

    ``blocks`` (which may be the caller's own k and v) are only read: blocks arrive in two sets
    of buffers of this function's, in turn, each receiving while the other is sent on."""
    xp = require_array("blocks", blocks[0])
    landing = [[xp.empty_like(b) for b in blocks] for _ in range(min(2, ring.size - 1))]
    for step in range(ring.size):
        transfer = ring.start(blocks, landing[step % 2]) if step < ring.size - 1 else None
        yield (ring.rank - step) % ring.size, blocks
        if transfer is not None:
            ring.wait(transfer)
            blocks = landing[step % 2]


def _merge_rows(target: str, out, lse, rows, part_out, part_lse) -> None:
    """Merge a partial result over other keys, (part_out, part_lse) for query rows ``rows``, into
    the running (out (B, H, S, Dv), lse (B, H, S)) of the compute dtype, in place."""
    xp = require_array("out", out)
    dv = out.shape[-1]
    # _merge.combine, not merge_attention: the parts are ours and well-formed, and the public
    # function's validation would wait for the GPU at every step.
    parts_out = xp.stack([out[:, :, rows], part_out.astype(out.dtype, copy=False)]).reshape(2, -1, dv)
    parts_lse = xp.stack([lse[:, :, rows], part_lse.astype(lse.dtype, copy=False)]).reshape(2, -1)
    merged_out, merged_lse = _merge.combine(target, parts_out, parts_lse, out.dtype)
    out[:, :, rows] = merged_out.reshape(part_out.shape)
    lse[:, :, rows] = merged_lse.reshape(part_lse.shape)


def ring_attention(q, k, v, comm, *, causal=False, layout="bhsd", load_balance="zigzag", scale=None, softcap=None,
                   alibi_slopes=None, window=None, return_lse=False, backend="auto"):
    """Attention over a sequence sharded across the ranks of ``comm``: each rank passes its
    shards and gets back its shard of `attention`'s result on the whole sequence.

    q (B, H, S/P, D), k (B, Hkv, S/P, D), v (B, Hkv, S/P, Dv) in layout "bhsd" ((B, S/P, H, D)
    etc. in "bshd"): this rank's shards, cut by `shard` with the same ``load_balance``; every
    rank passes shards of one shape and dtype (checked: ValueError on every rank otherwise).
    comm: an mpi4py.MPI.Comm (NumPy arrays; CuPy arrays only where the MPI is CUDA-aware,
        TypeError otherwise) or a cupy.cuda.nccl.NcclCommunicator (CuPy arrays), P ranks.
    causal: False, True, "bottom_right" or "top_left" (the same here: the whole sequence is
        square); positions are global: query i sees key j iff j <= i. Causal needs q and k
        shards of one length, even for "zigzag" (ValueError otherwise).
    load_balance: "zigzag" (default), "contiguous" or "striped" — how the shards were cut
        (see `positions`). Without causal it does not change the arithmetic.
    scale, softcap, backend: as in `attention`. alibi_slopes and window are not supported
        (ValueError): both depend on global positions, which the per-block calls cannot express.

    Returns this rank's out (B, H, S/P, Dv) in q's dtype and layout, or (out, lse (B, H, S/P),
    float32, float64 for float64) when return_lse. A row that sees no key gives 0, lse −inf.

    Each of the P steps attends the local queries to one K/V block (skipping blocks causal
    masking hides entirely) while the next block is sent on; the partial results, each in q's
    dtype (attention's out), are merged exactly in float32 (float64) and the result rounded to
    q's dtype.
    """
    check_flag("return_lse", return_lse)
    problem, ring, target = _context(q, k, v, comm, causal=causal, layout=layout, load_balance=load_balance,
                                     scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, window=window,
                                     backend=backend)
    p, xp = problem, problem.xp
    keywords = dict(scale=p.scale, softcap=p.softcap, layout="bhsd", backend=backend)
    q = _bhsd(q, layout)
    blocks = [xp.ascontiguousarray(_bhsd(x, layout)) for x in (k, v)]  # the transports move whole buffers
    ct = compute_dtype(p.dtype)
    out = xp.zeros((p.batch, p.heads, p.seq_q, p.head_dim_v), dtype=ct)
    lse = xp.full((p.batch, p.heads, p.seq_q), -np.inf, dtype=ct)  # no keys seen yet
    for source, (k_blk, v_blk) in _circulate(ring, blocks):
        for rows, keys, piece_causal in _pieces(p.causal is not None, load_balance, ring.rank, source, p.seq_q):
            part = attention(q[:, :, rows], k_blk[:, :, keys], v_blk[:, :, keys], causal=piece_causal,
                             return_lse=True, **keywords)
            _merge_rows(target, out, lse, rows, *part)
    out = _from_bhsd(out, layout, p.dtype)
    return (out, lse) if return_lse else out


def ring_attention_backward(dout, q, k, v, out, lse, comm, *, causal=False, layout="bhsd", load_balance="zigzag",
                            scale=None, softcap=None, alibi_slopes=None, window=None, backend="auto",
                            deterministic=False):
    """Gradients (dq, dk, dv) of `ring_attention`: this rank's shards of `attention_backward`'s
    gradients on the whole sequence.

    dout, out, lse: this rank's shards of the incoming gradient and of the forward's results
    (out (B, H, S/P, Dv) in q's dtype and layout, lse (B, H, S/P) as `ring_attention` returns
    them with return_lse=True); the other arguments and keywords must be those of the forward.
    deterministic: as in `attention_backward`; the ring itself sums in a fixed order.

    Returns dq (B, H, S/P, D), dk (B, Hkv, S/P, D), dv (B, Hkv, S/P, Dv) in the input dtype and
    layout; dk and dv are summed over the query heads sharing a kv head and over every rank's
    queries. K/V blocks travel the ring as in the forward; each block's dK/dV accumulator
    (float32, float64 for float64) travels with it and, after P steps, arrives back at the
    block's owner. dq stays local.
    """
    check_flag("deterministic", deterministic)
    problem, ring, target = _context(q, k, v, comm, causal=causal, layout=layout, load_balance=load_balance,
                                     scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, window=window,
                                     backend=backend, saved=(dout, out, lse))
    p, xp = problem, problem.xp
    keywords = dict(scale=p.scale, softcap=p.softcap, layout="bhsd", backend=backend, deterministic=deterministic)
    dout, q, out = (_bhsd(x, layout) for x in (dout, q, out))
    blocks = [xp.ascontiguousarray(_bhsd(x, layout)) for x in (k, v)]
    ct = compute_dtype(p.dtype)
    dq = xp.zeros(q.shape, dtype=ct)
    arriving = [xp.empty(b.shape, dtype=ct) for b in blocks]  # the current block's dK/dV from the ranks before
    transfer = None
    for source, (k_blk, v_blk) in _circulate(ring, blocks):
        grads = [xp.zeros(b.shape, dtype=ct) for b in blocks]  # this rank's share of the block's dK, dV
        for rows, keys, piece_causal in _pieces(p.causal is not None, load_balance, ring.rank, source, p.seq_q):
            # Exact for a subset of the keys because out and lse are the merged, global ones:
            # attention_backward forms P = exp(s − lse) and delta = rowsum(dO ∘ O), and with the
            # global lse and O these are the true probabilities and the true delta (a sum over
            # every key), so dS = P ∘ (dP − delta) on this block's keys is exactly the global
            # dS restricted to them. dq sums over blocks; dK/dV of a block over query shards.
            dq_part, dk_part, dv_part = attention_backward(
                dout[:, :, rows], q[:, :, rows], k_blk[:, :, keys], v_blk[:, :, keys], out[:, :, rows],
                lse[:, :, rows], causal=piece_causal, **keywords)
            dq[:, :, rows] += dq_part.astype(ct, copy=False)
            grads[0][:, :, keys] += dk_part.astype(ct, copy=False)
            grads[1][:, :, keys] += dv_part.astype(ct, copy=False)
        if transfer is not None:  # the block's accumulator, sent on by the previous rank a step ago
            ring.wait(transfer)
            for g, a in zip(grads, arriving):
                g += a
        # On to the next rank, which holds this block next step; at the last step that rank is
        # its owner, and what arrives here is this rank's own block, complete.
        transfer = ring.start(grads, arriving, channel=1)
    ring.wait(transfer)
    dk, dv = arriving
    return _from_bhsd(dq, layout, p.dtype), _from_bhsd(dk, layout, p.dtype), _from_bhsd(dv, layout, p.dtype)
