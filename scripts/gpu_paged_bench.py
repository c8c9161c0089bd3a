"""Paged decode on a CUDA GPU, through the public calls, timed with CUDA events
(back-to-back calls on torch's current stream, warm-up excluded, median of repeats).

  1. pyfa.paged_decode_attention at page size 16 vs pyfa.decode_attention (contiguous
     cache) at the same lengths: B = 8, kv_len 4K and 32K, Hq/Hkv 32/8, D = 128, bf16.
  2. A batch of 64 sequences with lengths spread from 512 to 32K (shuffled pages) at
     page sizes 16 and 128: achieved bandwidth (bytes of K + V read / time) beside a
     device copy measured in the same run (torch clone of a 2 GiB tensor: bytes read +
     written / time, the copy bandwidth).
  3. The same batch over TurboQuant 4-bit pools (pyfa.turboquant.paged_decode; codes
     and scales random bytes: the kernel's time does not depend on their values).

    python3 scripts/gpu_paged_bench.py [--json out.json]
"""
import argparse
import json
import statistics

import numpy as np
import torch

import pyfa
from pyfa import turboquant as tq

HQ, HKV, D = 32, 8, 128


def timed_us(call, iters=20, reps=7):
    """Median µs per call over `reps` runs of `iters` calls between two events (two warm-up runs)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for r in range(reps + 2):
        start.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()
        if r >= 2:
            samples.append(start.elapsed_time(end) * 1000.0 / iters)
    return statistics.median(samples)


def copy_gbs():
    """Device copy bandwidth: bytes read + written per second by torch's clone of 2 GiB."""
    x = torch.empty(1 << 30, dtype=torch.float16, device="cuda")
    us = timed_us(lambda: x.clone(), iters=5)
    return 2 * x.numel() * 2 / (us * 1e-6) / 1e9


def pools(lens, page_size, gen, dtype=torch.bfloat16, row=None, layout="nhd"):
    """Shuffled pools of `layout` covering `lens` and a block table [B, pages_per_seq] (int32, on
    the GPU). row: bytes of a uint8 row (TurboQuant codes), else D elements of `dtype`."""
    B = len(lens)
    pps = max(-(-n // page_size) for n in lens)
    num_pages = sum(-(-n // page_size) for n in lens)
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.zeros((B, pps), dtype=torch.int32)
    at = 0
    for b, n in enumerate(lens):
        used = -(-n // page_size)
        table[b, :used] = order[at:at + used]
        at += used
    dims = (num_pages, page_size, HKV) if layout == "nhd" else (num_pages, HKV, page_size)
    if row is None:
        k = torch.randn(dims + (D,), dtype=dtype, device="cuda")
        v = torch.randn_like(k)
    else:
        k = torch.randint(0, 256, dims + (row,), dtype=torch.uint8, device="cuda")
        v = torch.randint(0, 256, dims + (row,), dtype=torch.uint8, device="cuda")
    return k, v, table.cuda()


def contiguous_vs_paged(dev, gen, results):
    for L in (4096, 32768):
        B = 8
        q = torch.randn((B, HQ, D), dtype=torch.bfloat16, device="cuda")
        k = torch.randn((B, HKV, L, D), dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        t_cont = timed_us(lambda: pyfa.decode_attention(q, k, v, lens, device=dev))
        del k, v
        for layout in ("nhd", "hnd"):
            kp, vp, table = pools([L] * B, 16, gen, layout=layout)
            t_paged = timed_us(lambda: pyfa.paged_decode_attention(q, kp, vp, table, lens, page_layout=layout,
                                                                   device=dev))
            kv_bytes = 2 * B * HKV * L * D * 2
            row = {"case": f"B={B} L={L} bf16 {layout}", "contiguous_us": round(t_cont, 1),
                   "paged16_us": round(t_paged, 1), "paged_over_contiguous": round(t_paged / t_cont, 3),
                   "contiguous_GBs": round(kv_bytes / t_cont / 1e3, 1),
                   "paged16_GBs": round(kv_bytes / t_paged / 1e3, 1)}
            results.append(row)
            print(row, flush=True)
            del kp, vp
            torch.cuda.empty_cache()


def mixed_batch(dev, gen, results, copy):
    lens = np.linspace(512, 32768, 64).astype(int)
    np.random.default_rng(0).shuffle(lens)
    lens = lens.tolist()
    q = torch.randn((64, HQ, D), dtype=torch.bfloat16, device="cuda")
    tl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * sum(lens) * HKV * D * 2
    for ps, layout in ((16, "nhd"), (128, "nhd"), (16, "hnd"), (128, "hnd")):
        kp, vp, table = pools(lens, ps, gen, layout=layout)
        # Host lengths: the split is planned for the batch's mix (Paged.splitBatch); device lengths: as if full.
        for label, kv_len in (("host kv_len", lens), ("device kv_len", tl)):
            t = timed_us(lambda: pyfa.paged_decode_attention(q, kp, vp, table, kv_len, page_layout=layout, device=dev))
            gbs = kv_bytes / t / 1e3
            row = {"case": f"B=64 lens 512..32K page {ps} {layout} bf16 ({label})", "us": round(t, 1),
                   "GBs": round(gbs, 1), "of_copy": round(gbs / copy, 3)}
            results.append(row)
            print(row, flush=True)
        del kp, vp
        torch.cuda.empty_cache()
    rb = tq.row_bytes(D, 4)
    for ps in (16, 128):
        kc, vc, table = pools(lens, ps, gen, row=rb)
        ks = torch.rand(kc.shape[:3], dtype=torch.float32, device="cuda") + 0.5
        vs = torch.rand(kc.shape[:3], dtype=torch.float32, device="cuda") + 0.5
        t = timed_us(lambda: tq.paged_decode(q, kc, ks, vc, vs, table, lens, k_bits=4, v_bits=4, device=dev))
        tq_bytes = 2 * sum(lens) * HKV * (rb + 4)
        gbs = tq_bytes / t / 1e3
        row = {"case": f"B=64 lens 512..32K page {ps} TQ-4", "us": round(t, 1), "GBs": round(gbs, 1),
               "of_copy": round(gbs / copy, 3)}
        results.append(row)
        print(row, flush=True)
        del kc, vc, ks, vs
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the rows to this file")
    args = ap.parse_args()
    dev = pyfa.Device("cuda")
    gen = torch.Generator().manual_seed(0)
    copy = copy_gbs()
    print({"device copy GB/s (read + write)": round(copy, 1)}, flush=True)
    results = [{"case": "device copy (torch clone, 2 GiB)", "GBs": round(copy, 1)}]
    contiguous_vs_paged(dev, gen, results)
    mixed_batch(dev, gen, results, copy)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
