"""Where a decode call's host time goes, on the GPU machine: the public call on torch
tensors, the same run through the C ABI alone (the plan and run arguments the public
call kept), a no-op ABI call (cffi's own cost), a bare cuLaunchKernel of an empty
kernel through ctypes (the driver's floor), and a one-element torch op (torch's
floor); then the cache's append and attend alone, in turn, and as one call. Host µs per call of a
loop with no sync inside (the GPU keeps up: each call's kernels are shorter).

With --perf-loop N the script runs only N ABI-level decode runs (for a profiler); with
--cprofile N it also prints cProfile's top functions over N steps of each cache form; with
--profiler-effect it times the cache steps, the bare launch and the torch op again after one
torch.profiler session in this process (the serving benchmark takes its kernels' GPU time with
torch.profiler between its timed cases).
"""
import argparse
import ctypes
import time

import torch

import pyfa
from pyfa import _plans, cuda_interop, decode
from pyfa._native import ffi, lib

ap = argparse.ArgumentParser()
ap.add_argument("--perf-loop", type=int, default=0)
ap.add_argument("--calls", type=int, default=3000)
ap.add_argument("--cprofile", type=int, default=0)
ap.add_argument("--length", type=int, default=4096, help="positions of the decode and the caches")
ap.add_argument("--profiler-effect", action="store_true")
opts = ap.parse_args()

dev = pyfa.Device("cuda")
B, H, HKV, D, L = 1, 32, 8, 128, opts.length
q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
k = torch.randn(B, HKV, L, D, dtype=torch.bfloat16, device="cuda")
v = torch.randn(B, HKV, L, D, dtype=torch.bfloat16, device="cuda")
scale = D ** -0.5


def host_us(fn, n):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


public = lambda: pyfa.decode_attention(q, k, v, L, scale=scale, device=dev)
public()
(entry,) = decode._repeat.table.values()
plan, args = entry[0], entry[1]
out = torch.empty_like(q)
args.out.address = out.data_ptr()
enc = _plans.encoder(dev, cuda_interop.torch_stream_handle(0))
args.flags = lib.PYFA_RUN_FINISH
native = lambda: lib.pyfa_decode_run(plan, enc, args)

if opts.perf_loop:
    for _ in range(opts.perf_loop):
        native()
    torch.cuda.synchronize()
    raise SystemExit(0)

counters = ffi.new("pyfa_counters *")
noop = lambda: lib.pyfa_counters_get(counters)

cuda = ctypes.CDLL("libcuda.so.1")
mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
ptx = b""".version 8.0
.target sm_90a
.address_size 64
.visible .entry nop() { ret; }
"""
assert cuda.cuModuleLoadData(ctypes.byref(mod), ptx) == 0
assert cuda.cuModuleGetFunction(ctypes.byref(fn), mod, b"nop") == 0
stream = ctypes.c_void_p(cuda_interop.torch_stream_handle(0))
launch = cuda.cuLaunchKernel
launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
bare = lambda: launch(fn, 1, 1, 1, 32, 1, 1, 0, stream, None, None)
one = torch.zeros(1, device="cuda")
torch_op = lambda: one.add_(1)

before = pyfa.counters()["kernel_launches"]
n = opts.calls
rows = {"public decode_attention": host_us(public, n)}
launches = (pyfa.counters()["kernel_launches"] - before) / (n + 50)
rows["C ABI pyfa_decode_run (kept plan + args)"] = host_us(native, n)
rows["C ABI no-op (pyfa_counters_get)"] = host_us(noop, n)
rows["ctypes cuLaunchKernel, empty kernel"] = host_us(bare, n)
rows["torch one-element add_"] = host_us(torch_op, n)

