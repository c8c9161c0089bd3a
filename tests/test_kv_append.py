"""kv_append: the dense cache append kernel through the C ABI, against numpy
(every src / cache dtype pair, ring wrap-around, batched caches, rounding of
ties, overflow and special values), the baseline CPU build, and every rule
the dispatcher enforces."""
import os
import subprocess
import sys

import numpy as np
import pytest

import pyfa
from pyfa._io import to_device
from pyfa._native import ffi, lib
from pyfa.errors import check

FLOATS = [np.float32, np.float16, pyfa.bfloat16]
SENTINEL = 7.0  # every slot kv_append must not write keeps it


def _params(**fields):
    base = dict(num_tokens=1, num_kv_heads=1, head_dim=8, kv_capacity=4, write_pos=0, sequence=0)
    return ffi.new("pyfa_kv_append_params *", {**base, **fields})


def _append(device, src, cache, **fields):
    """Runs one kv_append of host rows `src` [n, Hkv, D] into the device buffer `cache`."""
    n, Hkv, D = src.shape
    p = _params(num_tokens=n, num_kv_heads=Hkv, head_dim=D, kv_capacity=cache.shape[-2], **fields)
    s = to_device(device, np.ascontiguousarray(src))
    enc = device.encoder()
    check(lib.pyfa_kv_append(enc, p, s.handle, cache.handle))
    check(lib.pyfa_encoder_commit(enc))
    check(lib.pyfa_encoder_wait(enc))


def _cache(device, shape, dtype):
    c = device.buffer(shape, dtype, storage="private")
    c.write(np.full(shape, SENTINEL, dtype))
    return c


def _expected(src, shape, dtype, write_pos, sequence=0):
    """numpy's kv_append: rows widened to float32, rounded to the cache dtype, at ring slots."""
    out = np.full(shape, SENTINEL, dtype)
    view = out if len(shape) == 3 else out[sequence]
    cap = shape[-2]
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is the rule
        for i, row in enumerate(src):
            view[:, (write_pos + i) % cap] = row.astype(np.float32).astype(dtype)
    return out


def _same(got, want):
    """Equal bit for bit, except that NaNs need only be NaNs (their payload is unspecified)."""
    g, w = got.astype(np.float32), want.astype(np.float32)
    assert np.array_equal(np.isnan(g), np.isnan(w))
    keep = ~np.isnan(w)
    assert np.array_equal(got.view(np.uint8).reshape(*got.shape, -1)[keep],
                          want.view(np.uint8).reshape(*want.shape, -1)[keep])


@pytest.mark.parametrize("src_dtype", FLOATS)
@pytest.mark.parametrize("cache_dtype", FLOATS)
@pytest.mark.parametrize("D", [13, 128])
def test_matches_numpy_with_wrap_around(device, rng, src_dtype, cache_dtype, D):
    Hkv, cap = 3, 11
    cache = _cache(device, (Hkv, cap, D), cache_dtype)
    src = (rng.standard_normal((7, Hkv, D)) * 10).astype(src_dtype)
    _append(device, src, cache, write_pos=8)  # slots 8, 9, 10, 0, 1, 2, 3
    _same(cache.read(), _expected(src, (Hkv, cap, D), cache_dtype, 8))


def test_full_ring_and_single_slot(device, rng):
    """n == capacity from any write_pos writes every slot once; n == 1 writes one."""
    Hkv, cap, D = 2, 5, 64
    for n, pos in ((cap, 3), (1, 4), (cap, 0)):
        cache = _cache(device, (Hkv, cap, D), np.float16)
        src = rng.standard_normal((n, Hkv, D)).astype(np.float32)
        _append(device, src, cache, write_pos=pos)
        _same(cache.read(), _expected(src, (Hkv, cap, D), np.float16, pos))


def test_sequence_of_a_batched_cache(device, rng):
    B, Hkv, cap, D = 3, 2, 6, 16
    cache = _cache(device, (B, Hkv, cap, D), pyfa.bfloat16)
    src = rng.standard_normal((4, Hkv, D)).astype(np.float16)
    _append(device, src, cache, write_pos=5, sequence=1)
    _same(cache.read(), _expected(src, (B, Hkv, cap, D), pyfa.bfloat16, 5, sequence=1))


def _special_rows():
    """float32 values at the rounding edges of float16 and bfloat16."""
    f = np.float32
    half_ulp_1_f16, half_ulp_1_bf16 = f(2.0**-11), f(2.0**-8)
    values = [
        1 + half_ulp_1_f16, 1 + 3 * half_ulp_1_f16, -(1 + half_ulp_1_f16),  # f16 ties: to even
        1 + half_ulp_1_bf16, 1 + 3 * half_ulp_1_bf16,                       # bf16 ties: to even
        65504.0, 65519.0, 65520.0, -65520.0, 1e6,                            # f16 max, below / at overflow
        3.38e38, 3.4e38, np.finfo(f).max,                                    # bf16 max region, overflow
        2.0**-24, 2.0**-25, 3 * 2.0**-26, 1e-8, 6.1e-5, 2.0**-14 - 2.0**-25, # f16 subnormals and ties
        1e-40, -0.0, 0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, -2.5,
    ]
    row = np.array(values + [0.0] * (32 - len(values)), f)
    return np.stack([row, -row])[:, None, :]  # [2, 1, 32]


