"""The C-ABI fuzz harness (tests/fuzz_cabi.py) in a subprocess: a crash is a
failed test naming the seed and the last call, not a dead pytest.

Calls per seed: $PYFA_FUZZ_CABI_CALLS, else 1500 on the CPU backend and 200
on others; seeds 0..2, or $PYFA_FUZZ_CABI_SEEDS (a comma list)."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parent / "fuzz_cabi.py"
BACKEND = os.environ.get("PYFA_BACKEND") or "cpu"
CALLS = int(os.environ.get("PYFA_FUZZ_CABI_CALLS") or (1500 if BACKEND == "cpu" else 200))
SEEDS = [int(s) for s in (os.environ.get("PYFA_FUZZ_CABI_SEEDS") or "0,1,2").split(",")]


@pytest.mark.parametrize("seed", SEEDS)
def test_cabi_fuzz_survives(seed):
    cmd = [sys.executable, str(HARNESS), "--seed", str(seed), "--calls", str(CALLS), "--backend", BACKEND, "--trace"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    calls = [line for line in p.stdout.splitlines() if line.startswith("CALL ")]
    if p.returncode != 0:
        how = f"signal {signal.Signals(-p.returncode).name}" if p.returncode < 0 else f"exit status {p.returncode}"
        pytest.fail(f"C-ABI fuzzer died ({how}) at seed {seed}, call {len(calls)}; reproduce with\n"
                    f"  {' '.join(cmd[1:])}\nlast call: {calls[-1] if calls else '(none)'}\n{p.stderr[-3000:]}")
    result = p.stdout.splitlines()[-1]
    assert result.startswith("RESULT ") and "crashes=0" in result, p.stdout[-2000:]
