#!/usr/bin/env bash
# Runs on the GPU machine from a bundle made by scripts/gpu_bundle.sh: installs
# the bundled wheels, then the GPU tests, compute-sanitizer over small decode,
# prefill and TurboQuant cases, the prefill / TurboQuant check scripts, and the
# decode benchmarks against torch SDPA. Results (at most 8 files) go to $OUT
# (or <bundle>/results):
#   env.txt  pytest.txt  sanitizer.txt  ops_check.txt  bench.json  bench.md  decode.png  pytest_benchmark.json
# PYFA_GPU_RUN_STEPS selects steps (default "tests sanitizer ops bench pytest-bench";
# "sweep" adds the decode knob sweep, "variants" the decode kernel variants
# side by side, both written to sweep.jsonl; "variant-tests" reruns the decode
# tests with each variant forced; "serving" runs benchmarks/test_serving_loop.py
# into serving.json + serving.txt (pytest output) + serving.md (scripts/serving_report.py;
# PYFA_SERVING_GATES=1 makes missed targets fail); "hf" runs scripts/hf_generate_bench.py
# into hf.json + hf.md; "main" runs the main job on the GPU, `python -m pyfa info`,
# `check --backend cuda --full` and `bench --backend cuda`, into main.txt + main_bench.png;
# "wgmma" checks and times the Hopper prefill path (scripts/gpu_wgmma_probe.py,
# the prefill-family tests with it selected, benchmarks/cuda_prefill_sweep.py
# beside the mma.sync path) into wgmma.txt, wgmma_tests.txt (P rounded, the default),
# wgmma_tests_exact_p.txt (forced, PYFA_CUDA_PREFILL_P_TERMS=2), wgmma_probe.npz, prefill_sweep.jsonl;
# "gates" runs the GPU perf gates, ratios against torch SDPA and
# FlashAttention-4 timed in the same run (benchmarks/test_cuda_decode.py, test_cuda_prefill.py,
# test_cuda_fa4.py, test_serving_loop.py with --serving-gates), into gates.txt (pytest output)
# + gates.json, and prints each gate's pass / FAIL with its value and bound, and each skip
# with its reason (FA4 not installed, ...)). The $OUT transfer takes at most 8 files: run
# "serving hf" or "gates" on their own (with env.txt, 6 and 3 files).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$here/results}
mkdir -p "$out"
steps=${PYFA_GPU_RUN_STEPS:-tests sanitizer ops bench pytest-bench}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pyfa-site \
    "$here"/wheels/*.whl || exit 1
export PYTHONPATH="$here:/tmp/pyfa-site${PYTHONPATH:+:$PYTHONPATH}"
export PYFA_CACHE_DIR=/tmp/pyfa-cache PYTHONUNBUFFERED=1
cd "$here"
{
    date -u; cat COMMIT 2>/dev/null; nvidia-smi -L; nvidia-smi --query-gpu=driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import torch, pyfa; print('torch', torch.__version__, torch.version.cuda); print(pyfa.backends(), pyfa.Device('cuda'))"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
status=0
has() { [[ " $steps " == *" $1 "* ]]; }
if has tests; then
    echo "== pytest"
    # Worker processes compile kernels in parallel (the disk cache is shared).
    timeout ${PYFA_TEST_TIMEOUT:-400} python3 -m pytest -q -rs -n ${PYFA_TEST_WORKERS:-12} tests 2>&1 | tee "$out/pytest.txt" | tail -25 || status=1
fi
if has sanitizer; then
    echo "== compute-sanitizer"
    for case in cuda_small_decode cuda_small_ops; do
        python3 benchmarks/$case.py > /dev/null 2>&1  # fills the kernel cache outside the tool
        for tool in memcheck racecheck; do
            echo "-- $tool $case" >> "$out/sanitizer.txt"
            timeout ${PYFA_SANITIZER_TIMEOUT:-90} compute-sanitizer --tool $tool --target-processes all python3 benchmarks/$case.py \
                >> "$out/sanitizer.txt" 2>&1 || { echo "$tool $case: exit $?" >> "$out/sanitizer.txt"; status=1; }
        done
    done
    tail -12 "$out/sanitizer.txt"
fi
if has ops; then
    echo "== prefill and TurboQuant checks"
    for script in gpu_prefill_check gpu_tq_check; do
        [ -f scripts/$script.py ] || continue
        echo "-- $script" >> "$out/ops_check.txt"
        timeout ${PYFA_OPS_TIMEOUT:-200} python3 scripts/$script.py >> "$out/ops_check.txt" 2>&1 || { echo "$script: exit $?" >> "$out/ops_check.txt"; status=1; }
    done
    grep -E "FAIL|exit|TFLOP|GB/s|x |summary|passed|failed" "$out/ops_check.txt" | tail -40
fi
if has bench; then
    echo "== benchmarks"
    timeout ${PYFA_BENCH_TIMEOUT:-200} python3 benchmarks/cuda_decode_bench.py --out "$out/bench.json" --md "$out/bench.md" --png "$out/decode.png" \
        2>&1 | tail -20 || status=1
fi
if has pytest-bench; then
    echo "== pytest-benchmark"
    timeout 300 python3 -m pytest -q benchmarks/test_cuda_decode.py benchmarks/test_cuda_prefill.py --benchmark-enable \
        --benchmark-json="$out/pytest_benchmark.json" --benchmark-columns=median \
        2>&1 | tail -15 || status=1
fi
if has sweep; then
    echo "== plan/kernel knob sweep (quick cases, f16)"
    PYFA_KNOB_CASES=quick PYFA_KNOB_DTYPE=f16 PYFA_KNOBS="PYFA_CUDA_VEC_BLOCKS_PER_SM=2;PYFA_CUDA_VEC_BLOCKS_PER_SM=6;\
PYFA_CUDA_VEC_BLOCKS_PER_SM=9;PYFA_CUDA_VEC_STAGES=2;PYFA_CUDA_VEC_ROWS_PER_STEP=8 PYFA_CUDA_VEC_STAGES=2;\
PYFA_CUDA_VEC_MIN_ROWS=64" bash scripts/gpu_decode_knobs.sh "$out/sweep.jsonl" || status=1
fi
if has variant-tests; then
    echo "== decode tests with each kernel variant forced"
    for knobs in "PYFA_CUDA_VEC_MMA=0 PYFA_CUDA_TQ_VEC_MMA=0" "PYFA_CUDA_VEC_MMA=1"; do
        echo "-- $knobs" >> "$out/pytest.txt"
        env $knobs timeout 200 python3 -m pytest -q -n ${PYFA_TEST_WORKERS:-12} -k cuda tests/test_decode.py \
            tests/test_decode_outputs.py tests/test_paged_decode.py tests/test_kvcache.py tests/test_turboquant.py 2>&1 | tail -3 | tee -a "$out/pytest.txt" || status=1
    done
fi
if has serving; then
    echo "== serving-loop benchmarks"
    # -v lists each skipped case, -rs why (the report copies both).
    timeout ${PYFA_SERVING_TIMEOUT:-500} python3 -m pytest -v -rs -p no:cacheprovider benchmarks/test_serving_loop.py \
        --benchmark-enable --benchmark-json="$out/serving.json" --benchmark-columns=median,rounds \
        ${PYFA_SERVING_GATES:+--serving-gates} > "$out/serving.txt" 2>&1 || status=1
    tail -25 "$out/serving.txt"
    python3 scripts/serving_report.py "$out/serving.json" --skips "$out/serving.txt" -o "$out/serving.md" \
        && cat "$out/serving.md" || status=1
fi
if has hf; then
    echo "== transformers generation: pyfa vs sdpa"
    timeout ${PYFA_HF_TIMEOUT:-500} python3 scripts/hf_generate_bench.py --json "$out/hf.json" --md "$out/hf.md" \
        ${PYFA_HF_ARGS:-} 2>&1 | tail -25 || status=1
fi
if has main; then
    echo "== python -m pyfa: info, check --full, bench on cuda"
    { timeout 60 python3 -m pyfa info && timeout ${PYFA_MAIN_CHECK_TIMEOUT:-300} python3 -m pyfa check --backend cuda --full \
        && timeout ${PYFA_MAIN_BENCH_TIMEOUT:-300} python3 -m pyfa bench --backend cuda --plot "$out/main_bench.png"; } \
        > "$out/main.txt" 2>&1 || { echo "main: exit $?" >> "$out/main.txt"; status=1; }
    grep -v '^check [0-9]\|^bench [0-9]' "$out/main.txt" | tail -70
fi
if has gates; then
    echo "== perf gates (against torch SDPA / FlashAttention-4, same run)"
    timeout ${PYFA_GATES_TIMEOUT:-900} python3 -m pytest -v -rs -p no:cacheprovider benchmarks/test_cuda_decode.py \
        benchmarks/test_cuda_prefill.py benchmarks/test_cuda_fa4.py benchmarks/test_serving_loop.py \
        --benchmark-enable --serving-gates --benchmark-columns=median --gate-json="$out/gates.json" \
        > "$out/gates.txt" 2>&1 || status=1
    # The summary: one line per gate (pass / FAIL, value, bound) and per skipped gate test.
    if grep -q "^perf gates: " "$out/gates.txt"; then
        sed -n '/=\+ perf gates =\+/,/^perf gates: /p' "$out/gates.txt"
    else
        echo "gates: no gate summary (pytest did not finish?)"; status=1
    fi
    tail -3 "$out/gates.txt"
fi
if has paged; then
    echo "== paged KV: tests (paged ops + the dense decode and prefill they share kernels with), benchmarks"
    timeout ${PYFA_PAGED_TEST_TIMEOUT:-300} python3 -m pytest -q -rs -n ${PYFA_TEST_WORKERS:-12} ${PYFA_PAGED_TESTS:-tests/test_paged_decode.py \
        tests/test_paged_append.py tests/test_paged_cache.py tests/test_varlen.py tests/test_paged_prefill.py \
        tests/test_decode.py tests/test_turboquant.py tests/test_prefill.py} \
        > "$out/paged_tests.txt" 2>&1 || status=1
    tail -6 "$out/paged_tests.txt"
    timeout ${PYFA_PAGED_BENCH_TIMEOUT:-240} python3 scripts/gpu_paged_bench.py --json "$out/paged.json" \
        > "$out/paged_bench.txt" 2>&1 || { echo "gpu_paged_bench: exit $?" >> "$out/paged_bench.txt"; status=1; }
    timeout ${PYFA_PAGED_BENCH_TIMEOUT:-240} python3 -m pytest -q -rs -p no:cacheprovider benchmarks/test_paged_append_bench.py \
        -k cuda --benchmark-enable --benchmark-columns=median --benchmark-json="$out/paged_append.json" \
        >> "$out/paged_bench.txt" 2>&1 || status=1
    timeout ${PYFA_PAGED_BENCH_TIMEOUT:-240} python3 -m pytest -q -rs -s -p no:cacheprovider benchmarks/test_cuda_varlen.py \
        --benchmark-enable --benchmark-columns=median --benchmark-json="$out/varlen.json" \
        >> "$out/paged_bench.txt" 2>&1 || status=1
    grep -v "^\s*$" "$out/paged_bench.txt" | tail -60
fi
if has wgmma; then
    echo "== Hopper prefill (warpgroup MMA): layout probes, the prefill tests, public calls beside torch"
    # Probes first (an operand-layout error shows there in seconds), then the
    # prefill-family tests with the path selected, then the public-call sweep
    # for the plan's choice, the wgmma path forced (P rounded, the default; then P in two terms) and the
    # mma.sync path.
    PYFA_CUDA_PREFILL_WGMMA=1 timeout 90 python3 scripts/gpu_wgmma_probe.py --out "$out/wgmma_probe.npz" \
        > "$out/wgmma.txt" 2>&1 || status=1
    cat "$out/wgmma.txt"
    PYFA_CUDA_PREFILL_WGMMA=1 timeout ${PYFA_WGMMA_TEST_TIMEOUT:-240} python3 -m pytest -q -rs --tb=line --maxfail=30 \
        -n ${PYFA_TEST_WORKERS:-12} tests/test_prefill.py tests/test_varlen.py tests/test_paged_prefill.py \
        > "$out/wgmma_tests.txt" 2>&1 || status=1
    tail -8 "$out/wgmma_tests.txt"
    PYFA_CUDA_PREFILL_WGMMA=1 PYFA_CUDA_PREFILL_P_TERMS=2 timeout ${PYFA_WGMMA_TEST_TIMEOUT:-240} python3 -m pytest -q -rs --tb=line --maxfail=30 \
        -n ${PYFA_TEST_WORKERS:-12} tests/test_prefill.py tests/test_varlen.py tests/test_paged_prefill.py \
        > "$out/wgmma_tests_exact_p.txt" 2>&1 || status=1
    tail -3 "$out/wgmma_tests_exact_p.txt"
    for knobs in "PYFA_SWEEP=plan-default" "PYFA_CUDA_PREFILL_WGMMA=1" "PYFA_CUDA_PREFILL_WGMMA=1 PYFA_CUDA_PREFILL_P_TERMS=2" \
        "PYFA_CUDA_PREFILL_WGMMA=0"; do
        env $knobs timeout ${PYFA_WGMMA_SWEEP_TIMEOUT:-120} python3 benchmarks/cuda_prefill_sweep.py --label "$knobs" \
            --json "$out/prefill_sweep.jsonl" 2>&1 | grep '^|' || status=1
    done
fi
if has variants; then
    echo "== decode kernel variants (quick cases)"
    for knobs in "PYFA_CUDA_VEC_MMA=0" "PYFA_CUDA_VEC_MMA=1" ${PYFA_GPU_VARIANT_KNOBS:-}; do
        env $knobs timeout 60 python3 benchmarks/cuda_decode_bench.py --quick --label "$knobs" --out "$out/sweep.jsonl" \
            --iters 10 --reps 5 2>&1 | grep '^{' || status=1
    done
fi
exit $status
