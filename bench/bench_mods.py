"""Benchmark programmable attention (cupy_attn.MaskMod / ScoreMod) against the dense equivalents.

    python bench/bench_mods.py [--quick] [--budget-s S] [--out DIR] [--device auto|gpu|cpu]

Three cases, forward only, causal:
- document masking over packed sequences: documents of random lengths packed into S tokens, a
  query attends the earlier keys of its own document (a MaskMod reading a (1, S) int32 document
  id tensor), with and without its block mask (cupy_attn.block_mask, built once);
- a sliding window with global tokens (Longformer's pattern): a query attends the last W keys and
  the first G (a MaskMod of two scalars), with and without its block mask, whose non-empty tiles
  of a row have a gap between the global ones and the window's;
- a relative-position bias table (T5): one bias per head and bucket of i − j (a ScoreMod reading
  an (H, 33) table and an (S, S) int32 bucket tensor, additive).
Against PyTorch SDPA with the equivalent dense mask ((1, 1, S, S) bool, or (1, H, S, S) float), the
fastest SDPA backend that accepts it, and FlexAttention (torch.nn.attention.flex_attention with
its block mask, compiled by torch.compile) where it runs. TFLOP/s counts the attended pairs only
(for the document mask Σ len·(len + 1)/2), for every implementation.

On a GPU: bf16, H = 16, D = 128, S = 4k and 16k. Without one (--device cpu): the NumPy backend at
CPU-sized shapes, and SDPA on the CPU when PyTorch is installed, so the script runs everywhere.
Writes results.json into --out and prints a table.
"""
from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy_attn  # noqa: E402
from bench_attention import budgeted_main, report_failure, resolve_device, time_call, write_records  # noqa: E402

BUCKETS = 33  # relative positions -16..16, clipped
GLOBAL_TOKENS = 16  # the window case's global keys


def shapes(device: str, quick: bool):
    """(dims, sequence lengths, the window case's W)."""
    if device == "gpu":
        return dict(H=16, D=128, dtype="bfloat16"), [4096] if quick else [4096, 16384], 512
    return dict(H=4, D=64, dtype="float32"), [256] if quick else [256, 1024], 64


