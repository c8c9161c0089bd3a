"""Host overhead of a decode call as users make it (public API on torch CUDA
tensors) beside torch SDPA in the same process: wall time of a loop of calls
without a sync inside, per call, then a 32-layer decode step (32 calls + one
sync). A quick check for the GPU machine; the pytest-benchmark suite
(benchmarks/test_serving_loop.py) is the record."""
import time

import torch
import torch.nn.functional as F

import pyfa

dev = pyfa.Device("cuda")
torch.manual_seed(0)


def per_call(fn, n=2000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host, (time.perf_counter() - t) / n * 1e6


def step(fns):
    def run():
        for f in fns:
            f()
        torch.cuda.synchronize()
    return run


import sys as _sys

for B, L in (() if "--loop" in _sys.argv else ((1, 4096), (8, 4096), (1, 32768), (8, 32768))):
    H, Hkv, D = 32, 8, 128
    q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
    layers = [(torch.randn(B, Hkv, L, D, dtype=torch.bfloat16, device="cuda"),
               torch.randn(B, Hkv, L, D, dtype=torch.bfloat16, device="cuda")) for _ in range(32 if L <= 4096 else 8)]
    k, v = layers[0]
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    p1 = lambda: pyfa.decode_attention(q, k, v, L, device=dev)
    p2 = lambda: pyfa.decode_attention(q, k, v, lens, device=dev)
    q4 = q[:, :, None]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        s1 = lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
        a = per_call(p1, 500)
        b = per_call(p2, 500)
        c = per_call(s1, 500)
        nl = len(layers)
        ps = step([(lambda kk=kk, vv=vv: pyfa.decode_attention(q, kk, vv, L, device=dev)) for kk, vv in layers])
        ss = step([(lambda kk=kk, vv=vv: F.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True)) for kk, vv in layers])
        ts = [per_call(f, 50)[1] for f in (ps, ss)]
    print(f"B={B} L={L}: pyfa(int kv_len) host {a[0]:.1f} us/call, total {a[1]:.1f}; pyfa(device kv_len) host {b[0]:.1f}, "
          f"total {b[1]:.1f}; torch flash host {c[0]:.1f}, total {c[1]:.1f}; {nl}-layer step pyfa {ts[0]:.0f} us, "
          f"torch {ts[1]:.0f} us, ratio {ts[0] / ts[1]:.2f}")
    print("counters", pyfa.counters())

if __name__ == "__main__":
    import cProfile
    import pstats
    import sys

    if "--profile" in sys.argv:
        B, L, H, Hkv, D = 1, 4096, 32, 8, 128
        q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(B, Hkv, L, D, dtype=torch.bfloat16, device="cuda")
        pyfa.decode_attention(q, k, k, L, device=dev)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            pyfa.decode_attention(q, k, k, L, device=dev)
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    if "--loop" in sys.argv:
        # Public calls for a while, for a sampling profiler attached from outside
        # (py-spy record --native -- python3 scripts/gpu_call_overhead.py --loop).
        B, L, H, Hkv, D = 1, 4096, 32, 8, 128
        q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(B, Hkv, L, D, dtype=torch.bfloat16, device="cuda")
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < 8:
            for _ in range(500):
                pyfa.decode_attention(q, k, k, L, device=dev)
            torch.cuda.synchronize()
            n += 500
        print("loop: %.1f us per call over %d calls" % ((time.perf_counter() - t0) / n * 1e6, n))
        # Then a cache step: KVCache on the GPU fed torch tensors, append one token + attend.
        from pyfa import dtypes as _dt
        cache = pyfa.KVCache(Hkv, D, L, dtype=_dt.bfloat16, device=dev, sliding_window=L)
        rows = torch.randn(L - 8, Hkv, D, dtype=torch.bfloat16, device="cuda")
        cache.append(rows, rows)
        kv1 = torch.randn(1, Hkv, D, dtype=torch.bfloat16, device="cuda")
        q1 = torch.randn(H, D, dtype=torch.bfloat16, device="cuda")
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < 8:
            for _ in range(500):
                cache.append(kv1, kv1)
                cache.attend(q1)
            torch.cuda.synchronize()
            n += 500
        print("cache loop: %.1f us per step over %d steps" % ((time.perf_counter() - t0) / n * 1e6, n))
    if "--native" in sys.argv:
        # The library's share: one run + finish with prepared arguments.
        from pyfa import _io, _plans
        from pyfa._native import ffi, lib

        B, L, H, Hkv, D = 1, 4096, 32, 8, 128
        q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(B, Hkv, L, D, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(B, H, D, dtype=torch.bfloat16, device="cuda")
        pyfa.decode_attention(q, k, k, L, device=dev, out=out)
        plan = next(iter(_plans._table().values()))
        stream = torch.cuda.current_stream().cuda_stream or 1
        enc = _plans.encoder(dev, stream)
        a = ffi.new("pyfa_decode_run_args *")
        for f, t in (("q", q), ("k_cache", k), ("v_cache", k), ("out", out)):
            getattr(a, f).address, getattr(a, f).nbytes = t.data_ptr(), t.numel() * t.element_size()
        lens, rings = ffi.new("int32_t[]", [L]), ffi.new("int32_t[]", [0])
        a.kv_len.host, a.ring_start.host, a.kv_capacity = lens, rings, L

        def native():
            lib.pyfa_decode_run(plan, enc, a)
            lib.pyfa_encoder_finish(enc)
        print("native run+finish: host %.1f us/call, total %.1f" % per_call(native, 3000))
        ws = ffi.new("uint64_t *")
        lib.pyfa_plan_workspace_bytes(plan, ws)
        print("plan workspace bytes", ws[0], "-> nwg", ws[0] // (B * H * (D + 2) * 4))

        def gpu_time(fn, n=200):
            for _ in range(10):
                fn()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            e0.record()
            for _ in range(n):
                fn()
            e1.record()
            torch.cuda.synchronize()
            return e0.elapsed_time(e1) / n * 1e3
        v2 = torch.randn_like(k)
        print("events per call: native %.1f us, public %.1f us, public k!=v %.1f us, torch flash %.1f us" % (
            gpu_time(native), gpu_time(lambda: pyfa.decode_attention(q, k, k, L, device=dev)),
            gpu_time(lambda: pyfa.decode_attention(q, k, v2, L, device=dev)),
            gpu_time(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v2, enable_gqa=True))))
        print("torch.empty: host %.1f us" % per_call(lambda: torch.empty(B, H, D, device="cuda"), 3000)[0])
        print("public call: host %.1f us" % per_call(lambda: pyfa.decode_attention(q, k, k, L, device=dev), 3000)[0])
