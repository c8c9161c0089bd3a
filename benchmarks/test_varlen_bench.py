"""CPU: one pyfa.varlen_attention call over packed prompts against one
pyfa.attention call per prompt (the same rows, the same kernel), bf16, causal.
Report only: the ratio and both GFLOP/s go to extra_info and the terminal.
Without --benchmark-enable each case runs once and checks the two agree.

    python3 -m pytest benchmarks/test_varlen_bench.py --benchmark-enable -s
"""
import time

import numpy as np
import pytest

import pyfa

H, HKV, D = 8, 2, 64


def best_time(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@pytest.mark.parametrize("count,lo,hi", [(16, 8, 64), (8, 64, 512)], ids=["16x8-64", "8x64-512"])
def test_varlen_vs_per_sequence(benchmark, cpu, count, lo, hi):
    rng = np.random.default_rng(0)
    lens = rng.integers(lo, hi + 1, count)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), H, D)).astype(pyfa.bfloat16)
    k = rng.standard_normal((int(cu[-1]), HKV, D)).astype(pyfa.bfloat16)
    v = rng.standard_normal((int(cu[-1]), HKV, D)).astype(pyfa.bfloat16)
    views = [(q[a:b][None], k[a:b][None], v[a:b][None]) for a, b in zip(cu[:-1], cu[1:])]
    packed = lambda: pyfa.varlen_attention(q, k, v, cu, cu, causal=True, device=cpu)
    each = lambda: [pyfa.attention(*x, causal=True, layout="bshd", device=cpu) for x in views]
    out = packed()
    for (a, b), o in zip(zip(cu[:-1], cu[1:]), each()):
        assert np.array_equal(out[a:b], o[0])
    repeats = 20 if benchmark.enabled else 1
    t_packed, t_each = best_time(packed, repeats), best_time(each, repeats)
    flops = 4 * H * D * sum(int(n) * (int(n) + 1) // 2 for n in lens)
    row = {"prompts": count, "tokens": int(cu[-1]), "varlen_GFLOPs": flops / t_packed / 1e9,
           "per_sequence_GFLOPs": flops / t_each / 1e9, "speedup": t_each / t_packed}
    benchmark.extra_info.update({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
    print("\n" + "  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    benchmark.pedantic(packed, rounds=3 if benchmark.enabled else 1, warmup_rounds=0)
