"""cupy_attn for PyTorch: attention as a torch.autograd.Function.

    import cupy_attn.torch
    out = cupy_attn.torch.attention(q, k, v, causal=True)   # q, k, v torch tensors
    out.sum().backward()                                     # q.grad, k.grad, v.grad

CPU tensors run on the NumPy backend (float64 included, so torch.autograd.gradcheck works), CUDA
tensors on the CUDA kernels, on PyTorch's current stream. Every keyword of
`cupy_attn.attention` is accepted (mask and lengths may be tensors); ``deterministic`` is passed
to the backward. Importing this module imports torch; importing cupy_attn does not.
"""
from __future__ import annotations

import torch

from . import api


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, keywords, deterministic):
        out, lse = api.attention(q, k, v, return_lse=True, **keywords)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.keywords, ctx.deterministic = keywords, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = api.attention_backward(dout, q, k, v, out, lse, deterministic=ctx.deterministic, **ctx.keywords)
        return dq, dk, dv, None, None


def attention(q, k, v, *, return_lse=False, deterministic=False, **keywords):
    """Differentiable `cupy_attn.attention` on torch tensors; gradients flow to q, k and v.

    Returns out, or (out, lse) with return_lse=True (lse is not differentiable).
    """
    out, lse = _Attention.apply(q, k, v, keywords, deterministic)
    return (out, lse) if return_lse else out
