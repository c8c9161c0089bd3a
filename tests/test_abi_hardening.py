"""The C ABI survives any input: sizes that overflow, lengths rewritten
between recording and commit, freed / forged / wrong-type handles. A trap or
a stray read would kill the pytest process, so each test passing proves the
process stayed alive; each also checks the error names the argument."""
import numpy as np
import pytest

import pyfa
from pyfa._io import to_device
from pyfa._native import ffi, lib
from pyfa.errors import check


def on_device(dev, a):
    """A buffer holding `a`: the array itself on host-visible devices, a copy
    on a GPU (the way the Python API passes host arrays)."""
    return to_device(dev, np.ascontiguousarray(a))

U32_MAX = 2**32 - 1


def _error(status):
    assert status == lib.PYFA_ERR_INVALID_ARGUMENT, status
    return ffi.string(lib.pyfa_last_error()).decode()


def _bufs(dev, *specs):
    return [dev.buffer(shape, dtype) for shape, dtype in specs]


# ---- item 1: sizes, grids and byte counts that overflow ----

def test_vec_plan_heads_product_overflows_32_bits(dev):
    p = ffi.new("pyfa_flash_attn_vec_params *", dict(batch=65536, num_heads=65536, num_kv_heads=65536, head_dim=64,
                                                     kv_capacity=16, scale=0.125))
    tmp = ffi.new("uint64_t *")
    assert "batch * num_heads: 65536 * 65536 exceeds" in _error(
        lib.pyfa_flash_attn_vec_plan(dev.handle, p, lib.PYFA_DTYPE_F16, 4, tmp))


def test_vec_plan_tmp_bytes_overflow(dev):
    p = ffi.new("pyfa_flash_attn_vec_params *", dict(batch=2**31, num_heads=2**31, num_kv_heads=1, head_dim=64,
                                                     kv_capacity=16, nwg=2, scale=0.125))
    tmp = ffi.new("uint64_t *")
    assert "batch * num_heads" in _error(lib.pyfa_flash_attn_vec_plan(dev.handle, p, lib.PYFA_DTYPE_F16, 4, tmp))
    # Within 32 bits of rows, the byte count still overflows nothing: a plain size.
    p = ffi.new("pyfa_flash_attn_vec_params *", dict(batch=65535, num_heads=65535, num_kv_heads=65535, head_dim=512,
                                                     kv_capacity=1, nwg=1024, scale=0.125))
    assert lib.pyfa_flash_attn_vec_plan(dev.handle, p, lib.PYFA_DTYPE_F16, 1, tmp) == 0
    assert tmp[0] == 65535 * 65535 * 1024 * 514 * 4


def test_vec_q_size_overflow(dev):
    q, k, lens, ring, tmp, out = _bufs(dev, ((64,), np.float32), ((64,), np.float16), ((1,), np.int32),
                                       ((1,), np.int32), ((64,), np.float32), ((64,), np.float32))
    p = ffi.new("pyfa_flash_attn_vec_params *", dict(batch=U32_MAX, num_heads=U32_MAX, num_kv_heads=1, head_dim=64,
                                                     kv_capacity=1, nwg=1, scale=0.125))
    msg = _error(lib.pyfa_flash_attn_vec(dev.encoder(), p, q.handle, k.handle, k.handle, lens.handle, ring.handle,
                                         tmp.handle, out.handle, ffi.NULL))
    assert "batch * num_heads" in msg


def test_vec_tq_q_size_overflow(dev):
    q, codes, scales, lens, ring, tmp, out = _bufs(
        dev, ((64,), np.float32), ((32,), np.uint8), ((1,), np.float32), ((1,), np.int32), ((1,), np.int32),
        ((64,), np.float32), ((64,), np.float32))
    attn = dict(batch=U32_MAX, num_heads=U32_MAX, num_kv_heads=1, head_dim=64, kv_capacity=1, nwg=1, scale=0.125)
    p = ffi.new("pyfa_flash_attn_vec_tq_params *", {"attn": attn, "k_bits": 4, "v_bits": 4})
    msg = _error(lib.pyfa_flash_attn_vec_tq(dev.encoder(), p, q.handle, codes.handle, scales.handle, codes.handle,
                                            scales.handle, lens.handle, ring.handle, tmp.handle, out.handle,
                                            ffi.NULL))
    assert "batch * num_heads" in msg


def test_prefill_lse_size_overflow(dev):
    q, out, lse = _bufs(dev, ((64,), np.float32), ((64,), np.float32), ((16,), np.float32))
    p = ffi.new("pyfa_flash_attn_prefill_params *", dict(
        batch=U32_MAX, num_heads=U32_MAX, num_kv_heads=1, head_dim=64, q_len=2**31 - 1, kv_len=16, scale=0.125))
    msg = _error(lib.pyfa_flash_attn_prefill(dev.encoder(), p, q.handle, q.handle, q.handle, ffi.NULL, ffi.NULL,
                                             out.handle, lse.handle))
    assert msg.startswith("lse: size overflows")


