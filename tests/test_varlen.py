"""pyfa.varlen_attention (flash_attn_prefill in varlen mode) against the float64
reference, one sequence at a time, and against the rectangular kernel.

Tolerances are test_prefill.py's (the same kernel and the same arithmetic,
only the rows' addresses differ): f32 inputs within 2e-5 of the float64
reference; f16 / bf16 inputs within flash-attn's rule, twice the error of the
same attention computed in the input dtype plus 2e-5; lse by f32 statistics.
"""
import os
import re

import numpy as np
import pytest

import pyfa
from pyfa import reference
from pyfa._native import ffi, lib

import test_prefill
from test_prefill import _p_rounding  # noqa: F401 (autouse: test_prefill.P_EXACT for this test's device)

BF16 = pyfa.bfloat16
ROUND = {np.dtype(np.float32): 0.0, np.dtype(np.float16): 2.0**-11, BF16: 2.0**-8}
# The MSL executor's perturbation mode adds random ulps per dispatch: two
# dispatches that are bit-identical on a device differ there in the last bit.
PERTURBED = os.environ.get("PYFA_MSL_PERTURB_ULPS", "0") not in ("", "0")
LAST_BIT = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 2.0**-10, BF16: 2.0**-7}


def cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def make(rng, q_lens, k_lens, H, Hkv, D, dtype):
    q = rng.standard_normal((sum(q_lens), H, D)).astype(dtype)
    k = rng.standard_normal((sum(k_lens), Hkv, D)).astype(dtype)
    v = rng.standard_normal((sum(k_lens), Hkv, D)).astype(dtype)
    return q, k, v


def reference_varlen(q, k, v, cu_q, cu_k, **kw):
    """Per sequence: reference.attention (bottom-right q_offset) on its rows: (out, lse), out a
    float64 array that carries, as ``out.in_dtype``, the same computed in q's dtype (None for f32)."""
    out, lse = _reference_varlen(q, k, v, cu_q, cu_k, **kw)
    out = out.view(Reference)
    out.in_dtype = None if q.dtype == np.float32 else _reference_varlen(q, k, v, cu_q, cu_k, rounding=q.dtype, **kw)[0]
    return out, lse


class Reference(np.ndarray):
    """A float64 reference output with the same attention computed in the input dtype beside it."""
    in_dtype = None


def _reference_varlen(q, k, v, cu_q, cu_k, **kw):
    total_q, H, D = q.shape
    out = np.zeros((total_q, H, D))
    lse = np.full((H, total_q), -np.inf)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0:
            continue
        o, l = reference.attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], layout="bshd", return_lse=True, **kw)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


def check_close(out, ref, dtype, ref_dtype=None):
    """test_prefill.check_close: ``ref_dtype`` (default: ``ref.in_dtype`` of a reference_varlen
    result) is the same attention in the 16-bit input dtype, None for f32 inputs."""
    dtype = np.dtype(dtype)
    if ref_dtype is None:
        ref_dtype = getattr(ref, "in_dtype", None)
    ref = np.asarray(ref)
    assert out.dtype == dtype and out.shape == ref.shape
    o = out.astype(np.float64)
    assert not np.isnan(o).any()
    bound = 2e-5 if ref_dtype is None else 2 * np.abs(np.asarray(ref_dtype) - ref).max(initial=0.0) + 2e-5
    assert np.abs(o - ref).max() <= bound, (np.abs(o - ref).max(), bound)
    if ref_dtype is not None and test_prefill.P_EXACT:
        exact = ROUND[dtype] * max(np.abs(ref).max(), 1.0) + 2e-5
        assert np.abs(o - ref).max() <= exact, ("exact P", np.abs(o - ref).max(), exact)


def check_lse(lse, ref_lse):
    assert lse.dtype == np.float32 and lse.shape == ref_lse.shape
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.abs(lse[fin] - ref_lse[fin]).max(initial=0.0) <= 1e-4


def assert_same_run(a, b):
    """Two dispatches computing the same rows with the same tiles: bit-identical."""
    if PERTURBED:
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   rtol=LAST_BIT[np.dtype(a.dtype)], atol=1e-5)
    else:
        assert np.array_equal(a, b)


