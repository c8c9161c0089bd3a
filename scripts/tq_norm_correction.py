"""Measures TurboQuant attention-output error for each norm_correction mode
(none = |x|, norm_preserving, unbiased), to pick the default.

Setup: head_dim 128, 2048 keys and values ~ N(0, I), 8 query heads ~ N(0, s^2 I)
sharing one KV head, K and V at the same bit width, a fresh seed per trial.
Error: relative L2 of the output against float64 attention over the exact K/V;
cosine per query row. Run: python scripts/tq_norm_correction.py [--trials N]
"""
from __future__ import annotations

import argparse

import numpy as np

import pyfa
from pyfa import reference


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--keys", type=int, default=2048)
    args = ap.parse_args(argv)
    D, N, H = args.head_dim, args.keys, 8
    modes = ("none", "norm_preserving", "unbiased")
    print(f"D={D} keys={N} query heads={H} trials={args.trials}; mean relative L2 error (mean cosine)")
    for q_std in (1.0, 3.0):
        print(f"q ~ N(0, {q_std**2:g} I)")
        print(f"{'mode':>16} " + " ".join(f"{f'{b}-bit':>17}" for b in (2, 3, 4, 8)))
        for mode in modes:
            cells = []
            for bits in (2, 3, 4, 8):
                rng = np.random.default_rng(1234)  # the same data for every mode
                errs, coss = [], []
                for trial in range(args.trials):
                    k = rng.standard_normal((N, 1, D))
                    v = rng.standard_normal((N, 1, D))
                    q = (q_std * rng.standard_normal((H, D))).astype(np.float32)
                    cache = pyfa.TurboQuantKVCache(1, D, N, k_bits=bits, v_bits=bits, seed=trial,
                                                   norm_correction=mode)
                    cache.append(k, v)
                    out = cache.attend(q).astype(np.float64)
                    ref = reference.decode_attention(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2), N)
                    errs.append(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                    coss.append(np.mean(np.sum(out * ref, 1) / np.linalg.norm(out, axis=1) / np.linalg.norm(ref, axis=1)))
                cells.append(f"{np.mean(errs):.4f} ({np.mean(coss):.4f})")
            print(f"{mode:>16} " + " ".join(f"{c:>17}" for c in cells))


if __name__ == "__main__":
    main()
