"""Compiling CUDA C source for the CPU: option translation, source rewriting, g++, disk cache."""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from .._source import inline_local_includes

INCLUDE_DIR = Path(__file__).resolve().parent / "include"
SHIM = "cuda_emu.h"
RUNTIME_SOURCES = (INCLUDE_DIR / "emu_runtime.cpp", INCLUDE_DIR / "emu_async.cpp", INCLUDE_DIR / "emu_lanes.cpp")

# NVRTC options that change nothing on the CPU (architecture, fast-math and debug switches).
_IGNORED = re.compile(
    r"^(-arch|--gpu-architecture|-std|--std|--ftz|--prec-div|--prec-sqrt|--fmad|-maxrregcount|"
    r"--maxrregcount|-rdc|--relocatable-device-code|-default-device|--extra-device-vectorization)=.*$"
    r"|^(-lineinfo|--generate-line-info|-use_fast_math|--use_fast_math|-G|--device-debug|"
    r"-default-device|--device-as-default-execution-space|-dopt=on|-Xptxas=.*)$"
)


class EmulatorError(RuntimeError):
    """A kernel failed while emulated (deadlock, misuse of a warp collective, __trap, ...)."""


class EmulatorCompileError(EmulatorError):
    """The host compiler rejected the kernel source."""


def compiler() -> str | None:
    """The C++ compiler the emulator uses ($CXX, else g++), or None if there is none."""
    candidate = os.environ.get("CXX", "g++")
    return shutil.which(candidate)


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cupy_attn" / "emulator"
    return Path(os.environ.get("CUPY_ATTN_EMULATOR_CACHE", default))


def translate_options(options) -> tuple[list[str], list[Path]]:
    """NVRTC options -> g++ flags and include directories; unknown options are an error."""
    flags, includes = [], []
    items = list(options)
    i = 0
    while i < len(items):
        opt = items[i]
        if not isinstance(opt, str):
            raise TypeError(f"options must be strings, got {opt!r}")
        if opt in ("-D", "-U", "-I", "--include-path", "--define-macro") and i + 1 < len(items):
            opt, i = opt + ("=" if opt.startswith("--") else "") + items[i + 1], i + 1
        if opt.startswith(("-D", "-U")):
            flags.append(opt)
        elif opt.startswith("--define-macro="):
            flags.append("-D" + opt.split("=", 1)[1])
        elif opt.startswith("-I"):
            includes.append(Path(opt[2:]))
        elif opt.startswith("--include-path="):
            includes.append(Path(opt.split("=", 1)[1]))
        elif not _IGNORED.match(opt):
            raise ValueError(f"option {opt!r} is not understood by the emulator (it takes -D, -U, -I and ignores NVRTC's architecture and fast-math switches)")
        i += 1
    return flags, includes


# `extern __shared__ T name[];` -> a pointer to the block's dynamic shared memory, on one line
# so line numbers stay true.
_EXTERN_SHARED = re.compile(
    r"extern\s+__shared__\s+((?:[\w:<>,\s]|__align__\s*\(\s*\d+\s*\)|alignas\s*\(\s*\d+\s*\))+?)\s*\b(\w+)\s*\[\s*\]\s*;"
)
_ALIGN = re.compile(r"(__align__|alignas)\s*\(\s*\d+\s*\)")


def rewrite_dynamic_shared(code: str) -> str:
    def pointer(match):
        element = " ".join(_ALIGN.sub("", match.group(1)).split())
        return f"{element}* {match.group(2)} = reinterpret_cast<{element}*>(::emu::dynamic_shared());"

    return _EXTERN_SHARED.sub(pointer, code)


def registration(names) -> str:
    entries = "".join(f'    ::emu::describe<&{name}>("{name}"),\n' for name in names)
    return (
        "\n#line 1 \"<emulator kernel table>\"\n"
        f"const ::emu::KernelInfo emu_kernel_table[] = {{\n{entries}}};\n"
        f"const int emu_kernel_count = {len(names)};\n"
    )


@lru_cache(maxsize=1)
def _toolchain_fingerprint() -> str:
    cxx = compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout if cxx else ""
    sources = "".join(p.read_text() for p in sorted([*INCLUDE_DIR.glob("*.h"), *RUNTIME_SOURCES]))
    return hashlib.sha256((version + sources).encode()).hexdigest()


