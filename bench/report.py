"""Markdown tables from benchmarks' results.json files: TFLOP/s of every implementation per case
(calls back to back, bench_attention.py) and cupy_attn's ratio to each other one. A result the
benchmark's check found wrong is shown as WRONG, never as a speed.

    python bench/report.py bench/out/results.json [more results.json ...] [--pass fwd]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Ours: the CUDA kernels on a GPU, the NumPy backend on a CPU (a results.json holds one or the other).
OURS = ("cupy_attn", "cupy_attn_numpy")
# cupy_attn_mma_sync: records from before 2026-11-30's switch, when an sm_90 GPU ran wgmma by default
COLUMNS = (("cupy_attn", "cupy_attn"), ("cupy_attn_mma_sync", "ours, mma.sync"), ("cupy_attn_wgmma", "ours, wgmma"),
           ("torch_sdpa_flash", "SDPA flash"), ("torch_sdpa_cudnn", "SDPA cuDNN"),
           ("torch_sdpa_efficient", "SDPA efficient"), ("jax_dot_product_attention", "JAX"),
           ("cupy_attn_numpy", "cupy_attn (NumPy)"), ("naive_numpy", "naive NumPy"), ("torch_sdpa_cpu", "SDPA (CPU)"))
FIELDS = ("pass", "impl", "tflops", "name", "dtype", "D", "Sq", "Sk", "causal", "B", "H", "Hkv")


def table(records: list[dict], pass_: str) -> str:
    present = [(impl, title) for impl, title in COLUMNS if any(r["impl"] == impl for r in records)]
    ours = next((impl for impl in OURS if any(r["impl"] == impl for r in records)), OURS[0])
    others = [(impl, title) for impl, title in present if impl != ours]
    cases: dict = {}
    for r in records:
        if r["pass"] == pass_:
            key = (r["name"], r["dtype"], r["D"], r["Sq"], r["Sk"], r["causal"], r["B"], r["H"], r["Hkv"])
            cases.setdefault(key, {})[r["impl"]] = None if r.get("wrong") else r["tflops"]
    head = ["case", "dtype", "D", "Sq/Sk", "causal"] + [t for _, t in present] + [f"÷ {t}" for _, t in others]
    lines = [f"| {' | '.join(head)} |", "|" + "---|" * len(head)]
    order = lambda k: (k[0] != "sweep", k[0], k[1], -k[2], k[3], k[5])  # noqa: E731
    for key in sorted(cases, key=order):
        got = cases[key]
        name, dtype, d, sq, sk, causal = key[:6]
        cells = [name, dtype, str(d), f"{sq}/{sk}", "yes" if causal else "no"]
        cells += ["—" if i not in got else "WRONG" if got[i] is None else f"{got[i]:.1f}" if got[i] >= 10
                  else f"{got[i]:.3g}" for i, _ in present]
        cells += [f"{got[ours] / got[i]:.2f}" if got.get(ours) and got.get(i) else "—" for i, _ in others]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+", help="results.json files, read as one list")
    parser.add_argument("--pass", dest="passes", default="fwd,bwd")
    args = parser.parse_args(argv)
    passes = args.passes.split(",")
    if any(p not in ("fwd", "bwd") for p in passes):
        parser.error(f"--pass takes fwd, bwd or fwd,bwd, got {args.passes!r}")
    records = []
    for path in args.results:
        try:
            part = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            parser.error(f"cannot read {path}: {error}")
        if not isinstance(part, list) or not all(isinstance(r, dict) and set(FIELDS) <= set(r) for r in part):
            parser.error(f"{path} is not a benchmark's results.json (a list of records with {', '.join(FIELDS)})")
        records += part
    for pass_ in passes:
        print(f"\n{'Forward' if pass_ == 'fwd' else 'Backward'} (TFLOP/s; ÷: cupy_attn over that implementation)\n")
        print(table(records, pass_))
    return 0


if __name__ == "__main__":
    sys.exit(main())
