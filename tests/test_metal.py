"""The Metal backend's own surface: device facts, caller memory wrapped in
place or copied, ops without Metal kernels. Its numerics run through the
shared decode / prefill / KV-cache / bad-input tests with PYFA_BACKEND=metal."""
import mmap

import numpy as np
import pytest

import pyfa
from pyfa import reference

pytestmark = pytest.mark.skipif("metal" not in pyfa.available_backends(), reason="no Metal device here")


@pytest.fixture
def metal():
    return pyfa.Device("metal")


def page_aligned(a):
    """A copy of `a` whose data starts on a page boundary."""
    raw = np.empty(a.nbytes + mmap.PAGESIZE, np.uint8)
    start = (-raw.ctypes.data) % mmap.PAGESIZE
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % mmap.PAGESIZE == 0
    return out


def test_device_facts(metal):
    assert metal.backend == "metal" and metal.simd_width == 32
    assert metal.max_threads_per_threadgroup >= 256 and metal.max_threadgroup_memory >= 16384
    if not metal.is_gpu:  # the MSL executor (Linux): says so, and "auto" never takes it
        assert "not a GPU" in metal.name and metal.host_visible
        assert pyfa.Device("auto").backend != "metal"


@pytest.mark.parametrize("aligned", [True, False])
def test_caller_memory_in_place_or_copied(metal, rng, aligned):
    """Page-aligned arrays are bound in place, others through a copy that is
    synced both ways; either way the result lands in the caller's `out`."""
    q = rng.standard_normal((1, 4, 128)).astype(np.float32)
    k = rng.standard_normal((1, 2, 300, 128)).astype(np.float16)
    v = rng.standard_normal((1, 2, 300, 128)).astype(np.float16)
    out = np.full((1, 4, 128), np.nan, np.float32)
    if aligned:
        q, k, v, out = (page_aligned(a) for a in (q, k, v, out))
    else:  # one element in, so no array starts on a page
        q, k, v, out = (np.concatenate([a.reshape(-1)[:1], a.reshape(-1)])[1:].reshape(a.shape) for a in (q, k, v, out))
        assert all(a.ctypes.data % mmap.PAGESIZE for a in (q, k, v, out))
    res = pyfa.decode_attention(q, k, v, 257, out=out, device=metal)
    assert res is out
    np.testing.assert_allclose(out, reference.decode_attention(q, k, v, 257), atol=2e-5, rtol=0)


def test_shared_buffers_are_what_kernels_read(metal, rng):
    cache = pyfa.KVCache(2, 64, 128, dtype=np.float16, device=metal)
    k = rng.standard_normal((50, 2, 64)).astype(np.float16)
    v = rng.standard_normal((50, 2, 64)).astype(np.float16)
    cache.append(k, v)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    ref = reference.decode_attention(q[None], k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None], 50)[0]
    np.testing.assert_allclose(cache.attend(q), ref, atol=2e-5, rtol=0)


def test_ops_without_metal_kernels_say_so(metal, rng):
    from pyfa import turboquant
    x = rng.standard_normal((2, 64)).astype(np.float32)
    with pytest.raises(pyfa.UnsupportedError, match="no Metal implementation yet"):
        turboquant.fwht(x, "fwht", device=metal)
