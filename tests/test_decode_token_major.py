"""decode_attention over caches in flash-attn's token-major layout ``[B, capacity, H_kv, D]``,
passed as ``k_cache.transpose(1, 2)``: read in place (as paged pools of one run of pages per
sequence), with the dense path's results and rules; other strided caches are still copied."""
import re

import numpy as np
import pytest

import pyfa
from pyfa import _plans, reference
from pyfa._native import lib

from test_decode import HALF_ULP, TOL


@pytest.fixture
def paged_runs(monkeypatch):
    """The (k, v, block table) addresses each paged decode run hands the library, and how many
    dense decode runs there were."""
    seen = {"paged": [], "dense": 0}
    original = _plans.run

    def run(device, runner, plan, enc, args, *rest, **kw):
        if runner == lib.pyfa_paged_decode_run:
            seen["paged"].append((args.k_pages.address, args.v_pages.address))
        elif runner == lib.pyfa_decode_run:
            seen["dense"] += 1
        return original(device, runner, plan, enc, args, *rest, **kw)
    monkeypatch.setattr(_plans, "run", run)
    return seen


def _at(a):
    return a.__array_interface__["data"][0]


def token_major(rng, B, Hkv, cap, D, dtype):
    """A cache ``[B, cap, Hkv, D]`` as decode_attention's ``[B, Hkv, cap, D]`` view."""
    return rng.standard_normal((B, cap, Hkv, D)).astype(dtype).transpose(0, 2, 1, 3)


def check(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape and np.isfinite(out).all()
    bound = TOL + HALF_ULP[np.dtype(dtype)] * np.abs(ref).max(initial=0)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=bound, rtol=0)


