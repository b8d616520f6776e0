"""Benchmark cupy_attn against PyTorch SDPA (every backend), JAX and NumPy.

    python bench/bench_attention.py [--quick | --full] [--budget-s S] [--out DIR] [--impls NAME ...]
                                    [--pass fwd,bwd] [--compile-times] [--device auto|gpu|cpu]

On a GPU: cupy_attn's CUDA kernels (and, on compute capability 9.0, its wgmma kernels beside the
mma.sync ones it runs by default) against PyTorch SDPA's flash, cuDNN and efficient backends and
jax.nn.dot_product_attention, in FlashAttention's configurations (B·S = 16k, H·D = 2048, S 1k to
16k, D 64/128, bf16/fp16, causal and not; --full adds D = 256 and S = 512) plus a GQA case, a
padding-mask case and a decode case. Without a GPU: the NumPy backend against naive NumPy and
PyTorch SDPA on the CPU, at CPU-sized shapes.

Timing: warm-up calls first (compilation is never timed), then, as FlashAttention's benchmarks
time (torch.utils.benchmark, triton's do_bench), the time per call of calls queued back to back
(`ms`, from which `tflops` comes: the GPU sets the pace where the host keeps ahead, the host
where it does not), cycling through several input sets whose total size exceeds the L2 cache;
beside it the median of single calls, each between two CUDA events (`ms_single_call`, which adds
the host's work before the first launch), and the host's time to return (`host_ms`). JAX's
calls, whose work is not on CuPy's stream, are timed by the host's clock to the last result.
FLOPs follow FlashAttention's convention: 4·B·H·Sq·Sk·D forward (halved when causal, Sq = Sk),
2.5× that backward. Peak memory is what the call allocates beyond its inputs.

Each implementation's first result of a case and pass (cupy_attn's computed into outputs
filled with NaN first, so that what a kernel leaves unwritten shows) is checked against attention
in float32 (bench/reference_check.py: PyTorch's SDPA math backend); each record holds its errors and
the kernels the call launched, and a result off by more than 5 % of an output's largest
magnitude, or 25 % of a row's, is marked wrong and left out of the comparisons and plots.

Writes results.json (a list of records) and one PNG per pass into --out, and prints a table of
cupy_attn's speed relative to the best other implementation last, then the result checks.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import tracemalloc
from functools import lru_cache
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout
import cupy_attn  # noqa: E402
from cupy_attn import _backends  # noqa: E402

import reference_check  # noqa: E402  (bench/)

L2_BYTES = 64 * 2**20  # a little above an H100/H200's L2
# JAX would otherwise take 75 % of the GPU's memory at its first use, from CuPy and PyTorch.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@dataclass(frozen=True)
class Case:
    name: str
    B: int
    H: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    dtype: str
    causal: bool
    padding: bool = False  # a bool (B, 1, 1, Sk) key-padding mask

    def __post_init__(self):
        # SDPA's and JAX's causal masks are top-left aligned, cupy_attn's bottom-right: the same
        # pairs, and half of them, only where Sq = Sk.
        if self.causal and self.Sq != self.Sk:
            raise ValueError(f"causal cases need Sq = Sk, got {self.Sq} and {self.Sk}")

    def flops(self, pass_: str) -> float:
        f = 4.0 * self.B * self.H * self.Sq * self.Sk * self.D / (2 if self.causal else 1)
        return f * (2.5 if pass_ == "bwd" else 1.0)


def gpu_cases(quick: bool, full: bool = False) -> list[Case]:
    """The headline cases first (bf16, D = 128, then bf16 D = 64: issue 15's comparison), so a run
    cut short by --budget-s keeps them; fp16 after (the 2026-12-04 run's 70 s reached bf16 D = 128
    and three fp16 cases)."""
    if quick:
        dtypes, dims, seqs = ["float16"], [64, 128], [1024, 4096]
    else:
        dtypes, dims, seqs = ["bfloat16", "float16"], [128, 64], [1024, 2048, 4096, 8192, 16384]
    cases = [Case("sweep", 16384 // s, 2048 // d, 2048 // d, s, s, d, dtype, causal)
             for dtype in dtypes for d in dims for s in seqs for causal in (False, True)]
    cases.append(Case("gqa", 2, 32, 8, 4096, 4096, 128, "bfloat16", True))
    cases.append(Case("padding_mask", 4, 16, 16, 4096, 4096, 128, "float16", False, padding=True))
    cases.append(Case("decode", 8, 32, 8, 1, 32768 if not quick else 8192, 128, "float16", False))
    if full:
        cases += [Case("sweep", 16384 // s, 2048 // d, 2048 // d, s, s, d, dtype, causal)
                  for d, s in ((256, 1024), (256, 4096), (256, 16384), (128, 512), (64, 512))
                  for dtype in dtypes for causal in (False, True)]
    return cases


def cpu_cases(quick: bool) -> list[Case]:
    seqs = [256, 512, 1024] if quick else [256, 512, 1024, 2048, 4096]
    cases = [Case("sweep", 1, 4, 4, s, s, 64, "float32", c) for s in seqs for c in (False, True)]
    cases.append(Case("padding_mask", 2, 4, 4, 512, 512, 64, "float32", False, padding=True))
    return cases


# ---- inputs -----------------------------------------------------------------------------------

@lru_cache(maxsize=8)  # every implementation and pass of one case share them
def host_inputs(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(cupy_attn._arrays.BFLOAT16 if case.dtype == "bfloat16" else case.dtype)
    q = rng.standard_normal((case.B, case.H, case.Sq, case.D), dtype=np.float32).astype(dtype)
    k = rng.standard_normal((case.B, case.Hkv, case.Sk, case.D), dtype=np.float32).astype(dtype)
    v = rng.standard_normal((case.B, case.Hkv, case.Sk, case.D), dtype=np.float32).astype(dtype)
    dout = rng.standard_normal(q.shape, dtype=np.float32).astype(dtype)
    lengths = rng.integers(case.Sk // 2, case.Sk + 1, case.B) if case.padding else None
    mask = (np.arange(case.Sk)[None, :] < lengths[:, None])[:, None, None, :] if case.padding else None
    return q, k, v, dout, mask


def input_sets(case: Case) -> int:
    per_set = 2 * (case.B * case.H * case.Sq + 2 * case.B * case.Hkv * case.Sk) * case.D
    return int(min(8, max(1, np.ceil(2 * L2_BYTES / per_set))))


# ---- implementations: each returns (prepare(case, pass) -> callable, or a reason it cannot run) ----

class Impl:
    name: str
    device: str  # "gpu" or "cpu"
    # For calls whose GPU work is not ordered on CuPy's current stream (JAX's): waits for a call's
    # result, and the timing uses the host's clock. None: CUDA events on that stream.
    wait = None

    def available(self) -> str | None:
        """None if usable, else why not."""
        return None

    def prepare(self, case: Case, pass_: str, sets: list):
        raise NotImplementedError

    def as_bhsd(self, result):
        """A call's result (out, or dq, dk, dv) in (B, H, S, D) layout, for the check."""
        return result


class CupyAttnCuda(Impl):
    name, device = "cupy_attn", "gpu"

    def available(self):
        usable, why = _backends.cuda_status()
        return None if usable else why

    def to_device(self, x):
        import cupy

        return cupy.asarray(x)

    def prepare(self, case, pass_, sets):
        calls = []
        for q, k, v, dout, mask in ([None if x is None else self.to_device(x) for x in s] for s in sets):
            if pass_ == "fwd":
                calls.append(lambda q=q, k=k, v=v, mask=mask: cupy_attn.attention(q, k, v, causal=case.causal, mask=mask))
            else:
                out, lse = cupy_attn.attention(q, k, v, causal=case.causal, mask=mask, return_lse=True)
                calls.append(lambda q=q, k=k, v=v, d=dout, o=out, l=lse, mask=mask: cupy_attn.attention_backward(
                    d, q, k, v, o, l, causal=case.causal, mask=mask))
        return calls


class CupyAttnWgmma(CupyAttnCuda):
    """On an sm_90 GPU: the wgmma kernels, beside the mma.sync ones it runs by default."""

    name = "cupy_attn_wgmma"

    def available(self):
        why = super().available()
        if why:
            return why
        import cupy

        return None if int(cupy.cuda.Device().compute_capability) == 90 else "wgmma needs compute capability 9.0"

    def prepare(self, case, pass_, sets):
        from cupy_attn import _kernel_backend

        def on_wgmma(call):
            def run():
                _kernel_backend.CUDA_COMPUTE_CAPABILITY = 90
                try:
                    return call()
                finally:
                    _kernel_backend.CUDA_COMPUTE_CAPABILITY = None
            return run

        _kernel_backend.CUDA_COMPUTE_CAPABILITY = 90
        try:
            return [on_wgmma(call) for call in super().prepare(case, pass_, sets)]
        finally:
            _kernel_backend.CUDA_COMPUTE_CAPABILITY = None


class TorchSdpa(Impl):
    device = "gpu"

    def __init__(self, backend: str):
        self.backend = backend
        self.name = f"torch_sdpa_{backend}"

    def available(self):
        if importlib.util.find_spec("torch") is None:
            return "PyTorch is not installed"
        import torch

        return None if torch.cuda.is_available() else "PyTorch sees no CUDA device"

    def prepare(self, case, pass_, sets):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                   "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[self.backend]
        dtype = getattr(torch, case.dtype)
        calls = []
        for q, k, v, dout, mask in sets:
            tq, tk, tv, td = (torch.from_numpy(np.asarray(x, np.float32)).to("cuda", dtype) for x in (q, k, v, dout))
            tm = None if mask is None else torch.from_numpy(mask).cuda()
            tq.requires_grad_(pass_ == "bwd")
            tk.requires_grad_(pass_ == "bwd")
            tv.requires_grad_(pass_ == "bwd")
            # is_causal is top-left in SDPA; it equals bottom-right for the Sq = Sk cases used here.
            kw = dict(attn_mask=tm, is_causal=case.causal and case.Sq > 1, enable_gqa=case.Hkv != case.H)

            def fwd(tq=tq, tk=tk, tv=tv, kw=kw):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, **kw)

            if pass_ == "fwd":
                calls.append(fwd)
            else:
                out = fwd()
                calls.append(lambda out=out, tq=tq, tk=tk, tv=tv, td=td: torch.autograd.grad(
                    out, (tq, tk, tv), td, retain_graph=True))
        return calls


