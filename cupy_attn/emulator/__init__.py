"""Run cupy_attn's CUDA C kernels on the CPU.

``RawModule`` mirrors ``cupy.RawModule``: it compiles the same ``.cu`` source with the host C++
compiler (a force-included header supplies CUDA's keywords, built-ins and types) and runs each
CUDA thread as a fiber, with real barrier, warp-collective and shared-memory semantics, on NumPy
arrays. See README.md, "The emulator", for what it models and what it does not.
"""
from ._build import EmulatorCompileError, EmulatorError, compiler
from ._counters import MemoryCounters, SiteCount, counting
from ._module import SCHEDULES, Function, RawModule


def available() -> tuple[bool, str]:
    """Whether kernels can be emulated here (a C++ compiler is found), and why not."""
    cxx = compiler()
    return (True, f"C++ compiler {cxx}") if cxx else (False, "no C++ compiler found (install g++ or set $CXX)")


__all__ = ["EmulatorCompileError", "EmulatorError", "Function", "MemoryCounters", "RawModule", "SCHEDULES", "SiteCount",
           "available", "counting"]
