"""One prefill shape (default bf16, B = 1, Hq/Hkv = 16/8, D = 128, 16K tokens,
not causal) through the public call, a few calls: a target for Nsight Compute,
or CUDA-event timings (TFLOP/s) without one.

    ncu --section SpeedOfLight --section WarpStateStats -k regex:flash_attn_prefill \\
        --launch-skip 2 --launch-count 1 python3 scripts/gpu_prefill_profile.py --once
    python3 scripts/gpu_prefill_profile.py --shape 16,8,128,16384,1     (Hq, Hkv, D, L, causal)
    python3 scripts/gpu_prefill_profile.py --shape 16,8,128,16384,1,4   (... , then N: varlen_attention
                                                                         over N packed sequences of L / N)
    python3 scripts/gpu_prefill_profile.py --shape 16,8,64,4096,1:mask=bool,window=512,softcap=30,lse=1
        (rectangular shapes: the call's options after a colon. mask=bool|additive is a [L, L] mask
        that hides the last 37 keys from every row, as a padded batch's does, and with mixed=1
        also a random 10% of every row's keys, so that every tile reads its mask; TFLOP/s count
        the rectangle or the causal triangle whatever the options hide)
    python3 scripts/gpu_prefill_profile.py --kernels ...   also each kernel's own GPU time
                                                           (torch.profiler over the timed calls)
    python3 scripts/gpu_prefill_profile.py --sdpa ...      torch SDPA's public call on the same inputs
                                                           instead (its own backend choice; causal
                                                           and a mask combined into one bool mask;
                                                           K and V repeated to q's heads)
    python3 scripts/gpu_prefill_profile.py --cudnn ...  torch SDPA held to its cuDNN backend (enable_gqa,
                                                        as scripts/gpu_prefill_peers.py calls it)
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
    specs = [sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "--shape"]
    for spec in specs or ["16,8,128,16384,0"]:
        dims, _, opts = spec.partition(":")
        options = dict(o.split("=", 1) for o in opts.split(",") if o)
        run(*(int(x) for x in dims.split(",")), options=options)


def call_options(options, L):
    """pyfa.attention's keyword arguments for the --shape options."""
    kw = {}
    if "window" in options:
        kw["window"] = int(options["window"])
    if "softcap" in options:
        kw["softcap"] = float(options["softcap"])
    if options.get("lse") == "1":
        kw["return_lse"] = True
    kind = options.get("mask")
    if kind:
        visible = torch.ones((L, L), device="cuda", dtype=torch.bool)
        visible[:, L - 37:] = False
        if options.get("mixed") == "1":
            g = torch.Generator(device="cuda").manual_seed(1)
            visible &= torch.rand((L, L), generator=g, device="cuda") >= 0.1
        if kind == "bool":
            kw["mask"] = visible
        else:
            zero = torch.zeros((L, L), device="cuda", dtype=torch.bfloat16)
            kw["mask"] = zero.masked_fill(~visible, float("-inf"))
    return kw


def run(Hq, Hkv, D, L, causal, packed=0, options=None):
    options = options or {}
    if options and (packed or "--fa4" in sys.argv):
        raise SystemExit("--shape options apply to pyfa.attention and --sdpa only (not varlen shapes or --fa4)")
    if packed and ("--fa4" in sys.argv or "--sdpa" in sys.argv or "--cudnn" in sys.argv):
        raise SystemExit("--fa4, --sdpa and --cudnn time rectangular shapes only")
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

        if "--sdpa" in sys.argv:
            kw = call_options(options, L)
            if set(kw) - {"mask"}:
                raise SystemExit(f"--sdpa takes no options but mask: {sorted(set(kw) - {'mask'})}")
            mask = kw.get("mask")
            if mask is not None and mask.dtype != torch.bool:
                mask = mask == 0  # the additive mask here is 0 or -inf
            if causal and mask is not None:
                mask = mask & torch.ones((L, L), device="cuda", dtype=torch.bool).tril()

            # K and V repeated to q's heads outside the timed call: SDPA's backends that take a
            # mask do not all take enable_gqa
            kx, vx = (x.repeat_interleave(Hq // Hkv, dim=1) for x in (k, v))

            def call():
                return torch.nn.functional.scaled_dot_product_attention(
                    q, kx, vx, attn_mask=mask, is_causal=bool(causal) and mask is None)
        elif "--cudnn" in sys.argv:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            if options:
                raise SystemExit("--cudnn takes no options")

            def call():  # as scripts/gpu_prefill_peers.py calls it
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal),
                                                                            enable_gqa=True)
        elif "--fa4" in sys.argv:
            from flash_attn.cute import flash_attn_func

            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # its layout: [B, L, H, D]

            def call():
                return flash_attn_func(qt, kt, vt, causal=bool(causal))
        else:
            kw = call_options(options, L)

            def call():
                return pyfa.attention(q, k, v, causal=bool(causal), device=dev, **kw)

        flops = 4 * Hq * L * L * D / (2 if causal else 1)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    if "--once" in sys.argv:
        return
    ms = event_ms(call, iters=10)
    what = f"varlen {packed} x {L // packed}" if packed else f"L={L}"
    if options:
        what += " " + ",".join(f"{k}={v}" for k, v in options.items())
    who = ("FlashAttention-4" if "--fa4" in sys.argv else "torch SDPA" if "--sdpa" in sys.argv
           else "cuDNN (torch SDPA)" if "--cudnn" in sys.argv else "pyfa")
    print(f"{who} Hq/Hkv {Hq}/{Hkv} D={D} {what} causal={bool(causal)}: {ms * 1e3:.1f} us, {flops / ms / 1e9:.1f} TFLOP/s")
    if "--kernels" in sys.argv:
        print_kernel_times(call)


def print_kernel_times(call, iters=10):
    """Each CUDA kernel's GPU time per call, from torch.profiler over `iters` calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total > 0:
            print(f"  kernel {e.key[:90]}: {e.device_time_total / iters:.1f} us a call ({e.count // iters} a call)")


if __name__ == "__main__":
    main()