class JaxDotProductAttention(Impl):
    name, device = "jax_dot_product_attention", "gpu"

    def available(self):
        if importlib.util.find_spec("jax") is None:
            return "JAX is not installed"
        import jax

        return None if jax.default_backend() == "gpu" else "JAX has no GPU backend"

    def prepare(self, case, pass_, sets):
        import jax
        import jax.numpy as jnp

        impl = "cudnn" if case.dtype in ("float16", "bfloat16") and not case.padding else None

        def attn(q, k, v, mask):
            return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=case.causal, implementation=impl)

        fwd = jax.jit(attn)
        # The backward alone: the vjp's function (a pytree holding the forward's residuals) is made
        # once per input set, outside the timing; jitting the vjp call with the forward would time
        # both, which XLA cannot separate. Made by a jitted function, so that every set's vjp has
        # the same structure and `bwd` compiles once (a plain jax.vjp's differs per call).
        make_vjp = jax.jit(lambda q, k, v, mask: jax.vjp(lambda q, k, v: attn(q, k, v, mask), q, k, v)[1])
        bwd = jax.jit(lambda vjp, d: vjp(d))
        calls = []
        for q, k, v, dout, mask in sets:
            # JAX's layout is (B, S, H, D)
            jq, jk, jv, jd = (jnp.asarray(np.swapaxes(x, 1, 2)) for x in (q, k, v, dout))
            jm = None if mask is None else jnp.asarray(mask)
            if pass_ == "fwd":
                calls.append(lambda jq=jq, jk=jk, jv=jv, jm=jm: fwd(jq, jk, jv, jm))
            else:
                calls.append(lambda vjp=make_vjp(jq, jk, jv, jm), jd=jd: bwd(vjp, jd))
        return calls

    @staticmethod
    def wait(result):
        import jax

        jax.block_until_ready(result)

    def as_bhsd(self, result):
        swap = lambda x: np.swapaxes(np.asarray(x), 1, 2)  # noqa: E731  (host copies, from (B, S, H, D))
        return swap(result) if not isinstance(result, tuple) else tuple(swap(x) for x in result)


