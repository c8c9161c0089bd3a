"""`python -m pyfa`: backends, device, and a realistic decode checked against
the float64 reference, with its time and achieved bandwidth."""
from __future__ import annotations

import argparse
import time

import numpy as np

import pyfa


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pyfa", description=__doc__)
    ap.add_argument("--backend", default="auto", help="auto, cpu, cuda or metal")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)

    print(f"pyfa backends compiled in: {', '.join(pyfa.backends())}")
    device = pyfa.Device(args.backend)
    print(f"device: {device.backend} / {device.name}")

    rng = np.random.default_rng(0)
    H, Hkv, D, L = args.heads, args.kv_heads, args.head_dim, args.context
    q = rng.standard_normal((1, H, D), dtype=np.float32)
    k = rng.standard_normal((1, Hkv, L, D), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((1, Hkv, L, D), dtype=np.float32).astype(np.float16)
    print(f"decode: B=1 Hq={H} Hkv={Hkv} D={D} context={L} K/V f16 ({(k.nbytes + v.nbytes) / 2**20:.0f} MiB)")

    out = pyfa.decode_attention(q, k, v, L, device=device)
    ref = pyfa.reference.decode_attention(q, k, v, L)
    err = float(np.abs(out - ref).max())
    rel = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        pyfa.decode_attention(q, k, v, L, device=device, out=out)
        times.append(time.perf_counter() - t0)
    t = float(np.median(times))
    gbs = (k.nbytes + v.nbytes) / t / 1e9
    print(f"max |out - ref| = {err:.3e}   relative L2 = {rel:.3e}   ({'ok' if err < 1e-3 else 'FAIL'}: bound 1e-3)")
    print(f"time (median of {args.repeats}, host clock): {t * 1e3:.2f} ms   K+V read: {gbs:.1f} GB/s")
    return 0 if err < 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
