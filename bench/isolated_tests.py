"""Run each selected test in its own pytest process, several at a time, each with a time limit.

    python bench/isolated_tests.py [--jobs N] [--timeout S] [--log-dir DIR] [--collect-only] -- PYTEST_ARGS...

For the GPU tests a fault cannot leak from: a kernel that faults ends its process's CUDA context
(every later CUDA call of the process fails), and one that hangs blocks its process. Alone, each
test's result is its own. Prints one line per test in pytest's -v form ("tests/m.py::t PASSED"),
HUNG for a test that outran --timeout, then the failures' short reasons. Exit status: 0 when
every test passed or was skipped, 1 when one failed, 2 when one hung (bench/gpu_check.sh then
leaves the wgmma cases out of the other GPU tests), 3 when nothing was collected.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")


class CollectionError(RuntimeError):
    """pytest could not collect the selection (a module failed to import, say)."""


def collect(python: str, selection: list[str]) -> list[str]:
    listing = subprocess.run([python, "-m", "pytest", *selection, "--collect-only", "-q", "-p", "no:cacheprovider"],
                             capture_output=True, text=True)
    if listing.returncode not in (0, 5):  # 5: nothing collected
        raise CollectionError(listing.stdout + listing.stderr)
    return [line.strip() for line in listing.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def run_one(python: str, test_id: str, timeout: float, extra: list[str], log: Path) -> tuple[str, str]:
    """(outcome, the log's reason line) of one test in a process of its own."""
    command = [python, "-m", "pytest", test_id, "-v", "-rfE", "--tb=short", "-p", "no:cacheprovider", *extra]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        text = done.stdout + done.stderr
    except subprocess.TimeoutExpired as hung:
        text = "".join(x.decode() if isinstance(x, bytes) else x or "" for x in (hung.stdout, hung.stderr))
        log.write_text(text + f"\nHUNG: no result after {timeout:g} s\n")
        return "HUNG", f"no result after {timeout:g} s"
    log.write_text(text)
    if "Timeout" in text and "+++++" in text:  # pytest-timeout ended the process: a hang too
        return "HUNG", "pytest-timeout ended it"
    found = re.search(rf"{re.escape(test_id)} ({'|'.join(OUTCOMES)})", text)
    outcome = found.group(1) if found else "ERROR"
    reasons = [line for line in text.splitlines() if line.startswith("E   ")]
    return outcome, reasons[0][4:].strip() if reasons and outcome in ("FAILED", "ERROR") else ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per test, its process's start included")
    parser.add_argument("--log-dir", type=Path, default=None, help="one log per test (default: a new temporary folder)")
    parser.add_argument("--collect-only", action="store_true", help="list the tests that would run, run none")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: the pytest selection")
    args = parser.parse_args(argv)
    selection = [a for a in args.pytest_args if a != "--"]
    python = sys.executable
    try:
        ids = collect(python, selection)
    except CollectionError as error:
        print(f"pytest could not collect {' '.join(selection)}:\n{error}")
        return 1
    if not ids:
        print(f"no tests collected by {' '.join(selection)}")
        return 3
    if args.collect_only:
        print("\n".join(ids))
        print(f"{len(ids)} tests would each run alone")
        return 0
    logs = args.log_dir or Path(tempfile.mkdtemp(prefix="isolated_tests_"))
    logs.mkdir(parents=True, exist_ok=True)
    # pytest-timeout, where installed, ends a hung test a little before the process's own limit,
    # with the hung threads' stacks in the log.
    timeout_plugin = subprocess.run([python, "-c", "import pytest_timeout"], capture_output=True).returncode == 0
    extra = ["--timeout", f"{max(args.timeout - 15, 5):g}", "--timeout-method", "thread"] if timeout_plugin else []
    names = [logs / (f"{n:03d}_" + re.sub(r"[^A-Za-z0-9_.-]", "_", test_id)[-150:] + ".log") for n, test_id in enumerate(ids)]
    # Each result as it comes, so a run cut short by an outer time limit still says what finished.
    results = {}
    with ThreadPoolExecutor(args.jobs) as pool:
        jobs = {pool.submit(run_one, python, test_id, args.timeout, extra, name): test_id for test_id, name in zip(ids, names)}
        for done in as_completed(jobs):
            results[jobs[done]] = done.result()
            print(f"{jobs[done]} {results[jobs[done]][0]}", flush=True)
    results = [results[test_id] for test_id in ids]
    for test_id, (outcome, reason) in zip(ids, results):
        if outcome in ("FAILED", "ERROR", "HUNG"):
            print(f"{outcome} {test_id} - {reason}")
    counts = {o: sum(r[0] == o for r in results) for o in (*OUTCOMES, "HUNG")}
    print(", ".join(f"{n} {o.lower()}" for o, n in counts.items() if n) + f" (each alone; logs in {logs})")
    if counts["HUNG"]:
        return 2
    return 1 if counts["FAILED"] or counts["ERROR"] or counts["XPASS"] else 0


if __name__ == "__main__":
    sys.exit(main())