class NumpyBackend(CupyAttnCuda):
    """The same calls on host arrays: the NumPy backend."""

    name, device = "cupy_attn_numpy", "cpu"

    def available(self):
        return None

    def to_device(self, x):
        return x


class NaiveNumpy(Impl):
    name, device = "naive_numpy", "cpu"

    def prepare(self, case, pass_, sets):
        if pass_ == "bwd":
            return "forward only"

        def naive(q, k, v, mask):
            s = q @ k.swapaxes(-1, -2) / np.float32(np.sqrt(q.shape[-1]))
            if case.causal:
                s = np.where(np.tri(s.shape[-2], s.shape[-1], s.shape[-1] - s.shape[-2], dtype=bool), s, -np.inf)
            if mask is not None:
                s = np.where(mask, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            return (s / s.sum(-1, keepdims=True)) @ v

        return [lambda q=q, k=k, v=v, mask=mask: naive(q, k, v, mask) for q, k, v, _, mask in sets]


class TorchSdpaCpu(Impl):
    name, device = "torch_sdpa_cpu", "cpu"

    def available(self):
        return None if importlib.util.find_spec("torch") else "PyTorch is not installed"

    def prepare(self, case, pass_, sets):
        import torch

        calls = []
        for q, k, v, dout, mask in sets:
            tq, tk, tv, td = (torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, v, dout))
            tm = None if mask is None else torch.from_numpy(mask)
            for t in (tq, tk, tv):
                t.requires_grad_(pass_ == "bwd")
            kw = dict(attn_mask=tm, is_causal=case.causal)
            if pass_ == "fwd":
                calls.append(lambda tq=tq, tk=tk, tv=tv, kw=kw: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, **kw))
            else:
                out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, **kw)
                calls.append(lambda out=out, tq=tq, tk=tk, tv=tv, td=td: torch.autograd.grad(out, (tq, tk, tv), td, retain_graph=True))
        return calls


