"""One prefill shape (default bf16, B = 1, Hq/Hkv = 16/8, D = 128, 16K tokens,
not causal) through the public call, a few calls: a target for Nsight Compute,
or CUDA-event timings (TFLOP/s) without one.

    ncu --section SpeedOfLight --section WarpStateStats -k regex:flash_attn_prefill \\
        --launch-skip 2 --launch-count 1 python3 scripts/gpu_prefill_profile.py --once
    python3 scripts/gpu_prefill_profile.py --shape 16,8,128,16384,1     (Hq, Hkv, D, L, causal)
"""
import sys
from pathlib import Path

import torch

import pyfa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from cuda_timing import event_ms  # noqa: E402


def main():
    # --shape Hq,Hkv,D,L,causal (repeatable) replaces the default shape
    shapes = [tuple(int(x) for x in sys.argv[i + 1].split(",")) for i, a in enumerate(sys.argv) if a == "--shape"]
    for shape in shapes or [(16, 8, 128, 16384, 0)]:
        run(*shape)


def run(Hq, Hkv, D, L, causal):
    dev = pyfa.Device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn((1, Hq, L, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn((1, Hkv, L, D), generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn((1, Hkv, L, D), generator=g, device="cuda", dtype=torch.bfloat16)

    def call():
        return pyfa.attention(q, k, v, causal=bool(causal), device=dev)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    if "--once" in sys.argv:
        return
    ms = event_ms(call, iters=10)
    flops = 4 * Hq * L * L * D / (2 if causal else 1)
    print(f"Hq/Hkv {Hq}/{Hkv} D={D} L={L} causal={bool(causal)}: {ms * 1e3:.1f} us, {flops / ms / 1e9:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
