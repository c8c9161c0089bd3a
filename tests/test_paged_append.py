"""Paged appends (paged_kv_params.h): kv_append_paged against a numpy model of
the pool (exact after rounding to the pool dtype), tq_quantize_paged against
the ring cache's encoder (codes and scales bit for bit), both layouts, page
sizes 1, 16 and 64, padding slots, and every rule the dispatchers and the
Python wrappers enforce."""
import numpy as np
import pytest

import pyfa
from pyfa import cuda_interop
from pyfa import turboquant as tq
from pyfa._io import to_device
from pyfa._native import ffi, lib

FLOATS = [np.float32, np.float16, pyfa.bfloat16]
SENTINEL = 7.0  # every row an append must not write keeps it


def _pool(device, shape, dtype, fill=SENTINEL):
    """A pool filled with `fill`: numpy on host-visible devices, a torch CUDA tensor on cuda."""
    host = np.full(shape, fill, dtype)
    if device.host_visible:
        return host
    torch = pytest.importorskip("torch", reason="pools on a cuda device are torch tensors here")
    t = torch.empty(shape, dtype=cuda_interop._TORCH_FROM_NP[np.dtype(dtype)](), device="cuda:0")
    to_device(device, cuda_interop.describe(t, "pool")).write(host)
    return t


def _host(device, a):
    """A host copy of a pool made by _pool."""
    if isinstance(a, np.ndarray):
        return a.copy()
    return to_device(device, cuda_interop.describe(a, "pool")).read()


def _rows_of(layout, pool, slot, page_size):
    """The [Hkv, ...] rows of flat slot `slot` in a host pool."""
    page, t = divmod(int(slot), page_size)
    return pool[page, t] if layout == "nhd" else pool[page, :, t]


def _slots(rng, n, num_slots, padding=2):
    """n distinct slots of the pool in random order, `padding` of them replaced by -1."""
    s = rng.permutation(num_slots)[:n].astype(np.int32)
    s[rng.choice(n, size=min(padding, n), replace=False)] = -1
    return s


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("src_dtype,pool_dtype", [(np.float32, np.float16), (np.float16, np.float16),
                                                  (pyfa.bfloat16, np.float32), (np.float32, pyfa.bfloat16)])
def test_dense_append_matches_numpy_model(device, rng, layout, page_size, src_dtype, pool_dtype):
    num_pages, Hkv, D, n = 3, 2, 72, 11  # D = 72: a row tail beyond the 8-lane groups
    shape = pa_shape(layout, num_pages, page_size, Hkv, D)
    k_pages, v_pages = _pool(device, shape, pool_dtype), _pool(device, shape, pool_dtype)
    n = min(n, num_pages * page_size)
    k = rng.standard_normal((n, Hkv, D)).astype(src_dtype)
    v = rng.standard_normal((n, Hkv, D)).astype(src_dtype)
    slots = _slots(rng, n, num_pages * page_size)
    pyfa.paged_kv_append(k, v, k_pages, v_pages, slots, page_layout=layout, device=device)
    want_k, want_v = np.full(shape, SENTINEL, pool_dtype), np.full(shape, SENTINEL, pool_dtype)
    for i, s in enumerate(slots):
        if s >= 0:  # widened to f32 (exact), rounded once to the pool dtype
            _rows_of(layout, want_k, s, page_size)[...] = k[i].astype(np.float32).astype(pool_dtype)
            _rows_of(layout, want_v, s, page_size)[...] = v[i].astype(np.float32).astype(pool_dtype)
    np.testing.assert_array_equal(_host(device, k_pages).view(np.uint8), want_k.view(np.uint8))
    np.testing.assert_array_equal(_host(device, v_pages).view(np.uint8), want_v.view(np.uint8))


def pa_shape(layout, num_pages, page_size, Hkv, *row):
    return (num_pages, page_size, Hkv, *row) if layout == "nhd" else (num_pages, Hkv, page_size, *row)


