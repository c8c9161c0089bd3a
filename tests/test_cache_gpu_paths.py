"""The caches' GPU-array code, run on the CPU backend: a GpuArray over host
memory (the CPU backend wraps any address) on a CPU device that takes the
GPU paths of pyfa/_io.py, with stream binding left out (the CPU has no
streams). Rows are wrapped in place (ring offsets included), results and
temporaries come from the array's "framework", and every rule holds; real
kernels run on the wrapped memory. tests/test_cuda_caches.py runs the same
paths on a GPU with torch and cupy."""
import numpy as np
import pytest

import pyfa
from pyfa import _io, _plans
from pyfa.cuda_interop import GpuArray


class HostGpuArray(GpuArray):
    """A GpuArray over a numpy array's memory; its framework makes more of them."""

    def __init__(self, a, device_id=0, kind="host"):
        a = np.ascontiguousarray(a)
        super().__init__(self, kind, a.ctypes.data, a.shape, a.dtype, 0, device_id)
        self.host = a

    def empty(self, shape, dtype):
        return HostGpuArray(np.full(shape, np.nan, dtype))

    def zeros(self, shape, dtype):
        return HostGpuArray(np.zeros(shape, dtype))


@pytest.fixture
def gpu(monkeypatch):
    """The emulated GPU device."""
    monkeypatch.setattr(_io, "encoder", lambda device, like=None: device.encoder())
    monkeypatch.setattr(_plans, "encoder", lambda device, stream=0: device.encoder())
    d = pyfa.Device("cpu")
    d._host_visible = False
    return d


@pytest.fixture
def wrapped(monkeypatch):
    """(address, nbytes) of the k and v rows of every append run on the emulated GPU."""
    from pyfa._native import lib
    seen = []
    original = _plans.run

    def run(device, runner, plan, enc, args, finish=True):
        if runner == lib.pyfa_kv_append_run and not device.host_visible:
            seen.extend([(args.k.address, args.k.nbytes), (args.v.address, args.v.nbytes)])
        return original(device, runner, plan, enc, args, finish)
    monkeypatch.setattr(_plans, "run", run)
    return seen


def _caches(kind, gpu_device):
    cpu = pyfa.Device("cpu")
    if kind == "dense":
        return [pyfa.KVCache(2, 64, 16, dtype=pyfa.bfloat16, sliding_window=12, device=d) for d in (gpu_device, cpu)]
    return [pyfa.TurboQuantKVCache(2, 64, 16, k_bits=3, v_bits=8, sliding_window=12, device=d)
            for d in (gpu_device, cpu)]


def _stored(c):
    """The bytes a cache holds (slots never written hold whatever the allocation held)."""
    return [b.view(np.uint8) for b in ([c._k.read(), c._v.read()] if isinstance(c, pyfa.KVCache) else c.codes())]


@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_rows_are_read_in_place_and_match_host_appends(gpu, wrapped, rng, kind):
    ours, twin = _caches(kind, gpu)
    # Device memory: shared storage would be mirrored to and from the host around each call on a GPU.
    held = [ours._k, ours._v] if kind == "dense" else ours._codes + ours._scales
    assert {b.storage for b in held} == {"private"}
    k = rng.standard_normal((45, 2, 64)).astype(np.float16)
    v = rng.standard_normal((45, 2, 64)).astype(np.float32)
    for part in (slice(0, 5), slice(5, 9), slice(9, 45)):  # the last is longer than the ring
        gk, gv = HostGpuArray(k[part]), HostGpuArray(v[part])
        del wrapped[:]
        ours.append(gk, gv)
        twin.append(k[part], v[part])
        n = part.stop - part.start
        skip = max(0, n - 16)  # the ring keeps the last 16 rows: wrapped from row `skip` on
        assert wrapped == [(g.ptr + skip * g.host[0].nbytes, (n - skip) * g.host[0].nbytes) for g in (gk, gv)]
        assert ours._staging == {}  # nothing staged, nothing copied
    for mine, theirs in zip(_stored(ours), _stored(twin)):
        np.testing.assert_array_equal(mine, theirs)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    out = ours.attend(HostGpuArray(q))
    assert isinstance(out, HostGpuArray) and out.shape == (4, 64) and out.dtype == np.float32
    np.testing.assert_array_equal(out.host, twin.attend(q))
    # Steady state: the plan and its workspace are reused, the result comes from the caller's framework.
    before = pyfa.counters()
    again = ours.attend(HostGpuArray(q))
    after = pyfa.counters()
    np.testing.assert_array_equal(again.host, out.host)
    grown = {key: after[key] - before[key] for key in ("device_allocations", "pinned_allocations",
                                                      "host_allocations", "plans_created")}
    assert grown == dict.fromkeys(grown, 0), grown


@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_empty_cache_gives_the_frameworks_zeros(gpu, kind):
    out = _caches(kind, gpu)[0].attend(HostGpuArray(np.ones((4, 64), np.float32)))
    assert isinstance(out, HostGpuArray) and np.array_equal(out.host, np.zeros((4, 64), np.float32))


@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_device_array_rules(gpu, rng, kind):
    c = _caches(kind, gpu)[0]
    rows = rng.standard_normal((3, 2, 64)).astype(np.float32)
    c.append(HostGpuArray(rows), HostGpuArray(rows))
    before = _stored(c)
    g = HostGpuArray(rows)
    for k, v, match in [
        (HostGpuArray(rows.astype(np.float64)), g, "k: dtype float64 not accepted for GPU arrays"),
        (g, HostGpuArray(rows.astype(np.int32)), "v: dtype int32 not accepted"),
        (HostGpuArray(rows[:, :1]), HostGpuArray(rows[:, :1]), "k: expected shape"),
        (g, HostGpuArray(rows[:2]), "v: 2 tokens, k has 3"),
        (g, rows, "v: must be a GPU array like k"),
        (rows, g, "v: must be a host array like k"),
        (g, HostGpuArray(rows, kind="other"), "v: a other array, k is a host array"),
        (HostGpuArray(rows, device_id=1), g, "k: on CUDA device 1; pyfa's cuda backend runs on device 0"),
    ]:
        with pytest.raises(pyfa.InvalidArgumentError, match=match):
            c.append(k, v)
    for q, match in [(HostGpuArray(np.ones((4, 32), np.float32)), "q: expected shape"),
                     (HostGpuArray(np.ones((4, 64))), "q: dtype float64 not accepted for GPU arrays"),
                     (HostGpuArray(np.ones((3, 64), np.float32)), "q: expected shape")]:
        with pytest.raises(pyfa.InvalidArgumentError, match=match):
            c.attend(q)
    assert len(c) == 3
    for mine, theirs in zip(_stored(c), before):
        np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("cls", [pyfa.KVCache, pyfa.TurboQuantKVCache])
def test_overflow_of_device_rows_changes_nothing(gpu, rng, cls):
    c = cls(2, 64, 4, device=gpu)
    rows = rng.standard_normal((3, 2, 64)).astype(np.float32)
    c.append(HostGpuArray(rows), HostGpuArray(rows))
    before = _stored(c)
    with pytest.raises(pyfa.InvalidArgumentError, match="append: 2 tokens would exceed capacity 4"):
        c.append(HostGpuArray(rows[:2]), HostGpuArray(rows[:2]))
    assert len(c) == 3
    for mine, theirs in zip(_stored(c), before):
        np.testing.assert_array_equal(mine, theirs)
