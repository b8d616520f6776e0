"""RawModule and Function: cupy.RawModule's interface over kernels compiled for the CPU."""
from __future__ import annotations

import ctypes
import os
import threading
from functools import lru_cache

import numpy as np
from numpy.lib.array_utils import byte_bounds

from . import _counters
from ._build import EmulatorError, build

SCHEDULES = {"forward": 0, "reverse": 1, "random": 2, "warps": 3, "warps_reverse": 4}
_KIND_NAMES = {"p": "pointer", "c": "const pointer", "i": "integer", "f": "float", "b": "bool", "o": "struct"}
STATIC_SHARED_LIMIT = 48 * 1024  # without opting in, as on the GPU
MAX_SHARED = 227 * 1024  # sm_90's per-block maximum with max_dynamic_shared_size_bytes
# Launches from several Python threads run one after another: a launch already spreads its
# blocks over default_workers() threads, and each maps a stack per fiber, so concurrent launches
# only added up mappings (past vm.max_map_count, a std::system_error and an abort) and memory.
_ONE_LAUNCH_AT_A_TIME = threading.Lock()


class _Argument:
    """A struct argument's bytes, kept alive in `storage`, at a 64-byte-aligned `address` in it."""

    def __init__(self, storage, address: int):
        self.storage, self.address = storage, address


def default_workers() -> int:
    value = os.environ.get("CUPY_ATTN_EMULATOR_THREADS", "")
    if not value:  # unset or empty: one thread per core, up to 4
        return min(os.cpu_count() or 1, 4)
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"CUPY_ATTN_EMULATOR_THREADS must be a positive integer (threads running blocks), got {value!r}")
    return int(value)


def _asan_loaded() -> bool:
    return hasattr(ctypes.CDLL(None), "__asan_init")


@lru_cache(maxsize=None)
def _load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL)
    lib.emu_kernel_count_get.restype = ctypes.c_int
    lib.emu_kernel_name.restype = ctypes.c_char_p
    lib.emu_kernel_name.argtypes = [ctypes.c_int]
    lib.emu_max_kernel_params.restype = ctypes.c_int
    lib.emu_kernel_params.restype = ctypes.c_int
    lib.emu_kernel_params.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]
    lib.emu_launch.restype = ctypes.c_int
    lib.emu_launch.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint), ctypes.c_size_t,
                               ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_ulonglong, ctypes.c_int,
                               ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int,
                               ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int,
                               ctypes.c_char_p, ctypes.c_size_t]
    return lib


def _dims(name: str, value) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(not isinstance(d, (int, np.integer)) or d < 1 for d in dims):
        raise ValueError(f"{name} must be a positive int or a tuple of 1 to 3 positive ints, got {value!r}")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


