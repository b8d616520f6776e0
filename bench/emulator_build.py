"""How long the emulator takes to build and run attention kernels on the CPU.

    python bench/emulator_build.py [--cases fwd_tc bwd_tc ...]

With an empty cache (a temporary CUPY_ATTN_EMULATOR_CACHE): first the shared parts every module
uses (the runtime library and the precompiled header), then per case its first call (building
its modules and running) and its second (running only). Build time dominates the test suite,
which builds several hundred modules.
"""
import argparse
import os
import tempfile
import time

import numpy as np

import cupy_attn
from cupy_attn import _kernel_backend
from cupy_attn.emulator import _build

CASES = {  # (dtype, head dim, compute capability, backward): 150 queries, 300 keys, 2 heads
    "fwd_fp32": (np.float32, 64, 80, False),
    "fwd_tc": (np.float16, 64, 80, False),
    "bwd_tc": (np.float16, 64, 80, True),
    "fwd_wgmma": (np.float16, 64, 90, False),
    "bwd_wgmma": (np.float16, 64, 90, True),
}


def run(dtype, head_dim, capability, backward):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, s, head_dim)).astype(dtype) for s in (150, 300, 300))
    _kernel_backend.EMULATOR_COMPUTE_CAPABILITY = capability
    out, lse = cupy_attn.attention(q, k, v, return_lse=True, backend="emulator")
    if backward:
        cupy_attn.attention_backward(np.ones_like(out), q, k, v, out, lse, backend="emulator")


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["CUPY_ATTN_EMULATOR_CACHE"] = cache
        print(f"runtime library {timed(_build.runtime_library):.1f} s, "
              f"precompiled header {timed(_build.precompiled_header):.1f} s")
        for name in args.cases:
            first, second = timed(run, *CASES[name]), timed(run, *CASES[name])
            print(f"{name:<10} first call {first:5.1f} s (build and run), second {second:5.2f} s (run)")


if __name__ == "__main__":
    main()
