"""Prefill beside torch SDPA's cuDNN kernel in two regimes of the GPU's power management, with the
SM clock and the board power sampled by nvidia-smi (every 50 ms) while each runs:

- burst: after a second of idle, a few calls (about 40 ms of work), timed by CUDA events; the
  board starts cool, at its boost clock;
- sustained: calls back to back for --seconds, the last half timed: the board at its power
  limit, the clock wherever that limit holds it.

Public calls on torch tensors in one process, bf16, B 1, Hq/Hkv 16/8 (cuDNN gets K and V
repeated to q's heads outside the timed calls), the implementations alternating per shape,
--rounds times. TFLOP/s count 4 H L^2 D (half of it causal).

    python3 scripts/gpu_prefill_power.py [--dims 64,128,256] [--lengths 4096,16384] [--json FILE]
"""
import argparse
import json
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import pyfa

ap = argparse.ArgumentParser()
ap.add_argument("--dims", default="64,128,256")
ap.add_argument("--lengths", default="4096,16384")
ap.add_argument("--seconds", type=float, default=2.5)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--json", default=None)
opts = ap.parse_args()
dev = pyfa.Device("cuda")
H, HKV = 16, 8


class Sampler:
    """nvidia-smi's SM clock (MHz) and power (W) every 50 ms while in the with-block."""

    def __enter__(self):
        self.p = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                   "-lms", "50"], stdout=subprocess.PIPE, text=True)
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self.p.terminate()
        lines = self.p.communicate()[0].strip().splitlines()
        self.rows = [tuple(float(x) for x in line.split(",")) for line in lines if line.count(",") == 1]

    def median(self, skip_fraction=0.0):
        rows = self.rows[int(len(self.rows) * skip_fraction):] or self.rows
        return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)


def timed_ms(fn, n):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / n


def burst(fn, per_call_ms):
    time.sleep(1.0)
    n = max(3, int(40 / per_call_ms))
    with Sampler() as smp:
        ms = timed_ms(fn, n)
    return ms, *smp.median()


def sustained(fn, per_call_ms):
    n = max(5, int(opts.seconds * 1e3 / 2 / per_call_ms))
    with Sampler() as smp:
        timed_ms(fn, n)  # the first half brings the board to its limit
        ms = timed_ms(fn, n)
    return ms, *smp.median(0.5)


rows = []
print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; "
      + subprocess.run(["nvidia-smi", "--query-gpu=power.limit,clocks.max.sm", "--format=csv,noheader"],
                       capture_output=True, text=True).stdout.strip())
for D in (int(x) for x in opts.dims.split(",")):
    for L in (int(x) for x in opts.lengths.split(",")):
        for causal in (False, True):
            q = torch.randn(1, H, L, D, dtype=torch.bfloat16, device="cuda")
            k = torch.randn(1, HKV, L, D, dtype=torch.bfloat16, device="cuda")
            v = torch.randn(1, HKV, L, D, dtype=torch.bfloat16, device="cuda")
            kr, vr = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)

            def cudnn(causal=causal):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, kr, vr, is_causal=causal)

            impls = {"pyfa": lambda causal=causal: pyfa.attention(q, k, v, causal=causal, device=dev), "cudnn": cudnn}
            diff = float((impls["pyfa"]().float() - cudnn().float()).abs().max())
            flops = 4 * H * L * L * D * (0.5 if causal else 1.0)
            for rnd in range(opts.rounds):
                for name, fn in impls.items():
                    fn()
                    torch.cuda.synchronize()
                    est = timed_ms(fn, 3)
                    for regime, measure in (("burst", burst), ("sustained", sustained)):
                        ms, clock, power = measure(fn, est)
                        row = {"D": D, "L": L, "causal": causal, "impl": name, "round": rnd, "regime": regime,
                               "us": round(ms * 1e3, 1), "tflops": round(flops / ms / 1e9, 1), "sm_mhz": clock,
                               "watts": power, "max_diff_vs_cudnn": diff}
                        rows.append(row)
                        print(f"D {D:3} L {L:5} causal {int(causal)} {name:5} round {rnd} {regime:9} "
                              f"{row['us']:9.1f} us {row['tflops']:6.1f} TF  {clock:5.0f} MHz {power:4.0f} W", flush=True)
            print(f"D {D:3} L {L:5} causal {int(causal)}: max |pyfa - cudnn| = {diff:.3g}")
if opts.json:
    with open(opts.json, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