cache = pyfa.KVCache(HKV, D, L, dtype=pyfa.bfloat16, sliding_window=L, device=dev)
rows_kv = torch.randn(L, HKV, D, dtype=torch.bfloat16, device="cuda")
cache.append(rows_kv, rows_kv)
k1 = torch.randn(1, HKV, D, dtype=torch.bfloat16, device="cuda")
q1 = q[0]
cache.attend(q1)
rows["KVCache.append (1 token)"] = host_us(lambda: cache.append(k1, k1), n)
rows["KVCache.attend"] = host_us(lambda: cache.attend(q1), n)
rows["KVCache.append + attend"] = host_us(lambda: (cache.append(k1, k1), cache.attend(q1)), n)
rows["KVCache.attend(q, k=, v=)"] = host_us(lambda: cache.attend(q1, k=k1, v=k1), n)

tq = pyfa.TurboQuantKVCache(HKV, D, L, k_bits=4, v_bits=4, sliding_window=L, device=dev)
tq.append(rows_kv, rows_kv)
tq.attend(q1)
rows["TurboQuantKVCache.append (1 token)"] = host_us(lambda: tq.append(k1, k1), n)
rows["TurboQuantKVCache.attend"] = host_us(lambda: tq.attend(q1), n)
rows["TurboQuantKVCache.append + attend"] = host_us(lambda: (tq.append(k1, k1), tq.attend(q1)), n)
rows["TurboQuantKVCache.attend(q, k=, v=)"] = host_us(lambda: tq.attend(q1, k=k1, v=k1), n)


def loop_us(fn, n=50, rounds=20):
    """As benchmarks/test_serving_loop.py times a cache step: the median over rounds of n calls
    and one synchronize, per call; with pyfa's counters per call over all rounds."""
    fn()
    torch.cuda.synchronize()
    before, times = pyfa.counters(), []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / n * 1e6)
    after = pyfa.counters()
    per = {k: (after[k] - before[k]) / (n * rounds) for k in after if after[k] != before[k]}
    return sorted(times)[rounds // 2], per


v1 = torch.randn(1, HKV, D, dtype=torch.bfloat16, device="cuda")
steps = {"KVCache.append + attend": lambda: (cache.append(k1, k1), cache.attend(q1)),
         "KVCache.append(k, v) + attend, v not k": lambda: (cache.append(k1, v1), cache.attend(q1)),
         "KVCache.attend(q, k=, v=)": lambda: cache.attend(q1, k=k1, v=k1),
         "TurboQuantKVCache.append + attend": lambda: (tq.append(k1, k1), tq.attend(q1)),
         "TurboQuantKVCache.attend(q, k=, v=)": lambda: tq.attend(q1, k=k1, v=k1)}
looped = {name: loop_us(fn) for name, fn in steps.items()}

print(f"{torch.cuda.get_device_name()}; B {B}, {H}/{HKV} heads, D {D}, {L} positions, bf16; "
      f"{launches:.2f} launches per decode call; host µs per call, {n} calls")
for name, us in rows.items():
    print(f"  {name:45s} {us:8.2f}")
print("cache steps as the serving benchmark times them (50 steps, then a synchronize; median of 20), "
      "with pyfa's counters per step:")
for name, (us, per) in looped.items():
    print(f"  {name:45s} {us:8.2f}  {per}")

if opts.cprofile:
    import cProfile
    import pstats

    forms = {"KVCache fused": lambda: cache.attend(q1, k=k1, v=k1),
             "TurboQuantKVCache append": lambda: tq.append(k1, k1),
             "TurboQuantKVCache attend": lambda: tq.attend(q1),
             "TurboQuantKVCache fused": lambda: tq.attend(q1, k=k1, v=k1)}
    for name, fn in forms.items():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(opts.cprofile):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"--- {name}: cProfile over {opts.cprofile} steps (tottime)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)

if opts.profiler_effect:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        for step in steps.values():
            step()
        torch.cuda.synchronize()
    after = {name: loop_us(step)[0] for name, step in steps.items()}
    after["ctypes cuLaunchKernel, empty kernel"] = host_us(bare, n)
    after["torch one-element add_"] = host_us(torch_op, n)
    print("after one torch.profiler session in this process (before -> after, µs):")
    for name, us in after.items():
        was = looped[name][0] if name in looped else rows[name]
        print(f"  {name:45s} {was:8.2f} -> {us:8.2f}")