# SDPA's math backend is left out on the GPU: it materialises (B, H, S, S) scores, is no anchor, and
# would spend most of a lent GPU's minutes on the 16k cases.
IMPLS = [CupyAttnCuda(), CupyAttnWgmma(), *(TorchSdpa(b) for b in ("flash", "cudnn", "efficient")), JaxDotProductAttention(),
         NumpyBackend(), NaiveNumpy(), TorchSdpaCpu()]


# ---- timing -------------------------------------------------------------------------------------

def time_gpu(calls, reps: int, detail: dict | None = None, wait=None) -> tuple[float, int]:
    """(ms per call of `reps` calls queued back to back, peak bytes): between one pair of CUDA
    events, or with `wait` (Impl.wait) by the host's clock from the first call's start to the last
    result. The GPU sets that pace where the host keeps ahead, the host where it does not, as in
    FlashAttention's benchmarks. With `detail`, also ms_single_call: the median of single calls,
    each from an event before it to one after (with the host's work before the first launch: on
    the 2026-12-04 H200 run about 0.6 ms more than Nsight Compute's kernel time at S = 4k), and
    host_ms: the median time a call takes to return (its launches queued; with `wait`, the whole
    call)."""
    import cupy

    def call(i):
        result = calls[i % len(calls)]()
        if wait is not None:
            wait(result)
        return result

    hook = PeakMemoryHook()
    torch_peak = _torch_peak_start()
    with hook:
        call(0)
    cupy.cuda.Device().synchronize()
    peak = max(hook.peak, _torch_peak_end(torch_peak))
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    if wait is None:
        start.record()
        for i in range(reps):
            calls[i % len(calls)]()
        stop.record()
        stop.synchronize()
        back_to_back = cupy.cuda.get_elapsed_time(start, stop) / reps
    else:
        began = time.perf_counter()
        for i in range(reps):
            last = calls[i % len(calls)]()
        wait(last)
        back_to_back = (time.perf_counter() - began) * 1e3 / reps
    if detail is not None:
        times, host = [], []
        for i in range(reps):
            start.record()
            began = time.perf_counter()
            call(i)
            host.append((time.perf_counter() - began) * 1e3)
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop))
        detail.update(ms_single_call=statistics.median(times), host_ms=statistics.median(host))
    return back_to_back, peak


