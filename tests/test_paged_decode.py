"""Paged decode (pyfa.paged_decode_attention, pyfa.turboquant.paged_decode) against the
float64 reference on the gathered K/V, the bad-input rules, and (CUDA) the device-value clamps."""
import numpy as np
import pytest

import pyfa
from pyfa import reference
from pyfa import turboquant as tq
import tq_contract

# Tolerances: as tests/test_decode.py (TOL, HALF_ULP) — the kernels read the same rounded K/V
# values the reference reads (gathered from the pool), so only f32 dot products and accumulation
# differ (~1e-6 on outputs of order 1); a misplaced page or a missing row moves outputs by >= 1e-2.
TOL = 2e-5
HALF_ULP = {np.dtype(np.float32): 0.0, np.dtype(np.float16): 2.0**-11, np.dtype(pyfa.bfloat16): 2.0**-8}


def make_pool(rng, B, Hkv, D, page_size, lens, dtype, layout="nhd", spare=2):
    """Pools with every sequence's pages shuffled through the pool (non-contiguous, out of order),
    a block table, and the gathered per-sequence caches [B, Hkv, cap, D] for the reference."""
    pps = max(1, max(-(-n // page_size) for n in lens))
    num_pages = B * pps + spare
    shape = (num_pages, page_size, Hkv, D) if layout == "nhd" else (num_pages, Hkv, page_size, D)
    k = rng.standard_normal(shape).astype(dtype)
    v = rng.standard_normal(shape).astype(dtype)
    table = rng.permutation(num_pages)[:B * pps].reshape(B, pps).astype(np.int32)
    return k, v, table


def gather(pool, table, layout):
    """[B, Hkv, pages_per_seq * page_size, D] caches holding each sequence's pages in order."""
    pages = pool[table]  # [B, pps, ...]
    if layout == "nhd":  # [B, pps, ps, Hkv, D]
        B, pps, ps, Hkv, D = pages.shape
        return pages.reshape(B, pps * ps, Hkv, D).transpose(0, 2, 1, 3)
    B, pps, Hkv, ps, D = pages.shape  # hnd
    return pages.transpose(0, 2, 1, 3, 4).reshape(B, Hkv, pps * ps, D)


def check(out, ref, dtype=np.float32, tol=TOL):
    assert out.dtype == dtype and out.shape == ref.shape
    bound = tol + HALF_ULP[np.dtype(dtype)] * np.abs(ref).max(initial=0)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=bound, rtol=0)


def run_case(device, rng, *, B=3, H=4, Hkv=2, D=64, page_size=16, lens=(1, 37, 64), dtype=np.float16,
             layout="nhd", window=None, softcap=0.0, out_dtype=None):
    k, v, table = make_pool(rng, B, Hkv, D, page_size, lens, dtype, layout)
    q = rng.standard_normal((B, H, D)).astype(np.float32)
    out, lse = pyfa.paged_decode_attention(q, k, v, table, list(lens), page_layout=layout, window=window,
                                           softcap=softcap, out_dtype=out_dtype, return_lse=True, device=device)
    kc, vc = gather(k, table, layout), gather(v, table, layout)
    ref, ref_lse = reference.decode_attention(q, kc, vc, list(lens), window=window, softcap=softcap,
                                              return_lse=True)
    check(out, ref, out_dtype or np.float32)
    np.testing.assert_allclose(lse, ref_lse, atol=TOL, rtol=0)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, pyfa.bfloat16])
def test_head_dims_and_dtypes(device, rng, D, dtype):
    run_case(device, rng, D=D, dtype=dtype)


def test_head_dim_512(device, rng):
    run_case(device, rng, B=2, H=2, Hkv=1, D=512, lens=(5, 40), dtype=np.float16)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_page_sizes_and_layouts(device, rng, page_size, layout):
    # Lengths mixed: one token, a partial last page, whole pages, a long one.
    run_case(device, rng, B=4, lens=(1, page_size + 3, 2 * page_size, 150), page_size=page_size, layout=layout)


