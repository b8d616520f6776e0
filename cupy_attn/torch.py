"""cupy_attn for PyTorch: attention and attention_varlen as torch.autograd.Functions.

    import cupy_attn.torch
    out = cupy_attn.torch.attention(q, k, v, causal=True)   # q, k, v torch tensors
    out.sum().backward()                                     # q.grad, k.grad, v.grad
    out = cupy_attn.torch.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)  # packed sequences

CPU tensors run on the NumPy backend (float64 included, so torch.autograd.gradcheck works), CUDA
tensors on the CUDA kernels, on PyTorch's current stream. Every keyword of
`cupy_attn.attention` is accepted (mask and lengths may be tensors); ``deterministic`` is passed
to the backward. Importing this module imports torch; importing cupy_attn does not.
"""
from __future__ import annotations

import torch

from . import api


class _Attention(torch.autograd.Function):
    """One autograd node for a (forward, backward) pair of the functional API; ``args`` are the
    positional arguments after q, k, v (cu_seqlens and max_seqlen of the varlen pair)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, functions, args, keywords, deterministic):
        api_forward, ctx.api_backward = functions
        if sinks is not None:  # an input of the node, so that it gets a gradient
            keywords = dict(keywords, sinks=sinks)
        out, lse = api_forward(q, k, v, *args, return_lse=True, **keywords)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args, ctx.keywords, ctx.deterministic = args, keywords, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if torch.is_grad_enabled():  # create_graph=True: the gradients would need a graph of their own
            raise NotImplementedError("cupy_attn.torch's gradients are not differentiable: a backward with "
                                      "create_graph=True (double backward, gradient penalties) is not supported")
        q, k, v, out, lse = ctx.saved_tensors
        grads = ctx.api_backward(dout, q, k, v, out, lse, *ctx.args, deterministic=ctx.deterministic, **ctx.keywords)
        # sinks may also be a list or a NumPy array, which takes no gradient
        dsinks = grads[3] if len(grads) == 4 and ctx.needs_input_grad[3] else None
        return grads[0], grads[1], grads[2], dsinks, None, None, None, None


def _dropout_seed(keywords: dict, generator) -> dict:
    """With dropout_p > 0 and no dropout_seed, a seed drawn from ``generator`` (torch's default
    CPU generator when None, so torch.manual_seed makes runs reproducible); the backward gets the
    same keywords, so it regenerates the forward's mask."""
    if keywords.get("dropout_p", 0) and "dropout_seed" not in keywords:
        device = "cpu" if generator is None else generator.device
        seed = torch.randint(0, 2 ** 63 - 1, (), generator=generator, device=device, dtype=torch.int64)
        keywords = dict(keywords, dropout_seed=int(seed))
    return keywords


def attention(q, k, v, *, return_lse=False, deterministic=False, generator=None, **keywords):
    """Differentiable `cupy_attn.attention` on torch tensors; gradients flow to q, k and v (and to
    ``sinks``, an (H,) tensor, when given).

    Dropout: dropout_p > 0 draws dropout_seed from ``generator`` (a torch.Generator; torch's
    default CPU generator when None) unless dropout_seed is given; each call gets a fresh mask.
    Returns out, or (out, lse) with return_lse=True (lse is not differentiable).
    """
    keywords = _dropout_seed(keywords, generator)
    functions = (api.attention, api.attention_backward)
    sinks = keywords.pop("sinks", None)
    out, lse = _Attention.apply(q, k, v, sinks, functions, (), keywords, deterministic)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, return_lse=False,
                     deterministic=False, **keywords):
    """Differentiable `cupy_attn.attention_varlen` on packed torch tensors (FlashAttention's
    flash_attn_varlen_func); gradients flow to q, k and v. cu_seqlens are int32 tensors.

    Returns out, or (out, lse) with return_lse=True (lse is not differentiable).
    """
    functions = (api.attention_varlen, api.attention_varlen_backward)
    args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out, lse = _Attention.apply(q, k, v, None, functions, args, keywords, deterministic)
    return (out, lse) if return_lse else out
