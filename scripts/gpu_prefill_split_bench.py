"""Prefill over grids smaller than the GPU (few query rows over a long cache, as speculative
decoding's verification; few heads) beside torch SDPA, on torch bf16 tensors, CUDA events around
a loop of public calls (the median of 7 loops). Run it twice, once with PYFA_CUDA_PREFILL_SPLIT=0
(blocks whole) and once without (the plan's key split), to compare the two; each run times torch
in the same process. Causal masking is bottom-right (the queries are the last rows), for torch
through ``causal_lower_right`` with K and V repeated to q's heads outside the timed loop; torch
picks its backend.

    python3 scripts/gpu_prefill_split_bench.py [--json FILE]
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import pyfa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from cuda_timing import event_ms  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--json", default=None)
opts = ap.parse_args()
dev = pyfa.Device("cuda")
# (B, Hq, Hkv, q_len, kv_len, D, causal)
SHAPES = [
    (1, 32, 8, 8, 4096, 128, True),
    (1, 32, 8, 8, 32768, 128, True),
    (1, 32, 8, 64, 16384, 128, True),
    (4, 32, 8, 8, 8192, 128, True),
    (1, 32, 8, 8, 8192, 64, True),
    (1, 4, 2, 2048, 2048, 64, False),
    (1, 8, 2, 2048, 2048, 128, False),
    (1, 16, 8, 4096, 4096, 64, False),
]


def timed_us(fn):
    """µs per call: the median of 7 loops of 20 calls between CUDA events (cuda_timing.event_ms)."""
    return event_ms(fn, iters=20, rounds=7) * 1e3


mode = "whole" if os.environ.get("PYFA_CUDA_PREFILL_SPLIT", "").strip() == "0" else "rule"
rows = []
print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; pyfa blocks: {mode}")
for B, H, HKV, ql, kl, D, causal in SHAPES:
    q = torch.randn(B, H, ql, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, HKV, kl, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(B, HKV, kl, D, dtype=torch.bfloat16, device="cuda")
    kr, vr = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    mask = causal_lower_right(ql, kl) if causal else None
    before = pyfa.counters()["split_launches"]
    out = pyfa.attention(q, k, v, causal=causal, device=dev)
    split = pyfa.counters()["split_launches"] - before
    ref = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
    diff = float((out.float() - ref.float()).abs().max())
    us = timed_us(lambda: pyfa.attention(q, k, v, causal=causal, device=dev))
    torch_us = timed_us(lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask))
    row = {"B": B, "Hq": H, "Hkv": HKV, "q_len": ql, "kv_len": kl, "D": D, "causal": causal, "pyfa_blocks": mode,
           "split": split, "pyfa_us": round(us, 1), "torch_sdpa_us": round(torch_us, 1),
           "max_diff_vs_torch": diff}
    rows.append(row)
    print(f"B {B} H {H}/{HKV} q {ql:5} kv {kl:6} D {D:3} causal {int(causal)} split {split}: "
          f"pyfa {us:8.1f} us  torch SDPA {torch_us:8.1f} us  ({torch_us / us:.2f}x)  max diff {diff:.3g}", flush=True)
if opts.json:
    with open(opts.json, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "pyfa_blocks": mode, "rows": rows}, f,
                  indent=1)
