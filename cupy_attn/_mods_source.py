"""A call's score_mod and mask_mod as CUDA C: the functions kernels/mask.cuh declares, appended to
a kernel's source, and the words (tensor addresses and strides, scalars) they read at run time.

Each tensor or scalar has a fixed place in the words, so the code depends only on the snippets,
the tensors' dtypes and ranks and the scalars' kinds: calls that change a tensor's contents,
address or strides, or a scalar's value, reuse the compiled module.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .mods import TENSOR_TYPES

_SIGNATURES = {
    "score_mod": "float score_mod(float score, int b, int h, int q_idx, int kv_idx, const long long* attn_words)",
    "score_mod_grad": "float score_mod_grad(float score, int b, int h, int q_idx, int kv_idx, const long long* attn_words)",
    "mask_mod": "bool mask_mod(int b, int h, int q_idx, int kv_idx, const long long* attn_words)",
}


@dataclass(frozen=True)
class ModSource:
    """What a module is built with for a call's mods: the -D options and the appended code."""

    options: tuple
    code: str
    listing: str  # the snippets with line numbers, for compile errors


def _scalar_kind(value) -> str:
    """How a scalar is stored in the words and read by a snippet: bool, int (long long) or double."""
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    return "int" if isinstance(value, (int, np.integer)) else "double"


def _layout(mod, base: int):
    """(name, kind, first word) per tensor and scalar of ``mod``, from word ``base``; and the word
    after them. A tensor takes 1 + ndim words (address, element strides), a scalar one."""
    places, at = [], base
    for name, x in mod.tensors.items():
        places.append((name, np.dtype(x.dtype), x.ndim, at))
        at += 1 + x.ndim
    for name, value in mod.scalars.items():
        places.append((name, _scalar_kind(value), 0, at))
        at += 1
    return places, at


def _accessors(places) -> tuple[list, list]:
    """#define and #undef lines that let a snippet read each tensor and scalar by name."""
    defines, undefs = [], []
    for name, kind, ndim, at in places:
        if isinstance(kind, np.dtype):
            ctype, read = TENSOR_TYPES[kind]
            args = ", ".join(f"attn_i{a}" for a in range(ndim))
            offset = " + ".join(f"static_cast<long long>(attn_i{a}) * attn_words[{at + 1 + a}]" for a in range(ndim))
            element = f"reinterpret_cast<const {ctype}*>(attn_words[{at}])[{offset}]"
            defines.append(f"#define {name}({args}) ({read.format(element)})")
        elif kind == "double":
            defines.append(f"#define {name} (reinterpret_cast<const double*>(attn_words)[{at}])")
        elif kind == "int":
            defines.append(f"#define {name} (attn_words[{at}])")
        else:
            defines.append(f"#define {name} (attn_words[{at}] != 0)")
        undefs.append(f"#undef {name}")
    return defines, undefs


def _function(signature: str, expression: str, label: str, places, result: str) -> str:
    defines, undefs = _accessors(places)
    return "\n".join([f"__device__ __forceinline__ {signature} {{", *defines,
                      f"    return static_cast<{result}>(", f'#line 1 "{label}"', expression,
                      '#line 1 "cupy_attn._mods_source"', "    );", *undefs, "}"])


def mod_source(score_mod, mask_mod, block_sparse: bool = False) -> ModSource:
    """The options and code a module needs for these mods (either may be None, not both), and with
    ``block_sparse`` a block mask's tables (kernels/block_info.cuh)."""
    functions, listings, at = [], [], 0
    if score_mod is not None:
        listings.append(numbered("score_mod", score_mod.cuda))
        places, at = _layout(score_mod, at)
        functions.append(_function(_SIGNATURES["score_mod"], score_mod.cuda, "score_mod", places, "float"))
        grad = "1.0f" if score_mod.grad in (None, "additive") else score_mod.grad
        functions.append(_function(_SIGNATURES["score_mod_grad"], grad, "score_mod_grad", places, "float"))
        if score_mod.grad not in (None, "additive"):
            listings.append(numbered("score_mod_grad", grad))
    if mask_mod is not None:
        places, at = _layout(mask_mod, at)
        functions.append(_function(_SIGNATURES["mask_mod"], mask_mod.cuda, "mask_mod", places, "bool"))
        listings.append(numbered("mask_mod", mask_mod.cuda))
    code = "\n\n// The call's mods (cupy_attn._mods_source)\nnamespace attn {\nnamespace mods {\n" + \
        "\n".join(functions) + "\n}  // namespace mods\n}  // namespace attn\n"
    options = ("-DATTN_MODS=1", f"-DATTN_SCORE_MOD={int(score_mod is not None)}",
               f"-DATTN_MASK_MOD={int(mask_mod is not None)}", f"-DATTN_BLOCK_MASK={int(block_sparse)}")
    return ModSource(options, code, "\n".join(listings))


def mod_words(xp, score_mod, mask_mod):
    """The int64 words the appended functions read: per tensor its address and element strides,
    per scalar its value (a double's bits for floats), in mod_source's order."""
    words = []
    for mod in (score_mod, mask_mod):
        if mod is None:
            continue
        for x in mod.tensors.values():
            address = x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr
            words += [address] + [st // x.itemsize for st in x.strides]
        for value in mod.scalars.values():
            double = _scalar_kind(value) == "double"
            words.append(int(np.array(float(value), np.float64).view(np.int64)) if double else int(value))
    return xp.asarray(np.array(words or [0], dtype=np.int64))


def numbered(label: str, expression: str) -> str:
    """A snippet with line numbers, for compile errors (lines as NVRTC reports them under #line)."""
    return "\n".join(f"{label} {n:>3} | {line}" for n, line in enumerate(expression.splitlines(), 1))
