"""Benchmark the inference paths: decoding over a KV cache, and packed (varlen) prefill.

    python bench/bench_inference.py [--quick] [--budget-s S] [--out DIR] [--device auto|gpu|cpu]

Decode (`attention_with_kvcache`, Sq = 1): B = 1, 8, 64; context 1k to 128k; H = 32, Hkv = 8,
D = 128, bf16; a contiguous cache and paged caches of 16- and 256-token pages (block tables
shuffled, as an allocator leaves them). Decoding reads every cached K/V byte once, so its measure
is achieved bandwidth: K/V bytes ÷ time, as a fraction of the GPU's datasheet bandwidth and of a
device-to-device copy measured in the same run. PyTorch SDPA runs the same shapes on a
contiguous (B, Hkv, S, D) cache with enable_gqa (it has no paged cache), each of its backends
that accepts the case, and the fastest is reported. Calls are timed back to back, each case over
enough caches taken in turn that together they exceed twice the L2 (so a small cache is read
from HBM, not from the L2).

Prefill (`attention_varlen`, causal): sequences of random lengths packed into 16k tokens,
against SDPA on the padded equivalent (B, max length) with a key-padding mask (what SDPA users
run without varlen support); TFLOP/s counts only the valid (causal) pairs, for both.

Without a GPU (--device cpu, or no GPU): the NumPy backend at CPU-sized shapes (and SDPA on the
CPU for prefill when PyTorch is installed), so the script and its output are exercised
everywhere. Writes results.json (a list of records) into --out and prints a table.
"""
from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy_attn  # noqa: E402
from bench_attention import (L2_BYTES, budgeted_main, report_failure, resolve_device, time_call, time_gpu,  # noqa: E402
                             write_records)

# Datasheet HBM bandwidth in bytes/s by the device name CuPy reports (a lead, not a measurement).
DATASHEET_BANDWIDTH = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}
GPU_MEMORY_BUDGET = 48 * 2**30  # skip decode cases whose caches would need more


@dataclass(frozen=True)
class DecodeCase:
    B: int
    context: int
    cache: str  # "contiguous", "paged16", "paged256"
    H: int = 32
    Hkv: int = 8
    D: int = 128
    dtype: str = "bfloat16"

    @property
    def page_size(self) -> int:
        return {"contiguous": 0, "paged16": 16, "paged256": 256}[self.cache]

    def kv_bytes(self) -> int:
        return 2 * self.B * self.context * self.Hkv * self.D * np.dtype(_dtype(self.dtype)).itemsize


@dataclass(frozen=True)
class PrefillCase:
    total: int
    min_len: int
    max_len: int
    H: int = 32
    Hkv: int = 8
    D: int = 128
    dtype: str = "bfloat16"


def _dtype(name: str):
    return cupy_attn._arrays.BFLOAT16 if name == "bfloat16" else np.dtype(name)


def decode_cases(device: str, quick: bool) -> list[DecodeCase]:
    if device == "cpu":
        return [DecodeCase(b, ctx, cache, H=8, Hkv=2, D=64, dtype="float32")
                for b in (1, 4) for ctx in (256, 1024) for cache in ("contiguous", "paged16")]
    contexts = (4096, 32768) if quick else (1024, 4096, 16384, 32768, 65536, 131072)
    cases = [DecodeCase(b, ctx, cache) for b in (1, 8, 64) for ctx in contexts
             for cache in ("contiguous", "paged16", "paged256")]
    return [c for c in cases if c.kv_bytes() <= GPU_MEMORY_BUDGET]


def prefill_cases(device: str, quick: bool) -> list[PrefillCase]:
    if device == "cpu":
        return [PrefillCase(1024, 32, 384, H=8, Hkv=2, D=64, dtype="float32")]
    return [PrefillCase(16384, 512, 4096)] + ([] if quick else [PrefillCase(16384, 128, 1024)])


def sequence_lengths(rng, total: int, low: int, high: int) -> np.ndarray:
    """Random lengths in [low, high] summing to total (the last one trimmed)."""
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(rng.integers(low, high + 1)))
    lengths[-1] -= sum(lengths) - total
    return np.array([n for n in lengths if n > 0])


# ---- decode ----

