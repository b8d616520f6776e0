"""Block sparsity for a MaskMod: which key tiles each query tile can attend at all, so that the
kernels visit only those (cupy_attn.block_mask).

The mask_mod's NumPy twin is evaluated where the arrays live (NumPy, or CuPy on the GPU) one band
of query rows at a time, and reduced per (query tile, key tile) of a tile configuration. The
kernels take, per (batch entry, head), for each query tile and each key tile, the first non-empty
key tile at or after it (forward and dQ), and the same along the other axis (dK/dV: the first
non-empty query tile at or after each query tile, per key tile), and step from one non-empty tile
to the next inside the tiles causal, window and lengths leave. A mask then costs time in
proportion to its non-empty tiles wherever they lie: Σ len² for documents of lengths len, not the
square of the total; a sliding window with global tokens, the window's tiles and the global ones,
not every tile between them. Full tiles (every pair allowed) skip the mask_mod; the other
non-empty tiles evaluate it element by element.
"""
from __future__ import annotations

import numpy as np

from ._arrays import count_argument, module_of
from . import mods
from .mods import MaskMod


class BlockMask:
    """A mask_mod's tile structure for a (B, H, Sq, Sk) problem; its tables per tile configuration are
    computed on first use and kept."""

    def __init__(self, mask_mod: MaskMod, shape: tuple, xp):
        self.mask_mod, self.shape, self.xp = mask_mod, shape, xp
        self._tiles, self._tables = {}, {}
        # The values the tables are the mask's at: the mask_mod's tensors (their bytes in index
        # order, so NaN compares equal to itself) and scalars. A tensor written in place since
        # (the README's way to feed a step's document ids without a new build) makes it stale.
        self._built_from = {name: _contents(xp, x) for name, x in mask_mod.tensors.items()}, dict(mask_mod.scalars)

    def changed(self) -> str | None:
        """The name of a tensor or scalar of the mask_mod whose value differs from the one the
        block mask was built from, or None (a comparison on the device for CuPy tensors)."""
        tensors, scalars = self._built_from
        for name, x in self.mask_mod.tensors.items():
            now, then = _contents(self.xp, x), tensors[name]
            if now.shape != then.shape or not bool((now == then).all()):
                return name
        return next((name for name, value in self.mask_mod.scalars.items() if scalars[name] != value), None)

    def require_unchanged(self) -> None:
        """Refuse a block mask whose mask_mod has changed since it was built (`changed`): its
        tables would skip, and take as full, tiles of the old mask (and tables evaluated now would
        not be those of the values it was built from)."""
        changed = self.changed()
        if changed is not None:
            raise ValueError(f"block_mask was built when the mask_mod's {changed!r} held other values: its tiles are "
                             "those of the old mask. Call cupy_attn.block_mask again, which rebuilds it after a change")

    def __repr__(self) -> str:
        return f"BlockMask({self.mask_mod!r}, shape={self.shape})"

    def tiles(self, block_m: int, block_n: int):
        """Bool (B, H, query tiles, key tiles) twice: tiles holding at least one allowed pair, and
        tiles whose pairs inside (Sq, Sk) are all allowed (computed once per tile configuration)."""
        key = (block_m, block_n)
        if key not in self._tiles:
            self.require_unchanged()
            self._tiles[key] = self._evaluate(block_m, block_n)
        return self._tiles[key]

    def _evaluate(self, block_m: int, block_n: int):
        xp, (b, h, sq, sk) = self.xp, self.shape
        m_tiles, n_tiles = -(-sq // block_m), -(-sk // block_n)
        nonempty = xp.zeros((b, h, m_tiles, n_tiles), dtype=bool)
        full = xp.zeros((b, h, m_tiles, n_tiles), dtype=bool)
        bi, hi = xp.arange(b)[:, None, None, None], xp.arange(h)[None, :, None, None]  # as the twins always see them
        kv = xp.arange(sk)
        for m in range(m_tiles):
            rows = xp.arange(m * block_m, min((m + 1) * block_m, sq))[:, None]
            allowed = mods.twin(self.mask_mod, bi, hi, rows, kv, shape=(b, h, rows.shape[0], sk), xp=xp)
            for out, reduce, pad in ((nonempty, xp.any, False), (full, xp.all, True)):
                padded = xp.full((b, h, n_tiles * block_n), pad, dtype=bool)  # keys past Sk decide nothing
                padded[..., :sk] = reduce(allowed, axis=2)
                out[:, :, m] = reduce(padded.reshape(b, h, n_tiles, block_n), axis=-1)
        return nonempty, full

    def kernel_tables(self, block_m: int, block_n: int):
        """For the kernels (kernels/block_info.cuh, TileWalk), flattened: int32 (B, H, query tiles,
        key tiles), the first non-empty key tile at or after each key tile of each query tile;
        int32 (B, H, key tiles, query tiles), the same for query tiles of each key tile; uint8
        (B, H, query tiles, key tiles), 1 for full tiles."""
        key = (block_m, block_n)
        if key not in self._tables:
            nonempty, full = self.tiles(block_m, block_n)
            self._tables[key] = (_next_nonempty(self.xp, nonempty), _next_nonempty(self.xp, nonempty.swapaxes(2, 3)),
                                 self.xp.ascontiguousarray(full.astype(np.uint8).reshape(-1)))
        return self._tables[key]


def _contents(xp, x):
    """A copy of ``x``'s bytes in index order: (*x.shape, itemsize) uint8."""
    return xp.ascontiguousarray(x).view(np.uint8).reshape(*x.shape, x.itemsize).copy()


def _next_nonempty(xp, tiles):
    """For each entry along the last axis, the index of the first True entry at or after it (the
    axis's length where none is left), int32, flattened. Through a cumulative count and a scatter,
    which CuPy has as NumPy does (a reversed minimum.accumulate would read more simply)."""
    count = tiles.shape[-1]
    rows = tiles.reshape(-1, count)
    before = xp.cumsum(rows, axis=-1, dtype=np.int32) - rows  # True entries before each one
    order = xp.full((rows.shape[0], count + 1), count, dtype=np.int32)  # per row, where its k-th True entry is
    row, col = xp.nonzero(rows)
    order[row, before[row, col]] = col.astype(np.int32)
    return xp.ascontiguousarray(xp.take_along_axis(order, before, axis=-1).reshape(-1))


def block_mask(mask_mod, B, H, Sq, Sk, *, like=None) -> BlockMask:
    """The tile structure of ``mask_mod`` for a (B, H, Sq, Sk) problem (H the query heads),
    evaluated with NumPy, or with CuPy on the GPU when ``like`` is a CuPy array (the mask_mod's
    tensors must then be CuPy arrays too). Pass it to `attention` / `attention_backward` as
    ``block_mask=`` with the same mask_mod: the kernels then visit, for each query tile, only its
    non-empty key tiles (and, in the backward, for each key tile only its non-empty query tiles).
    Reused across calls: block_mask returns the same object for the same mask_mod (by identity),
    shape and array library, as long as the mask_mod's tensors and scalars hold the values it was
    built from; after one changes (a tensor written in place) it builds the tables again."""
    if not isinstance(mask_mod, MaskMod):
        raise TypeError(f"mask_mod must be a cupy_attn.MaskMod, got {type(mask_mod).__name__}")
    shape = tuple(count_argument(name, n, 1) for name, n in (("B", B), ("H", H), ("Sq", Sq), ("Sk", Sk)))
    xp = np if like is None else module_of(like)
    if xp is None:
        raise TypeError(f"like must be a NumPy or CuPy array (or None for NumPy), got {type(like).__name__}")
    for name, x in mask_mod.tensors.items():
        if module_of(x) is not xp:
            raise TypeError(f"mask_mod's tensor {name!r} must be a {xp.__name__} array to evaluate the block mask "
                            f"with {xp.__name__}")
    per_mod = mask_mod._block_masks
    key = (shape, xp.__name__)
    if key not in per_mod or per_mod[key].changed() is not None:
        per_mod[key] = BlockMask(mask_mod, shape, xp)
    return per_mod[key]
