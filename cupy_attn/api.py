"""The public attention functions."""
from __future__ import annotations

import inspect

from . import _backends, _interop, _kernel_backend
from ._arrays import check_flag
from ._problem import check_backward_inputs, make_problem, make_varlen_problem

_SEMANTICS = """
    Shapes (layout "bhsd"; with layout "bshd" swap the S and H axes of q, k, v, out):
        q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv); H a multiple of Hkv
        (query head h uses kv head h // (H / Hkv): GQA, or MQA with Hkv = 1).
        out (B, H, Sq, Dv) in q's dtype and layout; lse (B, H, Sq), natural log, float32
        (float64 for float64 inputs), in every layout.

    Scores, in this order: s = q·kᵀ·scale (scale defaults to 1/√D); softcap c: s = c·tanh(s/c);
    ALiBi: s -= slope[b, h]·|i + off − j|; a float mask is added; a bool mask (True = may
    attend), causal, window and lengths remove keys. Then out = softmax(s)·v; with sinks, each
    row's denominator also holds exp(sinks[h]) (attention sinks, as gpt-oss: no value attached).

    Alignment: query i lines up with key i + off, off = kv_len − q_len on each batch entry's
    valid lengths (bottom-right, as FlashAttention), or off = 0 with causal="top_left"
    (PyTorch's is_causal). For Sq = 2, Sk = 5 (1 = may attend):

        causal=True (bottom_right)   causal="top_left"
            1 1 1 1 0                    1 0 0 0 0
            1 1 1 1 1                    1 1 0 0 0

    Keywords:
        mask: bool or float array broadcastable to (B, H, Sq, Sk) (in every layout).
        causal: False, True (= "bottom_right") or "top_left": key j visible iff j <= i + off.
        window: (left, right), ints >= 0 or None (unbounded): i + off − left <= j <= i + off + right.
        q_lengths, kv_lengths: (B,) ints; positions past a length are padding. Padded keys are
            never attended; padded query rows give output 0.
        scale: finite positive float. softcap: finite positive float or None.
        alibi_slopes: (H,) or (B, H) floats.
        sinks: (H,) float logits (natural-log units, not scaled), one per query head, or None.
            lse includes the sink; a row with nothing to attend gives out 0 and lse = sinks[h].
        dropout_p: float in [0, 1): each probability is dropped (zeroed) with probability
            dropout_p after the softmax and the kept ones are scaled by 1 / (1 − dropout_p), as in
            FlashAttention (lse is that of the softmax, before dropout). dropout_seed (int in
            [0, 2**64)) and dropout_offset (int in [0, 2**32)) choose the mask: element
            (b, h, i, j) is kept or dropped by a pure function of (seed, offset, b, h, i, j)
            (Philox4x32-10; `cupy_attn.dropout_mask` returns it), identical on every backend, so
            the backward must be given the forward's three values. 0 (the default) is no dropout.
        score_mod: a cupy_attn.ScoreMod (a C expression and its NumPy twin) applied to each score
            after softcap and ALiBi and before the float mask, in natural-log units; mask_mod: a
            cupy_attn.MaskMod removing keys as the bool mask does (cupy_attn.mods). Indices are
            positions in the padded (B, H, Sq, Sk) problem, h the query head.
        block_mask: from cupy_attn.block_mask(mask_mod, B, H, Sq, Sk): the kernels then visit, for
            each query tile, only its non-empty key tiles (the backward: each key tile's non-empty
            query tiles).
        backend: "auto" (by where the inputs live), "numpy", "cuda" or "emulator".

    A row that can attend to nothing gives output 0 and lse −inf (never NaN), and zero gradients.
    fp16/bf16/fp32 inputs are computed in float32, float64 in float64 (NumPy backend only).
    Results are arrays of the inputs' library (NumPy in, NumPy out; CuPy in, CuPy out; PyTorch
    and JAX arrays, on the CPU or a CUDA device, go in and come back zero-copy through DLPack).
    Bad arguments raise ValueError or TypeError naming the argument.
"""


