"""cupy_attn's forward and backward as PyTorch custom operators (torch.library.custom_op), so that
torch.compile keeps them in its graph: Dynamo and AOTAutograd see an operator with a schema, a
fake implementation (output shapes from input shapes) and an autograd formula, and never trace
into cupy_attn's Python. cupy_attn.torch calls them whenever a call's arguments fit the schema
(tensors, Python numbers, bools and strings); see `fits_the_schema`.

An operator's schema cannot hold None inside a list, so a window side of None (unbounded) travels
as int64's smallest value, and causal travels as a string ("" for no mask). A drawn dropout seed travels as a 0-d
int64 tensor, so that a compiled graph draws a fresh one per call instead of baking one in.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import api

Tensor = torch.Tensor

# The keywords of api.attention that are tensors in the operator's schema.
TENSOR_KEYWORDS = ("mask", "q_lengths", "kv_lengths", "alibi_slopes", "sinks")
# What no schema holds, for the unbounded window side and for no causal mask: a value of each
# type the API refuses anyway, so a caller's own such value goes the eager way to that error.
_UNBOUNDED = -(2 ** 63)
_NOT_CAUSAL = ""
# The keywords each operator takes, and those that may be None (others the API wants set).
_OPERATOR_KEYWORDS = {
    "attention": frozenset(TENSOR_KEYWORDS) | {"causal", "window", "scale", "softcap", "dropout_p", "dropout_seed",
                                               "dropout_offset", "layout", "backend"},
    "attention_varlen": frozenset({"alibi_slopes", "causal", "window", "scale", "softcap", "backend"}),
}
_OPTIONAL = frozenset(TENSOR_KEYWORDS) | {"causal", "window", "scale", "softcap"}
# Python objects no schema holds; None for them is no feature, as in the API.
_MODS = ("score_mod", "mask_mod", "block_mask")


# Not for CUDA graphs (torch.compile's mode="reduce-overhead" leaves these operators out of them):
# a call validates its lengths and masks on the host (a synchronising copy), builds kernels with
# NVRTC on first use, and allocates from CuPy's memory pool.
_TAGS = (torch.Tag.cudagraph_unsafe,)


def fits_int64(n) -> bool:
    """A plain int the schema's int64 holds, or a symbolic one (torch.compile's SymInt)."""
    return isinstance(n, torch.SymInt) or (type(n) is int and -2 ** 63 <= n < 2 ** 63)


def fits_a_length(n) -> bool:
    """fits_int64 for a length, which under torch.compile may be a symbol known only when the
    graph runs (max_seqlen computed from cu_seqlens): Dynamo shows it as an int whose bounds it
    cannot compare without failing, so they are left to the API there."""
    return isinstance(n, torch.SymInt) or (type(n) is int and (torch.compiler.is_compiling() or fits_int64(n)))


def fits_the_schema(arrays, keywords: dict, operator: str) -> bool:
    """Whether a call can travel through ``operator`` ("attention" or "attention_varlen"):
    ``arrays`` (q, k, v and any positional array) tensors, and each keyword one the operator
    takes, of the schema's type: a tensor where an array goes, plain Python values elsewhere.
    Values are not checked here: the API checks them when the operator runs. Anything else
    (NumPy arrays, lists of lengths, a score_mod, mask_mod or block_mask, a misspelt keyword, a
    seed past int64) takes the eager autograd node instead, where the API validates it."""
    if not all(isinstance(x, Tensor) for x in arrays):
        return False
    taken = _OPERATOR_KEYWORDS[operator]
    for name, value in keywords.items():
        if value is None and (name in _MODS or (name in _OPTIONAL and name in taken)):
            continue
        if name not in taken:
            return False
        if name in TENSOR_KEYWORDS:
            fits = isinstance(value, Tensor)
        elif name == "causal":
            fits = isinstance(value, bool) or (isinstance(value, str) and value != _NOT_CAUSAL)
        elif name == "window":
            fits = isinstance(value, (tuple, list)) and len(value) == 2 and all(
                s is None or (fits_int64(s) and s != _UNBOUNDED) for s in value)
        elif name in ("scale", "softcap", "dropout_p"):
            fits = type(value) is float or (type(value) is int and abs(value) < 2 ** 1000)  # float() holds it
        elif name in ("dropout_seed", "dropout_offset"):
            fits = fits_int64(value)
        else:  # layout, backend
            fits = isinstance(value, str)
        if not fits:
            return False
    return True


def _causal_in(causal) -> str:
    return _NOT_CAUSAL if causal is None or causal is False else "bottom_right" if causal is True else causal


def _causal_out(causal: str):
    return False if causal == _NOT_CAUSAL else causal


def _window_in(window):
    return None if window is None else [_UNBOUNDED if s is None else s for s in window]


def _window_out(window):
    return None if window is None else tuple(None if s == _UNBOUNDED else s for s in window)


def varlen_operator_arguments(keywords: dict) -> dict:
    """The varlen operator's keyword arguments for api.attention_varlen's ``keywords`` (which fit
    the schema); the attention operator takes them too."""
    return dict(alibi_slopes=keywords.get("alibi_slopes"), causal=_causal_in(keywords.get("causal")),
                window=_window_in(keywords.get("window")),
                scale=None if keywords.get("scale") is None else float(keywords["scale"]),
                softcap=None if keywords.get("softcap") is None else float(keywords["softcap"]),
                backend=keywords.get("backend", "auto"))


def operator_arguments(keywords: dict, drawn_seed: Tensor | None) -> dict:
    """The operator's keyword arguments for api.attention's ``keywords`` (which fit the schema),
    with ``drawn_seed`` (a 0-d int64 tensor) in place of dropout_seed when given."""
    return dict(varlen_operator_arguments(keywords), mask=keywords.get("mask"), q_lengths=keywords.get("q_lengths"),
                kv_lengths=keywords.get("kv_lengths"), sinks=keywords.get("sinks"),
                dropout_p=float(keywords.get("dropout_p", 0.0)), dropout_seed=drawn_seed,
                dropout_seed_value=keywords.get("dropout_seed", 0), dropout_offset=keywords.get("dropout_offset", 0),
                layout=keywords.get("layout", "bhsd"))


def _api_keywords(mask, q_lengths, kv_lengths, alibi_slopes, sinks, causal, window, scale, softcap, dropout_p,
                  dropout_seed, dropout_seed_value, dropout_offset, layout, backend) -> dict:
    """api.attention's keywords back from the operator's arguments."""
    return dict(mask=mask, q_lengths=q_lengths, kv_lengths=kv_lengths, alibi_slopes=alibi_slopes, sinks=sinks,
                causal=_causal_out(causal), window=_window_out(window), scale=scale, softcap=softcap,
                dropout_p=dropout_p,
                dropout_seed=dropout_seed_value if dropout_seed is None else int(dropout_seed),
                dropout_offset=dropout_offset, layout=layout, backend=backend)


def _check_dims(dims: int, what: str, **tensors) -> None:
    """The one check a fake implementation needs before indexing shapes (torch.compile runs it
    before the real one, which validates everything else): the API's message for a wrong rank."""
    for name, x in tensors.items():
        if x.dim() != dims:
            raise ValueError(f"{name} must be {dims}-D {what}, got shape {tuple(x.shape)}")


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def refuse_create_graph() -> None:
    """A backward run with create_graph=True would need the gradients' own graph, which the
    kernels do not give: refused rather than returning gradients missing their second-order term."""
    if torch.is_grad_enabled():
        raise NotImplementedError("cupy_attn.torch's gradients are not differentiable: a backward with "
                                  "create_graph=True (double backward, gradient penalties) is not supported")


