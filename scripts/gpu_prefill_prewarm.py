"""Compiles prefill kernels on a GPU machine before tests or timings, in parallel processes.

A fresh machine compiles each kernel specialisation the first time a call needs it (NVRTC, about
10-15 s each at sm_90a), one after another inside the process that needs it. This script makes
one tiny call per case in its own process, up to --jobs at once, so the compiles share the
machine's cores and later processes find the kernels in the cache (PYFA_CACHE_DIR, shared
between processes).

    python3 scripts/gpu_prefill_prewarm.py [--persist 3] [--timeout 240] [--jobs N] [CASE ...]

A CASE is D,dtype,causal,window,softcap,lse,out_f32 (e.g. 128,bfloat16,1,0,0,0,0); without any,
the unmasked cases of scripts/gpu_prefill_peers.py and benchmarks/cuda_prefill_sweep.py (bf16,
no LSE, causal and not, D 64, 80, 96, 128 and 256) and of tests/test_cuda_prefill_persistent.py's
CASES. Each case runs once per value of --persist (PYFA_CUDA_PREFILL_PERSIST). A call compiles the grid kernel's
specialisation before it picks its launch, so the default, 3 (three persistent blocks), compiles
both the grid kernel and, where it serves (D 64 to 128 on sm_90a), the persistent one. Prints one
line per case that failed, timed out or was not started before the deadline, then a count; exits 1
if any.
"""
import argparse
import ast
import os
import subprocess
import sys
import time
from pathlib import Path

TIMINGS = [(d, "bfloat16", c, 0, 0, 0, 0) for d in (64, 80, 96, 128, 256) for c in (0, 1)]
PERSISTENT_TESTS = Path(__file__).resolve().parents[1] / "tests" / "test_cuda_prefill_persistent.py"


def persistent_test_cases():
    """The test file's CASES as prewarm cases (read from its source: importing it needs pytest and
    skips without a GPU). Its calls all return LSE; q_offset and shapes pick no specialisation."""
    tree = ast.parse(PERSISTENT_TESTS.read_text())
    cases = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "CASES" for t in node.targets))
    return [(D, dtype, int(opts.get("causal", False)), opts.get("window", 0), opts.get("softcap", 0), 1,
             int(opts.get("out_dtype") == "float32")) for D, dtype, *_, opts in cases]


CALL = r"""
import sys, numpy as np, pyfa
D, dt, causal, window, softcap, lse, f32 = eval(sys.argv[1])
dt = pyfa.bfloat16 if dt == "bfloat16" else np.dtype(dt)
q = np.ones((1, 2, 256, D), dt)
k = np.ones((1, 1, 256, D), dt)
kw = dict(causal=bool(causal), return_lse=bool(lse))
if window:
    kw["window"] = window
if softcap:
    kw["softcap"] = float(softcap)
if f32:
    kw["out_dtype"] = np.float32
pyfa.attention(q, k, k, device=pyfa.Device("cuda"), **kw)
"""


def parse_case(text):
    parts = text.split(",")
    if len(parts) != 7:
        raise argparse.ArgumentTypeError(f"{text!r}: expected D,dtype,causal,window,softcap,lse,out_f32")
    try:
        return (int(parts[0]), parts[1], int(parts[2]), int(parts[3]), float(parts[4]), int(parts[5]), int(parts[6]))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def positive(text):
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1")
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", type=parse_case)
    ap.add_argument("--persist", default="3", help="PYFA_CUDA_PREFILL_PERSIST values, comma-separated")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds for all the calls together")
    ap.add_argument("--jobs", type=positive, default=os.cpu_count() or 4, help="processes at once")
    args = ap.parse_args()
    cases = args.cases or sorted(set(TIMINGS + persistent_test_cases()))
    env0 = dict(os.environ)
    env0["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]),
                                                     env0.get("PYTHONPATH")) if p)
    deadline = time.time() + args.timeout
    todo = [(knob, case) for knob in args.persist.split(",") for case in cases]
    waiting, running, failed = list(todo), [], []
    try:
        while waiting or running:
            while waiting and len(running) < args.jobs and time.time() < deadline:
                knob, case = waiting.pop(0)
                env = dict(env0, PYFA_CUDA_PREFILL_PERSIST=knob)
                running.append((knob, case, subprocess.Popen([sys.executable, "-c", CALL, repr(case)], env=env,
                                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                             text=True)))
            for item in [r for r in running if r[2].poll() is not None]:
                running.remove(item)
                knob, case, proc = item
                out, _ = proc.communicate()
                if proc.returncode != 0:
                    failed.append(f"persist={knob} {case}: exit {proc.returncode}: {out.strip()[-300:]}")
            if time.time() >= deadline:
                for knob, case, proc in running:
                    proc.kill()
                    proc.communicate()
                    failed.append(f"persist={knob} {case}: timed out")
                failed += [f"persist={knob} {case}: not started before the deadline" for knob, case in waiting]
                running, waiting = [], []
                break
            time.sleep(0.05)
    finally:
        for _, _, proc in running:
            proc.kill()
    for line in failed:
        print(line, flush=True)
    print(f"prewarm: {len(todo) - len(failed)} of {len(todo)} calls in {args.timeout - (deadline - time.time()):.0f} s",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
