"""``python -m cupy_attn {info,demo,kernels}``."""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np

from . import __version__, _backends, _paths, emulator, masks, reference
from .heads import merge_heads, multi_head_attention, split_heads


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    found = {}
    for dist in ("numpy", "scipy", "ml_dtypes", "cupy-cuda12x", "cupy-cuda13x", "torch", "jax"):
        try:
            found[dist] = md.version(dist)
        except md.PackageNotFoundError:
            found[dist] = "not installed"
    return found


def info(_args) -> int:
    print(f"cupy_attn {__version__} on Python {platform.python_version()} ({platform.machine()})")
    for dist, version in _versions().items():
        print(f"  {dist:<14} {version}")
    print(f"kernel sources: {_paths.kernel_dir()}")
    usable, why = emulator.available()
    print(f"emulator: {'usable' if usable else 'unusable'} ({why})")
    gpu, why = _backends.cuda_status()
    print(f"GPU: {'yes' if gpu else 'no'} ({why})")
    print("backends:")
    for name, (usable, reason) in _backends.available().items():
        print(f"  {name:<9} {'available' if usable else 'unavailable'}: {reason}")
    return 0


def _best_backend() -> tuple[str, str]:
    usable = _backends.available()
    if usable["cuda"][0]:
        return "cuda", "a GPU and the CUDA kernels are available"
    return "numpy", f"CUDA backend unavailable: {usable['cuda'][1]}"


# (batch, seq, embed, heads, kv_heads, mask kind): small enough for the float64 reference.
_CASES = [
    (2, 128, 256, 4, 4, None),
    (2, 257, 256, 8, 2, "causal"),
    (1, 1024, 512, 8, 8, "padding"),
    (4, 113, 384, 6, 1, "window"),
]


def _mask_keywords(kind, batch, seq, rng):
    if kind == "causal":
        return {"causal": True}
    if kind == "window":
        return {"window": (32, 0)}
    if kind == "padding":
        lengths = rng.integers(seq // 2, seq + 1, size=batch)
        return {"mask": masks.padding_mask(lengths, seq)}
    return {}


def _reference_mha(x, w_q, w_k, w_v, w_o, heads, kv_heads, keywords):
    q, k, v = (split_heads(x @ w, n) for w, n in ((w_q, heads), (w_k, kv_heads), (w_v, kv_heads)))
    out, _ = reference.attention(q, k, v, **keywords)
    return merge_heads(out) @ w_o


def demo(args) -> int:
    backend, why = _best_backend()
    if args.dtype == "float64" and backend != "numpy":
        backend, why = "numpy", "float64 runs on the NumPy backend only"
    print(f"backend: {backend}; {why}")
    if backend == "cuda":
        import cupy

        to_device, to_host = cupy.asarray, cupy.asnumpy
    else:
        to_device = to_host = np.asarray
    rng = np.random.default_rng(args.seed)
    dtype = np.dtype(args.dtype)
    tolerance = {np.float32: 1e-4, np.float64: 1e-10}[dtype.type]
    failures = 0
    print(f"{'B':>3} {'S':>5} {'E':>4} {'H':>3} {'Hkv':>3} {'mask':>8} {'max |err|':>10} {'ms':>8}")
    for batch, seq, embed, heads, kv_heads, kind in _CASES:
        head_dim = embed // heads
        x = rng.standard_normal((batch, seq, embed)).astype(dtype)
        w_q, w_k, w_v = ((rng.standard_normal((embed, n * head_dim)) / np.sqrt(embed)).astype(dtype)
                         for n in (heads, kv_heads, kv_heads))
        w_o = (rng.standard_normal((heads * head_dim, embed)) / np.sqrt(embed)).astype(dtype)
        keywords = _mask_keywords(kind, batch, seq, rng)
        device_arrays = [to_device(a) for a in (x, w_q, w_k, w_v, w_o)]
        device_keywords = {n: to_device(a) if isinstance(a, np.ndarray) else a for n, a in keywords.items()}
        start = time.perf_counter()
        y = to_host(multi_head_attention(*device_arrays, heads, num_kv_heads=kv_heads, backend=backend,
                                         **device_keywords))
        ms = (time.perf_counter() - start) * 1e3
        ref = _reference_mha(*(a.astype(np.float64) for a in (x, w_q, w_k, w_v, w_o)), heads, kv_heads, keywords)
        err = float(np.abs(np.asarray(y, np.float64) - ref).max())
        failures += not err <= tolerance
        print(f"{batch:>3} {seq:>5} {embed:>4} {heads:>3} {kv_heads:>3} {kind or '-':>8} {err:>10.2e} {ms:>8.1f}")
    print(f"{'all cases' if not failures else f'{failures} case(s) NOT'} within {tolerance:g} of the float64 reference")
    return 1 if failures else 0


def memory(args) -> int:
    from ._memory_report import memory_report, ratio

    rows = memory_report()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'family':<9} {'D':>3} {'pass':<27} {'kernel':<52} {'smem wavefronts / ideal':>24} {'gmem sectors / ideal':>22}")
    for r in rows:
        print(f"{r['family']:<9} {r['head_dim']:>3} {r['pass']:<27} {r['kernel']:<52} "
              f"{r['smem_wavefronts']:>9} / {r['smem_ideal']:<7} {ratio(r['smem_wavefronts'], r['smem_ideal']):>5.2f} "
              f"{r['gmem_sectors']:>8} / {r['gmem_ideal']:<6} {ratio(r['gmem_sectors'], r['gmem_ideal']):>5.2f}")
        for site in r["sites"]:
            print(f"    {site['space']:<6} {site['site']:<40} {site['accesses']:>7} accesses {site['actual']:>8} / "
                  f"{site['ideal']:<8} {ratio(site['actual'], site['ideal']):>5.2f}")
    return 0