def random_array(xp, shape, dtype, rng):
    """Standard normal values in ``dtype``, drawn in slices of the first axis of at most 2**26
    elements, so a cache of tens of GB needs no float32 twin of itself; on the GPU by CuPy's own
    generator (seeded from `rng`): the largest caches hold billions of values, minutes of the
    host's drawing."""
    x = xp.empty(shape, dtype=dtype)
    draw = rng if xp is np else xp.random.default_rng(int(rng.integers(2**31)))
    per_row = int(np.prod(shape[1:], dtype=np.int64))
    step = max(1, 2**26 // max(per_row, 1))
    for i in range(0, shape[0], step):
        rows = x[i:i + step]
        rows[...] = draw.standard_normal(rows.shape, dtype=np.float32).astype(dtype)
    return x


def decode_inputs(case: DecodeCase, xp, rng):
    """q (B, 1, H, D), caches holding `context` tokens per entry, a block table (None if contiguous)."""
    dtype = _dtype(case.dtype)

    def random(*shape):
        return random_array(xp, shape, dtype, rng)

    q = random(case.B, 1, case.H, case.D)
    if not case.page_size:
        k_cache = random(case.B, case.context, case.Hkv, case.D)
        v_cache = random(case.B, case.context, case.Hkv, case.D)
        table = None
    else:
        pages = case.context // case.page_size
        k_cache = random(case.B * pages, case.page_size, case.Hkv, case.D)
        v_cache = random(case.B * pages, case.page_size, case.Hkv, case.D)
        table = xp.asarray(rng.permutation(case.B * pages).reshape(case.B, pages).astype(np.int32))
    seqlens = xp.full(case.B, case.context, dtype=np.int32)
    return q, k_cache, v_cache, table, seqlens


def cupy_attn_decode(case: DecodeCase, inputs):
    q, k_cache, v_cache, table, seqlens = inputs
    return lambda: cupy_attn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)


