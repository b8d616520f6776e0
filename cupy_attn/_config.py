"""The one table of kernel tile configurations.

The kernels take these numbers as template arguments through name expressions, so this table is
the only place they are written down. Each entry says why it was chosen; entries measured on a
GPU say so, the rest are reasoned from register and shared-memory budgets (no GPU has measured
them yet).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._arrays import BFLOAT16

# C++ spellings of the storage types the kernels are instantiated for.
CTYPES = {np.dtype(np.float16): "__half", BFLOAT16: "__nv_bfloat16", np.dtype(np.float32): "float"}

FWD_THREADS = 128  # 4 warps; must match attn::kFwdThreads in kernels/attention_fwd.cu


@dataclass(frozen=True)
class ForwardTile:
    """A forward configuration for head dims (D and Dv) up to ``head_dim``."""

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


# The same tiles serve fp16, bf16 and fp32: this CUDA-core kernel stages every tile as float32.
# Per-lane registers: D / lanes_per_row output accumulators + block_n / lanes_per_row scores,
# kept at <= 32 + 32 so that no variant spills.
FORWARD_TILES = (
    ForwardTile(32, 64, 64, 2, "16 accumulators + 32 scores per lane; 40 KB shared"),
    ForwardTile(64, 64, 64, 2, "32 accumulators + 32 scores per lane; 64 KB shared"),
    ForwardTile(128, 32, 64, 4, "32 accumulators + 16 scores per lane; 88 KB shared"),
    ForwardTile(256, 16, 32, 8, "32 accumulators + 4 scores per lane; 82 KB shared (fits sm_86's 99 KB)"),
)
MAX_HEAD_DIM = FORWARD_TILES[-1].head_dim


def forward_tile(head_dim: int, head_dim_v: int) -> ForwardTile:
    need = max(head_dim, head_dim_v)
    for tile in FORWARD_TILES:
        if need <= tile.head_dim:
            return tile
    raise ValueError(
        f"head dims up to {MAX_HEAD_DIM} are supported by the CUDA kernels, got D = {head_dim}, Dv = {head_dim_v}; "
        "use backend='numpy' for larger ones"
    )


def forward_variants():
    """Every (dtype, tile) the table can select: what the compile report builds."""
    return [(dtype, tile) for tile in FORWARD_TILES for dtype in CTYPES]