@pytest.mark.parametrize("window,softcap", [(20, 0.0), (None, 30.0), (7, 5.0)])
def test_window_softcap_gqa(device, rng, window, softcap):
    run_case(device, rng, H=8, Hkv=2, lens=(3, 90, 41), window=window, softcap=softcap, dtype=pyfa.bfloat16)


@pytest.mark.parametrize("out_dtype", [np.float32, np.float16, pyfa.bfloat16])
def test_out_dtype(device, rng, out_dtype):
    run_case(device, rng, out_dtype=out_dtype)


def test_empty_sequence_gives_zeros_and_minus_inf(device, rng):
    k, v, table = make_pool(rng, 2, 1, 64, 16, [20, 20], np.float32)
    q = rng.standard_normal((2, 2, 64)).astype(np.float32)
    out, lse = pyfa.paged_decode_attention(q, k, v, table, [0, 20], return_lse=True, device=device)
    assert (out[0] == 0).all() and np.isneginf(lse[0]).all()
    ref = reference.decode_attention(q[1:], gather(k, table, "nhd")[1:], gather(v, table, "nhd")[1:], [20])
    check(out[1:], ref)


def test_lse_merge_equals_one_decode(device, rng):
    # A cascade: each sequence's first 32 positions (two pages) and the rest, decoded apart
    # and merged with their LSEs, equal one paged decode of the whole sequences.
    B, H, Hkv, D, ps = 2, 4, 2, 64, 16
    k, v, table = make_pool(rng, B, Hkv, D, ps, [70, 50], np.float16)
    q = rng.standard_normal((B, H, D)).astype(np.float32)
    whole = pyfa.paged_decode_attention(q, k, v, table, [70, 50], device=device)
    o_a, l_a = pyfa.paged_decode_attention(q, k, v, table[:, :2], [32, 32], return_lse=True, device=device)
    o_b, l_b = pyfa.paged_decode_attention(q, k, v, np.ascontiguousarray(table[:, 2:]), [38, 18],
                                           return_lse=True, device=device)
    o, _ = pyfa.merge_attention_states(o_a[:, :, None], l_a[:, :, None], o_b[:, :, None], l_b[:, :, None],
                                       device=device)
    np.testing.assert_allclose(o[:, :, 0], whole, atol=TOL, rtol=0)


def test_many_short_and_few_long(device, rng):
    # The split is planned for the batch's work (Paged.splitBatch): lengths far apart still decode exactly.
    lens = (1, 2, 3, 5, 8, 300, 13, 400)
    run_case(device, rng, B=len(lens), lens=lens, page_size=16, dtype=np.float16)


# ---- TurboQuant pools --------------------------------------------------------------------------

