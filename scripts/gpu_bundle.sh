#!/usr/bin/env bash
# Builds a self-contained bundle for a Linux GPU machine that has the NVIDIA
# driver, NVRTC and Python 3.12 but no Swift toolchain:
#   <dest>/pyfa/            the package, with _lib/libpyfa.so (Swift runtime linked in) and headers
#   <dest>/tests/, benchmarks/, scripts/gpu_run.sh, README.md and docs/API.md (their tests)
#   <dest>/wheels/          cffi + pycparser for CPython 3.12 (numpy, ml_dtypes, torch are expected there)
# Usage: [PYFA_BUNDLE_STRIP=1] bash scripts/gpu_bundle.sh [dest (default: bundle/)] ; wheels are taken from
# $PYFA_WHEELS_DIR if set, else downloaded from PyPI.
# On the GPU machine: bash <dest>/scripts/gpu_run.sh   (results go to $OUT or <dest>/results)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-bundle}
bash scripts/build.sh
rm -rf "$dest"
mkdir -p "$dest/scripts" "$dest/wheels"
cp -r pyfa tests benchmarks "$dest/"
mkdir -p "$dest/shaders" && cp -r shaders/common "$dest/shaders/"  # tests read the param headers
# tests/test_readme.py runs the README's CUDA snippets there; test_api_docs.py checks the API page.
mkdir -p "$dest/docs" && cp README.md "$dest/" && cp docs/API.md "$dest/docs/" && cp scripts/gen_api_docs.py "$dest/scripts/"
cp scripts/gpu_run.sh scripts/gpu_*_check.py scripts/gpu_tq_profile.py scripts/gpu_tq_sweep.sh scripts/serving_report.py \
    scripts/hf_generate_bench.py scripts/hf_attention_bench.py scripts/hf_prefill_profile.py scripts/gpu_token_major_bench.py scripts/gpu_prefill_power.py scripts/gpu_prefill_split_bench.py scripts/gpu_decode_knobs.sh scripts/gpu_paged_bench.py scripts/gpu_wgmma_probe.py scripts/gpu_call_overhead.py scripts/gpu_host_profile.py scripts/gpu_tq_attend_time.py scripts/gpu_decode_profile.py scripts/gpu_prefill_profile.py scripts/gpu_prefill_peers.py scripts/gpu_prefill_timeline.py scripts/gpu_prefill_prewarm.py scripts/gpu_prefill_ncu.sh \
    "$dest/scripts/"
find "$dest" -name __pycache__ -prune -exec rm -rf {} +
if [ -n "${PYFA_WHEELS_DIR:-}" ]; then
    cp "$PYFA_WHEELS_DIR"/cffi-*.whl "$PYFA_WHEELS_DIR"/pycparser-*.whl "$dest/wheels/"
else
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$dest/wheels" cffi pycparser
fi
git rev-parse HEAD > "$dest/COMMIT" 2>/dev/null || true
# PYFA_BUNDLE_STRIP=1: the library without its symbol tables (about 10 MB instead of 20), so that
# four bundles fit one transfer for an A / B (scripts/gpu_ab.sh); kernels keep their names.
if [ "${PYFA_BUNDLE_STRIP:-0}" = 1 ]; then strip --strip-unneeded "$dest/pyfa/_lib/libpyfa.so"; fi
du -sh "$dest"
