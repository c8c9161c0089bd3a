"""Prefill through the public call beside torch SDPA's cuDNN and flash backends, in one process:
bf16, CUDA events around back-to-back calls (cuda_timing.event_ms: the median of 3 rounds of 20
calls, after a warm-up), two values per implementation (the implementations take turns), the
shapes as B,Hq,Hkv,D,L,causal (bhsd, GQA through enable_gqa). Prints µs a call, TFLOP/s of the
fastest value, and the largest |pyfa - cuDNN|. Two builds are compared by running it from each
build's bundle in turn (docs/cuda/NOTES.md, "Where a block's time goes").

    python3 scripts/gpu_prefill_peers.py 8,32,8,128,1024,1 1,16,8,128,4096,0 ...
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import pyfa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from cuda_timing import event_ms  # noqa: E402


def main(specs):
    dev = pyfa.Device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    for spec in specs:
        B, Hq, Hkv, D, L, causal = (int(x) for x in spec.split(","))
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn((B, h, L, D), generator=g, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
        flops = 4 * B * Hq * L * L * D / (2 if causal else 1)

        def ours():
            return pyfa.attention(q, k, v, causal=bool(causal), device=dev)

        def sdpa(backend):
            def call():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), enable_gqa=True)
            return call

        impls = (("pyfa", ours), ("cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)), ("flash", sdpa(SDPBackend.FLASH_ATTENTION)))
        times = {}
        for _ in range(2):
            for name, call in impls:
                try:
                    times.setdefault(name, []).append(event_ms(call, iters=20) * 1e3)
                except RuntimeError as e:  # a backend without a kernel for the shape
                    times[name] = [str(e).splitlines()[0][:60]]
        err = (ours().float() - sdpa(SDPBackend.CUDNN_ATTENTION)().float()).abs().max().item()
        us = " ".join(f"{n} " + ",".join(f"{x:.1f}" if isinstance(x, float) else x for x in t) for n, t in times.items())
        tf = " ".join(f"{n} {flops / min(t) / 1e6:.0f}TF" for n, t in times.items() if isinstance(t[0], float))
        print(f"B{B} {Hq}/{Hkv} D{D} L{L} causal={causal}: us {us} | {tf} | max|pyfa-cudnn| {err:.2e}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
