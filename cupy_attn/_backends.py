"""Backend selection and availability, in one place.

"numpy" runs everywhere; "cuda" runs the run-time-compiled kernels on CuPy arrays when CuPy
reaches a GPU; "emulator" runs the same kernels on NumPy arrays through cupy_attn.emulator when a
C++ compiler is present. A backend that cannot run raises `BackendUnavailableError` with the
reason, never a silent fallback.
"""
from __future__ import annotations

import importlib.util

import numpy as np

from . import _kernel_backend, _numpy_backend, emulator


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here (not built yet, no GPU, no compiler, ...)."""


def cuda_status() -> tuple[bool, str]:
    """Whether CuPy can reach a GPU and compile the kernels there, and why not."""
    if importlib.util.find_spec("cupy") is None:
        return False, "CuPy is not installed (pip install 'cupy_attn[cuda13]', or '[cuda12]' for CUDA 12)"
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CuPy raises CUDARuntimeError (or an ImportError of libcuda) without a GPU
        return False, f"CuPy cannot reach a GPU: {exc}"
    if count == 0:
        return False, "CuPy found no CUDA device"
    compiles, why = cuda_compiler_status()
    if not compiles:
        return False, why
    return True, f"{count} CUDA device(s) visible to CuPy; {why}"


def cuda_compiler_status() -> tuple[bool, str]:
    """Whether CuPy can compile the kernels: NVRTC loads and the CUDA headers the kernels include
    (cuda_fp16.h, cuda_bf16.h) are where CuPy 14 looks for them (cuda.pathfinder). A machine with
    only the NVIDIA driver gets both from CuPy's ``ctk`` extra."""
    import cupy

    major = cupy.cuda.runtime.runtimeGetVersion() // 1000
    hint = (f"pip install 'cupy-cuda{major}x[ctk]' (what 'cupy_attn[cuda{major}]' installs), "
            "or set CUDA_PATH to a CUDA toolkit")
    try:
        nvrtc = "NVRTC {}.{}".format(*cupy.cuda.nvrtc.getVersion())
    except Exception as exc:  # the library is missing or does not load
        return False, f"CuPy cannot load NVRTC ({exc}): {hint}"
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:  # CuPy before 14 finds headers through CUDA_PATH alone
        return True, f"{nvrtc}; CUDA headers not checked (no cuda.pathfinder)"
    headers = find_nvidia_header_directory("cudart")
    if headers is None:
        return False, f"{nvrtc}, but no CUDA headers (cuda_fp16.h) where CuPy looks: {hint}"
    return True, f"{nvrtc}, CUDA headers in {headers}"


def available() -> dict[str, tuple[bool, str]]:
    """Every backend name -> (usable now, reason)."""
    return {name: status(name) for name in ("numpy", "cuda", "emulator")}


# cuda_status() once it said usable: a GPU CuPy reached and NVRTC that loaded stay so for the
# process, and every call on CuPy arrays asks (a failing status is asked again each time).
_CUDA_USABLE: list[tuple[bool, str]] = []


def status(name: str) -> tuple[bool, str]:
    """(usable now, reason) of one backend: what a call asks of the backend it runs on alone (all
    three cost a call 60 µs on a 2-core machine, most of it finding the emulator's compiler)."""
    if name == "numpy":
        return True, "always available"
    if name == "emulator":
        return emulator.available()
    if not _CUDA_USABLE:
        found = cuda_status()
        if not found[0]:
            return found
        _CUDA_USABLE.append(found)
    return _CUDA_USABLE[0]


def resolve(backend: str, xp) -> str:
    """The backend name that runs ``backend`` ("auto" or a name) on arrays of ``xp`` (numpy or
    cupy); raises if it cannot run here or on such arrays."""
    name = backend
    if name == "auto":
        name = "numpy" if xp is np else "cuda"
    usable, why = status(name)
    if not usable:
        where = "NumPy" if xp is np else "CuPy"
        raise BackendUnavailableError(f"backend {name!r} cannot run {where} inputs here: {why}")
    if name in ("numpy", "emulator") and xp is not np:
        raise BackendUnavailableError(
            f"backend {name!r} needs NumPy arrays; move CuPy inputs to the host with .get() first"
        )
    if name == "cuda" and xp is np:
        raise BackendUnavailableError("backend 'cuda' needs CuPy arrays; move NumPy inputs with cupy.asarray() first")
    return name


def select(problem) -> str:
    """The backend name that will run ``problem``; raises if it cannot run here."""
    name = resolve(problem.backend, problem.xp)
    if name != "numpy":
        _kernel_backend.check_supported(problem, name)
    return name


def forward(name: str, problem, q, k, v):
    if name == "numpy":
        return _numpy_backend.forward(problem, q, k, v)
    return _kernel_backend.forward(problem, q, k, v, target=name)


def backward(name: str, problem, dout, q, k, v, out, lse, deterministic: bool):
    if name == "numpy":  # always deterministic: no atomics, a fixed summation order
        return _numpy_backend.backward(problem, dout, q, k, v, out, lse)
    return _kernel_backend.backward(problem, dout, q, k, v, out, lse, target=name, deterministic=deterministic)
