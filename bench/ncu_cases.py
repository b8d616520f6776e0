"""One forward and one dK/dV launch per tensor-core kernel family, for Nsight Compute.

    ncu --clock-control none -k regex:"attention_(fwd|bwd_dkdv)" -c 4 --section ... \
        python bench/ncu_cases.py
    python bench/ncu_cases.py --dry-run     # the same calls, tiny, on the emulator (no GPU)
    python bench/ncu_cases.py --summarize ncu_raw.csv   # ncu --page raw --csv: the counters we track

bf16, B = 4, H = 16, S = 4096, D = 128, not causal (FlashAttention's headline configuration at
B·S = 16k). Order of the profiled launches: the GPU's default forward and dK/dV (mma.sync), then
on compute capability 9.0 the wgmma forward and dK/dV. Run bench/precompile.py first so that no compilation happens under
the profiler; ncu flushes the caches before each profiled launch.
"""
import argparse
import csv
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy_attn  # noqa: E402
from cupy_attn import _arrays, _kernel_backend  # noqa: E402


def case(dry_run: bool):
    """(array module, backend, q, k, v, dout) of the profiled case, or of its tiny emulated twin."""
    if dry_run:
        xp, backend, (b, h, s, d) = np, "emulator", (1, 1, 70, 128)
    else:
        import cupy

        xp, backend, (b, h, s, d) = cupy, "auto", (4, 16, 4096, 128)
    rng = np.random.default_rng(0)
    q, k, v, dout = (xp.asarray(rng.standard_normal((b, h, s, d), dtype=np.float32).astype(_arrays.BFLOAT16))
                     for _ in range(4))
    return xp, backend, q, k, v, dout


def kernel_families(xp, default_only: bool = False):
    """Runs the loop body under each kernel family this device has, in turn: its default, then on
    compute capability 9.0 the wgmma kernels (unless default_only: gpu_check.sh's choice where
    their benchmark failed, so that a fault or hang there costs no further step); yields the
    family's name."""
    hopper = not default_only and xp is not np and int(xp.cuda.Device().compute_capability) == 90
    for capability in (None, 90) if hopper else (None,):
        _kernel_backend.CUDA_COMPUTE_CAPABILITY = capability
        yield "wgmma" if capability else "default"
    _kernel_backend.CUDA_COMPUTE_CAPABILITY = None


# Substrings of the raw metric names worth a line each: time, tensor pipes, issue slots, achieved
# occupancy, shared-memory bank conflicts and wavefronts, DRAM throughput, registers; what the
# warps wait on (WarpStateStats: per reason, the warps stalled on it per issued instruction) and
# the global reductions (dQ's red.global) at L1 and L2, which the dK/dV kernels issue per query
# tile: whether those hold the dK/dV kernels back is the question the first H200 run left.
TRACKED = ("gpu__time_duration.sum", "pipe_tensor", "issue_active.avg.pct", "warps_active.avg.pct_of_peak",
           "data_bank_conflicts_pipe_lsu_mem_shared", "data_pipe_lsu_wavefronts_mem_shared.sum",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed", "launch__registers_per_thread",
           "launch__occupancy_limit", "_per_issue_active.ratio", "op_red")


def summarize(path: Path) -> str:
    rows = list(csv.reader(path.open()))
    header, units, kernels = rows[0], rows[1], rows[2:]
    name_col = header.index("Kernel Name")
    columns = [i for i, name in enumerate(header) if any(t in name for t in TRACKED)]
    lines = []
    for row in kernels:
        lines.append(row[name_col][:90])
        lines += [f"  {header[i]:<75} {row[i]:>14} {units[i]}" for i in columns]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the emulator")
    parser.add_argument("--summarize", type=Path, help="print the tracked counters of an ncu raw CSV and exit")
    parser.add_argument("--default-only", action="store_true", help="the GPU's default kernels alone, not the wgmma ones")
    args = parser.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    xp, backend, q, k, v, dout = case(args.dry_run)
    for family in kernel_families(xp, args.default_only):
        out, lse = cupy_attn.attention(q, k, v, return_lse=True, backend=backend)
        cupy_attn.attention_backward(dout, q, k, v, out, lse, backend=backend)
        if xp is not np:
            xp.cuda.Device().synchronize()
        print(f"ran forward and backward with the {family} kernels", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
