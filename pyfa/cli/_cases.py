"""The cases of `python -m pyfa check`: every op at small shapes over each
dtype, each compared with pyfa.reference (float64) by a Measure (_measure.py
states the bounds and where they come from).

A case is (label, function); the function takes (device, rng) and returns
its Measures. `cases(full)` lists them: the default set touches every op,
dtype and option at a few shapes; `full` adds every head dim, GQA group,
window / ring combination and the test suite's shape table.
"""
from __future__ import annotations

import functools

import numpy as np

import pyfa
from pyfa import _args, reference

from . import _measure as M

FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(pyfa.bfloat16))


def _normal(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


# ---- decode ---------------------------------------------------------------------------------------

def decode(device, rng, dt, B, H, Hkv, D, cap, lens, q_dtype=np.float32, out_dtype=None, q_scale=1.0, **kw):
    """decode_attention with K/V of dtype `dt` (row dt), its output and LSE."""
    q = _normal(rng, (B, H, D), q_dtype, q_scale)
    k, v = _normal(rng, (B, Hkv, cap, D), dt), _normal(rng, (B, Hkv, cap, D), dt)
    out, got_lse = pyfa.decode_attention(q, k, v, lens, out_dtype=out_dtype, return_lse=True, device=device, **kw)
    ref, ref_lse = reference.decode_attention(q, k, v, lens, return_lse=True, **kw)
    row = M.SHORT[np.dtype(dt)]
    want = np.dtype(out_dtype if out_dtype is not None else q_dtype)
    scale = _args.default_scale(kw.get("scale"), D)
    tol = M.F32_TOL + M.decode_split_bound(q, k, v, scale)
    return [M.output("decode", row, out, ref, want, tol=tol), M.lse("decode lse", row, got_lse, ref_lse)]


def _decode_cases(dt, full):
    name = M.SHORT[dt]
    head_dims = pyfa.supported("head_dims") if full else (64, 128, 256)
    for D in head_dims:
        yield f"decode {name} D={D}", functools.partial(decode, dt=dt, B=1, H=4, Hkv=2, D=D, cap=300, lens=257)
    for group in (1, 2, 4, 8, 12) if full else (1, 4):
        for n in (1, 31, 160) if full else (33,):
            yield (f"decode {name} GQA {group} kv_len={n}",
                   functools.partial(decode, dt=dt, B=1, H=2 * group, Hkv=2, D=64, cap=160, lens=n))
    for window, ring in ((1, 0), (7, 1), (64, 77), (500, 199)) if full else ((64, 77),):
        yield (f"decode {name} window={window} ring={ring} softcap",
               functools.partial(decode, dt=dt, B=1, H=4, Hkv=2, D=96, cap=200, lens=200, window=window,
                                 ring_start=ring, softcap=30.0, q_scale=4.0))
    yield (f"decode {name} batch of 4",
           functools.partial(decode, dt=dt, B=4, H=8, Hkv=2, D=128, cap=96, lens=[96, 1, 50, 96],
                             ring_start=[5, 0, 0, 95], window=20, scale=0.3))
    yield (f"decode {name} split over 2000 keys",
           functools.partial(decode, dt=dt, B=1, H=8, Hkv=2, D=128, cap=2048, lens=2000))
    # Output dtypes: q in the cache's dtype gives that output (one rounding); out_dtype=f32 skips it.
    pairs = ((dt, None), (dt, np.float32), (np.float32, dt)) if dt != np.float32 else ((dt, None),)
    for q_dtype, out_dtype in pairs:
        yield (f"decode {name} q {M.SHORT[np.dtype(q_dtype)]} out {M.SHORT[np.dtype(out_dtype or q_dtype)]}",
               functools.partial(decode, dt=dt, B=2, H=8, Hkv=4, D=128, cap=96, lens=[96, 40], q_dtype=q_dtype,
                                 out_dtype=out_dtype))


# ---- prefill and merge ----------------------------------------------------------------------------

def _prefill_inputs(rng, dt, B, H, Hkv, qL, kL, D, layout):
    def arr(h, n):
        return _normal(rng, (B, h, n, D) if layout == "bhsd" else (B, n, h, D), dt)
    return arr(H, qL), arr(Hkv, kL), arr(Hkv, kL)


def prefill(device, rng, dt, B, H, Hkv, qL, kL, D, layout="bhsd", mask=None, out_dtype=None, **kw):
    """attention in dtype `dt`; `mask`: None, "bool" or "additive" (random, rank 2, some rows all blocked)."""
    q, k, v = _prefill_inputs(rng, dt, B, H, Hkv, qL, kL, D, layout)
    if mask is not None:
        allowed = rng.random((qL, kL)) > 0.3
        allowed[::7] = False  # rows that see no key: zeros and an LSE of -inf
        kw["mask"] = allowed if mask == "bool" else np.where(allowed, rng.standard_normal((qL, kL)), -np.inf).astype(dt)
    out, got_lse = pyfa.attention(q, k, v, layout=layout, out_dtype=out_dtype, return_lse=True, device=device, **kw)
    ref, ref_lse = reference.attention(q, k, v, layout=layout, return_lse=True, **kw)
    row = M.SHORT[np.dtype(dt)]
    want = np.dtype(out_dtype if out_dtype is not None else dt)
    in_dtype = None if np.dtype(dt) == np.float32 else reference.attention(q, k, v, layout=layout, rounding=dt, **kw)
    return [M.output("prefill", row, out, ref, want, ref_in_dtype=in_dtype),
            M.lse("prefill lse", row, got_lse, ref_lse)]


# (B, H, Hkv, qL, kL, D, layout, causal), tests/test_prefill.py SHAPES: GQA ratios, both layouts,
# odd lengths, q_len < kv_len and q_len > kv_len (bottom-right causal: early rows see no key).
PREFILL_SHAPES = [
    (1, 1, 1, 1, 1, 64, "bhsd", True), (2, 2, 1, 7, 31, 128, "bshd", True), (1, 4, 1, 31, 7, 96, "bhsd", True),
    (1, 8, 1, 65, 127, 64, "bhsd", False), (2, 8, 2, 129, 33, 80, "bshd", False),
    (1, 4, 4, 127, 129, 192, "bshd", True), (1, 2, 2, 400, 400, 64, "bshd", True),
    (1, 2, 1, 33, 400, 256, "bhsd", True), (1, 8, 4, 129, 65, 128, "bshd", True), (1, 2, 1, 7, 129, 512, "bhsd", True),
]
QUICK_PREFILL_SHAPES = [PREFILL_SHAPES[i] for i in (1, 2, 4)]


def _prefill_cases(dt, full):
    name = M.SHORT[dt]
    for D in pyfa.supported("head_dims") if full else (64, 128):
        yield f"prefill {name} D={D} causal", functools.partial(
            prefill, dt=dt, B=1, H=2, Hkv=1, qL=33, kL=65, D=D, causal=True)
    for B, H, Hkv, qL, kL, D, layout, causal in PREFILL_SHAPES if full else QUICK_PREFILL_SHAPES:
        yield (f"prefill {name} {B}x{H}/{Hkv}x{qL}x{kL}x{D} {layout}{' causal' if causal else ''}",
               functools.partial(prefill, dt=dt, B=B, H=H, Hkv=Hkv, qL=qL, kL=kL, D=D, layout=layout, causal=causal))
    for mask in ("bool", "additive"):
        yield f"prefill {name} {mask} mask", functools.partial(
            prefill, dt=dt, B=1, H=4, Hkv=2, qL=40, kL=70, D=64, mask=mask)
    yield f"prefill {name} window softcap bshd", functools.partial(
        prefill, dt=dt, B=2, H=4, Hkv=2, qL=70, kL=90, D=128, layout="bshd", causal=True, window=40, softcap=10.0)
    if dt != np.float32:
        yield f"prefill {name} out f32", functools.partial(
            prefill, dt=dt, B=1, H=4, Hkv=2, qL=50, kL=60, D=128, causal=True, out_dtype=np.float32)


def merge(device, rng, dt, B, H, L, D, split, layout="bhsd", out_dtype=None):
    """Two prefill parts over keys [0, split) and [split, ...), merged; against the reference merge of the
    same parts. One row of part b sees no key (LSE -inf) to exercise the empty-part rule."""
    q, k, v = _prefill_inputs(rng, dt, B, H, H, L, 2 * L, D, layout)
    before = (slice(None),) * (2 if layout == "bhsd" else 1)  # the key axis is 2 in bhsd, 1 in bshd
    a, b = before + (slice(0, split),), before + (slice(split, None),)
    o_a, l_a = pyfa.attention(q, k[a], v[a], layout=layout, return_lse=True, device=device)
    o_b, l_b = pyfa.attention(q, k[b], v[b], layout=layout, return_lse=True, device=device)
    l_b[0, 0, 0] = -np.inf
    o, got_lse = pyfa.merge_attention_states(o_a, l_a, o_b, l_b, layout=layout, out_dtype=out_dtype, device=device)
    m_ref, m_lse = reference.merge_attention_states(o_a, l_a, o_b, l_b, layout=layout)
    row = M.SHORT[np.dtype(dt)]
    want = np.dtype(out_dtype if out_dtype is not None else dt)
    return [M.output("merge", row, o, m_ref, want, tol=M.MERGE_TOL),
            M.lse("merge lse", row, got_lse, m_lse, tol=M.MERGE_TOL, relative=False)]


def _merge_cases(dt, full):
    name = M.SHORT[dt]
    yield f"merge {name} bhsd", functools.partial(merge, dt=dt, B=2, H=4, L=33, D=64, split=20)
    yield f"merge {name} bshd", functools.partial(merge, dt=dt, B=1, H=4, L=17, D=128, split=9, layout="bshd")
    if dt != np.float32 or full:
        yield f"merge {name} out f32", functools.partial(merge, dt=dt, B=1, H=2, L=9, D=64, split=4,
                                                         out_dtype=np.float32)


# ---- caches ---------------------------------------------------------------------------------------

def kv_cache(device, rng, dt, Hkv, D, cap, chunks, H, window=None, q_dtype=np.float32, softcap=0.0):
    """KVCache of dtype `dt`: appends in `chunks`, attends; against the reference over the stored rows
    (rounded to dt), the last `window` of them for a sliding window."""
    n = sum(chunks)
    k, v = rng.standard_normal((n, Hkv, D)), rng.standard_normal((n, Hkv, D))
    cache = pyfa.KVCache(Hkv, D, cap, dtype=dt, sliding_window=window, device=device)
    start = 0
    for size in chunks:
        cache.append(k[start:start + size], v[start:start + size])
        start += size
    q = _normal(rng, (H, D), q_dtype)
    out, got_lse = cache.attend(q, softcap=softcap, return_lse=True)
    seen = min(n, window or cap)
    stored = [x[n - seen:].astype(dt).astype(np.float64).transpose(1, 0, 2) for x in (k, v)]
    ref, ref_lse = reference.decode_attention(q, *stored, seen, softcap=softcap, return_lse=True)
    row = M.SHORT[np.dtype(dt)]
    return [M.output("KVCache", row, out, ref, q_dtype), M.lse("KVCache lse", row, got_lse, ref_lse)]


def _kv_cache_cases(dt, full):
    name = M.SHORT[dt]
    n = 900 if full else 300
    yield f"KVCache {name} {n} rows", functools.partial(kv_cache, dt=dt, Hkv=2, D=128, cap=1024,
                                                         chunks=[n // 4] * 4, H=8)
    yield f"KVCache {name} softcap", functools.partial(kv_cache, dt=dt, Hkv=2, D=128, cap=128, chunks=[100],
                                                      H=4, softcap=3.0)
    yield f"KVCache {name} ring window", functools.partial(kv_cache, dt=dt, Hkv=2, D=64, cap=64,
                                                          chunks=[7, 50, 1, 64, 28], H=4, window=64)
    yield f"KVCache {name} q {name}", functools.partial(kv_cache, dt=dt, Hkv=2, D=64, cap=100, chunks=[70], H=4,
                                                        q_dtype=dt)


def turboquant(device, rng, H, Hkv, D, k_bits, v_bits, cap, n, window=None, softcap=0.0, nwg=None):
    """TurboQuantKVCache: append in three parts, attend (fused and not, f32 and bf16 outputs), against the
    reference over the cache's own dequantized rows (test_turboquant.py: the rotated-domain decode is the
    same math as dense decode on those rows)."""
    row = f"k{k_bits}v{v_bits}"
    cache = pyfa.TurboQuantKVCache(Hkv, D, cap, k_bits=k_bits, v_bits=v_bits, seed=42, sliding_window=window,
                                   device=device)
    for chunk in np.array_split(np.arange(n), 3):
        cache.append(rng.standard_normal((len(chunk), Hkv, D)), rng.standard_normal((len(chunk), Hkv, D)))
    q = _normal(rng, (H, D), np.float32, 2.0)
    k, v = cache.dequantize()
    ref, ref_lse = reference.decode_attention(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2), k.shape[0],
                                              softcap=softcap, window=window, return_lse=True)
    found = []
    for fused in (True, False):
        out, got_lse = cache.attend(q, softcap=softcap, fused=fused, nwg=nwg, return_lse=True)
        found += [M.output("TurboQuantKVCache", row, out, ref, np.float32), M.lse("TurboQuant lse", row, got_lse, ref_lse)]
    out = cache.attend(q, softcap=softcap, nwg=nwg, out_dtype=pyfa.bfloat16)
    return found + [M.output("TurboQuantKVCache", row, out, ref, pyfa.bfloat16)]


def turboquant_accuracy(device, rng, trials=2):
    """4-bit K and V, D = 128, 2048 Gaussian rows: attention over the compressed cache against float64
    attention over the original rows. Error 1 - mean cosine, bound 0.015 (test_turboquant.py
    test_attention_accuracy_4bit: mean cosine >= 0.985; 0.990 is typical). This is the case that sees a
    codec that is wrong in a way its own dequantize() shares."""
    cos = []
    for trial in range(trials):
        k, v = rng.standard_normal((2048, 1, 128)), rng.standard_normal((2048, 1, 128))
        q = rng.standard_normal((8, 128)).astype(np.float32)
        cache = pyfa.TurboQuantKVCache(1, 128, 2048, seed=trial, device=device)
        cache.append(k, v)
        out = np.asarray(cache.attend(q), np.float64)
        ref = reference.decode_attention(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2), 2048)
        cos += list(np.sum(out * ref, 1) / (np.linalg.norm(out, axis=1) * np.linalg.norm(ref, axis=1) + 1e-300))
    error = 1.0 - float(np.mean(cos)) if np.isfinite(cos).all() else float("inf")
    return [M.Measure("TurboQuant accuracy", "k4v4", error, 0.015, "1 - mean cosine vs the uncompressed rows")]


# (H, Hkv, D, k_bits, v_bits, capacity, appended, window, softcap, nwg): test_turboquant.py CASES.
TQ_CASES = [
    (8, 2, 128, 4, 4, 700, 700, None, 0.0, None), (4, 4, 64, 2, 8, 300, 300, None, 0.0, 3),
    (6, 2, 256, 3, 2, 256, 613, 200, 0.0, 4), (2, 1, 512, 8, 3, 128, 128, None, 5.0, 2),
    (4, 2, 128, 4, 2, 96, 250, 96, 2.0, 1), (16, 2, 64, 3, 4, 2048, 1500, None, 0.0, 7),
    (24, 2, 256, 4, 4, 300, 700, 250, 3.0, 5), (4, 1, 512, 4, 4, 200, 200, None, 0.0, None),
    (2, 2, 64, 4, 4, 100, 90, None, 0.0, 2),
]
QUICK_TQ_CASES = [TQ_CASES[i] for i in (0, 1, 2, 3)]


def _turboquant_cases(full):
    for H, Hkv, D, kb, vb, cap, n, window, softcap, nwg in TQ_CASES if full else QUICK_TQ_CASES:
        yield (f"TurboQuant k{kb}v{vb} D={D} {n} rows{' window' if window else ''}{' softcap' if softcap else ''}",
               functools.partial(turboquant, H=H, Hkv=Hkv, D=D, k_bits=kb, v_bits=vb, cap=cap, n=n, window=window,
                                 softcap=softcap, nwg=nwg))
    yield "TurboQuant accuracy k4v4", functools.partial(turboquant_accuracy, trials=4 if full else 2)


# ---- kv_append ------------------------------------------------------------------------------------

def kv_append(device, rng, src_dtype, Hkv, cap, D, n, write_pos):
    """The C ABI's kv_append of `n` rows of `src_dtype` into a cache of each float dtype (the row: the
    cache's dtype) at a ring position, read back, against numpy: rows widened to f32, rounded to the
    cache dtype (bit-exact)."""
    from pyfa import _io
    from pyfa._native import ffi, lib
    from pyfa.errors import check as check_status

    src = _normal(rng, (n, Hkv, D), src_dtype, 10.0)
    found = []
    for cache_dtype in FLOATS:
        sentinel = np.full((Hkv, cap, D), 7.0, cache_dtype)
        cache = device.buffer(sentinel.shape, cache_dtype, storage="private")
        cache.write(sentinel)
        params = ffi.new("pyfa_kv_append_params *", dict(num_tokens=n, num_kv_heads=Hkv, head_dim=D,
                                                         kv_capacity=cap, write_pos=write_pos, sequence=0))
        source = _io.to_device(device, src)
        enc = device.encoder()
        check_status(lib.pyfa_kv_append(enc, params, source.handle, cache.handle))
        check_status(lib.pyfa_encoder_commit(enc))
        check_status(lib.pyfa_encoder_wait(enc))
        want = sentinel.copy()
        for i, row in enumerate(src):
            want[:, (write_pos + i) % cap] = row.astype(np.float32).astype(cache_dtype)
        found.append(M.exact("kv_append", M.SHORT[cache_dtype], cache.read(), want))
    return found


def _kv_append_cases(dt, full):
    yield f"kv_append {M.SHORT[dt]} wrap-around", functools.partial(kv_append, src_dtype=dt, Hkv=3, cap=11, D=128,
                                                                      n=7, write_pos=8)
    if full:
        yield f"kv_append {M.SHORT[dt]} full ring", functools.partial(kv_append, src_dtype=dt, Hkv=2, cap=5, D=64,
                                                                        n=5, write_pos=3)


def cases(full: bool = False) -> list[tuple[str, object]]:
    """(label, function(device, rng) -> [Measure]) for every case, grouped by op."""
    found = []
    for family in (_decode_cases, _prefill_cases, _merge_cases, _kv_cache_cases, _kv_append_cases):
        for dt in FLOATS:
            found += list(family(dt, full))
    return found + list(_turboquant_cases(full))
