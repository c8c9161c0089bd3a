"""Small prefill, merge and TurboQuant cases on the CUDA device, for
compute-sanitizer (memcheck, racecheck): masks with blk, causal + window,
softcap, LSE, GQA, an odd length, the f32 path, D = 512; merge of two halves; a
TurboQuant cache append + fused and unfused attend of a split (the vector
kernel, and the tensor-core kernel at D = 64 to 512; the fused one merges and
undoes in its last workgroups). Exits non-zero on a wrong result."""
import sys
from pathlib import Path

import numpy as np

import pyfa
from pyfa import reference

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import tq_contract  # noqa: E402

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


# 133 keys: one or two key tiles; 700 and 600: rings of K and V stages that
# refill many times (D 128: 6 tiles of 128 keys, D 256: 10 of 64), which
# racecheck sees reused.
for D, dtype, qL, kL in [(128, pyfa.bfloat16, 70, 133), (64, np.float16, 70, 133), (96, np.float32, 70, 133),
                         (512, np.float16, 70, 133), (128, pyfa.bfloat16, 200, 700), (256, np.float16, 130, 600)]:
    q = rng.standard_normal((1, 4, qL, D)).astype(dtype)
    k = rng.standard_normal((1, 2, kL, D)).astype(dtype)
    v = rng.standard_normal((1, 2, kL, D)).astype(dtype)
    mask = rng.random((qL, kL)) > 0.3
    for kw in ({}, {"causal": True, "window": 40, "softcap": 20.0}, {"mask": mask}):
        o, lse = pyfa.attention(q, k, v, return_lse=True, device=dev, **kw)
        ro, rlse = reference.attention(q, k, v, return_lse=True, **kw)
        check(f"prefill D={D} {np.dtype(dtype)} {sorted(kw)}", o, ro, TOL[np.dtype(dtype)])
    oa, la = pyfa.attention(q, k[:, :, :60], v[:, :, :60], return_lse=True, device=dev)
    ob, lb = pyfa.attention(q, k[:, :, 60:], v[:, :, 60:], return_lse=True, device=dev)
    o, lse = pyfa.merge_attention_states(oa, la, ob, lb, device=dev)
    check(f"merge D={D} {np.dtype(dtype)}", o, reference.attention(q, k, v), 2 * TOL[np.dtype(dtype)])

try:
    # the vector kernel (4/3 bits), then the tensor-core kernel (4/4) at every head dim
    # (query heads 8: four a KV head, a warp merges a row; 4 and 2: two warps, the whole block)
    for kb, vb, D, H in [(4, 3, 128, 8), (4, 4, 64, 8), (4, 4, 128, 8), (4, 4, 256, 8), (4, 4, 512, 8),
                         (4, 4, 128, 4), (4, 4, 256, 2)]:
        cache = pyfa.TurboQuantKVCache(2, D, 256, k_bits=kb, v_bits=vb, device=dev)
        cache.append(rng.standard_normal((200, 2, D)).astype(np.float32),
                     rng.standard_normal((200, 2, D)).astype(np.float32))
        q = rng.standard_normal((H, D)).astype(np.float32)
        a, b = cache.attend(q, fused=True, nwg=3), cache.attend(q, fused=False, nwg=3)
        check(f"turboquant {kb}/{vb} bits D={D} H={H} fused == unfused", a, b, 0.0)
        # against the dequantized rows of the f32 codebook or of its f16 rounding (tests/tq_contract.py)
        refs = tq_contract.cache_references(cache, q)
        err = [float(np.abs(a - r).max()) for r in refs]
        check(f"turboquant {kb}/{vb} bits D={D} H={H} vs dense on dequantized K/V", a, refs[int(np.argmin(err))], 1e-4)
except pyfa.UnsupportedError as e:
    print(f"TurboQuant skipped: {e}")
print(f"small prefill/merge/TurboQuant on {dev.backend}: {len(failures)} failed")
sys.exit(1 if failures else 0)
