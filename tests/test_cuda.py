"""CUDA backend specifics: availability reporting, torch / cupy arrays used in
place on the caller's stream, device-pointer checks. GPU cases skip where no
GPU (or no torch / cupy) exists; the decode numerics themselves run through
the backend-parametrised suite (tests/test_decode.py)."""
import os

import numpy as np
import pytest

import pyfa
from pyfa import reference
from pyfa._native import ffi, lib



def _cuda_opens() -> bool:
    try:
        pyfa.Device("cuda")
        return True
    except pyfa.PyfaError:
        return False


HAS_GPU = _cuda_opens()
gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA device here")

# Tolerance on max |out - ref| for 16-bit caches: the reference reads the same
# rounded K/V/q values, so only f32 accumulation order and exp2 vs exp differ
# (a few ulp of f32 on values of order 1).
TOL = 2e-5


def test_cuda_is_compiled_in():
    assert "cuda" in pyfa.backends()
    assert pyfa.backends()[-1] == "cpu"


@pytest.mark.skipif(HAS_GPU, reason="a CUDA device exists here")
def test_cuda_unavailable_says_why():
    with pytest.raises(pyfa.BackendUnavailableError, match="backend 'cuda': .+"):
        pyfa.Device("cuda")
    # The library stays usable, and "auto" falls back to the CPU.
    assert pyfa.Device("auto").backend == "cpu"


def test_set_stream_unsupported_on_cpu(cpu):
    enc = cpu.encoder()
    assert lib.pyfa_encoder_set_stream(enc, 1234) == lib.PYFA_ERR_UNSUPPORTED
    assert b"stream" in ffi.string(lib.pyfa_last_error())


def test_compile_all_rejects_bad_arch():
    assert lib.pyfa_cuda_compile_all(b"hopper", ffi.NULL) == lib.PYFA_ERR_INVALID_ARGUMENT
    assert b"arch" in ffi.string(lib.pyfa_last_error())


def _inputs(rng, B=2, H=8, Hkv=2, D=128, cap=700, dtype=np.float16):
    q = rng.standard_normal((B, H, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, cap, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, cap, D)).astype(dtype)
    return q, k, v


@gpu
def test_wrap_refuses_host_memory():
    dev = pyfa.Device("cuda")
    a = np.zeros(64, np.float32)
    with pytest.raises(pyfa.InvalidArgumentError, match="data: .*not CUDA device memory"):
        dev.wrap_device(a.ctypes.data, a.nbytes, np.float32, a.shape)


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_in_place_same_kind_out(rng, dtype):
    torch = pytest.importorskip("torch")
    dev = pyfa.Device("cuda")
    np_dtype = {"float16": np.float16, "bfloat16": pyfa.bfloat16, "float32": np.float32}[dtype]
    q, k, v = _inputs(rng, dtype=np_dtype)
    to = lambda a: torch.from_numpy(a.astype(np.float32)).to(getattr(torch, dtype)).cuda()
    tq, tk, tv = to(q), to(k), to(v)
    out = pyfa.decode_attention(tq, tk, tv, [700, 333], device=dev, out_dtype=np.float32)
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.float32
    torch.cuda.synchronize()
    ref = reference.decode_attention(q, k, v, [700, 333])
    np.testing.assert_allclose(out.cpu().numpy(), ref, atol=TOL, rtol=0)


@gpu
def test_torch_on_side_stream_and_out(rng):
    torch = pytest.importorskip("torch")
    dev = pyfa.Device("cuda")
    q, k, v = _inputs(rng)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        tq, tk, tv = (torch.from_numpy(a).cuda() for a in (q, k, v))
        out = torch.full((2, 8, 128), float("nan"), device="cuda")
        res = pyfa.decode_attention(tq, tk, tv, 512, device=dev, out=out, out_dtype=np.float32)
        # Work queued on s after pyfa's sees its result without a host sync.
        doubled = out * 2
    s.synchronize()
    assert res.data_ptr() == out.data_ptr()
    ref = reference.decode_attention(q, k, v, 512)
    np.testing.assert_allclose(doubled.cpu().numpy(), 2 * ref, atol=2 * TOL, rtol=0)


@gpu
def test_torch_mixed_with_numpy_is_rejected(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _inputs(rng)
    with pytest.raises(pyfa.InvalidArgumentError, match="mix of device"):
        pyfa.decode_attention(torch.from_numpy(q).cuda(), k, v, 10, device=pyfa.Device("cuda"))


@gpu
def test_torch_non_contiguous_is_made_contiguous(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _inputs(rng, B=1)
    tk = torch.from_numpy(np.ascontiguousarray(k.transpose(0, 1, 3, 2))).cuda().transpose(2, 3)
    assert not tk.is_contiguous()
    out = pyfa.decode_attention(torch.from_numpy(q).cuda(), tk, torch.from_numpy(v).cuda(), 600,
                                device=pyfa.Device("cuda"), out_dtype=np.float32)
    np.testing.assert_allclose(out.cpu().numpy(), reference.decode_attention(q, k, v, 600), atol=TOL, rtol=0)


@gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_cupy_in_place(rng, dtype):
    cupy = pytest.importorskip("cupy")
    q, k, v = _inputs(rng, dtype=dtype)
    out = pyfa.decode_attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), [5, 700],
                                device=pyfa.Device("cuda"), out_dtype=np.float32)
    assert isinstance(out, cupy.ndarray)
    cupy.cuda.get_current_stream().synchronize()
    np.testing.assert_allclose(cupy.asnumpy(out), reference.decode_attention(q, k, v, [5, 700]), atol=TOL, rtol=0)


