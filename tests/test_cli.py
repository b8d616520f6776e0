"""The command line and the installed package layout."""
import json
import subprocess
import sys

from cupy_attn import _paths


def run(*args):
    return subprocess.run([sys.executable, "-m", "cupy_attn", *args], capture_output=True, text=True, timeout=300)


def test_info_reports_backends():
    result = run("info")
    assert result.returncode == 0, result.stderr
    assert "numpy     available" in result.stdout
    assert "cuda      " in result.stdout and "emulator  " in result.stdout
    assert "GPU:" in result.stdout


def test_demo_checks_against_reference():
    result = run("demo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("backend: ")
    assert "all cases within" in result.stdout
    assert result.stdout.count("e-") >= 4  # one error column entry per case


def test_boundary_model_needs_the_sass_report():
    result = run("kernels", "--boundary", "--dtypes", "float16")
    assert result.returncode != 0
    assert "--boundary models the hot loop of --sass" in result.stderr


def test_kernels_selects_by_name():
    result = run("kernels", "--json", "--arch", "sm_80", "--features", "plain", "--dtypes", "float32",
                 "--kernels", "attention_combine", "attention_bwd_preprocess")
    assert result.returncode == 0, result.stderr
    names = sorted(r["name"].split("<")[0] for r in json.loads(result.stdout))
    # the combine kernel of float32 partials (one), and the preprocess kernel
    assert names == ["attention_bwd_preprocess", "attention_combine"], names


def test_bad_arguments_are_errors_not_tracebacks(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    cases = [
        (("demo", "--seed", "-1"), "argument --seed: must be a non-negative integer, got '-1'"),
        (("kernels", "--kernels", "no_such_kernel"), "no kernel named no_such_kernel; the kernels are: "),
        # a Hopper kernel on sm_80 alone: a kernel, but no variant there
        (("kernels", "--arch", "sm_80", "--kernels", "attention_fwd_wgmma"), "no kernel variant matches"),
        # a filter that selects nothing must not pass as "every variant compiled"
        (("kernels", "--json", "--kernels", "attention_fwd_tc", "--dtypes", "float32"), "no kernel variant matches"),
        (("kernels", "--kernels", "attention_combine", "--ptx-dir", str(a_file)), f"--ptx-dir {a_file} is not a usable "),
    ]
    for args, message in cases:
        result = run(*args)
        assert result.returncode != 0 and message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr, (args, result.stderr)


def test_import_does_not_import_cupy_or_frameworks():
    code = "import sys, cupy_attn; print(sorted(m for m in ('cupy', 'torch', 'jax') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "[]", result.stderr


def test_kernel_sources_are_shipped():
    assert (_paths.kernel_dir() / "README.md").is_file()