def time_cpu(calls, reps: int) -> tuple[float, int]:
    tracemalloc.start()
    calls[0]()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        calls[i % len(calls)]()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), peak


def time_call(device: str, call, reps: int) -> float:
    """ms per call of ``call`` (or of a list of calls taken in turn, e.g. over input sets whose
    total exceeds the L2) on "gpu" (back to back) or "cpu" (median), after one warm-up call of
    each (compilation stays out)."""
    calls = call if isinstance(call, list) else [call]
    for c in calls:
        c()
    return (time_gpu if device == "gpu" else time_cpu)(calls, reps)[0]


def resolve_device(requested: str):
    """(device, array module) for --device auto|gpu|cpu: auto is the GPU when CuPy reaches one."""
    device = requested
    if device == "auto":
        device = "gpu" if _backends.cuda_status()[0] else "cpu"
    if device == "gpu":
        import cupy

        return device, cupy
    return device, np


def report_failure(name: str, exc: Exception) -> None:
    """A backend that rejects a case is reported on stderr, not fatal."""
    first = str(exc).splitlines()[0][:120] if str(exc) else ""
    print(f"  {name}: {type(exc).__name__}: {first}", file=sys.stderr)


def budgeted_main(argv, doc: str, run, default_out: Path, quick_help: str) -> int:
    """The command line the smaller benchmarks share (--quick, --budget-s, --out, --device):
    ``run(args)`` returns the records, written to results.json in --out."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--budget-s", type=float, default=0,
                        help="start no new case after this many seconds (0: no limit); what ran is reported")
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    records = run(args)
    write_records(args.out, records)
    return 0 if records else 1


def _torch_peak_start():
    if "torch" not in sys.modules:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _torch_peak_end(base) -> int:
    if base is None:
        return 0
    import torch

    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


class PeakMemoryHook:
    """The most bytes CuPy's memory pool held for the call at any moment."""

    def __enter__(self):
        import cupy

        pool = cupy.get_default_memory_pool()
        self.base = self.now = pool.used_bytes()
        self.peak = 0

        class Hook(cupy.cuda.MemoryHook):
            name = "peak"

            def malloc_postprocess(hook, device_id, size, mem_size, mem_ptr, pmem_id):
                self.now += mem_size
                self.peak = max(self.peak, self.now - self.base)

            def free_postprocess(hook, device_id, mem_size, mem_ptr, pmem_id):
                self.now -= mem_size

        self.hook = Hook()
        self.hook.__enter__()
        return self

    def __exit__(self, *exc):
        self.hook.__exit__(*exc)


# ---- driver -------------------------------------------------------------------------------------