@gpu
def test_shared_buffer_round_trip():
    dev = pyfa.Device("cuda")
    b = dev.buffer((4, 8), np.float32, storage="shared")
    b.numpy()[...] = np.arange(32, dtype=np.float32).reshape(4, 8)
    np.testing.assert_array_equal(b.read(), np.arange(32, dtype=np.float32).reshape(4, 8))


@gpu
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
def test_torch_prefill_and_merge_in_place(rng, mask_kind):
    """Prefill (with a GPU mask and the blk pre-pass) and merge take torch
    tensors in place and return torch tensors."""
    torch = pytest.importorskip("torch")
    dev = pyfa.Device("cuda")
    qL, kL, D = 100, 300, 128
    q = rng.standard_normal((1, 4, qL, D)).astype(pyfa.bfloat16)
    k = rng.standard_normal((1, 2, kL, D)).astype(pyfa.bfloat16)
    v = rng.standard_normal((1, 2, kL, D)).astype(pyfa.bfloat16)
    to = lambda a: torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).cuda()
    mask = None
    if mask_kind == "bool":
        mask = rng.random((qL, kL)) > 0.25
        mask[:, :128] = False  # whole blocked tiles for blk to skip
    elif mask_kind == "additive":
        mask = np.where(rng.random((qL, kL)) > 0.25, 0.0, -np.inf).astype(pyfa.bfloat16)
    tmask = None if mask is None else (torch.from_numpy(mask).cuda() if mask.dtype == bool else to(mask))
    out, lse = pyfa.attention(to(q), to(k), to(v), mask=tmask, causal=True, return_lse=True, device=dev)
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.bfloat16
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    torch.cuda.synchronize()
    ref, ref_lse = reference.attention(q, k, v, mask=mask, causal=True, return_lse=True)
    got = out.float().cpu().numpy()
    assert np.isfinite(got).all()
    # flash-attn's rule (tests/test_prefill.py): within twice the error of the same attention in bf16.
    ref16 = reference.attention(q, k, v, mask=mask, causal=True, rounding=pyfa.bfloat16)
    assert np.abs(got - ref).max() <= 2 * np.abs(ref16 - ref).max() + 2e-5
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, atol=1e-4, rtol=0)
    if mask is None:
        oa, la = pyfa.attention(to(q), to(k)[:, :, :150], to(v)[:, :, :150], return_lse=True, device=dev)
        ob, lb = pyfa.attention(to(q), to(k)[:, :, 150:], to(v)[:, :, 150:], return_lse=True, device=dev)
        o, _ = pyfa.merge_attention_states(oa, la, ob, lb, device=dev)
        assert isinstance(o, torch.Tensor)
        np.testing.assert_allclose(o.float().cpu().numpy(), reference.attention(q, k, v), atol=2e-2, rtol=0)


MERGE_CASES = [  # (B, H, H_kv, D, capacity, kv_len, kv dtype, out dtype, lse, window, softcap, ring_start)
    (1, 32, 8, 128, 4096, 4096, "bfloat16", None, False, None, 0.0, 0),
    (1, 32, 8, 128, 32768, 30001, "float16", "float32", True, None, 0.0, 0),
    (3, 16, 2, 64, 2048, 2048, "float32", None, True, 700, 0.0, 0),
    (2, 8, 8, 256, 9000, 9000, "bfloat16", "float16", False, None, 30.0, 4321),
    (1, 16, 2, 512, 16384, 16384, "float16", None, True, None, 0.0, 0),
    (4, 64, 8, 96, 1024, 1024, "float16", "bfloat16", True, 64, 0.0, 0),
]
# kv_len a power of two or the capacity: the plan sizes its split for the length's power-of-two
# bucket and the buffer ABI for the length, so both split alike (the same bits need the same nwg).


