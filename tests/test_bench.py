"""The benchmark script runs without a GPU and writes what it promises."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_quick_cpu_benchmark_writes_json_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_attention.py"), "--quick", "--device", "cpu",
                             "--impls", "cupy_attn_numpy", "naive_numpy", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    records = json.loads((tmp_path / "results.json").read_text())
    keys = {"impl", "pass", "B", "H", "Sq", "Sk", "D", "dtype", "causal", "ms_median", "tflops", "peak_bytes"}
    assert records and all(keys <= r.keys() for r in records)
    assert {r["impl"] for r in records} == {"cupy_attn_numpy", "naive_numpy"}
    assert {r["pass"] for r in records} == {"fwd", "bwd"}
    assert all(r["ms_median"] > 0 and r["tflops"] > 0 for r in records)
    assert (tmp_path / "fwd.png").stat().st_size > 1000 and (tmp_path / "bwd.png").exists()
    assert "relative to the best other implementation" in result.stdout
    # report.py turns it into a table of numbers: the NumPy backend is "ours" without a GPU
    report = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), str(tmp_path / "results.json"),
                             "--pass", "fwd"], capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    header, _, first = report.stdout.strip().splitlines()[2:5]
    assert header == "| case | dtype | D | Sq/Sk | causal | cupy_attn (NumPy) | naive NumPy | ÷ naive NumPy |"
    assert all(float(cell) > 0 for cell in first.strip("|").split("|")[5:]), first


def test_scripts_refuse_bad_arguments_before_writing(tmp_path):
    (tmp_path / "results.json").write_text("[]")
    scripts = [(["bench_attention.py", "--impls", "cupy_attn_nympy", "--out", str(tmp_path)], "no implementation named"),
               (["bench_attention.py", "--pass", ",", "--out", str(tmp_path)], "--pass takes fwd, bwd"),
               (["report.py", str(tmp_path / "missing.json")], "cannot read"),
               (["report.py", str(ROOT / "pyproject.toml")], "cannot read"),
               (["report.py", str(tmp_path / "results.json"), "--pass", "xyz"], "--pass takes fwd, bwd"),
               (["numpy_backend.py", "--seq", "0"], "must be a positive integer")]
    for args, message in scripts:
        result = subprocess.run([sys.executable, str(ROOT / "bench" / args[0]), *args[1:]], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, args
    assert (tmp_path / "results.json").read_text() == "[]"  # not overwritten


def test_inference_benchmark_cpu_mode(tmp_path):
    """bench/bench_inference.py's CPU mode: decode over contiguous and paged caches and packed
    prefill, each record with its measure (bandwidth, TFLOP/s) and the SDPA comparison."""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_inference.py"), "--device", "cpu",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    records = json.loads((tmp_path / "results.json").read_text())
    decode = [r for r in records if r["kind"] == "decode"]
    prefill = [r for r in records if r["kind"] == "prefill"]
    assert {r["cache"] for r in decode} == {"contiguous", "paged16"} and {r["B"] for r in decode} == {1, 4}
    assert all(r["ms"] > 0 and r["bandwidth"] > 0 for r in decode)
    assert prefill and all(r["ms"] > 0 and r["tflops"] > 0 and r["sequences"] > 1 for r in prefill)
    if importlib.util.find_spec("torch"):
        assert all(r["sdpa_ms"] > 0 for r in prefill)


def test_mods_benchmark_cpu_mode(tmp_path):
    """bench/bench_mods.py's CPU mode: the document mask, the window with global tokens and the bias
    table on the NumPy backend, TFLOP/s over the attended pairs, and SDPA with the dense equivalent
    when PyTorch is here."""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_mods.py"), "--device", "cpu", "--quick",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    records = json.loads((tmp_path / "results.json").read_text())
    ours = [r for r in records if r["impl"] == "cupy_attn"]
    assert {r["case"] for r in ours} == {"document", "window", "bias"}
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in ours)
    assert [r["case"] for r in records if r["impl"] == "cupy_attn+block_mask"] == ["document", "window"]
    if importlib.util.find_spec("torch"):
        assert {r["case"] for r in records if r["impl"] == "sdpa-math"} == {"document", "window", "bias"}


def test_emulator_build_timing_reports_every_asked_case():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "emulator_build.py"), "--cases", "fwd_fp32"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("runtime library ") and "precompiled header" in lines[0]
    assert lines[1].startswith("fwd_fp32   first call") and "(build and run)" in lines[1]