def run(args) -> list[dict]:
    """Every case in turn, each through every implementation, so a run stopped by --budget-s has
    complete comparisons for the cases it reached. results.json is rewritten after each record."""
    device = args.device
    if device == "auto":
        device = "gpu" if _backends.cuda_status()[0] else "cpu"
    cases = gpu_cases(args.quick, args.full) if device == "gpu" else cpu_cases(args.quick)
    impls = []
    for impl in IMPLS:
        if impl.device != device or (args.impls and impl.name not in args.impls):
            continue
        why = impl.available()
        if why:
            print(f"skipping {impl.name}: {why}", file=sys.stderr)
        else:
            impls.append(impl)
    reps = 10 if args.quick or device == "gpu" and not args.full else 30
    records = []
    started = time.perf_counter()
    for n, case in enumerate(cases):
        if args.budget_s and time.perf_counter() - started > args.budget_s:
            print(f"budget of {args.budget_s} s spent: {len(cases) - n} of {len(cases)} cases not run", file=sys.stderr)
            break
        sets = [host_inputs(case, seed) for seed in range(input_sets(case) if device == "gpu" else 1)]
        for pass_ in args.passes:
            for impl in impls:
                try:
                    calls = impl.prepare(case, pass_, sets)
                    if isinstance(calls, str):
                        continue
                    # warm-up (compilation and autotuning stay out of the timing); the first result
                    # (cupy_attn's into outputs poisoned first) is checked against float32 attention
                    if isinstance(impl, CupyAttnCuda):
                        launched, first = first_call_checked(calls[0])
                        check = dict(checked(case, pass_, device, first), kernels=launched)
                    else:
                        first = calls[0]()
                        if impl.wait is not None:
                            impl.wait(first)
                        check = checked(case, pass_, device, impl.as_bhsd(first))
                    first = None
                    for call in calls[1:2]:
                        call()
                    detail = {}
                    ms, peak = (time_gpu(calls, reps, detail, impl.wait) if device == "gpu"
                                else time_cpu(calls, reps))
                except Exception as exc:  # an implementation that rejects a case is reported, not fatal
                    print(f"{impl.name} {case.name} S={case.Sq} D={case.D} {case.dtype} causal={case.causal} "
                          f"{pass_}: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}",
                          file=sys.stderr)
                    continue
                finally:
                    calls = None
                record = dict(asdict(case), impl=impl.name, device=device, ms=ms,
                              tflops=case.flops(pass_) / (ms * 1e-3) / 1e12, peak_bytes=int(peak), reps=reps, **detail, **check)
                if "ms_single_call" in detail:
                    record["tflops_single_call"] = case.flops(pass_) / (detail["ms_single_call"] * 1e-3) / 1e12
                record["pass"] = pass_
                if "rel_max_error" in check:
                    record["wrong"] = reference_check.wrong(check)
                records.append(record)
                write_records(args.out, records)
                print(f"{impl.name:<28} {case.name:<12} {case.dtype:<8} B={case.B:<3} H={case.H:<3} S={case.Sq:>5}/{case.Sk:<5} "
                      f"D={case.D:<3} causal={case.causal!s:<5} {pass_} {ms:9.3f} ms {record['tflops']:8.3f} TFLOP/s"
                      + (f"  single call {detail['ms_single_call']:.3f} ms, host {detail['host_ms']:.3f} ms" if detail else "")
                      + (f"  error {max(check['rel_max_error'].values()):.1e}, by row {max(check['rel_row_error'].values()):.1e}"
                         if "rel_max_error" in check else "")
                      + ("  WRONG" if record.get("wrong") else ""),
                      flush=True)
    return records


def first_call_checked(call):
    """(the kernels it launched, its result) of a cupy_attn implementation's first call, made with
    outputs filled with NaN before the launch (what a kernel leaves unwritten shows in the check:
    a fresh output from CuPy's pool may hold the previous implementation's right answer), and
    the launches recorded (a fallback, e.g. TMA refusing an operand, shows under its own name)."""
    from cupy_attn import _kernel_backend

    launched, launch = [], _kernel_backend._launch
    poison = _kernel_backend.POISON_OUTPUTS

    def recorded(target, filename, name, *args, **keywords):
        launched.append(name)
        return launch(target, filename, name, *args, **keywords)

    _kernel_backend._launch, _kernel_backend.POISON_OUTPUTS = recorded, True
    try:
        return launched, call()
    finally:
        _kernel_backend._launch, _kernel_backend.POISON_OUTPUTS = launch, poison


def write_records(out: Path, records: list[dict]) -> None:
    """results.json, replaced whole: an outer timeout never leaves half a file."""
    partial = out / "results.json.partial"
    partial.write_text(json.dumps(records, indent=1))
    os.replace(partial, out / "results.json")


def compared(records: list[dict]) -> list[dict]:
    """The records a comparison may use: not those whose result the check found wrong."""
    return [r for r in records if not r.get("wrong")]