def boundary_tile_report(filename: str, name: str, arch: str) -> dict:
    """The hot loop of a boundary tile (causal diagonal, window edge, sequence end) of a plain
    build: its fastest path in the build that takes every tile as one
    (_compile.BOUNDARY_MODEL_OPTIONS)."""
    from . import _compile, _config, _nvrtc, _sass

    c, _ = _nvrtc.compile_kernel_least_spills(_compile.kernel_source(filename), name, arch,
                                              _compile.gpu_build_options(filename, _config.PLAIN_FEATURES)
                                              + _compile.BOUNDARY_MODEL_OPTIONS)
    report = _sass.hot_loop_report(*_sass.disassemble(c.cubin), arch)
    return {"boundary_path_instructions": report.path_instructions,
            "boundary_issue_per_tensor": None if report.issue_per_tensor is None else round(report.issue_per_tensor, 3)}


def kernels(args) -> int:
    from . import _compile, _config, _nvrtc, _sass

    if args.memory:
        return memory(args)
    if args.boundary and not args.sass:
        raise SystemExit("python -m cupy_attn kernels: --boundary models the hot loop of --sass; give both")
    if args.kernels:  # a name some architecture has (one the requested ones lack selects nothing there)
        known = {name.split("<")[0] for arch in ARCHES for _, name, _ in _config.kernel_variants(arch)}
        unknown = sorted(set(args.kernels) - known)
        if unknown:
            raise SystemExit(f"python -m cupy_attn kernels: no kernel named {', '.join(unknown)}; the kernels are: "
                             f"{', '.join(sorted(known))}")
    if args.ptx_dir:
        try:
            args.ptx_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SystemExit(f"python -m cupy_attn kernels: --ptx-dir {args.ptx_dir} is not a usable directory: "
                             f"{error.strerror}") from None
    rows = []
    levels = _config.FEATURE_NAMES
    for requested in args.arch:
        for (filename, name, dtype), features in itertools.product(_config.kernel_variants(requested), args.features):
            if (str(dtype) not in args.dtypes or (args.kernels and name.split("<")[0] not in args.kernels)
                    or not _config.selectable(filename, name, levels[features])):
                continue  # not asked for, or no call runs it (_config.HopperTile.serves)
            arch = _config.FILE_ARCH.get(filename, requested)
            c, attempts = _nvrtc.compile_kernel_least_spills(_compile.kernel_source(filename), name, arch,
                                                             _compile.gpu_build_options(filename, levels[features]))
            row = {"name": name, "features": features, "dtype": str(dtype), "arch": arch, "attempts": attempts,
                   "registers": c.registers,
                   "spill_stores": c.spill_stores, "spill_loads": c.spill_loads, "stack_frame_bytes": c.stack_frame_bytes,
                   "static_shared_bytes": c.static_shared_bytes, "compile_seconds": round(c.compile_seconds, 3),
                   "advisories": _sass.advisories(c.log)}
            if args.sass:
                row.update(_sass.hot_loop_report(*_sass.disassemble(c.cubin), arch).as_row())
                if args.boundary and features == "plain" and row["issue_per_tensor"] is not None:
                    row.update(boundary_tile_report(filename, name, arch))
            rows.append(row)
            if args.ptx_dir:
                stem = "_".join(re.findall(r"\w+", name))
                (args.ptx_dir / f"{stem}_{dtype}_{arch}_{features}.ptx").write_text(c.ptx)
    if not rows:
        raise SystemExit("python -m cupy_attn kernels: no kernel variant matches --arch, --kernels, --dtypes and "
                         "--features together (the tensor-core kernels take float16 and bfloat16 only)")
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"NVRTC {_nvrtc.version()}")
        sass = f" {'loop':>5} {'path':>5} {'tensor':>6} {'ldsm':>4} {'lds':>4} {'sts':>4} {'ldgsts':>6} {'tma':>3} {'bar':>3} " \
               f"{'mufu':>4} {'atom':>4} {'issue/tensor':>12} {'shared/tensor':>13} {'exposed':>7}" if args.sass else ""
        sass += f" {'boundary':>8}" if args.sass and args.boundary else ""
        print(f"{'kernel':<58} {'features':<8} {'arch':<7} {'regs':>4} {'spill st':>8} {'spill ld':>8} {'stack':>5} {'static smem':>11} "
              f"{'s':>6}{sass}")
        for r in rows:
            line = (f"{r['name']:<58} {r['features']:<8} {r['arch']:<7} {r['registers']:>4} {r['spill_stores']:>8} {r['spill_loads']:>8} "
                    f"{r['stack_frame_bytes']:>5} {r['static_shared_bytes']:>11} {r['compile_seconds']:>6.2f}")
            if args.sass:
                ratio = "—" if r["issue_per_tensor"] is None else f"{r['issue_per_tensor']:.2f}"
                exposed = "—" if r["exposed_per_tensor"] is None else f"{r['exposed_per_tensor']:.2f}"
                shared = "—" if r["shared_per_tensor"] is None else f"{r['shared_per_tensor']:.2f}"
                line += (f" {r['loop_instructions']:>5} {r['path_instructions']:>5} {sum(r['tensor_instructions'].values()):>6} "
                         f"{r['ldsm']:>4} {r['lds']:>4} {r['sts']:>4} {r['ldgsts']:>6} {r['tma']:>3} {r['bar']:>3} {r['mufu']:>4} "
                         f"{r['atomics']:>4} {ratio:>12} {shared:>13} {exposed:>7}")
                if r.get("boundary_issue_per_tensor") is not None:
                    line += f" {r['boundary_issue_per_tensor']:>8.2f}"
            print(line)
            for advisory in r["advisories"]:
                print(f"    ptxas: {advisory}")
    spills = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    if spills:
        print(f"{len(spills)} variant(s) spill registers", file=sys.stderr)
    return 1 if spills else 0


