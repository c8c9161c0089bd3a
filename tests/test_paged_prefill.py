"""pyfa.paged_attention (flash_attn_prefill in paged mode): new query rows of
each sequence against its cache in shuffled pool pages, against the float64
reference per sequence and against the varlen call on the same keys stored
contiguously. Tolerances: test_varlen.py's (the same kernel; only the K/V
rows' addresses differ, so paged and contiguous runs are bit-identical)."""
import re

import numpy as np
import pytest

import pyfa
from pyfa import reference
from pyfa._native import ffi, lib
from test_prefill import _p_rounding  # noqa: F401 (autouse: the rule check_close applies on this test's device)
from test_varlen import BF16, assert_same_run, check_close, check_lse, cu, reference_varlen


def make_paged(rng, q_lens, kv_lens, H, Hkv, D, dtype, page_size, layout, spare_pages=3):
    """q, the dense keys (packed per sequence), pools holding them in shuffled pages, block_table."""
    q = rng.standard_normal((sum(q_lens), H, D)).astype(dtype)
    k = rng.standard_normal((sum(kv_lens), Hkv, D)).astype(dtype)
    v = rng.standard_normal((sum(kv_lens), Hkv, D)).astype(dtype)
    pages_of = [(n + page_size - 1) // page_size for n in kv_lens]
    pages_per_seq = max(max(pages_of), 1) + 1  # a spare column: entries past a sequence's pages are not read
    num_pages = sum(pages_of) + spare_pages
    order = rng.permutation(num_pages)
    shape = (num_pages, page_size, Hkv, D) if layout == "nhd" else (num_pages, Hkv, page_size, D)
    k_pages = rng.standard_normal(shape).astype(dtype)  # garbage everywhere no sequence owns
    v_pages = rng.standard_normal(shape).astype(dtype)
    table = np.full((len(kv_lens), pages_per_seq), -1, np.int32)
    ck, used = cu(kv_lens), 0
    for b, n in enumerate(kv_lens):
        for i in range(pages_of[b]):
            page = order[used]
            used += 1
            table[b, i] = page
            rows = slice(ck[b] + i * page_size, min(ck[b] + (i + 1) * page_size, ck[b + 1]))
            t = rows.stop - rows.start
            if layout == "nhd":
                k_pages[page, :t], v_pages[page, :t] = k[rows], v[rows]
            else:
                k_pages[page, :, :t], v_pages[page, :, :t] = k[rows].transpose(1, 0, 2), v[rows].transpose(1, 0, 2)
    return q, k, v, k_pages, v_pages, table


Q_LENS = [1, 0, 20, 6]
KV_LENS = [1, 17, 90, 6]


@pytest.mark.parametrize("dtype,D,page_size,layout", [
    (np.float32, 64, 1, "nhd"), (np.float16, 128, 16, "hnd"), (BF16, 256, 64, "nhd"),
    (np.float32, 128, 64, "hnd"), (np.float16, 64, 16, "nhd"), (BF16, 64, 1, "hnd"),
])
def test_against_reference(device, rng, dtype, D, page_size, layout):
    q, k, v, kp, vp, table = make_paged(rng, Q_LENS, KV_LENS, 4, 2, D, dtype, page_size, layout)
    cq, lens = cu(Q_LENS), np.array(KV_LENS, np.int32)
    out, lse = pyfa.paged_attention(q, kp, vp, table, cq, lens, page_layout=layout, return_lse=True, device=device)
    ref, ref_lse = reference_varlen(q, k, v, cq, cu(KV_LENS), causal=True)
    check_close(out, ref, dtype)
    check_lse(lse, ref_lse)
    # The same keys stored contiguously: the varlen call, bit for bit.
    flat = pyfa.varlen_attention(q, k, v, cq, cu(KV_LENS), causal=True, device=device)
    assert_same_run(out, flat)


def test_query_view_and_output_view(device, rng):
    """q sliced from a fused projection's rows, out a transposed view: the contiguous call's bits."""
    q, k, v, kp, vp, table = make_paged(rng, Q_LENS, KV_LENS, 4, 2, 128, np.float16, 16, "nhd")
    cq, lens = cu(Q_LENS), np.array(KV_LENS, np.int32)
    fused = np.zeros((q.shape[0], 8, 128), np.float16)
    fused[:, 2:6] = q
    store = np.zeros((4, q.shape[0], 128), np.float16)
    out = store.transpose(1, 0, 2)
    assert pyfa.paged_attention(fused[:, 2:6], kp, vp, table, cq, lens, out=out, device=device) is out
    assert_same_run(np.ascontiguousarray(out), pyfa.paged_attention(q, kp, vp, table, cq, lens, device=device))


def test_head_dim_512(device, rng):
    q, k, v, kp, vp, table = make_paged(rng, [4, 9], [30, 9], 2, 1, 512, np.float16, 16, "nhd")
    out = pyfa.paged_attention(q, kp, vp, table, cu([4, 9]), [30, 9], device=device)
    check_close(out, reference_varlen(q, k, v, cu([4, 9]), cu([30, 9]), causal=True)[0], np.float16)


@pytest.mark.parametrize("causal,window,softcap,H,Hkv", [
    (True, 9, 0.0, 4, 1), (False, None, 0.0, 2, 2), (True, None, 6.0, 6, 3), (False, 20, 4.0, 4, 2),
])
def test_options(device, rng, causal, window, softcap, H, Hkv):
    q, k, v, kp, vp, table = make_paged(rng, Q_LENS, KV_LENS, H, Hkv, 64, np.float32, 16, "hnd")
    cq = cu(Q_LENS)
    kw = dict(causal=causal, window=window, softcap=softcap, scale=0.25)
    out, lse = pyfa.paged_attention(q, kp, vp, table, cq, KV_LENS, page_layout="hnd", return_lse=True,
                                    device=device, **kw)
    ref, ref_lse = reference_varlen(q, k, v, cq, cu(KV_LENS), **kw)
    check_close(out, ref, np.float32)
    check_lse(lse, ref_lse)


def test_chunked_prefill_cascade(device, rng):
    """Chunked prefill: a prompt's rows in two chunks against the growing paged cache equal one call over
    the whole prompt; and the second chunk split into cached prefix (non-causal, via varlen) + the rest
    merged with lse equals the paged call."""
    L, c1 = 70, 45
    q, k, v, kp, vp, table = make_paged(rng, [L], [L], 4, 2, 64, np.float32, 16, "nhd")
    whole = pyfa.paged_attention(q, kp, vp, table, [0, L], [L], device=device)
    first = pyfa.paged_attention(q[:c1], kp, vp, table, [0, c1], [c1], device=device)
    second, lse2 = pyfa.paged_attention(q[c1:], kp, vp, table, [0, L - c1], [L], return_lse=True, device=device)
    assert_same_run(np.concatenate([first, second]), whole)
    o_a, l_a = pyfa.varlen_attention(q[c1:], k[:c1], v[:c1], [0, L - c1], [0, c1], return_lse=True, device=device)
    o_b, l_b = pyfa.varlen_attention(q[c1:], k[c1:], v[c1:], [0, L - c1], [0, L - c1], causal=True,
                                     return_lse=True, device=device)
    o, lse = pyfa.merge_attention_states(o_a[None], l_a[None], o_b[None], l_b[None], layout="bshd", device=device)
    np.testing.assert_allclose(o[0], second, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse[0], lse2, atol=1e-5, rtol=0)


def _base(rng, page_size=16, layout="nhd"):
    q, k, v, kp, vp, table = make_paged(rng, [3, 5], [20, 5], 2, 1, 64, np.float32, page_size, layout)
    return dict(q=q, kp=kp, vp=vp, table=table, cq=cu([3, 5]), lens=np.array([20, 5], np.int32))


def _call(a, dev, **kw):
    return pyfa.paged_attention(a["q"], a["kp"], a["vp"], a["table"], a["cq"], a["lens"], device=dev, **kw)


def _set(**changes):
    return lambda a: a.update(changes)


def _table_entry(b, i, value):
    def change(a):
        a["table"] = a["table"].copy()
        a["table"][b, i] = value
    return change


@pytest.mark.parametrize("change,kw,message", [
    (_table_entry(0, 1, 99), {}, "block_table[0][1]: 99 must be in 0..<num_pages"),
    (_table_entry(1, 0, -1), {}, "block_table[1][0]: -1 must be in 0..<num_pages"),
    (lambda a: a.update(lens=np.array([20, 500], np.int32)), {}, "kv_len[1]: 500 must be in 0...pages_per_seq * page_size"),
    (lambda a: a.update(lens=np.array([20, -1], np.int32)), {}, "kv_len[1]: -1 must be in 0...pages_per_seq * page_size"),
    (lambda a: a.update(lens=np.array([2, 5], np.int32)), {}, "kv_len: sequence 0 has 3 query rows but 2 keys"),
    (lambda a: a.update(lens=np.array([20], np.int32)), {}, "kv_len: expected shape (2,)"),
    (lambda a: a.update(table=a["table"][:1]), {}, "cu_seqlens_q: expected shape (2,)"),
    (lambda a: a.update(table=a["table"][0]), {}, "block_table: expected a 2-D array of ints"),
    (lambda a: a.update(cq=np.array([0, 3, 9], np.int32)), {}, "cu_seqlens_q[2]: 9 must equal the packed length (8)"),
    (lambda a: a.update(kp=a["kp"][:, :12].copy(), vp=a["vp"][:, :12].copy()), {},
     "page_size: 12 must be a power of two in 1...1024"),
    (lambda a: a.update(vp=a["vp"][:-1].copy()), {}, "v_pages: shape"),
    (lambda a: a.update(kp=a["kp"].astype(np.float16)), {}, "k_pages: dtype float16 differs from q's"),
    (lambda a: None, {"page_layout": "nhwd"}, "page_layout"),
    (lambda a: None, {"max_seqlen_q": 4}, "cu_seqlens_q: sequence 1 has 5 rows, more than max_seqlen_q (4)"),
])
def test_bad_input(dev, rng, change, kw, message):
    a = _base(rng)
    change(a)
    with pytest.raises(pyfa.PyfaError, match=re.escape(message)):
        _call(a, dev, **kw)


def test_unused_block_table_entries_not_checked(dev, rng):
    """Entries past a sequence's pages (padding, -1 in vLLM) are not read, so they are not refused."""
    a = _base(rng)
    assert (a["table"][:, -1] == -1).all()
    _call(a, dev)


def test_pool_rows_fit_32_bits(dev):
    """num_pages * page_size * num_kv_heads must fit 32 bits (checked before any memory is)."""
    params = ffi.new("pyfa_flash_attn_prefill_params *")
    params.batch, params.num_heads, params.num_kv_heads, params.head_dim = 1, 8, 8, 64
    params.q_len, params.kv_len, params.scale = 1, 1, 0.125
    packed = ffi.new("pyfa_prefill_packed *", {"total_q": 1})
    pages = ffi.new("pyfa_kv_pages *", {"page_size": 1024, "num_pages": 1 << 20, "pages_per_seq": 1, "layout": 0})
    enc = dev.encoder()
    status = lib.pyfa_flash_attn_prefill_paged(enc, params, packed, pages, *([ffi.NULL] * 8))
    assert status != 0
    assert "num_pages: num_pages * page_size * num_kv_heads" in ffi.string(lib.pyfa_last_error()).decode()


def test_plan_matches_call(dev, rng):
    """pyfa_varlen_prefill_plan_new in paged mode / _run write what the buffer call does."""
    if not dev.host_visible:
        pytest.skip(f"plan runs bind host addresses; {dev.backend} does not read host memory")
    a = _base(rng, page_size=16, layout="hnd")
    want = _call(a, dev, page_layout="hnd")
    desc = ffi.new("pyfa_varlen_prefill_plan_desc *")
    at = desc.attn
    at.batch, at.num_heads, at.num_kv_heads, at.head_dim, at.q_len, at.kv_len = 2, 2, 1, 64, 5, 20
    at.scale, at.causal = 0.125, 1
    at.q_strides = at.out_strides = [0, 64, 128]
    at.k_strides = at.v_strides = [0, 0, 64]
    desc.pages.page_size, desc.pages.num_pages = 16, a["kp"].shape[0]
    desc.pages.pages_per_seq, desc.pages.layout = a["table"].shape[1], lib.PYFA_PAGES_HND
    desc.kv_mode = lib.PYFA_PREFILL_KV_PAGED
    desc.dtype = desc.out_dtype = pyfa.dtypes.code(np.float32)
    plan = ffi.new("pyfa_plan **")
    assert lib.pyfa_varlen_prefill_plan_new(plan, dev.handle, desc) == 0, ffi.string(lib.pyfa_last_error())
    out = np.zeros_like(a["q"])
    args = ffi.new("pyfa_varlen_prefill_run_args *")
    for field, x in (("q", a["q"]), ("k", a["kp"]), ("v", a["vp"]), ("cu_seqlens_q", a["cq"]), ("seq_k", a["lens"]),
                     ("block_table", a["table"]), ("out", out)):
        t = getattr(args, field)
        t.address, t.nbytes = int(ffi.cast("uintptr_t", ffi.from_buffer(x))), x.nbytes
    args.total_q, args.flags = a["q"].shape[0], lib.PYFA_RUN_FINISH
    status = lib.pyfa_varlen_prefill_run(plan[0], dev.encoder(), args)
    lib.pyfa_plan_free(plan[0])
    assert status == 0, ffi.string(lib.pyfa_last_error())
    assert np.array_equal(out, want)


def test_cuda_device_metadata(rng):
    """torch CUDA tensors in place with device metadata equal the host-metadata call."""
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available() or "cuda" not in pyfa.available_backends():
        pytest.skip("needs a CUDA GPU and pyfa's cuda backend")
    q, k, v, kp, vp, table = make_paged(rng, Q_LENS, KV_LENS, 4, 2, 128, np.float16, 16, "nhd")
    cq, lens = cu(Q_LENS), np.array(KV_LENS, np.int32)
    want = pyfa.paged_attention(q, kp, vp, table, cq, lens, device="cuda")
    t = [torch.from_numpy(x).cuda() for x in (q, kp, vp, table, cq, lens)]
    got = pyfa.paged_attention(*t, max_seqlen_q=max(Q_LENS), device="cuda")
    assert np.array_equal(got.cpu().numpy(), want)


def test_device_values_clamped(device, rng):
    """Paged metadata changed after recording (read when the dispatch runs, as GPU arrays are): kv_len
    below 0 is 0 and above pages_per_seq * page_size is that; a block_table entry outside the pool reads
    the last page (paged_kv_params.h)."""
    if device.backend == "cuda":
        pytest.skip("CUDA uploads shared metadata at commit; test_cuda_device_values_clamped covers CUDA")
    from test_varlen import shared
    H, Hkv, D, ps = 2, 1, 64, 16
    q, k, v, kp, vp, table = make_paged(rng, [3, 5], [20, 5], H, Hkv, D, np.float32, ps, "nhd")
    pps, last = table.shape[1], kp.shape[0] - 1
    bq, bk, bv, bt = shared(device, q), shared(device, kp), shared(device, vp), shared(device, table)
    cq, lens = shared(device, cu([3, 5])), shared(device, np.array([20, 5], np.int32))
    out = shared(device, np.full(q.shape, 7.0, np.float32))
    params = ffi.new("pyfa_flash_attn_prefill_params *")
    params.batch, params.num_heads, params.num_kv_heads, params.head_dim = 2, H, Hkv, D
    params.q_len, params.kv_len, params.scale, params.causal = 5, 20, 0.125, 1
    params.q_strides = params.out_strides = [0, D, H * D]
    packed = ffi.new("pyfa_prefill_packed *", {"total_q": 8})
    pages = ffi.new("pyfa_kv_pages *", {"page_size": ps, "num_pages": kp.shape[0], "pages_per_seq": pps, "layout": 0})
    enc = device.encoder()
    assert lib.pyfa_flash_attn_prefill_paged(enc, params, packed, pages, bq.handle, bk.handle, bv.handle, cq.handle,
                                             lens.handle, bt.handle, out.handle, ffi.NULL) == 0, \
        ffi.string(lib.pyfa_last_error())
    lens.numpy()[:] = [-5, 10**6]
    bt.numpy()[1, 1] = 10**6  # sequence 1 now holds pps * ps positions: its page 1 reads the last pool page
    bt.numpy()[1, 2:] = -3
    assert lib.pyfa_encoder_commit(enc) == 0 and lib.pyfa_encoder_wait(enc) == 0, ffi.string(lib.pyfa_last_error())
    o = out.numpy()
    assert (o[:3] == 0).all()  # kv_len -5 -> 0 keys
    pages_1 = [table[1, 0]] + [last] * (pps - 1)
    keys = np.concatenate([kp[p] for p in pages_1])[None]  # [1, pps * ps, Hkv, D]
    vals = np.concatenate([vp[p] for p in pages_1])[None]
    ref = reference.attention(q[None, 3:8], keys, vals, causal=True, layout="bshd")
    check_close(o[3:8], ref[0], np.float32)


def test_cuda_device_values_clamped(rng):
    """test_device_values_clamped's values as torch CUDA int32 arrays (not checked on the host): clamped."""
    from test_varlen import _cuda_torch
    torch = _cuda_torch()
    H, Hkv, D, ps = 2, 1, 64, 16
    q, k, v, kp, vp, table = make_paged(rng, [3, 5], [20, 5], H, Hkv, D, np.float16, ps, "nhd")
    pps, last = table.shape[1], kp.shape[0] - 1
    bad = table.copy()
    bad[1, 1], bad[1, 2:] = 10**6, -3
    t = [torch.from_numpy(x).cuda() for x in (q, kp, vp, bad, cu([3, 5]), np.array([-5, 10**6], np.int32))]
    out = torch.full(q.shape, 7.0, dtype=torch.float16, device="cuda")
    o = pyfa.paged_attention(*t, max_seqlen_q=5, out=out, device="cuda").cpu().numpy()
    assert (o[:3] == 0).all()
    pages_1 = [table[1, 0]] + [last] * (pps - 1)
    keys = np.concatenate([kp[p] for p in pages_1])[None]
    vals = np.concatenate([vp[p] for p in pages_1])[None]
    check_close(o[3:8], reference.attention(q[None, 3:8], keys, vals, causal=True, layout="bshd")[0], np.float16,
                reference.attention(q[None, 3:8], keys, vals, causal=True, layout="bshd", rounding=np.float16)[0])
