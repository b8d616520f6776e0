"""README's "Performance without a GPU" tables from the SASS audit and the emulator's memory
counters, occupancy by calculation.

    python -m cupy_attn kernels --arch sm_80 sm_90 --sass --boundary --json > kernels.json
    python -m cupy_attn kernels --memory --json > memory.json
    python bench/audit_table.py kernels.json memory.json

fp16, D = 64/128/256, each tensor-core kernel family; the plain build (what a call without
softcap, ALiBi or a mask runs), with the counts of the build for softcap, ALiBi and a float mask
together (the report's "all") beside it, and the plain build's boundary tiles (--boundary: a tile
on the causal diagonal, a window's edge or a sequence's end, whose scores are masked). Occupancy
on sm_90 (65,536 registers, 228 KB shared memory per SM, 1 KB of it reserved per block, registers
allocated per warp in units of 256): blocks of 4 warps per SM, the lesser of what registers and
shared memory allow.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cupy_attn import _config  # noqa: E402
from cupy_attn._memory_report import ratio  # noqa: E402

FP16 = np.dtype(np.float16)


def hopper_backward_tiles() -> dict:
    """fp16 name expression -> tile of the wgmma dK/dV, both kernels of each tile (dQ by its
    reductions, or by the deterministic kernel after)."""
    return {t.name_expression(FP16, accumulate): t for t in _config.HOPPER_BACKWARD_TILES for accumulate in (True, False)}


def shared_bytes() -> dict[str, int]:
    """fp16 name expression -> dynamic shared memory per block, from the tile table."""
    sizes = {t.name_expression(FP16): t.shared_bytes for t in
             (*_config.TENSOR_CORE_TILES, *_config.HOPPER_TILES, *_config.TENSOR_CORE_BACKWARD_TILES)}
    sizes.update({name: t.shared_bytes for name, t in hopper_backward_tiles().items()})
    sizes.update({t.dq_name(FP16): t.dq_shared_bytes for t in _config.DQ_TENSOR_CORE_TILES})
    return sizes


def hopper_tile(name: str):
    """The wgmma forward's tile whose fp16 kernel is `name`, or None."""
    return next((t for t in _config.HOPPER_TILES if t.name_expression(FP16) == name), None)


def threads(name: str) -> int:
    """Threads per block of the kernel `name`: the tile table's where it says (the warp-specialised
    wgmma kernels' three warpgroups, the mma.sync dK/dV's warps), else every kernel's."""
    backward = next((t for t in _config.TENSOR_CORE_BACKWARD_TILES if t.name_expression(FP16) == name), None)
    backward = backward or hopper_backward_tiles().get(name)
    return getattr(hopper_tile(name) or backward, "threads", _config.THREADS)