# Mixed lengths: 1-token sequences, a sequence with no query rows, one longer
# than a tile (48 rows on the CPU, 64 on CUDA), q_len < kv_len and ==.
Q_LENS = [1, 0, 70, 5, 1]
K_LENS = [1, 9, 90, 5, 40]


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
def test_against_reference(device, rng, dtype, D):
    causal = D != 128
    q, k, v = make(rng, Q_LENS, K_LENS, 4, 2, D, dtype)
    cq, ck = cu(Q_LENS), cu(K_LENS)
    out, lse = pyfa.varlen_attention(q, k, v, cq, ck, causal=causal, return_lse=True, device=device)
    ref, ref_lse = reference_varlen(q, k, v, cq, ck, causal=causal)
    check_close(out, ref, dtype)
    check_lse(lse, ref_lse)


def test_head_dim_512(device, rng):
    q, k, v = make(rng, [3, 20], [3, 33], 2, 1, 512, np.float16)
    cq, ck = cu([3, 20]), cu([3, 33])
    out = pyfa.varlen_attention(q, k, v, cq, ck, causal=True, device=device)
    check_close(out, reference_varlen(q, k, v, cq, ck, causal=True)[0], np.float16)


@pytest.mark.parametrize("causal,window,softcap,H,Hkv", [
    (True, 7, 0.0, 4, 1), (False, 16, 0.0, 2, 2), (True, None, 5.0, 6, 2), (False, 3, 8.0, 4, 4),
])
def test_options(device, rng, causal, window, softcap, H, Hkv):
    q, k, v = make(rng, Q_LENS, K_LENS, H, Hkv, 64, np.float32)
    cq, ck = cu(Q_LENS), cu(K_LENS)
    kw = dict(causal=causal, window=window, softcap=softcap, scale=0.3)
    out, lse = pyfa.varlen_attention(q, k, v, cq, ck, return_lse=True, device=device, **kw)
    ref, ref_lse = reference_varlen(q, k, v, cq, ck, **kw)
    check_close(out, ref, np.float32)
    check_lse(lse, ref_lse)


def test_out_dtype_and_out(device, rng):
    q, k, v = make(rng, [4, 6], [8, 6], 2, 1, 64, BF16)
    cq, ck = cu([4, 6]), cu([8, 6])
    ref = reference_varlen(q, k, v, cq, ck, causal=True)[0]
    buf = np.empty(q.shape, np.float32)
    got = pyfa.varlen_attention(q, k, v, cq, ck, causal=True, out=buf, out_dtype=np.float32, device=device)
    assert got is buf
    check_close(got, ref, np.float32)


@pytest.mark.parametrize("dtype,D", [(np.float32, 64), (np.float16, 128), (BF16, 256)])
def test_views_of_a_fused_qkv_projection(device, rng, dtype, D):
    """q, k and v as slices of one [total, H + 2 H_kv, D] projection, out a slice of wider rows:
    read and written where they are, bit for bit the contiguous call's result."""
    H, Hkv = 4, 2
    cq = ck = cu(K_LENS)
    qkv = rng.standard_normal((sum(K_LENS), H + 2 * Hkv, D)).astype(dtype)
    q, k, v = qkv[:, :H], qkv[:, H:H + Hkv], qkv[:, H + Hkv:]
    wide = np.full((sum(K_LENS), H, D + 16), 7, dtype)
    out = wide[..., :D]
    got, lse = pyfa.varlen_attention(q, k, v, cq, ck, causal=True, out=out, return_lse=True, device=device)
    assert got is out and np.all(wide[..., D:] == 7)
    copies = [np.ascontiguousarray(a) for a in (q, k, v)]
    whole, whole_lse = pyfa.varlen_attention(*copies, cq, ck, causal=True, return_lse=True, device=device)
    assert_same_run(np.ascontiguousarray(out), whole)
    assert_same_run(lse, whole_lse)
    ref, ref_lse = reference_varlen(*copies, cq, ck, causal=True)
    check_close(np.ascontiguousarray(out), ref, dtype)
    with pytest.raises(pyfa.PyfaError, match="out: a non-contiguous output must start on a 16-byte boundary, with its last axis"):
        pyfa.varlen_attention(q, k, v, cq, ck, out=np.zeros((sum(K_LENS), H, D + 1), dtype)[..., :D], device=device)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_equals_rectangular(device, rng, dtype):
    """Equal lengths: the varlen call computes what the rectangular kernel does on the padded-free batch."""
    B, L, kL = 3, 37, 52
    q, k, v = make(rng, [L] * B, [kL] * B, 4, 2, 128, dtype)
    out = pyfa.varlen_attention(q, k, v, cu([L] * B), cu([kL] * B), causal=True, device=device)
    rect = pyfa.attention(q.reshape(B, L, 4, 128), k.reshape(B, kL, 2, 128), v.reshape(B, kL, 2, 128),
                          causal=True, layout="bshd", device=device)
    assert_same_run(out, rect.reshape(B * L, 4, 128))


