"""One prefill shape (default bf16, B = 1, Hq/Hkv = 16/8, D = 128, 16K tokens,
not causal) through the public call, a few calls: a target for Nsight Compute,
or CUDA-event timings (TFLOP/s) without one.

    ncu --section SpeedOfLight --section WarpStateStats -k regex:flash_attn_prefill \\
        --launch-skip 2 --launch-count 1 python3 scripts/gpu_prefill_profile.py --once
    python3 scripts/gpu_prefill_profile.py --shape 16,8,128,16384,1     (Hq, Hkv, D, L, causal)
    python3 scripts/gpu_prefill_profile.py --shape 16,8,128,16384,1,4   (... , then N: varlen_attention
                                                                         over N packed sequences of L / N)
    python3 scripts/gpu_prefill_profile.py --fa4 ...   FlashAttention-4's public call on the same
                                                       inputs instead (rectangular shapes only; a
                                                       profile of the strongest peer beside ours)
"""
import sys
from pathlib import Path

import torch

import pyfa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from cuda_timing import event_ms  # noqa: E402


def main():
    # --shape Hq,Hkv,D,L,causal[,N] (repeatable) replaces the default shape
    shapes = [tuple(int(x) for x in sys.argv[i + 1].split(",")) for i, a in enumerate(sys.argv) if a == "--shape"]
    for shape in shapes or [(16, 8, 128, 16384, 0)]:
        run(*shape)


def run(Hq, Hkv, D, L, causal, packed=0):
    dev = pyfa.Device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    if packed:
        # varlen_attention over `packed` sequences of L // packed rows each, [total, H, D]
        n = L // packed
        q = torch.randn((packed * n, Hq, D), generator=g, device="cuda", dtype=torch.bfloat16)
        k = torch.randn((packed * n, Hkv, D), generator=g, device="cuda", dtype=torch.bfloat16)
        v = torch.randn((packed * n, Hkv, D), generator=g, device="cuda", dtype=torch.bfloat16)
        cu = torch.arange(0, packed * n + 1, n, device="cuda", dtype=torch.int32)

        def call():
            return pyfa.varlen_attention(q, k, v, cu, cu, max_seqlen_q=n, max_seqlen_k=n, causal=bool(causal),
                                         device=dev)

        flops = packed * 4 * Hq * n * n * D / (2 if causal else 1)
    else:
        q = torch.randn((1, Hq, L, D), generator=g, device="cuda", dtype=torch.bfloat16)
        k = torch.randn((1, Hkv, L, D), generator=g, device="cuda", dtype=torch.bfloat16)
        v = torch.randn((1, Hkv, L, D), generator=g, device="cuda", dtype=torch.bfloat16)

        if "--fa4" in sys.argv:
            from flash_attn.cute import flash_attn_func

            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # its layout: [B, L, H, D]

            def call():
                return flash_attn_func(qt, kt, vt, causal=bool(causal))
        else:

            def call():
                return pyfa.attention(q, k, v, causal=bool(causal), device=dev)

        flops = 4 * Hq * L * L * D / (2 if causal else 1)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    if "--once" in sys.argv:
        return
    ms = event_ms(call, iters=10)
    what = f"varlen {packed} x {L // packed}" if packed else f"L={L}"
    who = "FlashAttention-4" if "--fa4" in sys.argv else "pyfa"
    print(f"{who} Hq/Hkv {Hq}/{Hkv} D={D} {what} causal={bool(causal)}: {ms * 1e3:.1f} us, {flops / ms / 1e9:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
