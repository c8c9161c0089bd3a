"""Decode outputs in f32 / f16 / bf16 and the decode LSE (flash_attn_vec and
its reduce), against the float64 reference, on the direct path (nwg == 1)
and the split path (nwg > 1, reduce).

Tolerances. Outputs: test_decode.py's f32 TOL plus the rounding of the
output type (HALF_ULP there). LSE: lse = M + log(S) in f32; the scores are
f32 dot products (relative error ~sqrt(D) 6e-8 on scores of a few units) and
S a sum of f32 exponentials (relative ~1e-6), so |lse - ref| stays near 1e-6
(1 + |ref|); 1e-4 (1 + |ref|) leaves margin while a wrong LSE (log2 for ln,
the max left out, the scale missing) is off by far more than 0.1.
"""
import numpy as np
import pytest

import pyfa
from pyfa import _io, reference
from pyfa._native import ffi, lib
from pyfa.errors import check as check_status
from test_decode import HALF_ULP, TOL, check, make

FLOATS = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(pyfa.bfloat16)]


def check_lse(lse, ref_lse):
    """An LSE of the reference's shape: -inf exactly where the reference's is, close elsewhere."""
    assert lse.dtype == np.float32 and lse.shape == ref_lse.shape
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)) and not np.isnan(lse).any()
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=0, atol=1e-4 * (1 + np.abs(ref_lse[fin]).max(initial=0)))


def check_rounded_once(out, out32):
    """out (f16 / bf16) is out32 rounded to nearest even: numpy's astype rounds the same way. Separate
    kernels may differ in the last f32 bit, which can flip a rounding now and then (never more than one
    ulp); truncation or double rounding would miss on about half of the elements."""
    rounded = out32.astype(out.dtype)
    assert np.mean(out == rounded) >= 0.99
    ulp = np.spacing(np.abs(rounded)).astype(np.float64)
    assert (np.abs(out.astype(np.float64) - rounded.astype(np.float64)) <= ulp).all()


