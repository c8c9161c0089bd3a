"""Decode and prefill on the Metal device, as a Mac user calls them, beside
MLX's mx.fast.scaled_dot_product_attention in the same run when MLX is
installed.

Run on a Mac: python3 -m pytest benchmarks/test_metal_bench.py --benchmark-enable
Headline: the public Python call (pytest-benchmark's host clock); second
column (extra_info): the GPU time of the same work from the command buffers
(gpuEndTime - gpuStartTime, through pyfa_encoder_device_seconds).

On Linux the Metal device is the MSL executor on the CPU: every case runs once,
at a small size, as a smoke test of the path (timings there say nothing about
a GPU). No Mac figures exist yet.
"""
import numpy as np
import pytest

import pyfa
from pyfa import reference

pytestmark = pytest.mark.skipif("metal" not in pyfa.available_backends(), reason="no Metal device here")


@pytest.fixture(scope="module")
def metal():
    return pyfa.Device("metal")


def decode_shape(metal, L):
    """(H, Hkv, D, L): the real shape on a GPU, a small one on the executor."""
    return (16, 8, 128, L) if metal.is_gpu else (4, 2, 64, 256)


def prefill_shape(metal, L):
    return (16, 8, 128, L) if metal.is_gpu else (2, 1, 64, 64)


def device_seconds_decode(metal, q, k, v, n, repeats=5):
    """Median GPU seconds of one decode from the command buffers (the op
    recorded through the C ABI into an encoder of its own)."""
    from pyfa._native import ffi, lib
    from pyfa.errors import check

    B, H, D = q.shape
    params = ffi.new("pyfa_flash_attn_vec_params *", {
        "batch": B, "num_heads": H, "num_kv_heads": k.shape[1], "head_dim": D, "kv_capacity": k.shape[2],
        "scale": 1.0 / np.sqrt(D)})
    check(lib.pyfa_flash_attn_vec_plan(metal.handle, params, pyfa.dtypes.code(k.dtype), n, ffi.new("uint64_t *")))
    bufs = [metal.buffer(a.shape, a.dtype) for a in (q, k, v)]
    for b, a in zip(bufs, (q, k, v)):
        b.numpy()[...] = a
    lens = metal.buffer((B,), np.int32)
    lens.numpy()[:] = n
    rings = metal.buffer((B,), np.int32)
    rings.numpy()[:] = 0
    tmp = metal.buffer((max(1, B * H * params.nwg * (D + 2)),), np.float32)
    out = metal.buffer((B, H, D), np.float32)
    seconds = ffi.new("double *")
    times = []
    for _ in range(repeats):
        enc = metal.encoder()
        check(lib.pyfa_flash_attn_vec(enc, params, *(b.handle for b in (*bufs, lens, rings, tmp, out)), ffi.NULL))
        check(lib.pyfa_encoder_commit(enc))
        check(lib.pyfa_encoder_wait(enc))
        check(lib.pyfa_encoder_device_seconds(enc, seconds))
        times.append(seconds[0])
    return float(np.median(times))


@pytest.mark.parametrize("L", [4096, 16384])
def test_decode_metal(benchmark, metal, L):
    H, Hkv, D, L = decode_shape(metal, L)
    rng = np.random.default_rng(L)
    q = rng.standard_normal((1, H, D)).astype(np.float32)
    k, v = (rng.standard_normal((1, Hkv, L, D)).astype(np.float16) for _ in range(2))
    out = benchmark(lambda: pyfa.decode_attention(q, k, v, L, device=metal))
    np.testing.assert_allclose(out, reference.decode_attention(q, k, v, L), atol=2e-5, rtol=0)
    gpu = device_seconds_decode(metal, q, k, v, L)
    assert gpu > 0
    benchmark.extra_info.update({"shape": f"B=1 Hq/Hkv={H}/{Hkv} D={D} L={L} f16 K/V",
                                 "device_ms": gpu * 1e3, "device": metal.name,
                                 "kv_gb_per_s_device": (k.nbytes + v.nbytes) / gpu / 1e9})


@pytest.mark.parametrize("L", [1024, 4096])
def test_prefill_metal(benchmark, metal, L):
    H, Hkv, D, L = prefill_shape(metal, L)
    rng = np.random.default_rng(L)
    q = rng.standard_normal((1, H, L, D)).astype(np.float16)
    k, v = (rng.standard_normal((1, Hkv, L, D)).astype(np.float16) for _ in range(2))
    out = benchmark(lambda: pyfa.attention(q, k, v, causal=True, device=metal))
    ref = reference.attention(q, k, v, causal=True)
    assert np.abs(out.astype(np.float64) - ref).max() < 4e-3  # f16 output: half an ulp of values ~1
    benchmark.extra_info.update({"shape": f"B=1 Hq/Hkv={H}/{Hkv} D={D} L={L} f16 causal", "device": metal.name})


@pytest.mark.parametrize("L", [4096, 16384])
def test_decode_mlx(benchmark, metal, L):
    """The peer: MLX's fused SDPA on the same shape (decode: one query row)."""
    mx = pytest.importorskip("mlx.core")
    H, Hkv, D, L = decode_shape(metal, L)
    rng = np.random.default_rng(L)
    q = mx.array(rng.standard_normal((1, H, 1, D)).astype(np.float16))
    k, v = (mx.array(rng.standard_normal((1, Hkv, L, D)).astype(np.float16)) for _ in range(2))
    run = lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0 / np.sqrt(D)))  # noqa: E731
    benchmark(run)
    benchmark.extra_info.update({"shape": f"B=1 Hq/Hkv={H}/{Hkv} D={D} L={L} f16 K/V", "peer": "mlx"})


@pytest.mark.parametrize("L", [1024, 4096])
def test_prefill_mlx(benchmark, metal, L):
    mx = pytest.importorskip("mlx.core")
    H, Hkv, D, L = prefill_shape(metal, L)
    rng = np.random.default_rng(L)
    q = mx.array(rng.standard_normal((1, H, L, D)).astype(np.float16))
    k, v = (mx.array(rng.standard_normal((1, Hkv, L, D)).astype(np.float16)) for _ in range(2))
    run = lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0 / np.sqrt(D), mask="causal"))  # noqa: E731,E501
    benchmark(run)
    benchmark.extra_info.update({"shape": f"B=1 Hq/Hkv={H}/{Hkv} D={D} L={L} f16 causal", "peer": "mlx"})
