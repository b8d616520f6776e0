"""Tile sweep for the default (mma.sync) tensor-core kernels, prepared for a lent GPU: each
candidate tile of the forward and of dK/dV is checked against the float64 reference, then timed
on FlashAttention's configurations, and the best per case is printed last.

    python bench/tile_sweep.py --out DIR [--budget-s S]   # on a GPU, one command
    python bench/tile_sweep.py --dry-run                   # no GPU: NVRTC builds every candidate

A candidate replaces the tile table's entry for its head dim (cupy_attn._config) for the time of
its runs; the table itself changes only by hand, after a measurement. The dry run compiles each
candidate for sm_90 as CuPy would (plain score features) and reports registers, spills and
shared memory, so a candidate that cannot build never costs GPU minutes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cupy_attn import _compile, _config, _nvrtc, reference  # noqa: E402

HEAD_DIMS = (64, 128)
# (block_m, block_n) for the forward; (block_m, block_n, stages) for dK/dV. The table's own choice
# is among them; shared memory stays within sm_90's 227 KB per block. (D = 128 dK/dV at 64 x 64 in
# two stages left the list when the softmax's scale moved into its FFMA: 255 registers and 12
# bytes spilled; so did the D = 128 forward at 128 x 64: 108 bytes.)
FORWARD_CANDIDATES = {64: ((128, 64), (64, 64), (128, 32), (64, 128)), 128: ((64, 64), (64, 32), (64, 128), (128, 32))}
BACKWARD_CANDIDATES = {64: ((64, 128, 2), (64, 64, 2), (32, 64, 2), (64, 32, 2), (64, 64, 1), (32, 32, 2)),
                       128: ((32, 128, 2), (32, 64, 2), (32, 32, 2), (32, 64, 1), (64, 32, 2))}
SHARED_LIMIT = 227 * 1024


def _table_entry(tiles, head_dim):
    return next(t for t in tiles if t.head_dim == head_dim)


def candidates():
    """(pass, head dim, tile) for every candidate, the table's own first."""
    out = []
    for d in HEAD_DIMS:
        own = _table_entry(_config.TENSOR_CORE_TILES, d)
        # The table's min_blocks goes with its own tile; other candidates leave registers to ptxas.
        tiles = [dataclasses.replace(own, block_m=m, block_n=n, reason="sweep",
                                     min_blocks=own.min_blocks if (m, n) == (own.block_m, own.block_n) else 1)
                 for m, n in FORWARD_CANDIDATES[d]]
        out += [("fwd", d, t) for t in sorted(tiles, key=lambda t: (t.block_m, t.block_n) != (own.block_m, own.block_n))]
        own = _table_entry(_config.TENSOR_CORE_BACKWARD_TILES, d)
        tiles = [dataclasses.replace(own, block_m=m, block_n=n, stages=s, reason="sweep")
                 for m, n, s in BACKWARD_CANDIDATES[d]]
        out += [("bwd", d, t) for t in sorted(tiles, key=lambda t: (t.block_m, t.block_n, t.stages)
                                               != (own.block_m, own.block_n, own.stages))]
    return out


def describe(pass_: str, tile) -> str:
    return f"block_m={tile.block_m} block_n={tile.block_n}" + ("" if pass_ == "fwd" else f" stages={tile.stages}")


@contextmanager
def installed(pass_: str, tile):
    """The tile table with this candidate in place of its head dim's entry."""
    name = "TENSOR_CORE_TILES" if pass_ == "fwd" else "TENSOR_CORE_BACKWARD_TILES"
    saved = getattr(_config, name)
    # the entry the sweep's calls (no mask) take: at D = 128 the forward's unmasked_only tile, not
    # the one calls with a mask keep
    same = lambda t: t.head_dim == tile.head_dim and getattr(t, "unmasked_only", False) == getattr(tile, "unmasked_only", False)  # noqa: E731
    setattr(_config, name, tuple(tile if same(t) else t for t in saved))
    try:
        yield
    finally:
        setattr(_config, name, saved)


def dry_run() -> int:
    failures = 0
    for pass_, d, tile in candidates():
        fits = tile.shared_bytes <= SHARED_LIMIT
        try:
            c, _ = _nvrtc.compile_kernel_least_spills(_compile.kernel_source(tile.filename), tile.name_expression(np.float16),
                                                      "sm_90", _compile.gpu_build_options(tile.filename, _config.PLAIN_FEATURES))
            built = f"{c.registers} registers, spills {c.spill_stores}/{c.spill_loads} bytes"
            ok = fits and not c.spill_stores
        except _nvrtc.NvrtcError as exc:
            built, ok = f"does not build: {str(exc).splitlines()[0]}", False
        failures += not ok
        print(f"{pass_} D={d:<4} {describe(pass_, tile):<34} {tile.shared_bytes / 1024:6.1f} KB shared "
              f"{'' if fits else '(over 227 KB) '}{built}")
    print(f"tile sweep dry run: {len(candidates())} candidates, {failures} unusable")
    return 1 if failures else 0


