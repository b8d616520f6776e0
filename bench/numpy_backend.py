"""Time and peak memory of the tiled NumPy backend against naive O(S²) NumPy attention.

    python bench/numpy_backend.py [--seq 512 1024 2048 4096] [--batch 1] [--heads 8] [--dim 64]

Peak memory is measured with tracemalloc (NumPy reports its allocations to it) and excludes the
inputs; time is the median of --repeat runs. float32 forward; the naive version applies the
causal mask with numpy.where on the full score matrix.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's cupy_attn, not an installed one
import cupy_attn  # noqa: E402


def naive(q, k, v, causal):
    """softmax(q·kᵀ/√d)·v with the full (B, H, S, S) score matrix."""
    s = q @ k.swapaxes(-1, -2) / np.float32(np.sqrt(q.shape[-1]))
    if causal:
        s = np.where(np.tri(s.shape[-2], s.shape[-1], dtype=bool), s, np.float32(-np.inf))
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s @ v


def measure(fn, repeat):
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, peak


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=positive, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--batch", type=positive, default=1)
    parser.add_argument("--heads", type=positive, default=8)
    parser.add_argument("--dim", type=positive, default=64)
    parser.add_argument("--repeat", type=positive, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"B={args.batch} H={args.heads} D={args.dim} float32 forward; peak = extra memory beyond the inputs")
    print(f"{'S':>6} {'causal':>6} {'impl':>10} {'ms':>9} {'peak MiB':>9} {'max |diff|':>10}")
    for s in args.seq:
        q, k, v = (rng.standard_normal((args.batch, args.heads, s, args.dim), dtype=np.float32) for _ in range(3))
        for causal in (False, True):
            tiled = cupy_attn.attention(q, k, v, causal=causal, backend="numpy")
            diff = float(np.abs(tiled - naive(q, k, v, causal)).max())
            for name, fn in (("cupy_attn", lambda: cupy_attn.attention(q, k, v, causal=causal, backend="numpy")),
                             ("naive", lambda: naive(q, k, v, causal))):
                ms, peak = measure(fn, args.repeat)
                print(f"{s:>6} {str(causal):>6} {name:>10} {ms:>9.1f} {peak / 2**20:>9.1f} {diff:>10.1e}")


if __name__ == "__main__":
    main()
