"""The one table of kernel tile configurations.

The kernels take these numbers as template arguments through name expressions, so this table is
the only place they are written down. Each entry says why it was chosen; entries measured on a
GPU say so, the rest are reasoned from register and shared-memory budgets (no GPU has measured
them yet).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ._arrays import BFLOAT16

# C++ spellings of the storage types the kernels are instantiated for.
CTYPES = {np.dtype(np.float16): "__half", BFLOAT16: "__nv_bfloat16", np.dtype(np.float32): "float"}

THREADS = 128  # per block, every kernel; must match attn::kThreads in kernels/tile_io.cuh


# Score features a module is built for (-DATTN_SCORE_FEATURES, kernels/mask.cuh): exactly those a
# call uses, one bit each, so a call's loops carry no trace of a feature it lacks and no run-time
# test of one it has. (Attention sinks are none: read once per row, after the key loop.) The
# SASS audit's fastest path of the fp16 mma.sync forward at D = 128 on sm_80, per key tile: 591
# instructions without features, 723 with ALiBi alone, against at least 816 in the general build
# that decided each feature at run time before (bench/RESULTS.md, 2026-12-01). Each set is its own
# build: a compile on first use (on the emulator a g++ run), cached on disk.
SOFTCAP, ALIBI, BOOL_MASK, FLOAT_MASK, DROPOUT = 1, 2, 4, 8, 16
PLAIN_FEATURES = 0
FEATURE_BITS = {"softcap": SOFTCAP, "alibi": ALIBI, "bool_mask": BOOL_MASK, "float_mask": FLOAT_MASK, "dropout": DROPOUT}
ANY_FEATURES = SOFTCAP | ALIBI | BOOL_MASK | FLOAT_MASK | DROPOUT
# Every set the launcher can choose: any features, with at most one mask kind.
FEATURE_SETS = tuple(f for f in range(32) if f & (BOOL_MASK | FLOAT_MASK) != BOOL_MASK | FLOAT_MASK)
# The builds the compile report lists for every kernel: none, the score features at once (the
# float mask: a load and an add per score, the costlier kind), and dropout. (All of them with
# dropout is not one: the fp32 deterministic dQ at D = 32 spills 4 bytes there in 11 of 12
# compiles, ptxas choosing 64 registers; bench/RESULTS.md, 2026-12-01.)
ALL_FEATURES = SOFTCAP | ALIBI | FLOAT_MASK
DROPOUT_FEATURES = DROPOUT
FEATURE_NAMES = {"plain": PLAIN_FEATURES, "all": ALL_FEATURES, "dropout": DROPOUT_FEATURES}
FEATURE_LEVELS = tuple(FEATURE_NAMES.values())


def feature_words(features: int) -> str:
    """The names of a feature set's bits, e.g. 'softcap+bool_mask' ('plain' for none)."""
    return "+".join(name for name, bit in FEATURE_BITS.items() if features & bit) or "plain"


@dataclass(frozen=True)
class ForwardTile:
    """A forward configuration for head dims (D and Dv) up to ``head_dim``."""

    filename: ClassVar[str] = "attention_fwd.cu"
    sectioned: ClassVar[bool] = False  # the grid (query tiles, heads, batch entries): _schedule.py

    head_dim: int       # D and Dv are zero-padded up to this
    block_m: int        # query rows per thread block (= 4 warps · 32 / lanes_per_row)
    block_n: int        # keys per shared-memory tile
    lanes_per_row: int  # lanes sharing one query row
    reason: str

    @property
    def shared_bytes(self) -> int:
        """Q (block_m, D) + K (block_n, D + 1) + V (block_n, D) + P (block_m, block_n), float32."""
        d = self.head_dim
        return 4 * (self.block_m * d + self.block_n * (d + 1) + self.block_n * d + self.block_m * self.block_n)

    def name_expression(self, dtype) -> str:
        return (f"attention_fwd<{CTYPES[np.dtype(dtype)]}, {self.head_dim}, {self.block_m}, "
                f"{self.block_n}, {self.lanes_per_row}>")


# The CUDA-core forward serves fp32 (exact, no TF32); fp16/bf16 take the tensor-core kernel below.
# It stages every tile as float32.
# Per-lane registers: D / lanes_per_row output accumulators + block_n / lanes_per_row scores,
# kept at <= 32 + 32 so that no variant spills.
FORWARD_TILES = (
    ForwardTile(32, 64, 64, 2, "16 accumulators + 32 scores per lane; 40 KB shared"),
    ForwardTile(64, 64, 64, 2, "32 accumulators + 32 scores per lane; 64 KB shared"),
    ForwardTile(128, 32, 64, 4, "32 accumulators + 16 scores per lane; 88 KB shared"),
    ForwardTile(256, 16, 32, 8, "32 accumulators + 4 scores per lane; 82 KB shared (fits sm_86's 99 KB)"),
    ForwardTile(576, 8, 16, 16, "36 accumulators + 1 score per lane; 91 KB shared"),
)
# Head dims above 256 (up to MLA's 576 for D and Dv alike) take the WIDE tiles below, whose shared
# memory may exceed the 99 KB of sm_86/sm_89/sm_120 but fits the 163 KB of sm_80 and 227 KB of
# sm_90; the launcher checks the GPU's limit and says so. Everything up to 256 fits 99 KB, but for
# the mma.sync dK/dV at D = 128, whose first tile takes GPUs with room for it (backward_tile).
MAX_HEAD_DIM = 576
NARROW_HEAD_DIM = 256
WIDE_SHARED_LIMIT = 163 * 1024
LEAST_SHARED_LIMIT = 99 * 1024  # the dynamic shared memory a block may opt in to on sm_86, sm_89, sm_120