def check(pass_: str, tile, rng) -> None:
    """The candidate against the float64 reference on an awkward small problem (bf16, causal)."""
    import cupy

    import cupy_attn
    from cupy_attn._arrays import BFLOAT16

    q, dout = (rng.standard_normal((1, 2, 113, tile.head_dim)).astype(BFLOAT16) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, 203, tile.head_dim)).astype(BFLOAT16) for _ in range(2))
    gq, gk, gv = (cupy.asarray(x) for x in (q, k, v))
    out, lse = cupy_attn.attention(gq, gk, gv, causal=True, return_lse=True)
    want_out, _ = reference.attention(q, k, v, causal=True)
    worst = float(np.abs(out.get().astype(np.float64) - want_out).max())
    if pass_ == "bwd":
        grads = cupy_attn.attention_backward(cupy.asarray(dout), gq, gk, gv, out, lse, causal=True)
        wants = reference.attention_gradients(dout, q, k, v, causal=True)
        worst = max([worst] + [float(np.abs(g.get().astype(np.float64) - w).max() / max(np.abs(w).max(), 1e-6))
                               for g, w in zip(grads, wants)])
    if not worst < 0.05:
        raise AssertionError(f"{pass_} {describe(pass_, tile)}: error {worst:.3g} against the float64 reference")


def precompile_candidates() -> None:
    """Every candidate's kernel into CuPy's disk cache, in parallel, before anything is timed."""
    import os

    from precompile import compile_in_parallel, compile_on_gpu

    variants = sorted({(t.filename, t.name_expression(_config.BFLOAT16), _config.PLAIN_FEATURES) for _, _, t in candidates()})
    seconds = compile_in_parallel(compile_on_gpu, variants, os.cpu_count())
    print(f"compiled {len(variants)} candidate kernels in {seconds:.1f} s", flush=True)


def sweep(args) -> int:
    import bench_attention as bench

    precompile_candidates()
    rng = np.random.default_rng(0)
    cases = [bench.Case("sweep", 16384 // s, 2048 // d, 2048 // d, s, s, d, "bfloat16", causal)
             for d in HEAD_DIMS for s in (4096, 16384) for causal in (False, True)]
    impl = bench.CupyAttnCuda()
    records, started = [], time.perf_counter()
    for pass_, d, tile in candidates():
        if args.budget_s and time.perf_counter() - started > args.budget_s:
            print(f"budget of {args.budget_s} s spent: stopping before {pass_} D={d} {describe(pass_, tile)}", flush=True)
            break
        with installed(pass_, tile):
            try:
                check(pass_, tile, rng)
            except Exception as exc:  # a candidate that fails is reported, not timed
                print(f"REJECTED {pass_} D={d} {describe(pass_, tile)}: {type(exc).__name__}: {exc}", flush=True)
                continue
            for case in (c for c in cases if c.D == d):
                sets = [bench.host_inputs(case, seed) for seed in range(bench.input_sets(case))]
                calls = impl.prepare(case, pass_, sets)
                for call in calls[:2]:
                    call()
                ms, _ = bench.time_gpu(calls, 10)
                record = dict(dataclasses.asdict(case), tile=describe(pass_, tile), ms=ms,
                              tflops=case.flops(pass_) / (ms * 1e-3) / 1e12)
                record["pass"] = pass_
                records.append(record)
                (args.out / "tile_sweep.json").write_text(json.dumps(records, indent=1))
                print(f"{pass_} D={d:<4} S={case.Sq:<6} causal={case.causal!s:<5} {describe(pass_, tile):<34} "
                      f"{record['tflops']:8.2f} TFLOP/s", flush=True)
    print("best tile per case (TFLOP/s; the table's own tile is listed first per pass and head dim)")
    for key in sorted({(r["pass"], r["D"], r["Sq"], r["causal"]) for r in records}):
        rows = [r for r in records if (r["pass"], r["D"], r["Sq"], r["causal"]) == key]
        best = max(rows, key=lambda r: r["tflops"])
        print(f"{key[0]} D={key[1]:<4} S={key[2]:<6} causal={key[3]!s:<5} best {best['tile']:<34} {best['tflops']:8.2f}  "
              f"own {rows[0]['tflops']:8.2f}  ({rows[0]['tile']})")
    return 0 if records else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    parser.add_argument("--budget-s", type=float, default=0, help="start no new candidate after this many seconds")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: build every candidate with NVRTC and report it")
    args = parser.parse_args(argv)
    if args.dry_run:
        return dry_run()
    args.out.mkdir(parents=True, exist_ok=True)
    return sweep(args)


if __name__ == "__main__":
    sys.exit(main())
