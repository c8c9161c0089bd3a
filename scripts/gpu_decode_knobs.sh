#!/usr/bin/env bash
# Decode plan/kernel knobs at the serving shapes (Hq/Hkv 32/8, D 128, bf16; B 1 and 8;
# 4K and 32K), each setting in its own process (the knobs are read once), beside
# torch flash and cuDNN. Appends one JSON line per setting to $1 (default sweep.jsonl).
# Run on the GPU machine from a bundle (after gpu_run.sh installed its wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-sweep.jsonl}
cases=${PYFA_KNOB_CASES:-"32,8,128,32768,1;32,8,128,32768,8;32,8,128,4096,8"}
for knobs in "PYFA_CUDA_VEC_BLOCKS_PER_SM=0" "PYFA_CUDA_VEC_BLOCKS_PER_SM=4" "PYFA_CUDA_VEC_BLOCKS_PER_SM=8" \
             "PYFA_CUDA_VEC_BLOCKS_PER_SM=16" "PYFA_CUDA_VEC_MMA=0" "PYFA_CUDA_VEC_MMA=1" \
             "PYFA_CUDA_VEC_MMA_STAGES=3" "PYFA_CUDA_VEC_MMA_STAGES=5" "PYFA_CUDA_VEC_STAGES=4" "PYFA_CUDA_VEC_MIN_ROWS=256" \
             ${PYFA_KNOB_EXTRA:-}; do
    env $knobs timeout 60 python3 benchmarks/cuda_decode_bench.py --cases "$cases" --dtype bf16 --label "$knobs" \
        --out "$out" --iters 20 --reps 7 2>&1 | grep '^{' || echo "$knobs: failed"
done
