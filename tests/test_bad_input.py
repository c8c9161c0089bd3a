"""Every rule of the decode path gets a clear PyfaError naming the argument,
and the process survives it."""
import numpy as np
import pytest

import pyfa
from pyfa._native import ffi, lib
from pyfa.errors import check


def arrays(H=4, Hkv=2, D=64, cap=32, dtype=np.float16):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((H, D)).astype(np.float32)
    k = rng.standard_normal((Hkv, cap, D)).astype(dtype)
    return q, k, k.copy()


def raises(match, fn, *args, **kw):
    with pytest.raises(pyfa.InvalidArgumentError, match=match):
        fn(*args, **kw)


def test_zero_heads(dev):
    q, k, v = arrays()
    raises("num_heads: must be > 0", pyfa.decode_attention, q[:0], k, v, 4, device=dev)
    raises("num_kv_heads: must be > 0", pyfa.decode_attention, q, k[:0], v[:0], 4, device=dev)


def test_heads_not_multiple_of_kv_heads(dev):
    q, k, v = arrays(H=6, Hkv=4)
    raises("num_heads: 6 must be a multiple of num_kv_heads \\(4\\)", pyfa.decode_attention, q, k, v, 4, device=dev)


@pytest.mark.parametrize("D", [32, 72, 100, 1024])
def test_unsupported_head_dim(dev, D):
    q, k, v = arrays(D=D)
    raises(f"head_dim: {D} is not supported", pyfa.decode_attention, q, k, v, 4, device=dev)


@pytest.mark.parametrize("kv_len,match", [(0, "kv_len\\[0\\]: 0 must be in 1...kv_capacity"),
                                          (33, "kv_len\\[0\\]: 33 must be in 1...kv_capacity"),
                                          (-1, "kv_len\\[0\\]: -1 must be in 1...kv_capacity"),
                                          ([4, 0], "kv_len\\[1\\]: 0")])
def test_kv_len_out_of_range(dev, kv_len, match):
    q, k, v = arrays()
    if isinstance(kv_len, list):
        q, k, v = np.stack([q, q]), np.stack([k, k]), np.stack([v, v])
    raises(match, pyfa.decode_attention, q, k, v, kv_len, device=dev)


def test_kv_len_count_must_match_batch(dev):
    q, k, v = arrays()
    raises("kv_len: expected 1 values", pyfa.decode_attention, q, k, v, [3, 4], device=dev)


def test_ring_start_rules(dev):
    q, k, v = arrays()
    raises("ring_start\\[0\\]: 32 must be in 0..<kv_capacity", pyfa.decode_attention, q, k, v, 32, ring_start=32,
           device=dev)
    raises("ring_start\\[0\\]: -2 must be in 0..<kv_capacity", pyfa.decode_attention, q, k, v, 32, ring_start=-2,
           device=dev)
    # A run shorter than the cache may start anywhere (pyfa_params.h): not refused.
    assert pyfa.decode_attention(q, k, v, 10, ring_start=3, device=dev).shape == q.shape


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float64, np.uint8])
def test_wrong_dtype(dev, dtype):
    q, k, v = arrays()
    raises("q: dtype", pyfa.decode_attention, q.astype(dtype), k, v, 4, device=dev)
    raises("k_cache: dtype", pyfa.decode_attention, q, k.astype(dtype), v, 4, device=dev)


def test_mismatched_kv_dtypes_and_shapes(dev):
    q, k, v = arrays()
    raises("v_cache: dtype float32 differs", pyfa.decode_attention, q, k, v.astype(np.float32), 4, device=dev)
    raises("v_cache: shape", pyfa.decode_attention, q, k, v[:, :16], 4, device=dev)
    raises("k_cache: shape .* does not match q", pyfa.decode_attention, q, k[:, :, :32], v[:, :, :32], 4,
           device=dev)


