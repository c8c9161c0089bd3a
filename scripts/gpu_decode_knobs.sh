#!/usr/bin/env bash
# Decode plan/kernel knobs, each setting in its own process (the knobs are read
# once), beside torch flash and cuDNN; one JSON line per setting appended to $1
# (default sweep.jsonl). Run on the GPU machine from a bundle after gpu_run.sh
# installed its wheels (gpu_run.sh's "sweep" step calls it).
#   PYFA_KNOBS        settings separated by ";" (default: the list below)
#   PYFA_KNOB_CASES   "Hq,Hkv,D,kv_len,B;..." or "quick" (cuda_decode_bench.py's quick cases);
#                     default: the serving shapes, Hq/Hkv 32/8, D 128, B 1 and 8, 4K and 32K
#   PYFA_KNOB_DTYPE   f16 or bf16 (default bf16)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-sweep.jsonl}
cases=${PYFA_KNOB_CASES:-"32,8,128,32768,1;32,8,128,32768,8;32,8,128,4096,8"}
which=(--cases "$cases")
[ "$cases" = quick ] && which=(--quick)
IFS=';' read -ra settings <<< "${PYFA_KNOBS:-PYFA_CUDA_VEC_BLOCKS_PER_SM=0;PYFA_CUDA_VEC_BLOCKS_PER_SM=4;PYFA_CUDA_VEC_BLOCKS_PER_SM=8;PYFA_CUDA_VEC_BLOCKS_PER_SM=16;PYFA_CUDA_VEC_MMA=0;PYFA_CUDA_VEC_MMA=1;PYFA_CUDA_VEC_MMA_STAGES=3;PYFA_CUDA_VEC_MMA_STAGES=5;PYFA_CUDA_VEC_STAGES=4;PYFA_CUDA_VEC_MIN_ROWS=256}"
status=0
for knobs in "${settings[@]}"; do
    env $knobs timeout 60 python3 benchmarks/cuda_decode_bench.py "${which[@]}" --dtype "${PYFA_KNOB_DTYPE:-bf16}" \
        --label "$knobs" --out "$out" --iters 20 --reps 7 2>&1 | grep '^{' || { echo "$knobs: failed"; status=1; }
done
exit $status