def test_cascade_merge(device, rng):
    """A shared prefix (one call, non-causal) and each sequence's own keys (a second, causal) merged
    with merge_attention_states (batch 1, layout bshd, lse [1, H, total_q]) equal one call over both."""
    H, Hkv, D, P = 4, 2, 64, 30
    q_lens, s_lens = [5, 1, 12], [9, 1, 20]
    q, ks, vs = make(rng, q_lens, s_lens, H, Hkv, D, np.float32)
    kp = rng.standard_normal((P, Hkv, D)).astype(np.float32)
    vp = rng.standard_normal((P, Hkv, D)).astype(np.float32)
    cq, cs = cu(q_lens), cu(s_lens)
    B = len(q_lens)
    kpre, vpre = np.concatenate([kp] * B), np.concatenate([vp] * B)
    o_a, l_a = pyfa.varlen_attention(q, kpre, vpre, cq, cu([P] * B), return_lse=True, device=device)
    o_b, l_b = pyfa.varlen_attention(q, ks, vs, cq, cs, causal=True, return_lse=True, device=device)
    o, lse = pyfa.merge_attention_states(o_a[None], l_a[None], o_b[None], l_b[None], layout="bshd", device=device)
    kall = np.concatenate([np.concatenate([kp, ks[cs[b]:cs[b + 1]]]) for b in range(B)])
    vall = np.concatenate([np.concatenate([vp, vs[cs[b]:cs[b + 1]]]) for b in range(B)])
    call = cu([P + n for n in s_lens])
    one, one_lse = pyfa.varlen_attention(q, kall, vall, cq, call, causal=True, return_lse=True, device=device)
    np.testing.assert_allclose(o[0], one, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse[0], one_lse, atol=1e-5, rtol=0)
    ref, ref_lse = reference_varlen(q, kall, vall, cq, call, causal=True)
    check_close(o[0], ref, np.float32)
    check_lse(lse[0], ref_lse)


def test_max_seqlen_above_longest(device, rng):
    """A declared max above the longest sequence only adds tiles that exit at once."""
    q, k, v = make(rng, [3, 7], [5, 7], 2, 2, 64, np.float32)
    cq, ck = cu([3, 7]), cu([5, 7])
    out = pyfa.varlen_attention(q, k, v, cq, ck, max_seqlen_q=200, max_seqlen_k=300, causal=True, device=device)
    check_close(out, reference_varlen(q, k, v, cq, ck, causal=True)[0], np.float32)


def test_plan_matches_call(dev, rng):
    """pyfa_varlen_prefill_plan_new / _run (on host memory) write what the buffer call does."""
    if not dev.host_visible:
        pytest.skip(f"plan runs bind host addresses; {dev.backend} does not read host memory")
    q, k, v = make(rng, Q_LENS, K_LENS, 4, 2, 64, np.float32)
    cq, ck = cu(Q_LENS), cu(K_LENS)
    want, want_lse = pyfa.varlen_attention(q, k, v, cq, ck, causal=True, return_lse=True, device=dev)
    desc = ffi.new("pyfa_varlen_prefill_plan_desc *")
    _fill_attn(desc.attn, len(Q_LENS), 4, 2, 64, max(Q_LENS), max(K_LENS))
    desc.kv_mode, desc.return_lse = lib.PYFA_PREFILL_KV_VARLEN, 1
    desc.dtype = desc.out_dtype = pyfa.dtypes.code(np.float32)
    plan = ffi.new("pyfa_plan **")
    assert lib.pyfa_varlen_prefill_plan_new(plan, dev.handle, desc) == 0, ffi.string(lib.pyfa_last_error())
    out, lse = np.zeros_like(q), np.zeros((4, q.shape[0]), np.float32)
    args = ffi.new("pyfa_varlen_prefill_run_args *")
    for field, a in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cq), ("seq_k", ck), ("out", out), ("lse", lse)):
        t = getattr(args, field)
        t.address, t.nbytes = int(ffi.cast("uintptr_t", ffi.from_buffer(a))), a.nbytes
    args.total_q, args.total_k, args.flags = q.shape[0], k.shape[0], lib.PYFA_RUN_FINISH
    enc = dev.encoder()
    assert lib.pyfa_varlen_prefill_run(plan[0], enc, args) == 0, ffi.string(lib.pyfa_last_error())
    lib.pyfa_plan_free(plan[0])
    assert np.array_equal(out, want) and np.array_equal(lse, want_lse)