class Function:
    """One kernel; call it like cupy.RawKernel: ``fn(grid, block, args, shared_mem=0)``."""

    def __init__(self, lib: ctypes.CDLL, index: int, name: str):
        self._lib, self._index, self.name = lib, index, name
        most = lib.emu_max_kernel_params()
        sizes, pointees = (ctypes.c_int * most)(), (ctypes.c_int * most)()
        kinds = ctypes.create_string_buffer(most)
        count = lib.emu_kernel_params(index, sizes, kinds, pointees)
        self.params = [(sizes[i], kinds.raw[i:i + 1].decode(), pointees[i]) for i in range(count)]
        self.max_dynamic_shared_size_bytes = STATIC_SHARED_LIMIT

    def _argument(self, i: int, value, param):
        """The argument's bytes as a ctypes object, after checking it against the parameter."""
        size, kind, pointee = param
        where = f"{self.name} argument {i} ({_KIND_NAMES[kind]}, {size} bytes)"
        if kind in "pc":
            if value is None:
                return ctypes.c_void_p(None)
            if not isinstance(value, np.ndarray):
                raise TypeError(f"{where}: expected a NumPy array or None, got {type(value).__name__}")
            # Vector pointers (float4*, half2*) may take arrays of their element type.
            if pointee and (pointee < value.itemsize or pointee % value.itemsize):
                raise TypeError(f"{where}: points to {pointee}-byte elements but the array has dtype {value.dtype} ({value.itemsize} bytes)")
            if kind == "p" and not value.flags.writeable:
                raise TypeError(f"{where}: the kernel may write through this pointer but the array is read-only")
            return ctypes.c_void_p(value.ctypes.data)
        if not isinstance(value, np.generic):
            raise TypeError(
                f"{where}: got a Python {type(value).__name__}; pass a NumPy scalar of exactly "
                f"{size} bytes (e.g. numpy.int32 or numpy.float32): CuPy would pass a Python int or "
                "float as 8 bytes whatever the kernel expects"
            )
        expected_kinds = {"i": "iu", "f": "f", "b": "b?", "o": "V"}[kind]
        if value.dtype.kind not in expected_kinds or value.itemsize != size:
            raise TypeError(f"{where}: got numpy.{value.dtype} ({value.itemsize} bytes)")
        # Structs (a tensor map is alignas(64)) go in storage aligned to 64 bytes, which the kernel
        # copies its parameter from.
        storage = ctypes.create_string_buffer(size + 64)
        aligned = -ctypes.addressof(storage) % 64
        ctypes.memmove(ctypes.addressof(storage) + aligned, value.tobytes(), size)
        return _Argument(storage, ctypes.addressof(storage) + aligned)

    def __call__(self, grid, block, args, *, shared_mem=0, schedule="forward", seed=0, workers=None,
                 stack_size=128 * 1024):
        grid, block = _dims("grid", grid), _dims("block", block)
        threads = block[0] * block[1] * block[2]
        if threads > 1024 or block[2] > 64:
            raise ValueError(f"block {block} has {threads} threads; at most 1024 (and z <= 64) per block")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
        shared_mem = int(shared_mem)
        if shared_mem > self.max_dynamic_shared_size_bytes:
            raise ValueError(
                f"{self.name}: {shared_mem} bytes of dynamic shared memory exceed the kernel's limit of "
                f"{self.max_dynamic_shared_size_bytes}; set max_dynamic_shared_size_bytes first (as on the GPU)"
            )
        args = tuple(args)
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        values = [self._argument(i, a, p) for i, (a, p) in enumerate(zip(args, self.params))]
        argv = (ctypes.c_void_p * max(len(values), 1))(
            *[v.address if isinstance(v, _Argument) else ctypes.addressof(v) for v in values])
        error = ctypes.create_string_buffer(4096)
        counters = _counters.active()
        counted = ctypes.create_string_buffer(1 << 16 if counters else 1)
        # Where counted accesses may go: each array argument's bytes from its lowest to its highest
        # element (a strided view spans more than its nbytes).
        spans = [byte_bounds(a) for a in args if isinstance(a, np.ndarray)]
        bases = (ctypes.c_ulonglong * max(len(spans), 1))(*[low for low, _ in spans])
        sizes = (ctypes.c_ulonglong * max(len(spans), 1))(*[high - low for low, high in spans])
        with _ONE_LAUNCH_AT_A_TIME:
            status = self._lib.emu_launch(self._index, (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block),
                                          shared_mem, argv, SCHEDULES[schedule], int(seed) & (2**64 - 1),
                                          default_workers() if workers is None else int(workers), int(stack_size),
                                          error, len(error), int(counters is not None), bases, sizes, len(spans),
                                          counted, len(counted))
        if status:
            raise EmulatorError(f"{self.name}: {error.value.decode(errors='replace')}")
        if counters is not None:
            counters.add(self.name, counted.value.decode())

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._max_shared

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int):
        if not 0 <= int(value) <= MAX_SHARED:
            raise ValueError(f"max_dynamic_shared_size_bytes must lie in [0, {MAX_SHARED}], got {value}")
        self._max_shared = int(value)


class RawModule:
    """A twin of ``cupy.RawModule`` whose kernels run on the CPU.

    ``RawModule(code=src, options=("-DFOO=1",), name_expressions=None)``; then
    ``get_function(name)`` returns a `Function`. Kernels are extern "C" functions or the given
    name expressions (template instantiations). Compilation happens at the first
    ``get_function`` and is cached on disk; modules of the same source and options load the same
    library, so, unlike CuPy's, they share their ``__device__`` globals (``get_global``) and
    static data. ``sanitize=True`` builds with AddressSanitizer,
    which must then be loaded into the process first (``LD_PRELOAD=$(g++
    -print-file-name=libasan.so)``).
    """

    def __init__(self, code: str, options=(), name_expressions=None, *, sanitize: bool = False):
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        self.code, self.options = code, tuple(options)
        self.name_expressions = tuple(name_expressions or ())
        self.sanitize = sanitize
        self._names: tuple[str, ...] = ()
        self._lib = None

    def _compile(self, names: tuple[str, ...]):
        if self.sanitize and not _asan_loaded():
            raise EmulatorError(
                "sanitize=True needs AddressSanitizer's runtime loaded before Python starts: run with "
                "LD_PRELOAD=$(g++ -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0"
            )
        self._lib = _load(str(build(self.code, self.options, names, sanitize=self.sanitize)))
        self._names = names

    def get_function(self, name: str) -> Function:
        if name not in self._names:
            # Like CuPy, compile lazily; a name not seen before joins the name expressions.
            self._compile(tuple(dict.fromkeys(self.name_expressions + self._names + (name,))))
        return Function(self._lib, self._names.index(name), name)

    def get_global(self, name: str) -> int:
        """The host address (for ctypes) of the module's global variable ``name``, which the
        source declares ``extern "C"`` with default visibility: what ``cupy.RawModule.get_global``
        gives as a device pointer. A value set there before a launch is what the kernels read,
        as long as the module is not built again for a name expression it has not seen."""
        if self._lib is None:
            self._compile(self.name_expressions)
        try:
            return ctypes.addressof(ctypes.c_char.in_dll(self._lib, name))
        except ValueError:
            raise EmulatorError(f"the module has no global variable named {name!r} (declare it extern \"C\" with "
                                f"__attribute__((visibility(\"default\"))))") from None