def test_wrong_rank(dev):
    q, k, v = arrays()
    raises("q: expected 2-D or 3-D", pyfa.decode_attention, q[0], k, v, 4, device=dev)
    raises("k_cache: expected 3-D", pyfa.decode_attention, q, k[0], v[0], 4, device=dev)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scale(dev, scale):
    q, k, v = arrays()
    raises("scale: must be finite", pyfa.decode_attention, q, k, v, 4, scale=scale, device=dev)


@pytest.mark.parametrize("softcap", [-1.0, float("nan"), float("inf")])
def test_bad_softcap(dev, softcap):
    q, k, v = arrays()
    raises("softcap: must be finite and >= 0", pyfa.decode_attention, q, k, v, 4, softcap=softcap, device=dev)


@pytest.mark.parametrize("window", [-1, 0, 2.5, "8"])
def test_bad_window(dev, window):
    q, k, v = arrays()
    raises("window: must be None or a positive int", pyfa.decode_attention, q, k, v, 4, window=window, device=dev)


def test_bad_out(dev):
    q, k, v = arrays()
    raises("out: expected shape", pyfa.decode_attention, q, k, v, 4, out=np.zeros((4, 32), np.float32), device=dev)
    raises("out: expected shape", pyfa.decode_attention, q, k, v, 4, out=np.zeros((4, 64), np.float16), device=dev)


@pytest.mark.parametrize("out_dtype", [np.float64, "int8", 3, "bfloat17"])
def test_bad_out_dtype(dev, out_dtype):
    q, k, v = arrays()
    raises("out_dtype: must be one of float32, float16, bfloat16", pyfa.decode_attention, q, k, v, 4,
           out_dtype=out_dtype, device=dev)


def test_out_must_have_the_output_dtype(dev):
    """out= must be of the output dtype: q's by default, else out_dtype's."""
    q, k, v = arrays()
    raises("out: expected shape .* and dtype float16", pyfa.decode_attention, q, k, v, 4, out_dtype=np.float16,
           out=np.zeros((4, 64), np.float32), device=dev)
    raises("out: expected shape .* and dtype bfloat16", pyfa.decode_attention, q.astype(pyfa.bfloat16), k, v, 4,
           out=np.zeros((4, 64), np.float32), device=dev)


def test_bad_return_lse(dev):
    q, k, v = arrays()
    raises("return_lse: must be a bool", pyfa.decode_attention, q, k, v, 4, return_lse="yes", device=dev)


@pytest.mark.parametrize("cache_type", [pyfa.KVCache, pyfa.TurboQuantKVCache])
def test_cache_attend_output_rules(dev, cache_type):
    c = cache_type(2, 64, 8, device=dev)
    c.append(np.ones((2, 2, 64), np.float32), np.ones((2, 2, 64), np.float32))
    q = np.ones((4, 64), np.float32)
    raises("out_dtype: must be one of float32, float16, bfloat16", c.attend, q, out_dtype=np.int32)
    raises("return_lse: must be a bool", c.attend, q, return_lse=None)


def test_unknown_backend():
    with pytest.raises(pyfa.InvalidArgumentError, match="backend: unknown backend 'tpu'"):
        pyfa.Device("tpu")


def _low_level(dev, **overrides):
    """A decode through the C ABI with one piece replaced by `overrides`."""
    H, Hkv, D, cap = 4, 2, 64, 32
    arrays_ = {
        "q": np.zeros((1, H, D), np.float32), "k": np.zeros((1, Hkv, cap, D), np.float16),
        "v": np.zeros((1, Hkv, cap, D), np.float16), "kv_len": np.array([8], np.uint32),
        "ring_start": np.array([0], np.uint32), "tmp": np.zeros(1 * H * 2 * (D + 2), np.float32),
        "out": np.zeros((1, H, D), np.float32), "lse": None,
    }
    params = {"batch": 1, "num_heads": H, "num_kv_heads": Hkv, "head_dim": D, "kv_capacity": cap, "nwg": 2,
              "scale": 0.125}
    params.update(overrides.pop("params", {}))
    arrays_.update(overrides)
    bufs = [dev.wrap(a) if a is not None else None for a in arrays_.values()]
    enc = dev.encoder()
    p = ffi.new("pyfa_flash_attn_vec_params *", params)
    check(lib.pyfa_flash_attn_vec(enc, p, *(b.handle if b else ffi.NULL for b in bufs)))
    check(lib.pyfa_encoder_commit(enc))
    check(lib.pyfa_encoder_wait(enc))
    return arrays_["out"]