def _fill_attn(a, batch, H, Hkv, D, q_len, kv_len):
    a.batch, a.num_heads, a.num_kv_heads, a.head_dim, a.q_len, a.kv_len = batch, H, Hkv, D, q_len, kv_len
    a.scale, a.causal = 1.0 / np.sqrt(D), 1
    a.q_strides = a.out_strides = [0, D, H * D]
    a.k_strides = a.v_strides = [0, D, Hkv * D]


@pytest.mark.parametrize("field,value,message", [
    ("mask_strides", [0, 0, 7], "mask_strides: masks are not supported"),
    ("q_offset", 3, "q_offset: not read with packed sequences"),
    ("kv_mode", 0, "kv_mode: 0 must be"),
    ("return_lse", 2, "return_lse: must be 0 or 1"),
])
def test_plan_rules(dev, field, value, message):
    desc = ffi.new("pyfa_varlen_prefill_plan_desc *")
    _fill_attn(desc.attn, 2, 4, 2, 64, 8, 8)
    desc.kv_mode = lib.PYFA_PREFILL_KV_VARLEN
    desc.dtype = desc.out_dtype = pyfa.dtypes.code(np.float32)
    if field in ("mask_strides", "q_offset"):
        setattr(desc.attn, field, value)
    else:
        setattr(desc, field, value)
    plan = ffi.new("pyfa_plan **")
    assert lib.pyfa_varlen_prefill_plan_new(plan, dev.handle, desc) != 0
    assert message in ffi.string(lib.pyfa_last_error()).decode()


def test_plan_refuses_a_grid_of_2_to_the_32_tiles(dev):
    """A plan for 600 sequences under a declared longest of 2^31 - 1 rows is refused where it is
    made (not at each run)."""
    desc = ffi.new("pyfa_varlen_prefill_plan_desc *")
    _fill_attn(desc.attn, 600, 2, 1, 64, 2**31 - 1, 8)
    desc.kv_mode = lib.PYFA_PREFILL_KV_VARLEN
    desc.dtype = desc.out_dtype = pyfa.dtypes.code(np.float32)
    plan = ffi.new("pyfa_plan **")
    assert lib.pyfa_varlen_prefill_plan_new(plan, dev.handle, desc) != 0
    assert "max_seqlen_q: 2147483647 rows make" in ffi.string(lib.pyfa_last_error()).decode()


