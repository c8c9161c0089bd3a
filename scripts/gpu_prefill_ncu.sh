#!/usr/bin/env bash
# Nsight Compute profiles of one prefill shape, ours, FlashAttention-4's or cuDNN's (torch SDPA), on the
# GPU machine (after scripts/gpu_run.sh's setup; FA4 on PYTHONPATH for `fa4`):
#   bash scripts/gpu_prefill_ncu.sh pyfa|fa4|cudnn OUTDIR [Hq,Hkv,D,L,causal]
# writes OUTDIR/<who>_<shape>.{time.txt,details.txt,sass.csv.gz}: CUDA-event
# timings of the public call, ncu's details page (--set full) and its per-instruction
# source view (SASS with executed instructions and stall samples), so the two
# kernels' loops can be compared instruction by instruction (scripts/ncu_sass_mix.py).
set -euo pipefail
cd "$(dirname "$0")/.."
who=${1:?pyfa, fa4 or cudnn}; out=${2:?output folder}; shape=${3:-16,8,128,16384,0}
mkdir -p "$out"
tag="${who}_${shape//,/_}"
flag=(); regex="regex:flash_attn_prefill"
if [ "$who" = cudnn ]; then
    flag=(--cudnn); regex="regex:(?i)(sdpa|fmha|attn|cudnn)"
elif [ "$who" = fa4 ]; then
    flag=(--fa4); regex="regex:(?i)flash"
fi
python3 scripts/gpu_prefill_profile.py "${flag[@]}" --shape "$shape" | tee "$out/$tag.time.txt"
ncu --set full --import-source yes -k "$regex" --launch-skip 2 --launch-count 1 -f -o "/tmp/$tag" \
    python3 scripts/gpu_prefill_profile.py "${flag[@]}" --once --shape "$shape" > "$out/$tag.ncu_log.txt" 2>&1
ncu -i "/tmp/$tag.ncu-rep" --page details > "$out/$tag.details.txt"
ncu -i "/tmp/$tag.ncu-rep" --page source --csv --print-source sass | gzip > "$out/$tag.sass.csv.gz"
echo "$tag: $(grep -c . "$out/$tag.details.txt") lines of details"
