"""Every kernel variant compiles under NVRTC for sm_80 and sm_90 (the wgmma forward for sm_90a),
without spills or local memory (no GPU needed)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from cupy_attn import _compile, _config, _nvrtc, cli
from helpers import BF16


BUDGETS = Path(__file__).with_name("sass_budgets.json")
ROOT = Path(__file__).resolve().parent.parent
# The builds CI compiles: every variant's plain build on sm_80 and sm_90, the fp16 and fp32 variants'
# two others on sm_80, and on sm_90 those of the kernels only sm_90 runs (the wgmma kernels, sm_90a).
# A bf16 variant's code differs from its fp16 twin's only in conversions and the MMA's input type,
# which the plain build shows; the sm_90 builds of the other kernels are the sm_80 ones' source for
# another ptxas target, which their plain builds show. The SASS audit (--sass) runs on the
# tensor-core kernels, whose hot loops have budgets; the CUDA-core ones are checked for spills.
# `python -m cupy_attn kernels --sass` lists every build of every type on both.
PLAIN_ONLY = ("bfloat16",)
HOPPER_KERNELS = ("attention_fwd_wgmma", "attention_bwd_dkdv_wgmma")
TENSOR_CORE_KERNELS = ("attention_fwd_tc", "attention_bwd_dkdv_tc", "attention_bwd_dq_tc", *HOPPER_KERNELS)


def ci_builds(arch, name, dtype, words):
    return words == "plain" or (str(dtype) not in PLAIN_ONLY and (arch == "sm_80" or name.split("<")[0] in HOPPER_KERNELS))


def test_every_variant_compiles_without_spills(tmp_path, capsys):
    rows = []
    cuda_core = sorted({name.split("<")[0] for arch in ("sm_80", "sm_90") for _, name, _ in _config.kernel_variants(arch)}
                       - set(TENSOR_CORE_KERNELS))
    featured = ["--features", "all", "dropout", "--dtypes", "float16", "float32"]
    for audit, kernels in ((["--sass"], TENSOR_CORE_KERNELS), ([], cuda_core)):
        selections = [(["sm_80", "sm_90"], ["--features", "plain", "--dtypes", "float16", "bfloat16", "float32"], kernels),
                      (["sm_80"], featured, kernels)]
        if audit:  # the kernels only sm_90 runs are all tensor-core kernels
            selections.append((["sm_90"], featured, HOPPER_KERNELS))
        for archs, builds, names in selections:
            status = cli.main(["kernels", "--json", *audit, "--ptx-dir", str(tmp_path), "--arch", *archs, *builds,
                               "--kernels", *names])
            rows += json.loads(capsys.readouterr().out)
            assert status == 0
    audited = {r["name"].split("<")[0] for r in rows if "issue_per_tensor" in r}
    assert audited == set(TENSOR_CORE_KERNELS), audited
    check_sass_budgets(rows)
    expected = sorted((name, words) for arch in ("sm_80", "sm_90") for filename, name, dtype in _config.kernel_variants(arch)
                      for words, features in _config.FEATURE_NAMES.items()
                      if ci_builds(arch, name, dtype, words) and _config.selectable(filename, name, features))
    assert sorted((r["name"], r["features"]) for r in rows) == expected
    # unselectable, so not listed: the dropout builds of the wgmma forward's tiles that a call with
    # dropout alone does not take; the plain builds of the tiles that only calls with features or
    # mods take; and of the mma.sync forward's tiles that serve calls with a mask or mods where an
    # unmasked_only tile serves the rest, the plain and dropout builds
    masked_twins = sum(any(u.unmasked_only and u.head_dim == t.head_dim for u in _config.TENSOR_CORE_TILES)
                       and not t.unmasked_only for t in _config.TENSOR_CORE_TILES)
    assert masked_twins == 1
    # the tiles a call with dropout alone takes (one per head dim), and those that serve every call
    assert [(t.head_dim, t.block_n) for t in _config.HOPPER_TILES if _config.selectable(
        t.filename, t.name_expression(BF16), _config.DROPOUT_FEATURES)] == [(64, 128), (128, 64), (256, 32)]
    assert [(t.head_dim, t.block_n) for t in _config.HOPPER_TILES if t.serves(_config.ANY_FEATURES, True, True)] \
        == [(64, 64), (128, 64), (256, 32)]
    # so, for fp16 and bf16: without dropout alone 176 and 64 keys at D = 64, 128 at 128, 64 at 256
    # and the mma.sync twin; plain 64 keys at D = 64, 64 at 128, 32 at 256 and the twin
    assert (sum(not _config.selectable(f, n, _config.DROPOUT_FEATURES) for f, n, _ in _config.kernel_variants("sm_90")),
            sum(not _config.selectable(f, n, _config.PLAIN_FEATURES) for f, n, _ in _config.kernel_variants("sm_90"))) \
        == (2 * 5, 2 * 4)
    assert sum(not _config.selectable(f, n, _config.ALL_FEATURES) for f, n, _ in _config.kernel_variants("sm_80")) \
        == len(_config.TENSOR_CORE_DTYPES) * sum(t.unmasked_only for t in _config.TENSOR_CORE_TILES)
    keys = {"name", "features", "arch", "attempts", "registers", "spill_stores", "spill_loads", "stack_frame_bytes", "static_shared_bytes",
            "compile_seconds"}
    for row in rows:
        assert keys <= row.keys()
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0 and row["stack_frame_bytes"] == 0, row
        assert 0 < row["registers"] <= 255
        if row["name"].startswith(("attention_fwd_wgmma<", "attention_bwd_dkdv_wgmma<")):
            # the warp-specialised kernels: 168 per thread at launch, 384 x 168 = 64512 = 128 x 24 + 256 x 240: what the
            # warpgroups' setmaxnreg redistributes (with fewer, .inc 240 would wait forever)
            assert row["registers"] == _config.WS_LAUNCH_REGISTERS == 168, row
        assert row["arch"] == ("sm_90a" if "_wgmma<" in row["name"] else row["arch"])
    # the report builds as CuPy does on a GPU (test_report_builds_with_the_options_cupy_adds)
    filename, name = "attention_fwd_tc.cu", _config.TENSOR_CORE_TILES[1].name_expression(np.float16)
    as_on_gpu = _nvrtc.compile_kernel(_compile.kernel_source(filename), name, "sm_80",
                                      _compile.gpu_build_options(filename, _config.ALL_FEATURES))
    assert next(r for r in rows if r["name"] == name and r["arch"] == "sm_80" and r["features"] == "all")["registers"] \
        == as_on_gpu.registers
    # the mma.sync forward's tiles for calls without a mask or mods, whose build with a float mask no call runs
    plain_tc_tiles = [t for t in _config.TENSOR_CORE_TILES
                      if _config.selectable(_config.TensorCoreTile.filename, t.name_expression(np.float16), _config.PLAIN_FEATURES)]
    unmasked_only = tuple("_".join(re.findall(r"\w+", t.name_expression(dtype))) + "_"
                          for t in _config.TENSOR_CORE_TILES if t.unmasked_only for dtype in _config.TENSOR_CORE_DTYPES)
    assert unmasked_only and not any(_config.selectable(_config.TensorCoreTile.filename, t.name_expression(np.float16),
                                                        _config.ALL_FEATURES) for t in _config.TENSOR_CORE_TILES if t.unmasked_only)
    for arch in ("sm_80", "sm_90", "sm_90a"):
        for dtype in ("float16", "bfloat16", "float32"):
            tensor_cores = dtype != "float32"
            if arch == "sm_90a":  # only the Hopper kernels are built for sm_90a
                plain_tiles = sum(_config.selectable(_config.HopperTile.filename, t.name_expression(np.float16),
                                                     _config.PLAIN_FEATURES) for t in _config.HOPPER_TILES)
                expected = {"attention_fwd_wgmma": plain_tiles if tensor_cores else 0,
                            # with and without dQ's reductions (two template instances)
                            "attention_bwd_dkdv_wgmma": 2 * len(_config.HOPPER_BACKWARD_TILES) if tensor_cores else 0}
                for kernel, count in expected.items():
                    files = list(tmp_path.glob(f"{kernel}_*_{dtype}_{arch}_plain.ptx"))
                    assert len(files) == count, (kernel, dtype, arch)
                    assert all("wgmma.mma_async.sync.aligned.m64n" in f.read_text() for f in files)
                assert not [f for f in tmp_path.glob(f"*_{dtype}_{arch}_*.ptx") if "wgmma" not in f.name]
                continue
            expected = {
                "attention_fwd": 0 if tensor_cores else len(_config.FORWARD_TILES),
                # the tiles calls without score features can choose (not those for calls with a mask)
                "attention_fwd_tc": len(plain_tc_tiles) if tensor_cores else 0,
                "attention_bwd_preprocess": 1,
                "attention_bwd_dkdv": 0 if tensor_cores else len(_config.BACKWARD_TILES),
                # fp16/bf16 head dims above 256 take the CUDA-core dQ kernel in deterministic mode
                "attention_bwd_dq": len([t for t in _config.BACKWARD_TILES
                                         if not tensor_cores or t.head_dim > _config.NARROW_HEAD_DIM]),
                "attention_bwd_dkdv_tc": len(_config.TENSOR_CORE_BACKWARD_TILES) if tensor_cores else 0,
                "attention_bwd_dq_tc": len([t for t in _config.DQ_TENSOR_CORE_TILES
                                            if t.head_dim <= _config.NARROW_HEAD_DIM]) if tensor_cores else 0,
                "attention_decode": len(_config.DECODE_TILES),
            }
            for kernel, count in expected.items():
                files = [f for f in tmp_path.glob(f"{kernel}_*_{dtype}_{arch}_plain.ptx")
                         if not f.name.startswith((kernel + "_tc_", kernel + "_wgmma_"))]
                assert all(f.with_name(f.name.replace("_plain.ptx", "_all.ptx")).exists()
                           == (ci_builds(arch, kernel, dtype, "all") and not f.name.startswith(unmasked_only))
                           for f in files)
                assert len(files) == count, (kernel, dtype, arch)
                assert all(".entry" in f.read_text() for f in files)
                # Every fp16/bf16 kernel with a matrix product runs it on tensor cores (the
                # preprocess kernel is a row-wise dot product, dO·O; decoding, memory-bound, runs
                # in float32 on CUDA cores, its K/V tiles staged by cp.async; the deterministic dQ
                # of head dims above 256 runs on CUDA cores: _config.tensor_core_dq_tile).
                if kernel == "attention_decode":
                    assert all("cp.async.cg.shared.global" in f.read_text() for f in files), (kernel, dtype, arch)
                elif tensor_cores and kernel not in ("attention_bwd_preprocess", "attention_bwd_dq"):
                    assert all("mma.sync.aligned.m16n8k16" in f.read_text() and "ldmatrix" in f.read_text()
                               and "cp.async" in f.read_text() for f in files), (kernel, dtype, arch)


def test_every_feature_build_of_the_wgmma_forward_and_its_mods_compile_without_spills():
    """A call runs the build of exactly its score features, and the wgmma forward overlaps its
    softmax with P·V in every build, where ptxas had spilled in some feature sets and not others:
    bench/feature_builds.py builds every one a call can choose (the compile report above builds
    three) and exits 1 where one spills."""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "feature_builds.py"), "--kernels", "attention_fwd_wgmma",
                             "--json"], capture_output=True, text=True, timeout=900)
    assert result.returncode in (0, 1), result.stderr  # 1: a build spills
    rows = json.loads(result.stdout)
    assert result.returncode == 0, [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    # each feature set on its head dim's tile for calls with causal or a window and, if another, without
    assert len(rows) == sum(len({_config.forward_tile(d, d, np.float16, 90, f, diagonal=diagonal) for diagonal in (False, True)})
                            for d in {t.head_dim for t in _config.HOPPER_TILES} for f in _config.FEATURE_SETS)
    # as a number: at D = 64 the 12 sets without dropout on 128 keys, the plain and mask-alone ones
    # on 176 too, the 12 with dropout on 128 or, the 6 with ALiBi, on 64 (12 + 3 + 6 + 6); at
    # D = 128 and 256 each set on one tile
    assert len(rows) == 27 + 24 + 24
    assert {r["features"] for r in rows} == {_config.feature_words(f) for f in _config.FEATURE_SETS}
    assert all(r["issue_per_tensor"] > 0 and r["exposed_per_tensor"] is not None for r in rows)
    # and with bench_mods.py's mods (the two mask_mods with and without a block mask, the bias
    # score_mod; plain and with softcap), whose builds overlap too, on the tiles of calls with mods
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "feature_builds.py"), "--kernels", "attention_fwd_wgmma",
                             "--mods", "--json"], capture_output=True, text=True, timeout=900)
    assert result.returncode in (0, 1), result.stderr
    rows = json.loads(result.stdout)
    assert result.returncode == 0, [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    assert len(rows) == sum(t.mods for t in _config.HOPPER_TILES) * 5 * 2 and {r["features"].split(", ")[1] for r in rows} == {"plain", "softcap"}


def test_every_feature_build_of_the_wgmma_dkdv_at_d64_compiles_without_spills():
    """The wgmma dK/dV at D = 64 holds K's and V's fragments in registers in builds without
    softcap, nor dropout with a mask, where no feature set spilled beside them (8 of the 12 with
    softcap did, and a bool mask with dropout: those keep them in shared memory): every build a
    call can choose, both dQ modes. (At D = 128, which
    keeps K and V in shared memory, the deterministic dQ's builds with softcap, ALiBi, a mask and
    dropout spill 24 bytes: bench/RESULTS.md, 2026-12-06, twentieth session.)"""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "feature_builds.py"), "--kernels",
                             "attention_bwd_dkdv_wgmma", "--head-dims", "64", "--json"], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode in (0, 1), result.stderr  # 1: a build spills
    rows = json.loads(result.stdout)
    assert {r["name"] for r in rows} == {f"attention_bwd_dkdv_wgmma<__half, 64, 64, {dq}>" for dq in ("true", "false")}
    assert len(rows) == 2 * len(_config.FEATURE_SETS)
    assert [r for r in rows if r["spill_stores"] or r["spill_loads"]] == []
    # K and V from registers: Sᵀ and dPᵀ read B alone from shared memory, which the plain build's
    # wavefronts show (below those of the softcap build, which reads both operands there)
    shared = {(r["name"], r["features"]): r["shared_per_tensor"] for r in rows}
    for name in {n for n, _ in shared}:
        assert shared[(name, "plain")] < shared[(name, "softcap")], name


def test_every_wgmma_shape_assembles():
    """ptxas takes every wgmma.mma_async shape and form ptx.cuh wraps (the kernels use some; the
    emulator, which runs the rest in tests, never sees their inline asm): one probe kernel per
    shape, form and type, compiled for sm_90a."""
    from cupy_attn import _paths
    from cupy_attn._source import inline_local_includes

    probe = inline_local_includes('''#include "ptx.cuh"
template <class T, int N, bool kRegistersA>
__global__ void probe(float* out, unsigned long long a_desc, unsigned long long b_desc, unsigned x) {
    float d[N / 2] = {};
    const unsigned a[4] = {x, x + 1, x + 2, x + 3};
    ptx::wgmma_fence();
    if constexpr (kRegistersA) ptx::wgmma_m64k16_rs<T, N, ptx::Major::MN>(d, a, b_desc, 1);
    else ptx::wgmma_m64k16_ss<T, N, ptx::Major::K>(d, a_desc, b_desc, 0);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    for (int i = 0; i < N / 2; ++i) out[threadIdx.x * (N / 2) + i] = d[i];
}
''', [_paths.kernel_dir()], origin="probe.cu")
    for n in (32, 64, 72, 128, 176):
        for registers in ("false", "true"):
            for ctype in ("__half", "__nv_bfloat16"):
                c = _nvrtc.compile_kernel(probe, f"probe<{ctype}, {n}, {registers}>", "sm_90a", ("-std=c++17",))
                assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32" in c.ptx and c.spill_stores == 0


def test_tile_tables_cover_every_head_dim():
    for d in range(1, _config.MAX_HEAD_DIM + 1):
        # Up to 256 every tile fits sm_86's 99 KB opt-in limit; the wide tiles above fit sm_80's 163 KB.
        limit = 99 * 1024 if d <= _config.NARROW_HEAD_DIM else _config.WIDE_SHARED_LIMIT
        fwd, bwd = _config.forward_tile(d, d), _config.backward_tile(d, d)
        tc = _config.forward_tile(d, d, np.float16)
        assert tc.head_dim >= d and tc.head_dim % 16 == 0 and tc.block_n % 16 == 0 and tc.value_dim % 16 == 0
        assert tc.shared_bytes <= limit and tc.value_dim <= _config.NARROW_HEAD_DIM
        # a call with a mask or mods: the tile of the same head dim for every call
        masked = _config.forward_tile(d, d, np.float16, features=_config.BOOL_MASK)
        assert masked.head_dim == tc.head_dim and not masked.unmasked_only and masked.shared_bytes <= limit
        assert _config.forward_tile(d, d, np.float16, mods=True) is masked
        assert (masked is tc) == (not tc.unmasked_only)
        assert _config.forward_tile(d, d, np.float16, features=_config.SOFTCAP | _config.ALIBI | _config.DROPOUT) is tc
        dq = _config.tensor_core_dq_tile(d, d)
        if d <= _config.NARROW_HEAD_DIM:  # the deterministic dQ takes the block_n of the tile for every call
            assert dq is masked and dq.dq_shared_bytes <= limit
        else:
            assert isinstance(dq, _config.BackwardTile) and dq.head_dim >= d and dq.dq_shared_bytes <= limit
        hopper = _config.forward_tile(d, d, BF16, compute_capability=90)
        if d <= _config.HOPPER_TILES[-1].head_dim:
            assert isinstance(hopper, _config.HopperTile) and hopper.head_dim >= d and hopper.head_dim % 64 == 0
            assert hopper.shared_bytes <= 227 * 1024  # sm_90's per-block limit
        else:
            assert hopper is tc
        dropout = _config.forward_tile(d, d, BF16, compute_capability=90, features=_config.DROPOUT | _config.BOOL_MASK)
        every = _config.forward_tile(d, d, BF16, compute_capability=90, features=_config.ANY_FEATURES, mods=True)
        causal = _config.forward_tile(d, d, BF16, compute_capability=90, diagonal=True)
        if hopper is tc:
            assert dropout is tc and every is tc and causal is tc
        else:  # the tile of calls with mods, or every feature, serves every call
            assert isinstance(every, _config.HopperTile) and every.features == _config.ANY_FEATURES and every.mods
            assert not every.spills_with and every.head_dim == hopper.head_dim and every is not hopper
            assert _config.forward_tile(d, d, BF16, compute_capability=90, mods=True) is every
            assert _config.forward_tile(d, d, BF16, compute_capability=90, features=_config.ALIBI | _config.DROPOUT) is every
            # other features at D = 64 take 128 keys, whose state spills beside mods' and beside ALiBi's
            # and dropout's together; dropout with a mask too
            featured = _config.forward_tile(d, d, BF16, compute_capability=90, features=_config.ANY_FEATURES & ~_config.DROPOUT)
            assert featured.head_dim == hopper.head_dim and featured.diagonal
            assert featured is every if hopper.head_dim > 64 else \
                (featured.block_n, featured.spills_with, featured.mods) == (128, _config.ALIBI | _config.DROPOUT, False)
            assert dropout is (every if hopper.head_dim > 64 else featured)
            # a causal or windowed call's: the plain call's unless that one is for calls without a diagonal
            assert causal.diagonal and causal.head_dim == hopper.head_dim and (causal is hopper) == hopper.diagonal
        assert _config.selectable(dropout.filename, dropout.name_expression(BF16), _config.DROPOUT)
        assert _config.selectable(hopper.filename, hopper.name_expression(BF16), _config.DROPOUT) \
            == bool(getattr(hopper, "features", _config.DROPOUT) & _config.DROPOUT)
        assert isinstance(_config.forward_tile(d, d, np.float32, compute_capability=90), _config.ForwardTile)
        for dtype in (np.float16, BF16):
            tcb = _config.backward_tile(d, d, dtype)
            assert isinstance(tcb, _config.TensorCoreBackwardTile) and tcb.head_dim >= d
            assert tcb.shared_bytes <= limit and (tcb.head_dim // tcb.dim_warps) % 16 == 0
            # where a block may have more (sm_80, sm_90), a tile of the same head dim that fits it
            roomy = _config.backward_tile(d, d, dtype, shared_limit=163 * 1024)
            assert roomy.head_dim == tcb.head_dim and roomy.shared_bytes <= max(limit, 163 * 1024)
            assert roomy.block_n == (128 if 32 < roomy.head_dim <= 128 else tcb.block_n)
            assert roomy.threads == (256 if roomy.block_n == 128 else 128)
            hopper = _config.backward_tile(d, d, dtype, compute_capability=90)
            assert type(hopper) is (_config.HopperBackwardTile if d <= 128 else _config.TensorCoreBackwardTile)
            assert hopper.head_dim >= d and hopper.shared_bytes <= 227 * 1024
        assert isinstance(bwd, _config.BackwardTile)
        assert fwd.head_dim >= d and bwd.head_dim >= d
        # 4 warps of 32 / lanes_per_row rows
        assert fwd.block_m == _config.THREADS // fwd.lanes_per_row
        assert bwd.dq_block_m == _config.THREADS // bwd.dq_lanes_per_row
        assert max(fwd.shared_bytes, bwd.dkdv_shared_bytes, bwd.dq_shared_bytes) <= limit
        assert fwd.head_dim % fwd.lanes_per_row == 0 and fwd.block_n % fwd.lanes_per_row == 0
        assert _config.THREADS % bwd.block_n == 0 and _config.THREADS % bwd.block_m == 0
    assert np.dtype(np.float16) in _config.CTYPES


def test_report_builds_with_the_options_cupy_adds():
    """CuPy's RawModule compiles with -ftz=true (and more: _compile.CUPY_ADDED_OPTIONS); the report
    must too, or its registers are not those of the code that runs. Flush-to-zero shows in the PTX."""
    filename, name = "attention_fwd_tc.cu", _config.TENSOR_CORE_TILES[1].name_expression(np.float16)
    ours_only = _nvrtc.compile_kernel(_compile.kernel_source(filename), name, "sm_80", _compile.nvrtc_options(filename))
    as_on_gpu = _nvrtc.compile_kernel(_compile.kernel_source(filename), name, "sm_80", _compile.gpu_build_options(filename))
    assert set(_compile.CUPY_ADDED_OPTIONS) <= set(_compile.gpu_build_options(filename))
    assert as_on_gpu.ptx.count(".ftz.f32") > 2 * ours_only.ptx.count(".ftz.f32")


def check_sass_budgets(rows):
    """No ptxas advisory anywhere, and no tensor-core variant's hot loop issues more per tensor-core
    cycle than tests/sass_budgets.json allows. A change that lowers a ratio may lower its budget;
    one that raises it must raise the budget on purpose, in the same commit."""
    budgets = json.loads(BUDGETS.read_text())
    assert [(r["name"], r["arch"], r["advisories"]) for r in rows if r["advisories"]] == []
    key = lambda r: f"{r['name']} @ {r['arch']} [{r['features']}]"  # noqa: E731
    # a loop inside a hot loop counts once on its path, whatever its trip count: none may be there
    # for the figures below to hold (a rolled Philox made a dropout build's path a fraction of its work)
    assert [key(r) for r in rows if r.get("nested_loops")] == []
    measured = {key(r): r["issue_per_tensor"] for r in rows if r.get("issue_per_tensor") is not None}
    tensor_core = {key(r) for r in rows if "_tc<" in r["name"] or "_wgmma<" in r["name"]}
    assert tensor_core <= measured.keys(), "a tensor-core kernel has no hot loop with tensor instructions"
    # wgmma's loops: the instructions issued with none of the warpgroup's wgmma in flight, per
    # tensor cycle ("[..., exposed]"); mma.sync has no such window
    exposed = {r["name"]: r.get("exposed_per_tensor") for r in rows if r.get("issue_per_tensor") is not None}
    assert all((value is not None) == ("_wgmma<" in name) for name, value in exposed.items()), exposed
    measured.update({f"{key(r)[:-1]}, exposed]": r["exposed_per_tensor"] for r in rows
                     if r.get("exposed_per_tensor") is not None})
    # every tensor-core loop's shared-memory wavefronts per tensor cycle ("[..., shared]")
    assert all(r["shared_per_tensor"] > 0 for r in rows if r.get("issue_per_tensor") is not None)
    measured.update({f"{key(r)[:-1]}, shared]": r["shared_per_tensor"] for r in rows
                     if r.get("issue_per_tensor") is not None})
    # and MUFU cycles per tensor cycle ("[..., mufu]"): a loop's bound is the largest of the three,
    # so a change that trades MUFU for issue slots (exp2_polynomial) shows in both budgets
    measured.update({f"{key(r)[:-1]}, mufu]": r["mufu_per_tensor"] for r in rows
                     if r.get("issue_per_tensor") is not None})
    assert sorted(measured.keys() - budgets.keys()) == [], "new variants need a budget in tests/sass_budgets.json"
    over = {k: (v, budgets[k]) for k, v in measured.items() if v > budgets[k] + 5e-4}
    assert over == {}, "issue, exposed, shared or MUFU cycles per tensor cycle above its budget (measured, budget)"
    for r in rows:
        if r.get("issue_per_tensor") is not None:
            assert r["path_instructions"] <= r["loop_instructions"]
            assert sum(r["tensor_instructions"].values()) > 0
            # every tile loads: in the loop itself, or (the warp-specialised wgmma kernels, whose hot
            # loop is a consumer's) in the producer's, which the consumers' mbarrier waits stand for
            assert r["ldgsts"] + r["tma"] > 0 or r["name"].startswith(("attention_fwd_wgmma<",
                                                                       "attention_bwd_dkdv_wgmma<"))
    # A plain call's build carries no trace of softcap, ALiBi or masks: fewer instructions per tile
    # than the build of a call with all three.
    featured = {(r["name"], r["arch"]): r for r in rows if r["features"] == "all"}
    compared = 0
    for r in rows:
        if r["features"] == "plain" and r.get("issue_per_tensor") is not None and (r["name"], r["arch"]) in featured:
            assert r["path_instructions"] < featured[r["name"], r["arch"]]["path_instructions"], r["name"]
            assert r["loop_instructions"] < featured[r["name"], r["arch"]]["loop_instructions"], r["name"]
            compared += 1
    assert compared > 15  # sm_80's tensor-core builds with features and the wgmma ones


# The hot loops issue 14 sets targets for with causal: the fp16 forwards and dK/dV kernels of
# both families at D = 64 and 128.
BOUNDARY_KERNELS = ("attention_fwd_tc<", "attention_bwd_dkdv_tc<", "attention_fwd_wgmma<", "attention_bwd_dkdv_wgmma<")


def boundary_variants():
    found = []
    for requested in ("sm_80", "sm_90"):
        for filename, name, dtype in _config.kernel_variants(requested):
            if (str(dtype) == "float16" and name.startswith(BOUNDARY_KERNELS) and int(name.split(",")[1]) in (64, 128)
                    and _config.selectable(filename, name, _config.PLAIN_FEATURES)):
                found.append((filename, name, _config.FILE_ARCH.get(filename, requested)))
    return sorted(set(found))


def test_boundary_tiles_stay_within_their_budgets():
    """The masked copy of the hot loop (a tile on the causal diagonal, a window's edge or a
    sequence's end) per tensor-core cycle, within tests/sass_budgets.json's "[boundary]" budgets;
    and longer than an interior tile's (its "[plain]" budget), which shows the model reads the
    masked copy."""
    budgets = json.loads(BUDGETS.read_text())
    variants = boundary_variants()
    # two families' forward and dK/dV at two head dims, mma.sync on sm_80 and sm_90; at D = 128 the mma.sync
    # dK/dV has two tiles (128 keys, and 64 for GPUs of 99 KB), the wgmma dK/dV two kernels per head dim
    # (dQ by its reductions, or by the deterministic kernel after), and the wgmma forward at D = 64 two
    # plain tiles (176 keys, and 128 for causal or windowed calls)
    assert len(variants) == 17
    over, not_longer = {}, []
    for filename, name, arch in variants:
        boundary = cli.boundary_tile_report(filename, name, arch)["boundary_issue_per_tensor"]
        key = f"{name} @ {arch}"
        if boundary > budgets[f"{key} [boundary]"] + 5e-4:
            over[key] = (boundary, budgets[f"{key} [boundary]"])
        if not boundary > budgets[f"{key} [plain]"]:
            not_longer.append(key)
    assert over == {}, "boundary issue_per_tensor above its budget (measured, budget)"
    assert not_longer == []


def test_a_spilling_compile_is_retried_and_one_that_always_spills_is_reported(monkeypatch):
    """ptxas allocates differently under CPU load (_nvrtc.SPILL_ATTEMPTS): the report keeps a
    variant's best of its attempts, and a variant that spills on every one is still reported."""
    monkeypatch.delenv(_nvrtc.CACHE_ENVIRONMENT, raising=False)  # each call compiles
    results = iter([(16, 72), (0, 95)])

    def compile_kernel(code, name, arch, options=()):
        spills, registers = next(results)
        return _nvrtc.Compiled(name=name, arch=arch, registers=registers, spill_stores=spills, spill_loads=spills,
                               stack_frame_bytes=0, static_shared_bytes=0, compile_seconds=0.0, ptx="", log="", cubin=b"")

    monkeypatch.setattr(_nvrtc, "compile_kernel", compile_kernel)
    c, attempts = _nvrtc.compile_kernel_least_spills("", "k", "sm_90")
    assert (c.registers, c.spill_stores, attempts) == (95, 0, 2)
    results = iter([(8, 72)] * _nvrtc.SPILL_ATTEMPTS)
    c, attempts = _nvrtc.compile_kernel_least_spills("", "k", "sm_90")
    assert (c.spill_stores, attempts) == (8, _nvrtc.SPILL_ATTEMPTS)


def test_a_result_without_spills_is_kept_in_the_cache_and_one_with_spills_is_not(monkeypatch, tmp_path):
    monkeypatch.setenv(_nvrtc.CACHE_ENVIRONMENT, str(tmp_path / "cache"))
    compiles = []

    def compile_kernel(code, name, arch, options=()):
        compiles.append((code, name, arch, options))
        spills = 8 if name == "spills" else 0
        return _nvrtc.Compiled(name=name, arch=arch, registers=len(compiles), spill_stores=spills, spill_loads=spills,
                               stack_frame_bytes=0, static_shared_bytes=0, compile_seconds=0.0, ptx="", log="", cubin=b"")

    monkeypatch.setattr(_nvrtc, "compile_kernel", compile_kernel)
    first = _nvrtc.compile_kernel_least_spills("code", "k", "sm_90", ("-DA=1",))
    assert _nvrtc.compile_kernel_least_spills("code", "k", "sm_90", ("-DA=1",)) == first == (first[0], 1)
    assert len(compiles) == 1 and len(list((tmp_path / "cache").iterdir())) == 1
    # one that cannot be read (cut short, written by another version) is built again, and replaced
    [entry] = (tmp_path / "cache").iterdir()
    entry.write_bytes(entry.read_bytes()[:40])
    assert _nvrtc.compile_kernel_least_spills("code", "k", "sm_90", ("-DA=1",))[0].registers == 2
    assert _nvrtc.compile_kernel_least_spills("code", "k", "sm_90", ("-DA=1",))[0].registers == 2
    assert len(compiles) == 2 and len(list((tmp_path / "cache").iterdir())) == 1
    # another source, name, architecture or option is another build
    for args in (("code ", "k", "sm_90", ("-DA=1",)), ("code", "k2", "sm_90", ("-DA=1",)),
                 ("code", "k", "sm_80", ("-DA=1",)), ("code", "k", "sm_90", ("-DA=2",))):
        assert _nvrtc.compile_kernel_least_spills(*args)[0].registers == len(compiles)
    assert len(compiles) == 6
    _nvrtc.compile_kernel_least_spills("code", "spills", "sm_90")
    _nvrtc.compile_kernel_least_spills("code", "spills", "sm_90")
    assert len(compiles) == 6 + 2 * _nvrtc.SPILL_ATTEMPTS and len(list((tmp_path / "cache").iterdir())) == 5
