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
    keys = {"impl", "pass", "B", "H", "Sq", "Sk", "D", "dtype", "causal", "ms", "tflops", "peak_bytes"}
    assert records and all(keys <= r.keys() for r in records)
    assert {r["impl"] for r in records} == {"cupy_attn_numpy", "naive_numpy"}
    assert {r["pass"] for r in records} == {"fwd", "bwd"}
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in records)
    assert (tmp_path / "fwd.png").stat().st_size > 1000 and (tmp_path / "bwd.png").exists()
    assert "relative to the best other implementation" in result.stdout
    # every result was checked against float32 attention (PyTorch's math backend)
    checked = [r for r in records if r["impl"] == "cupy_attn_numpy"]
    if importlib.util.find_spec("torch"):
        errors = [e for r in checked for kind in ("rel_rms_error", "rel_max_error", "rel_row_error") for e in r[kind].values()]
        assert errors and all(0 < e < 1e-5 for e in errors), checked
        assert {tuple(r["rel_max_error"]) for r in checked} == {("out",), ("dq", "dk", "dv")}
        assert f"{len(records)} checked, 0 wrong" in result.stdout
        assert all(r["wrong"] is False and r["kernels"] == [] for r in checked), checked  # the NumPy backend launches none
        assert all(r["wrong"] is False and "kernels" not in r for r in records if r["impl"] == "naive_numpy")
    else:
        assert all(r["unchecked"] == "PyTorch is not installed" for r in records)
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


def test_the_reference_check_tells_a_wrong_result_from_rounding():
    """bench/reference_check.py against the NumPy backend (GQA, a padding mask, causal), then the
    same results with one kv head's dk doubled and one query row of out taken from another."""
    pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_attention
        import reference_check
    finally:
        sys.path.remove(str(ROOT / "bench"))
    import numpy as np

    import cupy_attn

    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 37, 16), dtype=np.float32)
    k, v = (rng.standard_normal((2, 2, 37, 16), dtype=np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape, dtype=np.float32)
    mask = (np.arange(37) < np.array([[30], [37]]))[:, None, None, :]
    out, lse = cupy_attn.attention(q, k, v, mask=mask, causal=True, return_lse=True, backend="numpy")
    grads = cupy_attn.attention_backward(dout, q, k, v, out, lse, mask=mask, causal=True, backend="numpy")
    ref = {p: reference_check.reference(q, k, v, dout, mask, causal=True, pass_=p, device="cpu") for p in ("fwd", "bwd")}
    right = {"fwd": reference_check.relative_errors(out, ref["fwd"]),
             "bwd": reference_check.relative_errors(grads, ref["bwd"])}
    assert list(right["bwd"]["rel_max_error"]) == ["dq", "dk", "dv"], right
    assert all(e < 1e-5 for r in right.values() for kind in r.values() for e in kind.values()), right
    wrong_out = out.copy()
    wrong_out[0, 1, 20] = out[0, 1, 21]  # one row of 296: an RMS error of 5 %, the largest of 50 %
    wrong_dk = grads[1].copy()
    wrong_dk[1, 0] *= 2
    wrong = {"fwd": reference_check.relative_errors(wrong_out, ref["fwd"]),
             "bwd": reference_check.relative_errors((grads[0], wrong_dk, grads[2]), ref["bwd"])}
    assert wrong["fwd"]["rel_max_error"]["out"] > 0.2 and wrong["bwd"]["rel_max_error"]["dk"] > 0.2, wrong
    assert wrong["bwd"]["rel_max_error"]["dq"] < 1e-5  # the other outputs stay right
    assert [reference_check.wrong(e) for e in (*right.values(), *wrong.values())] == [False, False, True, True]
    # A row of small values left unwritten (as a causal call's late rows are small beside its first):
    # 4 % of the output's largest magnitude, but the whole of its own row (measured against the
    # floor of 5 % of the largest: 0.8).
    import torch

    expected = torch.ones(1, 2, 50, 8)
    expected[0, 0, 0] = 25.0
    unwritten = expected.numpy().copy()
    unwritten[0, 1, 40] = 0.0
    errors = reference_check.relative_errors(unwritten, {"out": expected})
    assert errors["rel_max_error"]["out"] == pytest.approx(0.04) and errors["rel_row_error"]["out"] == pytest.approx(0.8)
    assert reference_check.wrong(errors)
    base = dict(name="sweep", dtype="float32", Sq=37, Sk=37, D=16, causal=True)
    records = [dict(base, impl=impl, **errors[p], **{"pass": p})
               for impl, errors in (("right", right), ("wrong", wrong)) for p in ("fwd", "bwd")]
    text = bench_attention.result_summary(records + [dict(base, impl="x", unchecked="why not")])
    assert "4 checked, 2 wrong" in text.splitlines()[0] and text.splitlines()[0].endswith("unchecked: why not"), text
    assert [line.split()[:2] for line in text.splitlines()[1:3]] == [["WRONG", "wrong"]] * 2, text
    assert sum(line.startswith("largest  right") for line in text.splitlines()) == 2, text


def test_a_result_found_wrong_is_no_speed(tmp_path):
    """A record whose check failed (reference_check.wrong) is left out of the benchmark's summary
    and plots, and report.py shows WRONG in its cell and no ratio to it."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_attention
    finally:
        sys.path.remove(str(ROOT / "bench"))
    base = dict(name="sweep", dtype="bfloat16", D=128, Sq=1024, Sk=1024, causal=False, B=16, H=16, Hkv=16)
    records = [dict(base, impl="cupy_attn", tflops=900.0, wrong=True, **{"pass": "fwd"}),
               dict(base, impl="torch_sdpa_cudnn", tflops=500.0, wrong=False, **{"pass": "fwd"}),
               dict(base, impl="cupy_attn", tflops=300.0, Sq=2048, Sk=2048, **{"pass": "fwd"}),
               dict(base, impl="torch_sdpa_cudnn", tflops=600.0, Sq=2048, Sk=2048, **{"pass": "fwd"})]
    rows = bench_attention.summary(records).splitlines()[2:]
    assert len(rows) == 1 and rows[0].split()[2] == "2048/2048" and rows[0].endswith("0.50"), rows
    (tmp_path / "a.json").write_text(json.dumps(records[:2]))
    (tmp_path / "b.json").write_text(json.dumps(records[2:]))
    report = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), str(tmp_path / "a.json"),
                             str(tmp_path / "b.json"), "--pass", "fwd"], capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    lines = [line for line in report.stdout.splitlines() if line.startswith("| sweep")]
    assert lines == ["| sweep | bfloat16 | 128 | 1024/1024 | no | WRONG | 500.0 | — |",
                     "| sweep | bfloat16 | 128 | 2048/2048 | no | 300.0 | 600.0 | 0.50 |"], report.stdout


def test_the_checked_first_call_poisons_outputs_and_names_its_kernels():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_attention
    finally:
        sys.path.remove(str(ROOT / "bench"))
    import numpy as np

    import cupy_attn
    from cupy_attn import _config, _kernel_backend

    q = np.random.default_rng(0).standard_normal((1, 2, 20, 32)).astype(np.float16)
    launched, (out, poisoned) = bench_attention.first_call_checked(
        lambda: (cupy_attn.attention(q, q, q, backend="emulator"), _kernel_backend.POISON_OUTPUTS))
    assert poisoned and not _kernel_backend.POISON_OUTPUTS and _kernel_backend._launch.__name__ == "_launch"
    assert launched == [_config.forward_tile(32, 32, np.float16, 80).name_expression(np.float16)] and np.isfinite(out).all()
