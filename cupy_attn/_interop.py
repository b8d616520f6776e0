"""PyTorch and JAX arrays in and out, zero-copy through DLPack, without importing either.

Framework arrays are recognised by their type's module. A CPU array becomes a NumPy array
(``numpy.from_dlpack``), a CUDA array a CuPy array (``cupy.from_dlpack``); results go back as the
caller's framework type. NumPy's DLPack does not know bfloat16, so on the CPU bfloat16 crosses as
16-bit integers reinterpreted in place: still zero-copy for PyTorch (and for JAX inputs), while
bfloat16 results handed to JAX are copied once (JAX cannot import them without a conversion).
JAX also copies a NumPy result that is not 64-byte aligned (its requirement for sharing a buffer)
or that is read-only.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import sys

import numpy as np

from ._arrays import BFLOAT16, is_cupy_array, module_of

# DLPack device types: host memory, CUDA device memory, and page-locked host memory (torch's
# pin_memory(), a DataLoader's pinned batches; JAX's pinned_host), which the host reads as any.
_CPU, _CUDA, _CUDA_HOST = 1, 2, 3


# Each function of `outside_torch_compile` and its torch.compiler.disable'd copy, made once
# torch._dynamo is imported (importing it takes seconds, so not before).
_OUTSIDE_TORCH_COMPILE: dict = {}
_wrapper_code = None  # the code object every wrapper of outside_torch_compile shares


def outside_torch_compile(function):
    """cupy_attn's public functions on tensors inside a torch.compile'd function run outside the
    graph: DLPack exchange, NumPy backends and kernel launches are nothing a graph can hold, and
    Dynamo stopped on some of them with an internal error. Once torch._dynamo is imported, a call
    goes to a torch.compiler.disable'd copy of ``function``: traced, a graph break; run, with
    Dynamo off for everything it calls (a score_mod's NumPy twin, CuPy). The wrapper's own frame
    is on Dynamo's skip list, so Dynamo never compiles it as a frame of its own (one code object
    for every function: its guards would use up the recompile limit)."""
    global _wrapper_code
    _OUTSIDE_TORCH_COMPILE[function] = None

    @functools.wraps(function)
    def call(*args, **keywords):
        if "torch._dynamo" in sys.modules:
            return (_OUTSIDE_TORCH_COMPILE[function] or _disable(function))(*args, **keywords)
        return function(*args, **keywords)

    _wrapper_code = call.__code__
    return call


def _disable(function):
    """``function``'s disable'd copy (no reason= in it: that needs PyTorch 2.8, and the plain API
    takes tensors of any version); the first one also puts the wrappers' code on the skip list."""
    import torch

    if not any(_OUTSIDE_TORCH_COMPILE.values()):
        torch._dynamo.eval_frame.skip_code(_wrapper_code)
    _OUTSIDE_TORCH_COMPILE[function] = torch.compiler.disable(function)
    return _OUTSIDE_TORCH_COMPILE[function]


def prepare_for_torch_compile() -> None:
    """Make every disable'd copy now (torch._dynamo imported), so that even a process's first
    call, already inside a trace, is the graph break that names it (Dynamo cannot make the copy
    while tracing under fullgraph=True)."""
    for function, disabled in list(_OUTSIDE_TORCH_COMPILE.items()):
        if disabled is None:
            _disable(function)


def framework_of(x) -> str | None:
    """"torch" or "jax" for their arrays, None for anything else (NumPy, CuPy, lists, ...)."""
    root = type(x).__module__.split(".")[0]
    if root == "torch" and hasattr(x, "__dlpack__"):
        return "torch"
    if root in ("jax", "jaxlib") and hasattr(x, "__dlpack__"):
        return "jax"
    return None


def _is_bfloat16(x) -> bool:
    return str(x.dtype).endswith("bfloat16")