@dataclass(frozen=True)
class BackwardTile:
    """Backward configurations for head dims (D and Dv) up to ``head_dim``.

    The dK/dV kernel holds ``block_n`` keys and visits ``block_m`` query rows at a time; the
    deterministic dQ kernel is laid out like the forward (``dq_block_m`` rows on
    ``dq_lanes_per_row`` lanes each, ``dq_block_n`` keys per tile).
    """

    filename: ClassVar[str] = "attention_bwd.cu"
    sectioned: ClassVar[bool] = False  # the grids (tiles, heads, batch entries): _schedule.py

    head_dim: int
    block_m: int
    block_n: int
    dq_block_m: int
    dq_block_n: int
    dq_lanes_per_row: int
    reason: str

    @property
    def dkdv_shared_bytes(self) -> int:
        """Q, dO (block_m, D) + K, V (block_n, D + 1) + P, dS (block_m, block_n) + lse, delta (block_m)."""
        d, m, n = self.head_dim, self.block_m, self.block_n
        return 4 * (2 * m * d + 2 * n * (d + 1) + 2 * m * n + 2 * m)

    @property
    def dq_shared_bytes(self) -> int:
        """Q, dO (m, D) + K, V (n, D + 1) + dS (m, n) + lse, delta (m), for the dQ kernel's m, n."""
        d, m, n = self.head_dim, self.dq_block_m, self.dq_block_n
        return 4 * (2 * m * d + 2 * n * (d + 1) + m * n + 2 * m)

    def dkdv_name(self, dtype) -> str:
        return f"attention_bwd_dkdv<{CTYPES[np.dtype(dtype)]}, {self.head_dim}, {self.block_m}, {self.block_n}>"

    def dq_name(self, dtype) -> str:
        return (f"attention_bwd_dq<{CTYPES[np.dtype(dtype)]}, {self.head_dim}, {self.dq_block_m}, "
                f"{self.dq_block_n}, {self.dq_lanes_per_row}>")


@dataclass(frozen=True)
class TensorCoreTile:
    """The fp16/bf16 forward on mma.sync: block_m query rows per block of 4 warps (64: one row
    tile of 16 rows per warp; 128: two, 64 rows apart). The deterministic dQ kernel is laid out
    alike, with the rows and keys of its head dim's tile for every call (the one not
    unmasked_only): dq_block_m and dq_block_n (dq_tile; by default 64 rows and block_n)."""

    filename: ClassVar[str] = "attention_fwd_tc.cu"
    # Its blocks (and the dQ kernel's) start in sections of (batch entry, head) pairs, the last
    # query tile first (kernels/block_info.cuh query_block_place, _schedule.py).
    sectioned: ClassVar[bool] = True

    head_dim: int
    block_m: int
    block_n: int
    reason: str
    value_slice: int = 0  # value dims per launch when fewer than head_dim (0: all of them)
    min_blocks: int = 1   # blocks per SM ptxas must leave registers for in the plain build (__launch_bounds__)
    # For calls without a mask, score_mod or mask_mod (whose per-row addressing spilled beside this
    # tile's accumulators); such calls take the next tile of the same head dim.
    unmasked_only: bool = False
    dq_tile: tuple = (64, 0)  # the deterministic dQ kernel's (rows, keys) per block; keys 0: block_n

    @property
    def dq_block_m(self) -> int:
        return self.dq_tile[0]

    @property
    def dq_block_n(self) -> int:
        return self.dq_tile[1] or self.block_n

    @property
    def value_dim(self) -> int:
        """O's dims one launch computes: a wider Dv is computed slice by slice, one launch each
        (every launch recomputes S; O's accumulators are what registers bound)."""
        return self.value_slice or self.head_dim

    @property
    def shared_bytes(self) -> int:
        """Q (block_m, D + 8) + two stages of K (block_n, D + 8) and V (block_n, value_dim + 8),
        16-bit; rows padded by 16 bytes for ldmatrix."""
        return 2 * ((self.block_m + 2 * self.block_n) * (self.head_dim + 8) + 2 * self.block_n * (self.value_dim + 8))

    def name_expression(self, dtype) -> str:
        return (f"attention_fwd_tc<{CTYPES[np.dtype(dtype)]}, {self.head_dim}, {self.block_m}, {self.block_n}, "
                f"{self.value_dim}, {self.min_blocks}>")

    @property
    def dq_shared_bytes(self) -> int:
        """The deterministic dQ kernel: Q, dO (dq_block_m, D + 8) + K, V (dq_block_n, D + 8),
        16-bit, and lse, delta (dq_block_m floats)."""
        return 2 * (2 * self.dq_block_m + 2 * self.dq_block_n) * (self.head_dim + 8) + 8 * self.dq_block_m

    def dq_name(self, dtype) -> str:
        return (f"attention_bwd_dq_tc<{CTYPES[np.dtype(dtype)]}, {self.head_dim}, {self.dq_block_n}, "
                f"{self.dq_block_m}>")


