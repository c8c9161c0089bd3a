"""TurboQuant decode outputs in f32 / f16 / bf16 and its LSE, on the direct
path (nwg == 1, the undo stores out), the unfused split path (reduce, then
the undo) and the fused reduce + undo, against the float64 reference over
the cache's dequantized rows.

Tolerances: test_turboquant.py's 2e-5 for the rotated-domain decode (float32
rotations and dots), plus the rounding of the output type (HALF_ULP,
test_decode.py), against either codebook rounding the contract allows
(tq_contract.py). The rotation is orthogonal, so the rotated-domain scores
equal the original-domain ones and the LSE is compared with the reference's
over the dequantized rows, within test_decode_outputs.py's bound.
"""
import numpy as np
import pytest

import pyfa
from pyfa import _io
from pyfa._native import ffi, lib
from pyfa.errors import check as check_status
from test_decode_outputs import FLOATS, check_lse, check_rounded_once
from tq_contract import cache_references, check

TQ_TOL = 2e-5
TAILS = [(1, True), (3, False), (3, True)]  # (nwg, fused): direct, reduce + undo, fused reduce + undo


def filled_cache(device, rng, Hkv, D, cap, n, bits=(4, 4), window=None):
    cache = pyfa.TurboQuantKVCache(Hkv, D, cap, k_bits=bits[0], v_bits=bits[1], seed=11, sliding_window=window,
                                   device=device)
    for part in np.array_split(np.arange(n), 2):
        cache.append(rng.standard_normal((len(part), Hkv, D)), rng.standard_normal((len(part), Hkv, D)))
    return cache


def dense_refs(cache, q, **kw):
    """(outs, lse): float64 attention over the cache's dequantized rows, an output per codebook
    rounding (tq_contract.py), and the LSE over the f32 codebook's rows."""
    refs = cache_references(cache, q, return_lse=True, **kw)
    return [o for o, _ in refs], refs[0][1]


@pytest.mark.parametrize("nwg,fused", TAILS)
@pytest.mark.parametrize("bits", [(4, 4), (3, 8)])
def test_every_output_dtype_and_lse_on_every_tail(device, rng, nwg, fused, bits):
    # (4, 4) takes CUDA's tensor-core TurboQuant decode, (3, 8) the vector one; a wrapped ring with a window.
    cache = filled_cache(device, rng, 2, 128, 256, 400, bits, window=200)
    q = rng.standard_normal((6, 128)).astype(np.float32) * 2
    ref, ref_lse = dense_refs(cache, q, softcap=8.0)
    out32, lse32 = cache.attend(q, softcap=8.0, nwg=nwg, fused=fused, return_lse=True)
    check(out32, ref, tol=TQ_TOL)
    check_lse(lse32, ref_lse)
    for dt in FLOATS[1:]:
        out, lse = cache.attend(q, softcap=8.0, nwg=nwg, fused=fused, out_dtype=dt, return_lse=True)
        check(out, ref, tol=TQ_TOL, dtype=dt)
        check_rounded_once(out, out32)
        check_lse(lse, ref_lse)


@pytest.mark.parametrize("qdtype", [np.float16, pyfa.bfloat16, np.float64])
def test_default_output_dtype_and_empty_cache(device, rng, qdtype):
    """Default out dtype: q's (float64 q is read as float32). An empty cache: zeros and LSE -inf."""
    want = np.dtype(np.float32) if qdtype == np.float64 else np.dtype(qdtype)
    cache = pyfa.TurboQuantKVCache(2, 64, 16, device=device)
    q = rng.standard_normal((4, 64)).astype(qdtype)
    out, lse = cache.attend(q, return_lse=True)
    assert out.dtype == want and out.shape == (4, 64) and (out == 0).all()
    assert lse.dtype == np.float32 and lse.shape == (4,) and np.isneginf(lse).all()
    cache.append(rng.standard_normal((5, 2, 64)), rng.standard_normal((5, 2, 64)))
    out = cache.attend(q)
    assert out.dtype == want
    check(out, dense_refs(cache, q.astype(np.float32))[0], tol=TQ_TOL, dtype=want)


