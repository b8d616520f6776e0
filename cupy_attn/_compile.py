"""Building kernels from kernels/*.cu for the GPU (cupy.RawModule) or the CPU (the emulator).

Local headers are inlined (with #line) so CuPy's cache key, a hash of the source string, covers
every header. One module per kernel variant, compiled on first use and memoised per device; the
first compile of a variant is logged at INFO level with its duration, later processes hit CuPy's
(or the emulator's) disk cache.
"""
from __future__ import annotations

import logging
import time
from functools import lru_cache

from . import _config, _paths
from ._source import inline_local_includes
from .mods import ModCompileError

log = logging.getLogger("cupy_attn")

NVRTC_OPTIONS = ("-std=c++17",)
# What CuPy 14's RawModule adds to the options it is given before NVRTC runs, where they change the
# generated code (cupy/_core/core.pyx assemble_cupy_compiler_options; cupy/cuda/compiler.py
# _compile_with_cache_cuda and _compile_using_nvrtc_no_warning): flush-to-zero for float32, and
# __device__ as the default execution space. Its include paths change no code; its -arch=sm_<device>
# (a cubin, straight from NVRTC) is what the report's arch stands for.
CUPY_ADDED_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")


# The SASS audit's model of a boundary tile (kernels/block_info.cuh ATTN_BOUNDARY_TILES): a build
# that takes every key tile as one on the causal diagonal, a window's edge or a sequence's end, so
# that the hot loop's fastest path is the masked copy's (`python -m cupy_attn kernels --sass
# --boundary`). Never given to a build that runs.
BOUNDARY_MODEL_OPTIONS = ("-DATTN_BOUNDARY_TILES=1",)


def feature_options(features: int, packed: bool = False) -> tuple:
    """The -D that build a module for a set of score features (kernels/mask.cuh) and a batch
    layout (kernels/block_info.cuh: padded, or packed for attention_varlen)."""
    if features not in _config.FEATURE_SETS:
        raise ValueError(f"features must be a set of _config.FEATURE_BITS with at most one mask kind "
                         f"(one of _config.FEATURE_SETS), got {features!r}")
    return (f"-DATTN_SCORE_FEATURES={features}",) + (("-DATTN_PACKED=1",) if packed else ())


def nvrtc_options(filename: str, features: int = _config.PLAIN_FEATURES, packed: bool = False) -> tuple:
    """NVRTC options cupy.RawModule is given for kernels/filename: the score features and batch
    layout, and for files bound to one architecture (the wgmma kernels, sm_90a) that
    architecture; CuPy's own -arch for the device is added after ours, and NVRTC builds for
    sm_90a when both are given."""
    arch = _config.FILE_ARCH.get(filename)
    return NVRTC_OPTIONS + ((f"-arch={arch}",) if arch else ()) + feature_options(features, packed)


def gpu_build_options(filename: str, features: int = _config.PLAIN_FEATURES, packed: bool = False) -> tuple:
    """Every code-changing NVRTC option a GPU build of kernels/filename gets: ours and CuPy's. The
    compile report, the precompile check and the compile-time benchmark build with these, so their
    registers and spills are those of the code that runs."""
    return nvrtc_options(filename, features, packed) + CUPY_ADDED_OPTIONS


@lru_cache(maxsize=None)
def kernel_source(filename: str) -> str:
    path = _paths.kernel_dir() / filename
    return inline_local_includes(path.read_text(), [_paths.kernel_dir()], origin=str(path))


def _device_id() -> int:
    import cupy

    return cupy.cuda.Device().id


@lru_cache(maxsize=None)
def _function(target: str, filename: str, name_expression: str, features: int, packed: bool, device: int, mods):
    code = kernel_source(filename) + (mods.code if mods else "")
    extra = mods.options if mods else ()
    start = time.perf_counter()
    try:
        if target == "cuda":
            import cupy

            module = cupy.RawModule(code=code, options=nvrtc_options(filename, features, packed) + extra,
                                    name_expressions=[name_expression])
        else:
            from .emulator import RawModule

            module = RawModule(code=code, options=feature_options(features, packed) + extra,
                               name_expressions=[name_expression])
        function = module.get_function(name_expression)
    except Exception as exc:
        # CuPy's CompileException, the emulator's EmulatorCompileError; anything else (no g++, a
        # driver error) is not the snippet's fault and passes unchanged.
        if mods is None or "CompileError" not in type(exc).__name__ and "CompileException" not in type(exc).__name__:
            raise
        raise ModCompileError(f"a score_mod or mask_mod did not compile into {name_expression}:\n{exc}\n\n"
                              f"the snippets (lines as the compiler numbers them):\n{mods.listing}") from None
    log.info("compiled %s (score features %s%s%s) for %s in %.2f s", name_expression, _config.feature_words(features),
             ", packed" if packed else "", ", with mods" if mods else "", target if target == "emulator" else f"GPU {device}",
             time.perf_counter() - start)
    return function


def function(target: str, filename: str, name_expression: str, features: int = _config.PLAIN_FEATURES,
             packed: bool = False, mods=None):
    """The kernel ``name_expression`` of ``kernels/filename`` for "cuda" or "emulator", built for
    ``features`` (one of _config.FEATURE_SETS), a padded or, with ``packed``, a packed (varlen)
    batch, and with ``mods`` (a _mods_source.ModSource) a call's score_mod and mask_mod."""
    return _function(target, filename, name_expression, features, bool(packed),
                     _device_id() if target == "cuda" else -1, mods)
