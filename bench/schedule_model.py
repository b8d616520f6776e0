"""A model, no GPU needed, of how the order in which a kernel's blocks start (cupy_attn/_schedule.py,
kernels/block_info.cuh query_block_place and key_block_place) shapes the end of a launch: the
tail, where some SMs idle while the last blocks finish; and what persistent blocks make of the
same order, claiming their next work tile ahead of their current one's end (the persistent wgmma
forward's, kernels/block_info.cuh WorkTiles) or, as that kernel did first, in a fixed turn.

    python bench/schedule_model.py [--sms 132] [--l2-mib 50] [--blocks-per-sm 1 2] [--overhead 1]
                                   [--claim-ahead 2]

For the benchmark's configurations (B·S = 16k, H·D = 2048, S = 1k-16k, D = 64 and 128, causal and
not; bench/bench_attention.py) and the tiles the table chooses on compute capability 9.0 (both
kernel families' forward and dK/dV), each block's work is the number of tiles it visits (key
tiles of a forward block, query tiles of a dK/dV block; under a causal mask, Sq = Sk) plus
`--overhead` tiles of prologue and epilogue. Blocks start in launch order, each on the slot (an
SM's room for one block) that frees first, as a GPU's block scheduler hands them out. Printed per
case and order:

    tail    the modelled time over its lower bound, max(total work / slots, the largest block),
            minus 1: the share of the launch lost to SMs idling at its end; "claimed ahead": with
            slot i taking the i-th block of "now" and then each the next unclaimed one when its
            current block has --claim-ahead tiles of work left (the persistent wgmma forward's
            producer claims once it has issued a tile's last loads, two stages ahead of its
            consumers); "fixed turn": with slot i taking the i-th, (i + slots)-th, ... block of
            "now" (a persistent kernel without a dynamic scheduler), which balances only blocks of
            equal work
    L2 MiB  the most rows that blocks running at once share (distinct (entry, head) pairs among
            them times one pair's K and V, or Q, dO, lse and delta), against the L2

Orders: "before" is the grid (tiles, heads, batch entries) the kernels ran on until 2026-12-02 (a
pair's tiles in order, pair after pair); "now" is block_place's (sections sized by
heads_per_section for --l2-mib; the last query tile first, the first key tile first). The
deterministic dQ kernel takes the forwards' order. Ignored: per-tile costs that differ (boundary
tiles, memory stalls), other launches, and whether the L2 actually keeps what fits.
"""
from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cupy_attn import _config, _schedule  # noqa: E402

DTYPE = np.dtype(np.float16)  # 2-byte elements; bf16 tiles are the same


