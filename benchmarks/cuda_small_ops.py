"""Small prefill, merge and TurboQuant cases on the CUDA device, for
compute-sanitizer (memcheck, racecheck): masks with blk, causal + window,
softcap, LSE, GQA, an odd length, the f32 path, D = 512; merge of two halves; a
TurboQuant cache append + fused and unfused attend (the vector kernel, and the
tensor-core kernel at D = 64 to 512). Exits non-zero on a wrong
result."""
import sys

import numpy as np

import pyfa
from pyfa import reference

dev = pyfa.Device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
rng = np.random.default_rng(0)
failures = []
# Max-abs bounds on outputs of size ~1: the output's own rounding (f16 2^-11,
# bf16 2^-8 relative) plus f32 accumulation; f32 I/O stays near 1e-6.
TOL = {np.dtype(np.float32): 1e-4, np.dtype(np.float16): 4e-3, np.dtype(pyfa.bfloat16): 1e-2}


def check(name, got, ref, tol):
    e = float(np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64)).max())
    ok = np.isfinite(np.asarray(got, np.float64)).all() and e <= tol
    print(f"{'PASS' if ok else 'FAIL'} {name}: max|err| = {e:.3g} (bound {tol:g})")
    if not ok:
        failures.append(name)


for D, dtype in [(128, pyfa.bfloat16), (64, np.float16), (96, np.float32), (512, np.float16)]:
    qL, kL = 70, 133
    q = rng.standard_normal((1, 4, qL, D)).astype(dtype)
    k = rng.standard_normal((1, 2, kL, D)).astype(dtype)
    v = rng.standard_normal((1, 2, kL, D)).astype(dtype)
    mask = rng.random((qL, kL)) > 0.3
    for kw in ({"causal": True, "window": 40, "softcap": 20.0}, {"mask": mask}):
        o, lse = pyfa.attention(q, k, v, return_lse=True, device=dev, **kw)
        ro, rlse = reference.attention(q, k, v, return_lse=True, **kw)
        check(f"prefill D={D} {np.dtype(dtype)} {sorted(kw)}", o, ro, TOL[np.dtype(dtype)])
    oa, la = pyfa.attention(q, k[:, :, :60], v[:, :, :60], return_lse=True, device=dev)
    ob, lb = pyfa.attention(q, k[:, :, 60:], v[:, :, 60:], return_lse=True, device=dev)
    o, lse = pyfa.merge_attention_states(oa, la, ob, lb, device=dev)
    check(f"merge D={D} {np.dtype(dtype)}", o, reference.attention(q, k, v), 2 * TOL[np.dtype(dtype)])

try:
    # the vector kernel (4/3 bits), then the tensor-core kernel (4/4) at every head dim
    for kb, vb, D in [(4, 3, 128), (4, 4, 64), (4, 4, 128), (4, 4, 256), (4, 4, 512)]:
        cache = pyfa.TurboQuantKVCache(2, D, 256, k_bits=kb, v_bits=vb, device=dev)
        cache.append(rng.standard_normal((200, 2, D)).astype(np.float32),
                     rng.standard_normal((200, 2, D)).astype(np.float32))
        q = rng.standard_normal((8, D)).astype(np.float32)
        a, b = cache.attend(q, fused=True), cache.attend(q, fused=False)
        kd, vd = cache.dequantize()
        check(f"turboquant {kb}/{vb} bits D={D} fused == unfused", a, b, 0.0)
        check(f"turboquant {kb}/{vb} bits D={D} vs dense on dequantized K/V", a,
              reference.decode_attention(q, kd.transpose(1, 0, 2), vd.transpose(1, 0, 2), 200), 1e-4)
except pyfa.UnsupportedError as e:
    print(f"TurboQuant skipped: {e}")
print(f"small prefill/merge/TurboQuant on {dev.backend}: {len(failures)} failed")
sys.exit(1 if failures else 0)