# Per thread: (block_m / 64)·(D/2) float accumulators of O plus (block_m / 64)·(block_n/2) of S
# and (block_m / 64)·4 of the rows' sums (P·1; builds without dropout).
# FlashAttention-2's choice for D <= 128 on sm_80/sm_90 is 128 query rows per block of 4 warps: each
# K and V fragment a warp reads from shared memory then serves two MMAs. The SASS audit's path
# per 64 keys over tensor cycles (fp16, sm_90; bench/RESULTS.md, 2026-12-01, third session): at
# D = 32 2.29 with 128 rows against 2.81 with 64, at D = 64 1.40 against 1.73, at the price of
# 168 and 231 registers (3 and 2 blocks per SM, against 4); at D = 64 a call with ALiBi and a
# mask spills 4-36 bytes in 7 of its 48 feature builds on sm_80/sm_90 (a GPU run weighs that
# against the 64-row tile's longer path). At D = 128, shared memory's bandwidth decides (the SASS
# audit's shared_per_tensor: 128 bytes per clock per SM, and a warp reads every K and V fragment
# of a tile whatever its rows): with 16 rows per warp (64 x 64) a tile's ldmatrix and cp.async
# take 2.67 cycles of shared memory per tensor cycle on sm_90 (1.33 on sm_80), with 32 (128 x 32)
# 1.70 (0.85), and the path is shorter too (NVRTC 13.5, fp16: 455 → 429 instructions on sm_90,
# 0.86 → 0.81 per tensor cycle; bench/RESULTS.md, 2026-12-06, twentieth session). 128 x 64 spills
# (40-48 bytes), and so does 128 x 32 beside a mask or mods (4-72 bytes: the per-row mask
# addresses), so calls with either keep 64 x 64. D = 256 takes 16-key tiles so that O's 128
# accumulators fit with two blocks per SM (32 keys: 99 KB of shared memory, one block) and the two
# K/V stages stay within sm_86's 99 KB. Which wins on a GPU is the next GPU run's to say
# (bench/tile_sweep.py).
TENSOR_CORE_TILES = (
    TensorCoreTile(32, 128, 64, "2 x (16 + 32 + 4) accumulators per thread; 30 KB shared", dq_tile=(128, 64)),
    TensorCoreTile(64, 128, 64, "2 x (32 + 32 + 4) accumulators per thread; 54 KB shared", dq_tile=(128, 32)),
    TensorCoreTile(128, 128, 32, "2 x (64 + 16 + 4) accumulators per thread; 68 KB shared", unmasked_only=True),
    TensorCoreTile(128, 64, 64, "64 + 32 + 4 accumulators per thread; 85 KB shared"),
    TensorCoreTile(256, 64, 16, "128 + 8 + 4 accumulators per thread; 66 KB shared"),
    TensorCoreTile(576, 64, 16, "value dims in launches of 256: 128 + 8 + 4 accumulators per thread; 126 KB shared (WIDE)",
                   value_slice=256),
)
TENSOR_CORE_DTYPES = (np.dtype(np.float16), BFLOAT16)
# The tiles whose dq_tile the deterministic dQ kernel takes: one per head dim, the one for every
# call. Its rows per warp set its shared-memory reads as the forward's do (the SASS audit's
# shared_per_tensor on sm_80, NVRTC 13.5, fp16; bench/RESULTS.md, 2026-12-06, twentieth session):
# at D = 32 128 x 64 0.79 against 1.38 for 64 x 64 (issue_per_tensor 0.65 against 0.78), at D = 64
# 128 x 32 0.96 against 1.35 (0.47 against 0.51; 128 x 64 spills 16 bytes with softcap, ALiBi and a
# float mask). At D = 128 128 x 32 spills (12 bytes, plain build) and 64 x 32 was longer than
# 64 x 64 (0.85 against 0.74 on sm_90), so it keeps 64 x 64, as D = 256 keeps 64 x 16.
DQ_TENSOR_CORE_TILES = tuple(t for t in TENSOR_CORE_TILES if not t.unmasked_only)


# The warp-specialised wgmma kernels' threads (attn::kWsThreads: a producer warpgroup and two
# consumers) and the registers each thread must start with: __launch_bounds__(384, 1) caps them at
# 65536 / 384 rounded down to 8, and setmaxnreg hands them on (64512 in all: the forward 40 to the
# producer and 232 to each consumer, the dK/dV 24 and 240), so a build with fewer would leave
# setmaxnreg.inc waiting forever.
WS_THREADS = 384
WS_LAUNCH_REGISTERS = 65536 // WS_THREADS // 8 * 8


