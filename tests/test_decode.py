"""flash_attn_vec (+ reduce) against the float64 reference."""
import numpy as np
import pytest

import pyfa
from pyfa import reference

# Tolerance on max |out - ref|. out is a convex combination of V rows with
# |v| ~ N(0, 1). The reference reads the same rounded K/V/q values (f16/bf16
# inputs are exact in float64), so the only differences are f32 dot products
# over D <= 512 terms (relative error ~ sqrt(D) * 6e-8 on scores of size ~1)
# and f32 accumulation of up to a few thousand weighted rows: both land near
# 1e-6; 2e-5 leaves margin without hiding a wrong row (errors of a misplaced
# key or a missing rescale are >= 1e-2 here).
TOL = 2e-5
# An f16 / bf16 output is the kernel's f32 result rounded once to nearest
# even: at most half an ulp of the output type from it, i.e. |x| * 2^-11
# (f16: 10 fraction bits) or |x| * 2^-8 (bf16: 7), bounded by the largest
# |x|. Below f16's normal range (2^-14) half an ulp is 2^-25, under TOL.
HALF_ULP = {np.dtype(np.float32): 0.0, np.dtype(np.float16): 2.0**-11, np.dtype(pyfa.bfloat16): 2.0**-8}


def make(rng, B, H, Hkv, D, cap, dtype, qdtype=np.float32):
    q = rng.standard_normal((B, H, D)).astype(qdtype)
    k = rng.standard_normal((B, Hkv, cap, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, cap, D)).astype(dtype)
    return q, k, v


def check(out, ref, tol=TOL, dtype=np.float32):
    """out of `dtype` matches the float64 reference within tol plus the output's rounding."""
    assert out.dtype == dtype and out.shape == ref.shape
    assert np.isfinite(out).all()
    bound = tol + HALF_ULP[np.dtype(dtype)] * np.abs(ref).max(initial=0)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=bound, rtol=0)


@pytest.mark.parametrize("D", pyfa.supported("head_dims"))
@pytest.mark.parametrize("dtype", [np.float32, np.float16, pyfa.bfloat16])
def test_head_dims_and_dtypes(device, rng, D, dtype):
    q, k, v = make(rng, 1, 4, 2, D, 300, dtype)
    check(pyfa.decode_attention(q, k, v, 257, device=device), reference.decode_attention(q, k, v, 257))


@pytest.mark.parametrize("qdtype", [np.float16, pyfa.bfloat16])
def test_half_precision_queries(device, rng, qdtype):
    """The output takes q's dtype by default."""
    q, k, v = make(rng, 2, 8, 4, 128, 96, np.float16, qdtype)
    ref = reference.decode_attention(q, k, v, [96, 40])
    check(pyfa.decode_attention(q, k, v, [96, 40], device=device), ref, dtype=qdtype)
    check(pyfa.decode_attention(q, k, v, [96, 40], out_dtype=np.float32, device=device), ref)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("kv_len", [1, 31, 32, 33, 160])
def test_gqa_and_lengths(device, rng, group, kv_len):
    q, k, v = make(rng, 1, 2 * group, 2, 64, 160, np.float16)
    check(pyfa.decode_attention(q, k, v, kv_len, device=device), reference.decode_attention(q, k, v, kv_len))


@pytest.mark.parametrize("D", pyfa.supported("head_dims"))
@pytest.mark.parametrize("dtype", [np.float16, pyfa.bfloat16])
@pytest.mark.parametrize("group", [4, 12])
def test_wide_groups(device, rng, D, dtype, group):
    # Wide GQA groups take the CUDA tensor-core decode (12 = a pass of 8 heads, then 4),
    # here with a partial last tile and a window that ends mid-tile.
    q, k, v = make(rng, 2, 2 * group, 2, D, 300, dtype)
    check(pyfa.decode_attention(q, k, v, [300, 77], device=device), reference.decode_attention(q, k, v, [300, 77]))
    out = pyfa.decode_attention(q, k, v, 300, window=123, ring_start=[5, 299], softcap=4.0, device=device)
    check(out, reference.decode_attention(q, k, v, 300, window=123, ring_start=[5, 299], softcap=4.0))


