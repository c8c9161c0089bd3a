"""Decode over caches in flash-attn's token-major layout ``[B, capacity, H_kv, D]`` (passed as
``k.transpose(1, 2)``), public calls on torch CUDA tensors, beside a call over a contiguous copy
made per call (``.contiguous()`` and the call on it: what reading such caches costs without the
in-place path), a head-major contiguous cache, and torch SDPA (flash) over the same token-major
views in one process. Per call: CUDA events over a loop of calls queued without a sync (the
GPU's time per call) and the loop's wall time per call; the median of rounds. Every sequence
holds ``capacity`` positions, so SDPA (which takes no lengths) does the same work.

    python3 scripts/gpu_token_major_bench.py [--json FILE]
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import pyfa

ap = argparse.ArgumentParser()
ap.add_argument("--json", default=None)
ap.add_argument("--calls", type=int, default=50)
ap.add_argument("--rounds", type=int, default=15)
opts = ap.parse_args()
dev = pyfa.Device("cuda")
H, HKV, D = 32, 8, 128


def timed(fn):
    """(GPU µs per call by CUDA events, wall µs per call): medians over rounds of a queued loop."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    gpu, wall = [], []
    for _ in range(opts.rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        start.record()
        for _ in range(opts.calls):
            fn()
        end.record()
        end.synchronize()
        wall.append((time.perf_counter() - t) / opts.calls * 1e6)
        gpu.append(start.elapsed_time(end) * 1e3 / opts.calls)
    return statistics.median(gpu), statistics.median(wall)


rows = []
print(f"{torch.cuda.get_device_name()}; Hq/Hkv {H}/{HKV}, D {D}, bf16; per call: GPU µs (events) / wall µs")
for B, L in ((1, 4096), (8, 4096), (1, 32768), (8, 32768)):
    q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
    kn, vn = (torch.randn(B, L, HKV, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    k, v = kn.transpose(1, 2), vn.transpose(1, 2)
    kc, vc = k.contiguous(), v.contiguous()
    ref = pyfa.decode_attention(q, kc, vc, L, device=dev)
    got = pyfa.decode_attention(q, k, v, L, device=dev)
    diff = float((got.float() - ref.float()).abs().max())
    q4 = q[:, :, None]
    cases = {
        "pyfa token-major (in place)": lambda: pyfa.decode_attention(q, k, v, L, device=dev),
        "pyfa token-major copied per call": lambda: pyfa.decode_attention(
            q, k.contiguous(), v.contiguous(), L, device=dev),
        "pyfa head-major contiguous": lambda: pyfa.decode_attention(q, kc, vc, L, device=dev),
    }
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        try:
            F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
            cases["torch SDPA flash, token-major views"] = lambda: F.scaled_dot_product_attention(q4, k, v,
                                                                                              enable_gqa=True)
        except RuntimeError as e:
            print(f"  torch SDPA flash refused the views: {e}")
        measured = {name: timed(fn) for name, fn in cases.items()}
    base = measured["pyfa token-major (in place)"][0]
    for name, (g, w) in measured.items():
        rows.append({"B": B, "L": L, "case": name, "gpu_us": round(g, 1), "wall_us": round(w, 1)})
        print(f"  B {B} L {L:>5} {name:<50} {g:9.1f} / {w:8.1f}   GPU vs in place {g / base:5.2f}x")
    print(f"  B {B} L {L}: max |in place - head-major contiguous| = {diff:.3g}")
if opts.json:
    with open(opts.json, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
