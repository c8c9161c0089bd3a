#!/usr/bin/env bash
# FlashAttention-4 (flash_attn.cute) for the GPU gates, from wheels, on a GPU
# machine that cannot reach PyPI:
#   bash scripts/gpu_fa4.sh download DIR      # here: the CPython 3.12 wheels into DIR
#   bash scripts/gpu_fa4.sh install DIR SITE  # there: DIR's wheels into SITE (--target)
# then, on the GPU machine, before scripts/gpu_run.sh (step "gates"):
#   export PYTHONPATH=SITE:SITE/nvidia_cutlass_dsl/dsl_packages
# (a --target install skips the .pth file that adds dsl_packages). Wheels split
# with `split` to fit a transfer (name.whl.part.aa, .ab, ...) are joined first.
set -euo pipefail
case "${1:-}" in
download)
    dir=${2:?usage: gpu_fa4.sh download DIR}
    mkdir -p "$dir"
    python3 -m pip download -q --pre --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$dir" \
        flash-attn-4 nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core \
        nvidia-cutlass-dsl-libs-cu13 apache-tvm-ffi torch-c-dlpack-ext quack-kernels
    ls -la "$dir" ;;
install)
    dir=${2:?usage: gpu_fa4.sh install DIR SITE}; site=${3:?usage: gpu_fa4.sh install DIR SITE}
    for first in "$dir"/*.whl.part.aa; do
        [ -e "$first" ] || continue
        whl=${first%.part.aa}
        cat "$whl".part.* > "$whl" && rm "$whl".part.*
    done
    python3 -m pip install -q --no-deps --no-compile --target "$site" "$dir"/*.whl
    PYTHONPATH="$site:$site/nvidia_cutlass_dsl/dsl_packages" python3 -c \
        "from flash_attn.cute import flash_attn_func; print('FlashAttention-4 imports from $site')" ;;
*)
    echo "usage: gpu_fa4.sh download DIR | install DIR SITE" >&2; exit 2 ;;
esac
