#!/usr/bin/env bash
# On the GPU machine (from a bundle): times TurboQuant decode against dense f16
# decode (scripts/gpu_tq_check.py) under several settings of the CUDA plan's
# TurboQuant knobs, one block of lines per setting, into $1 (default stdout).
#   PYFA_TQ_KNOBS   settings separated by ";" (default: the list below; an
#                   empty setting is the plan's defaults)
set -uo pipefail
cd "$(dirname "$0")/.."
dest=${1:-/dev/stdout}
IFS=';' read -ra settings <<< "${PYFA_TQ_KNOBS-;PYFA_CUDA_TQ_VEC_MIN_BLOCKS=2;PYFA_CUDA_TQ_VEC_MIN_BLOCKS=3;PYFA_CUDA_TQ_VEC_ROWS_PER_STEP=4;PYFA_CUDA_TQ_VEC_STAGES=2;PYFA_CUDA_TQ_VEC_STAGES=6;PYFA_CUDA_TQ_VEC_HEADS=1}"
for knobs in "${settings[@]}"; do
    echo "-- ${knobs:-defaults}" >> "$dest"
    env $knobs timeout 120 python3 scripts/gpu_tq_check.py 2>&1 | grep -E "time|FAIL|passed|failed" >> "$dest"
done
