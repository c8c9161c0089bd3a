"""Paged decode on the CPU backend (numpy pools, page size 16) beside contiguous decode of the
same batch and lengths, timed in the same run, in two pool arrangements: "paged" (NHD, pages
shuffled through the pool: a serving engine's pool after some churn) and "paged_hnd" (HND,
pages in order: each head's rows in 4 KB runs, the best case a paged pool allows). The
paged / contiguous ratio of the medians is reported (extra_info "paged/contiguous" and the
terminal line), not gated (the machine's load moves it by 0.1-0.2): the CPU kernel walks the
same rows; what differs is one block-table read per block and where the rows lie, which is why
a paged threadgroup walks every KV head of its pages (docs/cuda/PAGED.md, CPU backend).

Run: python3 -m pytest benchmarks/test_paged_decode_bench.py --benchmark-enable
(--benchmark-disable, the default, runs each case once at the smallest length as a smoke test.)
"""
import numpy as np
import pytest

import pyfa

SHAPE = dict(B=8, H=16, Hkv=8, D=128)
CONTEXTS = [1024, 8192]
PAGE_SIZE = 16
_median = {}


def inputs(L):
    rng = np.random.default_rng(L)
    B, H, Hkv, D = SHAPE["B"], SHAPE["H"], SHAPE["Hkv"], SHAPE["D"]
    q = rng.standard_normal((B, H, D), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, L, D), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((B, Hkv, L, D), dtype=np.float32).astype(np.float16)
    pps = L // PAGE_SIZE
    table = rng.permutation(B * pps).reshape(B, pps).astype(np.int32)
    # The same rows in an NHD pool: page table[b, i] holds positions i*16.. of sequence b.
    kp = np.empty((B * pps, PAGE_SIZE, Hkv, D), np.float16)
    vp = np.empty_like(kp)
    kp[table] = k.reshape(B, Hkv, pps, PAGE_SIZE, D).transpose(0, 2, 3, 1, 4)
    vp[table] = v.reshape(B, Hkv, pps, PAGE_SIZE, D).transpose(0, 2, 3, 1, 4)
    return q, k, v, kp, vp, table


def hnd_in_order(k, v):
    """The same rows in an HND pool whose page b * pages_per_seq + i holds positions i*16.. of sequence b."""
    B, Hkv, L, D = k.shape
    pps = L // PAGE_SIZE
    pool = lambda c: np.ascontiguousarray(c.reshape(B, Hkv, pps, PAGE_SIZE, D).transpose(0, 2, 1, 3, 4)
                                          ).reshape(B * pps, Hkv, PAGE_SIZE, D)
    return pool(k), pool(v), np.arange(B * pps, dtype=np.int32).reshape(B, pps)


@pytest.mark.parametrize("L", CONTEXTS)
@pytest.mark.parametrize("kind", ["contiguous", "paged", "paged_hnd"])
def test_paged_vs_contiguous_cpu(benchmark, L, kind, full_size, cpu):
    if not full_size and L > CONTEXTS[0]:
        pytest.skip("larger contexts only when benchmarking is enabled")
    q, k, v, kp, vp, table = inputs(L)
    if kind == "contiguous":
        call = lambda: pyfa.decode_attention(q, k, v, L, device=cpu)
    elif kind == "paged":
        call = lambda: pyfa.paged_decode_attention(q, kp, vp, table, L, device=cpu)
    else:
        kh, vh, order = hnd_in_order(k, v)
        call = lambda: pyfa.paged_decode_attention(q, kh, vh, order, L, page_layout="hnd", device=cpu)
    # Both read the same rows: the outputs agree to f32 accumulation order (the same kernel, same order).
    np.testing.assert_allclose(call(), pyfa.decode_attention(q, k, v, L, device=cpu), atol=2e-5, rtol=0)
    benchmark.group = f"paged-decode-cpu-L{L}"
    benchmark.extra_info.update(SHAPE, L=L, page_size=PAGE_SIZE, kind=kind, kv_bytes=int(k.nbytes + v.nbytes))
    benchmark.pedantic(call, rounds=7 if full_size else 1, iterations=1, warmup_rounds=1 if full_size else 0)
    if benchmark.stats:
        med = benchmark.stats.stats.median
        _median[(kind, L)] = med
        benchmark.extra_info["GB/s"] = round((k.nbytes + v.nbytes) / med / 1e9, 2)
        other = _median.get(("contiguous", L))
        if kind != "contiguous" and other:
            ratio = med / other
            benchmark.extra_info["paged/contiguous"] = round(ratio, 3)
            print(f"\n{kind}/contiguous at L={L}: {ratio:.3f} ({med * 1e3:.2f} ms vs {other * 1e3:.2f} ms)")
