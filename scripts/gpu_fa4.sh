#!/usr/bin/env bash
# FlashAttention-4 (flash_attn.cute) for the GPU gates and benchmarks, from wheels, on a GPU
# machine that cannot reach PyPI:
#   bash scripts/gpu_fa4.sh download DIR           # here: the CPython 3.12 wheels into DIR, the
#                                                   # largest repacked into parts (below)
#   bash scripts/gpu_fa4.sh stash DIR...           # there, one transfer: DIR's files into $STASH
#   bash scripts/gpu_fa4.sh install SITE [DIR...]  # there: the stash's and DIRs' wheels and parts
#                                                   # into SITE (--target)
# then, on the GPU machine, before scripts/gpu_run.sh (step "gates") or a benchmark:
#   export PYTHONPATH=SITE:SITE/nvidia_cutlass_dsl/dsl_packages
# (a --target install skips the .pth file that adds dsl_packages).
#
# The CUDA 13 libraries' wheel (nvidia-cutlass-dsl-libs-cu13, ~92 MB) does not fit one transfer
# beside a bundle. download unpacks it and recompresses its files with xz (-9e: ~64 MB) into
# DIR/cu13libs.tar.xz.part.aa, .ab, ... of $FA4_PART_BYTES each (default 30,000,000); carry them
# in separate calls while the machine stays warm, each call stashing what it carried ($STASH,
# default /tmp/pyfa-fa4-stash, outside the repository copy, which a later call replaces), and the
# last call installing. Parts join in name order wherever they are. Wheels split by hand with
# `split` (name.whl.part.aa, ...) are joined as well.
set -euo pipefail
stash=${STASH:-/tmp/pyfa-fa4-stash}
case "${1:-}" in
download)
    dir=${2:?usage: gpu_fa4.sh download DIR}
    mkdir -p "$dir"
    python3 -m pip download -q --pre --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$dir" \
        flash-attn-4 nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core \
        nvidia-cutlass-dsl-libs-cu13 apache-tvm-ffi torch-c-dlpack-ext quack-kernels
    for whl in "$dir"/nvidia_cutlass_dsl_libs_cu13-*.whl; do
        [ -e "$whl" ] || continue
        tmp=$(mktemp -d)
        python3 -m zipfile -e "$whl" "$tmp"
        (cd "$tmp" && tar cf - . | xz -T0 -9e) | split -b "${FA4_PART_BYTES:-30000000}" - "$dir/cu13libs.tar.xz.part."
        rm -rf "$tmp" "$whl"
    done
    ls -la "$dir" ;;
stash)
    shift
    mkdir -p "$stash"
    for d in "$@"; do cp "$d"/* "$stash"/; done
    ls -la "$stash" ;;
install)
    site=${2:?usage: gpu_fa4.sh install SITE [DIR...]}
    shift 2
    dirs=("$stash" "$@")
    work=$(mktemp -d)
    for d in "${dirs[@]}"; do [ -d "$d" ] && cp "$d"/* "$work"/ 2>/dev/null || true; done
    for first in "$work"/*.whl.part.aa; do
        [ -e "$first" ] || continue
        whl=${first%.part.aa}
        cat "$whl".part.* > "$whl" && rm "$whl".part.*
    done
    python3 -m pip install -q --no-deps --no-compile --target "$site" "$work"/*.whl
    # after the wheels: pip --target would replace the nvidia_cutlass_dsl folder these files join
    if compgen -G "$work/cu13libs.tar.xz.part.*" > /dev/null; then
        cat "$work"/cu13libs.tar.xz.part.* | tar xJf - -C "$site"
    fi
    rm -rf "$work"
    PYTHONPATH="$site:$site/nvidia_cutlass_dsl/dsl_packages" python3 -c \
        "from flash_attn.cute import flash_attn_func; print('FlashAttention-4 imports from $site')" ;;
*)
    echo "usage: gpu_fa4.sh download DIR | stash DIR... | install SITE [DIR...]" >&2; exit 2 ;;
esac