def _ring_codes(device, rows, bits, stream, seed, nc):
    """codes [n, Hkv, row_bytes] and scales [n, Hkv] the ring cache stores for `rows` [n, Hkv, D]."""
    n, Hkv, D = rows.shape
    cache = pyfa.TurboQuantKVCache(Hkv, D, n, k_bits=bits, v_bits=bits, seed=seed, norm_correction=nc, device=device)
    cache.append(rows, rows)
    codes, scales = cache._read(stream)
    return codes.transpose(1, 0, 2), scales.T


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("page_size,D,k_bits,v_bits,nc,src_dtype", [
    (1, 64, 4, 4, True, np.float32),
    (16, 128, 3, 8, "unbiased", np.float16),
    (64, 64, 2, 4, "none", pyfa.bfloat16),
    (16, 256, 8, 2, True, np.float32),
])
def test_tq_append_is_the_ring_caches_encoding(device, rng, layout, page_size, D, k_bits, v_bits, nc, src_dtype):
    num_pages, Hkv, seed = 2, 2, 2**40 + 3
    n = min(9, num_pages * page_size)
    geometry = (layout, num_pages, page_size, Hkv)
    k_codes = _pool(device, pa_shape(*geometry[:4], D * k_bits // 8), np.uint8, 0xA5)
    v_codes = _pool(device, pa_shape(*geometry[:4], D * v_bits // 8), np.uint8, 0xA5)
    k_scales, v_scales = (_pool(device, pa_shape(*geometry[:4]), np.float32) for _ in range(2))
    k = (rng.standard_normal((n, Hkv, D)) * 3).astype(src_dtype)
    v = rng.standard_normal((n, Hkv, D)).astype(src_dtype)
    slots = _slots(rng, n, num_pages * page_size, padding=1 if n > 1 else 0)
    tq.paged_quantize(k, v, k_codes, k_scales, v_codes, v_scales, slots, k_bits=k_bits, v_bits=v_bits, seed=seed,
                      norm_correction=nc, page_layout=layout, device=device)
    for rows, bits, stream, codes, scales in ((k, k_bits, tq.STREAM_K, k_codes, k_scales),
                                              (v, v_bits, tq.STREAM_V, v_codes, v_scales)):
        want_c, want_s = _ring_codes(device, rows, bits, stream, seed, nc)
        got_c, got_s = _host(device, codes), _host(device, scales)
        expect_c = np.full(got_c.shape, 0xA5, np.uint8)
        expect_s = np.full(got_s.shape, SENTINEL, np.float32)
        for i, s in enumerate(slots):
            if s >= 0:
                _rows_of(layout, expect_c, s, page_size)[...] = want_c[i]
                _rows_of(layout, expect_s, s, page_size)[...] = want_s[i]
        np.testing.assert_array_equal(got_c, expect_c)
        np.testing.assert_array_equal(got_s.view(np.uint32), expect_s.view(np.uint32))


def test_all_padding_writes_nothing(device, rng):
    shape = (2, 4, 1, 64)
    k_pages, v_pages = _pool(device, shape, np.float16), _pool(device, shape, np.float16)
    rows = rng.standard_normal((3, 1, 64)).astype(np.float32)
    pyfa.paged_kv_append(rows, rows, k_pages, v_pages, [-1, -5, -2**31], device=device)
    assert (_host(device, k_pages) == SENTINEL).all() and (_host(device, v_pages) == SENTINEL).all()
    codes, scales = _pool(device, (2, 4, 1, 32), np.uint8, 0), _pool(device, (2, 4, 1), np.float32)
    tq.paged_quantize(rows, rows, codes, scales, _pool(device, (2, 4, 1, 32), np.uint8, 0),
                      _pool(device, (2, 4, 1), np.float32), [-1, -1, -1], k_bits=4, v_bits=4, device=device)
    assert not _host(device, codes).any() and (_host(device, scales) == SENTINEL).all()


def test_cuda_in_place_with_device_slot_mapping(device, rng):
    """torch CUDA rows, pools and an int32 CUDA slot_mapping: written in place on the caller's
    stream (the values are device values: nothing is read on the host)."""
    if device.backend != "cuda":
        pytest.skip("needs the cuda backend (torch CUDA tensors)")
    torch = pytest.importorskip("torch")
    shape = (4, 16, 2, 128)
    k_pages = torch.zeros(shape, dtype=torch.float16, device="cuda")
    v_pages = torch.zeros_like(k_pages)
    k = torch.randn(6, 2, 128, device="cuda")
    v = torch.randn(6, 2, 128, device="cuda")
    slots = torch.tensor([3, 17, -1, 40, 63, 200], dtype=torch.int32, device="cuda")  # 200: outside, nothing
    pyfa.paged_kv_append(k, v, k_pages, v_pages, slots, device=device)
    torch.cuda.synchronize()
    flat_k, flat_v = k_pages.reshape(64, 2, 128), v_pages.reshape(64, 2, 128)
    for i, s in enumerate([3, 17, -1, 40, 63, 200]):
        if 0 <= s < 64:
            assert torch.equal(flat_k[s], k[i].half()) and torch.equal(flat_v[s], v[i].half())
    assert int((flat_k.abs().sum(dim=(1, 2)) > 0).sum()) == 4


# --------------------------------------------------------------------------- bad input

def _dense_args(rng, *, shape=(4, 16, 2, 64), n=3, dtype=np.float16):
    k = rng.standard_normal((n, shape[2], shape[3])).astype(np.float32)
    return k, k.copy(), np.zeros(shape, dtype), np.zeros(shape, dtype), np.arange(n, dtype=np.int32)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(slot_mapping=[0, 1, 64]), r"slot_mapping\[2\]: slot 64 is outside the pool"),
    (lambda a: a.update(slot_mapping=[5, 9, 5]), r"slot_mapping\[2\]: slot 5 is also token 0's"),
    (lambda a: a.update(slot_mapping=[0, 1]), r"slot_mapping: 2 values, expected one per token \(3\)"),
    (lambda a: a.update(slot_mapping=[0.0, 1.0, 2.0]), r"slot_mapping: expected a 1-D sequence of ints"),
    (lambda a: a.update(slot_mapping=[0, 1, 2**31]), r"slot_mapping: values must fit int32"),
    (lambda a: a.update(k_pages=np.zeros((4, 3, 2, 64), np.float16), v_pages=np.zeros((4, 3, 2, 64), np.float16)),
     r"page_size: 3 must be a power of two in 1\.\.\.1024"),
    (lambda a: a.update(k_pages=np.zeros((1, 2048, 2, 64), np.float16), v_pages=np.zeros((1, 2048, 2, 64), np.float16)),
     r"page_size: 2048 must be a power of two"),
    (lambda a: a.update(v_pages=np.zeros((4, 16, 2, 64), np.float32)), r"v_pages: shape .* must equal k_pages'"),
    (lambda a: a.update(k=np.zeros((3, 2, 32), np.float32)), r"k: expected shape \[n >= 1, num_kv_heads=2, head_dim=64\]"),
    (lambda a: a.update(v=np.zeros((2, 2, 64), np.float32)), r"v: 2 tokens, k has 3"),
    (lambda a: a.update(v=np.zeros((3, 2, 64), np.float16)), r"v: dtype float16 must equal k's \(float32\)"),
    (lambda a: a.update(k_pages=np.zeros((4, 16, 2, 64), np.int32)), r"k_pages: dtype int32 not accepted"),
    (lambda a: a.update(k_pages=np.zeros((4, 16, 2, 128), np.float16)[..., ::2]), r"k_pages: must be C-contiguous"),
    (lambda a: a.update(k_pages=np.zeros((4, 16, 2), np.float16)), r"k_pages: expected 4-D"),
    (lambda a: a.update(page_layout="bshd"), r"page_layout: must be one of 'hnd', 'nhd' \(either case\)"),
])
def test_dense_bad_input(rng, change, match):
    k, v, kp, vp, slots = _dense_args(rng)
    args = dict(k=k, v=v, k_pages=kp, v_pages=vp, slot_mapping=slots)
    change(args)
    layout = args.pop("page_layout", "nhd")
    before = args["k_pages"].copy()
    with pytest.raises(pyfa.InvalidArgumentError, match=match):
        pyfa.paged_kv_append(args["k"], args["v"], args["k_pages"], args["v_pages"], args["slot_mapping"],
                             page_layout=layout, device="cpu")
    np.testing.assert_array_equal(args["k_pages"], before)


def test_read_only_pool_is_refused(rng):
    k, v, kp, vp, slots = _dense_args(rng)
    kp.setflags(write=False)
    with pytest.raises(pyfa.InvalidArgumentError, match="k_pages: must be C-contiguous and writable"):
        pyfa.paged_kv_append(k, v, kp, vp, slots, device="cpu")


def _tq_args(rng, n=3, D=64, k_bits=4, v_bits=2, shape=(2, 16, 2)):
    k = rng.standard_normal((n, shape[2], D)).astype(np.float32)
    return dict(k=k, v=k.copy(), k_codes=np.zeros(shape + (D * k_bits // 8,), np.uint8),
                k_scales=np.zeros(shape, np.float32), v_codes=np.zeros(shape + (D * v_bits // 8,), np.uint8),
                v_scales=np.zeros(shape, np.float32), slot_mapping=np.arange(n, dtype=np.int32))


@pytest.mark.parametrize("change,kw,match", [
    (lambda a: a.update(slot_mapping=[31, 32, 0]), {}, r"slot_mapping\[1\]: slot 32 is outside the pool"),
    (lambda a: a.update(slot_mapping=[4, 4, -1]), {}, r"slot_mapping\[1\]: slot 4 is also token 0's"),
    (lambda a: None, {"k_bits": 5}, r"k_bits: 5 is not a TurboQuant bit width"),
    (lambda a: None, {"v_bits": 4}, r"v_codes: expected shape \[2, 16, 2, 32\]"),
    (lambda a: a.update(k_scales=np.zeros((2, 2, 16), np.float32)), {}, r"k_scales: expected shape \[2, 16, 2\]"),
    # the same arrays read as HND pools: [num_pages=2, Hkv=16, page_size=2, ...]
    (lambda a: None, {"page_layout": "hnd"}, r"k: expected shape \[n >= 1, num_kv_heads=16, head_dim=64\]"),
    (lambda a: a.update(k=np.zeros((3, 2, 48), np.float32), v=np.zeros((3, 2, 48), np.float32)), {},
     r"head_dim: 48 is not supported by TurboQuant"),
    (lambda a: a.update(k_scales=np.zeros((2, 16, 2), np.float64)), {}, r"k_scales: dtype float64 not accepted"),
    (lambda a: None, {"norm_correction": "sometimes"}, r"norm_correction: must be a bool or one of"),
    (lambda a: None, {"seed": -1}, r"seed: must be an int in \[0, 2\*\*64\)"),
])
def test_tq_bad_input(rng, change, kw, match):
    args = _tq_args(rng)
    change(args)
    kwargs = {"k_bits": 4, "v_bits": 2, "device": "cpu", **kw}
    with pytest.raises(pyfa.InvalidArgumentError, match=match):
        tq.paged_quantize(**args, **kwargs)
    assert not args["k_codes"].any() and not args["k_scales"].any()


def _c_params(ctype, **fields):
    base = {"pages": {"page_size": 16, "num_pages": 2, "layout": lib.PYFA_PAGES_NHD},
            "num_tokens": 2, "num_kv_heads": 1, "head_dim": 64}
    return ffi.new(ctype, {**base, **fields})


def _run_dense(cpu, params, src_k, src_v, k_pages, v_pages, slots):
    enc = cpu.encoder()
    status = lib.pyfa_kv_append_paged(enc, params, *(b.handle if b is not None else ffi.NULL
                                                     for b in (src_k, src_v, k_pages, v_pages, slots)))
    return status, ffi.string(lib.pyfa_last_error()).decode()


@pytest.mark.parametrize("fields,match", [
    ({"pages": {"page_size": 1024, "num_pages": 2**21, "layout": 0}, "num_kv_heads": 4},
     r"num_pages: num_pages \* page_size \* num_kv_heads = 8589934592 must fit 32 bits"),
    ({"pages": {"page_size": 1024, "num_pages": 2**32 - 1, "layout": 0}, "num_kv_heads": 2**32 - 1},
     r"num_pages: num_pages \* page_size \* num_kv_heads = more than 2\^64 must fit 32 bits"),
    ({"pages": {"page_size": 16, "num_pages": 0, "layout": 0}}, r"num_pages: must be >= 1"),
    ({"pages": {"page_size": 0, "num_pages": 2, "layout": 0}}, r"page_size: 0 must be a power of two"),
    ({"pages": {"page_size": 16, "num_pages": 2, "layout": 2}}, r"page_layout: 2 must be 0 \(NHD\) or 1 \(HND\)"),
    ({"num_tokens": 0}, r"num_tokens: must be > 0"),
    ({"head_dim": 0}, r"head_dim: must be > 0"),
    ({"num_kv_heads": 0}, r"num_kv_heads: must be > 0"),
    ({"reserved": 1}, r"reserved: must be 0"),
])
def test_dense_c_abi_rules(cpu, fields, match):
    src = cpu.wrap(np.zeros((2, 1, 64), np.float32))
    pools = [cpu.wrap(np.zeros((2, 16, 1, 64), np.float16)) for _ in range(2)]
    status, msg = _run_dense(cpu, _c_params("pyfa_kv_append_paged_params *", **fields), src, src, *pools,
                             cpu.wrap(np.arange(2, dtype=np.int32)))
    assert status == lib.PYFA_ERR_INVALID_ARGUMENT and __import__("re").search(match, msg), msg


def test_dense_c_abi_buffers(cpu):
    p = _c_params("pyfa_kv_append_paged_params *")
    pool_array = np.zeros((2, 16, 1, 64), np.float16)
    pool, other = cpu.wrap(pool_array), cpu.wrap(np.zeros((2, 16, 1, 64), np.float16))
    src = cpu.wrap(np.zeros((2, 1, 64), np.float32))
    slots = cpu.wrap(np.arange(2, dtype=np.int32))
    cases = [
        ((src, src, pool, other, None), "slot_mapping: buffer is NULL"),
        ((src, src, pool, other, cpu.wrap(np.arange(2, dtype=np.uint32))), "slot_mapping: dtype u32 not accepted"),
        ((src, src, pool, other, cpu.wrap(np.arange(1, dtype=np.int32))), "slot_mapping: buffer holds 1 elements"),
        ((src, cpu.wrap(np.zeros((2, 1, 64), np.float16)), pool, other, slots), "src_v: dtype f16 must equal src_k's"),
        ((src, src, pool, cpu.wrap(np.zeros((2, 16, 1, 64), np.float32)), slots), "v_pages: dtype f32 must equal"),
        ((src, src, pool, cpu.wrap(np.zeros((2, 16, 1, 32), np.float16)), slots), "v_pages: buffer holds 1024"),
        ((cpu.wrap(pool_array[0, :2].reshape(2, 1, 64)), cpu.wrap(np.zeros((2, 1, 64), np.float16)), pool, other,
          slots), "k_pages: overlaps src_k"),
        ((src, src, pool, pool, slots), "k_pages: overlaps v_pages"),
    ]
    for buffers, match in cases:
        status, msg = _run_dense(cpu, p, *buffers)
        assert status == lib.PYFA_ERR_INVALID_ARGUMENT and match in msg, (match, msg)


def test_tq_c_abi_rules(cpu):
    src = cpu.wrap(np.zeros((2, 1, 64), np.float32))
    outs = [cpu.wrap(np.zeros(s, dt)) for s, dt in (((2, 16, 1, 32), np.uint8), ((2, 16, 1), np.float32),
                                                     ((2, 16, 1, 32), np.uint8), ((2, 16, 1), np.float32))]
    slots = cpu.wrap(np.arange(2, dtype=np.int32))
    base = dict(k_bits=4, v_bits=4, norm_correction=1)
    for fields, match in [({"head_dim": 96}, "head_dim: 96 is not supported by TurboQuant"),
                          ({"v_bits": 6}, "v_bits: 6 is not a TurboQuant bit width"),
                          ({"norm_correction": 3}, "norm_correction: 3 must be 0"),
                          ({"v_bits": 8}, "v_codes: buffer holds 1024 elements, needs 2048")]:
        p = _c_params("pyfa_tq_quantize_paged_params *", **{**base, **fields})
        enc = cpu.encoder()
        status = lib.pyfa_tq_quantize_paged(enc, p, src.handle, src.handle, *(b.handle for b in outs), slots.handle)
        msg = ffi.string(lib.pyfa_last_error()).decode()
        assert status == lib.PYFA_ERR_INVALID_ARGUMENT and match in msg, (match, msg)


@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_device_slots_outside_the_pool_write_nothing(device, rng, kind):
    """paged_kv_params.h's rule for values the kernel reads: slot_mapping rewritten after the
    append was recorded (as a GPU array changes between graph replays) is not checked again, and
    a slot outside the pool writes nothing while the in-range tokens land."""
    n, shape = 4, (2, 16, 1)
    src = to_device(device, rng.standard_normal((n, 1, 64)).astype(np.float32))
    slots = device.buffer((n,), np.int32, storage="shared")
    slots.numpy()[:] = [0, 1, 2, 3]
    enc = device.encoder()
    if kind == "dense":
        pools = [device.buffer(shape + (64,), np.float32, storage="private") for _ in range(2)]
        p = _c_params("pyfa_kv_append_paged_params *", num_tokens=n)
        for b in pools:
            b.write(np.full(shape + (64,), SENTINEL, np.float32))
        check_status = lib.pyfa_kv_append_paged(enc, p, src.handle, src.handle, pools[0].handle, pools[1].handle,
                                                slots.handle)
    else:
        pools = [device.buffer(shape + (32,), np.uint8, storage="private"), device.buffer(shape, np.float32, storage="private"),
                 device.buffer(shape + (32,), np.uint8, storage="private"), device.buffer(shape, np.float32, storage="private")]
        for b in pools:
            b.write(np.zeros(b.shape, b.dtype))
        p = _c_params("pyfa_tq_quantize_paged_params *", num_tokens=n, k_bits=4, v_bits=4, norm_correction=1)
        check_status = lib.pyfa_tq_quantize_paged(enc, p, src.handle, src.handle, *(b.handle for b in pools),
                                                  slots.handle)
    assert check_status == lib.PYFA_OK, ffi.string(lib.pyfa_last_error()).decode()
    slots.numpy()[:] = [32, 5, -1, 2**31 - 1]  # only token 1 has a slot of the pool
    assert lib.pyfa_encoder_commit(enc) == lib.PYFA_OK and lib.pyfa_encoder_wait(enc) == lib.PYFA_OK
    flat = [b.read().reshape(32, -1) for b in pools]
    written = [np.flatnonzero((f != (SENTINEL if kind == "dense" else 0)).any(axis=1)).tolist() for f in flat]
    assert all(w == [5] for w in written), written


def test_torch_cpu_pools_are_written_in_place(rng):
    torch = pytest.importorskip("torch", reason="torch CPU tensors as pools")
    k_pages = torch.zeros((2, 4, 1, 64), dtype=torch.bfloat16)
    v_pages = torch.zeros_like(k_pages)
    k = torch.randn(2, 1, 64)
    pyfa.paged_kv_append(k, -k, k_pages, v_pages, [6, 1], device="cpu")
    assert torch.equal(k_pages.reshape(8, 1, 64)[6], k[0].bfloat16())
    assert torch.equal(v_pages.reshape(8, 1, 64)[1], -k[1].bfloat16())
    assert int((k_pages.reshape(8, -1) != 0).any(dim=1).sum()) == 2
    with pytest.raises(pyfa.InvalidArgumentError, match="k_pages: must be a contiguous torch tensor"):
        strided = torch.zeros((2, 4, 2, 64)).transpose(1, 2)  # an HND view of NHD memory
        pyfa.paged_kv_append(k, k, strided, strided.clone(), [0, 1], device="cpu")


# --------------------------------------------------------------------------- plan / run form

def _plan_desc(**fields):
    base = {"pages": {"page_size": 16, "num_pages": 2, "layout": lib.PYFA_PAGES_NHD}, "num_kv_heads": 1,
            "head_dim": 64, "src_dtype": lib.PYFA_DTYPE_F32, "pool_dtype": lib.PYFA_DTYPE_F16}
    return ffi.new("pyfa_paged_append_plan_desc *", {**base, **fields})


def _new_plan(dev, desc):
    out = ffi.new("pyfa_plan **")
    status = lib.pyfa_paged_append_plan_new(out, dev.handle, desc)
    return status, (ffi.gc(out[0], lib.pyfa_plan_free) if status == lib.PYFA_OK else
                    ffi.string(lib.pyfa_last_error()).decode())


def _tensor(t, a):
    t.address = int(ffi.cast("uintptr_t", ffi.from_buffer(a))) if a is not None else 0
    t.nbytes = a.nbytes if a is not None else 0


@pytest.mark.parametrize("fields,match", [
    ({"reserved": 1}, "reserved: must be 0"),
    ({"src_dtype": lib.PYFA_DTYPE_U8}, "src_dtype: u8 is not one of f32, f16, bf16"),
    ({"pool_dtype": lib.PYFA_DTYPE_I32}, "pool_dtype: i32 is not one of f32, f16, bf16 (dense pools)"),
    ({"v_bits": 4}, "v_bits: dense pools (k_bits 0) take no TurboQuant options"),
    ({"k_bits": 4, "v_bits": 4}, "pool_dtype: f16 must be u8 for TurboQuant pools"),
    ({"k_bits": 4, "v_bits": 7, "pool_dtype": lib.PYFA_DTYPE_U8}, "v_bits: 7 is not a TurboQuant bit width"),
    ({"k_bits": 4, "v_bits": 4, "pool_dtype": lib.PYFA_DTYPE_U8, "head_dim": 80},
     "head_dim: 80 is not supported by TurboQuant"),
    ({"pages": {"page_size": 6, "num_pages": 2, "layout": 0}}, "page_size: 6 must be a power of two"),
])
def test_plan_rules(cpu, fields, match):
    status, msg = _new_plan(cpu, _plan_desc(**fields))
    assert status == lib.PYFA_ERR_INVALID_ARGUMENT and match in msg, msg


@pytest.mark.parametrize("tq_pool", [False, True], ids=["dense", "tq"])
def test_plan_run_writes_what_the_buffer_form_writes(device, rng, tq_pool):
    """The plan's run on host memory (CPU, Metal) against the functional wrappers' buffer form."""
    if not device.host_visible:
        pytest.skip("runs on host memory (the pools' tests cover the run on a GPU)")
    k = rng.standard_normal((3, 1, 64)).astype(np.float32)
    v = rng.standard_normal((3, 1, 64)).astype(np.float32)
    slots = np.array([20, -1, 3], np.int32)
    if tq_pool:
        pools = [np.zeros((2, 16, 1, 32), np.uint8), np.zeros((2, 16, 1), np.float32),
                 np.zeros((2, 16, 1, 16), np.uint8), np.zeros((2, 16, 1), np.float32)]
        want = [a.copy() for a in pools]
        tq.paged_quantize(k, v, *want, slots, k_bits=4, v_bits=2, seed=9, norm_correction="none", device=device)
        desc = _plan_desc(k_bits=4, v_bits=2, seed_lo=9, pool_dtype=lib.PYFA_DTYPE_U8)
        fields = ("k_pages", "k_scales", "v_pages", "v_scales")
    else:
        pools = [np.zeros((2, 16, 1, 64), np.float16) for _ in range(2)]
        want = [a.copy() for a in pools]
        pyfa.paged_kv_append(k, v, *want, slots, device=device)
        desc, fields = _plan_desc(), ("k_pages", "v_pages")
    status, plan = _new_plan(device, desc)
    assert status == lib.PYFA_OK, plan
    args = ffi.new("pyfa_paged_append_run_args *")
    for field, a in zip(("k", "v") + fields, [k, v] + pools):
        _tensor(getattr(args, field), a)
    _tensor(args.slot_mapping.device, slots)
    args.num_tokens, args.flags = 3, lib.PYFA_RUN_FINISH
    enc = device.encoder()
    assert lib.pyfa_paged_append_run(plan, enc, args) == lib.PYFA_OK, ffi.string(lib.pyfa_last_error()).decode()
    for got, w in zip(pools, want):
        np.testing.assert_array_equal(got.view(np.uint8), w.view(np.uint8))
    assert any(p.any() for p in pools)


def test_plan_run_rules(cpu):
    status, plan = _new_plan(cpu, _plan_desc())
    assert status == lib.PYFA_OK, plan
    k = np.zeros((2, 1, 64), np.float32)
    pools = [np.zeros((2, 16, 1, 64), np.float16) for _ in range(2)]

    def run(change, slots=(0, 1), host=False):
        args = ffi.new("pyfa_paged_append_run_args *")
        s = np.array(slots, np.int32)
        for field, a in zip(("k", "v", "k_pages", "v_pages"), [k, k] + pools):
            _tensor(getattr(args, field), a)
        if host:  # values the library reads during the run and sends with the launch
            args.slot_mapping.host = host_values = ffi.new("int32_t[]", list(slots))  # noqa: F841 (kept alive)
        else:
            _tensor(args.slot_mapping.device, s)
        args.num_tokens = 2
        change(args)
        status = lib.pyfa_paged_append_run(plan, cpu.encoder(), args)
        return status, ffi.string(lib.pyfa_last_error()).decode()

    small = np.zeros(8, np.float16)
    for change, slots, match in [
        (lambda a: setattr(a, "num_tokens", 0), (0, 1), "num_tokens: must be > 0"),
        (lambda a: setattr(a.k, "address", 0), (0, 1), "k: address is 0"),
        (lambda a: _tensor(a.v_pages, small), (0, 1), "v_pages: 16 bytes cannot hold 2048 f16 values"),
        (lambda a: _tensor(a.k_scales, small), (0, 1), "k_scales: dense pools take no scales"),
        (lambda a: setattr(a, "flags", 2), (0, 1), "flags: unknown bits 0x2"),
        (lambda a: None, (7, 7), "slot_mapping[1]: slot 7 is also token 0's"),
        (lambda a: None, (32, 0), "slot_mapping[0]: slot 32 is outside the pool"),
    ]:
        status, msg = run(change, slots)
        assert status == lib.PYFA_ERR_INVALID_ARGUMENT and match in msg, (match, msg)
    for slots, match in [((7, 7), "slot_mapping[1]: slot 7 is also token 0's"),
                         ((32, 0), "slot_mapping[0]: slot 32 is outside the pool")]:
        status, msg = run(lambda a: None, slots, host=True)
        assert status == lib.PYFA_ERR_INVALID_ARGUMENT and match in msg, (match, msg)
    assert not pools[0].any()
    # Host slot values write where device memory does (-1: padding, nothing written).
    k[...] = 1.0
    status, msg = run(lambda a: setattr(a, "flags", lib.PYFA_RUN_FINISH), (3, -1), host=True)
    assert status == lib.PYFA_OK, msg
    assert pools[0][0, 3].any() and not pools[0][0, 4:].any() and not pools[0][0, :3].any()