@dataclass(frozen=True)
class HopperTile:
    """The fp16/bf16 forward on wgmma and TMA (sm_90a), chosen for compute capability 9.0 (which
    runs it when asked for: DEFAULT_KERNELS_FOR) where TMA can address q, k, v and out: blocks of
    block_m query rows in three warpgroups, a producer loading Q, K and V by TMA in boxes of 64
    head dims (TMA_BOX_DIMS) and two consumers of 64 rows each taking turns at the tensor cores;
    block_n keys per tile (the N of the S instruction), P·V in instructions of up to 128 head dims
    (head dims pad to 64)."""

    filename: ClassVar[str] = "attention_fwd_wgmma.cu"
    sectioned: ClassVar[bool] = True  # query_block_place, as TensorCoreTile

    head_dim: int
    block_n: int
    reason: str
    # The calls it serves: those whose score features are among these, but not all of
    # `spills_with`, and with a score_mod or mask_mod where `mods` (the state of the others spills
    # beside this tile's S, P and O).
    features: int = ANY_FEATURES
    mods: bool = True
    spills_with: int = 0
    diagonal: bool = True  # for calls whose rows end on a diagonal (causal or a window) too
    block_m: ClassVar[int] = 128  # attn::kConsumerGroups x 64, every tile
    threads: ClassVar[int] = WS_THREADS  # every tile

    @property
    def persistent(self) -> bool:
        """Whether O gets a staging tile of its own within HOPPER_SHARED_LIMIT: then the kernel is
        persistent (a block per SM, each claiming its next work tile as it nears the end of its
        current one, whose Q, K and V load while this one's O is stored), else it stages O in Q's
        rows and runs one block per work tile (attention_fwd_wgmma.cu, kPersistent: the same
        rule)."""
        return self._shared_bytes(own_output=True) <= HOPPER_SHARED_LIMIT

    @property
    def shared_bytes(self) -> int:
        """Q (block_m, D), two stages of K and of V (block_n, D each), at D = 64 a box of ones per
        stage of V (block_n, 64: P·V's last 8 columns, the rows' sums of P) and, if persistent, O's
        staging tile (block_m, D) in 128-byte-swizzled boxes, 16-bit (V is read there as an
        MN-major operand: no transposed copy), then the barriers: full and empty of each stage of
        K and of V, Q's landed and free, the next work tile's posted and read (12 x 8 bytes), and
        the next work tile's index (4 bytes, padded to 8)."""
        return self._shared_bytes(own_output=self.persistent)

    def _shared_bytes(self, own_output: bool) -> int:
        ones = 2 * self.block_n * TMA_BOX_DIMS if self.head_dim == TMA_BOX_DIMS else 0
        return 2 * ((self.block_m * (2 if own_output else 1) + 4 * self.block_n) * self.head_dim + ones) + 104

    def serves(self, features: int, mods: bool, diagonal: bool) -> bool:
        """Whether a call with these score features (a score_mod or mask_mod where mods; causal
        or a window where diagonal) may take this tile."""
        return (not features & ~self.features and (self.mods or not mods) and (self.diagonal or not diagonal)
                and not (self.spills_with and features & self.spills_with == self.spills_with))

    def tma_rows(self, operand: str) -> int:
        """Rows of one TMA box of q, k, v or out (each box TMA_BOX_DIMS head dims wide): the
        block's query rows of q (loaded once), a tile's keys of k and v, a consumer group's 64
        rows of out (each group stores its own)."""
        return {"q": self.block_m, "k": self.block_n, "v": self.block_n, "out": self.block_m // 2}[operand]

    def name_expression(self, dtype) -> str:
        return f"attention_fwd_wgmma<{CTYPES[np.dtype(dtype)]}, {self.head_dim}, {self.block_n}>"


HOPPER_SHARED_LIMIT = 227 * 1024  # dynamic shared memory a block may use on sm_90
TMA_LINE_BYTES = 128  # one 128-byte swizzled line per box row: 64 head dims of 16 bits, 32 of float32
TMA_BOX_DIMS = TMA_LINE_BYTES // 2  # head dims per TMA box of q, k, v, out and dout


# Per consumer thread (232 registers after setmaxnreg): D/2 floats of O (and 4 of the rows' sums of
# P at D = 64, builds without dropout), block_n/2 of S and block_n/4 registers of packed P. Every
# build overlaps the softmax of one tile with P·V of the previous, so all three are live at once,
# besides the state of its score features and mods (attention_fwd_wgmma.cu).
# Measured with NVRTC 13.5 (fp16; bench/RESULTS.md, 2026-12-01, fifth session): without the overlap 128 keys at
# D = 128 spill 4-24 bytes with softcap, ALiBi and a float mask (and dropout), 64 keys at D = 256
# 12-120 with a float mask; 64 and 32 keys spilled with none of the feature sets tried (dropout
# among them, at D = 256 too). At D = 64, 128 keys spilled 8-152 bytes in 7 of the 24 feature sets
# at 240 registers, 8-236 in 12 at 232 (the persistent forward's split; 2026-12-05): 64 keys in none.
# With the overlap (2026-12-06, eighteenth session) 64 keys at D <= 128 and 32 at 256 spill in none
# of the 23 feature sets, fp16 or bf16. At D = 64, 128 keys spill in none of the 11 sets without
# dropout (2026-12-07), fp16 or bf16, but in 10 of the 12 with it (4-76 bytes) and with the bias
# table of bench/bench_mods.py (12-60): calls with features but neither take 128 keys, where 64
# gave the SASS audit's issue_per_tensor 1.215 → 1.025 with ALiBi, 1.477 → 1.318 with a bool
# mask, 1.367 → 1.201 with a float mask (softcap: the MUFU bound 2.562 → 2.531). Since the
# epilogue works its staging offsets out where it uses them (twenty-fifth session) only the 4
# dropout sets with ALiBi but not a bool mask spill there (4-44 bytes): calls with dropout but not
# ALiBi take 128 keys too (`spills_with`), 3.090 → 2.859 with dropout alone, 5-6 % with a mask or
# softcap beside it; the bias table still spills (12 bytes, in the key loop). At D = 128, 128
# keys would spill with ALiBi, and its 64-key builds without softcap are within the tensor cores'
# time already (issue_per_tensor 0.68-0.88). 176 keys (calls without causal or a window) spill
# in no build with a mask alone: 1.318 → 1.256 (bool), 1.201 → 1.136 (float) against 128 keys;
# every other feature set spills there (24-828 bytes).
# So a call takes the first tile below for its head dim that serves it (HopperTile.serves).
# block_n is the N of the S instruction. At D = 64 a plain call (or one with a mask alone) takes 176 keys
# (m64n176k16, FlashAttention-3's choice there): the SASS audit's path per tile of 517
# instructions against 392 for 128 keys (2.94 per key against 3.06; issue_per_tensor 0.73 against
# 0.77), with the Q descriptors no longer hoisted (attention_fwd_wgmma.cu); with every 7th exp2 on
# the FMA units (exp2_polynomial, 2026-12-06) 614 against 457, issue_per_tensor 0.87 against 0.89
# and mufu_per_tensor 0.89 against 0.91; with the rows' sums on the tensor cores and every 5th exp2
# on the FMA units (2026-12-07) 554 against 426, 0.74 against 0.78 and 0.77 against 0.77. Causal
# and windowed calls keep 128 (not `diagonal`), as FlashAttention-3 does: a tile on the diagonal
# issues more (boundary issue_per_tensor 1.17 at 176 keys, 1.11 at 128; 0.98 and 0.93 since the
# rows' sums moved to the tensor cores), 128 query rows cross one tile of 128
# keys but often two of 176, and the masked part of the last tile grows; the model (interior tiles
# at the tensor cores' rate, boundary tiles at their issue rate) puts a causal call at 1.20x the
# 128-key time at S = 1k, 1.06x at 4k and 1.01x at 16k (bench/RESULTS.md, 2026-12-06). Shared memory
# within the 227 KB a block may use on sm_90. Earlier: with one warpgroup per block and cp.async,
# 128 keys at D = 64 gave issue_per_tensor 1.01 against 1.31 with 64 (the softmax's ~4.5
# instructions per score outweigh D = 64's tensor work, so the per-tile rest is what a longer tile
# amortises); TMA staging (fourth session) gave 0.88 at D = 64, 0.70 at 128, 0.47 at 256.
HOPPER_TILES = (
    HopperTile(64, 176, "36 + 88 + 44 registers of O and the row sums, S and P per consumer thread; 164 KB shared",
               features=BOOL_MASK | FLOAT_MASK, mods=False, diagonal=False),
    HopperTile(64, 128, "36 + 64 + 32 registers of O and the row sums, S and P per consumer thread; 128 KB shared",
               mods=False, spills_with=ALIBI | DROPOUT),
    HopperTile(64, 64, "32 + 32 + 16 registers of O, S and P (36 of O and the row sums without dropout) besides the "
                       "features'; 80 KB shared"),
    HopperTile(128, 128, "64 + 64 + 32 registers of O, S and P; 192 KB shared", features=PLAIN_FEATURES, mods=False),
    HopperTile(128, 64, "64 + 32 + 16 registers of O, S and P besides the features'; 128 KB shared"),
    HopperTile(256, 64, "128 + 32 + 16 registers of O, S and P; 192 KB shared (O staged in Q: not persistent)",
               features=PLAIN_FEATURES, mods=False),
    HopperTile(256, 32, "128 + 16 + 8 registers of O, S and P besides the features'; 192 KB shared"),
)
HOPPER_ARCH = "sm_90a"  # what NVRTC compiles the wgmma kernels for


@dataclass(frozen=True)
class TensorCoreBackwardTile:
    """The fp16/bf16 dK/dV kernel on mma.sync: block_n keys per block (groups of 16, each shared
    by 64 / block_n warps that split its head dims, or held by one warp from 64 keys on: 4 warps,
    8 for 128 keys), block_m query rows per step. Its dq goes by atomics, or comes from the
    deterministic tensor-core dQ kernel."""

    filename: ClassVar[str] = "attention_bwd_tc.cu"

    head_dim: int
    block_m: int
    block_n: int
    stages: int  # of Q and dO: with 2 the next query tile loads while this one is worked on
    reason: str

    @property
    def dim_warps(self) -> int:
        """Warps sharing one group of 16 keys, each holding head_dim / dim_warps dims of dK, dV."""
        return max(1, 4 // (self.block_n // 16))

    @property
    def threads(self) -> int:
        """The block's threads: a warp per dim share of each group of 16 keys (DkdvTcLayout::kBlockThreads)."""
        return 32 * self.block_n // 16 * self.dim_warps

    @property
    def shared_bytes(self) -> int:
        """K, V (block_n, D + 8) + dS (block_m, block_n + 8), 16-bit; per stage Q, dO (block_m,
        D + 8), 16-bit, and lse, delta (block_m floats); with dim_warps > 1 the partial Sᵀ, dPᵀ
        of 4 warps (2 x block_m x 16 floats each). kernels/attention_bwd_tc.cu's DkdvTcLayout."""
        m, n, d, stages = self.block_m, self.block_n, self.head_dim, self.stages
        partials = 4 * 2 * m * 16 if self.dim_warps > 1 else 0
        return 2 * (2 * n + stages * 2 * m) * (d + 8) + 2 * m * (n + 8) + 4 * (stages * 2 * m + partials)

    @property
    def sectioned(self) -> bool:
        """Whether its blocks start in sections of (batch entry, head) pairs, the first key tile
        first (kernels/block_info.cuh key_block_place; the kernel decides the same from kHeadDim):
        up to D = 128. Wider ones keep the grid (key tiles, heads, batch entries): the place's
        arithmetic made the D = 256 build spill 36 bytes on sm_90 (NVRTC 13.5)."""
        return self.head_dim <= 128

    def name_expression(self, dtype) -> str:
        return (f"attention_bwd_dkdv_tc<{CTYPES[np.dtype(dtype)]}, {self.head_dim}, {self.block_m}, {self.block_n}, "
                f"{self.stages}>")


# Per thread: dK and dV accumulate D/(2·dim_warps) floats each, Sᵀ and dPᵀ block_m/2 each. All
# head dims in one warp would give D = 256 256 accumulators per thread, so its 16-key groups are
# split over two warps (128 dims each; their Sᵀ, dPᵀ partial sums meet in shared memory). Q and
# dO load in two stages (as FlashAttention-2's backward double-buffers them) where both fit
# sm_86's 99 KB; D = 256 would need 118 KB and loads each tile after the previous one.
# Blocks of 128 keys (8 warps of 16; FlashAttention-2's on A100/H100: 128 keys, 8 warps) load each query
# tile's Q and dO, and reduce its dQ, once per 128 keys instead of once per 64: half the global
# traffic per key of the dK/dV loop (bench/RESULTS.md, 2026-12-06: the emulator's sectors, the
# SASS audit's 16 instead of 32 reductions per thread and tile), at the same 8 warps per SM (one
# block of 256 threads at 230-254 registers, against two of 128). At D = 128 that needs 111 KB,
# above sm_86's 99 KB: those GPUs take the next tile of the head dim (backward_tile). D = 32
# keeps 64 keys: its 184-196 registers give 3 blocks of 4 warps per SM, which 8-warp blocks would
# cut to 1.
TENSOR_CORE_BACKWARD_TILES = (
    TensorCoreBackwardTile(32, 64, 64, 2, "32 + 64 accumulators per thread; 40 KB shared"),
    TensorCoreBackwardTile(64, 64, 128, 2, "64 + 64 accumulators per thread, 8 warps; 90 KB shared"),
    TensorCoreBackwardTile(128, 32, 128, 2, "128 + 32 accumulators per thread, 8 warps; 111 KB shared"),
    TensorCoreBackwardTile(128, 32, 64, 2, "128 + 32 accumulators per thread; 73 KB shared (99 KB GPUs)"),
    TensorCoreBackwardTile(256, 32, 32, 1, "2 warps per 16 keys: 128 + 32 accumulators per thread; 85 KB shared"),
    TensorCoreBackwardTile(576, 16, 16, 1, "4 warps per 16 keys: 144 + 16 accumulators per thread; 82 KB shared"),
)


@dataclass(frozen=True)
class HopperBackwardTile:
    """The fp16/bf16 dK/dV kernel on wgmma and TMA (sm_90a), chosen for compute capability 9.0
    (when asked for: DEFAULT_KERNELS_FOR) for head dims up to 128 where TMA can address q, k, v
    and dout: blocks of 128 keys in three warpgroups, a producer loading K and V once and each
    query tile's Q, dO (TMA, boxes of TMA_BOX_DIMS head dims) and row statistics into two stages,
    and two consumers of 64 keys each; block_m query rows per tile. Its dq goes by atomics, or
    comes from the deterministic tensor-core dQ kernel."""

    filename: ClassVar[str] = "attention_bwd_wgmma.cu"
    block_n: ClassVar[int] = 128  # the kernel's keys per block: two consumer warpgroups of 64
    sectioned: ClassVar[bool] = True  # key_block_place, as TensorCoreBackwardTile up to D = 128
    threads: ClassVar[int] = WS_THREADS

    head_dim: int
    block_m: int
    reason: str

    @property
    def shared_bytes(self) -> int:
        """K, V (128, D), two stages of Q, dO (block_m, D) and per consumer two dS buffers
        (block_m, 64), 16-bit, in swizzled boxes; two stages of lse, delta (block_m floats); the
        barriers (five of 8 bytes)."""
        m, d = self.block_m, self.head_dim
        return 2 * (2 * self.block_n * d + 2 * 2 * m * d + 2 * 2 * m * 64) + 4 * 2 * 2 * m + 40

    def tma_rows(self, operand: str) -> int:
        """Rows of one TMA box (a 128-byte line wide: TMA_BOX_DIMS 16-bit head dims, 32 of the
        float32 dk, dv a GQA call sums after) of q, k, v, dout, dk, dv: a query tile's of q and
        dout, the block's keys of k and v, a consumer group's 64 keys of dk and dv (each group
        stores its own)."""
        return {"q": self.block_m, "dout": self.block_m, "k": self.block_n, "v": self.block_n, "dk": 64,
                "dv": 64}[operand]

    def name_expression(self, dtype, accumulate_dq: bool) -> str:
        """accumulate_dq: the kernel adds dQ by reductions (else the deterministic dQ kernel
        computes it after), a template argument of the kernel; no default, so that no caller
        gets one of the two kernels without saying which."""
        return (f"attention_bwd_dkdv_wgmma<{CTYPES[np.dtype(dtype)]}, {self.head_dim}, {self.block_m}, "
                f"{str(accumulate_dq).lower()}>")


# Per consumer thread: D/2 + D/2 floats of dK and dV, block_m/2 + block_m/2 of Sᵀ and dPᵀ,
# block_m/4 registers of packed Pᵀ, dSᵀ and 32 floats of dQ (64 dims at a time), under
# setmaxnreg's 240 (builds with score features at D = 128 take Sᵀ, dPᵀ 32 rows at a time: the
# kernel's kSubM). block_m = 64 is also dQ's M. D = 256 would need 256 accumulators per thread:
# it stays on the mma.sync kernel, which splits the dims over two warps.
HOPPER_BACKWARD_TILES = (
    HopperBackwardTile(64, 64, "64 + 64 accumulators per thread (and 32 of dQ); 97 KB shared"),
    HopperBackwardTile(128, 64, "128 + 64 accumulators per thread (and 32 of dQ); 161 KB shared"),
)
# The compute capability whose kernels a GPU runs when CUPY_ATTN_COMPUTE_CAPABILITY is unset,
# where measurement found another family faster than the GPU's own. On an H200 (bench/RESULTS.md,
# 2026-11-30) the mma.sync kernels beat the wgmma ones in all 80 benchmark cases (wgmma at
# 0.88-0.99x forward, 0.79-0.95x backward: fewer tensor-pipe cycles, bank-conflicted transposes),
# so compute capability 9.0 runs the 8.0 kernels until the wgmma ones win a measurement;
# CUPY_ATTN_COMPUTE_CAPABILITY=90 asks for the wgmma kernels. On the next H200 run (2026-12-04)
# the current wgmma kernels were 1.2-2.7x faster than the mma.sync ones in 25 of 26 cases, but a
# fault in a TMA test kept them out of that run's GPU tests: they stay opt-in until a GPU run has
# checked their results.
DEFAULT_KERNELS_FOR = {90: 80}

# Kernel files that only compile for one architecture, and that architecture.
FILE_ARCH = {"attention_fwd_wgmma.cu": HOPPER_ARCH, "attention_bwd_wgmma.cu": HOPPER_ARCH}


def preprocess_name(dtype) -> str:
    return f"attention_bwd_preprocess<{CTYPES[np.dtype(dtype)]}>"


# The backward's preprocess (delta = rowsum(dO ∘ O)) reads a row with 8 lanes, 16 bytes each
# (kernels/attention_bwd.cu, kPreprocessLanes): 16 rows per block of THREADS.
PREPROCESS_ROWS_PER_BLOCK = THREADS // 8


# The merge of partial results (cupy_attn._merge): one warp per row, so that a warp reads 32
# consecutive elements of a part's row at a time; memory-bound, nothing to tile.
COMBINE_FILE = "attention_combine.cu"
COMBINE_ROWS_PER_BLOCK = THREADS // 32


def combine_name(part_dtype, out_dtype) -> str:
    """The merge kernel for parts stored as ``part_dtype`` (float32, or the output's dtype)."""
    return f"attention_combine<{CTYPES[np.dtype(part_dtype)]}, {CTYPES[np.dtype(out_dtype)]}>"


@dataclass(frozen=True)
class DecodeTile:
    """The split-KV decoding kernel (kernels/attention_decode.cu, `attention_with_kvcache`), for
    every storage type, in float32 on CUDA cores: block_m rows (query, query head of one GQA
    group) per block, block_n keys per tile, one per lane, K and V staged in the storage type."""

    filename: ClassVar[str] = "attention_decode.cu"

    head_dim: int  # D and Dv are zero-padded up to this
    block_m: int   # rows per block, kThreads / 32 = 4 warps of block_m / 4 rows each
    reason: str
    block_n: int = 32  # one key per lane of a warp

    def stages(self, dtype) -> int:
        """K/V tiles held at once: two (the next loads while this one is worked on) where they
        fit sm_86's 99 KB, else one."""
        return 2 if self._shared_bytes(dtype, 2) <= 99 * 1024 else 1

    def shared_bytes(self, dtype) -> int:
        return self._shared_bytes(dtype, self.stages(dtype))

    def _shared_bytes(self, dtype, stages: int) -> int:
        """Q (block_m, D) and P (block_m, block_n) as float32; per stage K and V (block_n, D) in
        the storage type, rows padded by 16 bytes. kernels/attention_decode.cu's DecodeSmem."""
        size = np.dtype(dtype).itemsize
        return 4 * self.block_m * (self.head_dim + self.block_n) + stages * 2 * self.block_n * (self.head_dim * size + 16)

    def name_expression(self, dtype) -> str:
        return (f"attention_decode<{CTYPES[np.dtype(dtype)]}, {self.head_dim}, {self.block_m}, {self.block_n}, "
                f"{self.stages(dtype)}>")


# Per lane: block_m / 4 rows' scores (one key each), their running max and sum, and block_m / 4
# rows x D / 32 output accumulators (<= 32). Decoding has G·Sq rows per kv head (G = H / Hkv: 4-8
# in today's GQA models, Sq = 1 or a few speculative tokens); 16 rows hold a group of 8 with two
# queries in one block. A block's rows beyond G·Sq skip their Q·Kᵀ and P·V (a uniform branch per
# warp) but not the softmax's shuffles (10 per row and tile; a branch around them costs a slow
# shuffle call), which is why block_m is not larger; more rows (MQA, prefill over a cache) take
# more blocks, each re-reading K/V. Not yet measured on a GPU.
DECODE_TILES = (
    DecodeTile(32, 16, "4 scores + 4 accumulators per lane; 14 KB shared (16-bit), 22 KB (fp32)"),
    DecodeTile(64, 16, "4 scores + 8 accumulators per lane; 24 KB shared (16-bit), 40 KB (fp32)"),
    DecodeTile(128, 16, "4 scores + 16 accumulators per lane; 44 KB shared (16-bit), 76 KB (fp32)"),
    DecodeTile(256, 16, "4 scores + 32 accumulators per lane; 84 KB shared (16-bit), 83 KB with one stage (fp32)"),
)


def decode_tile(head_dim: int, head_dim_v: int) -> DecodeTile:
    return _pick(DECODE_TILES, head_dim, head_dim_v)


# Split-KV (attention_with_kvcache, num_splits=0). Decoding reads each K/V byte once, so its speed
# is the bandwidth of the memory reads in flight: every SM needs blocks streaming K/V. Without
# splitting there is one block per (row tile, kv head, batch entry), 8 for B = 1 with Hkv = 8,
# against 132 SMs on an H100/H200. Splitting each entry's key tiles into contiguous ranges, one
# block each, fills the GPU; the price is a float32 partial (out, lse) per split and row and the
# combine kernel that merges them. The rule:
#   - enough blocks for SPLIT_WAVES blocks per SM (each keeps up to two K/V tiles in flight: at
#     D = 128, 16-bit, two blocks per SM hold ~70 KB in flight, above the ~26 KB that an H200's
#     4.8 TB/s over ~0.7 µs of latency asks of each of its 132 SMs);
#   - but at least MIN_TILES_PER_SPLIT key tiles per split (128 keys: at G = 8 rows per kv head,
#     the partials written and read back are then under 7 % of the K/V bytes read), and at most
#     MAX_SPLITS (as FlashAttention's heuristic);
#   - no splitting when the grid already has SPLIT_WAVES blocks per SM (large batches, prefill).
# Explicit num_splits are clamped to the longest entry's key tiles. The emulator stands in for an
# H200 (EMULATOR_SM_COUNT), so it chooses what that GPU would.
SPLIT_WAVES = 2
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 128
EMULATOR_SM_COUNT = 132


def decode_splits(blocks: int, key_tiles: int, sm_count: int) -> int:
    """The number of splits for num_splits=0: ``blocks`` without splitting (row tiles x kv heads
    x batch), ``key_tiles`` of the longest entry, ``sm_count`` SMs."""
    wanted = -(-SPLIT_WAVES * sm_count // max(blocks, 1))
    return max(1, min(wanted, key_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


# The fp32 backward (exact, on CUDA cores; fp16/bf16 take the tensor-core kernels above).
# dK/dV: 128 threads hold a (block_n, D) dK and dV, D·block_n/128 <= 32 floats each per thread;
# every entry fits sm_86's 99 KB of shared memory.
BACKWARD_TILES = (
    BackwardTile(32, 64, 64, 64, 64, 2, "16 + 16 dK/dV accumulators per thread; 65 KB / 48 KB shared"),
    BackwardTile(64, 64, 64, 64, 64, 2, "32 + 32 dK/dV accumulators per thread; 97 KB / 81 KB shared"),
    BackwardTile(128, 32, 32, 32, 32, 4, "32 + 32 dK/dV accumulators per thread; 72 KB / 68 KB shared"),
    BackwardTile(256, 16, 16, 16, 16, 8, "32 + 32 dK/dV accumulators per thread; 66 KB / 65 KB shared"),
    BackwardTile(576, 16, 8, 8, 16, 16, "36 + 36 dK/dV accumulators per thread; 109 KB / 109 KB shared (WIDE)"),
)


def _pick(tiles, head_dim: int, head_dim_v: int):
    need = max(head_dim, head_dim_v)
    for tile in tiles:
        if need <= tile.head_dim:
            return tile
    raise ValueError(
        f"head dims up to {tiles[-1].head_dim} are supported by these CUDA kernels, got D = {head_dim}, "
        f"Dv = {head_dim_v}; use backend='numpy' for larger ones"
    )


def forward_tile(head_dim: int, head_dim_v: int, dtype=np.float32, compute_capability: int = 80,
                 features: int = PLAIN_FEATURES, mods: bool = False, diagonal: bool = False):
    """The forward configuration for a call with these score features (and a score_mod or mask_mod
    where mods; causal or a window where diagonal): wgmma on compute capability 9.0 up to its
    widest tile (the first of HOPPER_TILES that serves the call) and mma.sync otherwise for
    fp16/bf16 (TENSOR_CORE_TILES' unmasked_only tiles for calls without a mask or mods only), CUDA
    cores for fp32."""
    if np.dtype(dtype) in TENSOR_CORE_DTYPES:
        if compute_capability == 90 and max(head_dim, head_dim_v) <= HOPPER_TILES[-1].head_dim:
            return _pick([t for t in HOPPER_TILES if t.serves(features, mods, diagonal)], head_dim, head_dim_v)
        unmasked = not features & (BOOL_MASK | FLOAT_MASK) and not mods
        return _pick([t for t in TENSOR_CORE_TILES if unmasked or not t.unmasked_only], head_dim, head_dim_v)
    return _pick(FORWARD_TILES, head_dim, head_dim_v)


def selectable(filename: str, name_expression: str, features: int, mods: bool = False) -> bool:
    """Whether a call with these features (and a score_mod or mask_mod where mods) can run this
    variant: forward_tile's choice for its head dim, with causal or a window or without (of the
    wgmma forwards, the tiles that serve such calls and come first for their head dim; of the
    mma.sync forwards, the unmasked_only tiles for calls without a mask or mods, the
    others of their head dims for calls with either); every variant of the other files."""
    if filename == HopperTile.filename:
        tiles, compute_capability = HOPPER_TILES, 90
    elif filename == TensorCoreTile.filename:
        tiles, compute_capability = TENSOR_CORE_TILES, 80
    else:
        return True
    return any(forward_tile(t.head_dim, t.head_dim, dtype, compute_capability, features, mods, diagonal) is t
               for t in tiles for dtype in TENSOR_CORE_DTYPES if t.name_expression(dtype) == name_expression
               for diagonal in (False, True))


def tensor_core_dq_tile(head_dim: int, head_dim_v: int):
    """The deterministic dQ's configuration for fp16/bf16: the mma.sync forward's tile up to
    NARROW_HEAD_DIM; above, the CUDA-core dQ kernel (a BackwardTile, instantiated for the 16-bit
    type), since 64 query rows of Q and dO at 576 dims would need 187 KB of shared memory and dQ's
    576 accumulators per row more registers than a warp has."""
    if max(head_dim, head_dim_v) <= NARROW_HEAD_DIM:
        return _pick(DQ_TENSOR_CORE_TILES, head_dim, head_dim_v)
    return _pick(BACKWARD_TILES, head_dim, head_dim_v)


def backward_tile(head_dim: int, head_dim_v: int, dtype=np.float32, compute_capability: int = 80,
                  shared_limit: int = LEAST_SHARED_LIMIT):
    """The backward configuration: for fp16/bf16 the wgmma dK/dV (HopperBackwardTile) on compute
    capability 9.0 up to D = 128 and the mma.sync one (TensorCoreBackwardTile) otherwise, the
    first of its head dim's tiles whose shared memory fits ``shared_limit`` (the GPU's opt-in
    bytes per block: _kernel_backend.shared_limit; the default fits every GPU); for fp32 the
    CUDA-core dK/dV and dQ (BackwardTile)."""
    if np.dtype(dtype) in TENSOR_CORE_DTYPES:
        if compute_capability == 90 and max(head_dim, head_dim_v) <= HOPPER_BACKWARD_TILES[-1].head_dim:
            return _pick(HOPPER_BACKWARD_TILES, head_dim, head_dim_v)
        first = _pick(TENSOR_CORE_BACKWARD_TILES, head_dim, head_dim_v)
        same = [t for t in TENSOR_CORE_BACKWARD_TILES if t.head_dim == first.head_dim]
        # None fitting (a WIDE tile on a 99 KB GPU): the last, which the launcher refuses by name.
        return next((t for t in same if t.shared_bytes <= shared_limit), same[-1])
    return _pick(BACKWARD_TILES, head_dim, head_dim_v)


def kernel_variants(arch: str = "sm_80"):
    """Every (file, name expression, dtype) the table can select on ``arch``: what the compile
    report builds. On sm_90 that includes the wgmma kernels, which compile for sm_90a
    (FILE_ARCH)."""
    variants = []
    for dtype in CTYPES:
        if dtype in TENSOR_CORE_DTYPES:
            variants += [("attention_fwd_tc.cu", tile.name_expression(dtype), dtype) for tile in TENSOR_CORE_TILES]
            if arch in ("sm_90", HOPPER_ARCH):
                variants += [("attention_fwd_wgmma.cu", tile.name_expression(dtype), dtype) for tile in HOPPER_TILES]
                variants += [("attention_bwd_wgmma.cu", t.name_expression(dtype, accumulate), dtype)
                             for t in HOPPER_BACKWARD_TILES for accumulate in (True, False)]
        else:
            variants += [("attention_fwd.cu", tile.name_expression(dtype), dtype) for tile in FORWARD_TILES]
        variants.append(("attention_bwd.cu", preprocess_name(dtype), dtype))
        if dtype in TENSOR_CORE_DTYPES:
            variants += [("attention_bwd_tc.cu", t.name_expression(dtype), dtype) for t in TENSOR_CORE_BACKWARD_TILES]
            variants += [("attention_bwd_tc.cu", t.dq_name(dtype), dtype) for t in DQ_TENSOR_CORE_TILES
                         if t.head_dim <= NARROW_HEAD_DIM]
            variants += [("attention_bwd.cu", t.dq_name(dtype), dtype) for t in BACKWARD_TILES
                         if t.head_dim > NARROW_HEAD_DIM]
        else:
            variants += [("attention_bwd.cu", t.dkdv_name(dtype), dtype) for t in BACKWARD_TILES]
            variants += [("attention_bwd.cu", t.dq_name(dtype), dtype) for t in BACKWARD_TILES]
        variants += [(COMBINE_FILE, combine_name(part, dtype), dtype) for part in dict.fromkeys((np.dtype(np.float32), dtype))]
        variants += [(DecodeTile.filename, t.name_expression(dtype), dtype) for t in DECODE_TILES]
    return variants
