"""Dense decode at one serving shape (default B=8, Hq/Hkv = 32/8, D = 128, 32K
positions, bf16), pyfa and torch SDPA (flash) on the same tensors, a few calls
each: a target for Nsight Compute, or CUDA-event timings without one.

    ncu --set full -k regex:flash_attn_vec__ --launch-skip 3 --launch-count 1 \\
        python3 scripts/gpu_decode_profile.py --once
    python3 scripts/gpu_decode_profile.py --shape 8,32,8,128,32768 [--shape ...]
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import pyfa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from cuda_timing import event_ms  # noqa: E402


def main():
    # --shape B,H,Hkv,D,L (repeatable) replaces the default shape
    shapes = [tuple(int(x) for x in sys.argv[i + 1].split(",")) for i, a in enumerate(sys.argv) if a == "--shape"]
    for shape in shapes or [(8, 32, 8, 128, 32768)]:
        run(*shape)


def run(B, H, Hkv, D, L):
    dev = pyfa.Device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn((B, H, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn((B, Hkv, L, D), generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn((B, Hkv, L, D), generator=g, device="cuda", dtype=torch.bfloat16)
    calls = {"pyfa": lambda: pyfa.decode_attention(q, k, v, L, device=dev),
             "torch-flash": lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)}
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        for name, fn in calls.items():
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            if "--once" in sys.argv:
                continue
            us = event_ms(fn, iters=20) * 1e3
            gbs = 2 * k.numel() * 2 / us / 1e3
            print(f"{name}: {us:.1f} us per call, {gbs:.0f} GB/s of K+V (B={B} H={H}/{Hkv} D={D} L={L})")


if __name__ == "__main__":
    main()