def test_low_level_baseline_runs(dev):
    assert np.isfinite(_low_level(dev)).all()


@pytest.mark.parametrize("name,array,match", [
    ("q", np.zeros((1, 4, 32), np.float32), "q: buffer holds 128 elements, needs 256"),
    ("k", np.zeros((1, 2, 16, 64), np.float16), "k_cache: buffer holds 2048 elements, needs 4096"),
    ("v", np.zeros((1, 2, 32, 64), np.float32), "v_cache: dtype f32 not accepted"),
    ("kv_len", np.zeros(0, np.uint32), "kv_len: buffer holds 0 elements, needs 1"),
    ("tmp", np.zeros(100, np.float32), "tmp: buffer holds 100 elements"),
    ("out", np.zeros((1, 4, 64), np.uint16), "out: dtype u16 not accepted \\(expected f32 or f16 or bf16\\)"),
    ("out", np.zeros((1, 4, 32), np.float16), "out: buffer holds 128 elements, needs 256"),
    ("lse", np.zeros(4, np.float16), "lse: dtype f16 not accepted \\(expected f32\\)"),
    ("lse", np.zeros(3, np.float32), "lse: buffer holds 3 elements, needs 4"),
    ("q", None, "q: buffer is NULL"),
])
def test_low_level_undersized_or_wrong_buffers(dev, name, array, match):
    with pytest.raises(pyfa.InvalidArgumentError, match=match):
        _low_level(dev, **{name: array})


def test_low_level_lse_must_not_overlap(dev):
    """lse is an output: it may not share memory with an input, tmp or out."""
    out = np.zeros((1, 4, 64), np.float32)
    q = np.zeros((1, 4, 64), np.float32)
    with pytest.raises(pyfa.InvalidArgumentError, match="lse: overlaps out in memory"):
        _low_level(dev, out=out, lse=out.reshape(-1)[60:64])
    with pytest.raises(pyfa.InvalidArgumentError, match="lse: overlaps q in memory"):
        _low_level(dev, q=q, lse=q.reshape(-1)[:4])


def test_low_level_params_rules(dev):
    with pytest.raises(pyfa.InvalidArgumentError, match="nwg: 5000 exceeds 1024"):
        _low_level(dev, params={"nwg": 5000})
    with pytest.raises(pyfa.InvalidArgumentError, match="batch: must be > 0"):
        _low_level(dev, params={"batch": 0})


def test_failed_call_leaves_output_untouched(dev):
    out = np.full((1, 4, 64), 7.0, np.float32)
    with pytest.raises(pyfa.InvalidArgumentError):
        _low_level(dev, out=out, kv_len=np.array([99], np.uint32))
    assert (out == 7.0).all()


def test_null_handles_are_errors_not_crashes():
    out = ffi.new("pyfa_device_info *")
    assert lib.pyfa_device_info_get(ffi.NULL, out) == lib.PYFA_ERR_INVALID_ARGUMENT
    assert b"device: handle is NULL" in ffi.string(lib.pyfa_last_error())
    assert lib.pyfa_encoder_commit(ffi.NULL) == lib.PYFA_ERR_INVALID_ARGUMENT
    assert lib.pyfa_device_new(ffi.NULL, b"cpu") == lib.PYFA_ERR_INVALID_ARGUMENT
    lib.pyfa_buffer_free(ffi.NULL)  # freeing NULL is a no-op


