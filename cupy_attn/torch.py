"""cupy_attn for PyTorch: attention and attention_varlen, differentiable, and kept whole by
torch.compile and torch.export.

    import cupy_attn.torch
    out = cupy_attn.torch.attention(q, k, v, causal=True)   # q, k, v torch tensors
    out.sum().backward()                                     # q.grad, k.grad, v.grad
    out = cupy_attn.torch.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)  # packed sequences

CPU tensors run on the NumPy backend (float64 included, so torch.autograd.gradcheck works), CUDA
tensors on the CUDA kernels, on PyTorch's current stream. Every keyword of
`cupy_attn.attention` is accepted (mask and lengths may be tensors); ``deterministic`` is passed
to the backward. Gradients flow to q, k, v and sinks; a mask or ALiBi slopes that require grad
are refused (TypeError), since no gradient is computed for them. Importing this module imports
torch; importing cupy_attn does not.

Calls whose arguments are tensors and plain Python values run as the custom operators of
cupy_attn._torch_ops, which stay in a compiled graph (fullgraph=True works). Calls with a
score_mod, mask_mod or block_mask, NumPy arrays or lists among the arguments, or a generator=,
run an autograd node (a torch.autograd.Function) that torch.compile leaves out of the graph (a
graph break).
"""
from __future__ import annotations

import torch

if tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 8):
    raise ImportError(f"cupy_attn.torch needs PyTorch 2.8 or later (its custom operators), found {torch.__version__}")

from . import _interop, _torch_ops, api  # noqa: E402
from ._arrays import check_flag  # noqa: E402

_interop.prepare_for_torch_compile()  # the decorators below import torch._dynamo anyway


class _Attention(torch.autograd.Function):
    """One autograd node for a (forward, backward) pair of the functional API; ``args`` are the
    positional arguments after q, k, v (cu_seqlens and max_seqlen of the varlen pair)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, functions, args, keywords, deterministic):
        api_forward, ctx.api_backward = functions
        if sinks is not None:  # an input of the node, so that it gets a gradient
            keywords = dict(keywords, sinks=sinks)
        out, lse = api_forward(q, k, v, *args, return_lse=True, **keywords)
        # Every tensor the backward reads goes through save_for_backward, masks, lengths and
        # cu_seqlens included, so that torch refuses a backward after one was changed in place
        # (as it does for the operators' inputs) instead of differentiating with its new values.
        # (Inference tensors cannot be saved, nor changed in place outside inference mode: kept as they are.)
        values = [*args, *keywords.values()]
        ctx.saved_at = [i for i, x in enumerate(values) if isinstance(x, torch.Tensor) and not x.is_inference()]
        ctx.save_for_backward(q, k, v, out, lse, *(values[i] for i in ctx.saved_at))
        ctx.values = [None if i in ctx.saved_at else x for i, x in enumerate(values)]
        ctx.arg_count, ctx.names, ctx.deterministic = len(args), list(keywords), deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        _torch_ops.refuse_create_graph()
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        values = list(ctx.values)
        for i, tensor in zip(ctx.saved_at, tensors):
            values[i] = tensor
        args, keywords = values[:ctx.arg_count], dict(zip(ctx.names, values[ctx.arg_count:]))
        grads = ctx.api_backward(dout, q, k, v, out, lse, *args, deterministic=ctx.deterministic, **keywords)
        # sinks may also be a list or a NumPy array, which takes no gradient
        dsinks = grads[3] if len(grads) == 4 and ctx.needs_input_grad[3] else None
        return grads[0], grads[1], grads[2], dsinks, None, None, None, None


@torch.compiler.disable(reason="cupy_attn.torch: an argument its operators' schema does not hold (a score_mod, "
                                "mask_mod or block_mask, a NumPy array or list, a keyword they do not take, a value of "
                                "the wrong type or past int64): run the call eagerly, which also names a bad argument")
def _eager(q, k, v, sinks, functions, args, keywords, deterministic):
    """The autograd node, out of torch.compile's graph: for arguments no operator schema holds."""
    return _Attention.apply(q, k, v, sinks, functions, args, keywords, deterministic)


