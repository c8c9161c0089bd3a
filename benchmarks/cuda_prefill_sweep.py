"""Prefill on a CUDA GPU through the public call, beside torch SDPA (flash and
cuDNN) and, when it imports, FlashAttention-4 (flash_attn.cute, its own
[B, L, H, D] tensors, GQA native) in the same process: bf16, B = 1, Hq/Hkv =
16/8, bhsd, D in {64, 128, 256}, L in {4K, 16K}, causal and not. Times are CUDA events around
back-to-back calls after a warm-up (median of 3 rounds); TFLOP/s =
4 B H L^2 D / time, halved when causal. Each pyfa result is also checked
against torch's flash result (max |diff|).

    python3 benchmarks/cuda_prefill_sweep.py [--json out.jsonl] [--label TEXT] [--dims 64,128,256]

The CUDA plan's knobs (PYFA_CUDA_PREFILL_WGMMA, PYFA_CUDA_PREFILL_P_TERMS) are
read once per process: run the script once per setting, with --label naming it.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import pyfa
from cuda_timing import event_ms

try:
    from flash_attn.cute import flash_attn_func as fa4_func
    FA4_ERROR = None
except Exception as e:  # noqa: BLE001 - not installed, or installed without its CUDA libraries: the column says why
    fa4_func, FA4_ERROR = None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}" if str(e) else type(e).__name__


def fa4(q, k, v, causal):
    res = fa4_func(q, k, v, causal=causal)
    return res[0] if isinstance(res, tuple) else res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="append one JSON line per case to this file")
    ap.add_argument("--label", default="")
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--lens", default="4096,16384")
    args = ap.parse_args()
    dev = pyfa.Device("cuda")
    gpu = torch.cuda.get_device_name()
    H, Hkv = 16, 8
    rows = []
    for D in (int(x) for x in args.dims.split(",")):
        for L in (int(x) for x in args.lens.split(",")):
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn((1, H, L, D), generator=g, device="cuda", dtype=torch.bfloat16)
            k = torch.randn((1, Hkv, L, D), generator=g, device="cuda", dtype=torch.bfloat16)
            v = torch.randn((1, Hkv, L, D), generator=g, device="cuda", dtype=torch.bfloat16)
            kr, vr = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
            for causal in (True, False):
                flops = 4 * H * L * L * D / (2 if causal else 1)
                row = {"label": args.label, "gpu": gpu, "D": D, "L": L, "causal": causal}
                out = pyfa.attention(q, k, v, causal=causal, device=dev)
                row["pyfa_TF"] = round(flops / event_ms(lambda: pyfa.attention(q, k, v, causal=causal, device=dev))
                                       / 1e9, 1)
                for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel(backend):
                            ref = F.scaled_dot_product_attention(q, kr, vr, is_causal=causal)
                            ms = event_ms(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=causal))
                        row[f"{name}_TF"] = round(flops / ms / 1e9, 1)
                        if name == "flash":
                            row["max_diff_vs_flash"] = float((out.float() - ref.float()).abs().max())
                    except RuntimeError as e:
                        row[f"{name}_TF"] = None
                        row[f"{name}_error"] = str(e).splitlines()[0][:80]
                if fa4_func is None:
                    row["fa4_TF"], row["fa4_error"] = None, FA4_ERROR
                else:
                    qf, kf, vf = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                    try:
                        ref4 = fa4(qf, kf, vf, causal)
                        row["fa4_TF"] = round(flops / event_ms(lambda: fa4(qf, kf, vf, causal)) / 1e9, 1)
                        row["max_diff_vs_fa4"] = float((out.float() - ref4.transpose(1, 2).float()).abs().max())
                    except Exception as e:  # noqa: BLE001 - FA4 refusing a case is reported in its column
                        row["fa4_TF"], row["fa4_error"] = None, str(e).splitlines()[0][:80]
                    del qf, kf, vf
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
            del q, k, v, kr, vr, out
    print(f"| {args.label or 'pyfa'} on {gpu} | D | L | causal | pyfa TF | flash TF | cuDNN TF | FA4 TF "
          f"| pyfa / cuDNN | pyfa / FA4 |")
    for r in rows:
        ratio = r["pyfa_TF"] / r["cudnn_TF"] if r.get("cudnn_TF") else float("nan")
        ratio4 = r["pyfa_TF"] / r["fa4_TF"] if r.get("fa4_TF") else float("nan")
        print(f"| | {r['D']} | {r['L']} | {r['causal']} | {r['pyfa_TF']} | {r.get('flash_TF')} | {r.get('cudnn_TF')} "
              f"| {r.get('fa4_TF')} | {ratio:.2f} | {ratio4:.2f} |")


if __name__ == "__main__":
    main()
