"""The Metal backend's own surface: device facts, caller memory wrapped in
place or copied, read-only caller memory, fork. Its numerics run through the
shared decode / prefill / KV-cache / bad-input tests with PYFA_BACKEND=metal."""
import mmap
import os
import signal
import time

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


def test_read_only_caller_memory_is_never_written(metal, rng, tmp_path):
    """K and V in read-only pages, off page boundaries: bound through a copy,
    and the write-back after the call touches only bytes kernels changed."""
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 100, 64)).astype(np.float16)
    v = rng.standard_normal((1, 2, 100, 64)).astype(np.float16)
    path = tmp_path / "kv.bin"
    path.write_bytes(b"\0" * 64 + k.tobytes() + v.tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        kr = np.frombuffer(mm, np.float16, k.size, offset=64).reshape(k.shape)
        vr = np.frombuffer(mm, np.float16, v.size, offset=64 + k.nbytes).reshape(v.shape)
        assert not kr.flags.writeable and kr.ctypes.data % mmap.PAGESIZE
        out = pyfa.decode_attention(q, kr, vr, 77, device=metal)
        np.testing.assert_allclose(out, reference.decode_attention(q, k, v, 77), atol=2e-5, rtol=0)
        del kr, vr
    finally:
        mm.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_runs_kernels(metal, rng):
    """A child forked after the parent ran kernels has none of its threads;
    its first call must still run (not wait on workers that are gone)."""
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 300, 64)).astype(np.float32)
    ref = reference.decode_attention(q, k, k, 300)
    np.testing.assert_allclose(pyfa.decode_attention(q, k, k, 300, device=metal), ref, atol=2e-5, rtol=0)
    pid = os.fork()
    if pid == 0:  # the child: exit status says whether its result was right
        ok = False
        try:
            ok = np.allclose(pyfa.decode_attention(q, k, k, 300, device=metal), ref, atol=2e-5, rtol=0)
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's call did not finish in 60 s")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


def test_device_seconds_come_from_the_command_buffers(metal, cpu, rng):
    """pyfa_encoder_device_seconds: the GPU time of what the last wait
    completed on Metal; an UnsupportedError on a backend without a device clock."""
    from pyfa._native import ffi, lib
    from pyfa.errors import check

    seconds = ffi.new("double *")
    enc = cpu.encoder()
    with pytest.raises(pyfa.UnsupportedError, match="device_seconds: backend 'cpu' has no device clock"):
        check(lib.pyfa_encoder_device_seconds(enc, seconds))
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 200, 64)).astype(np.float32)
    params = ffi.new("pyfa_flash_attn_vec_params *", {
        "batch": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "kv_capacity": 200, "nwg": 1, "scale": 0.125})
    bufs = [metal.wrap(a) for a in (q, k, k, np.array([200], np.int32), np.array([0], np.int32))]
    out = np.zeros((1, 4, 64), np.float32)
    enc = metal.encoder()
    check(lib.pyfa_flash_attn_vec(enc, params, *(b.handle for b in bufs), ffi.NULL, metal.wrap(out).handle, ffi.NULL))
    check(lib.pyfa_encoder_commit(enc))
    check(lib.pyfa_encoder_wait(enc))
    check(lib.pyfa_encoder_device_seconds(enc, seconds))
    assert 0 < seconds[0] < 60
    with pytest.raises(pyfa.InvalidArgumentError, match="seconds: out-pointer is NULL"):
        check(lib.pyfa_encoder_device_seconds(enc, ffi.NULL))