def test_buffer_rules(dev):
    with pytest.raises(pyfa.InvalidArgumentError, match="shape\\[1\\]: must be >= 0"):
        dev.buffer((2, -3), np.float32)
    with pytest.raises(pyfa.InvalidArgumentError, match="shape: size overflows"):
        dev.buffer((2**40, 2**40), np.float32)
    with pytest.raises(pyfa.InvalidArgumentError, match="ndim: at most 8"):
        dev.buffer((1,) * 9, np.float32)
    with pytest.raises(pyfa.InvalidArgumentError, match="dtype: .*float64.* is not supported"):
        dev.buffer((2,), np.float64)
    with pytest.raises(pyfa.InvalidArgumentError, match="storage: 'managed'"):
        dev.buffer((2,), np.float32, storage="managed")
    b = dev.buffer((4,), np.float32)
    with pytest.raises(pyfa.InvalidArgumentError, match="write: array has 8 bytes"):
        b.write(np.zeros(2, np.float32))
    bad = ffi.new("pyfa_buffer **")
    assert lib.pyfa_buffer_new(bad, dev.handle, 42, 1, [4], 0) == lib.PYFA_ERR_INVALID_ARGUMENT
    assert b"dtype: unknown dtype code 42" in ffi.string(lib.pyfa_last_error())
    assert lib.pyfa_buffer_read(b.handle, 8, ffi.new("char[16]"), 16) == lib.PYFA_ERR_INVALID_ARGUMENT
    assert b"outside the buffer's 16 bytes" in ffi.string(lib.pyfa_last_error())


def test_wrap_rejects_small_memory(dev):
    a = np.zeros(4, np.float32)
    out = ffi.new("pyfa_buffer **")
    assert lib.pyfa_buffer_wrap(out, dev.handle, ffi.from_buffer(a), 8, lib.PYFA_DTYPE_F32, 1, [4]) == \
        lib.PYFA_ERR_INVALID_ARGUMENT
    assert b"nbytes: 8 bytes cannot hold shape [4] of f32" in ffi.string(lib.pyfa_last_error())


def test_tq_low_level_out_and_lse_rules(dev):
    """The TurboQuant decode's out and lse follow flash_attn_vec's rules."""
    H, D, cap = 2, 64, 8
    host = {"q": np.zeros((1, H, D), np.float32), "codes": np.zeros((1, 1, cap, D // 2), np.uint8),
            "scales": np.zeros((1, 1, cap), np.float32), "kv_len": np.array([4], np.int32),
            "ring": np.zeros(1, np.int32), "tmp": np.zeros(4096, np.float32), "out": np.zeros((1, H, D), np.float16)}
    p = ffi.new("pyfa_flash_attn_vec_tq_params *", {
        "attn": dict(batch=1, num_heads=H, num_kv_heads=1, head_dim=D, kv_capacity=cap, nwg=1, scale=0.125),
        "k_bits": 4, "v_bits": 4})

    def call(**over):
        a = {**host, **over}
        b = {n: dev.wrap(x) for n, x in a.items() if n != "lse"}
        lse = dev.wrap(a["lse"]) if a.get("lse") is not None else None
        check(lib.pyfa_flash_attn_vec_tq(dev.encoder(), p, b["q"].handle, b["codes"].handle, b["scales"].handle,
                                         b["codes"].handle, b["scales"].handle, b["kv_len"].handle, b["ring"].handle,
                                         b["tmp"].handle, b["out"].handle, lse.handle if lse else ffi.NULL))
    call(lse=np.zeros(H, np.float32))  # the baseline records
    raises("out: dtype u16 not accepted", call, out=np.zeros((1, H, D), np.uint16))
    raises("lse: dtype f16 not accepted", call, lse=np.zeros(H, np.float16))
    raises("lse: buffer holds 1 elements, needs 2", call, lse=np.zeros(1, np.float32))
    raises("lse: overlaps tmp in memory", call, lse=host["tmp"][:H])