def _check_special_values(device):
    src32 = _special_rows()
    for src_dtype in FLOATS:
        with np.errstate(over="ignore", invalid="ignore"):
            src = src32.astype(src_dtype)
        for cache_dtype in FLOATS:
            cache = _cache(device, (1, 2, 32), cache_dtype)
            _append(device, src, cache)
            _same(cache.read(), _expected(src, (1, 2, 32), cache_dtype, 0))


def test_rounding_overflow_and_special_values(device):
    _check_special_values(device)


def test_generic_cpu_build_rounds_alike():
    """The baseline-ISA CPU kernel (its own float16 conversion) gives the same bits."""
    code = ("import pyfa, tests.test_kv_append as t; t._check_special_values(pyfa.Device('cpu')); "
            "assert pyfa.Device('cpu').name.endswith('generic kernels)'); print('ok')")
    env = dict(os.environ, PYFA_CPU_ISA="generic")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_struct_size():
    assert ffi.sizeof("pyfa_kv_append_params") == 24
    assert lib.pyfa_struct_size(b"pyfa_kv_append_params") == 24


# ---- every rule of the dispatcher, each an error naming the argument ----

def _error(status):
    assert status == lib.PYFA_ERR_INVALID_ARGUMENT, status
    return ffi.string(lib.pyfa_last_error()).decode()


@pytest.mark.parametrize("change, match", [
    (dict(num_tokens=0), "num_tokens: 0 must be in 1...kv_capacity"),
    (dict(num_tokens=5), "num_tokens: 5 must be in 1...kv_capacity (4)"),
    (dict(write_pos=4), "write_pos: 4 must be < kv_capacity (4)"),
    (dict(num_kv_heads=0), "num_kv_heads: must be > 0"),
    (dict(head_dim=0), "head_dim: must be > 0"),
    (dict(kv_capacity=0), "kv_capacity: must be > 0"),
    (dict(kv_capacity=2**31, write_pos=2**31 - 1), "kv_capacity: 2147483648 must be at most 2147483647"),
    (dict(num_tokens=3, head_dim=16), "src: buffer holds 32 elements, needs 48"),
    (dict(sequence=1), "cache: buffer holds 32 elements, needs 64"),
    (dict(sequence=2**32 - 1, head_dim=2**31), "cache: size overflows 64 bits"),
])
def test_bad_params(dev, change, match):
    src = dev.buffer((4, 1, 8), np.float32)
    cache = dev.buffer((1, 4, 8), np.float16)
    p = _params(**{**dict(num_tokens=4), **change})
    assert match in _error(lib.pyfa_kv_append(dev.encoder(), p, src.handle, cache.handle))


def test_bad_buffers(dev):
    p = _params(num_tokens=2)
    good_src, good_cache = dev.buffer((2, 1, 8), np.float32), dev.buffer((1, 4, 8), np.float32)
    other = pyfa.Device(dev.backend)
    cases = [
        (dev.buffer((2, 1, 8), np.int32), good_cache, "src: dtype i32 not accepted"),
        (good_src, dev.buffer((1, 4, 8), np.uint16), "cache: dtype u16 not accepted"),
        (None, good_cache, "src: buffer is NULL"),
        (good_src, None, "cache: buffer is NULL"),
        (other.buffer((2, 1, 8), np.float32), good_cache, "every buffer must belong to the encoder's device"),
    ]
    for src, cache, match in cases:
        msg = _error(lib.pyfa_kv_append(dev.encoder(), p, ffi.NULL if src is None else src.handle,
                                        ffi.NULL if cache is None else cache.handle))
        assert match in msg
    assert "params: NULL" in _error(lib.pyfa_kv_append(dev.encoder(), ffi.NULL, good_src.handle, good_cache.handle))


def test_src_overlapping_the_cache_is_refused(cpu):
    host = np.zeros((1, 4, 8), np.float32)
    cache = cpu.wrap(host)
    src = cpu.wrap(host.reshape(4, 1, 8)[:2])  # rows 0-1 of the cache itself
    msg = _error(lib.pyfa_kv_append(cpu.encoder(), _params(num_tokens=2), src.handle, cache.handle))
    assert "cache: overlaps src in memory" in msg


def test_rejected_call_records_nothing(dev):
    """A refused dispatch leaves the encoder empty: committing it writes nothing."""
    cache = _cache(dev, (1, 4, 8), np.float32)
    src = to_device(dev, np.ones((5, 1, 8), np.float32))
    enc = dev.encoder()
    assert lib.pyfa_kv_append(enc, _params(num_tokens=5), src.handle, cache.handle) != 0
    check(lib.pyfa_encoder_commit(enc))
    check(lib.pyfa_encoder_wait(enc))
    assert np.all(cache.read() == SENTINEL)


def test_dead_and_wrong_handles(dev):
    src, cache = dev.buffer((2, 1, 8), np.float32), dev.buffer((1, 4, 8), np.float32)
    p = _params(num_tokens=2)
    freed = ffi.new("pyfa_buffer **")
    check(lib.pyfa_buffer_new(freed, dev.handle, lib.PYFA_DTYPE_F32, 3, [2, 1, 8], lib.PYFA_STORAGE_SHARED))
    lib.pyfa_buffer_free(freed[0])
    assert "src: not a live handle" in _error(lib.pyfa_kv_append(dev.encoder(), p, freed[0], cache.handle))
    assert "encoder: handle is NULL" in _error(lib.pyfa_kv_append(ffi.NULL, p, src.handle, cache.handle))
    assert "encoder: handle is not an encoder" in _error(
        lib.pyfa_kv_append(ffi.cast("pyfa_encoder *", src.handle), p, src.handle, cache.handle))
