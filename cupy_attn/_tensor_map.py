"""TMA tensor maps: what a kernel's cp.async.bulk.tensor copies address (kernels/ptx.cuh).

A `TensorMapSpec` holds what the CUDA driver's cuTensorMapEncodeTiled takes for a tiled map, and
checks it against the driver's rules, so that an array TMA cannot address is refused with the
reason (the caller then uses the cp.async kernels, and says so). It encodes to the 128 bytes a
kernel receives as a `const __grid_constant__ ptx::TensorMap` in two ways: through the driver
(cuda-bindings, on a GPU) or in the emulator's own layout (EmulatedTensorMap in the emulator's
emu_runtime.h), which the emulator's TMA twin reads. Dimensions are listed innermost first, as the
driver takes them.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import ml_dtypes
import numpy as np

SWIZZLES = (0, 32, 64, 128)  # bytes per swizzled line; 0: none
MAX_RANK = 5
TENSOR_MAP_BYTES = 128
# EmulatedTensorMap's layout, field for field.
_EMULATED = np.dtype({
    "names": ["address", "rank", "element_bytes", "swizzle", "oob_fill", "dims", "box", "strides", "magic"],
    "formats": ["<u8", "<u4", "<u4", "<u4", "<u4", ("<u8", 5), ("<u4", 5), ("<u8", 4), "<u8"],
    "offsets": [0, 8, 12, 16, 20, 24, 64, 88, 120],
    "itemsize": TENSOR_MAP_BYTES,
})
_EMULATED_MAGIC = 0x50414D524F534E45
# A kernel argument of 128 bytes: a NumPy structured scalar, which CuPy passes by value (as a
# custom structure) and the emulator checks against the parameter's size.
ARGUMENT = np.dtype({"names": ["opaque"], "formats": [("<u8", 16)]})
_DTYPES = {np.dtype(np.float16): "FLOAT16", np.dtype(ml_dtypes.bfloat16): "BFLOAT16", np.dtype(np.float32): "FLOAT32"}


class TensorMapError(ValueError):
    """TMA cannot describe this array or box (the message says which rule it breaks)."""


@dataclass(frozen=True)
class TensorMapSpec:
    """A tiled tensor map: `dtype`, the global array's `address`, its `dims` and byte `strides`
    (of dims[1:]), the `box` one copy moves, and the `swizzle` span of the box's lines in shared
    memory (bytes; the box's innermost extent must then be exactly that span). Elements outside
    the array load as zero, or as NaN with `oob_nan`."""

    dtype: np.dtype
    address: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: int = 0
    oob_nan: bool = False

    def __post_init__(self):
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        for name in ("dims", "strides", "box"):
            object.__setattr__(self, name, tuple(int(x) for x in getattr(self, name)))
        if self.dtype not in _DTYPES:
            raise TensorMapError(f"dtype must be float16, bfloat16 or float32, got {self.dtype}")
        rank, size = len(self.dims), self.dtype.itemsize
        if not 1 <= rank <= MAX_RANK:
            raise TensorMapError(f"dims must have 1 to {MAX_RANK} entries, got {rank}")
        if len(self.strides) != rank - 1 or len(self.box) != rank:
            raise TensorMapError(f"a rank-{rank} map takes {rank - 1} strides and {rank} box extents, got "
                                 f"{len(self.strides)} and {len(self.box)}")
        if self.address % 16:
            raise TensorMapError(f"address must be 16-byte aligned, got {self.address:#x}")
        for i, d in enumerate(self.dims):
            if not 1 <= d <= 2**31:  # CUDA 13.5's cuda.h (13.0's said 2^32)
                raise TensorMapError(f"dims[{i}] must lie in [1, 2^31], got {d}")
        for i, s in enumerate(self.strides):
            if s % 16 or not 0 < s < 2**40:
                raise TensorMapError(f"strides[{i}] (bytes, of dims[{i + 1}]) must be a positive multiple of 16 "
                                     f"below 2^40, got {s}")
        for i, b in enumerate(self.box):
            if not 1 <= b <= 256:
                raise TensorMapError(f"box[{i}] must lie in [1, 256], got {b}")
        line = self.box[0] * size
        if line % 16:
            raise TensorMapError(f"the box's innermost extent must span a multiple of 16 bytes, got {line}")
        if self.swizzle not in SWIZZLES:
            raise TensorMapError(f"swizzle must be one of {SWIZZLES} (bytes), got {self.swizzle}")
        if self.swizzle and line != self.swizzle:
            raise TensorMapError(f"a {self.swizzle}-byte swizzle needs a box line of exactly {self.swizzle} bytes "
                                 f"({self.swizzle // size} elements), got {line}")

    @classmethod
    def of_array(cls, array, box, *, swizzle: int = 0, oob_nan: bool = False) -> "TensorMapSpec":
        """The map over a whole array (NumPy or CuPy: anything with .data.ptr or .ctypes.data,
        .shape, .strides, .dtype) with `box` given in the array's own axis order (outermost first),
        as is the array; its last axis must be contiguous."""
        if array.strides[-1] != array.dtype.itemsize:
            raise TensorMapError(f"the array's last axis must be contiguous (stride {array.dtype.itemsize} bytes), "
                                 f"got stride {array.strides[-1]}")
        if len(box) != array.ndim:
            raise TensorMapError(f"box must have one extent per axis ({array.ndim}), got {len(box)}")
        address = (array.data.ptr if hasattr(array, "__cuda_array_interface__")
                   else array.__array_interface__["data"][0])
        return cls(array.dtype, address, tuple(reversed(array.shape)), tuple(reversed(array.strides[:-1])),
                   tuple(reversed(box)), swizzle, oob_nan)

    @property
    def box_bytes(self) -> int:
        return int(np.prod(self.box)) * self.dtype.itemsize

    def emulated(self) -> np.void:
        """The 128 bytes the emulator's TMA twin reads, as a kernel argument."""
        rank = len(self.dims)
        record = np.zeros((), _EMULATED)
        record["address"], record["rank"], record["element_bytes"] = self.address, rank, self.dtype.itemsize
        # The fill's bits: 0, or the dtype's NaN.
        fill = int(np.array(np.nan, self.dtype).view(f"u{self.dtype.itemsize}")) if self.oob_nan else 0
        record["swizzle"], record["oob_fill"], record["magic"] = self.swizzle, fill, _EMULATED_MAGIC
        record["dims"][:rank], record["box"][:rank] = self.dims, self.box
        record["strides"][:rank - 1] = self.strides
        return np.frombuffer(record.tobytes(), ARGUMENT)[0]

    def encoded(self) -> np.void:
        """The driver's CUtensorMap for this map, as a kernel argument (needs the CUDA driver and
        cuda-bindings). Encoded once per distinct map: the map is a function of the fields alone
        (address, geometry, swizzle, fill), so a cached one is exact, for any array at that
        address."""
        return _encode(self).copy()


@functools.lru_cache(maxsize=4096)
def checked(dtype, address: int, dims: tuple, strides: tuple, box: tuple, swizzle: int = 0,
            oob_nan: bool = False) -> TensorMapSpec:
    """TensorMapSpec(...) remembered per set of fields (hashable: tuples), so that a launch over
    the same arrays and boxes as an earlier one skips the rule checks and, through encoded(), the
    driver; a spec the rules refuse is not remembered (its TensorMapError raised each time)."""
    return TensorMapSpec(dtype, address, dims, strides, box, swizzle, oob_nan)


# cuTensorMapEncodeTiled as cuda.h declares it (CUDA 12.0 on); the enums are passed as their values.
_ENCODE_TILED = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
    ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32), ctypes.c_int,
    ctypes.c_int, ctypes.c_int, ctypes.c_int)
