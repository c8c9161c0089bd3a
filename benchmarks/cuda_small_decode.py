"""A small decode on the CUDA device, for compute-sanitizer (memcheck,
racecheck): split (nwg > 1, reduce pass) and direct (nwg == 1) paths, GQA
groups of 2 (vector kernel) and 4 (tensor-core kernel for 16-bit caches), a
ring buffer, a window, softcap, 16-bit and f32 caches; paged decode over
shuffled NHD and HND pools (the tensor-core kernel's tile-ahead block_table
loads); with torch, the same dense cases on torch tensors, through a plan whose
split merges in its last workgroups (tickets). Exits non-zero on a wrong result."""
import sys

import numpy as np

import pyfa
from pyfa import reference

dev = pyfa.Device("cuda")
try:
    import torch

    torch_dtypes = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32,
                    np.dtype(pyfa.bfloat16): torch.bfloat16}
    if not torch.cuda.is_available():
        torch = None
except ImportError:
    torch = None
rng = np.random.default_rng(0)
worst = 0.0
for H, D, dtype, kw in [(8, 128, np.float16, {}), (8, 256, pyfa.bfloat16, {"window": 100, "softcap": 30.0}),
                        (8, 80, np.float32, {}), (8, 512, np.float16, {}), (4, 128, np.float16, {})]:
    q = rng.standard_normal((2, H, D)).astype(np.float32)
    k = rng.standard_normal((2, 2, 1024, D)).astype(dtype)
    v = rng.standard_normal((2, 2, 1024, D)).astype(dtype)
    for lens, ring in [([1024, 1024], [0, 37]), ([700, 3], 0)]:
        out = pyfa.decode_attention(q, k, v, lens, ring_start=ring, device=dev, **kw)
        ref = reference.decode_attention(q, k, v, lens, ring_start=ring, **kw)
        worst = max(worst, float(np.abs(out - ref).max()))
        if torch is not None:
            t = lambda a: torch.from_numpy(np.asarray(a, np.float32)).to(torch_dtypes[np.dtype(dtype)]).cuda()  # noqa: E731
            for _ in range(2):  # the second finds the tickets as the first left them
                out, lse = pyfa.decode_attention(t(q.astype(dtype)), t(k), t(v), torch.tensor(lens, dtype=torch.int32,
                                                 device="cuda"), ring_start=torch.tensor(ring if isinstance(ring, list)
                                                 else [ring] * 2, dtype=torch.int32, device="cuda"), device=dev,
                                                 out_dtype=np.float32, return_lse=True, **kw)
            ref = reference.decode_attention(q.astype(dtype), k, v, lens, ring_start=ring, **kw)
            worst = max(worst, float(np.abs(out.cpu().numpy() - ref).max()))
for layout in ("nhd", "hnd"):
    H, Hkv, D, ps = 8, 2, 128, 16
    q = rng.standard_normal((2, H, D)).astype(np.float32)
    k = rng.standard_normal((2, Hkv, 1024, D)).astype(np.float16)
    v = rng.standard_normal((2, Hkv, 1024, D)).astype(np.float16)
    table = rng.permutation(2 * 1024 // ps).reshape(2, -1).astype(np.int32)
    pools = []
    for c in (k, v):  # page table[b, i] holds positions i*ps.. of sequence b
        blocks = c.reshape(2, Hkv, -1, ps, D).transpose(0, 2, 3, 1, 4)  # [B, pages, ps, Hkv, D]
        pool = np.empty((2 * 1024 // ps, ps, Hkv, D), np.float16)
        pool[table] = blocks
        pools.append(pool if layout == "nhd" else np.ascontiguousarray(pool.transpose(0, 2, 1, 3)))
    for lens in ([1024, 1024], [700, 3]):
        out = pyfa.paged_decode_attention(q, pools[0], pools[1], table, lens, page_layout=layout, device=dev)
        ref = reference.decode_attention(q, k, v, lens)
        worst = max(worst, float(np.abs(out - ref).max()))
print(f"small decode: max |out - ref| = {worst:.3g}")
sys.exit(0 if worst < 1e-4 else 1)