def test_merge_rows_overflow(dev):
    o, lse = _bufs(dev, ((64,), np.float32), ((16,), np.float32))
    p = ffi.new("pyfa_merge_attn_params *", dict(batch=U32_MAX, num_heads=U32_MAX, seq_len=U32_MAX, head_dim=64))
    msg = _error(lib.pyfa_merge_attention_states(dev.encoder(), p, o.handle, lse.handle, o.handle, lse.handle,
                                                 o.handle, lse.handle))
    assert msg.startswith("lse_a: size overflows")


@pytest.mark.parametrize("heads", [1, 4])
def test_turboquant_cache_size_overflow(dev, heads):
    src, codes, scales, out = _bufs(dev, ((64 * heads,), np.float32), ((32,), np.uint8), ((1,), np.float32),
                                    ((64 * heads,), np.float32))
    common = dict(num_tokens=1, num_kv_heads=heads, head_dim=64, kv_capacity=2**30, bits=4, stream=0,
                  sequence=U32_MAX)
    p = ffi.new("pyfa_tq_quantize_params *", dict(common, write_pos=0))
    assert "codes: size overflows" in _error(
        lib.pyfa_hadamard_quantize_kv(dev.encoder(), p, src.handle, codes.handle, scales.handle))
    p = ffi.new("pyfa_tq_dequantize_params *", dict(common, first_slot=0))
    assert "codes: size overflows" in _error(
        lib.pyfa_tq_dequantize_kv(dev.encoder(), p, codes.handle, scales.handle, out.handle))


# ---- item 2: kv_len / ring_start rewritten after recording ----

H, HKV, D, CAP = 4, 2, 64, 32