# Bad input -> PyfaError naming the argument and the rule.
def _base(rng):
    q, k, v = make(rng, [3, 4], [5, 4], 2, 1, 64, np.float32)
    return q, k, v, cu([3, 4]), cu([5, 4])


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(cq=np.array([1, 3, 7], np.int32)), "cu_seqlens_q[0]: 1 must be 0"),
    (lambda a: a.update(cq=np.array([0, 5, 4, 7], np.int32), ck=cu([5, 0, 4])), "cu_seqlens_q[2]: 4 is below"),
    (lambda a: a.update(cq=np.array([0, 3, 6], np.int32)), "cu_seqlens_q[2]: 6 must equal the packed length (7)"),
    (lambda a: a.update(ck=np.array([0, 5, 8], np.int32)), "cu_seqlens_k[2]: 8 must equal the packed length (9)"),
    (lambda a: a.update(ck=np.array([0, 2, 9], np.int32)), "cu_seqlens_k: sequence 0 has 3 query rows but 2 keys"),
    (lambda a: a.update(ck=np.array([0, 5], np.int32)), "cu_seqlens_k: expected shape (3,)"),
    (lambda a: a.update(cq=np.array([0], np.int32)), "cu_seqlens_q: needs batch + 1 >= 2 values"),
    (lambda a: a.update(cq=np.array([0.0, 3, 7])), "cu_seqlens_q: expected a 1-D array of ints"),
    (lambda a: a.update(max_seqlen_q=3), "cu_seqlens_q: sequence 1 has 4 rows, more than max_seqlen_q (3)"),
    (lambda a: a.update(max_seqlen_k=4), "cu_seqlens_k: sequence 0 has 5 rows, more than max_seqlen_k (4)"),
    (lambda a: a.update(max_seqlen_q=0), "max_seqlen_q"),
    (lambda a: a.update(k=a["k"].astype(np.float16)), "k: dtype float16 differs from q's"),
    (lambda a: a.update(v=a["v"][:, :, :32].copy()), "v: shape"),
    (lambda a: a.update(k=a["k"][:, :, :32].copy(), v=a["v"][:, :, :32].copy()), "k: head_dim 32 differs"),
    (lambda a: a.update(q=a["q"][:0]), "q: no rows (total_q must be > 0)"),
    (lambda a: a.update(k=np.concatenate([a["k"]] * 4, 1), v=np.concatenate([a["v"]] * 4, 1)), "num_kv_heads"),
    (lambda a: a.update(window=0), "window"),
    (lambda a: a.update(out=np.empty((7, 2, 64), np.float16)), "out: expected shape"),
    (lambda a: a.update(out_dtype=np.float16), "out_dtype"),
])
def test_bad_input(dev, rng, change, message):
    q, k, v, cq, ck = _base(rng)
    a = dict(q=q, k=k, v=v, cq=cq, ck=ck)
    change(a)
    kw = {key: a[key] for key in ("max_seqlen_q", "max_seqlen_k", "window", "out", "out_dtype") if key in a}
    with pytest.raises(pyfa.PyfaError, match=re.escape(message)):
        pyfa.varlen_attention(a["q"], a["k"], a["v"], a["cq"], a["ck"], causal=True, device=dev, **kw)


def test_a_grid_of_2_to_the_32_tiles_is_refused(dev, rng):
    """600 sequences, most of them empty, under a declared longest of 2^31 - 1 rows: more query
    tiles x heads x sequences than the kernels count in 32 bits; refused, naming max_seqlen_q."""
    q, k, v, _, _ = _base(rng)
    with pytest.raises(pyfa.PyfaError, match=r"max_seqlen_q: 2147483647 rows make \d+ query tiles .*"
                                             r"x heads \(2\) x sequences \(600\) = \d+ must be at most 4294967295"):
        pyfa.varlen_attention(q, k, v, cu([3, 4] + [0] * 598), cu([5, 4] + [0] * 598), causal=True,
                              max_seqlen_q=2**31 - 1, device=dev)


def test_total_k_zero(dev, rng):
    q, k, v, cq, ck = _base(rng)
    with pytest.raises(pyfa.PyfaError, match=r"k: no rows \(total_k must be > 0\)"):
        pyfa.varlen_attention(q, k[:0], v[:0], cq, np.zeros(3, np.int32), device=dev)


def _cuda_torch():
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available() or "cuda" not in pyfa.available_backends():
        pytest.skip("needs a CUDA GPU and pyfa's cuda backend")
    return torch


def test_cuda_device_metadata(rng):
    """torch CUDA tensors in place, metadata as device int32 arrays (max_seqlen_* given), equal to the host call."""
    torch = _cuda_torch()
    q, k, v = make(rng, Q_LENS, K_LENS, 4, 2, 128, np.float16)
    cq, ck = cu(Q_LENS), cu(K_LENS)
    want = pyfa.varlen_attention(q, k, v, cq, ck, causal=True, device="cuda")
    t = [torch.from_numpy(x).cuda() for x in (q, k, v, cq, ck)]
    with pytest.raises(pyfa.PyfaError, match="max_seqlen_q: required"):
        pyfa.varlen_attention(*t, causal=True, device="cuda")
    got = pyfa.varlen_attention(*t, max_seqlen_q=max(Q_LENS), max_seqlen_k=max(K_LENS), causal=True, device="cuda")
    assert np.array_equal(got.cpu().numpy(), want)


