#!/usr/bin/env python3
"""Host time of pyfa calls on torch tensors queued behind other GPU work, to find which launches
hold the host when programmatic dependent launch is on (compare a run with PYFA_CUDA_PDL=1 and
one without; the setting is read when the CUDA backend starts).

Cases, each the median of --reps calls (host microseconds from the call's start to its return,
nothing synchronised in between):

  idle           a decode call on an idle GPU;
  after-mm       a decode call queued right behind a torch matmul (8192^3 bf16, about 1.6 ms on an H200);
  after-own      a decode call queued right behind a long decode call (B 8, 32K);
  tq-after-mm    a TurboQuantKVCache.attend behind the matmul, tq-idle the same on an idle GPU;
  step-after-mm  KVCache.append + attend behind the matmul, step-idle the same on an idle GPU.

    PYFA_CUDA_PDL=1 python3 scripts/gpu_pdl_probe.py [--reps 20]
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    import torch

    import pyfa

    cuda = torch.device("cuda")
    bf16 = torch.bfloat16
    a = torch.randn(8192, 8192, device=cuda, dtype=bf16)
    q1 = torch.randn(1, 32, 128, device=cuda, dtype=bf16)
    k1 = torch.randn(1, 8, 4096, 128, device=cuda, dtype=bf16)
    v1 = torch.randn_like(k1)
    q8 = torch.randn(8, 32, 128, device=cuda, dtype=bf16)
    k8 = torch.randn(8, 8, 32768, 128, device=cuda, dtype=bf16)
    v8 = torch.randn_like(k8)
    dev = pyfa.Device("cuda")
    tq = pyfa.TurboQuantKVCache(8, 128, 32768, k_bits=4, v_bits=4, device=dev)
    rows = torch.randn(4096, 8, 128, device=cuda, dtype=bf16)
    tq.append(rows, rows)
    kv = pyfa.KVCache(8, 128, 8192, dtype=pyfa.bfloat16, device=dev)
    kv.append(rows, rows)
    one = torch.randn(1, 8, 128, device=cuda, dtype=bf16)
    qh = torch.randn(32, 128, device=cuda, dtype=bf16)

    def decode1():
        pyfa.decode_attention(q1, k1, v1, 4096)

    def decode8():
        pyfa.decode_attention(q8, k8, v8, 32768)

    def tq_attend():
        tq.attend(qh)

    def step():
        kv.append(one, one)
        kv.attend(qh)

    def matmul():
        torch.mm(a, a)

    for f in (decode1, decode8, tq_attend, step, matmul):  # plans, kernels and torch warmed up
        f()
        f()
    torch.cuda.synchronize()

    def host_us(before, call):
        times = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            if before is not None:
                before()
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        return statistics.median(times), min(times)

    pdl = os.environ.get("PYFA_CUDA_PDL", "")
    for name, before, call in (("idle", None, decode1), ("after-mm", matmul, decode1), ("after-own", decode8, decode1),
                               ("tq-after-mm", matmul, tq_attend), ("tq-idle", None, tq_attend),
                               ("step-after-mm", matmul, step), ("step-idle", None, step)):
        med, low = host_us(before, call)
        print(f"PYFA_CUDA_PDL={pdl or 'unset'} {name:14s} host {med:9.1f} us median, {low:9.1f} min", flush=True)


if __name__ == "__main__":
    main()
