"""Every kernel variant compiles under NVRTC for sm_80 and sm_90, without spills (no GPU needed)."""
import json

import numpy as np

from cupy_attn import _config, cli


def test_every_variant_compiles_without_spills(tmp_path, capsys):
    status = cli.main(["kernels", "--arch", "sm_80", "sm_90", "--json", "--ptx-dir", str(tmp_path)])
    rows = json.loads(capsys.readouterr().out)
    assert status == 0
    assert len(rows) == 2 * len(_config.forward_variants())
    keys = {"name", "arch", "registers", "spill_stores", "spill_loads", "static_shared_bytes", "compile_seconds"}
    for row in rows:
        assert keys <= row.keys()
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
        assert 0 < row["registers"] <= 255
    for arch in ("sm_80", "sm_90"):
        for dtype in ("float16", "bfloat16", "float32"):
            files = list(tmp_path.glob(f"attention_fwd*_{dtype}_{arch}.ptx"))
            assert len(files) == len(_config.FORWARD_TILES)
            assert all(".entry" in f.read_text() for f in files)


def test_tile_table_covers_every_head_dim():
    for d in range(1, _config.MAX_HEAD_DIM + 1):
        tile = _config.forward_tile(d, d)
        assert tile.head_dim >= d
        assert tile.block_m == 4 * 32 // tile.lanes_per_row  # 4 warps of 32 / lanes_per_row rows
        assert tile.shared_bytes <= 99 * 1024  # fits every sm_80+ GPU's opt-in limit
        assert tile.head_dim % tile.lanes_per_row == 0 and tile.block_n % tile.lanes_per_row == 0
    assert np.dtype(np.float16) in _config.CTYPES