def _mode(sanitize: bool) -> list[str]:
    return ["-fsanitize=address", "-fno-omit-frame-pointer", "-O1", "-g"] if sanitize else ["-O2"]


# Every g++ run of the emulator: the runtime library, the precompiled header and the kernels must
# agree on these (a precompiled header is used only with the options it was built with).
BASE_FLAGS = ("-std=c++17", "-fPIC", "-fno-strict-aliasing", "-pthread", "-w")


def _compile(target: Path, arguments: list[str], what: str) -> None:
    """g++ ``arguments`` (flags and inputs) into ``target``, unless it exists: built in a temporary
    directory beside it and renamed (atomic, so concurrent builders of one target are harmless)."""
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        command = [compiler(), *BASE_FLAGS, *arguments, "-o", str(out)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise EmulatorCompileError(f"g++ could not compile {what}:\n{result.stderr[-6000:]}\ncommand: {shlex.join(command)}")
        os.replace(out, target)


def _shared_key(sanitize: bool) -> str:
    if compiler() is None:
        raise EmulatorError("the emulator needs a C++ compiler: none found (install g++ or set $CXX)")
    return hashlib.sha256("\0".join([_toolchain_fingerprint(), *_mode(sanitize)]).encode()).hexdigest()[:32]


def runtime_library(sanitize: bool = False) -> Path:
    """The emulator's runtime (emu_runtime.cpp, emu_async.cpp, emu_lanes.cpp: the launch, fibers,
    barriers, warp collectives, mbarriers, TMA, the order of a warp's lanes), compiled once per
    toolchain and mode into the cache: every kernel module links it, so a kernel's build compiles
    only the kernel."""
    target = cache_dir() / f"libemu_runtime_{_shared_key(sanitize)}.so"
    _compile(target, [*_mode(sanitize), "-shared", f"-Wl,-soname,{target.name}", "-I", str(INCLUDE_DIR),
                      *map(str, RUNTIME_SOURCES)], "the emulator's runtime")
    return target


def precompiled_header(sanitize: bool = False) -> Path:
    """cuda_emu.h and the standard headers it includes, parsed once per toolchain and mode (g++
    -x c++-header): the directory holding cuda_emu.h.gch, which kernel builds search before the
    header's own (kernel_flags), so they skip that parse; g++ ignores a precompiled header that
    does not fit a build and reads the header itself."""
    directory = cache_dir() / f"pch_{_shared_key(sanitize)}"
    _compile(directory / f"{SHIM}.gch", [*_mode(sanitize), "-I", str(INCLUDE_DIR), "-x", "c++-header",
                                         str(INCLUDE_DIR / SHIM)], "the emulator's header")
    return directory


def kernel_flags(flags: list[str], includes: list[Path], sanitize: bool = False) -> list[str]:
    """What a kernel's g++ run adds to BASE_FLAGS before its source: the precompiled header's
    directory first, then the emulator's headers, the kernel's include directories and its
    translated options, and cuda_emu.h force-included."""
    return [*_mode(sanitize), "-I", str(precompiled_header(sanitize)), "-I", str(INCLUDE_DIR),
            *[f"-I{d}" for d in includes], *flags, "-include", SHIM]


def build(code: str, options, names, *, sanitize: bool = False) -> Path:
    """Compile ``code`` (with kernels ``names``) into a shared library linking the runtime library;
    cached on disk by a hash of the full source (local headers inlined), options, names, emulator
    sources and compiler."""
    runtime = runtime_library(sanitize)
    flags, includes = translate_options(options)
    source = inline_local_includes(code, includes)
    source = rewrite_dynamic_shared(source) + registration(names)
    key = hashlib.sha256("\0".join([_toolchain_fingerprint(), source, *flags, *map(str, includes),
                                    *_mode(sanitize)]).encode()).hexdigest()
    target = cache_dir() / f"{key[:32]}.so"
    if not target.exists():
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "kernel.cu"
            src.write_text(source)
            # the kernel as C++ (-x c++), then the runtime library (-x none), which the module
            # finds beside it when loaded ($ORIGIN: both live in the cache)
            _compile(target, [*kernel_flags(flags, includes, sanitize), "-shared", "-x", "c++", str(src), "-x", "none",
                              str(runtime), "-Wl,-rpath,$ORIGIN"], "the kernel source")
    return target