def plot(records: list[dict], out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for pass_ in sorted({r["pass"] for r in records}):
        rows = [r for r in compared(records) if r["pass"] == pass_ and r["name"] == "sweep"]
        panels = sorted({(r["dtype"], r["D"], r["causal"]) for r in rows})
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
        for ax, (dtype, d, causal) in zip(axes[0], panels):
            for impl in sorted({r["impl"] for r in rows}):
                pts = sorted((r["Sq"], r["tflops"]) for r in rows
                             if r["impl"] == impl and (r["dtype"], r["D"], r["causal"]) == (dtype, d, causal))
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{pass_} {dtype} D={d}{' causal' if causal else ''}", fontsize=9)
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s (calls back to back)")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{pass_}.png", dpi=110)
        plt.close(fig)


@lru_cache(maxsize=1)  # the cupy_attn implementations of a case and pass run one after the other
def _reference(case: Case, pass_: str, device: str) -> dict:
    return reference_check.reference(*host_inputs(case, 0), causal=case.causal, pass_=pass_, device=device)


def checked(case: Case, pass_: str, device: str, result) -> dict:
    """reference_check.relative_errors of a result of the first input set against float32
    attention, or {"unchecked": why} where that cannot be computed."""
    if importlib.util.find_spec("torch") is None:
        return {"unchecked": "PyTorch is not installed"}
    try:
        return reference_check.relative_errors(result, _reference(case, pass_, device))
    except Exception as exc:  # the reference is a check on the timing, never a reason to lose it
        return {"unchecked": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"}


def result_summary(records: list[dict]) -> str:
    """The checks of the results against float32 attention: a count, every wrong result
    (reference_check.wrong), and the largest errors of each implementation and pass."""
    rows = [r for r in records if "rel_max_error" in r]
    wrong = [r for r in rows if reference_check.wrong(r)]
    unchecked = sorted({r["unchecked"] for r in records if "unchecked" in r})
    lines = [f"results against float32 attention: {len(rows)} checked, {len(wrong)} wrong (an error above "
             f"{reference_check.WRONG_ABOVE} of the output's largest magnitude or {reference_check.WRONG_ROW_ABOVE} of "
             "a row's; left out of the comparisons)"
             + (f"; unchecked: {'; '.join(unchecked)}" if unchecked else "")]

    def line(label: str, r: dict) -> str:
        errors = " ".join(f"{name} {r['rel_max_error'][name]:.1e} (row {r.get('rel_row_error', {}).get(name, float('nan')):.1e}, "
                          f"RMS {r['rel_rms_error'][name]:.1e})" for name in r["rel_max_error"])
        return (f"{label:<8} {r['impl']:<18} {r['name']:<12} {r['dtype']:<9} S={r['Sq']}/{r['Sk']} D={r['D']} "
                f"causal={r['causal']!s:<5} {r['pass']}: {errors}")

    lines += [line("WRONG", r) for r in wrong]
    largest: dict = {}
    for r in rows:
        if r not in wrong:
            key, error = (r["impl"], r["pass"]), max(r["rel_max_error"].values())
            if error >= largest.get(key, (-1.0, None))[0]:
                largest[key] = (error, r)
    lines += [line("largest", largest[key][1]) for key in sorted(largest)]
    return "\n".join(lines)


def summary(records: list[dict]) -> str:
    # cupy_attn as a user gets it (its default kernels on the GPU, the NumPy backend on the CPU);
    # other cupy_attn variants (e.g. cupy_attn_wgmma) are neither "ours" nor "others" here.
    default = ("cupy_attn", "cupy_attn_numpy")
    lines = ["cupy_attn relative to the best other implementation (>1: cupy_attn faster)",
             f"{'case':<12} {'dtype':<9} {'S':>11} {'D':>4} {'causal':<6} {'pass':<4} {'cupy_attn':>10} {'best other':>28} {'ratio':>6}"]
    key = lambda r: (r["name"], r["dtype"], r["Sq"], r["Sk"], r["D"], r["causal"], r["B"], r["H"], r["pass"])  # noqa: E731
    groups: dict = {}
    for r in compared(records):
        groups.setdefault(key(r), []).append(r)
    for k in sorted(groups):
        ours = [r for r in groups[k] if r["impl"] in default]
        others = [r for r in groups[k] if not r["impl"].startswith("cupy_attn")]
        if not ours or not others:
            continue
        best = max(others, key=lambda r: r["tflops"])
        mine = max(ours, key=lambda r: r["tflops"])
        lines.append(f"{k[0]:<12} {k[1]:<9} {f'{k[2]}/{k[3]}':>11} {k[4]:>4} {k[5]!s:<6} {k[8]:<4} "
                     f"{mine['tflops']:>10.3f} {best['impl'] + ' ' + format(best['tflops'], '.3f'):>28} "
                     f"{mine['tflops'] / best['tflops']:>6.2f}")
    return "\n".join(lines)


def compile_times() -> list[dict]:
    """Cold NVRTC compile per variant (no GPU needed); with a GPU also CuPy's cold and warm load."""
    import os
    import subprocess
    import tempfile

    from cupy_attn import _compile, _config, _nvrtc

    rows = []
    for filename, name, dtype in _config.kernel_variants("sm_90"):
        arch = _config.FILE_ARCH.get(filename, "sm_90")
        c = _nvrtc.compile_kernel(_compile.kernel_source(filename), name, arch,
                                  _compile.gpu_build_options(filename, _config.PLAIN_FEATURES))
        rows.append({"kernel": name, "nvrtc_cold_s": round(c.compile_seconds, 3)})
        print(f"{name:<58} NVRTC cold {c.compile_seconds:6.2f} s", flush=True)
    if _backends.cuda_status()[0]:
        # The fp16 forward at D = 128 this GPU selects (the wgmma kernel on compute capability 9.0).
        probe = ("import time, cupy, cupy_attn._compile as c, cupy_attn._config as k, numpy as np;"
                 "tile = k.forward_tile(128, 128, np.float16, int(cupy.cuda.Device().compute_capability));"
                 "t = time.perf_counter(); c.function('cuda', tile.filename, tile.name_expression(np.float16));"
                 "print(time.perf_counter() - t)")
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, CUPY_CACHE_DIR=cache)
            cold, warm = (float(subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                                               check=True).stdout) for _ in range(2))
        rows.append({"kernel": "fp16 forward (D=128) via CuPy", "cupy_cold_s": cold, "cupy_warm_s": warm})
        print(f"CuPy load of one forward variant: cold {cold:.2f} s, warm (disk cache) {warm:.3f} s")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small subset (under two minutes on a CPU)")
    parser.add_argument("--full", action="store_true", help="also D = 256 and S = 512 (GPU)")
    parser.add_argument("--budget-s", type=float, default=0,
                        help="start no new case after this many seconds (0: no limit); what ran is reported")
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    parser.add_argument("--impls", nargs="*", help="implementation names to run (default: all available)")
    parser.add_argument("--pass", dest="passes", default="fwd,bwd", type=lambda s: [p for p in s.split(",") if p],
                        help="fwd, bwd or fwd,bwd")
    parser.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto")
    parser.add_argument("--compile-times", action="store_true", help="report kernel compile times instead")
    args = parser.parse_args(argv)
    if not args.passes or any(p not in ("fwd", "bwd") for p in args.passes):
        parser.error(f"--pass takes fwd, bwd or fwd,bwd, got {','.join(args.passes)!r}")
    unknown = sorted(set(args.impls or ()) - {impl.name for impl in IMPLS})
    if unknown:
        parser.error(f"--impls: no implementation named {', '.join(unknown)}; there are "
                     f"{', '.join(impl.name for impl in IMPLS)}")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"--out {args.out} is not a usable directory: {error.strerror}")
    if args.compile_times:
        (args.out / "compile_times.json").write_text(json.dumps(compile_times(), indent=1))
        return 0
    records = run(args)
    write_records(args.out, records)
    if importlib.util.find_spec("matplotlib"):
        plot(records, args.out)
    else:
        print("matplotlib is not installed (pip install 'cupy_attn[bench]'): no plots", file=sys.stderr)
    print(summary(records))
    print(result_summary(records))
    return 0 if records else 1


if __name__ == "__main__":
    sys.exit(main())
