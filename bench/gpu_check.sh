#!/usr/bin/env bash
# One command for a lent GPU: GPU tests, compute-sanitizer, benchmark. Installs nothing; runs
# from the source tree with the machine's CuPy, PyTorch and JAX.
#
#   bash bench/gpu_check.sh OUTDIR [--full] [--only tests,sanitize,bench]
#
# Writes logs, results.json and PNGs to OUTDIR and prints a summary last. Exits non-zero when any
# GPU test fails (the sanitizer and benchmark still run, so one call gives all the evidence).
# Each step has its own time limit (tests 300 s, each sanitizer tool 150 s, benchmark 420 s);
# where one device call may run 600 s, split the steps over two calls with --only, e.g.
# "--only tests,sanitize" and then "--only bench".
set -uo pipefail
out=${1:?usage: bench/gpu_check.sh OUTDIR [--full] [--only tests,sanitize,bench]}
shift
quick=--quick
steps=tests,sanitize,bench
while [ $# -gt 0 ]; do
    case "$1" in
        --full) quick= ;;
        --only) steps=${2:?--only needs a comma-separated list of tests, sanitize, bench}; shift ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done
run() { case ",$steps," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0

echo "== environment" | tee "$out/summary.txt"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python -m cupy_attn info; } 2>&1 | tee "$out/info.log"

if run tests; then
    echo "== GPU tests" | tee -a "$out/summary.txt"
    timeout 300 python -m pytest tests -m gpu -q -p no:cacheprovider > "$out/gpu_tests.log" 2>&1 || status=1
    tail -n 3 "$out/gpu_tests.log" | tee -a "$out/summary.txt"
fi

sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
run sanitize || sanitizer=skip
for tool in memcheck racecheck; do
    [ "$sanitizer" = skip ] && break
    echo "== compute-sanitizer $tool" | tee -a "$out/summary.txt"
    if [ -n "$sanitizer" ]; then
        timeout 150 "$sanitizer" --tool "$tool" --error-exitcode 3 python bench/sanitize_cases.py > "$out/sanitizer_$tool.log" 2>&1
        rc=$?
        [ $rc -eq 0 ] || status=1
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitize cases ran" "$out/sanitizer_$tool.log" | tee -a "$out/summary.txt"
        echo "exit $rc" | tee -a "$out/summary.txt"
    else
        echo "compute-sanitizer not found" | tee -a "$out/summary.txt"
    fi
done

if run bench; then
    echo "== benchmark" | tee -a "$out/summary.txt"
    timeout 420 python bench/bench_attention.py $quick --out "$out" > "$out/bench.log" 2>&1 || echo "benchmark exit $?" | tee -a "$out/summary.txt"
    sed -n '/relative to the best other/,$p' "$out/bench.log" | tee -a "$out/summary.txt"
fi
[ $status -eq 0 ] && echo "GPU CHECK PASSED" || echo "GPU CHECK FAILED (see $out/*.log)"
exit $status
