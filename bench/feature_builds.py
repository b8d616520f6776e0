"""Every score-feature build of the tensor-core kernels through ptxas and the SASS audit: the
compile report (`python -m cupy_attn kernels --sass`) builds three feature sets (plain, all and
dropout); a call runs the build of exactly its own features, one of _config.FEATURE_SETS, so this
builds each one the launcher can choose and reports its spills and hot loop.

    python bench/feature_builds.py [--kernels attention_fwd_wgmma] [--dtypes float16] [--head-dims 64] [--mods] [--json]

One row per (kernel, feature set): registers, spill stores and loads, the hot loop's fastest path
per tile, issue_per_tensor, mufu_per_tensor, shared_per_tensor and exposed_per_tensor (wgmma
kernels), as the compile report gives them. With --mods, the builds of bench/bench_mods.py's three
mods instead (a document mask and a window with global tokens, each with and without a block mask,
and a bias table; without score features and with softcap), for the variants a call with mods runs.
Exit status 1 where a build spills. No GPU needed: NVRTC and nvdisasm from the pip wheels.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cupy_attn import _compile, _config, _mods_source, _nvrtc, _sass  # noqa: E402


def bench_mods():
    """(label, ModSource) of bench_mods.py's three cases, the two with a mask_mod also with a block
    mask (which comes with a mask_mod: bench_mods.py builds one for those two)."""
    import numpy as np
    from bench_mods import mods_for

    s = 256
    doc, table, buckets = np.zeros((1, s), np.int32), np.zeros((4, 33), np.float32), np.zeros((s, s), np.int32)
    return [(f"{case}{' + block mask' if block else ''}",
             _mods_source.mod_source(m.get("score_mod"), m.get("mask_mod"), block_sparse=block))
            for case in ("document", "window", "bias") for m in [mods_for(case, np, doc, table, buckets, 64)]
            for block in ((False, True) if "mask_mod" in m else (False,))]


def feature_build_rows(kernels, dtypes, arch: str = "sm_90", mods: bool = False, head_dims=None) -> list[dict]:
    """Rows for each variant of `kernels` (names without template arguments) that the table lists
    on `arch`, in `dtypes` and, unless None, `head_dims`, and each feature set a call can run it with
    (_config.selectable); with `mods`, each of bench_mods' mods without score features and with
    softcap instead."""
    rows = []
    builds = ([(label, m, f) for label, m in bench_mods() for f in (_config.PLAIN_FEATURES, _config.SOFTCAP)] if mods
              else [(None, None, f) for f in _config.FEATURE_SETS])
    for filename, name, dtype in _config.kernel_variants(arch):
        if name.split("<")[0] not in kernels or str(dtype) not in dtypes:
            continue
        if head_dims is not None and int(name.split(",")[1]) not in head_dims:  # <type, head dim, ...>
            continue
        build_arch = _config.FILE_ARCH.get(filename, arch)
        for label, mod, features in builds:
            if not _config.selectable(filename, name, features, mods=mod is not None):
                continue
            c, _ = _nvrtc.compile_kernel_least_spills(
                _compile.kernel_source(filename) + (mod.code if mod else ""), name, build_arch,
                _compile.gpu_build_options(filename, features) + (mod.options if mod else ()))
            report = _sass.hot_loop_report(*_sass.disassemble(c.cubin), build_arch).as_row()
            words = _config.feature_words(features)
            rows.append({"name": name, "arch": build_arch, "features": f"{label}, {words}" if mod else words,
                         "registers": c.registers, "spill_stores": c.spill_stores, "spill_loads": c.spill_loads,
                         **{k: report[k] for k in ("path_instructions", "issue_per_tensor", "mufu_per_tensor",
                                                   "shared_per_tensor", "exposed_instructions", "exposed_per_tensor")}})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", nargs="+", default=["attention_fwd_wgmma"],
                        help="kernel names without template arguments (default: the wgmma forward)")
    parser.add_argument("--dtypes", nargs="+", default=["float16"], choices=["float16", "bfloat16"])
    parser.add_argument("--head-dims", nargs="+", type=int, help="only the variants of these head dims (default: all)")
    parser.add_argument("--arch", default="sm_90", choices=["sm_80", "sm_86", "sm_89", "sm_90"])
    parser.add_argument("--mods", action="store_true", help="build bench_mods.py's mods instead of the feature sets")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    args = parser.parse_args(argv)
    head_dims = args.head_dims and set(args.head_dims)
    rows = feature_build_rows(set(args.kernels), set(args.dtypes), args.arch, args.mods, head_dims)
    if not rows:
        of_head_dims = f" of head dims {', '.join(map(str, args.head_dims))}" if head_dims else ""
        parser.error(f"no variant of {', '.join(args.kernels)} in {', '.join(args.dtypes)}{of_head_dims} on {args.arch}")
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"NVRTC {_nvrtc.version()}\n")
        print("| kernel | features | registers | spill stores / loads | path | issue_per_tensor | mufu_per_tensor "
              "| shared_per_tensor | exposed |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:  # a kernel without tensor instructions has no hot loop to report (—)
            issue = "—" if r["issue_per_tensor"] is None else f"{r['issue_per_tensor']:.3f}"
            mufu = "—" if r["mufu_per_tensor"] is None else f"{r['mufu_per_tensor']:.3f}"
            shared = "—" if r["shared_per_tensor"] is None else f"{r['shared_per_tensor']:.3f}"
            exposed = "—" if r["exposed_per_tensor"] is None else f"{r['exposed_per_tensor']:.3f} ({r['exposed_instructions']})"
            print(f"| `{r['name']}` | {r['features']} | {r['registers']} | {r['spill_stores']} / {r['spill_loads']} "
                  f"| {r['path_instructions'] if issue != '—' else '—'} | {issue} | {mufu} | {shared} | {exposed} |")
    return 1 if any(r["spill_stores"] or r["spill_loads"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