def blocks_per_sm(registers: int, shared: int, block_threads: int = _config.THREADS) -> int:
    """Blocks per SM on sm_90 that registers (at the launch's count per thread) and shared memory allow."""
    warps = min(64, 65536 // (-(-registers * 32 // 256) * 256))
    return min(warps * 32 // block_threads, (228 * 1024) // (shared + 1024), 32)


def featured_name(name: str) -> str:
    """The kernel a call with softcap, ALiBi and a float mask runs where a plain call runs `name`:
    the same, except for a wgmma forward tile that does not serve such calls (HopperTile.serves)
    and an mma.sync forward tile that serves calls without a mask only."""
    tile = hopper_tile(name)
    if tile is not None:
        return _config.forward_tile(tile.head_dim, tile.head_dim, FP16, 90, _config.ALL_FEATURES).name_expression(FP16)
    tile = next((t for t in _config.TENSOR_CORE_TILES if t.name_expression(FP16) == name), None)
    if tile is not None and tile.unmasked_only:
        return _config.forward_tile(tile.head_dim, tile.head_dim, FP16, 80, _config.ALL_FEATURES).name_expression(FP16)
    return name


# The tensor-core kernels the tables show: (audit table label, resource table label, name prefix).
KERNELS = (("forward (mma.sync)", "forward (mma.sync)", "attention_fwd_tc<"),
           ("forward (wgmma)", "forward (wgmma)", "attention_fwd_wgmma<"),
           ("dK/dV (mma.sync)", "dK/dV (mma.sync)", "attention_bwd_dkdv_tc<"),
           ("dK/dV (wgmma)", "dK/dV (wgmma)", "attention_bwd_dkdv_wgmma<"),
           ("dQ (mma.sync)", "deterministic dQ", "attention_bwd_dq_tc<"))


def is_fp16_variant(name: str, prefix: str, head_dim: int) -> bool:
    """Whether name is the fp16 instantiation of kernel `prefix` for head-dim tile head_dim."""
    head = f"{prefix}__half, {head_dim}"
    return name.startswith(head) and name[len(head)] in ",>"


def tile_keys(name: str, head_dim: int) -> str:
    """", N keys" where the table has several tiles of one kernel and head dim (the wgmma forward's,
    the mma.sync dK/dV's at D = 128), ", deterministic dQ" for the wgmma dK/dV that leaves dQ to
    the deterministic kernel, else ""."""
    if name.startswith("attention_fwd_wgmma<"):
        return f", {name.split(', ')[-1][:-1]} keys"
    if name.startswith("attention_bwd_dkdv_wgmma<") and name.endswith("false>"):
        return ", deterministic dQ"
    if name.startswith("attention_bwd_dkdv_tc<") and head_dim == 128:
        return f", {name.split(', ')[3]} keys"
    if name.startswith("attention_fwd_tc<") and sum(t.head_dim == head_dim for t in _config.TENSOR_CORE_TILES) > 1:
        return f", {name.split(', ')[2]} rows"
    return ""


def boundary(row: dict) -> str:
    """A plain build's boundary-tile issue_per_tensor and path (the report's --boundary), or —."""
    if row.get("boundary_issue_per_tensor") is None:
        return "—"
    return f"{row['boundary_issue_per_tensor']:.2f} ({row['boundary_path_instructions']})"


def exposed(row: dict) -> str:
    """A wgmma build's exposed_per_tensor and exposed instructions, or — (mma.sync)."""
    if row.get("exposed_per_tensor") is None:
        return "—"
    return f"{row['exposed_per_tensor']:.2f} ({row['exposed_instructions']})"


def table(rows: list[dict]) -> str:
    sizes = shared_bytes()
    lines = ["| kernel | D | arch | path / loop instructions | with softcap, ALiBi and a float mask | tensor instructions "
             "| ldsm | lds | sts | bar | mufu (per tensor cycle) | shared wavefronts (per tensor cycle) | issue_per_tensor "
             "| exposed | boundary tile | registers | blocks (warps) per SM |",
             "|" + "---|" * 17]
    general = {(r["name"], r["arch"]): r for r in rows if r.get("features") == "all"}
    for kind, _, prefix in KERNELS:
        for d in (64, 128, 256):
            for r in rows:
                if r["dtype"] != "float16" or not is_fp16_variant(r["name"], prefix, d):
                    continue
                if r.get("features", "plain") != "plain":
                    continue
                other = general.get((featured_name(r["name"]), r["arch"]))
                built_in = f"{other['path_instructions']} / {other['loop_instructions']}" if other else "—"
                tensors = ", ".join(f"{n} {op}" for op, n in r["tensor_instructions"].items())
                blocks = blocks_per_sm(r["registers"], sizes[r["name"]], threads(r["name"]))
                occupancy = f"{blocks} ({blocks * threads(r['name']) // 32})" if r["arch"] != "sm_80" else "—"
                lines.append(f"| {kind}{tile_keys(r['name'], d)} | {d} | {r['arch']} | {r['path_instructions']} / {r['loop_instructions']} "
                             f"| {built_in} | {tensors} | {r['ldsm']} | {r['lds']} | {r['sts']} | {r['bar']} | {r['mufu']} ({r['mufu_per_tensor']:.2f}) "
                             f"| {r['shared_wavefronts']:g} ({r['shared_per_tensor']:.2f}) | {r['issue_per_tensor']:.2f} | {exposed(r)} | {boundary(r)} | {r['registers']} | {occupancy} |")
    return "\n".join(lines)


def resources_table(rows: list[dict]) -> str:
    """README's resource table: registers of the plain build (softcap, ALiBi and a float mask's in brackets) on
    sm_80 and sm_90 (sm_90a for wgmma), shared memory from the tile table, blocks per SM on sm_90."""
    sizes = shared_bytes()
    registers = {(r["name"], r["arch"], r.get("features", "plain")): r["registers"] for r in rows
                 if r["dtype"] == "float16"}
    lines = ["| kernel (fp16) | registers sm_80 / sm_90, plain build (softcap, ALiBi, float mask) | shared memory "
             "| threads per block | blocks per SM on sm_90, plain (softcap, ALiBi, float mask) |", "|---|---|---|---|---|"]

    def shown(x):
        return "—" if x is None else x

    def regs(name, arch):
        plain, general = registers.get((name, arch, "plain")), registers.get((name, arch, "all"))
        return "—" if plain is None and general is None else f"{shown(plain)} ({shown(general)})"

    for _, kind, prefix in KERNELS:
        for d in (64, 128, 256):
            for name in sorted({n for n, _, _ in registers if is_fp16_variant(n, prefix, d)}):
                hopper = "_wgmma<" in name
                sm90 = "sm_90a" if hopper else "sm_90"
                blocks = [shown(registers.get((name, sm90, f)) and
                                blocks_per_sm(registers[(name, sm90, f)], sizes[name], threads(name)))
                          for f in ("plain", "all")]
                label = f"{kind}, D = {d}" + tile_keys(name, d)
                lines.append(f"| {label} | {regs(name, 'sm_80')} / {regs(name, sm90)}{' (sm_90a)' if hopper else ''} "
                             f"| {round(sizes[name] / 1024)} KB | {threads(name)} | {blocks[0]} ({blocks[1]}) |")
    return "\n".join(lines)


def memory_table(rows: list[dict]) -> str:
    lines = ["| family | D | pass | kernel | shared wavefronts / ideal | ratio | global sectors / ideal | ratio | worst site |",
             "|" + "---|" * 9]
    for r in rows:
        worst = max(r["sites"], key=lambda s: (ratio(s["actual"], s["ideal"]), s["actual"]))
        lines.append(f"| {r['family']} | {r['head_dim']} | {r['pass']} | `{r['kernel']}` "
                     f"| {r['smem_wavefronts']} / {r['smem_ideal']} | {ratio(r['smem_wavefronts'], r['smem_ideal']):.2f} "
                     f"| {r['gmem_sectors']} / {r['gmem_ideal']} | {ratio(r['gmem_sectors'], r['gmem_ideal']):.2f} "
                     f"| {worst['space']} {worst['site']}: {ratio(worst['actual'], worst['ideal']):.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    kernel_rows = json.loads(Path(sys.argv[1]).read_text())
    print(table(kernel_rows))
    print()
    print(resources_table(kernel_rows))
    if len(sys.argv) > 2:
        print()
        print(memory_table(json.loads(Path(sys.argv[2]).read_text())))
