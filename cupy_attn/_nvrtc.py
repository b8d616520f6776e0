"""NVRTC through ctypes, without CuPy or a GPU: the compile report's engine.

libnvrtc and the CUDA headers come from the `nvidia-cuda-nvrtc` and `nvidia-cuda-runtime` wheels
(the test extra installs them), from $CUDA_PATH, or from /usr/local/cuda. ptxas's verbose output
(`--ptxas-options=-v`) gives registers, spills and static shared memory per kernel.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import pickle
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


class NvrtcError(RuntimeError):
    """NVRTC is missing or rejected a kernel."""


def _roots() -> list[Path]:
    roots = [Path(p) / "nvidia" for p in sys.path if (Path(p) / "nvidia").is_dir()]
    cuda = os.environ.get("CUDA_PATH")
    return roots + ([Path(cuda)] if cuda else []) + [Path("/usr/local/cuda")]


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    patterns = ["cu1*/lib/libnvrtc.so.*", "cuda_nvrtc/lib/libnvrtc.so.*", "lib64/libnvrtc.so*"]
    for root in _roots():
        for pattern in patterns:
            for path in sorted(glob.glob(str(root / pattern)), reverse=True):
                if "builtins" not in path and "alt" not in path:
                    return ctypes.CDLL(path)
    raise NvrtcError("libnvrtc not found: pip install nvidia-cuda-nvrtc nvidia-cuda-runtime (or set CUDA_PATH)")


@lru_cache(maxsize=1)
def include_dir() -> Path:
    for root in _roots():
        for candidate in [*sorted(root.glob("cu1*/include")), root / "cuda_runtime/include", root / "include"]:
            if (candidate / "cuda_fp16.h").is_file():
                return candidate
    raise NvrtcError("CUDA headers (cuda_fp16.h) not found: pip install nvidia-cuda-runtime (or set CUDA_PATH)")


def version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


@dataclass
class Compiled:
    name: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame_bytes: int
    static_shared_bytes: int
    compile_seconds: float
    ptx: str
    log: str
    cubin: bytes  # the machine code NVRTC built for a real architecture (sm_XX), for disassembly


def _ptxas_number(pattern: str, log: str) -> int:
    match = re.search(pattern, log)
    return int(match.group(1)) if match else 0


def compile_kernel(code: str, name_expression: str, arch: str, options=()) -> Compiled:
    """Compile one kernel (a name expression) for ``arch`` (sm_80, sm_90, sm_90a, ...)."""
    lib = library()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"kernel.cu", 0, None, None):
        raise NvrtcError("nvrtcCreateProgram failed")
    try:
        lib.nvrtcAddNameExpression(prog, name_expression.encode())
        opts = [f"-arch={arch}", f"-I{include_dir()}", "--ptxas-options=-v", *options]
        argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        start = time.perf_counter()
        status = lib.nvrtcCompileProgram(prog, len(opts), argv)
        seconds = time.perf_counter() - start
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if status:
            raise NvrtcError(f"NVRTC could not compile {name_expression} for {arch}:\n{log}")
        lowered = ctypes.c_char_p()
        lib.nvrtcGetLoweredName(prog, name_expression.encode(), ctypes.byref(lowered))
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        if size.value:
            lib.nvrtcGetCUBIN(prog, cubin)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    # ptxas reports per entry function; this program holds exactly one.
    return Compiled(
        name=name_expression, arch=arch,
        registers=_ptxas_number(r"Used (\d+) registers", log),
        spill_stores=_ptxas_number(r"(\d+) bytes spill stores", log),
        spill_loads=_ptxas_number(r"(\d+) bytes spill loads", log),
        stack_frame_bytes=_ptxas_number(r"(\d+) bytes stack frame", log),
        static_shared_bytes=_ptxas_number(r"(\d+) bytes smem", log),
        compile_seconds=seconds, ptx=ptx.value.decode(), log=log, cubin=cubin.raw[:size.value],
    )


# ptxas's register allocation is not a pure function of its input: on a saturated CPU it has
# returned a different allocation for the same program and options (measured 2026-11-30:
# attention_bwd_dq<float, 128, 32, 32, 4> plain sm_90, 95 registers and no spills on an idle
# 2-core machine, 72 registers and 16 bytes spilled with both cores busy). A report of spills
# therefore compiles a spilling variant again, up to SPILL_ATTEMPTS times in all, and keeps the
# best result: a variant that spills on every attempt is reported.
SPILL_ATTEMPTS = 3


# Where compile_kernel_least_spills keeps the results without spills, if set: a private directory
# (its files are unpickled), read and written by concurrent processes and threads (each result
# written whole to a file of its own, then renamed). A result read there keeps its first build's
# compile_seconds, log and attempts. The tests set one per run, so that a build two checks share
# (the compile report's and the feature builds' plain, all and dropout builds, for one) goes
# through NVRTC once.
CACHE_ENVIRONMENT = "CUPY_ATTN_NVRTC_CACHE"


def _cached_result(code: str, name_expression: str, arch: str, options) -> Path | None:
    directory = os.environ.get(CACHE_ENVIRONMENT)
    if not directory:
        return None
    key = hashlib.sha256("\0".join([version(), str(include_dir()), code, name_expression, arch, *options]).encode())
    return Path(directory) / f"{key.hexdigest()[:32]}.pickle"


def compile_kernel_least_spills(code: str, name_expression: str, arch: str, options=()) -> tuple[Compiled, int]:
    """compile_kernel, repeated while the result spills (SPILL_ATTEMPTS in all); the result with
    the fewest spilled bytes and the number of compiles it took (as first built, where it comes
    from CACHE_ENVIRONMENT's directory; one that cannot be read there is built again)."""
    cached = _cached_result(code, name_expression, arch, options)
    if cached is not None and cached.is_file():
        try:
            return pickle.loads(cached.read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError):
            pass
    best, attempts = None, 0
    while attempts < SPILL_ATTEMPTS and (best is None or best.spill_stores + best.spill_loads):
        attempts += 1
        c = compile_kernel(code, name_expression, arch, options)
        if best is None or c.spill_stores + c.spill_loads < best.spill_stores + best.spill_loads:
            best = c
    if cached is not None and not best.spill_stores + best.spill_loads:  # one that spills is compiled again
        cached.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=cached.parent, suffix=".partial")
        with os.fdopen(handle, "wb") as f:
            f.write(pickle.dumps((best, attempts)))
        os.replace(partial, cached)
    return best, attempts
