"""GPU time of a TurboQuantKVCache attend on the cuda device, as a decode loop calls it: a
full ring of 32K positions, B 1, Hq/Hkv 16/8, a bf16 torch q; 50 attends queued while the
stream is held (torch.cuda._sleep), CUDA events around them, median of 7; with the launches
of one attend (pyfa's counters). Compare settings of the CUDA plan's knobs in one machine
session, e.g. the q rotation in its own launch against inside the decode:

    for knob in 0 1; do PYFA_CUDA_TQ_ROTATE_Q=$knob python3 scripts/gpu_tq_attend_time.py 4,3 128; done
"""
import argparse
import statistics

import torch

import pyfa

ap = argparse.ArgumentParser()
ap.add_argument("bits", help="k_bits,v_bits")
ap.add_argument("head_dim", type=int, nargs="?", default=128)
ap.add_argument("--length", type=int, default=32768)
opts = ap.parse_args()
kb, vb = (int(x) for x in opts.bits.split(","))
L, HKV, H, D = opts.length, 8, 16, opts.head_dim

cache = pyfa.TurboQuantKVCache(HKV, D, L, k_bits=kb, v_bits=vb, sliding_window=L, device=pyfa.Device("cuda"))
rows = torch.randn(L, HKV, D, dtype=torch.bfloat16, device="cuda")
cache.append(rows, rows)
q = torch.randn(H, D, dtype=torch.bfloat16, device="cuda")
cache.attend(q)
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
times = []
for _ in range(7):
    torch.cuda._sleep(200_000_000)  # holds the stream until the 50 attends are queued
    start.record()
    for _ in range(50):
        cache.attend(q)
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end) * 1000 / 50)
before = pyfa.counters()["kernel_launches"]
cache.attend(q)
launches = pyfa.counters()["kernel_launches"] - before
print(f"{torch.cuda.get_device_name()}: k/v bits {kb}/{vb}, D {D}, B 1, H {H}/{HKV}, {L} positions: "
      f"{statistics.median(times):.1f} GPU µs per attend, {launches} launches")