def test_split_caches_merge_into_whole(device, rng):
    """Two caches holding the two halves of the rows (codes are a pure function of the row) decode and merge
    into one decode over a cache of all the rows."""
    k, v = rng.standard_normal((2, 300, 2, 128))
    q = rng.standard_normal((8, 128)).astype(np.float32)
    whole = pyfa.TurboQuantKVCache(2, 128, 300, device=device)
    whole.append(k, v)
    parts = []
    for s in (slice(0, 110), slice(110, 300)):
        c = pyfa.TurboQuantKVCache(2, 128, 300, device=device)
        c.append(k[s], v[s])
        parts.append(c.attend(q, return_lse=True))
    (o_a, l_a), (o_b, l_b) = parts
    o, lse = pyfa.merge_attention_states(o_a[None, :, None], l_a[None, :, None], o_b[None, :, None],
                                         l_b[None, :, None], device=device)
    out, out_lse = whole.attend(q, return_lse=True)
    np.testing.assert_allclose(o[0, :, 0], out, atol=TQ_TOL, rtol=0)
    np.testing.assert_allclose(lse[0, :, 0], out_lse, atol=1e-4 * (1 + np.abs(out_lse).max()), rtol=0)


@pytest.mark.parametrize("nwg,fused", TAILS)
def test_rows_without_keys_are_zero_with_lse_minus_inf(device, rng, nwg, fused):
    """kv_len 0 reaching the kernels as a device value (the lengths rewritten after recording)."""
    B, H, Hkv, D, cap = 2, 4, 2, 64, 32
    caches = [filled_cache(device, rng, Hkv, D, cap, cap) for _ in range(B)]
    codes = [device.buffer((B, Hkv, cap, D // 2), np.uint8) for _ in range(2)]
    scales = [device.buffer((B, Hkv, cap), np.float32) for _ in range(2)]
    for stream in range(2):  # the two caches as one batched cache (same seed, so the same rotation)
        codes[stream].write(np.stack([c.codes()[2 * stream] for c in caches]))
        scales[stream].write(np.stack([c.codes()[2 * stream + 1] for c in caches]))
    q = rng.standard_normal((B, H, D)).astype(np.float32)
    p = ffi.new("pyfa_flash_attn_vec_tq_params *", {
        "attn": dict(batch=B, num_heads=H, num_kv_heads=Hkv, head_dim=D, kv_capacity=cap, nwg=nwg, scale=0.125),
        "k_bits": 4, "v_bits": 4, "seed_lo": 11, "fused": int(fused)})
    tmp_bytes = ffi.new("uint64_t *")
    check_status(lib.pyfa_flash_attn_vec_tq_plan(device.handle, p, cap, tmp_bytes))
    tmp = device.buffer((tmp_bytes[0] // 4,), np.float32)
    lens = device.buffer((B,), np.int32, storage="private")
    lens.write(np.array([cap, cap], np.int32))
    qb, rings = _io.to_device(device, q), _io.to_device(device, np.zeros(B, np.int32))
    out, lse = device.buffer((B, H, D), np.float16), device.buffer((B, H), np.float32)
    enc = device.encoder()
    check_status(lib.pyfa_flash_attn_vec_tq(enc, p, qb.handle, codes[0].handle, scales[0].handle, codes[1].handle,
                                            scales[1].handle, lens.handle, rings.handle, tmp.handle, out.handle,
                                            lse.handle))
    lens.write(np.array([cap, 0], np.int32))
    check_status(lib.pyfa_encoder_commit(enc))
    check_status(lib.pyfa_encoder_wait(enc))
    o, l = out.read(), lse.read()
    assert not np.isnan(o.astype(np.float32)).any() and not np.isnan(l).any()
    assert (o[1] == 0).all() and np.isneginf(l[1]).all()
    ref, ref_lse = dense_refs(caches[0], q[0], scale=0.125)
    check(o[0], ref, tol=TQ_TOL, dtype=np.float16)
    check_lse(l[0], ref_lse)