def sdpa_decode_calls(case: DecodeCase, sets: int):
    """SDPA's backends on `sets` contiguous (B, Hkv, S, D) caches, taken in turn: name -> calls."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = getattr(torch, case.dtype)
    inputs = []
    for _ in range(sets):
        q = torch.randn(case.B, case.H, 1, case.D, device="cuda", dtype=dtype)
        k = torch.randn(case.B, case.Hkv, case.context, case.D, device="cuda", dtype=dtype)
        inputs.append((q, k, torch.randn_like(k)))
    calls = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
        def call(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        calls[name] = [lambda q=q, k=k, v=v, call=call: call(q, k, v) for q, k, v in inputs]
    return calls


def decode_sets(case: DecodeCase, device: str) -> int:
    """How many caches a decode case takes in turn: together at least twice the L2 on the GPU, so
    that no call finds its keys and values there (a small cache read again would be timed at the
    L2's bandwidth, not HBM's); one on the CPU."""
    return 1 if device == "cpu" else int(min(8, max(1, -(-2 * L2_BYTES // case.kv_bytes()))))


# ---- prefill ----

def prefill_inputs(case: PrefillCase, xp, rng):
    dtype = _dtype(case.dtype)
    lengths = sequence_lengths(rng, case.total, case.min_len, case.max_len)
    cu = xp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    q, k, v = (random_array(xp, (case.total, h, case.D), dtype, rng) for h in (case.H, case.Hkv, case.Hkv))
    return lengths, cu, q, k, v


def causal_pairs(lengths) -> int:
    return int(sum(n * (n + 1) // 2 for n in lengths))


def sdpa_padded_calls(case: PrefillCase, lengths, device: str):
    """SDPA on the padded equivalent (B, H, max length, D) with a key-padding mask plus causal
    (a bool mask; is_causal cannot be combined with one): name -> call."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = getattr(torch, case.dtype)
    b, s = len(lengths), int(lengths.max())
    where = "cuda" if device == "gpu" else "cpu"
    q = torch.randn(b, case.H, s, case.D, device=where, dtype=dtype)
    k = torch.randn(b, case.Hkv, s, case.D, device=where, dtype=dtype)
    v = torch.randn_like(k)
    i = torch.arange(s, device=where)
    valid = i[None, :] < torch.as_tensor(lengths, device=where)[:, None]  # (B, S)
    mask = (i[None, :] <= i[:, None])[None, None] & valid[:, None, None, :] & valid[:, None, :, None]
    # (flash takes no mask; math would materialise every score and is never the fastest)
    backends = ({"efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
                if device == "gpu" else {"default": None})
    calls = {}
    for name, backend in backends.items():
        def call(backend=backend):
            if backend is None:
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        calls[name] = call
    return calls


# ---- running ----

def copy_bandwidth() -> float:
    """Bytes read plus written per second by a 2 GiB device-to-device copy (10 back to back)."""
    import cupy

    src = cupy.empty(2**30, dtype=np.uint8)
    dst = cupy.empty_like(src)
    ms, _ = time_gpu([lambda: dst.__setitem__(Ellipsis, src)], 10)
    return 2 * src.nbytes / (ms * 1e-3)


def _best(device: str, calls: dict, reps: int):
    """(name, ms) of the fastest call that runs; (None, None) if none does."""
    best = (None, None)
    for name, call in calls.items():
        try:
            ms = time_call(device, call, reps)
        except Exception as exc:
            report_failure(f"sdpa {name}", exc)
            continue
        if best[1] is None or ms < best[1]:
            best = (name, ms)
    return best


def run(args) -> list[dict]:
    device, xp = resolve_device(args.device)
    peak = copy = None
    if device == "gpu":
        import cupy

        copy = copy_bandwidth()
        peak = DATASHEET_BANDWIDTH.get(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
    has_torch = importlib.util.find_spec("torch") is not None
    reps = 20 if device == "gpu" else 3
    rng = np.random.default_rng(0)
    records = []
    started = time.perf_counter()

    def out_of_time() -> bool:
        return bool(args.budget_s) and time.perf_counter() - started > args.budget_s

    def record(**fields):
        records.append(dict(fields, device=device, copy_bandwidth=copy, datasheet_bandwidth=peak))
        write_records(args.out, records)

    for case in decode_cases(device, args.quick):
        if out_of_time():
            print("budget spent: remaining decode cases not run", file=sys.stderr)
            break
        sets = decode_sets(case, device)
        ms = time_call(device, [cupy_attn_decode(case, decode_inputs(case, xp, rng)) for _ in range(sets)], reps)
        sdpa_name, sdpa_ms = (_best(device, sdpa_decode_calls(case, sets), reps)
                              if device == "gpu" and has_torch and case.cache == "contiguous" else (None, None))
        bandwidth = case.kv_bytes() / (ms * 1e-3)
        record(kind="decode", **asdict(case), ms=ms, bandwidth=bandwidth, sdpa_backend=sdpa_name, sdpa_ms=sdpa_ms,
               sdpa_bandwidth=None if sdpa_ms is None else case.kv_bytes() / (sdpa_ms * 1e-3))
        share = "" if peak is None else f" {bandwidth / peak:6.1%} of datasheet"
        print(f"decode  B={case.B:<3} ctx={case.context:<6} {case.cache:<10} {ms:9.4f} ms "
              f"{bandwidth / 1e9:8.1f} GB/s{share}" + ("" if sdpa_ms is None else f"  sdpa[{sdpa_name}] {sdpa_ms:9.4f} ms"),
              flush=True)
    for case in prefill_cases(device, args.quick):
        if out_of_time():
            print("budget spent: remaining prefill cases not run", file=sys.stderr)
            break
        lengths, cu, q, k, v = prefill_inputs(case, xp, rng)
        longest = int(lengths.max())
        ms = time_call(device, lambda: cupy_attn.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True), reps)
        sdpa_name, sdpa_ms = _best(device, sdpa_padded_calls(case, lengths, device), reps) if has_torch else (None, None)
        flops = 4.0 * case.H * case.D * causal_pairs(lengths)
        record(kind="prefill", **asdict(case), sequences=len(lengths), ms=ms, tflops=flops / (ms * 1e-3) / 1e12,
               sdpa_backend=sdpa_name, sdpa_ms=sdpa_ms,
               sdpa_tflops=None if sdpa_ms is None else flops / (sdpa_ms * 1e-3) / 1e12)
        print(f"prefill {len(lengths)} sequences, {case.total} tokens: {ms:9.3f} ms"
              + ("" if sdpa_ms is None else f"  sdpa[{sdpa_name}] padded {sdpa_ms:9.3f} ms ({sdpa_ms / ms:.2f}x)"),
              flush=True)
    return records


def main(argv=None) -> int:
    return budgeted_main(argv, __doc__, run, Path("bench/out_inference"), "fewer contexts and one prefill case")

if __name__ == "__main__":
    sys.exit(main())
