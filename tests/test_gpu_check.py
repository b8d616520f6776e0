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
                 "== benchmark", "== Nsight Compute", "== tile sweep", "== inference benchmark",
                 "== programmable attention benchmark"):
        assert step in summary
    assert "compiled 2 variants" in summary
    assert "sanitize cases ran: " in summary
    assert "relative to the best other implementation" in summary
    assert "ran forward and backward" in summary
    assert "candidates, 0 unusable" in summary  # every prepared tile candidate builds
    assert "decode  B=4" in summary and "prefill " in summary
    assert "mods document S=256" in summary and "mods bias     S=256" in summary
    assert summary.rstrip().endswith("GPU CHECK DRY RUN PASSED")
    assert (out / "results.json").exists()


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

