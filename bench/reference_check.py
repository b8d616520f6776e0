"""How far a benchmarked result lies from attention in float32: the benchmark's check that what it
timed is right.

The 2026-12-04 H200 run timed the `wgmma` kernels while the canary that guards their GPU tests had
failed, so their speed was measured and their results never looked at. The benchmark now compares
the result of each cupy_attn implementation's first call (its first input set) with PyTorch's
SDPA math backend on the same inputs in float32 (true float32 matmuls: PyTorch leaves TF32 off
for them by default), and records each output's relative RMS error and largest error. Heads go in chunks whose
float32 scores (and, backward, their gradients) stay near 1 GiB, so the 16k cases fit beside the
timed ones.
"""
from __future__ import annotations

import numpy as np

# An error above this share of an output's largest magnitude is a wrong result, not rounding:
# fp16/bf16 round at 2^-11 / 2^-8 relative, and a correct kernel's errors stay near that; a wrong
# row, tile or head is off by the order of its values.
WRONG_ABOVE = 0.05
# The same per row (the last axis), against the row's largest magnitude or, for rows below it, 5 %
# of the output's: a causal call's late rows of out are an order of magnitude below its first
# ones, so zeroing every row past 8k of a 16k case moves the whole output's measure by 0.03 alone.
# A correct bf16 result (PyTorch's SDPA in bf16 against float32, S = 1k and 4k, D = 64 and 128,
# causal and not, on the CPU) stays at 0.06 (dq of a causal call, whose first rows are near 0) and
# below; a row left unwritten or taken from the wrong tile is off by about 1.
WRONG_ROW_ABOVE = 0.25
ROW_FLOOR = 0.05
_CHUNK_BYTES = 2**30


def reference(q, k, v, dout, mask, *, causal: bool, pass_: str, device: str) -> dict:
    """{output name: float32 torch tensor} for (B, H, S, D) host arrays: "out" forward; "dq",
    "dk", "dv" backward (dk and dv summed over each GQA group, as cupy_attn returns them). `mask`
    a bool array broadcasting to (B, H, Sq, Sk) or None; `causal` bottom-right aligned, as
    cupy_attn's causal=True; `device` "gpu" or "cpu"."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    on = "cuda" if device == "gpu" else "cpu"
    tq, tk, tv, td = (torch.from_numpy(np.asarray(x, np.float32)).to(on) for x in (q, k, v, dout))
    b, h, sq, _ = q.shape
    kv_heads, sk = k.shape[1], k.shape[2]
    if causal:  # as a mask: SDPA takes none beside is_causal
        below = np.tri(sq, sk, sk - sq, dtype=bool)
        mask = below if mask is None else np.asarray(mask) & below
    tm = None if mask is None else torch.from_numpy(np.asarray(mask)).to(on)
    groups = h // kv_heads
    per_kv_head = b * groups * sq * sk * 4 * (1 if pass_ == "fwd" else 3)
    chunk = max(1, min(kv_heads, _CHUNK_BYTES // per_kv_head))  # kv heads per chunk
    parts: dict = {name: [] for name in (("out",) if pass_ == "fwd" else ("dq", "dk", "dv"))}
    for g0 in range(0, kv_heads, chunk):
        heads = slice(g0 * groups, (g0 + chunk) * groups)
        cq, ck, cv = (x.detach().clone().requires_grad_(pass_ == "bwd")
                      for x in (tq[:, heads], tk[:, g0:g0 + chunk], tv[:, g0:g0 + chunk]))
        with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
            out = torch.nn.functional.scaled_dot_product_attention(
                cq, ck.repeat_interleave(groups, 1), cv.repeat_interleave(groups, 1), attn_mask=tm)
        if pass_ == "fwd":
            parts["out"].append(out.detach())
        else:
            for name, grad in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (cq, ck, cv), td[:, heads])):
                parts[name].append(grad)
    return {name: torch.cat(chunks, dim=1) for name, chunks in parts.items()}


def relative_errors(result, expected: dict) -> dict:
    """{"rel_rms_error": {output: ‖result − expected‖₂ / ‖expected‖₂}, "rel_max_error": {output:
    max |result − expected| / max |expected|}, "rel_row_error": {output: the largest over rows of
    max |row's error| / max(max |row|, ROW_FLOOR · max |expected|)}} for a result (out, or the
    tuple dq, dk, dv; CuPy or NumPy arrays or torch tensors, (B, H, S, D)) against `reference`'s
    tensors. The RMS error is
    the precision of the whole; the largest error catches a few wrong rows, which a 16k case's RMS
    error would hide, and the row error wrong rows of small values."""
    import torch

    arrays = (result,) if len(expected) == 1 else tuple(result)
    errors: dict = {"rel_rms_error": {}, "rel_max_error": {}, "rel_row_error": {}}
    for (name, want), got in zip(expected.items(), arrays):
        # float32 first, on the array's own side: DLPack and torch.from_numpy know no ml_dtypes bfloat16
        got = (got.detach().float() if isinstance(got, torch.Tensor)
               else torch.from_numpy(np.asarray(got, np.float32)) if isinstance(got, np.ndarray)
               else torch.from_dlpack(got.astype(np.float32))).to(want.device)
        if got.shape != want.shape:
            raise ValueError(f"{name} has shape {tuple(got.shape)}, the reference {tuple(want.shape)}")
        difference = got - want
        errors["rel_rms_error"][name] = float(torch.linalg.vector_norm(difference) / torch.linalg.vector_norm(want))
        largest = want.abs().max()
        errors["rel_max_error"][name] = float(difference.abs().max() / largest)
        rows = torch.clamp(want.abs().amax(dim=-1), min=float(ROW_FLOOR * largest))
        errors["rel_row_error"][name] = float((difference.abs().amax(dim=-1) / rows).max())
    return errors


def wrong(errors: dict) -> bool:
    """Whether a result whose `relative_errors` these are is wrong: an output's largest error
    above WRONG_ABOVE of its largest magnitude, or a row's above WRONG_ROW_ABOVE of its own (NaN
    included)."""
    return not (all(e <= WRONG_ABOVE for e in errors["rel_max_error"].values())
                and all(e <= WRONG_ROW_ABOVE for e in errors.get("rel_row_error", {}).values()))
