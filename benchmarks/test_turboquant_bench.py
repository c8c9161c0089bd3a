"""TurboQuant decode against dense float16 decode, and encode throughput.

Run: python -m pytest benchmarks/test_turboquant_bench.py --benchmark-enable
(with the default --benchmark-disable each test runs once at smoke size).

Decode shapes: 8 query heads over 2 KV heads, head_dim 128 / 256, 4K-64K
context. A real decode step reads every layer's cache once, so nothing stays
in the last-level cache between layers; to measure that, each timed call
attends over enough layers (caches) to rotate through 96 MiB of dense K+V and
the time is per layer. Gate: at >= 16K context TQ-4 (4-bit K and V) must be
no slower than dense float16, the two measured interleaved in the same run.
"""
import math
import time

import numpy as np
import pytest

import pyfa
from pyfa import turboquant as tq

H, HKV = 8, 2
WORKING_SET = 96 * 2**20


def _min_time(fn, repeats):
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@pytest.mark.parametrize("context", [4096, 16384, 65536])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_decode_tq4_vs_dense_f16(benchmark, head_dim, context):
    full = not benchmark.disabled
    L = context if full else 256
    dense_bytes = L * HKV * head_dim * 2 * 2  # K + V, float16
    layers = max(1, -(-WORKING_SET // dense_bytes)) if full else 1
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((L, HKV, head_dim), dtype=np.float32).astype(np.float16)
    dense = [pyfa.KVCache(HKV, head_dim, L) for _ in range(layers)]
    quant = [pyfa.TurboQuantKVCache(HKV, head_dim, L, k_bits=4, v_bits=4) for _ in range(layers)]
    for d, t in zip(dense, quant):
        d.append(kv, kv)
        t.append(kv, kv)
    q = rng.standard_normal((H, head_dim)).astype(np.float32)

    def run_dense():
        for c in dense:
            c.attend(q)

    def run_tq():
        for c in quant:
            c.attend(q)

    benchmark(run_tq)
    repeats = 7 if full else 1
    t_dense = t_tq = math.inf
    for _ in range(3):  # interleaved, so load from elsewhere hits both alike
        t_dense = min(t_dense, _min_time(run_dense, repeats))
        t_tq = min(t_tq, _min_time(run_tq, repeats))
    t_dense, t_tq = t_dense / layers, t_tq / layers
    tq_token_bytes = HKV * (2 * tq.row_bytes(head_dim, 4) + 2 * 4)  # codes + f32 scales, K and V
    dense_token_bytes = HKV * head_dim * 2 * 2
    benchmark.extra_info.update({
        "context": L, "head_dim": head_dim, "layers": layers,
        "bytes_per_token_dense_f16": dense_token_bytes, "bytes_per_token_tq4": tq_token_bytes,
        "dense_ms": t_dense * 1e3, "tq4_ms": t_tq * 1e3, "speedup_vs_dense": t_dense / t_tq,
        "dense_GBps": L * dense_token_bytes / t_dense / 1e9,
        "tq4_GBps_read": L * tq_token_bytes / t_tq / 1e9,
        "tq4_GBps_dense_equivalent": L * dense_token_bytes / t_tq / 1e9,
    })
    if full and context >= 16384:
        assert t_tq <= t_dense, f"TQ-4 {t_tq * 1e3:.2f} ms slower than dense f16 {t_dense * 1e3:.2f} ms"


@pytest.mark.parametrize("head_dim", [128, 256])
def test_encode_throughput(benchmark, head_dim):
    full = not benchmark.disabled
    n = 4096 if full else 64
    rng = np.random.default_rng(1)
    kv = rng.standard_normal((n, HKV, head_dim), dtype=np.float32).astype(np.float16)
    cache = pyfa.TurboQuantKVCache(HKV, head_dim, n, sliding_window=n)

    benchmark(cache.append, kv, kv)
    t = _min_time(lambda: cache.append(kv, kv), 5 if full else 1)
    benchmark.extra_info.update({"tokens": n, "num_kv_heads": HKV, "head_dim": head_dim,
                                 "tokens_per_s": n / t, "rows_per_s": 2 * n * HKV / t})