@_interop.outside_torch_compile
def attention(q, k, v, *, mask=None, causal=False, window=None, q_lengths=None, kv_lengths=None,
              scale=None, softcap=None, alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=0,
              dropout_offset=0, score_mod=None, mask_mod=None, block_mask=None, layout="bhsd", return_lse=False,
              backend="auto"):
    check_flag("return_lse", return_lse)
    framework, lead = _interop.lead(q, k, v)
    with _interop.caller_stream(framework, lead):
        q, k, v, mask, q_lengths, kv_lengths, alibi_slopes, sinks = _interop.backend_arrays(
            framework, function="attention", q=q, k=k, v=v, mask=mask, q_lengths=q_lengths, kv_lengths=kv_lengths,
            alibi_slopes=alibi_slopes, sinks=sinks)
        problem = make_problem(q, k, v, mask=mask, causal=causal, window=window, q_lengths=q_lengths,
                               kv_lengths=kv_lengths, scale=scale, softcap=softcap,
                               alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p,
                               dropout_seed=dropout_seed, dropout_offset=dropout_offset, score_mod=score_mod,
                               mask_mod=mask_mod, block_mask=block_mask, layout=layout, backend=backend)
        out, lse = _backends.forward(_backends.select(problem), problem, q, k, v)
        out, lse = (_interop.to_framework(framework, x) for x in (out, lse))
    return (out, lse) if return_lse else out


@_interop.outside_torch_compile
def attention_backward(dout, q, k, v, out, lse, *, mask=None, causal=False, window=None,
                       q_lengths=None, kv_lengths=None, scale=None, softcap=None,
                       alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=0, dropout_offset=0,
                       score_mod=None, mask_mod=None, block_mask=None, layout="bhsd", backend="auto",
                       deterministic=False):
    check_flag("deterministic", deterministic)
    framework, lead = _interop.lead(q, k, v)
    with _interop.caller_stream(framework, lead):
        dout, q, k, v, out, lse, mask, q_lengths, kv_lengths, alibi_slopes, sinks = _interop.backend_arrays(
            framework, function="attention_backward", dout=dout, q=q, k=k, v=v, out=out, lse=lse, mask=mask,
            q_lengths=q_lengths, kv_lengths=kv_lengths, alibi_slopes=alibi_slopes, sinks=sinks)
        problem = make_problem(q, k, v, mask=mask, causal=causal, window=window, q_lengths=q_lengths,
                               kv_lengths=kv_lengths, scale=scale, softcap=softcap,
                               alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p,
                               dropout_seed=dropout_seed, dropout_offset=dropout_offset, score_mod=score_mod,
                               mask_mod=mask_mod, block_mask=block_mask, layout=layout, backend=backend)
        check_backward_inputs(problem, dout, out, lse)
        grads = _backends.backward(_backends.select(problem), problem, dout, q, k, v, out, lse, deterministic)
        return tuple(_interop.to_framework(framework, g) for g in grads)


attention.__doc__ = """Scaled dot-product attention, softmax(q·kᵀ·scale + mask)·v.

    Returns out, or (out, lse) when return_lse is true.
""" + _SEMANTICS

attention_backward.__doc__ = """Gradients (dq, dk, dv) of attention, from the forward's out and lse;
    (dq, dk, dv, dsinks) when sinks are given, dsinks (H,) float32 (float64 for float64 inputs).

    dout has out's shape and dtype; the keywords must be those of the forward call. dk and dv
    are summed over the query heads that share a kv head. Gradients come in the input dtype
    and layout; the mask gets no gradient.

    deterministic: on the CUDA kernels, dq is by default summed with float32 atomics (fast,
    but the summation order, and so the last bits, vary run to run), and so are dk and dv of a
    GQA group. True computes dq in a separate kernel without atomics and sums each group's dk,
    dv in a fixed order: bit-identical results run to run, at the cost of recomputing the scores
    once more. The NumPy backend is always deterministic.
""" + _SEMANTICS


@_interop.outside_torch_compile
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     window=None, scale=None, softcap=None, alibi_slopes=None, return_lse=False, backend="auto"):
    check_flag("return_lse", return_lse)
    framework, lead = _interop.lead(q, k, v)
    with _interop.caller_stream(framework, lead):
        q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes = _interop.backend_arrays(
            framework, function="attention_varlen", q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes)
        problem = make_varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      causal=causal, window=window, scale=scale, softcap=softcap,
                                      alibi_slopes=alibi_slopes, backend=backend)
        out, lse = _backends.forward(_backends.select(problem), problem, q, k, v)
        out, lse = (_interop.to_framework(framework, x) for x in (out, lse))
    return (out, lse) if return_lse else out