ARCHES = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")


def _seed(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return int(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupy_attn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, GPU and backend availability").set_defaults(run=info)
    d = sub.add_parser("demo", help="multi-head attention on random inputs, checked against the float64 reference")
    d.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    d.add_argument("--seed", type=_seed, default=0)
    d.set_defaults(run=demo)
    k = sub.add_parser("kernels", help="compile every kernel variant with NVRTC (no GPU needed): registers, spills, shared memory")
    k.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"], choices=ARCHES)
    k.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    k.add_argument("--ptx-dir", type=Path, help="write each variant's PTX here")
    k.add_argument("--boundary", action="store_true",
                   help="with --sass: also model each plain tensor-core build's boundary tiles (the causal "
                        "diagonal, a window's edges, a sequence's end), whose scores are masked: "
                        "boundary_path_instructions and boundary_issue_per_tensor")
    k.add_argument("--features", nargs="+", default=["plain", "all", "dropout"], choices=("plain", "all", "dropout"),
                   help="score-feature builds to compile (a call runs the build of exactly its features): plain (no "
                        "softcap, ALiBi, mask or dropout), all (softcap, ALiBi and a float mask) and dropout (Philox "
                        "dropout alone)")
    k.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16", "float32"], choices=("float16", "bfloat16", "float32"),
                   help="input types of the variants to compile")
    k.add_argument("--kernels", nargs="+", metavar="KERNEL",
                   help="only these kernels (their names without template arguments, e.g. attention_fwd_tc "
                        "attention_bwd_dkdv_wgmma); default: every kernel")
    k.add_argument("--memory", action="store_true",
                   help="run the tensor-core kernels (fp16, D = 64 and 128, both families) and the decoding kernel on the "
                        "emulator and report shared-memory wavefronts and global sectors against their minimum, per kernel "
                        "and access site")
    k.add_argument("--sass", action="store_true",
                   help="disassemble each cubin (nvdisasm) and report its hot loop: instruction mix and issue_per_tensor")
    k.set_defaults(run=kernels)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