# ---- attention --------------------------------------------------------------------------------
@torch.library.custom_op("cupy_attn::attention", mutates_args=(), tags=_TAGS)
def attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], q_lengths: Optional[Tensor],
                 kv_lengths: Optional[Tensor], alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                 causal: str, window: Optional[list[int]], scale: Optional[float], softcap: Optional[float],
                 dropout_p: float, dropout_seed: Optional[Tensor], dropout_seed_value: int, dropout_offset: int,
                 layout: str, backend: str, deterministic: bool) -> tuple[Tensor, Tensor]:
    """api.attention, returning (out, lse). ``deterministic`` is the backward's, kept for it."""
    keywords = _api_keywords(mask, q_lengths, kv_lengths, alibi_slopes, sinks, causal, window, scale, softcap,
                             dropout_p, dropout_seed, dropout_seed_value, dropout_offset, layout, backend)
    return api.attention(q, k, v, return_lse=True, **keywords)


@attention_op.register_fake
def _(q, k, v, mask, q_lengths, kv_lengths, alibi_slopes, sinks, causal, window, scale, softcap, dropout_p,
      dropout_seed, dropout_seed_value, dropout_offset, layout, backend, deterministic):
    _check_dims(4, "(B, H, S, D) for layout 'bhsd'" if layout == "bhsd" else "(B, S, H, D) for layout 'bshd'",
                q=q, k=k, v=v)
    # out: q's shape with v's head dim; lse: (B, H, Sq) in either layout
    batch, heads, rows = (q.shape[0], q.shape[1], q.shape[2]) if layout == "bhsd" else (q.shape[0], q.shape[2], q.shape[1])
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    return out, q.new_empty((batch, heads, rows), dtype=_lse_dtype(q))


