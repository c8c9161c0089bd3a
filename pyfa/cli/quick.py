"""`python -m pyfa` with no command: what is here (versions, backends, the
device), the quick check, and one decode at a realistic shape (16 query
heads, 8 KV heads, D = 256, 16K float16 positions) checked against the
float64 reference, with its time and the bandwidth it reached."""
from __future__ import annotations

import sys
import time

import numpy as np

import pyfa

from . import _measure, backend_name, check, info

# The timed decode: a 16K-token context of a model with 16 query and 8 KV heads of dim 256 (128 MiB of K/V).
DECODE_SHAPE = {"B": 1, "H": 16, "Hkv": 8, "D": 256, "L": 16384}


def run(args, out=None) -> int:
    out = out or sys.stdout
    device = pyfa.Device(backend_name(args))
    print(info.library_lines()[0], file=out)
    print(f"backends compiled in: {', '.join(pyfa.backends())}; open here: {', '.join(pyfa.available_backends())}",
          file=out)
    print(f"device: {device.backend} ({device.name})", file=out)

    measures, seconds = check.run_cases(device, full=False)
    text, checked = check.report(measures)
    failed = sum(not m.ok for m in measures)
    print(f"check (quick set, every op and dtype): {'PASS' if checked else 'FAIL'}: {len(measures) - failed} of "
          f"{len(measures)} comparisons within their bounds ({seconds:.1f} s)", file=out)
    if not checked:
        print(text, file=out)

    decoded = _decode(device, out, **DECODE_SHAPE)
    print(f"more: {' | '.join('python -m pyfa ' + c for c in ('info', 'check --full', 'bench', '--help'))}", file=out)
    return 0 if checked and decoded else 1


def _decode(device: pyfa.Device, out, B, H, Hkv, D, L, repeats=10) -> bool:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, D), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, L, D), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((B, Hkv, L, D), dtype=np.float32).astype(np.float16)
    print(f"decode: B={B} Hq={H} Hkv={Hkv} D={D} context={L}, K/V float16 ({(k.nbytes + v.nbytes) / 2**20:.0f} MiB), "
          "q and output float32", file=out)
    result = pyfa.decode_attention(q, k, v, L, device=device)
    m = _measure.output("decode", "f16", result, pyfa.reference.decode_attention(q, k, v, L), np.float32)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pyfa.decode_attention(q, k, v, L, device=device, out=result)  # numpy in, numpy out: returns when done
        times.append(time.perf_counter() - t0)
    t = float(np.median(times))
    print(f"  max |out - ref| = {m.error:.2e} (bound {m.bound:.0e}: {'ok' if m.ok else 'FAIL'}); "
          f"{t * 1e3:.2f} ms (median of {repeats}, host clock), K+V read at {(k.nbytes + v.nbytes) / t / 1e9:.1f} GB/s",
          file=out)
    return m.ok
