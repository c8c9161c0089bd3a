"""Decode attention on the CUDA device against torch SDPA (flash and cuDNN
backends) in the same process: CUDA events around back-to-back launches on one
stream, warm-up excluded, median over repeats. Bandwidth counts the K and V
bytes read (the usual convention for decode bandwidth).

pyfa is timed two ways:
  kernel: dispatches recorded ahead, then one commit between the events, so
          the GPU runs them back to back (what a serving loop or a CUDA graph sees);
  api:    pyfa.decode_attention(torch tensors) per call, Python overhead included.

    python3 benchmarks/cuda_decode_bench.py --out results.json [--md table.md] [--png plot.png] [--quick]
"""
import argparse
import json
import math
import statistics
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import pyfa
from pyfa import _io
from pyfa._native import ffi, lib
from pyfa.errors import check

# (Hq, Hkv, D, kv_len, B)
CASES = [
    (16, 8, 256, 4096, 1), (16, 8, 256, 16384, 1), (16, 8, 256, 65536, 1),
    (16, 8, 256, 16384, 8), (16, 8, 256, 65536, 8),
    (32, 8, 128, 16384, 1), (32, 8, 128, 65536, 8),
    (16, 2, 512, 16384, 1), (16, 2, 512, 65536, 1), (16, 2, 512, 65536, 8),
]
QUICK = [(16, 8, 256, 16384, 1), (16, 8, 256, 65536, 8), (16, 2, 512, 65536, 1), (16, 2, 512, 65536, 8),
         (32, 8, 128, 16384, 1), (32, 8, 128, 65536, 8)]


