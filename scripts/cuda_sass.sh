#!/usr/bin/env bash
# Compiles the CUDA entries whose names start with a prefix (NVRTC, no GPU) and
# prints their resource use, or with --sass their SASS, through cuobjdump; with
# --spills, ptxas's own report of each entry's spill stores and loads as well.
#   bash scripts/cuda_sass.sh [--sass] [--spills] <entry prefix> [arch (default sm_90a)]
# e.g. bash scripts/cuda_sass.sh --sass flash_attn_vec__fc2_2_128_0_0_1_2_0_1
# cuobjdump: $CUOBJDUMP, else on PATH (CUDA toolkit, or pip's nvidia-cuda-cuobjdump).
# The kernels are built as a plan builds them (PYFA_CUDA_COMPILE_FULL=1), so the
# registers, stack and spills shown are the launched kernel's; NVRTC's log
# (ptxas's warnings) comes first.
set -euo pipefail
cd "$(dirname "$0")/.."
sass=0
log=1
while [ "${1:-}" = "--sass" ] || [ "${1:-}" = "--spills" ]; do
    if [ "$1" = "--sass" ]; then sass=1; else log=2; fi
    shift
done
prefix=${1:?entry name prefix}
arch=${2:-sm_90a}
tool=${CUOBJDUMP:-$(command -v cuobjdump || true)}
[ -n "$tool" ] || { echo "cuobjdump not found: set CUOBJDUMP" >&2; exit 2; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
PYFA_CACHE_DIR="$dir" PYFA_CUDA_COMPILE_FULL=1 PYFA_CUDA_COMPILE_LOG=$log PYFA_CUDA_COMPILE_ONLY="$prefix" PYTHONPATH=. python3 scripts/cuda_compile_check.py "$arch"
for f in "$dir"/cuda/*.cubin; do
    # pyfa's cache files carry a 24-byte header (magic, size, hash) before the ELF image
    tail -c +25 "$f" > "$dir/image.elf"
    if [ $sass = 1 ]; then
        for fn in $("$tool" -res-usage "$dir/image.elf" | sed -n "s/^ Function \($prefix[A-Za-z0-9_]*\):$/\1/p"); do
            "$tool" -sass -fun "$fn" "$dir/image.elf"
        done
    else
        "$tool" -res-usage "$dir/image.elf" | grep -A1 "Function $prefix"
    fi
done
