"""Instructions a tiny public decode call costs on the CPU backend, whole (Python,
cffi, the library's Swift and the kernel), counted by callgrind: the
difference between a process that makes N calls after a warm-up and one that
makes none, divided by N. Deterministic where wall time on a shared machine is
not, so a change to the call path can be compared before and after.

    python3 scripts/call_instructions.py [--calls 2000]

Needs valgrind and a built library (bash scripts/build.sh).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = """
import sys
import numpy as np
import pyfa
cpu = pyfa.Device("cpu")
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 1, 64), dtype=np.float32)
k = rng.standard_normal((1, 1, 1, 64), dtype=np.float32)
for _ in range(5):
    pyfa.decode_attention(q, k, k, 1, device=cpu)
for _ in range(int(sys.argv[1])):
    pyfa.decode_attention(q, k, k, 1, device=cpu)
"""


def count(work: Path, calls: int) -> int:
    out = work / f"callgrind.{calls}"
    env = dict(os.environ, PYFA_NUM_THREADS="1", PYTHONPATH=str(work))
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
                    str(work / "workload.py"), str(calls)], env=env, check=True, capture_output=True)
    for line in out.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {out}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        print("valgrind is not on PATH")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # A copy of the package whose library has no DWARF: valgrind 3.19 gives up on clang's DWARF 5.
        shutil.copytree(REPO / "pyfa", work / "pyfa", ignore=shutil.ignore_patterns("__pycache__"))
        lib = work / "pyfa" / "_lib" / "libpyfa.so"
        objcopy = shutil.which("llvm-objcopy") or shutil.which("objcopy")
        subprocess.run([objcopy, "--strip-debug", str(lib)], check=True)
        (work / "workload.py").write_text(WORKLOAD)
        base, loaded = count(work, 0), count(work, args.calls)
    print(f"tiny decode call (B=1, H=1, D=64, kv_len=1, f32, cpu): {(loaded - base) / args.calls:,.0f} instructions "
          f"per call ({args.calls} calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