# Where the driver writes a map: "tensorMap address must be aligned to 64 bytes" (the driver API's
# cuTensorMapEncodeTiled); CUDA 13's cuda.h declares CUtensorMap alignas(128).
MAP_ALIGNMENT = 128


@functools.lru_cache(maxsize=1)
def _driver_encode_tiled():
    """The driver's cuTensorMapEncodeTiled, found through cuda-bindings' cuGetProcAddress and called
    with ctypes. Not cuda-bindings' own wrapper: that one has the driver write into a CUtensorMap
    Python object, which CPython's allocator places 48 bytes past a 64-byte boundary (cuda-bindings
    12.9 and 13.2, every object), against the rule above."""
    from cuda.bindings import driver

    status, *_ = driver.cuInit(0)
    if status != driver.CUresult.CUDA_SUCCESS:
        raise TensorMapError(f"cuInit failed: {status.name}")
    status, function, *_ = driver.cuGetProcAddress(b"cuTensorMapEncodeTiled", 12000,
                                                   driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT)
    if status != driver.CUresult.CUDA_SUCCESS or not function:
        raise TensorMapError(f"the driver has no cuTensorMapEncodeTiled: {status.name}")
    return _ENCODE_TILED(int(function))


@functools.lru_cache(maxsize=4096)
def _encode(spec: TensorMapSpec) -> np.void:
    """cuTensorMapEncodeTiled of spec (TensorMapSpec.encoded), remembered per spec, written into
    MAP_ALIGNMENT-aligned memory and returned as a kernel argument."""
    from cuda.bindings import driver

    rank = len(spec.dims)
    swizzle = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}[spec.swizzle]
    fill = "NAN_REQUEST_ZERO_FMA" if spec.oob_nan else "NONE"
    storage = np.zeros(TENSOR_MAP_BYTES + MAP_ALIGNMENT, np.uint8)
    offset = -storage.ctypes.data % MAP_ALIGNMENT
    status = _driver_encode_tiled()(
        storage.ctypes.data + offset,
        int(getattr(driver.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{_DTYPES[spec.dtype]}")), rank, spec.address,
        (ctypes.c_uint64 * rank)(*spec.dims), (ctypes.c_uint64 * (rank - 1))(*spec.strides),
        (ctypes.c_uint32 * rank)(*spec.box), (ctypes.c_uint32 * rank)(*[1] * rank),
        int(driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE),
        int(getattr(driver.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{swizzle}")),
        int(driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B),
        int(getattr(driver.CUtensorMapFloatOOBfill, f"CU_TENSOR_MAP_FLOAT_OOB_FILL_{fill}")))
    if status != int(driver.CUresult.CUDA_SUCCESS):
        raise TensorMapError(f"cuTensorMapEncodeTiled refused {spec}: {driver.CUresult(status).name}")
    return np.frombuffer(storage[offset:offset + TENSOR_MAP_BYTES].tobytes(), ARGUMENT)[0]