def shared(dev, a):
    """A shared buffer holding `a` (the test writes it again after recording)."""
    b = dev.buffer(a.shape, a.dtype)
    b.numpy()[...] = a
    return b


def test_device_values_clamped(device, rng):
    """Metadata the kernels read when the dispatch runs (as a GPU array updated between CUDA graph replays):
    values changed after recording are clamped as flash_attn_prefill_params.h says, and no row outside a
    sequence's clamped range, or past max_seqlen_q, is written."""
    if device.backend == "cuda":
        pytest.skip("CUDA uploads shared metadata at commit; test_cuda_device_values_clamped covers CUDA")
    H, Hkv, D = 2, 1, 64
    q, k, v = make(rng, [4, 6], [5, 6], H, Hkv, D, np.float32)  # total_q 10, total_k 11
    bq, bk, bv = shared(device, q), shared(device, k), shared(device, v)
    cq, ck = shared(device, cu([4, 6])), shared(device, cu([5, 6]))
    out = shared(device, np.full(q.shape, 7.0, np.float32))
    lse = shared(device, np.full((H, 10), 7.0, np.float32))
    params = ffi.new("pyfa_flash_attn_prefill_params *")
    _fill_attn(params, 2, H, Hkv, D, 6, 6)
    packed = ffi.new("pyfa_prefill_packed *", {"total_q": 10, "total_k": 11})
    enc = device.encoder()
    assert lib.pyfa_flash_attn_prefill_varlen(enc, params, packed, bq.handle, bk.handle, bv.handle, cq.handle,
                                              ck.handle, out.handle, lse.handle) == 0, ffi.string(lib.pyfa_last_error())
    # Sequence 0: q rows [0, 8) (-7 clamps to 0), k rows [3, 3): 8 rows over no key, of which the first
    # max_seqlen_q = 6 are written (zeros, lse -inf). Sequence 1: q rows [8, 10) (1000 clamps to 10),
    # k rows [2, 11) (99 clamps to 11): 2 rows at positions 7, 8 over 9 keys.
    cq.numpy()[:] = [-7, 8, 1000]
    ck.numpy()[:] = [3, 2, 99]
    assert lib.pyfa_encoder_commit(enc) == 0 and lib.pyfa_encoder_wait(enc) == 0, ffi.string(lib.pyfa_last_error())
    o, l = out.numpy(), lse.numpy()
    assert (o[:6] == 0).all() and np.isneginf(l[:, :6]).all()
    assert (o[6:8] == 7.0).all() and (l[:, 6:8] == 7.0).all()
    ref, ref_lse = reference.attention(q[None, 8:10], k[None, 2:11], v[None, 2:11], causal=True, layout="bshd",
                                       return_lse=True)
    check_close(o[8:10], ref[0], np.float32)
    check_lse(l[:, 8:10], ref_lse[0])


def test_cuda_device_values_clamped(rng):
    """test_device_values_clamped's values as torch CUDA int32 arrays (not checked on the host): clamped."""
    torch = _cuda_torch()
    H, Hkv, D = 2, 1, 64
    q, k, v = make(rng, [4, 6], [5, 6], H, Hkv, D, np.float16)
    t = [torch.from_numpy(x).cuda() for x in (q, k, v)]
    cq = torch.tensor([-7, 8, 1000], dtype=torch.int32, device="cuda")
    ck = torch.tensor([3, 2, 99], dtype=torch.int32, device="cuda")
    out = torch.full(q.shape, 7.0, dtype=torch.float16, device="cuda")
    o, l = pyfa.varlen_attention(*t, cq, ck, max_seqlen_q=6, max_seqlen_k=6, causal=True, out=out, return_lse=True,
                                 device="cuda")
    o, l = o.cpu().numpy(), l.cpu().numpy()
    assert (o[:6] == 0).all() and np.isneginf(l[:, :6]).all()
    assert (o[6:8] == 7.0).all()
    ref, ref_lse = reference.attention(q[None, 8:10], k[None, 2:11], v[None, 2:11], causal=True, layout="bshd",
                                       return_lse=True)
    ref16 = reference.attention(q[None, 8:10], k[None, 2:11], v[None, 2:11], causal=True, layout="bshd",
                                rounding=np.float16)
    check_close(o[8:10], ref[0], np.float16, ref16[0])
    check_lse(l[:, 8:10], ref_lse[0])
