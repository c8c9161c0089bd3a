"""PagedKVCache and TurboQuantPagedKVCache: page allocation on demand, batched
appends of several sequences in one call, freeing and page reuse, the decode
tables, all-or-nothing appends when the pool runs out of pages, and attend
against the float64 reference of the gathered rows.

attend calls pyfa.paged_decode_attention / pyfa.turboquant.paged_decode; where
this library does not have them yet, those tests fail with an ImportError /
AttributeError naming them."""
import numpy as np
import pytest

import pyfa
from pyfa import cuda_interop
from pyfa import turboquant as tq
from pyfa._io import to_device
import tq_contract


def _host(device, a):
    if isinstance(a, np.ndarray):
        return a.copy()
    return to_device(device, cuda_interop.describe(a, "pool")).read()


def _pool_bytes(device, pool):
    return [_host(device, a).tobytes() for a in pool._pool_arrays()]


def _batch(rng, counts, Hkv, D):
    """seq_ids for `counts` {seq: n}, interleaved at random, and rows k, v for them (a sequence's
    rows are its tokens in batch order)."""
    ids = [s for s, n in counts.items() for _ in range(n)]
    rng.shuffle(ids)
    k = rng.standard_normal((len(ids), Hkv, D)).astype(np.float32)
    v = rng.standard_normal((len(ids), Hkv, D)).astype(np.float32)
    return ids, k, v