def needs_autograd(framework: str | None, *arrays) -> bool:
    """Whether torch's autograd would record an operation on ``arrays`` (``framework``'s): one
    requires grad and grad mode is on (it is off in a torch.autograd.Function's forward and
    backward, and so in cupy_attn.torch's operators, which do their own autograd)."""
    if framework != "torch":
        return False
    import torch

    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in arrays)


def _traced(x) -> str | None:
    """What kind of value without data ``x`` is, if it is one: "jax" for a tracer (inside jax.jit,
    vmap or grad), "torch" for a fake, functional or meta tensor (torch.export, FakeTensorMode, the
    meta device); None for an array with memory."""
    if "Tracer" in type(x).__name__:
        return "jax"
    if type(x).__name__ in ("FakeTensor", "FunctionalTensor") or getattr(x, "is_meta", False):
        return "torch"
    return None


def to_backend(x, name: str = "an array", *, written: bool = False):
    """A framework array as a NumPy (CPU) or CuPy (CUDA) array sharing its memory; anything
    else unchanged. ``name``: the argument, for errors; ``written``: it is to be written in place
    (a KV cache), so it must be the tensor's own memory, not a lazy view of it."""
    framework = framework_of(x)
    if framework is None:
        return x
    traced = _traced(x)
    if traced == "jax":
        raise TypeError(
            f"{name} is a traced JAX value (inside jax.jit, vmap or grad): cupy_attn's plain functions compute on "
            "concrete arrays; use cupy_attn.jax.attention, which supports jax.grad and, on the CPU, jax.jit"
        )
    if traced == "torch":
        raise TypeError(
            f"{name} is a {type(x).__name__} without data (torch.export, FakeTensorMode or the meta device): "
            "cupy_attn's plain functions compute on real tensors; cupy_attn.torch.attention and attention_varlen "
            "are operators that trace and export"
        )
    if framework == "torch":
        if str(x.layout) != "torch.strided":
            raise TypeError(f"{name} must be a dense torch tensor (layout torch.strided), got {x.layout}")
        if written and x.requires_grad:
            raise TypeError(f"{name} requires grad: torch refuses in-place writes to it, and so does cupy_attn (pass "
                            f"{name}.detach(), which shares its memory)")
        x = x.detach()
        if x.is_neg() or x.is_conj():
            # DLPack hands over the memory, not the lazy negation or conjugation of a view.
            if written:
                raise TypeError(f"{name} has its negative or conjugate bit set (a lazy view), so it cannot be "
                                "written in place; pass .resolve_neg() / .resolve_conj() of it and keep that one")
            x = x.resolve_neg().resolve_conj()  # a copy
    device = int(x.__dlpack_device__()[0])
    if device in (_CPU, _CUDA_HOST):
        if _is_bfloat16(x):
            if framework == "torch":
                import torch

                return np.from_dlpack(x.view(torch.int16)).view(BFLOAT16)
            return np.asarray(x)  # JAX exposes its CPU buffer with ml_dtypes' bfloat16
        return np.from_dlpack(x)
    if device == _CUDA:
        cupy = importlib.import_module("cupy")
        return cupy.from_dlpack(x)
    raise TypeError(f"{framework} arrays on DLPack device type {device} are not supported (CPU, pinned host memory "
                    "and CUDA are)")


# The tensors whose library must be the call's: the result's type comes from q, k, v (or x),
# and the others are of their size. Masks, lengths, slopes, block tables and the like may come
# from NumPy (or CuPy) beside framework arrays: the library's own mask builders make those, and a
# real mismatch (a NumPy mask beside CUDA tensors) is refused after conversion.
TENSORS = frozenset(("q", "k", "v", "dout", "out", "lse", "k_cache", "v_cache", "x", "w_q", "w_k", "w_v", "w_o",
                     "context"))


# The differentiable twin of a plain function, for the error that refuses its grad-requiring tensors.
_DIFFERENTIABLE = {"attention": "cupy_attn.torch.attention", "attention_varlen": "cupy_attn.torch.attention_varlen"}