@gpu
@pytest.mark.parametrize("case", MERGE_CASES, ids=lambda c: "B{}-H{}x{}-D{}-L{}-{}".format(c[0], c[1], c[2], c[3], c[5], c[6]))
def test_split_decode_merged_in_its_last_workgroups_matches_the_reduce(rng, case):
    """A decode through a plan (torch tensors) whose split ends in its last workgroups (a launch:
    tickets) gives the bits of the same decode through the buffer ABI (numpy arrays), which ends
    with the reduce dispatch; five calls in a row, so each leaves the tickets as it found them.
    Splits of more workgroups than the CUDA plan merges (PYFA_CUDA_VEC_MERGE_LAST_MAX_NWG, 16)
    keep the reduce dispatch there too: two launches."""
    torch = pytest.importorskip("torch")
    B, H, Hkv, D, cap, L, kv_dtype, out_dtype, lse, window, softcap, ring = case
    dev = pyfa.Device("cuda")
    dt = {"float32": np.float32, "float16": np.float16, "bfloat16": pyfa.bfloat16}[kv_dtype]
    q = rng.standard_normal((B, H, D)).astype(np.float32).astype(dt)
    k, v = (rng.standard_normal((B, Hkv, cap, D)).astype(np.float32).astype(dt) for _ in range(2))
    kw = dict(scale=0.1, softcap=softcap, window=window, ring_start=ring if L == cap else 0, out_dtype=out_dtype,
              return_lse=lse)
    want = pyfa.decode_attention(q, k, v, L, device=dev, **kw)
    tt = lambda a: torch.from_numpy(a.astype(np.float32)).to(getattr(torch, kv_dtype)).cuda()  # noqa: E731
    tq, tk, tv = tt(q), tt(k), tt(v)
    before = pyfa.counters()["kernel_launches"]
    for _ in range(5):
        got = pyfa.decode_attention(tq, tk, tv, L, device=dev, **kw)
    torch.cuda.synchronize()
    launches = (pyfa.counters()["kernel_launches"] - before) / 5
    for a, b in zip(got if lse else [got], want if lse else [want]):
        np.testing.assert_array_equal(a.float().cpu().numpy(), np.asarray(b, np.float32))
    p = ffi.new("pyfa_flash_attn_vec_params *", dict(batch=B, num_heads=H, num_kv_heads=Hkv, head_dim=D,
                                                      kv_capacity=cap, window=window or 0, scale=0.1, softcap=softcap))
    assert lib.pyfa_flash_attn_vec_plan(dev.handle, p, {"float32": lib.PYFA_DTYPE_F32, "float16": lib.PYFA_DTYPE_F16,
                                                        "bfloat16": lib.PYFA_DTYPE_BF16}[kv_dtype], L,
                                        ffi.new("uint64_t *")) == lib.PYFA_OK
    merges = 1 < p.nwg <= int(os.environ.get("PYFA_CUDA_VEC_MERGE_LAST_MAX_NWG", 16))
    assert launches == (1 if merges or p.nwg == 1 else 2), f"{launches} launches per call (nwg {p.nwg})"


# (D, dtype, v broadcast over the batch): D 128 views every TMA map can take; a broadcast v
# (batch stride 0) leaves the maps out and takes the cp.async stages
@gpu
@pytest.mark.parametrize("D,dtype,broadcast", [(128, "bfloat16", False), (64, "float16", True),
                                               (256, "bfloat16", True)])
def test_strided_torch_views_are_used_in_place(rng, D, dtype, broadcast):
    """A prefill on views of torch CUDA memory (q and out transposed, k sliced from wider rows, v
    broadcast) allocates nothing through torch (no copies) and gives the contiguous call's bits."""
    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)
    B, H, Hkv, L = 2, 8, 2, 300
    t = lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dt).cuda()
    q = t(B, L, H, D).transpose(1, 2)
    k = t(B, L, Hkv, D + 16)[..., :D].transpose(1, 2)
    v = t(1, Hkv, L, D).expand(B, Hkv, L, D) if broadcast else t(B, L, Hkv, D).transpose(1, 2)
    store = torch.full((B, L, H, D), float("nan"), dtype=dt, device="cuda")
    out = store.transpose(1, 2)
    dev = pyfa.Device("cuda")
    pyfa.attention(q, k, v, causal=True, out=out, device=dev)  # the plan made
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    got = pyfa.attention(q, k, v, causal=True, out=out, device=dev)
    torch.cuda.synchronize()
    assert got is out and torch.cuda.memory_stats()["allocation.all.allocated"] == before
    whole = pyfa.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True, device=dev)
    assert torch.equal(store.transpose(1, 2), whole)


@gpu
def test_varlen_views_of_a_fused_qkv_tensor_are_used_in_place(rng):
    """varlen_attention on slices of one torch [total, H + 2 H_kv, D] projection allocates nothing
    through torch and gives the contiguous call's bits."""
    torch = pytest.importorskip("torch")
    H, Hkv, D, lens = 8, 2, 128, [5, 300, 77]
    total = sum(lens)
    qkv = torch.from_numpy(rng.standard_normal((total, H + 2 * Hkv, D)).astype(np.float32)).to(torch.bfloat16).cuda()
    q, k, v = qkv[:, :H], qkv[:, H:H + Hkv], qkv[:, H + Hkv:]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    dev = pyfa.Device("cuda")
    out = torch.empty((total, H, D), dtype=torch.bfloat16, device="cuda")
    kw = dict(max_seqlen_q=max(lens), max_seqlen_k=max(lens), causal=True, device=dev)
    pyfa.varlen_attention(q, k, v, cu, cu, out=out, **kw)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    pyfa.varlen_attention(q, k, v, cu, cu, out=out, **kw)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    assert torch.equal(out, pyfa.varlen_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, **kw))
