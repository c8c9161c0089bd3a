"""The repeat path of pyfa.paged_decode_attention: numpy calls repeating an earlier one's shapes,
dtypes and defaults on a host-visible device skip the Python checks and reuse the plan and run
arguments; results and rules stay those of the full path.

Tolerance: as tests/test_paged_decode.py (TOL): the kernels read the same f16 values the float64
reference reads, so only f32 accumulation differs (~1e-6 on outputs of order 1), while a stale
address or block table moves outputs by >= 1e-2."""
import numpy as np
import pytest

import pyfa
from pyfa import paged, reference

TOL = 2e-5
B, H, HKV, D, PAGE = 2, 4, 2, 64, 16


def pools(rng, num_pages=12, layout="nhd"):
    shape = (num_pages, PAGE, HKV, D) if layout == "nhd" else (num_pages, HKV, PAGE, D)
    return (rng.standard_normal(shape, dtype=np.float32).astype(np.float16),
            rng.standard_normal(shape, dtype=np.float32).astype(np.float16))


def ref(q, k, v, table, n, layout="nhd", **kw):
    """float64 decode over the pages `table` names, gathered in order."""
    pages = k[table], v[table]
    if layout == "nhd":  # [B, pps, ps, Hkv, D] -> [B, Hkv, pps * ps, D]
        kc, vc = (p.reshape(B, -1, HKV, D).transpose(0, 2, 1, 3) for p in pages)
    else:  # [B, pps, Hkv, ps, D]
        kc, vc = (p.transpose(0, 2, 1, 3, 4).reshape(B, HKV, -1, D) for p in pages)
    return reference.decode_attention(q, kc, vc, [n] * B, **kw)


def host_only(device):
    if not device.host_visible:
        pytest.skip(f"{device.backend}: numpy inputs are copied to this device (no repeat path)")


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_repeated_calls_keep_every_rule(device, rng, layout):
    host_only(device)
    paged._repeat.table = {}
    q = rng.standard_normal((B, H, D), dtype=np.float32)
    k, v = pools(rng, layout=layout)
    table = rng.permutation(12)[:8].reshape(B, 4).astype(np.int32)
    call = lambda n, t=table, q=q, k=k, v=v: pyfa.paged_decode_attention(q, k, v, t, n, page_layout=layout,
                                                                         device=device)
    first = call(40)
    assert len(paged._repeat.table) == 1, "the first call was not remembered"
    for n in (40, 33, 64, 17, 1):  # 17 and 1 are other length buckets: full path, then remembered
        got = call(n)
        assert got.dtype == q.dtype and got.shape == q.shape
        np.testing.assert_allclose(got, ref(q, k, v, table, n, layout), atol=TOL, rtol=0)
    assert len(paged._repeat.table) == 3
    np.testing.assert_array_equal(first, call(40))
    # The table is read at each call: entries rewritten in place, or a new table, are followed.
    table[:, ::-1] = table.copy()
    np.testing.assert_allclose(call(40), ref(q, k, v, table, 40, layout), atol=TOL, rtol=0)
    other = np.ascontiguousarray(table[::-1])
    np.testing.assert_allclose(call(40, other), ref(q, k, v, other, 40, layout), atol=TOL, rtol=0)
    # New arrays of the same shapes are read at their own addresses.
    q2 = q[::-1].copy()
    k2, v2 = pools(rng, layout=layout)
    np.testing.assert_allclose(call(40, q=q2, k=k2, v=v2), ref(q2, k2, v2, table, 40, layout), atol=TOL, rtol=0)
    # Bad values on a repeated call raise what the full path raises.
    bad = table.copy()
    bad[1, 2] = 12
    with pytest.raises(pyfa.PyfaError, match=r"block_table\[1\]\[2\]: 12 must be in 0\.\.<num_pages \(12\)"):
        call(40, bad)
    with pytest.raises(pyfa.PyfaError, match=r"kv_len\[0\]: 65 must be in 0\.\.\.pages_per_seq \* page_size \(64\)"):
        call(65)
    # kv_len 0 and options the repeat path does not take go the full path.
    np.testing.assert_array_equal(call(0), np.zeros_like(q))
    got = pyfa.paged_decode_attention(q, k, v, table, 40, page_layout=layout, window=8, device=device)
    np.testing.assert_allclose(got, ref(q, k, v, table, 40, layout, window=8), atol=TOL, rtol=0)
    np.testing.assert_array_equal(call(40), pyfa.paged_decode_attention(q, k, v, table.astype(np.int64), 40,
                                                                        page_layout=layout, device=device))


def test_repeat_path_is_taken_and_keys_on_the_scale(rng):
    """A matching numpy call is answered by the repeat path itself; each scale is its own entry."""
    cpu = pyfa.Device("cpu")
    paged._repeat.table = {}
    q = rng.standard_normal((B, H, D), dtype=np.float32)
    k, v = pools(rng)
    table = np.arange(8, dtype=np.int32).reshape(B, 4)
    assert paged._repeat_host(q, k, v, table, 40, "nhd", cpu, None) is None  # nothing remembered yet
    for scale in (0.5, None):
        pyfa.paged_decode_attention(q, k, v, table, 40, scale=scale, device=cpu)
        got = paged._repeat_host(q, k, v, table, 50, "nhd", cpu, scale)
        assert got is not None, "a matching call took the full path"
        np.testing.assert_allclose(got, ref(q, k, v, table, 50, scale=scale), atol=TOL, rtol=0)
    assert len(paged._repeat.table) == 2
    # Another layout, a table of another dtype or a non-contiguous pool is not a match.
    assert paged._repeat_host(q, k, v, table, 40, "hnd", cpu, None) is None
    assert paged._repeat_host(q, k, v, table.astype(np.int64), 40, "nhd", cpu, None) is None
    assert paged._repeat_host(q, k[:, ::-1], v, table, 40, "nhd", cpu, None) is None


