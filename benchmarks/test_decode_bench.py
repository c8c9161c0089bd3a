"""Decode on the CPU backend over 1K-64K context, beside peers measured in the
same run: a float32 numpy decode (matmul + softmax, what a numpy user writes)
and torch's CPU SDPA when torch is installed.

Run: python3 -m pytest benchmarks/test_decode_bench.py --benchmark-enable
(--benchmark-disable, the default in pyproject, runs each case once as a smoke test
at small size). Gates compare pyfa against a peer timed in this run; the peers
are timed first (their group), and the pyfa case reads their medians.
"""
import time

import numpy as np
import pytest

import pyfa

SHAPE = dict(H=16, Hkv=8, D=256)
CONTEXTS = [1024, 4096, 16384, 65536]
_peer_median = {}


def inputs(L):
    rng = np.random.default_rng(L)
    q = rng.standard_normal((1, SHAPE["H"], SHAPE["D"]), dtype=np.float32)
    k = rng.standard_normal((1, SHAPE["Hkv"], L, SHAPE["D"]), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((1, SHAPE["Hkv"], L, SHAPE["D"]), dtype=np.float32).astype(np.float16)
    return q, k, v


def numpy_decode(q, k, v, n):
    """float32 numpy decode with GQA, reading the f16 cache like any numpy code would."""
    B, H, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, H // Hkv, D)
    kf = k[:, :, :n].astype(np.float32)
    s = np.einsum("bgqd,bgkd->bgqk", qg, kf) / np.sqrt(D)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    return np.einsum("bgqk,bgkd->bgqd", s, v[:, :, :n].astype(np.float32)).reshape(B, H, D)


def torch_sdpa(q, k, v, n):
    import torch
    import torch.nn.functional as F
    tq = torch.from_numpy(q)[:, :, None].to(torch.float16)
    tk, tv = torch.from_numpy(k[:, :, :n]), torch.from_numpy(v[:, :, :n])
    return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)


def median_seconds(benchmark):
    return benchmark.stats.stats.median if benchmark.stats else None


def run(benchmark, fn, L, label, full):
    if not full and L > 4096:
        pytest.skip("large contexts only when benchmarking is enabled")
    q, k, v = inputs(L)
    benchmark.group = f"decode-L{L}"
    benchmark.extra_info.update(SHAPE, L=L, peer=label, kv_bytes=int(k.nbytes + v.nbytes))
    benchmark.pedantic(fn, args=(q, k, v, L), rounds=5 if full else 1, iterations=1, warmup_rounds=1 if full else 0)
    med = median_seconds(benchmark)
    if med:
        benchmark.extra_info["GB/s"] = round((k.nbytes + v.nbytes) / med / 1e9, 2)
        _peer_median[(label, L)] = med
    return med


@pytest.mark.parametrize("L", CONTEXTS)
def test_numpy_peer(benchmark, L, full_size):
    run(benchmark, numpy_decode, L, "numpy", full_size)


@pytest.mark.parametrize("L", CONTEXTS)
def test_torch_peer(benchmark, L, full_size):
    pytest.importorskip("torch")
    run(benchmark, torch_sdpa, L, "torch", full_size)


@pytest.mark.parametrize("L", CONTEXTS)
def test_pyfa_cpu(benchmark, L, full_size, cpu):
    med = run(benchmark, lambda q, k, v, n: pyfa.decode_attention(q, k, v, n, device=cpu), L, "pyfa-cpu", full_size)
    if not med:
        return
    for peer, need in (("numpy", 3.0), ("torch", 1.0)):
        other = _peer_median.get((peer, L))
        if other:
            ratio = other / med
            benchmark.extra_info[f"speedup_vs_{peer}"] = round(ratio, 2)
            assert ratio >= need, f"pyfa CPU is {ratio:.2f}x {peer} at L={L}, gate is {need}x"
