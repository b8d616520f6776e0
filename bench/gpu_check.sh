#!/usr/bin/env bash
# One command for a lent GPU: GPU tests, compute-sanitizer, benchmark and Nsight Compute. Installs
# nothing; runs from the source tree with the machine's python3, CuPy, PyTorch and JAX.
#
#   bash bench/gpu_check.sh OUTDIR [--only tests,sanitize,bench,sweep,inference,mods] [--bench-budget S] [--full] [--dry-run]
#
# Every run first compiles all kernel variants in parallel into CuPy's disk cache (precompile.py),
# so no timed step compiles. Steps:
#   tests     pytest -m gpu (both kernel families): first a canary of the Hopper primitives and one wgmma
#             forward and backward, then the rest (without the wgmma cases if the canary failed);
#             per-test timeout, one line per module in the summary
#   sanitize  compute-sanitizer memcheck, racecheck and synccheck over bench/sanitize_cases.py
#   bench     bench/bench_attention.py against SDPA's flash/cuDNN/efficient and JAX (stops starting
#             cases after --bench-budget seconds), then the wgmma kernels alone in a process of
#             their own (half that budget), the host time per call (bench/host_profile.py), the
#             wgmma forward persistent and with a block per tile (bench/persistence.py; only if the
#             wgmma benchmark ran and its results were right), then ncu on one forward and one
#             dK/dV launch per kernel family (bench/ncu_cases.py)
#   sweep     (only when named) bench/tile_sweep.py: candidate tiles of the default kernels, each
#             checked against the reference, then timed (stops starting candidates after
#             --bench-budget seconds)
#   inference (only when named) bench/bench_inference.py: decode over contiguous and paged KV caches
#             (achieved bandwidth) and packed prefill, against SDPA (stops after --bench-budget s)
#   mods      (only when named) bench/bench_mods.py: MaskMod document and window-with-global-token
#             masks and a ScoreMod bias table against SDPA with the dense mask and FlexAttention
#             (stops after --bench-budget s)
# Each step has its own time limits. On the 2026-12-04 H200 run "--only tests" took about 2
# minutes, "--only bench --bench-budget 70" with Nsight Compute about 2 and "--only sanitize" about
# 1.5 (from the summaries' start times); the limits add up to more (tests: precompile 150 s,
# canary 160, the rest 180, reruns 150; sanitize: 100 per tool; bench: --bench-budget + 150, the
# wgmma kernels' --bench-budget / 2 + 120, host profile 120, persistence 90, ncu 150 + 120), so
# wrap a device call in `timeout` and write OUTDIR outside $OUT,
# copying it back after. Writes logs, results.json, PNGs and the ncu report to OUTDIR and prints a one-screen summary last. Exits non-zero when a GPU test or
# a sanitizer fails (the other steps still run, so one call gives all the evidence).
#
# --dry-run runs every step's CPU twin (NVRTC instead of CuPy, test collection, the emulator, the
# CPU benchmark) so a typo never costs GPU minutes; CI runs it (tests/test_gpu_check.py).
set -uo pipefail
usage="usage: bench/gpu_check.sh OUTDIR [--only tests,sanitize,bench] [--bench-budget S] [--full] [--dry-run]"
out=${1:?$usage}
shift
case "$out" in -*) echo "OUTDIR comes first, got the option $out; $usage" >&2; exit 2 ;; esac
# Relative to where the command was given, not to the checkout this script moves into.
case "$out" in /*) ;; *) out=$PWD/$out ;; esac
steps=tests,sanitize,bench
budget=200
size=
dry=
while [ $# -gt 0 ]; do
    case "$1" in
        --only) steps=${2:?--only needs a comma-separated list of tests, sanitize, bench}; shift ;;
        --bench-budget) budget=${2:?--bench-budget needs seconds}; shift
            case "$budget" in ''|*[!0-9]*) echo "--bench-budget needs whole seconds, got $budget" >&2; exit 2 ;; esac
            budget=$((10#$budget)) ;;  # 08 is 8, not an invalid octal number
        --full) size=--full ;;
        --dry-run) dry=1 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done
for step in ${steps//,/ }; do
    case "$step" in tests|sanitize|bench|sweep|inference|mods) ;; *) echo "unknown step: $step (tests, sanitize, bench, sweep, inference, mods)" >&2; exit 2 ;; esac
done
run() { case ",$steps," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
cd "$(dirname "$0")/.."
mkdir -p -- "$out" && out=$(cd -- "$out" && pwd) || { echo "cannot make OUTDIR $out" >&2; exit 2; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX would otherwise take 75% of the GPU from CuPy and PyTorch
py=${PYTHON:-python3}
status=0
note() { echo "$*" | tee -a "$out/summary.txt"; }
: > "$out/summary.txt"

note "== environment ($(date -u +%FT%TZ))"
{ [ -n "$dry" ] || nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  $py -m cupy_attn info; } > "$out/setup.log" 2>&1
grep -E "^GPU|cupy-cuda|torch|jax|NVIDIA" "$out/setup.log" | tee -a "$out/summary.txt"
note "== compile every variant in parallel"
timeout 150 $py bench/precompile.py ${dry:+--dry-run} >> "$out/setup.log" 2>&1 || { note "precompile failed (see setup.log)"; status=1; }
tail -n 1 "$out/setup.log" | tee -a "$out/summary.txt"

if run tests; then
    note "== GPU tests"
    extra=()
    $py -c "import xdist" 2>/dev/null && extra+=(-n 8)
    # A kernel that never finishes (an mbarrier phase nobody completes) blocks its worker inside a
    # CUDA call, where the default signal method cannot interrupt it: the thread method ends that
    # worker after 90 s (pytest-xdist reports the test as crashed and starts a new worker), so a hang
    # costs one test rather than the step's whole time limit.
    timeout_args=()
    $py -c "import pytest_timeout" 2>/dev/null && timeout_args=(--timeout 90 --timeout-method thread)
    # The canary goes first: the Hopper primitives (TMA, mbarriers, wgmma) and one wgmma forward and
    # backward, each test in a process of its own (bench/isolated_tests.py), since a kernel fault
    # ends its process's CUDA context: on the first H200 run one faulting TMA test turned the 15
    # canary tests after it into failures that said nothing of their own kernels. Should a canary
    # test hang, the rest runs without the wgmma cases, so a broken wgmma path costs the canary's
    # minute rather than a hang per wgmma test; failures alone leave them in (each says what fails).
    first="test_gpu_hopper or test_hopper_gpus_run_mma_sync_unless_wgmma_is_asked_for"
    canary=(tests/test_gpu_hopper.py tests/test_gpu.py -k "$first")
    others="not ($first)"
    # Tests skipped in a process whose context a fault ended (tests/gpu_context.py) are listed here
    # and run again, in fresh processes, after the others.
    lost="$out/context_lost.txt"
    : > "$lost"
    if [ -n "$dry" ]; then
        # Collection only: where CuPy is missing the GPU modules skip themselves (exit 5, nothing
        # collected); what this checks is the command lines and that every test module imports.
        $py bench/isolated_tests.py --collect-only -- "${canary[@]}" > "$out/gpu_tests_canary.log" 2>&1
        rc=$?
        [ $rc -eq 0 ] || [ $rc -eq 3 ] || status=1  # 3: nothing collected (no CuPy here)
        tail -n 1 "$out/gpu_tests_canary.log" | tee -a "$out/summary.txt"
        $py -m pytest tests -m gpu -k "$others" --collect-only -q -p no:cacheprovider "${extra[@]}" "${timeout_args[@]}" \
            > "$out/gpu_tests.log" 2>&1
        rc=$?
        [ $rc -eq 0 ] || [ $rc -eq 5 ] || status=1
        tail -n 1 "$out/gpu_tests.log" | tee -a "$out/summary.txt"
    else
        # About 20 tests in 3 rounds of 8 at most 45 s each: the outer limit leaves the runner time to
        # report; each result is logged as it comes, so even a cut-short canary says what finished.
        timeout 160 $py bench/isolated_tests.py --jobs 8 --timeout 45 --log-dir "$out/canary" -- "${canary[@]}" \
            > "$out/gpu_tests_canary.log" 2>&1
        rc=$?
        note "canary: exit $rc ($(tail -n 1 "$out/gpu_tests_canary.log"))"
        grep -E "^(FAILED|ERROR|HUNG) " "$out/gpu_tests_canary.log" | cut -c1-200 | tee -a "$out/summary.txt"
        [ $rc -eq 0 ] || status=1
        if [ $rc -eq 2 ] || [ $rc -eq 124 ]; then
            note "a wgmma canary test hung (see gpu_tests_canary.log): the other GPU tests run without the wgmma cases"
            others="$others and not wgmma"
        fi
        CUPY_ATTN_CONTEXT_LOST="$lost" timeout 180 $py -m pytest tests -m gpu -k "$others" -v -rfE --tb=short \
            -p no:cacheprovider "${extra[@]}" "${timeout_args[@]}" > "$out/gpu_tests.log" 2>&1 || status=1
        tail -n 1 "$out/gpu_tests.log" | tee -a "$out/summary.txt"
        if [ -s "$lost" ]; then
            note "$(sort -u "$lost" | wc -l) tests skipped after a fault ended their process's context: run again, each alone"
            mapfile -t rerun < <(sort -u "$lost")
            timeout 150 $py bench/isolated_tests.py --jobs 8 --timeout 45 --log-dir "$out/rerun" -- "${rerun[@]}" \
                > "$out/gpu_tests_rerun.log" 2>&1 || status=1
            grep -E "^(FAILED|ERROR|HUNG) " "$out/gpu_tests_rerun.log" | cut -c1-200 | tee -a "$out/summary.txt"
            tail -n 1 "$out/gpu_tests_rerun.log" | tee -a "$out/summary.txt"
        fi
        # one line per module: passed / failed / errors / skipped / hung, of the canary and the main
        # run (a test skipped there after a lost context counts as skipped; its rerun is listed above)
        # (pytest-xdist prints "[gw0] [ 1%] PASSED tests/m.py::t", plain pytest and the isolated runs
        # "tests/m.py::t PASSED")
        cat "$out/gpu_tests_canary.log" "$out/gpu_tests.log" \
            | grep -oE "\] (PASSED|FAILED|ERROR|SKIPPED) tests/[a-z_]+\.py|^tests/[a-z_]+\.py::[^ ]+ (PASSED|FAILED|ERROR|SKIPPED|HUNG)" \
            | sed -E 's/^\] //; s/::[^ ]+//' | sort | uniq -c | tee -a "$out/summary.txt"
    fi
fi

if run sanitize; then
    sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
    for tool in memcheck racecheck synccheck; do
        note "== compute-sanitizer $tool"
        log="$out/sanitizer_$tool.log"
        if [ -n "$dry" ]; then
            $py bench/sanitize_cases.py --dry-run > "$log" 2>&1
        elif [ -n "$sanitizer" ]; then
            # memcheck also reports failed CUDA API calls, and cuda-bindings' driver module asks the driver
            # for every entry point it knows when first used (the tensor maps' encoding): 34 refusals of
            # entry points this driver lacks (cuGetProcAddress_v2, CUDA_ERROR_INVALID_VALUE) were the first
            # H200 run's 34 memcheck "errors". Those reports are off; CuPy raises on any failed call of ours.
            api=()
            [ "$tool" = memcheck ] && api=(--report-api-errors no)
            timeout 100 "$sanitizer" --tool "$tool" "${api[@]}" --error-exitcode 3 $py bench/sanitize_cases.py > "$log" 2>&1
        else
            echo "compute-sanitizer not found" > "$log"; false
        fi
        rc=$?
        [ $rc -eq 0 ] || status=1
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitize cases ran|not found" "$log" | tee -a "$out/summary.txt"
        note "exit $rc"
        [ -n "$dry" ] && break
    done
fi

if run bench; then
    note "== benchmark (budget ${budget} s)"
    # The wgmma kernels, whose results no GPU has yet checked, run in a process of their own after
    # the others: a fault there ends only its own CUDA context, a hang only its own time limit.
    if [ -n "$dry" ]; then
        baseline=(--quick --device cpu --budget-s 1 --impls cupy_attn_numpy naive_numpy)
        hopper=(--quick --device cpu --budget-s 1 --impls cupy_attn_numpy)
    else
        baseline=($size --budget-s "$budget" --impls cupy_attn torch_sdpa_flash torch_sdpa_cudnn torch_sdpa_efficient
                  jax_dot_product_attention)
        hopper=($size --budget-s "$(( budget / 2 > 0 ? budget / 2 : 1 ))" --impls cupy_attn_wgmma)
    fi
    timeout $((budget + 150)) $py bench/bench_attention.py "${baseline[@]}" --out "$out" > "$out/bench.log" 2>&1 \
        || note "benchmark exit $?"
    grep -E "^budget|not run" "$out/bench.log" | tee -a "$out/summary.txt"
    sed -n '/relative to the best other/,$p' "$out/bench.log" | tee -a "$out/summary.txt"
    note "== benchmark of the wgmma kernels (budget $((budget / 2)) s; a process of its own)"
    wgmma_ok=1
    timeout $((budget / 2 + 120)) $py bench/bench_attention.py "${hopper[@]}" --out "$out/wgmma" > "$out/bench_wgmma.log" 2>&1
    rc=$?
    if grep -q "^skipping cupy_attn_wgmma" "$out/bench_wgmma.log"; then
        note "$(grep "^skipping cupy_attn_wgmma" "$out/bench_wgmma.log")"; wgmma_ok=0
    elif [ $rc -ne 0 ]; then
        note "wgmma benchmark exit $rc"; wgmma_ok=0
    fi
    grep -q "WRONG" "$out/bench_wgmma.log" && wgmma_ok=0
    grep -E "^budget|not run|checked,|^WRONG" "$out/bench_wgmma.log" | tee -a "$out/summary.txt"
    note "tables of both: python bench/report.py $out/results.json $out/wgmma/results.json"
    # Where the wgmma kernels did not run right, the later steps leave them out (a fault or hang
    # there would cost those steps' time too).
    families=()
    [ $wgmma_ok -eq 1 ] || families=(--default-only)

    note "== host time per call (bench/host_profile.py: cProfile of queued calls)"
    timeout 120 $py bench/host_profile.py ${dry:+--dry-run} "${families[@]}" > "$out/host_profile.log" 2>&1 \
        || note "host profile exit $?"
    grep -E "^host " "$out/host_profile.log" | tee -a "$out/summary.txt"

    note "== persistence (bench/persistence.py: the wgmma forward, a block per SM or per work tile)"
    if [ $wgmma_ok -eq 1 ]; then
        timeout 90 $py bench/persistence.py ${dry:+--dry-run} > "$out/persistence.log" 2>&1 || note "persistence exit $?"
        grep -E "^persistence" "$out/persistence.log" | tee -a "$out/summary.txt"
    else
        note "not run: the wgmma benchmark did not run, failed or found a wrong result (see bench_wgmma.log)"
    fi

    note "== Nsight Compute: one forward and one dK/dV launch per kernel family"
    ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1 || true)
    if [ -n "$dry" ]; then
        $py bench/ncu_cases.py --dry-run "${families[@]}" > "$out/ncu.log" 2>&1 || note "ncu cases failed"
        tail -n 1 "$out/ncu.log" | tee -a "$out/summary.txt"
    elif [ -n "$ncu" ]; then
        timeout 150 "$ncu" --clock-control none -k 'regex:attention_(fwd|bwd_dkdv)' -c 4 \
            --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy --section SchedulerStats \
            --section WarpStateStats --section MemoryWorkloadAnalysis_Tables --section LaunchStats \
            -f -o "$out/ncu" $py bench/ncu_cases.py "${families[@]}" > "$out/ncu.log" 2>&1 || note "ncu exit $?"
        "$ncu" --import "$out/ncu.ncu-rep" --page raw --csv > "$out/ncu_raw.csv" 2>> "$out/ncu.log" \
            && $py bench/ncu_cases.py --summarize "$out/ncu_raw.csv" | tee -a "$out/summary.txt"
        "$ncu" --import "$out/ncu.ncu-rep" --page details > "$out/ncu_details.txt" 2>> "$out/ncu.log"
        # Per SASS instruction (SourceCounters), in a run of its own so that its longer replay cannot
        # cost the report above: which loads of the dK/dV kernels conflict on shared-memory banks
        # and where warps stall. The first H200 run saw 16-19 M conflicts in both that the
        # emulator's counters do not show; the offsets map to NVRTC 13.0's disassembly of each variant.
        timeout 120 "$ncu" --clock-control none -k 'regex:attention_bwd_dkdv' -c 2 --section SourceCounters \
            -f -o "$out/ncu_source" $py bench/ncu_cases.py "${families[@]}" >> "$out/ncu.log" 2>&1 \
            && "$ncu" --import "$out/ncu_source.ncu-rep" --page source --print-source sass --csv > "$out/ncu_sass.csv" \
                2>> "$out/ncu.log" \
            || note "no per-instruction page of the dK/dV kernels (see ncu.log)"
    else
        note "ncu not found"
    fi
fi
if run sweep; then
    note "== tile sweep (budget ${budget} s)"
    if [ -n "$dry" ]; then
        $py bench/tile_sweep.py --dry-run > "$out/sweep.log" 2>&1 || status=1
        tail -n 1 "$out/sweep.log" | tee -a "$out/summary.txt"
    else
        timeout $((budget + 120)) $py bench/tile_sweep.py --out "$out" --budget-s "$budget" > "$out/sweep.log" 2>&1 \
            || note "tile sweep exit $?"
        grep -E "^REJECTED|^budget" "$out/sweep.log" | tee -a "$out/summary.txt"
        sed -n '/best tile per case/,$p' "$out/sweep.log" | tee -a "$out/summary.txt"
    fi
fi
if run inference; then
    note "== inference benchmark (budget ${budget} s)"
    if [ -n "$dry" ]; then
        inference_args=(--device cpu)
    else
        inference_args=(--budget-s "$budget")
    fi
    timeout $((budget + 120)) $py bench/bench_inference.py "${inference_args[@]}" --out "$out/inference" \
        > "$out/inference.log" 2>&1 || note "inference benchmark exit $?"
    grep -E "^(decode|prefill|budget)" "$out/inference.log" | tee -a "$out/summary.txt"
fi
if run mods; then
    note "== programmable attention benchmark (budget ${budget} s)"
    if [ -n "$dry" ]; then
        mods_args=(--device cpu --quick)
    else
        mods_args=(--budget-s "$budget")
    fi
    timeout $((budget + 120)) $py bench/bench_mods.py "${mods_args[@]}" --out "$out/mods" \
        > "$out/mods.log" 2>&1 || note "mods benchmark exit $?"
    grep -E "^(mods|budget)" "$out/mods.log" | tee -a "$out/summary.txt"
fi
if [ -n "$dry" ]; then
    [ $status -eq 0 ] && note "GPU CHECK DRY RUN PASSED" || note "GPU CHECK DRY RUN FAILED (see $out/*.log)"
else
    [ $status -eq 0 ] && note "GPU CHECK PASSED" || note "GPU CHECK FAILED (see $out/*.log)"
fi
exit $status