def test_repeat_path_allocates_nothing_in_the_library(device, rng):
    host_only(device)
    q = rng.standard_normal((B, H, D), dtype=np.float32)
    k, v = pools(rng)
    table = np.arange(8, dtype=np.int32).reshape(B, 4)
    for _ in range(2):
        pyfa.paged_decode_attention(q, k, v, table, 40, device=device)
    before = pyfa.counters()
    for n in range(33, 64):
        pyfa.paged_decode_attention(q, k, v, table, n, device=device)
    after = pyfa.counters()
    assert after["plans_created"] == before["plans_created"], (before, after)
    assert after["host_allocations"] == before["host_allocations"], (before, after)


HAS_GPU = "cuda" in pyfa.available_backends()


@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device here")
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_torch_cuda_repeat_path(rng, layout):
    """torch CUDA calls repeating an earlier one's shapes and defaults take the repeat path (no plan,
    allocation, copy or wait in the library) and give what the full path gives, with kv_len an int or
    an int32 tensor, as pools and tables change in place."""
    torch = pytest.importorskip("torch")
    dev = pyfa.Device("cuda")
    paged._repeat.table = {}
    qn = rng.standard_normal((B, H, D), dtype=np.float32)
    kn, vn = pools(rng, layout=layout)
    tn = np.array([[3, 7, 1, 9], [0, 11, 4, 2]], np.int32)
    q = torch.from_numpy(qn).to("cuda", torch.float16)
    k, v, t = (torch.from_numpy(a).cuda() for a in (kn, vn, tn))
    lens = torch.tensor([50, 50], dtype=torch.int32, device="cuda")
    for n in (40, lens):
        pyfa.paged_decode_attention(q, k, v, t, n, page_layout=layout, device=dev)  # full path, remembered
        assert paged._repeat_torch(paged._repeat.table, q, k, v, t, n, layout, dev, None) is not None
    before = pyfa.counters()
    outs = {n: pyfa.paged_decode_attention(q, k, v, t, n, page_layout=layout, device=dev) for n in (33, 64)}
    outs[0] = pyfa.paged_decode_attention(q, k, v, t, lens, page_layout=layout, device=dev)
    after = pyfa.counters()
    for name in ("plans_created", "device_allocations", "pinned_allocations", "synchronizations",
                 "host_to_device_copies", "device_to_host_copies"):
        assert after[name] == before[name], (name, before, after)
    torch.cuda.synchronize()
    qh = q.float().cpu().numpy()
    for n, out in outs.items():
        assert out.dtype == torch.float16
        want = ref(qh, kn, vn, tn, n or 50, layout=layout)
        np.testing.assert_allclose(out.float().cpu().numpy(), want, atol=1e-3, rtol=0)  # f16 output: 2^-11
    # New pool contents and a new table, in place: the next repeat call reads them.
    kn2 = rng.standard_normal(kn.shape, dtype=np.float32).astype(np.float16)
    k.copy_(torch.from_numpy(kn2).cuda())
    tn2 = tn[:, ::-1].copy()
    t.copy_(torch.from_numpy(tn2).cuda())
    out = pyfa.paged_decode_attention(q, k, v, t, 64, page_layout=layout, device=dev)
    torch.cuda.synchronize()
    np.testing.assert_allclose(out.float().cpu().numpy(), ref(qh, kn2, vn, tn2, 64, layout=layout), atol=1e-3,
                               rtol=0)


@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device here")
def test_torch_cuda_host_table_and_lengths_take_the_full_path(rng):
    """A CPU block_table or kv_len tensor beside CUDA pools goes to the library as host values each
    call (the full path): a changed table is read again, and no repeat entry is kept for it."""
    torch = pytest.importorskip("torch")
    dev = pyfa.Device("cuda")
    paged._repeat.table = {}
    qn = rng.standard_normal((B, H, D), dtype=np.float32)
    kn, vn = pools(rng)
    q = torch.from_numpy(qn).to("cuda", torch.float16)
    k, v = torch.from_numpy(kn).cuda(), torch.from_numpy(vn).cuda()
    qh = q.float().cpu().numpy()
    for tn in (np.array([[3, 7, 1, 9], [0, 11, 4, 2]], np.int32), np.array([[5, 6, 8, 10], [2, 4, 11, 0]], np.int32)):
        for n in (40, torch.tensor([40, 40], dtype=torch.int32)):  # an int, a CPU tensor
            out = pyfa.paged_decode_attention(q, k, v, torch.from_numpy(tn), n, device=dev)
            torch.cuda.synchronize()
            np.testing.assert_allclose(out.float().cpu().numpy(), ref(qh, kn, vn, tn, 40), atol=1e-3, rtol=0)
    assert paged._repeat.table == {}
