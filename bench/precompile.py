"""Compile every kernel variant this GPU can select, in parallel, into CuPy's disk cache.

    python bench/precompile.py [--jobs N] [--dry-run]

Run first on a lent GPU: the tests, the sanitizer and the benchmark then load cubins from the
cache instead of compiling one variant at a time inside a timed step. Prints each variant's
compile time and the wall time of the whole build. --dry-run compiles the first variants with
NVRTC alone (no CuPy, no GPU), to check the script where no GPU is.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout
from cupy_attn import _compile, _config, _nvrtc  # noqa: E402


def compile_on_gpu(variant: tuple) -> tuple[str, float]:
    filename, name, features = variant
    start = time.perf_counter()
    _compile.function("cuda", filename, name, features=features)
    return f"{name} [{features}]", time.perf_counter() - start


def compile_without_gpu(variant: tuple) -> tuple[str, float]:
    filename, name, features = variant
    arch = _config.FILE_ARCH.get(filename, "sm_90")
    result = _nvrtc.compile_kernel(_compile.kernel_source(filename), name, arch,
                                   _compile.gpu_build_options(filename, features))
    return f"{name} [{features}]", result.compile_seconds


def compile_in_parallel(work, variants: list, jobs: int, verbose: bool = False) -> float:
    """Run work(variant) for every (filename, name expression, features) variant in a pool of
    `jobs` processes; the wall time it took."""
    start = time.perf_counter()
    # spawn: each worker opens its own CUDA context (a forked CUDA context is unusable)
    with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(variants))), mp_context=get_context("spawn")) as pool:
        for name, seconds in pool.map(work, variants):
            if verbose:
                print(f"{name:<58} {seconds:6.2f} s", flush=True)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--dry-run", action="store_true", help="NVRTC only, first two variants, no GPU")
    args = parser.parse_args(argv)
    if args.dry_run:
        arch, work = "sm_90", compile_without_gpu
    else:
        import cupy

        arch, work = f"sm_{cupy.cuda.Device().compute_capability}", compile_on_gpu
    # The compile report's builds of every variant (plain; softcap, ALiBi and a float mask; dropout):
    # a call compiles the build of exactly its features (_config.FEATURE_SETS) on first use.
    variants = [(filename, name, features) for filename, name, _ in _config.kernel_variants(arch)
                for features in _config.FEATURE_LEVELS if _config.selectable(filename, name, features)]
    if args.dry_run:
        variants = variants[:2]
    seconds = compile_in_parallel(work, variants, args.jobs, verbose=True)
    print(f"compiled {len(variants)} variants for {arch} in {seconds:.1f} s wall with {args.jobs} jobs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
