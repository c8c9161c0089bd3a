#!/usr/bin/env bash
# A / B timing of bundles (scripts/gpu_bundle.sh) on one GPU machine, alternated so that
# all see the same clocks and neighbours:
#   bash scripts/gpu_ab.sh BUNDLE_A BUNDLE_B [BUNDLE_C ...] [ROUNDS (default 2)]
# A side may also be a bundle with knobs, BUNDLE@VAR=VALUE[,VAR=VALUE...]: that bundle run with
# those variables set (e.g. bundle/m@PYFA_CUDA_PREFILL_CLUSTER=0 beside bundle/m).
# Each round runs, for every bundle in turn:
#   - scripts/gpu_prefill_profile.py for every shape in $PYFA_AB_PREFILL (space-separated
#     Hq,Hkv,D,L,causal[,N packed sequences: varlen][:options, see that script]; default: D 128
#     and 256 at 16K and 4K);
#   - scripts/gpu_tq_check.py's timing lines when PYFA_AB_TQ=1.
# Lines are prefixed with the bundle's name; the kernel cache is shared (keys carry the source).
set -uo pipefail
usage="usage: gpu_ab.sh BUNDLE_A BUNDLE_B [BUNDLE_C ...] [ROUNDS]"
bundles=()
rounds=2
for arg in "$@"; do
    if [[ "$arg" =~ ^[0-9]+$ ]]; then rounds=$arg; else bundles+=("$arg"); fi
done
[ ${#bundles[@]} -ge 2 ] || { echo "$usage" >&2; exit 2; }
shapes=${PYFA_AB_PREFILL-"16,8,128,16384,1 16,8,128,16384,0 16,8,256,16384,1 16,8,128,4096,1 16,8,256,4096,0"}
export PYFA_CACHE_DIR=${PYFA_CACHE_DIR:-/tmp/pyfa-cache} PYTHONUNBUFFERED=1
for side in "${bundles[@]}"; do
    bundle=${side%%@*}
    (cd "$bundle" && OUT=/tmp/gpu_ab_setup PYFA_GPU_RUN_STEPS=none bash scripts/gpu_run.sh >/dev/null 2>&1) || {
        echo "gpu_ab: $bundle does not set up" >&2; exit 1; }
done
for ((r = 1; r <= rounds; r++)); do
    for side in "${bundles[@]}"; do
        bundle=${side%%@*}
        knobs=()
        name=$(basename "$bundle")
        if [ "$side" != "$bundle" ]; then
            IFS=, read -r -a knobs <<< "${side#*@}"
            name="$name@${side#*@}"
        fi
        for shape in $shapes; do
            echo "$name $(cd "$bundle" && env "${knobs[@]}" PYTHONPATH="$PWD:/tmp/pyfa-site" timeout 60 python3 scripts/gpu_prefill_profile.py --shape "$shape" 2>&1 | tail -1)"
        done
        if [ "${PYFA_AB_TQ:-0}" = 1 ]; then
            (cd "$bundle" && env "${knobs[@]}" PYTHONPATH="$PWD:/tmp/pyfa-site" timeout 150 python3 scripts/gpu_tq_check.py 2>&1) |
                grep -E "^(ok|FAIL) +time" | sed "s|^|$name |"
        fi
    done
done
