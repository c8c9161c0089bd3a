"""Dense decode at one serving shape (default B=8, Hq/Hkv = 32/8, D = 128, 32K
positions, bf16), pyfa and torch SDPA (flash, then cuDNN) on the same tensors,
a few calls each: a target for Nsight Compute, or CUDA-event timings without
one. Each line names the pyfa knobs set in the environment (PYFA_CUDA_*), so
runs of one shape under different knobs can be told apart.

    ncu --set full -k regex:flash_attn_vec__ --launch-skip 3 --launch-count 1 \\
        python3 scripts/gpu_decode_profile.py --once
    python3 scripts/gpu_decode_profile.py --shape 8,32,8,128,32768[,cap] [--shape ...] [--cudnn]
"""
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import pyfa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from cuda_timing import event_ms  # noqa: E402


def main():
    # --shape B,H,Hkv,D,L[,cap] (repeatable) replaces the default shape
    shapes = [tuple(int(x) for x in sys.argv[i + 1].split(",")) for i, a in enumerate(sys.argv) if a == "--shape"]
    for shape in shapes or [(8, 32, 8, 128, 32768)]:
        run(*shape)


def run(B, H, Hkv, D, L, cap=None):
    # cap: the caches' capacity (rows per head, >= L), so heads lie cap * D apart
    cap = cap or L
    dev = pyfa.Device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn((B, H, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn((B, Hkv, cap, D), generator=g, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn((B, Hkv, cap, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = k_cache[:, :, :L], v_cache[:, :, :L]
    knobs = " ".join(f"{name}={val}" for name, val in sorted(os.environ.items())
                     if name.startswith("PYFA_CUDA_")) or "defaults"
    sdpa = torch.nn.attention.SDPBackend
    calls = {"pyfa": (None, lambda: pyfa.decode_attention(q, k_cache, v_cache, L, device=dev)),
             "torch-flash": (sdpa.FLASH_ATTENTION, lambda: F.scaled_dot_product_attention(q[:, :, None], k, v,
                                                                                           enable_gqa=True)),
             "torch-cudnn": (sdpa.CUDNN_ATTENTION, lambda: F.scaled_dot_product_attention(q[:, :, None], k, v,
                                                                                           enable_gqa=True))}
    for name, (backend, fn) in calls.items():
        if name == "torch-cudnn" and "--cudnn" not in sys.argv:
            continue
        with torch.nn.attention.sdpa_kernel(backend) if backend is not None else torch.no_grad():
            try:
                for _ in range(5):
                    fn()
            except RuntimeError as e:  # torch has no kernel for the shape (D = 512)
                print(f"{name}: not run ({str(e).splitlines()[0]}) (B={B} H={H}/{Hkv} D={D} L={L}) [{knobs}]")
                continue
            torch.cuda.synchronize()
            if "--once" in sys.argv:
                continue
            us = event_ms(fn, iters=20) * 1e3
            gbs = 2 * k.numel() * 2 / us / 1e3
            print(f"{name}: {us:.1f} us per call, {gbs:.0f} GB/s of K+V (B={B} H={H}/{Hkv} D={D} L={L} cap={cap}) [{knobs}]")


if __name__ == "__main__":
    main()