@torch.library.custom_op("cupy_attn::attention_backward", mutates_args=(), tags=_TAGS)
def attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          mask: Optional[Tensor], q_lengths: Optional[Tensor], kv_lengths: Optional[Tensor],
                          alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], causal: str,
                          window: Optional[list[int]], scale: Optional[float], softcap: Optional[float],
                          dropout_p: float, dropout_seed: Optional[Tensor], dropout_seed_value: int,
                          dropout_offset: int, layout: str, backend: str, deterministic: bool) -> list[Tensor]:
    """api.attention_backward: [dq, dk, dv], and dsinks when sinks are given."""
    keywords = _api_keywords(mask, q_lengths, kv_lengths, alibi_slopes, sinks, causal, window, scale, softcap,
                             dropout_p, dropout_seed, dropout_seed_value, dropout_offset, layout, backend)
    return list(api.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **keywords))


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, mask, q_lengths, kv_lengths, alibi_slopes, sinks, *_):
    grads = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)]
    return grads + ([sinks.new_empty(sinks.shape, dtype=_lse_dtype(q))] if sinks is not None else [])


def _save_attention(ctx, inputs, output):
    (q, k, v, mask, q_lengths, kv_lengths, alibi_slopes, sinks, causal, window, scale, softcap, dropout_p,
     dropout_seed, dropout_seed_value, dropout_offset, layout, backend, deterministic) = inputs
    ctx.save_for_backward(q, k, v, mask, q_lengths, kv_lengths, alibi_slopes, sinks, dropout_seed, *output)
    ctx.scalars = (causal, window, scale, softcap, dropout_p, dropout_seed_value, dropout_offset, layout, backend,
                   deterministic)
    ctx.mark_non_differentiable(output[1])


def _attention_gradients(ctx, dout, _dlse):
    refuse_create_graph()
    q, k, v, mask, q_lengths, kv_lengths, alibi_slopes, sinks, dropout_seed, out, lse = ctx.saved_tensors
    causal, window, scale, softcap, dropout_p, dropout_seed_value, dropout_offset, layout, backend, deterministic = \
        ctx.scalars
    grads = attention_backward_op(dout, q, k, v, out, lse, mask, q_lengths, kv_lengths, alibi_slopes, sinks, causal,
                                  window, scale, softcap, dropout_p, dropout_seed, dropout_seed_value,
                                  dropout_offset, layout, backend, deterministic)
    dsinks = grads[3] if sinks is not None and ctx.needs_input_grad[7] else None
    # one gradient per operator input: q, k, v, the five tensors (sinks' own), then the scalars
    return (grads[0], grads[1], grads[2], None, None, None, None, dsinks) + (None,) * 11


attention_op.register_autograd(_attention_gradients, setup_context=_save_attention)


# ---- attention_varlen -------------------------------------------------------------------------
@torch.library.custom_op("cupy_attn::attention_varlen", mutates_args=(), tags=_TAGS)
def attention_varlen_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                        max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Optional[Tensor], causal: str,
                        window: Optional[list[int]], scale: Optional[float], softcap: Optional[float],
                        backend: str, deterministic: bool) -> tuple[Tensor, Tensor]:
    """api.attention_varlen, returning (out, lse). ``deterministic`` is the backward's, kept for it."""
    return api.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                causal=_causal_out(causal), window=_window_out(window), scale=scale, softcap=softcap,
                                alibi_slopes=alibi_slopes, return_lse=True, backend=backend)


@attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *_):
    _check_dims(3, "(total, H, D) for packed sequences", q=q, k=k, v=v)
    # out (total_q, H, Dv); lse (H, total_q)
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q))


@torch.library.custom_op("cupy_attn::attention_varlen_backward", mutates_args=(), tags=_TAGS)
def attention_varlen_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                 cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                 alibi_slopes: Optional[Tensor], causal: str, window: Optional[list[int]],
                                 scale: Optional[float], softcap: Optional[float], backend: str,
                                 deterministic: bool) -> list[Tensor]:
    """api.attention_varlen_backward: [dq, dk, dv]."""
    return list(api.attention_varlen_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=_causal_out(causal),
        window=_window_out(window), scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, backend=backend,
        deterministic=deterministic))


@attention_varlen_backward_op.register_fake
def _(dout, q, k, v, *_):
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)]


def _save_varlen(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes = inputs[:8]
    ctx.save_for_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, *output)
    ctx.scalars = (max_seqlen_q, max_seqlen_k) + tuple(inputs[8:])
    ctx.mark_non_differentiable(output[1])


def _varlen_gradients(ctx, dout, _dlse):
    refuse_create_graph()
    q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, out, lse = ctx.saved_tensors
    max_seqlen_q, max_seqlen_k, causal, window, scale, softcap, backend, deterministic = ctx.scalars
    dq, dk, dv = attention_varlen_backward_op(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, alibi_slopes, causal, window, scale, softcap, backend,
                                              deterministic)
    return (dq, dk, dv) + (None,) * 11


attention_varlen_op.register_autograd(_varlen_gradients, setup_context=_save_varlen)
