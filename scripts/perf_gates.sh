#!/usr/bin/env bash
# CI's performance gates (about 1 minute on 2 cores); each prints what it
# compared and the script exits 1 if any gate failed, naming it:
#   1. CPU-kernel instruction counts under valgrind --tool=callgrind against
#      benchmarks/callgrind_baseline.json (scripts/callgrind_gate.py), then its
#      self-test (extra kernel work must fail the gate);
#   2. CPU ratio gates: pyfa against numpy (and torch SDPA when installed)
#      timed in the same run (benchmarks/test_cpu_gates.py).
# valgrind is installed with apt-get when missing (as root or through
# passwordless sudo); without a way to install it the script fails, saying so.
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS

if ! command -v valgrind >/dev/null 2>&1; then
    echo "perf_gates: installing valgrind"
    if [ "$(id -u)" -eq 0 ]; then
        sudo=()
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo=(sudo -n)
    else
        echo "perf_gates: FAILED: valgrind is missing and installing it needs root (no passwordless sudo)" >&2
        exit 1
    fi
    command -v apt-get >/dev/null 2>&1 || { echo "perf_gates: FAILED: valgrind is missing and there is no apt-get" >&2; exit 1; }
    { "${sudo[@]}" apt-get update -qq && DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq valgrind; } \
        >/tmp/pyfa-apt-valgrind.log 2>&1 \
        || { tail -20 /tmp/pyfa-apt-valgrind.log; echo "perf_gates: FAILED: apt-get install valgrind" >&2; exit 1; }
fi

failed=()
echo "== callgrind instruction-count gate"
python3 scripts/callgrind_gate.py || failed+=("callgrind gate")
python3 scripts/callgrind_gate.py --selftest || failed+=("callgrind gate self-test")
echo "== CPU ratio gates ($((SECONDS - t0)) s)"
python3 -m pytest -q -rs -p no:cacheprovider benchmarks/test_cpu_gates.py --benchmark-enable \
    --benchmark-columns=min,median,rounds || failed+=("CPU ratio gates")
echo "perf_gates: $((SECONDS - t0)) s"
if [ ${#failed[@]} -gt 0 ]; then
    printf 'perf_gates: FAILED: %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "perf_gates: all passed"