@pytest.mark.parametrize("D", pyfa.supported("head_dims"))
@pytest.mark.parametrize("dtype", [np.float16, pyfa.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_queries_in_cache_dtype(device, rng, D, dtype, group):
    # q in the cache's dtype: the CUDA tensor-core decode takes it as one exact
    # term and scales the scores after the product (other q dtypes are split).
    q, k, v = make(rng, 2, 2 * group, 2, D, 300, dtype, dtype)
    check(pyfa.decode_attention(q, k, v, [300, 77], out_dtype=np.float32, device=device),
          reference.decode_attention(q, k, v, [300, 77]))
    out = pyfa.decode_attention(q, k, v, 300, window=123, ring_start=[5, 299], softcap=4.0, device=device)
    check(out, reference.decode_attention(q, k, v, 300, window=123, ring_start=[5, 299], softcap=4.0), dtype=dtype)


@pytest.mark.parametrize("window", [1, 7, 64, 500])
@pytest.mark.parametrize("ring_start", [0, 1, 77, 199])
def test_window_and_ring(device, rng, window, ring_start):
    cap = 200
    q, k, v = make(rng, 1, 4, 2, 96, cap, pyfa.bfloat16)
    out = pyfa.decode_attention(q, k, v, cap, window=window, ring_start=ring_start, device=device)
    check(out, reference.decode_attention(q, k, v, cap, window=window, ring_start=ring_start))


def test_ring_equals_unrolled_cache(device, rng):
    """A full ring read at ring_start r equals the same cache rotated into order."""
    cap, r = 128, 45
    q, k, v = make(rng, 1, 4, 4, 64, cap, np.float32)
    ordered_k, ordered_v = np.roll(k, -r, axis=2), np.roll(v, -r, axis=2)
    for window in (None, 50):
        a = pyfa.decode_attention(q, k, v, cap, ring_start=r, window=window, device=device)
        b = pyfa.decode_attention(q, ordered_k, ordered_v, cap, window=window, device=device)
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("softcap", [0.0, 1.0, 30.0])
def test_softcap(device, rng, softcap):
    q, k, v = make(rng, 1, 8, 2, 128, 64, np.float16)
    q *= 4  # scores of several units, so the cap bends them
    out = pyfa.decode_attention(q, k, v, 64, softcap=softcap, device=device)
    check(out, reference.decode_attention(q, k, v, 64, softcap=softcap))
    if softcap == 1.0:  # the cap changes the result, so it is really applied
        assert np.abs(out - reference.decode_attention(q, k, v, 64)).max() > 1e-2


def test_batch_mixed_lengths_windows_rings(device, rng):
    cap = 96
    q, k, v = make(rng, 4, 8, 2, 128, cap, np.float16)
    lens, rings = [96, 1, 50, 96], [5, 0, 0, 95]
    for window in (None, 20):
        out = pyfa.decode_attention(q, k, v, lens, ring_start=rings, window=window, scale=0.3, device=device)
        check(out, reference.decode_attention(q, k, v, lens, ring_start=rings, window=window, scale=0.3))


def test_slots_past_kv_len_are_never_read(device, rng):
    q, k, v = make(rng, 2, 4, 2, 64, 64, np.float32)
    k[:, :, 40:] = np.nan
    v[:, :, 40:] = np.inf
    out = pyfa.decode_attention(q, k, v, [40, 17], device=device)
    check(out, reference.decode_attention(q, k, v, [40, 17]))


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_a_run_of_positions_from_ring_start(device, rng, window, D):
    """kv_len positions from slot ring_start, wrapping at capacity: a left-padded sequence's
    run (slots 20..59), one that wraps (slots 90..95, 0..9), one of one slot, a full ring.
    Slots outside each run hold NaN / inf, so reading one shows."""
    cap = 96
    q, k, v = make(rng, 4, 8, 2, D, cap, np.float16)
    lens, rings = [40, 16, 1, 96], [20, 90, 95, 7]
    for b, (n, r) in enumerate(zip(lens, rings)):
        outside = np.ones(cap, bool)
        outside[(r + np.arange(n)) % cap] = False
        k[b, :, outside], v[b, :, outside] = np.nan, np.inf
    for q_in in (q, q.astype(np.float16)):  # the tensor-core and vector decodes
        out = pyfa.decode_attention(q_in, k, v, lens, ring_start=rings, window=window, device=device)
        check(out, reference.decode_attention(q_in, k, v, lens, ring_start=rings, window=window), dtype=q_in.dtype)


def test_a_run_equals_the_same_rows_at_slot_zero(device, rng):
    """A run of positions from slot r (wrapping) gives the bits of the same rows moved to slots 0.."""
    cap, r = 2048, 2000
    q, k, v = make(rng, 1, 4, 2, 128, cap, pyfa.bfloat16)
    moved_k, moved_v = np.roll(k, -r, axis=2), np.roll(v, -r, axis=2)
    for n in (50, 1500):  # one workgroup's run, and a split one
        a = pyfa.decode_attention(q, k, v, n, ring_start=r, device=device)
        b = pyfa.decode_attention(q, moved_k, moved_v, n, device=device)
        np.testing.assert_array_equal(a, b)


def test_long_context_many_workgroups(device, rng):
    q, k, v = make(rng, 1, 16, 8, 256, 4096, np.float16)
    check(pyfa.decode_attention(q, k, v, 4001, device=device), reference.decode_attention(q, k, v, 4001))


def test_single_sequence_2d_inputs(device, rng):
    q, k, v = make(rng, 1, 4, 2, 64, 32, np.float16)
    out = pyfa.decode_attention(q[0], k[0], v[0], 20, device=device)
    assert out.shape == (4, 64)
    check(out, reference.decode_attention(q[0], k[0], v[0], 20))


def test_out_argument_is_filled_in_place(device, rng):
    q, k, v = make(rng, 1, 4, 2, 64, 32, np.float16)
    out = np.full((1, 4, 64), np.nan, np.float32)
    res = pyfa.decode_attention(q, k, v, 32, out=out, device=device)
    assert res is out
    check(out, reference.decode_attention(q, k, v, 32))


def test_non_contiguous_inputs_are_copied(device, rng):
    q, k, v = make(rng, 1, 4, 2, 64, 64, np.float32)
    kt = np.ascontiguousarray(k.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)  # same values, F-order rows
    qs = np.repeat(q, 2, axis=2)[:, :, ::2]
    assert not kt.flags.c_contiguous and not qs.flags.c_contiguous
    check(pyfa.decode_attention(qs, kt, v, 64, device=device), reference.decode_attention(q, k, v, 64))


def test_explicit_workgroup_counts_match(device, rng):
    """Every nwg, including more workgroups than keys (empty workgroups), gives the same result."""
    from pyfa._native import ffi, lib
    from pyfa.errors import check as check_status

    q, k, v = make(rng, 1, 4, 2, 64, 40, np.float32)
    ref = reference.decode_attention(q, k, v, 5)
    for nwg in (1, 2, 3, 7, 64):
        params = ffi.new("pyfa_flash_attn_vec_params *", {
            "batch": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "kv_capacity": 40,
            "nwg": nwg, "scale": 0.125})
        tmp = np.zeros(4 * nwg * 66, np.float32)
        out = np.full((1, 4, 64), np.nan, np.float32)
        lens, rings = np.array([5], np.int32), np.array([0], np.int32)
        bufs = [device.wrap(a) if device.host_visible else None for a in (q, k, v, lens, rings, tmp, out)]
        if bufs[0] is None:
            pytest.skip("low-level host-memory wrap needs a host-visible device")
        enc = device.encoder()
        check_status(lib.pyfa_flash_attn_vec(enc, params, *(b.handle for b in bufs), ffi.NULL))
        check_status(lib.pyfa_encoder_commit(enc))
        check_status(lib.pyfa_encoder_wait(enc))
        check(out, ref)


def test_two_decodes_in_one_commit_share_tmp(device, rng):
    """Ops recorded into one commit run as if in order, even where a backend
    may overlap the dispatches between two barriers: the second decode
    overwrites the tmp the first one's reduce reads (the encoder puts a
    barrier between them; CI runs this under reversed dispatch orders)."""
    from pyfa._native import ffi, lib
    from pyfa.errors import check as check_status

    if not device.host_visible:
        pytest.skip("low-level host-memory wrap needs a host-visible device")
    nwg = 4
    q1, k1, v1 = make(rng, 1, 4, 2, 64, 300, np.float32)
    q2, k2, v2 = make(rng, 1, 4, 2, 64, 300, np.float32)
    params = ffi.new("pyfa_flash_attn_vec_params *", {
        "batch": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "kv_capacity": 300,
        "nwg": nwg, "scale": 0.125})
    tmp = np.zeros(4 * nwg * 66, np.float32)
    lens, rings = np.array([300], np.int32), np.array([0], np.int32)
    out1, out2 = np.full((1, 4, 64), np.nan, np.float32), np.full((1, 4, 64), np.nan, np.float32)
    wrap = {id(a): device.wrap(a) for a in (q1, k1, v1, q2, k2, v2, tmp, lens, rings, out1, out2)}
    enc = device.encoder()
    for q, k, v, out in ((q1, k1, v1, out1), (q2, k2, v2, out2)):
        check_status(lib.pyfa_flash_attn_vec(enc, params, *(wrap[id(a)].handle for a in (q, k, v, lens, rings, tmp, out)),
                                             ffi.NULL))
    check_status(lib.pyfa_encoder_commit(enc))
    check_status(lib.pyfa_encoder_wait(enc))
    check(out1, reference.decode_attention(q1, k1, v1, 300, scale=0.125))
    check(out2, reference.decode_attention(q2, k2, v2, 300, scale=0.125))
