"""Median wall time of small public decode calls on the CPU backend, for comparing thread
counts (the pool reads PYFA_NUM_THREADS once, so run once per count):

    PYFA_NUM_THREADS=1 python3 scripts/cpu_decode_threads.py
    PYFA_NUM_THREADS=2 python3 scripts/cpu_decode_threads.py

Shapes: B = 1; 1/1 heads at D = 64 in f32, 8/2 at D = 128 in f16 and 1/1 at D = 128 in f16; 512
to 8K keys. Where two threads take longer than one, the plan's split of the keys over
workgroups costs more than it saves on this machine.
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import pyfa  # noqa: E402


def median_us(fn, n, warm=20):
    for _ in range(warm):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main():
    cpu = pyfa.Device("cpu")
    rng = np.random.default_rng(0)
    for H, HKV, D, dtype in [(1, 1, 64, np.float32), (8, 2, 128, np.float16), (1, 1, 128, np.float16)]:
        for L in (512, 1024, 2048, 4096, 8192):
            q = rng.standard_normal((1, H, D), dtype=np.float32).astype(dtype)
            k = rng.standard_normal((1, HKV, L, D), dtype=np.float32).astype(dtype)
            us = median_us(lambda: pyfa.decode_attention(q, k, k, L, device=cpu), 400)
            print(f"H{H}x{HKV} D{D} {np.dtype(dtype).name} L{L}: {us:.1f} us")


if __name__ == "__main__":
    main()
