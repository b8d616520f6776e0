"""The order in which the blocks of the tensor-core kernels start (kernels/block_info.cuh:
query_block_place for the mma.sync and wgmma forwards and the tensor-core deterministic dQ,
key_block_place for the wgmma dK/dV and the mma.sync one up to D = 128), and the grid that gives it.

A GPU starts the blocks of a grid in the order of their linear index (x fastest), and each SM
takes the next block as one of its own finishes. The grid is shaped so that
- the heaviest tiles start first: under a causal mask a later query tile visits more key tiles
  and an earlier key tile more query tiles, and a heavy block started last would keep its SM busy
  while the others idle (longest processing time first, as FlashAttention-3 orders its query
  tiles): query tiles from the last, key tiles from the first;
- the blocks running at once share their rows in the L2: a (batch entry, head) pair's blocks all
  read its K and V (query tiles) or its Q, dO, lse and delta (key tiles), so the pairs go in
  sections whose shared rows fit the L2 together (`heads_per_section`), and one section's blocks
  start before the next section's.
Grid (pairs per section, tiles, sections): within a section, tile rank by tile rank, and within a
rank pair by pair. `launch_order` is the kernels' mapping in Python, for tests and
bench/schedule_model.py. (The CUDA-core kernels and the mma.sync dK/dV above D = 128 keep the grid
(tiles, heads, batch entries): the place's arithmetic made ptxas spill in them.)
"""
from __future__ import annotations

import math

GRID_YZ_LIMIT = 65535  # blocks along a grid's y and z axes

# The share of the L2 one section's shared rows may take. Two sections run at once for a while (the
# next one's heaviest tiles start while this one's lightest finish), and the L2 also holds what
# streams through (each block's Q tile, its output) and, on an H100/H200, copies of lines in both
# of its halves. With this, bench/schedule_model.py models the blocks running at once on an H200
# to read at most 32 MiB of K and V of its 50 at the forwards' own occupancy (one block per SM for
# the wgmma forward, two for the mma.sync one), as the former grid did. A guess until a GPU run
# measures it (FlashAttention-3 sizes its sections for 32 MB of an H100's 50).
L2_SHARE = 0.25


def heads_per_section(shared_bytes: int, pairs: int, l2_bytes: int, group: int = 1) -> int:
    """How many (batch entry, head) pairs one section holds: a divisor of `pairs` (so every
    section is whole) made of whole groups of `group` consecutive heads (a GQA group reads one kv
    head's K and V; 1 where each head's rows are its own), the largest whose groups fit L2_SHARE
    of the L2 at `shared_bytes` each; one group where none fits; and enough that the sections
    number at most GRID_YZ_LIMIT."""
    if shared_bytes < 0 or pairs < 0 or l2_bytes < 0 or group < 1 or pairs % group:
        raise ValueError(f"heads_per_section takes sizes >= 0 and whole groups of >= 1 pairs, got shared_bytes = "
                         f"{shared_bytes}, pairs = {pairs}, l2_bytes = {l2_bytes}, group = {group}")
    groups = pairs // group
    if groups == 0:
        return 1
    fit = groups if shared_bytes == 0 else max(1, int(l2_bytes * L2_SHARE) // shared_bytes)
    fewest = -(-pairs // GRID_YZ_LIMIT)  # pairs per section for at most GRID_YZ_LIMIT sections
    sizes = [n * group for n in _divisors(groups) if n * group >= fewest]
    fitting = [s for s in sizes if s // group <= fit]
    return max(fitting) if fitting else min(sizes)


def _divisors(n: int) -> list[int]:
    """The divisors of n >= 1 (trial division up to its square root: a call's pairs number up to
    2^31)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def sectioned_grid(tiles: int, pairs: int, section: int) -> tuple[int, int, int]:
    """The grid of a kernel whose blocks start in sections: (pairs per section, tiles, sections)."""
    if section < 1 or pairs % section:
        raise ValueError(f"a section holds a divisor of the {pairs} pairs, got {section}")
    if tiles > GRID_YZ_LIMIT:
        raise ValueError(f"at most {GRID_YZ_LIMIT} tiles per call, got {tiles}")
    return (section, tiles, pairs // section)


def division_magic(divisor: int) -> tuple[int, int]:
    """(magic, shift) with n // divisor == ((2n · magic) >> 32) >> shift for every 0 <= n < 2^31:
    shift = ceil(log2 divisor), magic = ceil(2^(31 + shift) / divisor), which fits 32 bits (the
    round-up method: n · (magic · divisor - 2^(31 + shift)) < 2^31 · divisor <= 2^(31 + shift))."""
    if not 1 <= divisor < 2**16:
        raise ValueError(f"division_magic takes a divisor in [1, 65535], got {divisor}")
    shift = (divisor - 1).bit_length()
    return -(-(1 << (31 + shift)) // divisor), shift


def launch_order(grid: tuple[int, int, int], heads: int, last_tile_first: bool) -> list[tuple[int, int, int]]:
    """(tile, head, batch entry) of each block of a sectioned_grid, in the order of the blocks'
    linear index: the twin of query_block_place (last_tile_first) and key_block_place."""
    in_section, tiles, sections = grid
    order = []
    for section in range(sections):
        for rank in range(tiles):
            for x in range(in_section):
                pair = section * in_section + x
                order.append((tiles - 1 - rank if last_tile_first else rank, pair % heads, pair // heads))
    return order
