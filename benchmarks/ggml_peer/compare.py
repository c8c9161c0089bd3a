"""pyfa's CPU decode beside ggml's (llama.cpp's kernels) on the same inputs, in one run.

For each shape (B = 1, one query row per head, K and V in f16, q in f32): the median wall time of
pyfa's public call (``pyfa.decode_attention`` on numpy arrays, device "cpu") and of ggml's
``ggml_flash_attn_ext`` graph computed on ggml's threads (the harness
``ggml_decode``, built by ``run.sh``), each with the same thread count, in rounds that take turns
(a shared machine's speed drifts between them): the median of the rounds' medians, and the
range; and each output's largest error against the float64 reference. ggml's time is its C
call alone; pyfa's includes Python.

    python3 benchmarks/ggml_peer/compare.py GGML_DECODE_BINARY [--threads 2] [--iters 200] [--rounds 3]

The thread count reaches pyfa through PYFA_NUM_THREADS, which the library reads once: this script
sets it before pyfa loads.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# (H_q, H_kv, D, kv_len)
SHAPES = [
    (32, 8, 128, 1024),
    (32, 8, 128, 4096),
    (32, 8, 128, 16384),
    (16, 8, 256, 4096),
    (16, 8, 256, 16384),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("binary")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    os.environ["PYFA_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import pyfa
    from pyfa import reference

    cpu = pyfa.Device("cpu")
    rng = np.random.default_rng(0)
    print(f"threads {args.threads}; B 1, q f32, K/V f16; {args.rounds} rounds taking turns, each the median "
          f"of {args.iters} calls (fewer over longer caches) after a warm-up; µs: median of the rounds [range]")
    print("| Hq/Hkv | D | keys | pyfa µs | ggml µs | pyfa / ggml time | pyfa max err | ggml max err |")
    print("|---|---|---|---|---|---|---|---|")
    for hq, hkv, d, length in SHAPES:
        q = rng.standard_normal((1, hq, d), dtype=np.float32)
        k = rng.standard_normal((1, hkv, length, d), dtype=np.float32).astype(np.float16)
        v = rng.standard_normal((1, hkv, length, d), dtype=np.float32).astype(np.float16)
        iters = max(20, args.iters * 1024 // length)
        call = lambda: pyfa.decode_attention(q, k, v, length, device=cpu)  # noqa: E731
        ggml_rounds, pyfa_rounds = [], []
        with tempfile.TemporaryDirectory() as tmp:
            q.tofile(f"{tmp}/q.f32")
            k.tofile(f"{tmp}/k.f16")
            v.tofile(f"{tmp}/v.f16")
            for _ in range(args.rounds):
                run = subprocess.run([args.binary, str(hq), str(hkv), str(d), str(length), str(args.threads),
                                      str(iters), tmp], capture_output=True, text=True, check=True)
                ggml_rounds.append(float(run.stdout.split()[1]))
                for _ in range(3):
                    out = np.asarray(call())
                times = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t0)
                pyfa_rounds.append(statistics.median(times) * 1e6)
            ggml_out = np.fromfile(f"{tmp}/out_ggml.f32", dtype=np.float32).reshape(1, hq, d)
        ref = reference.decode_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), length)
        err = lambda o: float(np.abs(o.astype(np.float64) - ref).max())  # noqa: E731
        p_us, g_us = statistics.median(pyfa_rounds), statistics.median(ggml_rounds)
        span = lambda r: f"[{min(r):.0f}-{max(r):.0f}]"  # noqa: E731
        print(f"| {hq}/{hkv} | {d} | {length} | {p_us:.1f} {span(pyfa_rounds)} | {g_us:.1f} {span(ggml_rounds)} "
              f"| {p_us / g_us:.2f} | {err(out):.1e} | {err(ggml_out):.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