@_interop.outside_torch_compile
def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
                              backend="auto", deterministic=False):
    check_flag("deterministic", deterministic)
    framework, lead = _interop.lead(q, k, v)
    with _interop.caller_stream(framework, lead):
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = _interop.backend_arrays(
            framework, function="attention_varlen_backward", dout=dout, q=q, k=k, v=v, out=out, lse=lse,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes)
        problem = make_varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      causal=causal, window=window, scale=scale, softcap=softcap,
                                      alibi_slopes=alibi_slopes, backend=backend)
        check_backward_inputs(problem, dout, out, lse)
        grads = _backends.backward(_backends.select(problem), problem, dout, q, k, v, out, lse, deterministic)
        return tuple(_interop.to_framework(framework, g) for g in grads)


_VARLEN_SEMANTICS = """
    Packed (variable-length) batches, FlashAttention's flash_attn_varlen_func: B sequences laid
    one after another along the first axis, with no padding.

        q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv); H a multiple of Hkv.
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,), starting at 0, non-decreasing, ending at
            total_q and total_k: sequence b owns q rows [cu_seqlens_q[b], cu_seqlens_q[b + 1])
            and k, v rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]). Empty sequences are allowed.
        max_seqlen_q, max_seqlen_k: ints at least the longest sequence and below 2^31 (checked; the
            grids are sized by the longest sequence, so a generous bound costs nothing).
        out (total_q, H, Dv) in q's dtype; lse (H, total_q), natural log, float32 (float64 for
            float64 inputs).

    Each sequence is attended on its own, exactly as `attention` attends one batch entry: the
    kernels never read a row of another sequence. causal (True / "bottom_right" or "top_left"),
    window, scale, softcap and alibi_slopes ((H,) or (B, H)) mean what they mean in `attention`,
    with the alignment taken on each sequence's own lengths (bottom-right: the last query of a
    sequence lines up with its last key). A query row with no key to attend (an empty key
    sequence, or masked out) gives output 0 and lse −inf, and zero gradients.
    Results are arrays of the inputs' library (NumPy, CuPy, PyTorch or JAX, as `attention`).
"""

attention_varlen.__doc__ = """Attention over a packed batch of variable-length sequences.

    Returns out, or (out, lse) when return_lse is true.
""" + _VARLEN_SEMANTICS

attention_varlen_backward.__doc__ = """Gradients (dq, dk, dv) of `attention_varlen` from its out and lse.

    dout has out's shape and dtype; the other arguments and keywords must be those of the forward
    call. dq (total_q, H, D), dk (total_k, Hkv, D), dv (total_k, Hkv, Dv) in the input dtype; dk and
    dv are summed over the query heads sharing a kv head. deterministic: as in `attention_backward`.
""" + _VARLEN_SEMANTICS


@_interop.outside_torch_compile
def precompile(q, k, v, *, backward=True, deterministic=False, **keywords):
    """Build, without running them, the kernels `attention` (and with backward=True
    `attention_backward`) would launch for these inputs and keywords: q, k, v fix the dtype, head
    dims, layout and where the arrays live (their sequence lengths and contents do not matter:
    small arrays do). Each build is cached on disk (CuPy's cache, or the emulator's), so a later
    process warms up from it. Returns the kernel names built, [] on the NumPy backend."""
    check_flag("backward", backward)
    check_flag("deterministic", deterministic)
    keywords.pop("return_lse", None)  # attention's, but it changes no kernel
    unknown = sorted(set(keywords) - set(inspect.signature(make_problem).parameters) - {"q", "k", "v"})
    if unknown:
        raise TypeError(f"precompile takes attention's keywords; {', '.join(unknown)} is not one of them")
    framework, lead = _interop.lead(q, k, v)
    with _interop.caller_stream(framework, lead):
        q, k, v, *values = _interop.backend_arrays(framework, q=q, k=k, v=v, **keywords)
        keywords = dict(zip(keywords, values))
        problem = make_problem(q, k, v, **keywords)
        if 0 in (problem.batch, problem.heads, problem.seq_q, problem.seq_k):
            raise ValueError("precompile needs arrays with no empty axis (a call with one launches no kernel), got "
                             f"B, H, Sq, Sk = {problem.batch}, {problem.heads}, {problem.seq_q}, {problem.seq_k}")
        name = _backends.select(problem)
        if name == "numpy":
            return []
        xp = problem.xp
        with _kernel_backend.compile_only() as built:
            _backends.forward(name, problem, q, k, v)
            if backward:
                out = xp.zeros(problem.out_shape, problem.dtype)
                lse = xp.zeros(problem.lse_shape, problem.compute_dtype)
                _backends.backward(name, problem, out, q, k, v, out, lse, deterministic)
        return list(dict.fromkeys(built))
