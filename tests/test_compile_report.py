"""Every kernel variant compiles under NVRTC for sm_80 and sm_90, without spills (no GPU needed)."""
import json

import numpy as np

from cupy_attn import _config, cli
from helpers import BF16


def test_every_variant_compiles_without_spills(tmp_path, capsys):
    status = cli.main(["kernels", "--arch", "sm_80", "sm_90", "--json", "--ptx-dir", str(tmp_path)])
    rows = json.loads(capsys.readouterr().out)
    assert status == 0
    assert len(rows) == 2 * len(_config.kernel_variants())
    keys = {"name", "arch", "registers", "spill_stores", "spill_loads", "static_shared_bytes", "compile_seconds"}
    for row in rows:
        assert keys <= row.keys()
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
        assert 0 < row["registers"] <= 255
    for arch in ("sm_80", "sm_90"):
        for dtype in ("float16", "bfloat16", "float32"):
            tensor_cores = dtype != "float32"
            expected = {
                "attention_fwd": 0 if tensor_cores else len(_config.FORWARD_TILES),
                "attention_fwd_tc": len(_config.TENSOR_CORE_TILES) if tensor_cores else 0,
                "attention_bwd_preprocess": 1,
                "attention_bwd_dkdv": 0 if tensor_cores else len(_config.BACKWARD_TILES),
                "attention_bwd_dq": 0 if tensor_cores else len(_config.BACKWARD_TILES),
                "attention_bwd_dkdv_tc": len(_config.TENSOR_CORE_BACKWARD_TILES) if tensor_cores else 0,
                "attention_bwd_dq_tc": len(_config.TENSOR_CORE_TILES) if tensor_cores else 0,
            }
            for kernel, count in expected.items():
                files = [f for f in tmp_path.glob(f"{kernel}_*_{dtype}_{arch}.ptx") if not f.name.startswith(kernel + "_tc_")]
                assert len(files) == count, (kernel, dtype, arch)
                assert all(".entry" in f.read_text() for f in files)
                # Every fp16/bf16 kernel with a matrix product runs it on tensor cores (the
                # preprocess kernel is a row-wise dot product, dO·O).
                if tensor_cores and kernel != "attention_bwd_preprocess":
                    assert all("mma.sync.aligned.m16n8k16" in f.read_text() and "ldmatrix" in f.read_text()
                               and "cp.async" in f.read_text() for f in files), (kernel, dtype, arch)


def test_tile_tables_cover_every_head_dim():
    for d in range(1, _config.MAX_HEAD_DIM + 1):
        fwd, bwd = _config.forward_tile(d, d), _config.backward_tile(d, d)
        tc = _config.forward_tile(d, d, np.float16)
        assert tc.head_dim >= d and tc.head_dim % 16 == 0 and tc.block_n % 16 == 0
        assert max(tc.shared_bytes, tc.dq_shared_bytes) <= 99 * 1024
        for dtype in (np.float16, BF16):
            tcb = _config.backward_tile(d, d, dtype)
            assert isinstance(tcb, _config.TensorCoreBackwardTile) and tcb.head_dim >= d
            assert tcb.shared_bytes <= 99 * 1024 and (tcb.head_dim // tcb.dim_warps) % 16 == 0
        assert isinstance(bwd, _config.BackwardTile)
        assert fwd.head_dim >= d and bwd.head_dim >= d
        # 4 warps of 32 / lanes_per_row rows; every shared-memory budget fits sm_86's 99 KB opt-in limit
        assert fwd.block_m == _config.THREADS // fwd.lanes_per_row
        assert bwd.dq_block_m == _config.THREADS // bwd.dq_lanes_per_row
        assert max(fwd.shared_bytes, bwd.dkdv_shared_bytes, bwd.dq_shared_bytes) <= 99 * 1024
        assert fwd.head_dim % fwd.lanes_per_row == 0 and fwd.block_n % fwd.lanes_per_row == 0
        assert _config.THREADS % bwd.block_n == 0 and _config.THREADS % bwd.block_m == 0
    assert np.dtype(np.float16) in _config.CTYPES
