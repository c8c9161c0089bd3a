"""Where a prefill block's time goes: reads the per-block stamps a probe build of the Hopper
prefill writes over the LSE of a call. The probe is docs/cuda/logs/prefill_timeline_probe_q_tma.patch,
which applies to shaders/cuda/attn_prefill_wgmma.cuh since 5a05b48 (Q by TMA or by the consumers'
copies); the logs' first runs used docs/cuda/logs/prefill_timeline_probe.patch, at f92e3bb. Thread 0
of consumer warpgroup 0 writes, over its warp's first 16 LSE rows, the %globaltimer at entry, once
Q and the first K stage landed, after the first tile, after the last P V, after the output's store,
then its SM id and tile count, and the moments its own wait for Q and for the K stage returned. On
a build without the probe the numbers are meaningless. One shape B,Hq,Hkv,D,L,causal (bf16, bhsd):
five calls with return_lse=True, the last one's stamps summarised (medians over its blocks).

    python3 scripts/gpu_prefill_timeline.py 8,32,8,128,1024,1
"""
import statistics as st
import sys
from collections import defaultdict

import torch

import pyfa


def main(spec):
    B, Hq, Hkv, D, L, causal = (int(x) for x in spec.split(","))
    BQ = pyfa_block_q(D)
    dev = pyfa.Device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((B, h, L, D), generator=g, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
    for _ in range(5):
        _, lse = pyfa.attention(q, k, v, causal=bool(causal), device=dev, return_lse=True)
    torch.cuda.synchronize()
    words = lse.contiguous().view(-1).view(torch.int64).cpu()
    blocks = []
    for b in range(B):
        for h in range(Hq):
            for t in range((L + BQ - 1) // BQ):
                x = words[((b * Hq + h) * L + t * BQ) // 2:][:8].tolist()
                blocks.append(dict(sm=x[5] >> 32, tiles=x[5] & 0xFFFFFFFF, t=x[0:5], q=x[6], k=x[7]))
    us = lambda ns: ns / 1e3  # noqa: E731
    med = st.median
    t_first = min(b["t"][0] for b in blocks)
    t_last = max(b["t"][4] for b in blocks)
    start = [us(b["t"][1] - b["t"][0]) for b in blocks]
    first = [us(b["t"][2] - b["t"][1]) for b in blocks]
    loop = [us(b["t"][3] - b["t"][2]) / (b["tiles"] - 1) for b in blocks if b["tiles"] > 1]
    end = [us(b["t"][4] - b["t"][3]) for b in blocks]
    print(f"B {B}, {Hq}/{Hkv}, D {D}, L {L}, causal {bool(causal)}: {len(blocks)} blocks over {us(t_last - t_first):.1f} us")
    print(f"  medians, us: start {med(start):.2f} (own wait for Q {med(us(b['q'] - b['t'][0]) for b in blocks):.2f}, "
          f"then for K0 {med(us(b['k'] - b['t'][0]) for b in blocks):.2f}) | first tile {med(first):.2f} | "
          f"a loop tile {med(loop):.3f} | last turn + store {med(end):.2f}")
    by_sm = defaultdict(list)
    for b in blocks:
        by_sm[b["sm"]].append(b)
    gaps, busy = [], 0.0
    for rows in by_sm.values():
        rows.sort(key=lambda b: b["t"][0])
        gaps += [us(n["t"][0] - p["t"][4]) for p, n in zip(rows, rows[1:])]
        busy += sum(us(b["t"][4] - b["t"][0]) for b in rows)
    print(f"  {len(blocks) / len(by_sm):.2f} blocks an SM; between blocks {med(gaps) if gaps else 0:.2f} us (median); "
          f"blocks running {busy / (len(by_sm) * us(t_last - t_first)):.3f} of the span")


def pyfa_block_q(D):
    """The Hopper kernel's query tile (cuda_layout.h, pyfa_cuda_prefill_wgmma_block_q, rectangular mode)."""
    return 192 if D == 64 else 128


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