def _record_vec(dev, k, v, q, lens, ring, nwg, tq=None):
    """Records one decode (dense, or TurboQuant with tq = (codes, scales) per
    stream) and returns (encoder, kv_len buffer, ring_start buffer, out buffer)."""
    kvl, rs = on_device(dev, np.array(lens, np.int32)), on_device(dev, np.array(ring, np.int32))
    out = dev.buffer((1, H, D), np.float32)
    attn = dict(batch=1, num_heads=H, num_kv_heads=HKV, head_dim=D, kv_capacity=CAP, nwg=nwg, scale=0.125)
    enc = dev.encoder()
    qb = on_device(dev, q)
    if tq is None:
        tmp = dev.buffer((H * nwg * (D + 2),), np.float32)
        p = ffi.new("pyfa_flash_attn_vec_params *", attn)
        check(lib.pyfa_flash_attn_vec(enc, p, qb.handle, k.handle, v.handle, kvl.handle, rs.handle, tmp.handle,
                                      out.handle, ffi.NULL))
    else:
        (kc, ks), (vc, vs) = tq
        p = ffi.new("pyfa_flash_attn_vec_tq_params *", {"attn": attn, "k_bits": 4, "v_bits": 4, "seed_lo": 3,
                                                        "fused": 1})
        tmp_bytes = ffi.new("uint64_t *")
        check(lib.pyfa_flash_attn_vec_tq_plan(dev.handle, p, CAP, tmp_bytes))
        tmp = dev.buffer((tmp_bytes[0] // 4,), np.float32)
        check(lib.pyfa_flash_attn_vec_tq(enc, p, qb.handle, kc.handle, ks.handle, vc.handle, vs.handle,
                                         kvl.handle, rs.handle, tmp.handle, out.handle, ffi.NULL))
    return enc, kvl, rs, out, (qb, tmp)


def _run(enc, out):
    check(lib.pyfa_encoder_commit(enc))
    check(lib.pyfa_encoder_wait(enc))
    return out.read()


def _caches(dev, rng, tq):
    if not tq:
        k, v = (on_device(dev, rng.standard_normal((1, HKV, CAP, D)).astype(np.float16)) for _ in range(2))
        return dict(k=k, v=v)
    caches = []
    for _ in range(2):
        codes = on_device(dev, rng.integers(0, 256, (1, HKV, CAP, D // 2), dtype=np.uint8))
        scales = on_device(dev, rng.uniform(0.5, 2.0, (1, HKV, CAP)).astype(np.float32))
        caches.append((codes, scales))
    dummy = dev.buffer((1,), np.float16)
    return dict(k=dummy, v=dummy, tq=caches)


@pytest.mark.parametrize("tq", [False, True], ids=["dense", "tq"])
@pytest.mark.parametrize("nwg", [1, 3])
@pytest.mark.parametrize("field,value,clamped", [
    ("kv_len", 2**31 - 1, dict(lens=[CAP], ring=[0])),   # above kv_capacity: kv_capacity
    ("kv_len", 2**31, dict(lens=None, ring=[0])),         # negative as int32: no visible key (out = 0)
    ("ring_start", 2**30, dict(lens=[4], ring=[0])),      # at or above kv_capacity: 0
])
def test_lengths_rewritten_after_recording_are_clamped(device, rng, tq, nwg, field, value, clamped):
    """pyfa_params.h's rule: kernels clamp kv_len / ring_start as they read them."""
    c = _caches(device, rng, tq)
    q = rng.standard_normal((1, H, D)).astype(np.float32)
    enc, kvl, rs, out, keep = _record_vec(device, c["k"], c["v"], q, [4], [0], nwg, c.get("tq"))
    (kvl if field == "kv_len" else rs).write(np.array([value], np.uint32).view(np.int32))
    got = _run(enc, out)
    if clamped["lens"] is None:
        np.testing.assert_array_equal(got, np.zeros_like(got))
        return
    enc2, _, _, out2, keep2 = _record_vec(device, c["k"], c["v"], q, clamped["lens"], clamped["ring"], nwg,
                                          c.get("tq"))
    want = _run(enc2, out2)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got, want)


# ---- item 4: handles ----

def _raw_buffer(dev):
    out = ffi.new("pyfa_buffer **")
    check(lib.pyfa_buffer_new(out, dev.handle, lib.PYFA_DTYPE_F32, 1, [4], 0))
    return out[0]


def _raw_encoder(dev):
    out = ffi.new("pyfa_encoder **")
    check(lib.pyfa_encoder_new(out, dev.handle))
    return out[0]


def test_freed_buffer_is_an_error(dev):
    b = _raw_buffer(dev)
    lib.pyfa_buffer_free(b)
    dst = ffi.new("char[16]")
    assert "buffer: not a live handle" in _error(lib.pyfa_buffer_read(b, 0, dst, 16))
    assert lib.pyfa_buffer_contents(b) == ffi.NULL
    assert lib.pyfa_buffer_nbytes(b) == 0
    assert lib.pyfa_buffer_dtype(b) == -1


def test_double_free_is_ignored(dev):
    b = _raw_buffer(dev)
    lib.pyfa_buffer_free(b)
    lib.pyfa_buffer_free(b)
    assert "not a live handle" in ffi.string(lib.pyfa_last_error()).decode()
    e = _raw_encoder(dev)
    lib.pyfa_encoder_free(e)
    lib.pyfa_encoder_free(e)


def test_commit_on_freed_encoder_is_an_error(dev):
    e = _raw_encoder(dev)
    lib.pyfa_encoder_free(e)
    assert "encoder: not a live handle" in _error(lib.pyfa_encoder_commit(e))
    assert "encoder: not a live handle" in _error(lib.pyfa_encoder_wait(e))


def test_wrong_type_handles(dev):
    enc = dev.encoder()
    b = dev.buffer((4,), np.float32)
    as_buffer = ffi.cast("pyfa_buffer *", enc)
    assert "buffer: handle is not a buffer" in _error(lib.pyfa_buffer_read(as_buffer, 0, ffi.new("char[4]"), 4))
    assert "encoder: handle is not an encoder" in _error(lib.pyfa_encoder_commit(ffi.cast("pyfa_encoder *",
                                                                                          b.handle)))
    assert "device: handle is not a device" in _error(
        lib.pyfa_device_info_get(ffi.cast("pyfa_device *", b.handle), ffi.new("pyfa_device_info *")))
    # Freeing a handle as another type frees nothing.
    lib.pyfa_buffer_free(ffi.cast("pyfa_buffer *", enc))
    check(lib.pyfa_encoder_commit(enc))


def test_forged_handles(dev):
    for raw in (0xdeadbeef, 0x10, 1 << 40, dev.buffer((4,), np.float32).numpy().ctypes.data):
        assert "not a live handle" in _error(lib.pyfa_encoder_commit(ffi.cast("pyfa_encoder *", raw)))


def test_freed_buffer_as_op_argument(dev):
    b = _raw_buffer(dev)
    lib.pyfa_buffer_free(b)
    p = ffi.new("pyfa_tq_fwht_params *", dict(nrows=1, head_dim=64, transform=0, stream=0))
    dst = dev.buffer((64,), np.float32)
    assert "src: not a live handle" in _error(lib.pyfa_fwht(dev.encoder(), p, b, dst.handle))


def test_wrap_device_refuses_host_visible_devices(dev):
    if not dev.host_visible:
        pytest.skip("a device with its own memory checks the address itself")
    with pytest.raises(pyfa.InvalidArgumentError, match="address: wrap_device needs a device with its own memory"):
        dev.wrap_device(0xdeadbeef, 64, np.float32, (16,))
