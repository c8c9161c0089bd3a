#!/usr/bin/env bash
# Sanitizer run: libpyfa built with AddressSanitizer (Swift and C) and
# UndefinedBehaviorSanitizer (C; swiftc has no -sanitize=undefined on Linux,
# and Swift's own overflow and bounds checks trap in release builds anyway),
# then the Python test suite, the hypothesis fuzzer and the C-ABI fuzzer
# against it. Any sanitizer report aborts the process that made it, so it
# fails the step that ran it.
#
#   bash scripts/sanitizer_run.sh            # fuzzers for 60 s each
#   PYFA_SANITIZER_FUZZ_SECONDS=600 bash scripts/sanitizer_run.sh
#
# The build goes to .build-asan (dynamic Swift runtime: the static stdlib and
# the sanitizer runtimes do not link together), leaving .build and pyfa/_lib
# alone; Python loads it through $PYFA_LIBRARY, with the toolchain's ASan
# runtime preloaded (python3 itself is not instrumented).
set -uo pipefail
cd "$(dirname "$0")/.."
seconds=${PYFA_SANITIZER_FUZZ_SECONDS:-60}
scratch=.build-asan
t0=$SECONDS

step() { echo "sanitizer_run: $* ($((SECONDS - t0)) s)"; }

step "building libpyfa with -sanitize=address / -fsanitize=address,undefined"
swift build -c release --product pyfa --scratch-path "$scratch" \
    -Xswiftc -sanitize=address -Xcc -fsanitize=address,undefined -Xcc -fno-sanitize-recover=undefined \
    2>&1 | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
lib="$(swift build -c release --scratch-path "$scratch" --show-bin-path)/libpyfa.so"
[ -f "$lib" ] || { echo "sanitizer_run: $lib not built"; exit 1; }

swift_bin=$(readlink -f "$(command -v swift)")
runtime=$(ls "$(dirname "$swift_bin")"/../lib/clang/*/lib/linux/libclang_rt.asan-x86_64.so 2>/dev/null | head -1)
[ -n "$runtime" ] || { echo "sanitizer_run: the toolchain has no libclang_rt.asan-x86_64.so"; exit 1; }

# The toolchain's Swift runtime (the library links it dynamically here).
swift_libs="$(dirname "$swift_bin")/../lib/swift/linux"
export PYFA_LIBRARY="$lib"
export LD_LIBRARY_PATH="$swift_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_PRELOAD="$runtime"
# Python's allocations live until exit by design: no leak report.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
python3 -c "import pyfa._native as n; assert n.LIBRARY_PATH.samefile('$lib'), n.LIBRARY_PATH" || exit 1

step "test suite"
python3 -m pytest -q -p no:cacheprovider tests || exit 1
step "hypothesis fuzzer (about ${seconds} s)"
# Examples sized from the CPU backend's rate under ASan (~200 examples/s over the 4 tests).
PYFA_FUZZ_EXAMPLES=$((seconds * 50 + 1)) python3 -m pytest -q -p no:cacheprovider tests/test_fuzz_api.py || exit 1
step "C-ABI fuzzer (${seconds} s)"
python3 tests/fuzz_cabi.py --seed 1000 --calls 1000 --seconds "$seconds" | tail -1
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "sanitizer_run: C-ABI fuzzer died (rerun with --trace for the call)"; exit 1; }
step "done, no sanitizer finding"