def _seed(generator) -> torch.Tensor:
    device = "cpu" if generator is None else generator.device
    return torch.randint(0, 2 ** 63 - 1, (), generator=generator, device=device, dtype=torch.int64)


@torch.compiler.disable(reason="cupy_attn.torch: Dynamo cannot pass a torch.Generator (generator=) to the seed's "
                                "draw; without generator=, the draw from torch's default generator stays in the graph")
def _seed_from_generator(generator) -> torch.Tensor:
    return _seed(generator)


def _refuse_lost_gradients(function: str, keywords: dict) -> None:
    """q, k, v and sinks get gradients, no other argument does (the kernels compute none for a
    mask or ALiBi slopes): a tensor among the keywords that requires grad while autograd records
    is refused, where its gradient would otherwise stay None without a word (a learned bias that
    never learns)."""
    if not torch.is_grad_enabled():
        return
    for name, x in keywords.items():
        if name != "sinks" and isinstance(x, torch.Tensor) and x.requires_grad:
            raise TypeError(f"{name} requires grad, but cupy_attn.torch.{function} computes no gradient for {name} "
                            f"(only for q, k, v and sinks): pass {name}.detach() to use it as a constant")


def _drawn_seed(keywords: dict, generator) -> torch.Tensor | None:
    """With dropout_p > 0 and no dropout_seed, a seed (a 0-d int64 tensor) drawn from
    ``generator`` (torch's default CPU generator when None, so torch.manual_seed makes runs
    reproducible); the backward gets the same seed, so it regenerates the forward's mask."""
    if not keywords.get("dropout_p", 0) or "dropout_seed" in keywords:
        return None
    return _seed(None) if generator is None else _seed_from_generator(generator)


def attention(q, k, v, *, return_lse=False, deterministic=False, generator=None, **keywords):
    """Differentiable `cupy_attn.attention` on torch tensors; gradients flow to q, k and v (and to
    ``sinks``, an (H,) tensor, when given).

    Dropout: dropout_p > 0 draws dropout_seed from ``generator`` (a torch.Generator; torch's
    default CPU generator when None) unless dropout_seed is given; each call gets a fresh mask.
    Returns out, or (out, lse) with return_lse=True (lse is not differentiable).
    """
    check_flag("return_lse", return_lse)
    check_flag("deterministic", deterministic)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__qualname__}")
    _refuse_lost_gradients("attention", keywords)
    seed = _drawn_seed(keywords, generator)
    if _torch_ops.fits_the_schema((q, k, v), keywords, "attention"):
        out, lse = _torch_ops.attention_op(q, k, v, **_torch_ops.operator_arguments(keywords, seed),
                                           deterministic=bool(deterministic))
    else:
        if seed is not None:
            keywords = dict(keywords, dropout_seed=int(seed))
        sinks = keywords.pop("sinks", None)
        functions = (api.attention, api.attention_backward)
        out, lse = _eager(q, k, v, sinks, functions, (), keywords, deterministic)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, return_lse=False,
                     deterministic=False, **keywords):
    """Differentiable `cupy_attn.attention_varlen` on packed torch tensors (FlashAttention's
    flash_attn_varlen_func); gradients flow to q, k and v. cu_seqlens are int32 tensors.

    Returns out, or (out, lse) with return_lse=True (lse is not differentiable).
    """
    check_flag("return_lse", return_lse)
    check_flag("deterministic", deterministic)
    _refuse_lost_gradients("attention_varlen", keywords)
    lengths_fit = all(_torch_ops.fits_a_length(n) for n in (max_seqlen_q, max_seqlen_k))
    if lengths_fit and _torch_ops.fits_the_schema((q, k, v, cu_seqlens_q, cu_seqlens_k), keywords,
                                                  "attention_varlen"):
        out, lse = _torch_ops.attention_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  **_torch_ops.varlen_operator_arguments(keywords),
                                                  deterministic=bool(deterministic))
    else:
        functions = (api.attention_varlen, api.attention_varlen_backward)
        args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        out, lse = _eager(q, k, v, None, functions, args, keywords, deterministic)
    return (out, lse) if return_lse else out