def decode_nwg(device, q, k, v, lens, nwg, out_dtype, with_lse=True, rings=None, **params):
    """One decode through the C ABI with an explicit workgroup count; returns (out, lse or None)."""
    B, H, D = q.shape
    fields = {"batch": B, "num_heads": H, "num_kv_heads": k.shape[1], "head_dim": D, "kv_capacity": k.shape[2],
              "nwg": nwg, "scale": 1.0 / np.sqrt(D), **params}
    p = ffi.new("pyfa_flash_attn_vec_params *", fields)
    tmp_bytes = ffi.new("uint64_t *")
    check_status(lib.pyfa_flash_attn_vec_plan(device.handle, p, pyfa.dtypes.code(k.dtype), k.shape[2], tmp_bytes))
    rings = np.zeros(B, np.int32) if rings is None else np.asarray(rings, np.int32)
    bufs = [_io.to_device(device, a) for a in (q, k, v, np.asarray(lens, np.int32), rings)]
    tmp = device.buffer((max(1, tmp_bytes[0] // 4),), np.float32)
    out = device.buffer((B, H, D), out_dtype)
    lse = device.buffer((B, H), np.float32) if with_lse else None
    enc = device.encoder()
    check_status(lib.pyfa_flash_attn_vec(enc, p, *(b.handle for b in bufs), tmp.handle, out.handle, _io.handle(lse)))
    check_status(lib.pyfa_encoder_commit(enc))
    check_status(lib.pyfa_encoder_wait(enc))
    return out.read(), lse.read() if with_lse else None


@pytest.mark.parametrize("nwg", [1, 3])
@pytest.mark.parametrize("kv_dtype", [np.float16, pyfa.bfloat16, np.float32])
def test_every_output_dtype_on_both_paths(device, rng, kv_dtype, nwg):
    q, k, v = make(rng, 2, 8, 2, 128, 200, kv_dtype)
    lens, opts = [200, 77], dict(window=150, softcap=20.0)
    ref, ref_lse = reference.decode_attention(q, k, v, lens, return_lse=True, ring_start=[9, 0], **opts)
    out32, lse32 = decode_nwg(device, q, k, v, lens, nwg, np.float32, rings=[9, 0], **opts)
    check(out32, ref)
    check_lse(lse32, ref_lse)
    for dt in FLOATS[1:]:
        out, lse = decode_nwg(device, q, k, v, lens, nwg, dt, rings=[9, 0], **opts)
        check(out, ref, dtype=dt)
        check_rounded_once(out, out32)
        check_lse(lse, ref_lse)


@pytest.mark.parametrize("D", pyfa.supported("head_dims"))
@pytest.mark.parametrize("group", [1, 12])
def test_lse_head_dims_and_groups(device, rng, D, group):
    # 12 query heads per KV head take the CUDA tensor-core decode in a pass of 8 heads, then 4.
    q, k, v = make(rng, 1, 2 * group, 2, D, 300, np.float16, np.float16)
    out, lse = pyfa.decode_attention(q, k, v, 257, return_lse=True, device=device)
    ref, ref_lse = reference.decode_attention(q, k, v, 257, return_lse=True)
    check(out, ref, dtype=np.float16)
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("out_dtype", [None, "float32", np.float16, pyfa.bfloat16])
def test_python_api_output_dtype_and_lse_shapes(device, rng, out_dtype):
    q, k, v = make(rng, 2, 4, 2, 64, 40, np.float16, pyfa.bfloat16)
    want = np.dtype(pyfa.bfloat16) if out_dtype is None else np.dtype(out_dtype)
    out = pyfa.decode_attention(q, k, v, [40, 3], out_dtype=out_dtype, device=device)
    assert out.dtype == want
    out2, lse = pyfa.decode_attention(q[0], k[0], v[0], 3, out_dtype=out_dtype, return_lse=True, device=device)
    assert out2.dtype == want and out2.shape == (4, 64) and lse.shape == (4,)
    ref, ref_lse = reference.decode_attention(q[0], k[0], v[0], 3, return_lse=True)
    check(out2, ref, dtype=want)
    check_lse(lse, ref_lse)
    filled = np.full((2, 4, 64), np.nan, want)
    assert pyfa.decode_attention(q, k, v, [40, 3], out=filled, out_dtype=out_dtype, device=device) is filled
    check(filled, reference.decode_attention(q, k, v, [40, 3]), dtype=want)


@pytest.mark.parametrize("qdtype,out_dtype", [(np.float32, np.float32), (np.float16, np.float32),
                                              (pyfa.bfloat16, pyfa.bfloat16)])
def test_split_cache_merges_into_whole(device, rng, qdtype, out_dtype):
    """Split-KV / cascade use: decode each half of a cache with its LSE, merge, and get one decode over the
    whole cache. Halves in bf16 carry their rounding (HALF_ULP) into the merge, which rounds again."""
    cap, split = 300, 130
    q, k, v = make(rng, 2, 8, 2, 128, cap, np.float16, qdtype)
    halves = [pyfa.decode_attention(q, k[:, :, s], v[:, :, s], n, out_dtype=out_dtype, return_lse=True,
                                    device=device)
              for s, n in ((slice(0, split), split), (slice(split, cap), cap - split))]
    (o_a, l_a), (o_b, l_b) = halves
    o, lse = pyfa.merge_attention_states(o_a[:, :, None], l_a[:, :, None], o_b[:, :, None], l_b[:, :, None],
                                         out_dtype=np.float32, device=device)
    whole, whole_lse = pyfa.decode_attention(q, k, v, cap, out_dtype=np.float32, return_lse=True, device=device)
    rounding = 2 * HALF_ULP[np.dtype(out_dtype)] * np.abs(whole).max()
    np.testing.assert_allclose(o[:, :, 0], whole, atol=TOL + rounding, rtol=0)
    np.testing.assert_allclose(lse[:, :, 0], whole_lse, atol=1e-4 * (1 + np.abs(whole_lse).max()), rtol=0)
    ref, ref_lse = reference.decode_attention(q, k, v, cap, return_lse=True)
    check(o[:, :, 0], ref, tol=TOL + rounding)
    check_lse(lse[:, :, 0], ref_lse)


def _record_then_change_lengths(device, q, k, v, nwg, out_dtype, valid, at_run):
    """Records a decode with kv_len `valid` (the host rule: 1..capacity), then rewrites the lengths buffer
    to `at_run` before the commit: kv_len is read when the dispatch runs, so the kernels see `at_run`."""
    B, H, D = q.shape
    p = ffi.new("pyfa_flash_attn_vec_params *", {"batch": B, "num_heads": H, "num_kv_heads": k.shape[1],
                                                 "head_dim": D, "kv_capacity": k.shape[2], "nwg": nwg,
                                                 "scale": 0.125})
    lens = device.buffer((B,), np.int32, storage="private")
    lens.write(np.asarray(valid, np.int32))
    bufs = [_io.to_device(device, a) for a in (q, k, v)]
    rings = _io.to_device(device, np.zeros(B, np.int32))
    tmp = device.buffer((max(1, B * H * nwg * (D + 2)),), np.float32)
    out, lse = device.buffer((B, H, D), out_dtype), device.buffer((B, H), np.float32)
    enc = device.encoder()
    check_status(lib.pyfa_flash_attn_vec(enc, p, *(b.handle for b in bufs), lens.handle, rings.handle, tmp.handle,
                                         out.handle, lse.handle))
    lens.write(np.asarray(at_run, np.int32))
    check_status(lib.pyfa_encoder_commit(enc))
    check_status(lib.pyfa_encoder_wait(enc))
    return out.read(), lse.read()


@pytest.mark.parametrize("nwg", [1, 4])
@pytest.mark.parametrize("out_dtype", [np.float32, np.float16])
def test_rows_without_keys_are_zero_with_lse_minus_inf(device, rng, nwg, out_dtype):
    """kv_len 0 (and a negative kv_len, clamped to 0) reaching the kernel as a device value: out 0, lse -inf."""
    q, k, v = make(rng, 3, 4, 2, 64, 32, np.float16)
    out, lse = _record_then_change_lengths(device, q, k, v, nwg, out_dtype, [32, 5, 9], [20, 0, -7])
    assert not np.isnan(out.astype(np.float32)).any() and not np.isnan(lse).any()
    assert (out[1:] == 0).all() and np.isneginf(lse[1:]).all()
    ref, ref_lse = reference.decode_attention(q[:1], k[:1], v[:1], 20, scale=0.125, return_lse=True)
    check(out[:1], ref, dtype=out_dtype)
    check_lse(lse[:1], ref_lse)
