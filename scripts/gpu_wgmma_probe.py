"""Structured inputs through pyfa.attention on the CUDA device, to locate an
operand-layout error of a tensor-core prefill path: each probe's output and
inputs go to an .npz for study off the GPU, with one summary line each.

  random      q, k, v random: the float64 reference error
  uniform_p   q = 0 (every weight equal): out is the mean of v's rows, so a
              wrong output-column or V-column mapping shows, whatever S does
  v_identity  v = the identity (rows >= D zero): out = P itself, so the score
              and softmax layout shows against the reference P
  one_hot     k[j] = e_j, q[i] = 30 e_perm(i): row i attends key perm(i) alone,
              out[i] = v[perm(i)]; 'rows_right' counts rows that picked the
              right key (the P V key mapping, given the scores are right)

One query tile and one key tile of the plan's geometry (L = 128 rows and
keys; D 128 and 256), bf16, one head, non-causal, scale 1.

    PYFA_CUDA_PREFILL_WGMMA=1 python3 scripts/gpu_wgmma_probe.py [--out probe.npz]
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import pyfa  # noqa: E402
from pyfa import reference  # noqa: E402

BF16 = pyfa.bfloat16


def probes(D, L, rng):
    eye = np.zeros((L, D), np.float32)
    eye[np.arange(min(L, D)), np.arange(min(L, D))] = 1.0
    perm = rng.permutation(L) % D
    yield "random", rng.standard_normal((L, D)), rng.standard_normal((L, D)), rng.standard_normal((L, D))
    yield "uniform_p", np.zeros((L, D)), rng.standard_normal((L, D)), rng.standard_normal((L, D))
    yield "v_identity", 0.3 * rng.standard_normal((L, D)), rng.standard_normal((L, D)), eye
    q = np.zeros((L, D))
    q[np.arange(L), perm] = 30.0
    yield "one_hot", q, eye, rng.standard_normal((L, D))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="wgmma_probe.npz")
    ap.add_argument("--backend", default="cuda")
    args = ap.parse_args()
    dev = pyfa.Device(args.backend)
    rng = np.random.default_rng(0)
    saved = {}
    for D in (128, 256):
        L = 128
        for name, q, k, v in probes(D, L, rng):
            q4, k4, v4 = (x.astype(BF16)[None, None] for x in (q, k, v))
            out = pyfa.attention(q4, k4, v4, scale=1.0, device=dev, out_dtype=np.float32)
            ref = reference.attention(q4, k4, v4, scale=1.0)
            err = float(np.abs(out.astype(np.float64) - ref).max())
            line = f"D={D} {name}: max|out - ref| {err:.3e}"
            if name == "one_hot":
                vv = v4[0, 0].astype(np.float64)
                pick = np.argmin(((out[0, 0][:, None, :] - vv[None]) ** 2).sum(-1), axis=1)
                want = np.argmin(((ref[0, 0][:, None, :] - vv[None]) ** 2).sum(-1), axis=1)
                line += f", rows_right {int((pick == want).sum())}/{L}"
                saved[f"D{D}_{name}_pick"] = pick
                saved[f"D{D}_{name}_want"] = want
            print(line, flush=True)
            for key, arr in (("q", q4), ("k", k4), ("v", v4)):
                saved[f"D{D}_{name}_{key}"] = arr.astype(np.float32)
            saved[f"D{D}_{name}_out"] = out
            saved[f"D{D}_{name}_ref"] = ref
    np.savez_compressed(args.out, **saved)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