def _expected_rows(history, seq, dtype):
    """[Hkv, len, D] of the rows appended to `seq`, in order, rounded to dtype."""
    rows = [r for s, r in history if s == seq]
    return np.stack(rows, axis=1).astype(np.float32).astype(dtype)


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_dense_pool_appends_several_sequences_per_batch(device, rng, layout, page_size):
    Hkv, D = 2, 64
    pool = pyfa.PagedKVCache({1: 32, 16: 8, 64: 3}[page_size], page_size, Hkv, D, page_layout=layout, device=device)
    seqs = [pool.add_sequence() for _ in range(3)]
    history_k, history_v = [], []
    for counts in ({seqs[0]: 5, seqs[1]: 1, seqs[2]: 17}, {seqs[1]: 3}, {seqs[0]: 1, seqs[1]: 1, seqs[2]: 1}):
        ids, k, v = _batch(rng, counts, Hkv, D)
        pool.append(ids, k, v)
        history_k += list(zip(ids, k))
        history_v += list(zip(ids, v))
    lengths = {s: sum(1 for t, _ in history_k if t == s) for s in seqs}
    for s in seqs:
        assert pool.length(s) == lengths[s]
        gk, gv = pool.gather(s)
        np.testing.assert_array_equal(gk, _expected_rows(history_k, s, np.float16))
        np.testing.assert_array_equal(gv, _expected_rows(history_v, s, np.float16))
    used = sum(-(-n // page_size) for n in lengths.values())
    assert pool.free_pages == pool.num_pages - used
    table = np.asarray(_host(device, pool.block_table(seqs)))
    assert table.shape == (3, max(-(-n // page_size) for n in lengths.values()))
    live = np.concatenate([table[b, :-(-lengths[s] // page_size)] for b, s in enumerate(seqs)])
    assert len(set(live.tolist())) == used  # no page is shared between sequences
    np.testing.assert_array_equal(_host(device, pool.kv_len(seqs)), [lengths[s] for s in seqs])


def test_freed_pages_are_reused(device, rng):
    pool = pyfa.PagedKVCache(4, 16, 1, 64, dtype=np.float32, device=device)
    a, b = pool.add_sequence(), pool.add_sequence()
    pool.append([a] * 40, rng.standard_normal((40, 1, 64)), rng.standard_normal((40, 1, 64)))  # 3 pages
    assert pool.free_pages == 1 and len(pool) == 2
    pool.free_sequence(a)
    assert pool.free_pages == 4 and len(pool) == 1 and pool.sequences == [b]
    c = pool.add_sequence()
    k = rng.standard_normal((64, 1, 64)).astype(np.float32)
    pool.append([c] * 64, k, -k)  # all four pages, three of them a's
    assert pool.free_pages == 0
    gk, gv = pool.gather(c)
    np.testing.assert_array_equal(gk, k.transpose(1, 0, 2))
    np.testing.assert_array_equal(gv, -k.transpose(1, 0, 2))
    assert pool.gather(b)[0].shape == (1, 0, 64)


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("page_size,k_bits,v_bits", [(1, 4, 4), (16, 3, 8), (64, 2, 4)])
def test_turboquant_pool_matches_ring_caches(device, rng, layout, page_size, k_bits, v_bits):
    """Each sequence's codes and scales are the bytes a TurboQuantKVCache stores for its rows, and
    gather decodes them as that cache's dequantize does."""
    Hkv, D, seed = 2, 64, 11
    pool = pyfa.TurboQuantPagedKVCache({1: 32, 16: 8, 64: 3}[page_size], page_size, Hkv, D, k_bits=k_bits, v_bits=v_bits,
                                       seed=seed, norm_correction="unbiased", page_layout=layout, device=device)
    seqs = [pool.add_sequence() for _ in range(2)]
    ids, k, v = _batch(rng, {seqs[0]: 3, seqs[1]: 20}, Hkv, D)
    pool.append(ids, k, v)
    ids2, k2, v2 = _batch(rng, {seqs[0]: 2}, Hkv, D)
    pool.append(ids2, k2, v2)
    all_ids, all_k, all_v = ids + ids2, np.concatenate([k, k2]), np.concatenate([v, v2])
    for s in seqs:
        mine = [i for i, t in enumerate(all_ids) if t == s]
        ring = pyfa.TurboQuantKVCache(Hkv, D, len(mine), k_bits=k_bits, v_bits=v_bits, seed=seed,
                                      norm_correction="unbiased", device=device)
        ring.append(all_k[mine], all_v[mine])
        for got, want in zip(pool.codes(s), ring.codes()):
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
        rk, rv = ring.dequantize()
        gk, gv = pool.gather(s)
        np.testing.assert_array_equal(gk, rk.transpose(1, 0, 2))
        np.testing.assert_array_equal(gv, rv.transpose(1, 0, 2))


@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_append_past_free_pages_changes_nothing(device, rng, kind):
    make = (lambda: pyfa.PagedKVCache(3, 16, 2, 64, device=device)) if kind == "dense" else \
        (lambda: pyfa.TurboQuantPagedKVCache(3, 16, 2, 64, device=device))
    pool = make()
    a, b = pool.add_sequence(), pool.add_sequence()
    pool.append([a] * 20 + [b] * 3, rng.standard_normal((23, 2, 64)), rng.standard_normal((23, 2, 64)))
    assert pool.free_pages == 0  # a holds pages for 32 tokens, b for 16
    before, lens, table = _pool_bytes(device, pool), (pool.length(a), pool.length(b)), pool.block_table([a, b])
    table_host = np.asarray(_host(device, table)).copy()
    # b fits 13 more tokens and a 12, but not the 14th of b: nothing of the batch may land
    ids = [a] * 5 + [b] * 14
    with pytest.raises(pyfa.PyfaError, match=r"append: 19 tokens need 1 new pages, the pool has 0 free"):
        pool.append(ids, rng.standard_normal((19, 2, 64)), rng.standard_normal((19, 2, 64)))
    assert _pool_bytes(device, pool) == before
    assert (pool.length(a), pool.length(b)) == lens and pool.free_pages == 0
    assert pool.block_table([a, b]) is table
    np.testing.assert_array_equal(_host(device, pool.block_table([a, b])), table_host)
    pool.append([b] * 13 + [a] * 12, rng.standard_normal((25, 2, 64)), rng.standard_normal((25, 2, 64)))
    assert (pool.length(a), pool.length(b)) == (32, 16)


def test_failed_dispatch_returns_its_pages(rng):
    """Pages taken for an append whose dispatch the library refuses go back to the free list."""
    pool = pyfa.PagedKVCache(4, 16, 1, 64, device="cpu")
    s = pool.add_sequence()
    bad = rng.standard_normal((2, 1, 64)).astype(np.float32)
    with pytest.raises(pyfa.InvalidArgumentError, match="v: dtype float16 must equal k's"):
        pool.append([s, s], bad, bad.astype(np.float16))
    assert pool.free_pages == 4 and pool.length(s) == 0
    pool._run = lambda *a: (_ for _ in ()).throw(pyfa.ExecutionError("device fault"))
    with pytest.raises(pyfa.ExecutionError, match="device fault"):
        pool.append([s] * 17, rng.standard_normal((17, 1, 64)), rng.standard_normal((17, 1, 64)))
    assert pool.free_pages == 4 and pool.length(s) == 0


def test_decode_tables_are_kept_until_something_changes(device, rng):
    pool = pyfa.PagedKVCache(8, 4, 1, 64, device=device)
    a, b = pool.add_sequence(), pool.add_sequence()
    row = rng.standard_normal((1, 1, 64))
    pool.append([a], row, row)
    table, lens = pool.block_table([a, b]), pool.kv_len([a, b])
    assert pool.block_table([a, b]) is table and pool.kv_len([a, b]) is lens
    pool.append([a], row, row)  # same page: the table stays, kv_len changes
    assert pool.block_table([a, b]) is table and pool.kv_len([a, b]) is not lens
    np.testing.assert_array_equal(_host(device, pool.kv_len([a, b])), [2, 0])
    pool.append([b], row, row)  # a new page for b
    assert pool.block_table([a, b]) is not table
    np.testing.assert_array_equal(_host(device, pool.block_table([b, a])), [[1], [0]])
    pool.free_sequence(a)
    with pytest.raises(pyfa.InvalidArgumentError, match=r"seq_ids\[1\]: 0 is not a live sequence"):
        pool.block_table([b, a])


@pytest.mark.parametrize("make,match", [
    (lambda: pyfa.PagedKVCache(4, 3, 1, 64), r"page_size: 3 must be a power of two in 1\.\.1024"),
    (lambda: pyfa.PagedKVCache(4, 2048, 1, 64), r"page_size: .* in 1\.\.1024"),
    (lambda: pyfa.PagedKVCache(0, 16, 1, 64), r"num_pages: must be a positive int"),
    (lambda: pyfa.PagedKVCache(2**21, 1024, 4, 64), r"num_pages: .* must fit 32 bits"),
    (lambda: pyfa.PagedKVCache(4, 16, 0, 64), r"num_kv_heads: must be a positive int"),
    (lambda: pyfa.PagedKVCache(4, 16, 1, 64, dtype=np.int8), r"dtype: must be one of"),
    (lambda: pyfa.PagedKVCache(4, 16, 1, 64, page_layout="bshd"), r"page_layout: must be one of 'hnd', 'nhd' \(either case\)"),
    (lambda: pyfa.TurboQuantPagedKVCache(4, 16, 1, 100), r"head_dim: 100 is not supported by TurboQuant"),
    (lambda: pyfa.TurboQuantPagedKVCache(4, 16, 1, 64, v_bits=5), r"v_bits: 5 is not a TurboQuant bit width"),
    (lambda: pyfa.TurboQuantPagedKVCache(4, 16, 1, 64, seed=-1), r"seed: must be an int"),
])
def test_bad_construction(make, match):
    with pytest.raises(pyfa.InvalidArgumentError, match=match):
        make()


def test_bad_sequence_ids_and_rows(rng):
    pool = pyfa.PagedKVCache(4, 16, 2, 64, device="cpu")
    a = pool.add_sequence()
    rows = rng.standard_normal((2, 2, 64)).astype(np.float32)
    cases = [
        (lambda: pool.free_sequence(7), r"seq_id: 7 is not a live sequence of this pool"),
        (lambda: pool.free_sequence("a"), r"seq_id: 'a' is not a live sequence"),
        (lambda: pool.length(7), r"seq_id: 7 is not a live sequence"),
        (lambda: pool.gather(7), r"seq_id: 7 is not a live sequence"),
        (lambda: pool.append([a, 9], rows, rows), r"seq_ids\[1\]: 9 is not a live sequence"),
        (lambda: pool.append([a], rows, rows), r"seq_ids: 1 ids, k has 2 rows"),
        (lambda: pool.append([[a, a]], rows, rows), r"seq_ids: expected a 1-D sequence of sequence ids"),
        (lambda: pool.append([a, a], rows[:, :1], rows[:, :1]), r"k: expected shape \[n >= 1, num_kv_heads=2"),
        (lambda: pool.append([a, a], rows, rows[:1]), r"v: 1 tokens, k has 2"),
    ]
    for call, match in cases:
        with pytest.raises(pyfa.InvalidArgumentError, match=match):
            call()
        assert pool.length(a) == 0 and pool.free_pages == 4
    pool.free_sequence(a)
    with pytest.raises(pyfa.InvalidArgumentError, match=r"seq_id: 0 is not a live sequence"):
        pool.free_sequence(a)  # twice


def test_nbytes(device):
    assert pyfa.PagedKVCache(4, 16, 2, 64, device=device).nbytes == 2 * 4 * 16 * 2 * 64 * 2
    assert pyfa.TurboQuantPagedKVCache(4, 16, 2, 128, k_bits=4, v_bits=2, device=device).nbytes == \
        4 * 16 * 2 * (64 + 32 + 4 + 4)


# --------------------------------------------------------------------------- attend (paged decode)

def _reference(pool, q, seqs, gathered, **kw):
    out = np.zeros(q.shape)
    for b, s in enumerate(seqs):
        k, v = gathered[s]
        out[b] = pyfa.reference.decode_attention(q[b], k, v, k.shape[1], **kw)
    return out


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_dense_pool_attend_matches_reference(device, rng, layout):
    pool = pyfa.PagedKVCache(16, 16, 2, 64, dtype=np.float32, page_layout=layout, device=device)
    seqs = [pool.add_sequence() for _ in range(3)]
    ids, k, v = _batch(rng, {seqs[0]: 40, seqs[1]: 1, seqs[2]: 23}, 2, 64)
    pool.append(ids, k, v)
    q = rng.standard_normal((3, 8, 64)).astype(np.float32)
    gathered = {s: pool.gather(s) for s in seqs}
    for kw in ({}, {"softcap": 5.0, "window": 17}):
        out = pool.attend(q, seqs, **kw)
        # f32 pools and q: float32 accumulation over <= 40 keys of |v| ~ 1
        np.testing.assert_allclose(_host(device, out), _reference(pool, q, seqs, gathered, **kw), atol=2e-5, rtol=0)


def test_turboquant_pool_attend_matches_reference(device, rng):
    pool = pyfa.TurboQuantPagedKVCache(8, 16, 2, 64, device=device)
    seqs = [pool.add_sequence() for _ in range(2)]
    ids, k, v = _batch(rng, {seqs[0]: 30, seqs[1]: 7}, 2, 64)
    pool.append(ids, k, v)
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    out = pool.attend(q, seqs)
    # against the dequantised rows: the rotated-domain decode's float32 rounding (as the ring
    # cache's test_rotated_domain_decode_equals_dense_on_dequantized bounds it), with either
    # codebook rounding the contract allows (tq_contract.py)
    refs = []
    for dt in tq_contract.CODEBOOK_DTYPES:
        gathered = {}
        for s in seqs:
            kc, ks, vc, vs = pool.codes(s)
            gathered[s] = tuple(tq_contract.decode_rows(c, sc, bits, pool.seed, stream, dt) for c, sc, bits, stream in
                                ((kc, ks, pool.k_bits, tq.STREAM_K), (vc, vs, pool.v_bits, tq.STREAM_V)))
        refs.append(_reference(pool, q, seqs, gathered))
    np.testing.assert_allclose(refs[0].astype(np.float64), _reference(pool, q, seqs, {s: pool.gather(s) for s in seqs}),
                               atol=1e-6, rtol=0)  # the model's rows are gather's
    tq_contract.check(_host(device, out), refs, tol=2e-5)