def tq_pools(rng, B, Hkv, D, page_size, lens, k_bits, v_bits, seed, layout="nhd"):
    """Codes and scales made by pyfa.turboquant.quantize, placed into shuffled pages; and the
    per-sequence rows [B][n, Hkv, D] (for the TurboQuantKVCache-style decode of the same codes)."""
    pps = max(-(-n // page_size) for n in lens)
    num_pages = B * pps + 1
    table = rng.permutation(num_pages)[:B * pps].reshape(B, pps).astype(np.int32)
    rows = num_pages * page_size * Hkv
    x_k = rng.standard_normal((rows, D)).astype(np.float32)
    x_v = rng.standard_normal((rows, D)).astype(np.float32)
    kc, ks = tq.quantize(x_k, k_bits, seed=seed, stream=tq.STREAM_K)
    vc, vs = tq.quantize(x_v, v_bits, seed=seed, stream=tq.STREAM_V)

    def shape(a, tail):
        if layout == "nhd":
            return a.reshape((num_pages, page_size, Hkv) + tail)
        return a.reshape((num_pages, Hkv, page_size) + tail)

    return (shape(kc, (kc.shape[1],)), shape(ks, ()), shape(vc, (vc.shape[1],)), shape(vs, ()), table,
            shape(x_k, (D,)), shape(x_v, (D,)))


def tq_rows(pool, table, b, n, layout):
    """Sequence b's first n rows of a codes [.., row] or scales pool, as [Hkv, n, ...]."""
    g = gather(pool[..., None] if pool.ndim == 3 else pool, table[b:b + 1], layout)[0][:, :n]
    return np.ascontiguousarray(g[..., 0] if pool.ndim == 3 else g)


def tq_reference(q, kc, ks, vc, vs, table, b, n, k_bits, v_bits, seed, layout, **options):
    """float64 decode of sequence b over the rows its codes decode to: what
    TurboQuantKVCache.attend computes over the same codes, as ([out], [lse]) with one entry per
    codebook rounding the contract allows (tq_contract.py)."""
    outs, lses = [], []
    for dt in tq_contract.CODEBOOK_DTYPES:
        k = tq_contract.decode_rows(tq_rows(kc, table, b, n, layout), tq_rows(ks, table, b, n, layout), k_bits, seed,
                                    tq.STREAM_K, dt)
        v = tq_contract.decode_rows(tq_rows(vc, table, b, n, layout), tq_rows(vs, table, b, n, layout), v_bits, seed,
                                    tq.STREAM_V, dt)
        out, lse = reference.decode_attention(q, k, v, n, return_lse=True, **options)
        outs.append(out)
        lses.append(lse)
    return outs, lses


@pytest.mark.parametrize("k_bits,v_bits,D,layout", [(4, 4, 128, "nhd"), (2, 8, 64, "hnd"), (3, 4, 256, "nhd")])
def test_tq_paged_equals_cache_decode(device, rng, k_bits, v_bits, D, layout):
    B, H, Hkv, ps, seed = 3, 4, 2, 16, 11
    lens = [1, 37, 64]
    kc, ks, vc, vs, table, _, _ = tq_pools(rng, B, Hkv, D, ps, lens, k_bits, v_bits, seed, layout)
    q = rng.standard_normal((B, H, D)).astype(np.float32)
    out, lse = tq.paged_decode(q, kc, ks, vc, vs, table, lens, k_bits=k_bits, v_bits=v_bits, seed=seed,
                               page_layout=layout, return_lse=True, device=device)
    for b, n in enumerate(lens):
        ref, ref_lse = tq_reference(q[b], kc, ks, vc, vs, table, b, n, k_bits, v_bits, seed, layout)
        # The bounds of tests/test_turboquant.py: the same codes, float32 rounding in the rotations.
        tq_contract.check(out[b], ref, tol=2e-5)
        tq_contract.assert_close_to_one(lse[b], ref_lse, 2e-5, "LSE")


def test_tq_window_softcap_out_dtype(device, rng):
    B, H, Hkv, D, ps, seed = 2, 4, 1, 64, 8, 3
    lens = [30, 13]
    kc, ks, vc, vs, table, _, _ = tq_pools(rng, B, Hkv, D, ps, lens, 4, 4, seed)
    q = rng.standard_normal((B, H, D)).astype(np.float16)
    for fused in (True, False):
        out = tq.paged_decode(q, kc, ks, vc, vs, table, lens, k_bits=4, v_bits=4, seed=seed, window=9,
                              softcap=20.0, out_dtype=np.float32, fused=fused, device=device)
        assert out.dtype == np.float32
        for b, n in enumerate(lens):
            ref, _ = tq_reference(q[b], kc, ks, vc, vs, table, b, n, 4, 4, seed, "nhd", window=9, softcap=20.0)
            tq_contract.check(out[b], ref, tol=2e-5)


# ---- bad input: each rule a PyfaError naming the argument -------------------------------------

def _args(rng, page_size=16, num_pages=6, pps=2, Hkv=2, D=64, dtype=np.float16):
    q = rng.standard_normal((2, 4, D)).astype(np.float32)
    k = rng.standard_normal((num_pages, page_size, Hkv, D)).astype(dtype)
    return q, k, k.copy(), np.array([[0, 1], [2, 3]], np.int32)[:, :pps]


def _refused(match, *args, **kw):
    with pytest.raises(pyfa.PyfaError, match=match):
        pyfa.paged_decode_attention(*args, **kw)


def test_bad_page_size_not_power_of_two(rng):
    q, k, v, t = _args(rng, page_size=12)
    _refused(r"page_size: 12 must be a power of two", q, k, v, t, [5, 5])


def test_bad_page_size_too_large(rng):
    q, k, v, t = _args(rng, page_size=2048, num_pages=4, Hkv=1)
    _refused(r"page_size: 2048 must be a power of two in 1\.\.\.1024", q[:, :2], k, v, t, [5, 5])


def test_bad_block_table_entry_out_of_range(rng):
    q, k, v, t = _args(rng)
    t[1, 1] = 6
    _refused(r"block_table\[1\]\[1\]: 6 must be in 0\.\.<num_pages \(6\)", q, k, v, t, [5, 5])


def test_bad_block_table_entry_negative(rng):
    q, k, v, t = _args(rng)
    t[0, 1] = -1
    _refused(r"block_table\[0\]\[1\]: -1 must be in 0\.\.<num_pages", q, k, v, t, [5, 5])


def test_bad_kv_len_beyond_pages(rng):
    q, k, v, t = _args(rng)
    _refused(r"kv_len\[1\]: 33 must be in 0\.\.\.pages_per_seq \* page_size \(32\)", q, k, v, t, [5, 33])


def test_bad_kv_len_negative(rng):
    q, k, v, t = _args(rng)
    _refused(r"kv_len\[0\]: -1 must be in 0\.\.\.", q, k, v, t, [-1, 3])


def test_bad_block_table_shape(rng):
    q, k, v, t = _args(rng)
    _refused(r"block_table: expected ints of shape \[batch=2", q, k, v, t[:1], [5, 5])


def test_bad_block_table_dtype(rng):
    q, k, v, t = _args(rng)
    _refused(r"block_table: expected ints", q, k, v, t.astype(np.float32), [5, 5])


def test_bad_pool_rank(rng):
    q, k, v, t = _args(rng)
    _refused(r"k_pages: expected 4-D", q, k[0], v, t, [5, 5])


def test_bad_pool_head_dim(rng):
    q, k, v, t = _args(rng)
    _refused(r"k_pages: head_dim 64 .* does not match q's 128", np.zeros((2, 4, 128), np.float32), k, v, t, [5, 5])


def test_bad_q_rank(rng):
    q, k, v, t = _args(rng)
    _refused(r"q: expected 3-D", q[0], k, v, t, [5, 5])


def test_bad_pool_dtype(rng):
    q, k, v, t = _args(rng)
    _refused(r"k_pages: dtype int32 not accepted", q, k.astype(np.int32), v, t, [5, 5])


def test_bad_pools_of_different_dtypes(rng):
    q, k, v, t = _args(rng)
    _refused(r"v_pages: dtype float32 differs", q, k, v.astype(np.float32), t, [5, 5])


def test_bad_pools_of_different_shapes(rng):
    q, k, v, t = _args(rng)
    _refused(r"v_pages: shape .* differs from k_pages'", q, k, v[:5], t, [5, 5])


def test_bad_gqa_heads(rng):
    q, k, v, t = _args(rng)
    _refused(r"num_heads: 3 must be a multiple of num_kv_heads \(2\)", q[:, :3], k, v, t, [5, 5])


def test_ring_start_not_accepted(rng):
    q, k, v, t = _args(rng)
    _refused(r"ring_start: paged sequences are not rings", q, k, v, t, [5, 5], ring_start=0)


def test_bad_page_layout(rng):
    q, k, v, t = _args(rng)
    _refused(r"page_layout: must be one of 'hnd', 'nhd' \(either case\), got 'bshd'", q, k, v, t, [5, 5],
             page_layout="bshd")
    _refused(r"page_layout: must be one of 'hnd', 'nhd' \(either case\), got 1", q, k, v, t, [5, 5], page_layout=1)


def test_page_layout_either_case(rng):
    # FlashInfer spells its layouts "NHD" / "HND": either case names the same layout.
    q, k, v, t = _args(rng)
    np.testing.assert_array_equal(pyfa.paged_decode_attention(q, k, v, t, [5, 9], page_layout="NHD"),
                                  pyfa.paged_decode_attention(q, k, v, t, [5, 9], page_layout="nhd"))


def test_bad_out_dtype(rng):
    q, k, v, t = _args(rng)
    _refused(r"out_dtype", q, k, v, t, [5, 5], out_dtype=np.int32)


def test_tq_bad_codes_row_bytes(rng):
    kc, ks, vc, vs, table, _, _ = tq_pools(rng, 2, 1, 64, 8, [5, 9], 4, 4, 0)
    q = np.zeros((2, 2, 64), np.float32)
    with pytest.raises(pyfa.PyfaError, match=r"v_codes: shape .* 16-byte rows"):
        tq.paged_decode(q, kc, ks, vc, vs, table, [5, 9], k_bits=4, v_bits=2)


def test_tq_bad_scales_shape(rng):
    kc, ks, vc, vs, table, _, _ = tq_pools(rng, 2, 1, 64, 8, [5, 9], 4, 4, 0)
    q = np.zeros((2, 2, 64), np.float32)
    with pytest.raises(pyfa.PyfaError, match=r"v_scales: shape"):
        tq.paged_decode(q, kc, ks, vc, vs[:, :4], table, [5, 9], k_bits=4, v_bits=4)


def test_tq_bad_bits(rng):
    kc, ks, vc, vs, table, _, _ = tq_pools(rng, 2, 1, 64, 8, [5, 9], 4, 4, 0)
    q = np.zeros((2, 2, 64), np.float32)
    with pytest.raises(pyfa.PyfaError, match=r"k_bits: 5 is not a TurboQuant bit width"):
        tq.paged_decode(q, kc, ks, vc, vs, table, [5, 9], k_bits=5, v_bits=4)


def test_tq_bad_block_table_entry(rng):
    kc, ks, vc, vs, table, _, _ = tq_pools(rng, 2, 1, 64, 8, [5, 9], 4, 4, 0)
    q = np.zeros((2, 2, 64), np.float32)
    table[0, 0] = kc.shape[0]
    with pytest.raises(pyfa.PyfaError, match=r"block_table\[0\]\[0\]"):
        tq.paged_decode(q, kc, ks, vc, vs, table, [5, 9], k_bits=4, v_bits=4)


# ---- CUDA: device values, read when the kernels run and clamped (paged_kv_params.h) ----------

def _cuda():
    try:
        return pyfa.Device("cuda")
    except pyfa.PyfaError:
        return None


gpu = pytest.mark.skipif(_cuda() is None, reason="no CUDA device here")


def _torch_case(rng, dtype=np.float16, layout="nhd"):
    torch = pytest.importorskip("torch")
    k, v, table = make_pool(rng, 3, 2, 128, 16, [40, 70, 16], dtype, layout, spare=3)
    q = rng.standard_normal((3, 8, 128)).astype(np.float32)
    tdt = {np.dtype(np.float16): torch.float16, np.dtype(pyfa.bfloat16): torch.bfloat16}[np.dtype(dtype)]
    to = lambda a: torch.from_numpy(a.astype(np.float32)).to(tdt).cuda()
    return torch, q, k, v, table, to(q), to(k), to(v)


@gpu
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_cuda_torch_in_place_with_device_values(rng, layout):
    torch, q, k, v, table, tq_, tk, tv = _torch_case(rng, layout=layout)
    lens = [40, 70, 16]
    out, lse = pyfa.paged_decode_attention(tq_, tk, tv, torch.from_numpy(table).cuda(),
                                           torch.tensor(lens, dtype=torch.int32).cuda(), page_layout=layout,
                                           return_lse=True, device=pyfa.Device("cuda"))
    assert isinstance(out, torch.Tensor) and out.is_cuda
    torch.cuda.synchronize()
    q16 = q.astype(np.float16)
    ref, ref_lse = reference.decode_attention(q16, gather(k, table, layout), gather(v, table, layout), lens,
                                              return_lse=True)
    np.testing.assert_allclose(out.float().cpu().numpy(), ref, atol=TOL + 2.0**-11 * np.abs(ref).max(), rtol=0)
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, atol=TOL, rtol=0)


@gpu
def test_cuda_clamps_block_table_entries_to_last_page(rng):
    torch, q, k, v, table, tq_, tk, tv = _torch_case(rng)
    bad = table.copy()
    bad[0, 1], bad[1, 2] = k.shape[0] + 5, -3  # outside 0..num_pages-1: read page num_pages - 1
    lens = [40, 70, 16]
    out = pyfa.paged_decode_attention(tq_, tk, tv, torch.from_numpy(bad).cuda(),
                                      torch.tensor(lens, dtype=torch.int32).cuda(), device=pyfa.Device("cuda"))
    torch.cuda.synchronize()
    clamped = np.where((bad < 0) | (bad >= k.shape[0]), k.shape[0] - 1, bad)
    ref = reference.decode_attention(q.astype(np.float16), gather(k, clamped, "nhd"), gather(v, clamped, "nhd"), lens)
    np.testing.assert_allclose(out.float().cpu().numpy(), ref, atol=TOL + 2.0**-11 * np.abs(ref).max(), rtol=0)


@gpu
def test_cuda_clamps_kv_len(rng):
    torch, q, k, v, table, tq_, tk, tv = _torch_case(rng)
    cap = table.shape[1] * 16
    lens = torch.tensor([cap + 100, -5, 16], dtype=torch.int32).cuda()  # above: cap; negative: empty
    out, lse = pyfa.paged_decode_attention(tq_, tk, tv, torch.from_numpy(table).cuda(), lens, return_lse=True,
                                           device=pyfa.Device("cuda"))
    torch.cuda.synchronize()
    o, l = out.float().cpu().numpy(), lse.cpu().numpy()
    ref, ref_lse = reference.decode_attention(q.astype(np.float16), gather(k, table, "nhd"), gather(v, table, "nhd"),
                                              [cap, 0, 16], return_lse=True)
    assert (o[1] == 0).all() and np.isneginf(l[1]).all()
    for b in (0, 2):
        np.testing.assert_allclose(o[b], ref[b], atol=TOL + 2.0**-11 * np.abs(ref).max(), rtol=0)
        np.testing.assert_allclose(l[b], ref_lse[b], atol=TOL, rtol=0)


@gpu
def test_cuda_tq_paged_with_device_values(rng):
    torch = pytest.importorskip("torch")
    lens = [9, 40]
    kc, ks, vc, vs, table, _, _ = tq_pools(rng, 2, 2, 128, 16, lens, 4, 4, 5)
    q = rng.standard_normal((2, 4, 128)).astype(np.float32)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()
    out = tq.paged_decode(t(q), t(kc), t(ks), t(vc), t(vs), t(table), torch.tensor(lens, dtype=torch.int32).cuda(),
                          k_bits=4, v_bits=4, seed=5, device=pyfa.Device("cuda"))
    torch.cuda.synchronize()
    for b, n in enumerate(lens):
        ref, _ = tq_reference(q[b], kc, ks, vc, vs, table, b, n, 4, 4, 5, "nhd")
        tq_contract.check(out[b].cpu().numpy(), ref, tol=2e-5)


@gpu
def test_cuda_graph_replays_device_values(rng):
    # block_table and kv_len as device int32 arrays: a captured call sees values written before each replay.
    torch, q, k, v, table, tq_, tk, tv = _torch_case(rng)
    dev = pyfa.Device("cuda")
    ttable = torch.from_numpy(table).cuda()
    lens = torch.tensor([40, 70, 16], dtype=torch.int32).cuda()
    out = torch.empty((3, 8, 128), dtype=torch.float16, device="cuda")
    pyfa.paged_decode_attention(tq_, tk, tv, ttable, lens, out=out, device=dev)  # plan made outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pyfa.paged_decode_attention(tq_, tk, tv, ttable, lens, out=out, device=dev)
    lens.copy_(torch.tensor([3, 21, 48], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.decode_attention(q.astype(np.float16), gather(k, table, "nhd"), gather(v, table, "nhd"),
                                     [3, 21, 48])
    np.testing.assert_allclose(out.float().cpu().numpy(), ref, atol=TOL + 2.0**-11 * np.abs(ref).max(), rtol=0)


def test_split_is_planned_for_the_batch_work(cpu):
    # A few long sequences among many short ones: the plan is asked for ceil(sum / max) sequences
    # of the longest length (pyfa.h, paged decode), so its split (nwg: the workspace holds
    # batch * H * nwg partial rows) is never smaller than for the batch planned as all full.
    from pyfa import _io, _plans, paged
    from pyfa._native import ffi, lib
    lens = [4096] + [16] * 7
    assert paged.length_hints(lens, 8, _io.sequence_values(lens, "kv_len", 8, None)) == (4096, 2)
    assert paged.length_hints(64, 8, _io.sequence_values(64, "kv_len", 8, None)) == (64, 8)

    def workspace(split):
        desc = ffi.new("pyfa_paged_decode_plan_desc *")
        desc.attn.batch, desc.attn.num_heads, desc.attn.num_kv_heads, desc.attn.head_dim = 8, 2, 1, 64
        desc.attn.scale = 0.125
        desc.pages.page_size, desc.pages.num_pages, desc.pages.pages_per_seq = 16, 300, 256
        desc.q_dtype = desc.kv_dtype = desc.out_dtype = lib.PYFA_DTYPE_F16
        desc.max_kv_len, desc.split_batch = 4096, split
        plan = _plans.new_plan(lib.pyfa_paged_decode_plan_new, cpu, desc)
        n = ffi.new("uint64_t *")
        assert lib.pyfa_plan_workspace_bytes(plan, n) == 0
        return n[0]

    assert workspace(2) >= workspace(8)
    with pytest.raises(pyfa.PyfaError, match=r"split_batch: 9 exceeds batch \(8\)"):
        workspace(9)


@pytest.mark.parametrize("field,value,match", [
    ("num_pages", 0, r"num_pages: must be >= 1"),
    ("pages_per_seq", 0, r"pages_per_seq: must be >= 1"),
    ("layout", 2, r"page_layout: 2 must be PYFA_PAGES_NHD \(0\) or PYFA_PAGES_HND \(1\)"),
    ("num_pages", 1 << 28, r"num_pages: num_pages \* page_size \* num_kv_heads \(\d+\) must fit 32 bits"),
    ("page_size", 0, r"page_size: 0 must be a power of two"),
])
def test_plan_refuses_bad_pages(cpu, field, value, match):
    # Pool geometry rules the Python call cannot reach with real arrays (the C ABI's plan checks them).
    from pyfa import _plans
    from pyfa._native import ffi, lib
    desc = ffi.new("pyfa_paged_decode_plan_desc *")
    desc.attn.batch, desc.attn.num_heads, desc.attn.num_kv_heads, desc.attn.head_dim = 1, 2, 2, 64
    desc.attn.scale = 0.125
    desc.pages.page_size, desc.pages.num_pages, desc.pages.pages_per_seq = 64, 4, 2
    desc.q_dtype = desc.kv_dtype = desc.out_dtype = lib.PYFA_DTYPE_F32
    setattr(desc.pages, field, value)
    with pytest.raises(pyfa.PyfaError, match=match):
        _plans.new_plan(lib.pyfa_paged_decode_plan_new, cpu, desc)


@gpu
def test_cuda_host_arrays_are_staged(rng):
    # numpy pools on the cuda device: copied in, the results copied back (the call waits).
    k, v, table = make_pool(rng, 2, 2, 64, 16, [20, 33], np.float16)
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    out, lse = pyfa.paged_decode_attention(q, k, v, table, [20, 33], return_lse=True, device=pyfa.Device("cuda"))
    ref, ref_lse = reference.decode_attention(q, gather(k, table, "nhd"), gather(v, table, "nhd"), [20, 33],
                                              return_lse=True)
    check(out, ref)
    np.testing.assert_allclose(lse, ref_lse, atol=TOL, rtol=0)
