"""Counter-based Philox (Salmon, Moraes, Dror and Shaw, SC'11), vectorised in NumPy, and the
dropout keep-mask it defines.

Dropout must give the same keep/drop decision for element (b, h, i, j) on every backend, tile
size and kernel family, so the decision is a pure function of (seed, offset, b, h, i, j):

    key     = (seed mod 2³², seed div 2³²)                     seed in [0, 2⁶⁴)
    counter = (j div 4, i, b·H + h, offset)                    offset in [0, 2³²)
    word    = Philox4x32-10(counter, key)[j mod 4]             4 consecutive keys per call
    keep    = word >= threshold,  threshold = ⌊p · 2³²⌋

so P(keep) = 1 − threshold / 2³² (within 2⁻³² of 1 − p). Kept probabilities are scaled by
1 / (1 − p) (FlashAttention's definition). kernels/dropout.cuh computes the same in CUDA C.

The round function is written once for both word widths: the 32-bit one is what dropout uses;
the 64-bit one is NumPy's own `numpy.random.Philox`, against which the tests check it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._arrays import describe, is_integer, is_real_number
from ._interop import outside_torch_compile

# Multipliers and Weyl key increments of Random123's philox4x32 and philox4x64.
_CONSTANTS = {
    32: (np.uint32, 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85),
    64: (np.uint64, 0xD2E7470EE14C6C93, 0xCA5A826395121157, 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B),
}
_LOW32 = np.uint64(0xFFFFFFFF)
ROUNDS = 10


def _mulhilo(a, multiplier: int, bits: int):
    """(high, low) words of the 2·bits-bit product a · multiplier, elementwise."""
    if bits == 32:
        product = a.astype(np.uint64) * np.uint64(multiplier)
        return (product >> np.uint64(32)).astype(np.uint32), (product & _LOW32).astype(np.uint32)
    # 64 x 64 -> 128 bits from 32-bit halves (uint64 products of halves cannot overflow).
    s32 = np.uint64(32)
    a_lo, a_hi = a & _LOW32, a >> s32
    m_lo, m_hi = np.uint64(multiplier & 0xFFFFFFFF), np.uint64(multiplier >> 32)
    ll, lh, hl, hh = a_lo * m_lo, a_lo * m_hi, a_hi * m_lo, a_hi * m_hi
    middle = (ll >> s32) + (lh & _LOW32) + (hl & _LOW32)  # < 3 · 2³²
    high = hh + (lh >> s32) + (hl >> s32) + (middle >> s32)
    return high, a * np.uint64(multiplier)  # the low word wraps, as uint64 arithmetic does


def philox(counter, key, *, bits: int = 32, rounds: int = ROUNDS):
    """Philox4x{bits}-{rounds}: counter is 4 arrays (or ints) of words, key 2; they broadcast
    together. Returns the 4 output words as arrays of uint32 (bits=32) or uint64 (bits=64)."""
    word, m0, m1, w0, w1 = _CONSTANTS[bits]
    with np.errstate(over="ignore"):
        c0, c1, c2, c3 = np.broadcast_arrays(*(np.asarray(c, dtype=word) for c in counter))
        k0, k1 = (np.asarray(k, dtype=word) for k in key)
        for r in range(rounds):
            if r:  # the key schedule: a Weyl sequence added before every round but the first
                k0, k1 = k0 + word(w0), k1 + word(w1)
            hi0, lo0 = _mulhilo(c0, m0, bits)
            hi1, lo1 = _mulhilo(c2, m1, bits)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@dataclass(frozen=True)
class Dropout:
    """A validated dropout configuration (see the module docstring)."""

    p: float     # in (0, 1)
    seed: int    # [0, 2⁶⁴)
    offset: int  # [0, 2³²)

    @property
    def threshold(self) -> int:
        """Words below it drop their element: ⌊p · 2³²⌋ (exact: 2³² is a power of two)."""
        return int(self.p * 2.0 ** 32)

    @property
    def scale(self) -> float:
        """What kept probabilities are multiplied by."""
        return 1.0 / (1.0 - self.p)

    def keep_tile(self, batch: int, heads: int, i0: int, i1: int, j0: int, j1: int):
        """(B, H, i1 − i0, j1 − j0) keep-decisions of a tile, one Philox call per 4 keys."""
        g0, g1 = j0 >> 2, (j1 + 3) >> 2  # the groups of 4 keys the tile touches
        key = (self.seed & 0xFFFFFFFF, self.seed >> 32)
        bh = (np.arange(batch)[:, None] * heads + np.arange(heads)[None, :])[:, :, None, None]
        counter = (np.arange(g0, g1)[None, None, None, :], np.arange(i0, i1)[None, None, :, None], bh, self.offset)
        words = np.stack(philox(counter, key), axis=-1)  # (B, H, m, groups, 4): keys 4·group + lane
        words = words.reshape(words.shape[:3] + (4 * (g1 - g0),))[..., j0 - 4 * g0:j1 - 4 * g0]
        return words >= np.uint32(self.threshold)


def check_dropout(p, seed, offset, rows: int = 1) -> Dropout | None:
    """dropout_p, dropout_seed and dropout_offset validated (cupy_attn._philox); None for p = 0.
    ``rows`` is B·H, which must fit the counter's 32-bit word."""
    if not is_real_number(p):
        raise TypeError(f"dropout_p must be a real number in [0, 1), got {describe(p)}")
    if not 0.0 <= float(p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p!r}")
    for name, value, bits in (("dropout_seed", seed, 64), ("dropout_offset", offset, 32)):
        if not is_integer(value):
            raise TypeError(f"{name} must be an int, got {describe(value)}")
        if not 0 <= int(value) < 2 ** bits:
            raise ValueError(f"{name} must be in [0, 2**{bits}), got {int(value)}")
    if rows > 2 ** 32:
        raise ValueError(f"dropout needs B·H <= 2**32 (one Philox counter word), got {rows}")
    return Dropout(float(p), int(seed), int(offset)) if p else None


@outside_torch_compile
def dropout_mask(shape, p, seed, offset=0):
    """The keep-mask (True = kept) that `attention` with dropout_p=p, dropout_seed=seed and
    dropout_offset=offset applies to the probabilities of a (B, H, Sq, Sk) problem (H the query
    heads, indices in the padded problem): a NumPy bool array of ``shape`` = (B, H, Sq, Sk), the
    same on every backend. Kept probabilities are scaled by 1 / (1 − p). For testing and
    inspection; it costs B·H·Sq·Sk / 4 Philox evaluations."""
    if not isinstance(shape, (tuple, list)) or len(shape) != 4 or not all(
            isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ValueError(f"shape must be 4 non-negative ints (B, H, Sq, Sk), got {shape!r}")
    batch, heads, seq_q, seq_k = (int(n) for n in shape)
    dropout = check_dropout(p, seed, offset, batch * heads)
    if dropout is None:
        return np.ones(shape, dtype=bool)
    return dropout.keep_tile(batch, heads, 0, seq_q, 0, seq_k)
