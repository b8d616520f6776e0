"""What the wgmma forward's persistence saves: its kernel's time between two CUDA events, with one
block per SM claiming work tiles (as it runs) and with a block per work tile (the same build, whose
blocks' claims then find none), on the same inputs.

    python bench/persistence.py [--calls N] [--dry-run]

bf16, D = 128, B·S = 16k, H = 16 (the benchmark's configuration), S = 1k, 4k and 16k, causal and
not; the median of N launches each. What persistence saves is each block's start (barriers, its
first K, V and Q) and end (O staged and stored) once per 128 query rows, which weighs most at
small S. Needs compute capability 9.0; elsewhere it says so and exits 0.
--dry-run: the same on the emulator (compute capability 9.0 emulated, its 3 SMs) at one tiny size.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]  # a source checkout
import cupy_attn  # noqa: E402
import host_profile  # noqa: E402  (bench/: launches timed between stamps)
from cupy_attn import _arrays, _kernel_backend  # noqa: E402

KERNEL = "attention_fwd_wgmma<"


def forward_launch(xp, call, sync) -> tuple[float, tuple]:
    """(ms, grid) of the wgmma forward launch of one call."""
    with host_profile.timed_launches(xp) as timed:
        call()
        sync()
    [(ms, grid)] = [(start.ms_to(stop), grid) for name, grid, start, stop in timed if name.startswith(KERNEL)]
    return ms, grid


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--dry-run", action="store_true", help="one tiny size on the emulator")
    args = parser.parse_args(argv)
    if args.dry_run:
        xp, backend, calls, sizes = np, "emulator", 1, [(1, 2, 300)]
        _kernel_backend.EMULATOR_COMPUTE_CAPABILITY = 90
        sync = lambda: None  # noqa: E731
    else:
        import cupy

        if int(cupy.cuda.Device().compute_capability) != 90:
            print("persistence: the wgmma forward needs compute capability 9.0; this GPU has "
                  f"{cupy.cuda.Device().compute_capability}")
            return 0
        xp, backend, calls = cupy, "auto", args.calls
        sizes = [(16384 // s, 16, s) for s in (1024, 4096, 16384)]
        _kernel_backend.CUDA_COMPUTE_CAPABILITY = 90
        sync = cupy.cuda.Device().synchronize
    resident_blocks = _kernel_backend.resident_blocks
    rng = np.random.default_rng(0)
    for b, h, s in sizes:
        q, k, v = (xp.asarray(rng.standard_normal((b, h, s, 128), dtype=np.float32).astype(_arrays.BFLOAT16))
                   for _ in range(3))
        for causal in (False, True):
            call = lambda: cupy_attn.attention(q, k, v, causal=causal, backend=backend)  # noqa: E731
            times = {}
            for mode, blocks in (("a block per tile", lambda target: 2**31 - 1), ("persistent", resident_blocks)):
                _kernel_backend.resident_blocks = blocks
                try:
                    forward_launch(xp, call, sync)  # the first call's compilation and tensor maps, untimed
                    runs = [forward_launch(xp, call, sync) for _ in range(calls)]
                finally:
                    _kernel_backend.resident_blocks = resident_blocks
                times[mode] = (statistics.median(ms for ms, _ in runs), runs[0][1][0])
            (per_tile, tiles), (persistent, blocks) = times["a block per tile"], times["persistent"]
            print(f"persistence bf16 D=128 B={b} H={h} S={s} {'causal' if causal else 'not causal'}: a block per "
                  f"tile {per_tile:.3f} ms ({tiles} blocks), persistent {persistent:.3f} ms ({blocks} blocks): "
                  f"{per_tile / persistent:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