def tile_work(axis: str, index: int, seq: int, block: int, other: int, causal: bool) -> int:
    """Tiles of `other` rows or keys that tile `index` (of `block` rows or keys) visits at Sq =
    Sk = seq: a query tile's key tiles (under a causal mask, keys up to its last row), a key
    tile's query tiles (rows from its first key)."""
    if not causal:
        return -(-seq // other)
    if axis == "queries":
        return -(-min((index + 1) * block, seq) // other)
    return -(-seq // other) - index * block // other


def lower_bound(order, work, slots: int) -> float:
    """No launch of the blocks in `order` ends before its work spread evenly over `slots`, or its
    largest block."""
    return max(sum(work[t] for t, _, _ in order) / slots, max(work))


def simulate(order, work, slots: int, shared_bytes: int) -> tuple[float, float]:
    """(tail, the most bytes the blocks running at once share) of blocks started in `order` (each
    a (tile, head, entry)) on `slots` slots, `work[tile]` each, `shared_bytes` per (head, entry)."""
    free = [(0.0, slot) for slot in range(slots)]  # (when the slot frees, slot)
    running, most, end = {}, 0, 0.0
    for tile, head, entry in order:
        start, slot = heapq.heappop(free)
        running[slot] = (head, entry)
        most = max(most, len(set(running.values())))
        finish = start + work[tile]
        heapq.heappush(free, (finish, slot))
        end = max(end, finish)
    return end / lower_bound(order, work, slots) - 1, most * shared_bytes


def claimed_ahead(order, work, slots: int, ahead: float) -> float:
    """The tail of blocks started in `order` when `slots` persistent blocks take them as the
    persistent wgmma forward's do (kernels/block_info.cuh, WorkTiles): block i the i-th first, then
    each the first one unclaimed when its current one has `ahead` of work left, which it runs once
    that one ends. A block whose current one is shorter claims the one after it straight after its
    last claim (the producer, two stages ahead of the consumers, may claim before they start it)."""
    claims, ends = [], [0.0] * slots  # (when the slot claims, slot); when its current block ends
    for slot, (tile, _, _) in enumerate(order[:slots]):
        ends[slot] = work[tile]
        heapq.heappush(claims, (max(0.0, ends[slot] - ahead), slot))
    for tile, _, _ in order[slots:]:
        claimed, slot = heapq.heappop(claims)
        ends[slot] += work[tile]
        heapq.heappush(claims, (max(claimed, ends[slot] - ahead), slot))
    return max(ends) / lower_bound(order, work, slots) - 1


def fixed_turn(order, work, slots: int) -> float:
    """The tail of blocks started in `order` when `slots` persistent blocks take them in a fixed
    turn (block i: the i-th, the (i + slots)-th, ...), as the persistent wgmma forward's did at
    first, instead of each on the slot that frees first."""
    loads = [0.0] * slots
    for n, (tile, _, _) in enumerate(order):
        loads[n % slots] += work[tile]
    return max(loads) / lower_bound(order, work, slots) - 1


def kernels(head_dim: int, causal: bool):
    """(name, axis, block rows or keys, the other side's tile) of the kernels the table chooses on
    compute capability 9.0 (the 227 KB of shared memory a block may have there) for fp16/bf16
    plain calls, causal or not: the wgmma and mma.sync forwards and dK/dVs."""
    out = []
    for family, cc in (("wgmma", 90), ("mma.sync", 80)):
        f = _config.forward_tile(head_dim, head_dim, DTYPE, cc, diagonal=causal)
        b = _config.backward_tile(head_dim, head_dim, DTYPE, cc, _config.HOPPER_SHARED_LIMIT)
        out += [(f"forward {family}", "queries", f.block_m, f.block_n), (f"dK/dV {family}", "keys", b.block_n, b.block_m)]
    return out


def model_rows(sms: int = 132, l2_bytes: int = 50 * 2**20, blocks_per_sm=(1, 2), overhead: float = 1.0,
               claim_ahead: float = 2.0):
    """One dict per (kernel, D, S, causal, blocks per SM) of the benchmark's configurations: the
    tail and the rows the blocks running at once share (bytes), before and now."""
    out = []
    for d in (64, 128):
        heads = 2048 // d
        for causal in (False, True):
            for name, axis, block, other in kernels(d, causal):
                for seq in (1024, 2048, 4096, 8192, 16384):
                    entries, tiles = 16384 // seq, -(-seq // block)
                    pairs, row_bytes = heads * entries, 2 * d * DTYPE.itemsize
                    shared = seq * row_bytes if axis == "queries" else seq * (row_bytes + 8)
                    before = [(t, pair % heads, pair // heads) for pair in range(pairs) for t in range(tiles)]
                    grid = _schedule.sectioned_grid(tiles, pairs, _schedule.heads_per_section(shared, pairs, l2_bytes))
                    now = _schedule.launch_order(grid, heads, axis == "queries")
                    work = [tile_work(axis, t, seq, block, other, causal) + overhead for t in range(tiles)]
                    for per_sm in blocks_per_sm:
                        (tail0, l2_0), (tail1, l2_1) = (simulate(o, work, sms * per_sm, shared) for o in (before, now))
                        out.append(dict(kernel=name, D=d, S=seq, causal=causal, blocks_per_sm=per_sm, tail_before=tail0,
                                        tail_now=tail1, tail_claimed_ahead=claimed_ahead(now, work, sms * per_sm, claim_ahead),
                                        tail_fixed_turn=fixed_turn(now, work, sms * per_sm),
                                        shared_before=l2_0, shared_now=l2_1))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", type=int, default=132, help="SMs (an H100 SXM or H200: 132)")
    parser.add_argument("--l2-mib", type=float, default=50, help="the L2 sections are sized for (H100/H200: 50)")
    parser.add_argument("--blocks-per-sm", type=int, nargs="+", default=[1, 2],
                        help="blocks resident per SM (the wgmma kernels: 1; the mma.sync ones 1-3 by registers)")
    parser.add_argument("--overhead", type=float, default=1.0, help="a block's prologue and epilogue, in tiles")
    parser.add_argument("--claim-ahead", type=float, default=2.0,
                        help="work left, in tiles, when a persistent block claims its next one")
    args = parser.parse_args(argv)
    print(f"{args.sms} SMs, sections for {args.l2_mib:g} MiB of L2, overhead {args.overhead:g} tile(s) per block, "
          f"persistent blocks claiming {args.claim_ahead:g} tile(s) ahead")
    print("| kernel | D | S | causal | blocks/SM | tail before | tail now | tail now, claimed ahead | tail now, fixed turn "
          "| L2 MiB before | L2 MiB now |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = model_rows(args.sms, int(args.l2_mib * 2**20), args.blocks_per_sm, args.overhead, args.claim_ahead)
    for r in rows:
        print(f"| {r['kernel']} | {r['D']} | {r['S']} | {'yes' if r['causal'] else 'no'} | {r['blocks_per_sm']} | "
              f"{r['tail_before']:.1%} | {r['tail_now']:.1%} | {r['tail_claimed_ahead']:.1%} | {r['tail_fixed_turn']:.1%} | {r['shared_before'] / 2**20:.0f} | "
              f"{r['shared_now'] / 2**20:.0f} |")
    for causal in (True, False):
        for per_sm in args.blocks_per_sm:
            part = [r for r in rows if r["causal"] == causal and r["blocks_per_sm"] == per_sm]
            mean = lambda key: sum(r[key] for r in part) / len(part)  # noqa: E731
            print(f"{'causal' if causal else 'not causal'}, {per_sm} block(s) per SM: tail {mean('tail_before'):.1%} "
                  f"before, {mean('tail_now'):.1%} now on average (most {max(r['tail_before'] for r in part):.1%}, "
                  f"{max(r['tail_now'] for r in part):.1%}); rows shared at once at most "
                  f"{max(r['shared_before'] for r in part) / 2**20:.0f} and {max(r['shared_now'] for r in part) / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