# Capacities whose largest power-of-two divisor (the page size) is 1, 8, 32 and the kernels'
# largest page (1024: capacity 3072 is three pages).
@pytest.mark.parametrize("cap", [7, 40, 96, 3072])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, pyfa.bfloat16])
def test_token_major_caches_are_read_in_place(device, rng, paged_runs, cap, dtype):
    B, H, Hkv, D = 2, 8, 4, 64
    q = rng.standard_normal((B, H, D)).astype(dtype)
    k, v = token_major(rng, B, Hkv, cap, D, dtype), token_major(rng, B, Hkv, cap, D, dtype)
    assert not k.flags.c_contiguous
    lens = [cap, max(1, cap // 3)]
    out = pyfa.decode_attention(q, k, v, lens, device=device)
    check(out, reference.decode_attention(q, np.ascontiguousarray(k), np.ascontiguousarray(v), lens), dtype)
    assert len(paged_runs["paged"]) == 1 and paged_runs["dense"] == 0
    if device.host_visible:  # the run is handed the caches' own memory
        assert paged_runs["paged"] == [(_at(k), _at(v))]


def test_options_and_one_sequence(device, rng, paged_runs):
    """window, softcap, scale, out_dtype, return_lse and out= as on the dense path; a 2-D q with
    ``[H_kv, capacity, D]`` caches; out= is the caller's array."""
    H, Hkv, D, cap = 8, 2, 128, 160
    q = rng.standard_normal((H, D)).astype(np.float16)
    k = rng.standard_normal((cap, Hkv, D)).astype(np.float16).transpose(1, 0, 2)
    v = rng.standard_normal((cap, Hkv, D)).astype(np.float16).transpose(1, 0, 2)
    kw = dict(window=50, softcap=7.0, scale=0.3)
    out = np.full((H, D), np.nan, np.float32)
    got, lse = pyfa.decode_attention(q, k, v, 131, out=out, out_dtype=np.float32, return_lse=True, device=device, **kw)
    assert got is out and lse.shape == (H,) and lse.dtype == np.float32
    dense_out, dense_lse = pyfa.decode_attention(q, np.ascontiguousarray(k), np.ascontiguousarray(v), 131,
                                                 out_dtype=np.float32, return_lse=True, device=device, **kw)
    ref = reference.decode_attention(q[None], np.ascontiguousarray(k)[None], np.ascontiguousarray(v)[None], 131, **kw)
    check(out, ref[0], np.float32)
    np.testing.assert_allclose(lse, dense_lse, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out, dense_out, atol=2 * TOL, rtol=0)
    assert len(paged_runs["paged"]) == 1


def test_kv_len_rules_hold(device, rng, paged_runs):
    """A host kv_len outside 1..capacity is refused as on the dense path, naming the entry; the
    same for lists; a wrong count and a value past int32 are refused by name."""
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    k = token_major(rng, 2, 2, 32, 64, np.float32)
    for lens, entry in ((0, "kv_len[0]: 0"), (33, "kv_len[0]: 33"), ([5, 33], "kv_len[1]: 33"),
                        ([-1, 4], "kv_len[0]: -1")):
        with pytest.raises(pyfa.PyfaError, match=re.escape(f"{entry} must be in 1...kv_capacity (32)")):
            pyfa.decode_attention(q, k, k, lens, device=device)
    with pytest.raises(pyfa.PyfaError, match="kv_len: expected 2 values"):
        pyfa.decode_attention(q, k, k, [3], device=device)
    with pytest.raises(pyfa.PyfaError, match=re.escape(f"kv_len[0]: {2**40} must be in -2147483647..2147483647")):
        pyfa.decode_attention(q, k, k, 2**40, device=device)
    assert paged_runs["paged"] == []  # refused lengths take the dense path, whose rules word the errors


def test_other_strided_caches_are_copied(device, rng, paged_runs):
    """A ring (ring_start != 0), a capacity slice of a longer cache with B > 1, and caches of
    one KV head or other strides take the dense path over copies, with its results."""
    B, H, Hkv, D = 2, 4, 2, 64
    q = rng.standard_normal((B, H, D)).astype(np.float32)
    k, v = token_major(rng, B, Hkv, 48, D, np.float32), token_major(rng, B, Hkv, 48, D, np.float32)
    kc, vc = np.ascontiguousarray(k), np.ascontiguousarray(v)
    ring = pyfa.decode_attention(q, k, v, 48, ring_start=5, device=device)
    check(ring, reference.decode_attention(q, kc, vc, 48, ring_start=5), np.float32)
    sliced = pyfa.decode_attention(q, k[:, :, :40], v[:, :, :40], 40, device=device)
    check(sliced, reference.decode_attention(q, kc[:, :, :40], vc[:, :, :40], 40), np.float32)
    fortran = np.asfortranarray(kc)
    check(pyfa.decode_attention(q, fortran, vc, 30, device=device), reference.decode_attention(q, kc, vc, 30),
          np.float32)
    assert paged_runs["paged"] == [] and paged_runs["dense"] == (3 if device.host_visible else 0)


def test_first_sequence_of_a_batch_is_read_in_place(device, rng, paged_runs):
    """B = 1 slices of a token-major batch (any batch stride) are read in place too."""
    k, v = token_major(rng, 3, 2, 64, 64, np.float16), token_major(rng, 3, 2, 64, 64, np.float16)
    q = rng.standard_normal((1, 4, 64)).astype(np.float16)
    out = pyfa.decode_attention(q, k[1:2], v[1:2], 64, device=device)
    ref = reference.decode_attention(q, np.ascontiguousarray(k[1:2]), np.ascontiguousarray(v[1:2]), 64)
    check(out, ref, np.float16)
    assert len(paged_runs["paged"]) == 1


def test_torch_cpu_token_major_cache(paged_runs):
    """torch CPU tensors (bfloat16 included) are read in place; the result is a torch tensor."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 96, 2, 64, generator=g).to(torch.bfloat16).transpose(1, 2) for _ in range(2))
    out = pyfa.decode_attention(q, k, v, [96, 17], device="cpu")
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert paged_runs["paged"] == [(k.data_ptr(), v.data_ptr())]
    host = lambda t: t.float().numpy()  # noqa: E731  (bf16 widens exactly)
    ref = reference.decode_attention(host(q), host(k.contiguous()), host(v.contiguous()), [96, 17])
    np.testing.assert_allclose(host(out), ref, atol=TOL + HALF_ULP[np.dtype(pyfa.bfloat16)] * np.abs(ref).max(), rtol=0)


def test_torch_cuda_token_major_cache_in_place_and_captured(paged_runs, monkeypatch):
    """torch CUDA caches in flash-attn's layout: the run reads their memory, a repeated call takes
    the repeat path (no pool views built, no checks repeated), and a CUDA graph that captured the
    call with a device kv_len replays like eager calls after q, the cache and kv_len change in
    place."""
    from cuda_torch import torch_and_cuda_device

    torch, dev = torch_and_cuda_device()
    B, H, Hkv, D, cap = 3, 16, 4, 128, 1536
    g = torch.Generator(device="cuda").manual_seed(5)
    fill = lambda *s: torch.randn(*s, generator=g, device="cuda").to(torch.bfloat16)  # noqa: E731
    kn, vn = fill(B, cap, Hkv, D), fill(B, cap, Hkv, D)
    q, k, v = fill(B, H, D), kn.transpose(1, 2), vn.transpose(1, 2)
    lens = torch.tensor([cap, 700, 1], dtype=torch.int32, device="cuda")
    eager = pyfa.decode_attention(q, k, v, lens, device=dev)
    assert paged_runs["paged"][0] == (k.data_ptr(), v.data_ptr())
    dense = pyfa.decode_attention(q, k.contiguous(), v.contiguous(), lens, device=dev)
    assert float((eager.float() - dense.float()).abs().max()) <= 2 ** -7 * float(dense.float().abs().max()) + 1e-3
    from pyfa import _token_major

    def no_full_path(*a, **kw):
        raise AssertionError("a repeated call took the full path")
    full_path = _token_major.pools
    monkeypatch.setattr(_token_major, "pools", no_full_path)
    again = pyfa.decode_attention(q, k, v, lens, device=dev)
    assert torch.equal(again, eager) and paged_runs["paged"][-1] == (k.data_ptr(), v.data_ptr())
    monkeypatch.setattr(_token_major, "pools", full_path)
    kc = k.clone()  # another memory of the same layout: the repeat path reads it where it is
    assert kc.stride() == k.stride() and kc.data_ptr() != k.data_ptr()
    assert torch.equal(pyfa.decode_attention(q, kc, v, lens, device=dev), eager)
    assert paged_runs["paged"][-1] == (kc.data_ptr(), v.data_ptr())
    # Paged calls of the same pool shape with a table of their own (they take the paged repeat
    # path the routed call seeded) leave the token-major calls reading their own table.
    P = cap & -cap
    pages = kn.view(B * cap // P, P, Hkv, D), vn.view(B * cap // P, P, Hkv, D)
    shuffled = torch.randperm(B * cap // P, device="cuda").to(torch.int32).view(B, cap // P)
    for _ in range(2):
        pyfa.paged_decode_attention(q, *pages, shuffled, lens, device=dev)
    assert torch.equal(pyfa.decode_attention(q, k, v, lens, device=dev), eager)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pyfa.decode_attention(q, k, v, lens, device=dev)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pyfa.decode_attention(q, k, v, lens, device=dev)
    for i, lengths in enumerate(([cap, 700, 1], [5, cap, 1000])):
        if i:
            q.copy_(fill(B, H, D))
            kn.copy_(fill(B, cap, Hkv, D))
            vn.copy_(fill(B, cap, Hkv, D))
            lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, pyfa.decode_attention(q, k, v, lens, device=dev)), f"replay {i}"
        host = lambda t: t.float().cpu().numpy()  # noqa: E731
        ref = reference.decode_attention(host(q), host(k.contiguous()), host(v.contiguous()), lengths)
        err = float(np.abs(host(out) - ref).max())
        assert err <= 1e-2, f"replay {i}: max error {err} against the reference"
