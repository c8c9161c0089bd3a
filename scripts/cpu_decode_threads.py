"""Wall time of small public decode calls on the CPU backend (K and V in f16 or f32, B = 1).

    PYFA_NUM_THREADS=1 python3 scripts/cpu_decode_threads.py
    PYFA_NUM_THREADS=2 python3 scripts/cpu_decode_threads.py
        the median of 400 calls over 512 to 8K keys (1/1 heads at D = 64 in f32, 8/2 at D = 128
        in f16 and 1/1 at D = 128 in f16; one array is both K and V), for comparing thread counts (the pool reads
        PYFA_NUM_THREADS once, so run once per count): where two threads take longer than one,
        the plan's split of the keys over workgroups costs more than it saves on this machine;
    PYFA_NUM_THREADS=1 python3 scripts/cpu_decode_threads.py --in-cache
        the fastest of 300 calls over caches that fit in the core's caches (16/8 heads at D = 256
        over 256 keys, 32/8 and 8/8 at D = 128 over 512, 8/2 at D = 64 over 1K; f16), where the
        kernel's arithmetic, not memory, sets the time: for A / B runs of two builds taking turns
        on a shared machine, whose interference only adds time.
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import pyfa  # noqa: E402


def call_times(fn, n, warm):
    """Seconds of each of n calls of fn after `warm` untimed ones."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def main():
    in_cache = "--in-cache" in sys.argv[1:]
    cpu = pyfa.Device("cpu")
    rng = np.random.default_rng(0)
    if in_cache:
        shapes = [(16, 8, 256, np.float16, 256), (32, 8, 128, np.float16, 512), (8, 8, 128, np.float16, 512),
                  (8, 2, 64, np.float16, 1024)]
    else:
        shapes = [(H, HKV, D, dt, L) for H, HKV, D, dt in [(1, 1, 64, np.float32), (8, 2, 128, np.float16),
                                                           (1, 1, 128, np.float16)]
                  for L in (512, 1024, 2048, 4096, 8192)]
    for H, HKV, D, dtype, L in shapes:
        q = rng.standard_normal((1, H, D), dtype=np.float32).astype(dtype)
        k = rng.standard_normal((1, HKV, L, D), dtype=np.float32).astype(dtype)
        v = rng.standard_normal((1, HKV, L, D), dtype=np.float32).astype(dtype) if in_cache else k
        call = lambda: pyfa.decode_attention(q, k, v, L, device=cpu)  # noqa: E731
        us = 1e6 * (min(call_times(call, 300, 5)) if in_cache else statistics.median(call_times(call, 400, 20)))
        print(f"H{H}x{HKV} D{D} {np.dtype(dtype).name} L{L}: {us:.1f} us")


if __name__ == "__main__":
    main()
