"""bench/gpu_check.sh in --dry-run: every step's CPU twin, so no lent GPU minute is lost to a typo."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_dry_run_runs_every_step_and_summarises(tmp_path):
    pytest.importorskip("matplotlib")
    env = dict(os.environ, PYTHON=sys.executable)
    # OUTDIR relative to where the command runs (here tmp_path), not to the checkout
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "out", "--dry-run",
                             "--only", "tests,sanitize,bench,sweep,inference,mods"], capture_output=True, text=True,
                            timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = tmp_path / "out"
    summary = (out / "summary.txt").read_text()
    for step in ("== environment", "== compile every variant", "== GPU tests", "== compute-sanitizer",
                 "== benchmark", "== host time per call", "== persistence", "== Nsight Compute", "== tile sweep",
                 "== inference benchmark", "== programmable attention benchmark"):
        assert step in summary
    assert "compiled 2 variants" in summary
    assert "sanitize cases ran: " in summary
    assert "relative to the best other implementation" in summary
    assert "ran forward and backward" in summary
    assert "host default forward: " in summary and "host default backward: " in summary
    assert "persistence bf16 D=128 B=1 H=2 S=300 causal: a block per tile " in summary
    assert "candidates, 0 unusable" in summary  # every prepared tile candidate builds
    assert "decode  B=4" in summary and "prefill " in summary
    assert "mods document S=256" in summary and "mods bias     S=256" in summary
    assert summary.rstrip().endswith("GPU CHECK DRY RUN PASSED")
    assert (out / "results.json").exists()
    # the wgmma kernels' benchmark runs in a process of its own, into a folder of its own
    assert "== benchmark of the wgmma kernels" in summary and (out / "wgmma" / "results.json").exists()
    assert f"tables of both: python bench/report.py {out}/results.json {out}/wgmma/results.json" in summary


def test_unknown_step_is_refused_before_anything_runs(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(tmp_path), "--only", "tests,bnech"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "unknown step: bnech" in result.stderr
    assert not (tmp_path / "summary.txt").exists()


def test_arguments_that_would_run_the_real_check_are_refused(tmp_path):
    """A forgotten OUTDIR once took --dry-run as the directory: the real check ran, writing its logs to /."""
    script = str(ROOT / "bench" / "gpu_check.sh")
    for args, message in ((["--dry-run"], "OUTDIR comes first, got the option --dry-run"),
                          ([str(tmp_path), "--bench-budget", "--dry-run"], "--bench-budget needs whole seconds"),
                          ([str(tmp_path / "file" / "out"), "--dry-run"], "cannot make OUTDIR")):
        (tmp_path / "file").write_text("")
        result = subprocess.run(["bash", script, *args], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]



ISOLATED_CASES = '''
import time
import pytest
def test_passes(): pass
def test_fails(): assert 1 == 2, "one is not two"
def test_hangs(): time.sleep(600)
@pytest.mark.parametrize("n", [1, 2])
def test_param(n): assert n
'''


def test_isolated_tests_give_each_test_its_own_result(tmp_path):
    """bench/isolated_tests.py, which runs the GPU canary: one process per test, a failure and a hang
    told apart (exit 2 for a hang, which makes gpu_check.sh leave the wgmma cases out)."""
    (tmp_path / "test_cases.py").write_text(ISOLATED_CASES)
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "isolated_tests.py"), "--timeout", "20",
                             "--log-dir", str(tmp_path / "logs"), "--", "test_cases.py"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = result.stdout.splitlines()
    assert result.returncode == 2, result.stdout + result.stderr
    for line in ("test_cases.py::test_passes PASSED", "test_cases.py::test_fails FAILED", "test_cases.py::test_hangs HUNG",
                 "test_cases.py::test_param[1] PASSED", "test_cases.py::test_param[2] PASSED",
                 "FAILED test_cases.py::test_fails - AssertionError: one is not two"):
        assert line in lines, result.stdout
    assert len(list((tmp_path / "logs").iterdir())) == 5
    # without the hang: 1 (a failure)
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "isolated_tests.py"), "--", "test_cases.py",
                             "-k", "not hangs"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 1 and "3 passed, 1 failed" in result.stdout, result.stdout


LOST_CONTEXT_CASES = '''
import pytest
pytestmark = pytest.mark.gpu
def test_a(): pass
def test_b(): raise RuntimeError("cudaErrorIllegalInstruction: an illegal instruction was encountered" if LOSE else "a plain error")
def test_c(): pass
def test_d(): pass
'''


@pytest.mark.parametrize("lose", [True, False], ids=["fault", "plain_error"])
def test_a_lost_context_skips_the_later_gpu_tests(tmp_path, lose):
    """tests/gpu_context.py: after an error that ends the CUDA context, the process's later GPU tests
    are skipped, naming the test that lost it, and listed for gpu_check.sh to run again; after any
    other error they run."""
    (tmp_path / "test_cases.py").write_text(f"LOSE = {lose}\n" + LOST_CONTEXT_CASES)
    lost = tmp_path / "lost.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
               CUPY_ATTN_CONTEXT_LOST=str(lost))
    result = subprocess.run([sys.executable, "-m", "pytest", "test_cases.py", "-p", "gpu_context", "-v", "-rs",
                             "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestUnknownMarkWarning"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    out = result.stdout
    assert "test_cases.py::test_a PASSED" in out and "test_cases.py::test_b FAILED" in out, out
    if lose:
        assert "test_cases.py::test_c SKIPPED" in out and "test_cases.py::test_d SKIPPED" in out, out
        assert "the CUDA context was lost to test_cases.py::test_b (RuntimeError)" in out, out
        # the failed test too: its error may have come from an earlier test's kernel
        assert lost.read_text().split() == ["test_cases.py::test_b", "test_cases.py::test_c", "test_cases.py::test_d"]
    else:
        assert "test_cases.py::test_c PASSED" in out and "test_cases.py::test_d PASSED" in out, out
        assert not lost.exists()
