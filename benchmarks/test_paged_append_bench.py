"""Paged appends: what one decode step's append costs a server.

- cpu (runs anywhere, reported, not gated): one token for each of B = 64
  sequences into a PagedKVCache (one kv_append_paged dispatch), against the
  same tokens appended to 64 single-sequence KVCache objects (two kv_append
  dispatches each). f16 pools, H_kv = 8, D = 128, page_size = 16.
  extra_info: us_per_step (median), and on the second case its ratio to
  the first's.
- cuda (an H100 / H200 with torch): one decode step of a server holding B
  sequences of L tokens: append one token per sequence (torch CUDA rows,
  PagedKVCache.append) and attend (PagedKVCache.attend, i.e.
  pyfa.paged_decode_attention), bf16, H_q / H_kv = 32 / 8, D = 128,
  page_size = 16. "us" is the wall time per step (N steps queued, one sync);
  "gpu_us" the device's own time per step (CUDA events, the stream held while
  the host queues, as benchmarks/test_serving_loop.py measures it);
  "append_gpu_us" the append alone. Skips without torch, a CUDA device or
  pyfa.paged_decode_attention.

    python3 -m pytest benchmarks/test_paged_append_bench.py --benchmark-enable -rs \\
        --benchmark-json=paged_append.json
"""
import numpy as np
import pytest

import pyfa

try:
    import torch
except ImportError:
    torch = None

HKV, D, PAGE = 8, 128, 16
_cpu_medians = {}  # impl -> median us of the cpu case, for the ratio


@pytest.mark.parametrize("impl", ["paged_pool", "kvcache_x64"])
def test_cpu_append_one_token_for_64_sequences(benchmark, cpu, impl):
    B = 64
    rng = np.random.default_rng(0)
    k = rng.standard_normal((B, HKV, D)).astype(np.float16)
    v = rng.standard_normal((B, HKV, D)).astype(np.float16)
    steps = 200  # timed appends, one token per sequence each (+ 2 warm-up steps)
    if impl == "paged_pool":
        pool = pyfa.PagedKVCache(B * (steps // PAGE + 2), PAGE, HKV, D, device=cpu)
        ids = [pool.add_sequence() for _ in range(B)]

        def step():
            pool.append(ids, k, v)
    else:
        caches = [pyfa.KVCache(HKV, D, 64, sliding_window=64, device=cpu) for _ in range(B)]
        rows = [(k[b:b + 1], v[b:b + 1]) for b in range(B)]

        def step():
            for c, (kb, vb) in zip(caches, rows):
                c.append(kb, vb)

    benchmark.extra_info.update(case="cpu_append", sequences=B, num_kv_heads=HKV, head_dim=D, impl=impl)
    benchmark.pedantic(step, rounds=steps if benchmark.enabled else 1, warmup_rounds=2 if benchmark.enabled else 0)
    if benchmark.enabled and benchmark.stats is not None:
        us = _cpu_medians[impl] = benchmark.stats.stats.median * 1e6
        benchmark.extra_info["us_per_step"] = round(us, 2)
        if impl == "kvcache_x64" and "paged_pool" in _cpu_medians:
            benchmark.extra_info["ratio_vs_paged_pool"] = round(us / _cpu_medians["paged_pool"], 2)


def _cuda_or_skip():
    if torch is None or not torch.cuda.is_available():
        pytest.skip("needs torch with a CUDA device")
    if "cuda" not in pyfa.available_backends():
        pytest.skip("needs pyfa's cuda backend")
    if not hasattr(pyfa, "paged_decode_attention"):
        pytest.skip("needs pyfa.paged_decode_attention (the paged decode)")
    return pyfa.Device("cuda")


@pytest.mark.parametrize("B,L", [(8, 4096), (64, 4096), (64, 32768)])
def test_cuda_step_append_and_paged_decode(benchmark, B, L):
    from test_serving_loop import gpu_us  # the serving loop's device-time instrument

    dev = _cuda_or_skip()
    num_pages = B * (L // PAGE + 64)
    pool = pyfa.PagedKVCache(num_pages, PAGE, HKV, D, dtype=pyfa.bfloat16, device=dev)
    ids = [pool.add_sequence() for _ in range(B)]
    fill = torch.randn(L, HKV, D, device="cuda", dtype=torch.bfloat16)
    for s in ids:  # L tokens per sequence, in chunks
        for c in range(0, L, 4096):
            part = fill[c:c + 4096]
            pool.append([s] * part.shape[0], part, part)
    torch.cuda.synchronize()
    k = torch.randn(B, HKV, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, 32, D, device="cuda", dtype=torch.bfloat16)

    def append():
        pool.append(ids, k, k)

    def step():
        append()
        pool.attend(q, ids)

    n = 64  # steps per round; the pool has room for 1024 more tokens per sequence

    def rounds():
        for _ in range(n):
            step()
        torch.cuda.synchronize()

    rounds()  # warm: plans, kernels, block tables
    benchmark.pedantic(rounds, rounds=3 if benchmark.enabled else 1)
    benchmark.extra_info.update(case="cuda_step", sequences=B, kv_len=L, page_size=PAGE, dtype="bf16",
                                gpu=torch.cuda.get_device_name())
    if benchmark.enabled and benchmark.stats is not None:
        benchmark.extra_info["us"] = round(benchmark.stats.stats.median * 1e6 / n, 2)
    benchmark.extra_info["gpu_us"] = round(gpu_us(step, 8)[0], 2)
    benchmark.extra_info["append_gpu_us"] = round(gpu_us(append, 8)[0], 2)