def documents(rng, total: int) -> np.ndarray:
    """(1, total) int32 document ids of random lengths (64 to total / 4 tokens)."""
    ids, at, doc = np.empty(total, np.int32), 0, 0
    while at < total:
        n = int(rng.integers(64, max(65, total // 4)))
        ids[at:at + n] = doc
        at, doc = at + n, doc + 1
    return ids[None]


def attended_pairs(case: str, doc: np.ndarray, window: int) -> int:
    s = doc.shape[1]
    if case == "document":
        lengths = np.bincount(doc[0])
        return int((lengths * (lengths + 1) // 2).sum())
    if case == "window":  # row i: keys [max(0, i - W + 1), i] and those of the first G before them
        i = np.arange(s)
        in_window = np.minimum(i + 1, window)
        return int((in_window + np.clip(np.minimum(i - window + 1, GLOBAL_TOKENS), 0, None)).sum())
    return s * (s + 1) // 2


def inputs(xp, rng, S: int, H: int, D: int, dtype):
    return tuple(xp.asarray(rng.standard_normal((1, H, S, D)).astype(np.float32)).astype(dtype) for _ in range(3))


def mods_for(case: str, xp, doc: np.ndarray, table: np.ndarray, buckets: np.ndarray, window: int) -> dict:
    if case == "document":
        return dict(mask_mod=cupy_attn.MaskMod(
            "doc(0, q_idx) == doc(0, kv_idx)", lambda b, h, q_idx, kv_idx, doc: doc[0, q_idx] == doc[0, kv_idx],
            tensors={"doc": xp.asarray(doc)}))
    if case == "window":
        return dict(mask_mod=cupy_attn.MaskMod(
            "q_idx - kv_idx < window || kv_idx < global_tokens",
            lambda b, h, q_idx, kv_idx, window, global_tokens: (q_idx - kv_idx < window) | (kv_idx < global_tokens),
            scalars={"window": window, "global_tokens": GLOBAL_TOKENS}))
    return dict(score_mod=cupy_attn.ScoreMod(
        "score + table(h, bucket(q_idx, kv_idx))",
        lambda s, b, h, q_idx, kv_idx, table, bucket: s + table[h, bucket[q_idx, kv_idx]],
        tensors={"table": xp.asarray(table), "bucket": xp.asarray(buckets)}, grad="additive"))


def torch_calls(case: str, device: str, q, k, v, doc, table, buckets, window: int) -> dict:
    """SDPA with the dense mask on each backend, and FlexAttention on the GPU: name -> call."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = "cuda" if device == "gpu" else "cpu"
    # DLPack knows no ml_dtypes bfloat16: its bits cross as int16 and are read as torch's bfloat16
    # (as cupy_attn's own interop does), float32 as itself.
    tq, tk, tv = (torch.from_numpy(x) if device == "cpu" else torch.from_dlpack(x) if x.dtype.kind == "f"
                  else torch.from_dlpack(x.view(np.int16)).view(torch.bfloat16) for x in (q, k, v))
    S = tq.shape[2]
    causal = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
    doc_t = torch.as_tensor(doc, device=dev)
    i, j = torch.arange(S, device=dev)[:, None], torch.arange(S, device=dev)[None, :]
    if case == "document":
        dense = (causal & (doc_t[0, :, None] == doc_t[0, None, :]))[None, None]
    elif case == "window":
        dense = (causal & ((i - j < window) | (j < GLOBAL_TOKENS)))[None, None]
    else:
        bias = torch.as_tensor(table, device=dev)[:, torch.as_tensor(buckets, device=dev).long()]
        dense = bias.masked_fill(~causal, float("-inf"))[None].to(tq.dtype)
    calls = {}
    for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        def call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=dense)
        calls[f"sdpa-{backend.name.lower()}"] = call
    if device == "gpu":
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            compiled = torch.compile(flex_attention)
            table_t, buckets_t = torch.as_tensor(table, device=dev), torch.as_tensor(buckets, device=dev).long()
            if case == "document":
                def mask_mod(b, h, q_idx, kv_idx):
                    return (kv_idx <= q_idx) & (doc_t[0, q_idx] == doc_t[0, kv_idx])
                block = create_block_mask(mask_mod, 1, None, S, S, device=dev)
                calls["flex"] = lambda: compiled(tq, tk, tv, block_mask=block)
            elif case == "window":
                def mask_mod(b, h, q_idx, kv_idx):
                    return (kv_idx <= q_idx) & ((q_idx - kv_idx < window) | (kv_idx < GLOBAL_TOKENS))
                block = create_block_mask(mask_mod, 1, None, S, S, device=dev)
                calls["flex"] = lambda: compiled(tq, tk, tv, block_mask=block)
            else:
                def score_mod(score, b, h, q_idx, kv_idx):
                    return score + table_t[h, buckets_t[q_idx, kv_idx]]
                block = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, 1, None, S, S, device=dev)
                calls["flex"] = lambda: compiled(tq, tk, tv, score_mod=score_mod, block_mask=block)
        except Exception as exc:  # FlexAttention needs torch.compile and Triton
            report_failure("flex", exc)
    return calls


def run(args) -> list[dict]:
    device, xp = resolve_device(args.device)
    dims, seqs, window = shapes(device, args.quick)
    dtype = cupy_attn._arrays.BFLOAT16 if dims["dtype"] == "bfloat16" else np.float32
    has_torch = importlib.util.find_spec("torch") is not None
    reps = 20 if device == "gpu" else 3
    rng = np.random.default_rng(0)
    records, started = [], time.perf_counter()
    for S in seqs:
        for case in ("document", "window", "bias"):
            if args.budget_s and time.perf_counter() - started > args.budget_s:
                print("budget spent: remaining cases not run", file=sys.stderr)
                return records
            doc = documents(rng, S)
            table = rng.standard_normal((dims["H"], BUCKETS)).astype(np.float32)
            i, j = np.arange(S)[:, None], np.arange(S)[None, :]
            buckets = (np.clip(i - j, -(BUCKETS // 2), BUCKETS // 2) + BUCKETS // 2).astype(np.int32)
            q, k, v = inputs(xp, rng, S, dims["H"], dims["D"], dtype)
            mods = mods_for(case, xp, doc, table, buckets, window)
            flops = 4.0 * dims["H"] * dims["D"] * attended_pairs(case, doc, window)
            timings = {"cupy_attn": time_call(device, lambda: cupy_attn.attention(q, k, v, causal=True, **mods), reps)}
            if "mask_mod" in mods:  # and with its block mask, built once (as FlexAttention's)
                blocks = cupy_attn.block_mask(mods["mask_mod"], 1, dims["H"], S, S, like=q)
                timings["cupy_attn+block_mask"] = time_call(
                    device, lambda: cupy_attn.attention(q, k, v, causal=True, block_mask=blocks), reps)
            if has_torch:
                for name, call in torch_calls(case, device, q, k, v, doc, table, buckets, window).items():
                    try:
                        timings[name] = time_call(device, call, reps)
                    except Exception as exc:
                        report_failure(name, exc)
            for name, ms in timings.items():
                records.append(dict(case=case, S=S, device=device, impl=name, ms=ms,
                                    tflops=flops / (ms * 1e-3) / 1e12, **dims,
                                    **(dict(W=window, G=GLOBAL_TOKENS) if case == "window" else {})))
            write_records(args.out, records)
            print(f"mods {case:<8} S={S:<6} " + "  ".join(f"{n} {ms:8.3f} ms ({flops / (ms * 1e-3) / 1e12:6.2f} TFLOP/s)"
                                                        for n, ms in timings.items()), flush=True)
    return records


def main(argv=None) -> int:
    return budgeted_main(argv, __doc__, run, Path("bench/out_mods"), "one sequence length")

if __name__ == "__main__":
    sys.exit(main())
