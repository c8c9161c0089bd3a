#!/usr/bin/env bash
# pyfa's CPU decode beside ggml's (the kernels llama.cpp runs on a CPU), in one run:
#   bash benchmarks/ggml_peer/run.sh [THREADS (default 2)]
# Clones ggml at a fixed commit into $GGML_DIR (default /tmp/pyfa-ggml; needs git, cmake and a C
# compiler), builds its CPU backend for this machine (GGML_NATIVE), builds the harness
# ggml_decode.c against it, and runs compare.py (pyfa from this checkout: bash scripts/build.sh first).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
threads=${1:-2}
commit=d99724f2b141fed9e1a9f402213506c081433465
dir=${GGML_DIR:-/tmp/pyfa-ggml}
if [ ! -d "$dir/.git" ]; then
    git clone -q https://github.com/ggml-org/ggml.git "$dir"
fi
git -C "$dir" checkout -q "$commit"
cmake -S "$dir" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_BUILD_TESTS=OFF \
    -DGGML_BUILD_EXAMPLES=OFF > /dev/null
cmake --build "$dir/build" -j "$(nproc)" > /dev/null
cc -O2 -o "$dir/ggml_decode" "$here/ggml_decode.c" -I"$dir/include" -L"$dir/build/src" -lggml -lggml-base \
    -lggml-cpu -Wl,-rpath,"$dir/build/src" -lm
python3 "$here/compare.py" "$dir/ggml_decode" --threads "$threads"
