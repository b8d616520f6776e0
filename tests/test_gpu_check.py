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
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(tmp_path), "--dry-run",
                             "--only", "tests,sanitize,bench,sweep,inference,mods"], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = (tmp_path / "summary.txt").read_text()
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
    assert (tmp_path / "results.json").exists()


def test_unknown_step_is_refused_before_anything_runs(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(tmp_path), "--only", "tests,bnech"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "unknown step: bnech" in result.stderr
    assert not (tmp_path / "summary.txt").exists()
