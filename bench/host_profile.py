"""Where a call's time goes: its kernels' GPU times, and cProfile over repeated calls for the host.

    python bench/host_profile.py [--calls N] [--dry-run]

On a GPU: bf16, B = 4, H = 16, S = 4096, D = 128 (the Nsight Compute case), the default kernels
and, on compute capability 9.0, the wgmma ones. For each: the wall time per call with the calls
queued (no synchronisation between them) and with a synchronisation after each; the median time
of a whole call between two CUDA events (the benchmark's single-call time), beside each of its kernels'
(cupy_attn's launches, each between two events) and what is left (CuPy's fills and conversions,
and the host's gaps between launches); then the functions that took the most time of N queued
calls, by own time and by cumulative time. On the 2026-12-04 H200 run a single forward call took
about 0.63 ms longer than Nsight Compute's time of its kernel at this size, and a backward call
about 1.1 ms longer than its dK/dV kernel.
--dry-run: the same on the emulator at a tiny size, to check the script where no GPU is.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]  # a source checkout
import cupy_attn  # noqa: E402
import ncu_cases  # noqa: E402  (bench/: the profiled case and its kernel families)
from cupy_attn import _kernel_backend  # noqa: E402


def per_call_ms(call, calls: int, sync) -> tuple[float, float]:
    """(ms per call queued, ms per call each synchronised)."""
    began = time.perf_counter()
    for _ in range(calls):
        call()
    sync()
    queued = (time.perf_counter() - began) / calls * 1e3
    began = time.perf_counter()
    for _ in range(calls):
        call()
        sync()
    return queued, (time.perf_counter() - began) / calls * 1e3


class Stamp:
    """A point in a call's time: a CUDA event recorded on the current stream, or on the emulator
    the host's clock."""

    def __init__(self, xp):
        self.event = xp.cuda.Event() if xp is not np else None
        if self.event is not None:
            self.event.record()
        self.at = time.perf_counter()

    def ms_to(self, later: "Stamp") -> float:
        if self.event is None:
            return (later.at - self.at) * 1e3
        import cupy

        return cupy.cuda.get_elapsed_time(self.event, later.event)


@contextlib.contextmanager
def timed_launches(xp):
    """Every kernel cupy_attn launches inside (_kernel_backend._launch) between two stamps:
    yields the list of (kernel name, grid, start, stop) it fills."""
    launch, timed = _kernel_backend._launch, []

    def timed_launch(target, filename, name, grid, *args, **keywords):
        start = Stamp(xp)
        launch(target, filename, name, grid, *args, **keywords)
        timed.append((name, grid, start, Stamp(xp)))

    _kernel_backend._launch = timed_launch
    try:
        yield timed
    finally:
        _kernel_backend._launch = launch


def kernel_times(call, calls: int, sync, xp) -> str:
    """The median time of a whole call (synchronised before and after, as the benchmark times a single one)
    and of each of its launches, in ms, and the rest: what the launches do not cover."""
    whole, kernels = [], {}
    for _ in range(calls):
        with timed_launches(xp) as timed:
            sync()
            start = Stamp(xp)
            call()
            stop = Stamp(xp)
            sync()
        whole.append(start.ms_to(stop))
        for name, _, began, ended in timed:
            kernels.setdefault(name, []).append(began.ms_to(ended))
    call_ms = statistics.median(whole)
    parts = {name: statistics.median(times) for name, times in kernels.items()}
    return f"{call_ms:.3f} ms per call: " + ", ".join(f"{name} {ms:.3f}" for name, ms in parts.items()) \
        + f", the rest {call_ms - sum(parts.values()):.3f}"


def profile(call, calls: int, sync) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    sync()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(15)
    stats.sort_stats("cumulative").print_stats(25)
    return text.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the emulator")
    parser.add_argument("--default-only", action="store_true", help="the GPU's default kernels alone, not the wgmma ones")
    args = parser.parse_args(argv)
    xp, backend, q, k, v, dout = ncu_cases.case(args.dry_run)
    calls = 2 if args.dry_run else args.calls
    sync = xp.cuda.Device().synchronize if xp is not np else (lambda: None)
    b, h, s, d = q.shape
    for family in ncu_cases.kernel_families(xp, args.default_only):
        out, lse = cupy_attn.attention(q, k, v, return_lse=True, backend=backend)  # compiled here, not timed
        cupy_attn.attention_backward(dout, q, k, v, out, lse, backend=backend)
        sync()
        passes = {"forward": lambda: cupy_attn.attention(q, k, v, backend=backend),
                  "backward": lambda: cupy_attn.attention_backward(dout, q, k, v, out, lse, backend=backend)}
        for name, call in passes.items():
            queued, synced = per_call_ms(call, calls, sync)
            print(f"host {family} {name}: {queued:.3f} ms per call queued, {synced:.3f} ms each synchronised "
                  f"({calls} calls, B={b} H={h} S={s} D={d} bf16)", flush=True)
            print(f"host {family} {name} kernels: {kernel_times(call, calls, sync, xp)}", flush=True)
            print(profile(call, calls, sync), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
