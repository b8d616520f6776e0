"""Running kernels/*.cu: "cuda" on CuPy arrays, "emulator" on NumPy arrays, one launcher for both.

The launcher turns a validated `Problem` into a grid, a block, the dynamic shared memory size and
explicitly typed scalar arguments (numpy.int32 / int64 / float32: a Python int would be passed as
8 bytes whatever the kernel expects).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import os
import re

import numpy as np

from . import _compile, _config, _mods_source, _numpy_backend, _schedule, _tensor_map
from ._arrays import whole_element_strides
from ._problem import Problem
from ._tensor_map import TensorMapError

log = logging.getLogger("cupy_attn")

I32, I64, F32 = np.int32, np.int64, np.float32

# The emulator's thread schedule between synchronisation points; tests vary it.
EMULATOR_SCHEDULE = "forward"
# Fill outputs with NaN before launching, so elements a kernel fails to write show; tests set it.
POISON_OUTPUTS = False
# The compute capability kernels are chosen for. Test hooks, which win over the environment:
# the one the emulator stands in for (90 selects the Hopper wgmma kernels; None: the environment,
# else 80), and one to use instead of the GPU's default (GPU tests set 90 to run the wgmma kernels
# on an sm_90 device, which runs the mma.sync ones by default: _config.DEFAULT_KERNELS_FOR).
EMULATOR_COMPUTE_CAPABILITY = None
CUDA_COMPUTE_CAPABILITY = None
# Users choose the same through the environment, e.g. 90 for the wgmma kernels on an H100.
CAPABILITY_VARIABLE = "CUPY_ATTN_COMPUTE_CAPABILITY"
# The L2 the emulator sizes the tensor-core kernels' sections of (batch entry, head) pairs for
# (_schedule.heads_per_section): an H100's. Tests shrink it to split small problems into sections.
EMULATOR_L2_BYTES = 50 * 2**20
# The dynamic shared memory a block may opt in to on the GPU the emulator stands in for (an A100's:
# the mma.sync dK/dV at D = 128 then takes its 128-key tile; tests set it to
# _config.LEAST_SHARED_LIMIT for the tile of sm_86, sm_89 and sm_120).
EMULATOR_SHARED_LIMIT = 163 * 1024
# The SMs the emulator stands in for, each running one block of a persistent kernel (the wgmma
# forward): few, so that a test's blocks claim work tiles past their first. Tests vary it.
EMULATOR_SMS = 3

# Within compile_only(): the kernels a call would launch, built and recorded instead of run.
_COMPILE_ONLY = contextvars.ContextVar("cupy_attn_compile_only", default=None)

_CAUSAL = {None: 0, "bottom_right": 1, "top_left": 2}
# How the dK/dV kernels write dK and dV (attn::DkdvOut, kernels/backward_stats.cuh): in the input
# type per query head (no GQA group), float32 per query head (each group summed after), float32
# per kv head that the group's heads add to (reductions: the wgmma kernel's TMA ones, the mma.sync
# kernel's red.global.add, the CUDA-core kernel's atomicAdd).
DKDV_INPUT_TYPE, DKDV_FLOAT, DKDV_FLOAT_ADDED = 0, 1, 2
# The fewest query rows a tile of the tensor-core forwards or dQ kernel holds: the grid's y axis
# counts their tiles (_query_grid).
_QUERY_TILE_ROWS = min([t.block_m for t in _config.TENSOR_CORE_TILES + _config.HOPPER_TILES]
                       + [t.dq_block_m for t in _config.DQ_TENSOR_CORE_TILES])
# The fewest keys a tile of the sectioned dK/dV kernels holds: the grid's y axis counts their tiles
# (_key_grid).
_KEY_TILE_KEYS = min(t.block_n for t in _config.TENSOR_CORE_BACKWARD_TILES + _config.HOPPER_BACKWARD_TILES
                     if t.sectioned)


# The largest seq_q + seq_k the kernels take: 2^31 less a margin for rounding up to whole tiles
# (at most 176 keys or 128 rows) and for a tile's rows past its last valid one.
_ROW_LIMIT = 2**31 - 1024


def check_supported(problem: Problem, target: str) -> None:
    if problem.dtype == np.float64:
        raise TypeError(f"float64 inputs run on the NumPy backend only; backend {target!r} takes float16, bfloat16 or float32")
    _config.forward_tile(problem.head_dim, problem.head_dim_v)  # raises for head dims above MAX_HEAD_DIM
    if problem.heads > _schedule.GRID_YZ_LIMIT or problem.batch > _schedule.GRID_YZ_LIMIT:
        raise ValueError(f"at most {_schedule.GRID_YZ_LIMIT} heads and batch entries per call, got H = {problem.heads}, "
                         f"B = {problem.batch}")
    # Checked before an append to a KV cache writes anything. The kernels' band arithmetic adds a
    # row, its diagonal's offset (each below seq_q + seq_k) and, with a window, a side (clamped to
    # seq_q + seq_k: _problem._window), and rounds a length up to whole tiles, all in 32 bits.
    reach = problem.seq_q + problem.seq_k
    if (1 if problem.window is None else 2) * reach > _ROW_LIMIT:
        limit = "2^31 - 1024" if problem.window is None else "2^30 - 512 with a window"
        raise ValueError(f"the kernels index rows with 32-bit integers: seq_q + seq_k must be at most {limit}, "
                         f"got {reach}")
    if problem.packing is not None:
        for name, n in {"total_q": problem.packing.total_q, "total_k": problem.packing.total_k}.items():
            if n >= 2**31:
                raise ValueError(f"the kernels index rows with 32-bit integers: {name} must be below 2^31, got {n}")
    if problem.heads * problem.batch >= 2**31:  # the sectioned grids' pair index (kernels/block_info.cuh)
        raise ValueError(f"fewer than 2^31 (batch entry, head) pairs per call, got H = {problem.heads}, B = {problem.batch}")
    if problem.dtype in _config.TENSOR_CORE_DTYPES and _blocks(problem.seq_q, _QUERY_TILE_ROWS) > _schedule.GRID_YZ_LIMIT:
        # the tensor-core forwards' and dQ's grid (_query_grid), checked before any kernel runs
        raise ValueError(f"float16/bfloat16 calls take at most {_schedule.GRID_YZ_LIMIT} query tiles of "
                         f"{_QUERY_TILE_ROWS} rows (seq_q up to {_schedule.GRID_YZ_LIMIT * _QUERY_TILE_ROWS}), "
                         f"got seq_q = {problem.seq_q}")


def _kernel_addressable(xp, x):
    """x, or a contiguous copy of it where the kernels cannot address it: they need a unit stride
    on the last axis and byte strides of whole elements (a structured array's field may have
    neither)."""
    unit_last = x.shape[-1] <= 1 or x.strides[-1] == x.itemsize
    return x if unit_last and whole_element_strides(x) else xp.ascontiguousarray(x)


def _bhs_strides(problem: Problem, x) -> list:
    """(batch, head, row) strides in elements, whatever the layout. A packed (total, H, D) tensor
    passes its row stride as the batch stride: the kernels multiply it by each sequence's first
    row (kernels/block_info.cuh)."""
    s = [st // x.itemsize for st in x.strides]
    if problem.packing is not None:
        return [I64(s[0]), I64(s[1]), I64(s[0])]
    return [I64(s[0]), I64(s[1]), I64(s[2])] if problem.layout == "bhsd" else [I64(s[0]), I64(s[2]), I64(s[1])]


def _constant(xp, dtype, length: int = 1, value: int = 0, *, writable: bool = False):
    """A read-only array of `length` entries of `value`: the arguments a launch takes but does not
    use (no mask, ALiBi, sinks or packing) and the lengths of an unpadded batch. Made once per
    device and kept (_constants), instead of an allocation and a fill kernel per argument and
    launch (6 per forward launch on CuPy arrays); the kernels only read them (const pointers).
    With `writable`, an output argument the launch does not write (the emulator refuses a
    read-only array behind a pointer the kernel may write through)."""
    return _constants(xp, None if xp is np else xp.cuda.Device().id, np.dtype(dtype), length, value, writable)


@functools.lru_cache(maxsize=256)
def _constants(xp, device, dtype: np.dtype, length: int, value: int, writable: bool):
    array = xp.full(length, value, dtype=dtype)
    if xp is np and not writable:
        array.flags.writeable = False
    return array


def _packing_args(problem: Problem) -> tuple:
    """q_starts, kv_starts, packed, total_q, total_k of ATTN_PARAMS."""
    pack = problem.packing
    if pack is None:
        unused = _constant(problem.xp, np.int32)
        return unused, unused, I32(0), I32(0), I32(0)
    return pack.cu_seqlens_q[:-1], pack.cu_seqlens_k[:-1], I32(1), I32(pack.total_q), I32(pack.total_k)


def _mask_arguments(problem: Problem):
    """(mask array, its batch, head and query strides in elements with 0 on broadcast axes, kind)
    for the kernel, which reads each mask row's keys contiguously (kernels/mask.cuh)."""
    xp, mask = problem.xp, problem.mask
    if mask is None:
        return _constant(xp, np.uint8), [I64(0)] * 3, I32(0)
    if mask.dtype == np.bool_:
        kind = 1
    else:
        kind = 2
        with np.errstate(over="ignore"):  # a float64 mask below float32's range: -inf, which masks
            mask = mask.astype(np.float32, copy=False)  # keeps the mask's own (broadcastable) shape
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    if not _keys_contiguous(mask, problem.seq_k):
        mask = _copy_keys_contiguous(xp, mask, problem.seq_k)
    strides = [I64(0 if n == 1 else st // mask.itemsize) for n, st in zip(mask.shape[:3], mask.strides[:3])]
    return mask, strides, I32(kind)


def _keys_contiguous(mask, seq_k: int) -> bool:
    """Whether the kernels can read mask (4-d) in place: seq_k keys one element apart, and every
    other stride a whole number of elements (a structured array's field may step by any number of
    bytes)."""
    return mask.shape[-1] == seq_k and (seq_k <= 1 or mask.strides[-1] == mask.itemsize) \
        and whole_element_strides(mask)


def _copy_keys_contiguous(xp, mask, seq_k: int):
    """mask copied with its keys contiguous: a mask broadcast over the keys, or one whose keys are
    strided (a transposed view). The other axes keep their own sizes (those broadcast by stride 0
    are taken once), so the copy is the mask's own rows, seq_k keys each."""
    own = mask[tuple(slice(0, 1) if st == 0 else slice(None) for st in mask.strides[:3])]
    return xp.ascontiguousarray(xp.broadcast_to(own, own.shape[:3] + (seq_k,)))


def _lengths(problem: Problem, lengths, full: int):
    xp = problem.xp
    if lengths is None:
        return _constant(xp, np.int32, problem.batch, full)
    return xp.ascontiguousarray(lengths, dtype=np.int32)


def score_features(problem: Problem) -> int:
    """The score features a call's modules are built for (kernels/mask.cuh): exactly those it uses.
    Dropout counts when it drops anything (a threshold above 0: p ≥ 2⁻³²)."""
    p, c = problem, _config
    bits = (c.SOFTCAP if p.softcap is not None else 0) | (c.ALIBI if p.alibi_slopes is not None else 0) \
        | (c.DROPOUT if p.dropout is not None and p.dropout.threshold > 0 else 0)
    if p.mask is not None:
        bits |= c.BOOL_MASK if p.mask.dtype == np.bool_ else c.FLOAT_MASK
    return bits


def _module(problem: Problem) -> dict:
    """How the kernels a call launches are built: its score features, its batch layout (padded, or
    packed for attention_varlen; kernels/block_info.cuh) and its score_mod and mask_mod."""
    p = problem
    mods = None if p.score_mod is None and p.mask_mod is None else \
        _mods_source.mod_source(p.score_mod, p.mask_mod, p.block_mask is not None)
    return dict(features=score_features(p), packed=p.packing is not None, mods=mods)


def _launch(target: str, filename: str, name: str, grid, args, shared_bytes: int = 0, *, threads: int = _config.THREADS,
            features: int = _config.PLAIN_FEATURES, packed: bool = False, mods=None):
    if 0 in grid:
        return  # nothing to compute (an empty batch, head or sequence axis)
    if target == "cuda" and shared_bytes > 48 * 1024:
        _check_shared_memory(shared_bytes, name)
    fn = _compile.function(target, filename, name, features=features, packed=packed, mods=mods)
    built = _COMPILE_ONLY.get()
    if built is not None:
        built.append(name)
        return
    if shared_bytes > 48 * 1024 and fn.max_dynamic_shared_size_bytes < shared_bytes:
        fn.max_dynamic_shared_size_bytes = shared_bytes
    if target == "cuda" and threads == _config.WS_THREADS:
        check_register_split(fn.num_regs, name)
    block = (threads,)
    if target == "emulator":
        fn(grid, block, args, shared_mem=shared_bytes, schedule=EMULATOR_SCHEDULE)
    else:
        fn(grid, block, args, shared_mem=shared_bytes)


def check_register_split(registers: int, name: str) -> None:
    """A warp-specialised kernel hangs unless it starts with exactly the registers its setmaxnreg
    split hands on (_config.WS_LAUNCH_REGISTERS): refuse it before the launch. NVRTC 13.5 builds
    every one so (tests/test_compile_report.py); this guards against the NVRTC CuPy loads on a
    GPU doing otherwise."""
    if registers != _config.WS_LAUNCH_REGISTERS:
        raise RuntimeError(
            f"{name} was built with {registers} registers per thread, but its setmaxnreg split needs exactly "
            f"{_config.WS_LAUNCH_REGISTERS} (its consumers would wait forever for the rest): this NVRTC builds the "
            "wgmma kernels differently from the one cupy_attn is tested with; CUPY_ATTN_COMPUTE_CAPABILITY=80 runs "
            "the mma.sync kernels instead")


@contextlib.contextmanager
def compile_only():
    """Build the kernels the calls inside would launch, without launching them (their outputs are
    left unwritten); yields the list of kernel names built."""
    built = []
    token = _COMPILE_ONLY.set(built)
    try:
        yield built
    finally:
        _COMPILE_ONLY.reset(token)


def _check_shared_memory(shared_bytes: int, name: str) -> None:
    """The WIDE tiles (head dims above 256) need more shared memory than some GPUs give a block."""
    import cupy

    device = cupy.cuda.Device()
    limit = shared_limit("cuda")
    if shared_bytes > limit:
        raise ValueError(f"{name} needs {shared_bytes // 1024} KB of shared memory per block, but this GPU (compute "
                         f"capability {device.compute_capability}) offers {limit // 1024} KB: head dims above "
                         f"{_config.NARROW_HEAD_DIM} need one with at least {_config.WIDE_SHARED_LIMIT // 1024} KB "
                         "(A100, H100, H200); use backend='numpy' here")


def shared_limit(target: str) -> int:
    """The dynamic shared memory a block may opt in to (bytes): the current GPU's, or on the
    emulator EMULATOR_SHARED_LIMIT."""
    if target == "emulator":
        return EMULATOR_SHARED_LIMIT
    import cupy

    return _device_attribute(cupy.cuda.Device().id, "MaxSharedMemoryPerBlockOptin")


@functools.lru_cache(maxsize=None)
def _device_attribute(device: int, name: str) -> int:
    """CuPy's attribute `name` of ``device`` (e.g. "MaxSharedMemoryPerBlockOptin": the dynamic
    shared memory a block may opt in to, in bytes; "MultiProcessorCount"), asked once."""
    import cupy

    return cupy.cuda.Device(device).attributes[name]


def _empty(xp, shape, dtype):
    """An output buffer; NaN-filled when POISON_OUTPUTS so unwritten elements show."""
    return xp.full(shape, np.nan, dtype=dtype) if POISON_OUTPUTS else xp.empty(shape, dtype=dtype)


def resident_blocks(target: str) -> int:
    """The blocks of a persistent kernel (one block per SM at 384 threads): the GPU's SM count,
    or EMULATOR_SMS on the emulator."""
    if target == "emulator":
        return EMULATOR_SMS
    import cupy

    return _device_attribute(cupy.cuda.Device().id, "MultiProcessorCount")


def _heads_magic(heads: int) -> tuple:
    """heads_magic and heads_shift of ATTN_PARAMS: query_block_place's and key_block_place's
    division by the head count."""
    magic, shift = _schedule.division_magic(max(heads, 1))
    return np.uint32(magic), I32(shift)


def _l2_bytes(target: str) -> int:
    if target == "emulator":
        return EMULATOR_L2_BYTES
    import cupy

    return _device_l2_bytes(cupy.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _device_l2_bytes(device: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device)["l2CacheSize"])


def _sectioned_grid(problem: Problem, target: str, tiles: int, shared_bytes: int, group: int) -> tuple[int, int, int]:
    """The grid of a kernel whose blocks each take a tile of one (batch entry, head) pair, in
    sections of pairs whose shared rows (shared_bytes each, groups of `group` heads) fit the L2
    together (kernels/block_info.cuh, query_block_place and key_block_place; _schedule)."""
    pairs = problem.heads * problem.batch
    section = _schedule.heads_per_section(shared_bytes, pairs, _l2_bytes(target), group)
    return _schedule.sectioned_grid(tiles, pairs, section)


def _query_grid(problem: Problem, target: str, block_m: int) -> tuple[int, int, int]:
    """The tensor-core forwards' and dQ's grid: query tiles of block_m rows (within the grid's
    limit: check_supported), a pair's blocks sharing its K and V (one kv head's per GQA group)."""
    p = problem
    return _sectioned_grid(p, target, _blocks(p.seq_q, block_m), p.seq_k * (p.head_dim + p.head_dim_v) * p.dtype.itemsize,
                           p.groups)


def _key_grid(problem: Problem, target: str, block_n: int) -> tuple[int, int, int]:
    """The tensor-core dK/dV kernels' grid up to D = 128: key tiles of block_n keys (within the
    grid's limit: backward checks), a pair's blocks sharing its Q, dO, lse and delta."""
    p = problem
    return _sectioned_grid(p, target, _blocks(p.seq_k, block_n),
                           p.seq_q * ((p.head_dim + p.head_dim_v) * p.dtype.itemsize + 8), 1)


def _common_args(problem: Problem, q, k, v, fourth, tiles: tuple | None = None) -> tuple:
    """ATTN_PARAMS (kernels/block_info.cuh): everything after a kernel's own pointers. ``fourth``
    is out in the forward and dout in the backward; ``tiles`` the kernel's (query rows, keys) per
    tile, for a block mask's ranges (kernels that never take one, decoding, leave it None)."""
    p = problem
    mask, mask_strides, mask_kind = _mask_arguments(p)
    slopes = _constant(p.xp, np.float32) if p.alibi_slopes is None else p.xp.ascontiguousarray(p.alibi_slopes, dtype=np.float32)
    sinks = _constant(p.xp, np.float32) if p.sinks is None else p.xp.ascontiguousarray(p.sinks, dtype=np.float32)
    left, right = p.window if p.window is not None else (None, None)  # clamped to Sq + Sk (_problem._window)
    drop = p.dropout
    dropout = ((np.uint64(0), np.uint32(0), np.uint32(0), F32(1.0)) if drop is None else
               (np.uint64(drop.seed), np.uint32(drop.offset), np.uint32(drop.threshold), F32(drop.scale)))
    return (
        _lengths(p, p.q_lengths, p.seq_q), _lengths(p, p.kv_lengths, p.seq_k), *_packing_args(p), slopes, sinks, mask,
        I32(p.heads), *_heads_magic(p.heads), I32(p.groups), I32(p.seq_q), I32(p.seq_k), I32(p.head_dim),
        I32(p.head_dim_v),
        *_bhs_strides(p, q), *_bhs_strides(p, k), *_bhs_strides(p, v), *_bhs_strides(p, fourth),
        *mask_strides, mask_kind,
        I32(_CAUSAL[p.causal]), I32(-1 if left is None else left), I32(-1 if right is None else right),
        I32(p.alibi_slopes is not None), I32(p.sinks is not None), F32(p.scale), F32(p.softcap or 0.0), *dropout,
    ) + (() if p.score_mod is None and p.mask_mod is None else (_mods_source.mod_words(p.xp, p.score_mod, p.mask_mod),)) \
        + (() if tiles is None else _block_args(p, *tiles))


def _block_args(problem: Problem, block_m: int, block_n: int) -> tuple:
    """A block mask's tables for a kernel's tile sizes (the next non-empty tile along each axis, the
    full tiles), and the tile counts."""
    if problem.block_mask is None:
        return ()
    return (*problem.block_mask.kernel_tables(block_m, block_n), I32(_blocks(problem.seq_q, block_m)),
            I32(_blocks(problem.seq_k, block_n)))


def _blocks(n: int, per_block: int) -> int:
    return (n + per_block - 1) // per_block


def _requested_capability():
    """CUPY_ATTN_COMPUTE_CAPABILITY as an int (e.g. "80"), or None when unset."""
    value = os.environ.get(CAPABILITY_VARIABLE)
    if value is None or value == "":
        return None
    if not value.isdigit() or int(value) < 80:
        raise ValueError(f"{CAPABILITY_VARIABLE} must be a compute capability of at least 8.0 written without the "
                         f"dot (80, 86, 90, ...), got {value!r}")
    return int(value)


def compute_capability(target: str) -> int:
    """The compute capability kernels are chosen for: the current GPU's, or the one whose kernels
    measured faster on it (_config.DEFAULT_KERNELS_FOR: 80 on H100/H200), unless
    CUPY_ATTN_COMPUTE_CAPABILITY asks for another the GPU can run; for the emulator, the GPU it
    stands in for (80 unless the variable says otherwise)."""
    requested = _requested_capability()
    if target == "emulator":
        if EMULATOR_COMPUTE_CAPABILITY is not None:
            return EMULATOR_COMPUTE_CAPABILITY
        return 80 if requested is None else requested
    if CUDA_COMPUTE_CAPABILITY is not None:
        return CUDA_COMPUTE_CAPABILITY
    import cupy

    device = int(cupy.cuda.Device().compute_capability)
    if requested is None:
        return _config.DEFAULT_KERNELS_FOR.get(device, device)
    if requested > device or (requested == 90 and device != 90):  # sm_90a code runs on 9.0 only
        raise ValueError(f"{CAPABILITY_VARIABLE}={requested} asks for kernels this GPU (compute capability "
                         f"{device // 10}.{device % 10}) cannot run; use {device} or an older one such as 80")
    return requested


_SAID = set()


def _say_once(message: str) -> None:
    """A fallback the caller did not ask for, logged as a warning the first time it happens: the
    first time for each reason, whatever address a refusal names (a training loop's arrays come
    at ever new ones)."""
    reason = re.sub(r"0x[0-9a-f]+", "0x…", message)
    if reason not in _SAID:
        _SAID.add(reason)
        log.warning(message)


def _pointer(x) -> int:
    return x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr


def _allocation_offset(x) -> int:
    """Where x starts as TMA's alignment rules see it: a device array's address (allocations are
    at least 256-byte aligned, so only a view's offset shows); for the emulator, a NumPy array's
    offset into the array that holds its memory, which stands in for such an allocation (NumPy's
    own are only 16-byte aligned, and a kernel must not choose differently on the emulator than
    it would on a GPU for the same view). Memory that no NumPy array owns (a torch tensor's, a
    buffer's) counts from the first array over it."""
    if not isinstance(x, np.ndarray):
        return _pointer(x)
    owner = x  # through the bases that are arrays (an as_strided view's is an interface object)
    while getattr(owner, "base", None) is not None and hasattr(owner.base, "__array_interface__"):
        owner = owner.base
    return _pointer(x) - owner.__array_interface__["data"][0]


PACKED_REFUSAL = "a packed (varlen) batch: a box would reach into the next sequence"


def _say_tma_refused(pass_: str, why_not: str) -> None:
    """The mma.sync kernels, which read and write any strides, run a pass (forward, backward) in
    place of the wgmma ones, whose TMA cannot address the call's operands (`why_not`; empty where
    there is nothing to launch, which needs no word)."""
    if why_not:
        _say_once(f"the wgmma {pass_} needs TMA, which cannot address this call's operands ({why_not}): "
                  f"the mma.sync {pass_} runs instead")


def _mma_sync_backward(problem: Problem, why_not: str, limit: int):
    """The tile of the mma.sync backward in place of the wgmma one (_say_tma_refused)."""
    p = problem
    _say_tma_refused("backward", why_not)
    return _config.backward_tile(p.head_dim, p.head_dim_v, p.dtype, 80, limit)


def tensor_maps(problem: Problem, tile, target: str, **operands):
    """The wgmma kernels' TMA maps of q, k, v, out and dout, and of the backward's dk and dv
    (`_per_head` buffers) (dims: head dims, rows, heads, batch; boxes of one 128-byte line of dims
    x tile.tma_rows(name) rows, 128-byte swizzle) as kernel arguments, in the order given, or the
    reason TMA cannot address one of them."""
    p = problem
    if p.packing is not None:
        return None, PACKED_REFUSAL
    shapes = {"q": (p.head_dim, p.seq_q, p.heads), "k": (p.head_dim, p.seq_k, p.kv_heads),
              "v": (p.head_dim_v, p.seq_k, p.kv_heads), "out": (p.head_dim_v, p.seq_q, p.heads),
              "dout": (p.head_dim_v, p.seq_q, p.heads)}
    maps = []
    for name, x in operands.items():
        if name in ("dk", "dv"):  # (B, heads, Sk, dims) views (_per_head), of any strides
            heads, rows, head_dim = (int(n) for n in x.shape[1:])
            batch, head, row = (int(s) for s in x.strides[:3])
        else:
            head_dim, rows, heads = shapes[name]
            batch, head, row = (int(s) * x.itemsize for s in _bhs_strides(p, x))
        # An axis of one entry is never stepped along: its stride becomes the packed one (the inner
        # axes' extent, a multiple of 16 bytes), which the driver takes whatever the array's is.
        strides, extent = [], -(-head_dim * x.itemsize // 16) * 16
        for stride, n in ((row, rows), (head, heads), (batch, p.batch)):
            strides.append(stride if n > 1 else extent)
            extent = strides[-1] * n
        # The CUDA C++ Programming Guide's table of swizzle modes: a swizzled map's global memory
        # 128-byte aligned (the driver's encoding checks 16 bytes alone).
        past = _allocation_offset(x) % _config.TMA_LINE_BYTES
        if past:
            return None, (f"{name}: a swizzled TMA map needs its array 128-byte aligned, and it starts {past} bytes "
                          "past a multiple of 128")
        try:
            spec = _tensor_map.checked(x.dtype, _pointer(x), (head_dim, rows, heads, p.batch), tuple(strides),
                                       (_config.TMA_LINE_BYTES // x.itemsize, tile.tma_rows(name), 1, 1),
                                       _config.TMA_LINE_BYTES)
        except TensorMapError as error:
            return None, f"{name}: {error}"
        maps.append(spec)
    if target == "emulator":
        return [m.emulated() for m in maps], None
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return None, "cuda-bindings is not installed (pip install cuda-bindings; the cuda12/cuda13 extras have it)"
    try:
        return [m.encoded() for m in maps], None
    except TensorMapError as error:  # a rule of the driver's that TensorMapSpec does not check
        return None, str(error)


def _output(problem: Problem, tma: bool):
    """The forward's out: contiguous, or for the TMA store (whose rows must be a multiple of 16
    bytes apart) rows padded to 8 elements where Dv is not a multiple of 8: a view of wider rows,
    which the caller gets as a contiguous copy."""
    p = problem
    padded = -(-p.head_dim_v // 8) * 8 if tma else p.head_dim_v
    if padded == p.head_dim_v:
        return _empty(p.xp, p.out_shape, p.dtype)
    return _empty(p.xp, p.out_shape[:-1] + (padded,), p.dtype)[..., :p.head_dim_v]


def forward(problem: Problem, q, k, v, *, target: str):
    p, xp = problem, problem.xp
    check_supported(p, target)
    if not p.heads:  # no query heads, no rows: nothing to launch (the grids take whole GQA groups)
        return xp.zeros(p.out_shape, p.dtype), xp.zeros(p.lse_shape, np.float32)
    module = _module(p)
    tile = _config.forward_tile(p.head_dim, p.head_dim_v, p.dtype, compute_capability(target), module["features"],
                                mods=module["mods"] is not None, diagonal=p.causal is not None or p.window is not None)
    q, k, v = (_kernel_addressable(xp, x) for x in (q, k, v))
    hopper = isinstance(tile, _config.HopperTile)
    out = _output(p, hopper and p.packing is None)  # a packed batch: no TMA (tensor_maps)
    lse = _empty(xp, p.lse_shape, np.float32)
    maps = ()
    if hopper and 0 not in (p.seq_q, p.heads, p.batch):  # else nothing is launched
        # No keys: TMA refuses an axis of no entries, and the mma.sync forward writes the dead rows.
        maps, why_not = tensor_maps(p, tile, target, q=q, k=k, v=v, out=out) if p.seq_k else (None, "")
        if maps is None:
            _say_tma_refused("forward", why_not)
            tile = _config.forward_tile(p.head_dim, p.head_dim_v, p.dtype, 80, module["features"],
                                        mods=module["mods"] is not None)
            maps = ()
            if not out.flags.c_contiguous:  # rows padded for the TMA store: the mma.sync kernel's are not
                out = _output(p, False)
    # The tensor-core forwards start their blocks in the order _query_grid shapes; the CUDA-core
    # one keeps the grid (query tiles, heads, batch entries) (kernels/block_info.cuh).
    grid = _query_grid(p, target, tile.block_m) if tile.sectioned else (_blocks(p.seq_q, tile.block_m), p.heads, p.batch)
    work = ()
    if isinstance(tile, _config.HopperTile):  # that grid's blocks as work tiles (WorkTiles)
        pairs, tiles, sections = grid
        total = pairs * tiles * sections  # < 2^31 (an int in the kernel): q holds 128 rows per work tile
        # The persistent build's blocks claim the tiles past their first on a counter zeroed for
        # this launch alone (a Hopper tile takes Dv whole: one launch), not one kept per device:
        # another call, on another stream, may run at the same time.
        claims = xp.zeros(1, np.uint32)
        work = (I32(pairs), I32(tiles), I32(total), claims)
        grid = (min(total, resident_blocks(target)) if tile.persistent else total, 1, 1)
    # A tile computing fewer value dims per launch than Dv runs once per slice of v and out (views:
    # same strides, shifted base), each launch writing the same lse.
    width = getattr(tile, "value_dim", p.head_dim_v)
    for d0 in range(0, p.head_dim_v, width):
        d1 = min(d0 + width, p.head_dim_v)
        part = p if (d0, d1) == (0, p.head_dim_v) else dataclasses.replace(p, head_dim_v=d1 - d0)
        v_part, out_part = v[..., d0:d1], out[..., d0:d1]
        # The mma.sync kernels take a `vectorised` flag after lse; the fp32 and TMA ones do not.
        flags = (_vector_flags(q, k, v_part),) if isinstance(tile, _config.TensorCoreTile) else ()
        args = (q, k, v_part, out_part, lse, *flags, *maps, *work,
                *_common_args(part, q, k, v_part, out_part, (tile.block_m, tile.block_n)))
        _launch(target, tile.filename, tile.name_expression(p.dtype), grid, args, tile.shared_bytes,
                threads=getattr(tile, "threads", _config.THREADS), **module)
    return (out if out.flags.c_contiguous else xp.ascontiguousarray(out)), lse


def _vector_flags(*arrays):
    """The tensor-core kernels' `vectorised` argument: bit i set when arrays[i] (q, k, v, dout)
    can be copied in 16-byte chunks."""
    return I32(sum(1 << i for i, x in enumerate(arrays) if _copies_in_16_bytes(x)))


def _copies_in_16_bytes(x) -> bool:
    """Whether every row of x starts 16-byte aligned, so a kernel may copy 16-byte chunks (8
    elements of 16 bits, 4 of fp32) with cp.async (else it copies element by element)."""
    return _pointer(x) % 16 == 0 and all(st % 16 == 0 for st in x.strides[:-1])


def _per_head(problem: Problem, rows: int, dims: int, zeroed: bool = False, dtype=np.float32,
              callers_layout: bool = False, heads: int | None = None):
    """A buffer of one row per (query head, row): (B, H, rows, dims), or (H, total rows, dims) for
    a packed batch (kernels/block_info.cuh, HeadView.stats, .key_stats and, per kv head,
    .kv_key_stats, as the atomics' dQ and the CUDA-core kernels address it); float32 unless told;
    `heads` of them (the query heads unless told). With callers_layout, a bshd call's buffer is a
    (B, H, rows, dims) view of (B, rows, H, dims) storage, and a packed batch's an (H, rows, dims)
    view of (rows, H, dims) storage, which _from_per_head hands back (or converts) without a
    transposing copy (for kernels that write through strides: _gradient_rows, the TMA store's
    maps)."""
    p, xp = problem, problem.xp
    heads = p.heads if heads is None else heads
    if p.packing is not None:
        shape, order = ((rows, heads, dims), (1, 0, 2)) if callers_layout else ((heads, rows, dims), (0, 1, 2))
    else:
        bshd = callers_layout and p.layout == "bshd"
        shape, order = ((p.batch, rows, heads, dims), (0, 2, 1, 3)) if bshd else ((p.batch, heads, rows, dims),
                                                                                 (0, 1, 2, 3))
    buffer = xp.zeros(shape, dtype) if zeroed else _empty(xp, shape, dtype)
    return buffer.transpose(order)


def _gradient_rows(problem: Problem, view) -> list:
    """A `_per_head` view's (batch, head, row) strides in elements, as the tensor-core backward
    kernels take them (kernels/tc_backward.cuh, GradientRows): a packed batch's row stride as its
    batch stride, which the kernels multiply by a sequence's first row."""
    s = [st // view.itemsize for st in view.strides]
    return [I64(s[1]), I64(s[0]), I64(s[1])] if problem.packing is not None else [I64(x) for x in s[:3]]


def _from_per_head(problem: Problem, x, dtype, *, sum_groups: bool = False, scale: float | None = None):
    """A per-head buffer (`_per_head`, float32 or the input type; with sum_groups, summed over
    each GQA group to one kv head; with scale, multiplied by it in float32 on the way) -> the
    caller's layout and dtype, contiguous (the buffer itself where it already is and nothing is
    scaled)."""
    p, xp = problem, problem.xp
    if sum_groups and p.groups > 1:
        grouped = x.shape[:-3] + (p.kv_heads, p.groups) + x.shape[-2:]
        x = x.reshape(grouped).sum(axis=-3)
    if p.packing is not None:
        x = x.transpose(1, 0, 2)
    elif p.layout == "bshd":
        x = x.transpose(0, 2, 1, 3)
    if scale is None:
        # Order "C": converted and laid out in one pass (astype's default, "K", keeps a transposed
        # view's memory order, which another pass then made contiguous).
        return x.astype(dtype, order="C", copy=False)
    # One pass: the product in float32, rounded once to dtype as it is stored. A value past the
    # type's range becomes inf, as in astype and the kernels' own stores, without NumPy's warning.
    out = xp.empty(x.shape, dtype=dtype)
    with np.errstate(over="ignore"):
        xp.multiply(x, np.float32(scale), out=out, casting="same_kind")
    return out


def row_deltas(problem: Problem, dout, out, *, target: str):
    """delta = rowsum(dO ∘ O) in float32, one per lse entry (the backward's preprocess kernel), from
    dout and out in the call's layout (any row strides, the last axis contiguous); a packed batch
    is one sequence of total_q rows here."""
    p = problem
    delta = _empty(p.xp, p.lse_shape, np.float32)
    rows_q, batches = (p.packing.total_q, 1) if p.packing is not None else (p.seq_q, p.batch)
    _launch(target, "attention_bwd.cu", _config.preprocess_name(p.dtype),
            (_blocks(rows_q, _config.PREPROCESS_ROWS_PER_BLOCK), p.heads, batches),
            (dout, out, delta, I32(p.heads), I32(rows_q), I32(p.head_dim_v), *_bhs_strides(p, dout),
             *_bhs_strides(p, out)))
    return delta


def backward(problem: Problem, dout, q, k, v, out, lse, *, target: str, deterministic: bool):
    p, xp = problem, problem.xp
    check_supported(p, target)
    if not p.heads:  # dq is empty, and the kv heads serve no query: dk = dv = 0
        grads = tuple(xp.zeros(x.shape, p.dtype) for x in (q, k, v))
        return grads if p.sinks is None else grads + (xp.zeros(0, np.float32),)
    b, h, sq, sk = p.batch, p.heads, p.seq_q, p.seq_k
    limit = shared_limit(target)
    tile = _config.backward_tile(p.head_dim, p.head_dim_v, p.dtype, compute_capability(target), limit)
    if isinstance(tile, _config.HopperBackwardTile) and p.packing is not None:  # before its buffers are made
        tile = _mma_sync_backward(p, PACKED_REFUSAL, limit)
    if _config.backward_tile(p.head_dim, p.head_dim_v, p.dtype, 80, limit).sectioned \
            and _blocks(sk, _KEY_TILE_KEYS) > _schedule.GRID_YZ_LIMIT:
        # _key_grid's limit, checked before any kernel runs (the wgmma tile may fall back to this one)
        raise ValueError(f"the float16/bfloat16 backward up to D = 128 takes at most {_schedule.GRID_YZ_LIMIT} key "
                         f"tiles of {_KEY_TILE_KEYS} keys (seq_k up to {_schedule.GRID_YZ_LIMIT * _KEY_TILE_KEYS}), "
                         f"got seq_k = {sk}")
    q, k, v, dout, out = (_kernel_addressable(xp, x) for x in (q, k, v, dout, out))
    lse = xp.ascontiguousarray(lse, dtype=np.float32)

    delta = row_deltas(p, dout, out, target=target)
    rows_q = p.packing.total_q if p.packing is not None else sq

    # dQ: summed by atomics in float32 (zero-initialised), or written once per row by the
    # deterministic dQ kernel, the tensor-core one in the input type (no conversion pass after;
    # the dK/dV kernels then take dq as their float32 dq_accum and leave it untouched). The
    # tensor-core dK/dV kernels add dS·K unscaled, and the conversion pass multiplies by the scale
    # (FlashAttention's dQ postprocessing): a multiplication per dQ element once, instead of one
    # per element per key block in their hot loops (32 of the D = 64 mma.sync kernel's 673
    # instructions per tile on sm_90, NVRTC 13.5).
    # dK, dV: in the input type per query head where each is one kv head's (no GQA group to sum).
    # A GQA group's query heads add theirs to float32 per kv head (reductions into zeros), a buffer
    # and a pass the group's size smaller than one per query head and the sum over it; except in
    # deterministic mode, where the adds' order must not vary: there float32 per query head, each
    # group summed at the end in a fixed order.
    rows_k = p.packing.total_k if p.packing is not None else sk
    dq_tile = None
    if deterministic:
        dq_tile = tile if isinstance(tile, _config.BackwardTile) else _config.tensor_core_dq_tile(p.head_dim, p.head_dim_v)
    dq_dtype = p.dtype if isinstance(dq_tile, _config.TensorCoreTile) else np.dtype(np.float32)
    # The tensor-core dQ kernel writes through strides (GradientRows): in the caller's layout, so
    # that a bshd or packed call gets dq without a transposing copy.
    dq = _per_head(p, rows_q, p.head_dim, zeroed=not deterministic, dtype=dq_dtype,
                   callers_layout=isinstance(dq_tile, _config.TensorCoreTile))
    dkdv_out = DKDV_INPUT_TYPE if p.groups == 1 else DKDV_FLOAT if deterministic else DKDV_FLOAT_ADDED
    dkdv_dtype = p.dtype if dkdv_out == DKDV_INPUT_TYPE else np.dtype(np.float32)
    added = dkdv_out == DKDV_FLOAT_ADDED
    dkdv_heads = p.kv_heads if added else p.heads
    module = _module(p)
    vectorised = _vector_flags(q, k, v, dout)
    maps = ()
    if isinstance(tile, _config.HopperBackwardTile):
        # dK and dV leave by TMA store (or reduction), which needs rows a multiple of 16 bytes apart
        # (views of wider rows; the caller gets contiguous copies). No query rows (dK = dV = 0) or
        # nothing to launch: no map to build; the mma.sync kernel writes the zeros.
        # In the caller's layout, which a map addresses as well as any other: where nothing is
        # summed after, a bshd call then gets them without a transposing copy of each.
        width = 16 // dkdv_dtype.itemsize
        dk, dv = (_per_head(p, rows_k, -(-dims // width) * width, zeroed=added, dtype=dkdv_dtype,
                            callers_layout=dkdv_out != DKDV_FLOAT, heads=dkdv_heads)[..., :dims]
                  for dims in (p.head_dim, p.head_dim_v))
        maps, why_not = (tensor_maps(p, tile, target, q=q, k=k, v=v, dout=dout, dk=dk, dv=dv)
                         if 0 not in (sq, sk, h, b) else (None, ""))
        if maps is None:
            tile = _mma_sync_backward(p, why_not, limit)
    if not maps:
        # The mma.sync dK/dV writes through strides (GradientRows) too, so in the caller's layout
        # where nothing is summed after; the CUDA-core kernel per head.
        callers_layout = dkdv_out != DKDV_FLOAT and not isinstance(tile, _config.BackwardTile)
        dk, dv = (_per_head(p, rows_k, dims, zeroed=added, dtype=dkdv_dtype, callers_layout=callers_layout,
                            heads=dkdv_heads)
                  for dims in (p.head_dim, p.head_dim_v))
    common = _common_args(p, q, k, v, dout, (tile.block_m, tile.block_n))
    # The tensor-core dK/dV kernels up to D = 128 start their blocks in the order _key_grid shapes;
    # the others keep the grid (key tiles, heads, batch entries) (kernels/block_info.cuh).
    dkdv_grid = _key_grid(p, target, tile.block_n) if tile.sectioned else (_blocks(sk, tile.block_n), h, b)
    if isinstance(tile, _config.BackwardTile):  # fp32: CUDA cores
        _launch(target, "attention_bwd.cu", tile.dkdv_name(p.dtype), dkdv_grid,
                (q, k, v, dout, lse, delta, dq, dk, dv, I32(not deterministic), I32(dkdv_out), *common),
                tile.dkdv_shared_bytes,
                **module)
    elif isinstance(tile, _config.HopperBackwardTile):  # wgmma and TMA: q, k, v, dout, dk, dv through their maps
        _launch(target, tile.filename, tile.name_expression(p.dtype, accumulate_dq=not deterministic), dkdv_grid,
                (lse, delta, dq, I32(dkdv_out), *maps, *common), tile.shared_bytes, threads=tile.threads, **module)
    else:  # mma.sync
        _launch(target, tile.filename, tile.name_expression(p.dtype), dkdv_grid,
                (q, k, v, dout, lse, delta, dq, dk, dv, *_gradient_rows(p, dk), *_gradient_rows(p, dv),
                 I32(not deterministic), I32(dkdv_out), vectorised, *common),
                tile.shared_bytes, threads=tile.threads, **module)
    if deterministic:
        if isinstance(dq_tile, _config.BackwardTile):  # fp32, and fp16/bf16 head dims above 256: CUDA cores
            common = _common_args(p, q, k, v, dout, (dq_tile.dq_block_m, dq_tile.dq_block_n))
            _launch(target, "attention_bwd.cu", dq_tile.dq_name(p.dtype), (_blocks(sq, dq_tile.dq_block_m), h, b),
                    (q, k, v, dout, lse, delta, dq, *common), dq_tile.dq_shared_bytes, **module)
        else:
            common = _common_args(p, q, k, v, dout, (dq_tile.dq_block_m, dq_tile.dq_block_n))
            _launch(target, "attention_bwd_tc.cu", dq_tile.dq_name(p.dtype), _query_grid(p, target, dq_tile.dq_block_m),
                    (q, k, v, dout, lse, delta, dq, *_gradient_rows(p, dq), vectorised, *common),
                    dq_tile.dq_shared_bytes, **module)
    dq_unscaled = not deterministic and not isinstance(tile, _config.BackwardTile)
    grads = (_from_per_head(p, dq, p.dtype, scale=p.scale if dq_unscaled else None),
             _from_per_head(p, dk, p.dtype, sum_groups=dkdv_out == DKDV_FLOAT),
             _from_per_head(p, dv, p.dtype, sum_groups=dkdv_out == DKDV_FLOAT))
    if p.sinks is None:
        return grads
    return grads + (_numpy_backend.sink_gradient(xp, p.sinks.astype(np.float32), lse, delta),)