def timed(launch, iters, reps, prepare=None):
    """Median µs per launch: events around `iters` launches (after `prepare`)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for r in range(reps + 2):  # the first two are warm-up
        if prepare:
            prepare()
        start.record()
        launch()
        end.record()
        end.synchronize()
        if r >= 2:
            samples.append(start.elapsed_time(end) * 1000.0 / iters)
    return statistics.median(samples)


class PyfaDecode:
    """Buffers, params and an encoder bound to torch's current stream, built once."""

    def __init__(self, dev, q, k, v, kv_len):
        B, H, D = q.shape
        Hkv, cap = k.shape[1], k.shape[2]
        self.params = ffi.new("pyfa_flash_attn_vec_params *", {
            "batch": B, "num_heads": H, "num_kv_heads": Hkv, "head_dim": D, "kv_capacity": cap,
            "nwg": 0, "window": 0, "scale": 1.0 / math.sqrt(D), "softcap": 0.0})
        tmp_bytes = ffi.new("uint64_t *")
        kv_dtype = lib.PYFA_DTYPE_F16 if k.dtype == torch.float16 else lib.PYFA_DTYPE_BF16
        check(lib.pyfa_flash_attn_vec_plan(dev.handle, self.params, kv_dtype, kv_len, tmp_bytes))
        self.out = torch.empty((B, H, D), dtype=torch.float32, device="cuda")
        lens = torch.full((B,), kv_len, dtype=torch.int32, device="cuda")
        rings = torch.zeros((B,), dtype=torch.int32, device="cuda")
        tmp = torch.empty((max(tmp_bytes[0] // 4, 1),), dtype=torch.float32, device="cuda")
        self.keep = (q, k, v, lens, rings, tmp)
        g = [pyfa.cuda_interop.describe(t, "x") for t in (q, k, v, lens, rings, tmp, self.out)]
        self.bufs = [_io.to_device(dev, a) for a in g]
        self.has_tmp = tmp_bytes[0] > 0
        self.enc = _io.encoder(dev, g[0])
        self.nwg = int(self.params.nwg)

    def record(self, n):
        b = self.bufs
        for _ in range(n):
            check(lib.pyfa_flash_attn_vec(self.enc, self.params, b[0].handle, b[1].handle, b[2].handle, b[3].handle,
                                          b[4].handle, b[5].handle if self.has_tmp else ffi.NULL, b[6].handle,
                                          ffi.NULL))

    def commit(self):
        check(lib.pyfa_encoder_commit(self.enc))


def copy_bandwidth():
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = timed(lambda: [y.copy_(x) for _ in range(5)], 5, 5)
    return 2 * x.numel() / (us * 1e-6) / 1e9


def run_case(dev, Hq, Hkv, D, L, B, iters, reps, dtype="f16"):
    g = torch.Generator(device="cuda").manual_seed(0)
    t = {"f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    q = torch.randn((B, Hq, D), generator=g, device="cuda", dtype=torch.float16).to(t)
    k = torch.randn((B, Hkv, L, D), generator=g, device="cuda", dtype=torch.float16).to(t)
    v = torch.randn((B, Hkv, L, D), generator=g, device="cuda", dtype=torch.float16).to(t)
    nbytes = 2 * k.numel() * k.element_size()
    row = {"Hq": Hq, "Hkv": Hkv, "D": D, "kv_len": L, "B": B, "dtype": dtype, "kv_bytes": nbytes}

    pd = PyfaDecode(dev, q, k, v, L)
    row["nwg"] = pd.nwg
    row["pyfa_kernel_us"] = timed(pd.commit, iters, reps, prepare=lambda: pd.record(iters))
    row["pyfa_api_us"] = timed(lambda: [pyfa.decode_attention(q, k, v, L, device=dev) for _ in range(iters)],
                               iters, reps)
    ours = pyfa.decode_attention(q, k, v, L, device=dev)

    q4, = (q.view(B, Hq, 1, D),)
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                ref = F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
                torch.cuda.synchronize()
                row[f"{name}_us"] = timed(
                    lambda: [F.scaled_dot_product_attention(q4, k, v, enable_gqa=True) for _ in range(iters)],
                    iters, reps)
            row[f"{name}_max_abs_diff"] = float((ref.view(B, Hq, D).float() - ours.float()).abs().max())
        except RuntimeError as e:
            row[f"{name}_us"] = None
            row[f"{name}_error"] = str(e).splitlines()[0][:200]
    for key in ("pyfa_kernel", "pyfa_api", "flash", "cudnn"):
        us = row.get(f"{key}_us")
        row[f"{key}_GBps"] = None if us is None else nbytes / (us * 1e-6) / 1e9
    del pd
    return row


def markdown(rows, gpu, copy_gbps):
    lines = [f"Decode {rows[0]['dtype'] if rows else 'f16'} on {gpu} (torch {torch.__version__}); µs per call (GB/s of K+V read); "
             f"device-to-device copy {copy_gbps:.0f} GB/s (read + write).", "",
             "| Hq/Hkv | D | kv_len | B | nwg | pyfa kernel | pyfa api | torch flash | torch cuDNN |",
             "|---|---|---|---|---|---|---|---|---|"]

    def cell(r, key):
        us = r.get(f"{key}_us")
        return "no kernel" if us is None else f"{us:.1f} ({r[f'{key}_GBps']:.0f})"
    for r in rows:
        lines.append(f"| {r['Hq']}/{r['Hkv']} | {r['D']} | {r['kv_len']} | {r['B']} | {r['nwg']} | "
                     f"{cell(r, 'pyfa_kernel')} | {cell(r, 'pyfa_api')} | {cell(r, 'flash')} | {cell(r, 'cudnn')} |")
    return "\n".join(lines) + "\n"


def plot(rows, gpu, copy_gbps, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['Hq']}/{r['Hkv']} D{r['D']}\n{r['kv_len'] // 1024}K B{r['B']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(rows)), 4.5))
    for i, (key, name) in enumerate([("pyfa_kernel", "pyfa"), ("flash", "torch flash"), ("cudnn", "torch cuDNN")]):
        vals = [r.get(f"{key}_GBps") or 0 for r in rows]
        ax.bar(x + (i - 1) * 0.27, vals, 0.27, label=name)
    ax.axhline(copy_gbps, color="k", ls="--", lw=1, label=f"D2D copy {copy_gbps:.0f} GB/s")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("GB/s of K+V read")
    ax.set_title(f"Decode {rows[0]['dtype']} on {gpu} (missing bars: no torch kernel)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--md")
    ap.add_argument("--png")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--label", default="default")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--cases", help="semicolon-separated Hq,Hkv,D,kv_len,B (instead of the built-in cases)")
    ap.add_argument("--dtype", default="f16", choices=["f16", "bf16"], help="q, K and V dtype")
    args = ap.parse_args()
    dev = pyfa.Device("cuda")
    gpu = torch.cuda.get_device_name()
    copy_gbps = copy_bandwidth()
    rows = []
    cases = [tuple(int(x) for x in c.split(",")) for c in args.cases.split(";")] if args.cases else None
    for case in cases or (QUICK if args.quick else CASES):
        r = run_case(dev, *case, args.iters, args.reps, args.dtype)
        r["label"] = args.label
        rows.append(r)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()
                          if k.endswith("_us") or k in ("Hq", "Hkv", "D", "kv_len", "B", "nwg", "label", "pyfa_kernel_GBps")}), flush=True)
    result = {"gpu": gpu, "device": dev.name, "torch": torch.__version__, "copy_GBps": copy_gbps, "rows": rows}
    with open(args.out, "a" if args.quick or cases else "w") as f:
        f.write(json.dumps(result, indent=None if args.quick or cases else 1) + "\n")
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(rows, gpu, copy_gbps))
    if args.png:
        plot(rows, gpu, copy_gbps, args.png)
    print(markdown(rows, gpu, copy_gbps))


if __name__ == "__main__":
    sys.exit(main())