def backend_arrays(framework: str | None, written=(), *, function: str | None = None, **named) -> list:
    """The named arguments as backend arrays (`to_backend`; those named in ``written`` are to be
    written in place), after checking that the TENSORS among them (and merge_attention's parts,
    outs[i] and lses[i]) come from the caller's library, ``framework`` (None: NumPy or CuPy): a
    torch tensor beside NumPy arrays would otherwise be taken on the CPU and the result handed
    back as whichever came first. Everything else passes as it is. ``function``: the cupy_attn
    function whose results come from them, which refuses a torch tensor that autograd would
    follow, as torch's own Tensor.numpy() does: a result computed outside autograd would silently
    cut the graph (a residual branch's gradient lost without an error)."""
    check_libraries(framework, **named)
    if function is not None:
        for name, x in named.items():
            if name not in written and needs_autograd(framework, x):  # (a cache to write: refused below)
                twin = _DIFFERENTIABLE.get(function)
                instead = f"use {twin}, which is differentiable, or call it" if twin else "call it"
                raise TypeError(f"{name} requires grad, and cupy_attn.{function} computes outside torch's autograd, "
                                f"so its gradient would be silently lost: {instead} under torch.no_grad() (or pass "
                                f"{name}.detach())")
    return [to_backend(x, name, written=name in written) for name, x in named.items()]


def check_libraries(framework: str | None, **named) -> None:
    """Refuse a TENSORS array among ``named`` (or a merge_attention part) from a library other
    than ``framework``'s (see `backend_arrays`)."""
    lead_name = next((n for n, x in named.items() if framework_of(x) == framework), None)
    for name, x in named.items():
        kind = framework_of(x)
        checked = name in TENSORS or name.startswith(("outs[", "lses["))
        if checked and kind != framework and (kind is not None or module_of(x) is not None):
            theirs = f"a {framework} array" if framework else "a NumPy or CuPy array"
            raise TypeError(f"{name} is a {kind or module_of(x).__name__} array, but {lead_name} is {theirs}: pass all "
                            "arrays from one library")


def to_framework(framework: str | None, x):
    """A NumPy/CuPy result back into ``framework``'s array type (zero-copy where DLPack allows)."""
    if framework is None or not (isinstance(x, np.ndarray) or is_cupy_array(x)):
        return x
    bf16 = x.dtype == BFLOAT16
    if framework == "torch":
        import torch

        if bf16:
            return torch.from_dlpack(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_dlpack(x)
    import jax.numpy as jnp

    if isinstance(x, np.ndarray) and (bf16 or not x.flags.writeable):
        # A copy: JAX's DLPack import takes neither bfloat16 nor read-only NumPy arrays (views
        # of JAX's own buffers, e.g. from split_heads).
        return jnp.asarray(x)
    return jnp.from_dlpack(x)


def lead(*arrays):
    """(framework, array) of the first framework array among ``arrays``: the caller's type,
    which results are handed back as; (None, None) if there is none."""
    return next(((f, a) for a in arrays if (f := framework_of(a)) is not None), (None, None))


@contextlib.contextmanager
def caller_stream(framework: str | None, x):
    """Run CuPy work on the lead framework array's GPU (``x``, of `lead`): for PyTorch on its
    current CUDA stream, so no synchronisation is needed and the caller's later work on that
    stream sees the results; for JAX, whose streams CuPy cannot join, on CuPy's, synchronised
    before the call returns, since the CuPy views of JAX's buffers go with it and JAX may then
    hand their memory to its next operation (a temporary's, e.g. a mask made for the call)."""
    if framework is None or _traced(x) or int(x.__dlpack_device__()[0]) != _CUDA:
        yield  # (a value without data: to_backend refuses it, naming it)
        return
    import cupy

    index = int(x.__dlpack_device__()[1])
    if framework == "jax":
        with cupy.cuda.Device(index):
            yield
            cupy.cuda.get_current_stream().synchronize()
        return
    import torch

    stream = torch.cuda.current_stream(x.device)
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream, index):
        yield
