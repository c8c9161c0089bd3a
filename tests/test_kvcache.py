"""pyfa.KVCache: the dense single-sequence cache over flash_attn_vec."""
import numpy as np
import pytest

import pyfa
from pyfa import reference
from test_decode import check
from test_decode_outputs import check_lse

# Storage rounds K/V to the cache dtype; the reference reads the same rounded
# rows, so only float32 accumulation differs (see test_decode.py): 2e-5.
TOL = 2e-5


def _stored(x, dtype):
    return x.astype(dtype).astype(np.float64)


@pytest.mark.parametrize("dtype", [np.float16, pyfa.bfloat16, np.float32])
def test_append_and_attend(device, rng, dtype):
    c = pyfa.KVCache(2, 128, 1024, dtype=dtype, device=device)
    k, v = rng.standard_normal((900, 2, 128)), rng.standard_normal((900, 2, 128))
    for part in np.array_split(np.arange(900), 4):
        c.append(k[part], v[part])
    assert len(c) == 900 and c.nbytes == 2 * 2 * 1024 * 128 * np.dtype(dtype).itemsize
    q = rng.standard_normal((8, 128)).astype(np.float32)
    for softcap in (0.0, 3.0):
        ref = reference.decode_attention(q, _stored(k, dtype).transpose(1, 0, 2),
                                         _stored(v, dtype).transpose(1, 0, 2), 900, softcap=softcap)
        np.testing.assert_allclose(c.attend(q, softcap=softcap), ref, atol=TOL, rtol=0)


def test_ring_buffer_attends_over_last_tokens(device, rng):
    k, v = rng.standard_normal((150, 2, 64)), rng.standard_normal((150, 2, 64))
    c = pyfa.KVCache(2, 64, 64, dtype=np.float32, sliding_window=64, device=device)
    start = 0
    for size in (7, 50, 1, 64, 28):
        c.append(k[start:start + size], v[start:start + size])
        start += size
    assert len(c) == 64
    q = rng.standard_normal((4, 64)).astype(np.float32)
    ref = reference.decode_attention(q, k[-64:].transpose(1, 0, 2), v[-64:].transpose(1, 0, 2), 64)
    np.testing.assert_allclose(c.attend(q), ref, atol=TOL, rtol=0)
    # Window smaller than the capacity: the last 40 of the 150.
    w = pyfa.KVCache(2, 64, 100, dtype=np.float32, sliding_window=40, device=device)
    w.append(k[:120], v[:120])
    w.append(k[120:], v[120:])
    ref = reference.decode_attention(q, k[-40:].transpose(1, 0, 2), v[-40:].transpose(1, 0, 2), 40)
    np.testing.assert_allclose(w.attend(q), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("qdtype,out_dtype,want", [
    (np.float16, None, np.float16), (pyfa.bfloat16, None, pyfa.bfloat16), (np.float64, None, np.float32),
    (np.float16, np.float32, np.float32), (np.float32, pyfa.bfloat16, pyfa.bfloat16)])
def test_output_dtype_and_lse(device, rng, qdtype, out_dtype, want):
    """The output takes q's dtype (float64 q is read as float32) unless out_dtype names another; the LSE is
    the reference's. Bounds: TOL plus the output's rounding (test_decode.py)."""
    c = pyfa.KVCache(2, 64, 100, dtype=np.float16, device=device)
    k, v = rng.standard_normal((70, 2, 64)), rng.standard_normal((70, 2, 64))
    c.append(k, v)
    q = rng.standard_normal((4, 64)).astype(qdtype)
    out, lse = c.attend(q, out_dtype=out_dtype, return_lse=True)
    ref, ref_lse = reference.decode_attention(q.astype(np.float32), _stored(k, np.float16).transpose(1, 0, 2),
                                              _stored(v, np.float16).transpose(1, 0, 2), 70, return_lse=True)
    check(out, ref, dtype=want)
    check_lse(lse, ref_lse)


def test_empty_cache_gives_zeros_and_lse_minus_inf(device, rng):
    c = pyfa.KVCache(2, 64, 8, device=device)
    out, lse = c.attend(rng.standard_normal((4, 64)).astype(np.float16), return_lse=True)
    assert out.dtype == np.float16 and (out == 0).all()
    assert lse.dtype == np.float32 and lse.shape == (4,) and np.isneginf(lse).all()


def test_overflow_without_window_changes_nothing(device, rng):
    c = pyfa.KVCache(2, 64, 10, dtype=np.float32, device=device)
    k = rng.standard_normal((8, 2, 64))
    c.append(k, k)
    before = c._k.read()
    with pytest.raises(pyfa.PyfaError, match="exceed capacity 10"):
        c.append(rng.standard_normal((3, 2, 64)), rng.standard_normal((3, 2, 64)))
    assert len(c) == 8
    np.testing.assert_array_equal(c._k.read(), before)


def test_bad_input(device, rng):
    with pytest.raises(pyfa.PyfaError, match="dtype"):
        pyfa.KVCache(2, 64, 8, dtype=np.int8, device=device)
    with pytest.raises(pyfa.PyfaError, match="capacity: 8 must be >= sliding_window"):
        pyfa.KVCache(2, 64, 8, sliding_window=9, device=device)
    c = pyfa.KVCache(2, 64, 8, device=device)
    with pytest.raises(pyfa.PyfaError, match="k: expected shape"):
        c.append(rng.standard_normal((1, 3, 64)), rng.standard_normal((1, 3, 64)))
    assert np.all(c.attend(rng.standard_normal((2, 64))) == 0)  # empty cache: no key visible
    with pytest.raises(pyfa.PyfaError, match="head_dim"):
        pyfa.KVCache(2, 80, 8, device=device).attend(rng.standard_normal((2, 64)))


def _small_cache(kind, device, capacity=16, window=None):
    if kind == "dense":
        return pyfa.KVCache(2, 64, capacity, dtype=np.float32, sliding_window=window, device=device)
    return pyfa.TurboQuantKVCache(2, 64, capacity, k_bits=4, v_bits=3, sliding_window=window, device=device)


def _stored_bytes(c):
    return [b.view(np.uint8) for b in ([c._k.read(), c._v.read()] if isinstance(c, pyfa.KVCache) else c.codes())]


@pytest.mark.parametrize("window", [None, 6], ids=["no-window", "ring"])
@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_attend_with_rows_is_append_then_attend(device, rng, kind, window):
    """attend(q, k=, v=) gives the bits of append(k, v) then attend(q) on a twin, and stores the same
    bytes: from an empty cache, through the ring's wrap, with the repeat path (defaults) and the
    full one (LSE, float64 rows)."""
    # 14 rows in all: they fill the cache without a window exactly (slots never written hold whatever
    # the allocation held) and wrap the ring of 8 slots.
    ours, twin = (_small_cache(kind, device, capacity=14 if window is None else 8, window=window) for _ in range(2))
    for i, n in enumerate((3, 1, 1, 5, 1, 1, 2)):
        k, v = rng.standard_normal((n, 2, 64)), rng.standard_normal((n, 2, 64))
        if i % 3:
            k, v = k.astype(np.float32), v.astype(np.float32)
        q = rng.standard_normal((4, 64)).astype(np.float32)
        lse = i % 2 == 1
        twin.append(k, v)
        want = twin.attend(q, return_lse=lse)
        got = ours.attend(q, k=k, v=v, return_lse=lse)
        for a, b in zip(got if lse else [got], want if lse else [want]):
            np.testing.assert_array_equal(a, b, err_msg=f"step {i}")
        assert len(ours) == len(twin)
    for a, b in zip(_stored_bytes(ours), _stored_bytes(twin)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_attend_with_rows_refused_appends_nothing(device, rng, kind):
    """Each refusal of attend(q, k=, v=), whether of the rows, of q or of an option, raises naming
    the argument and leaves the cache as it was: same length, same bytes, same attention."""
    c = _small_cache(kind, device, capacity=8)
    rows = rng.standard_normal((5, 2, 64)).astype(np.float32)
    c.append(rows, rows)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    before, stored = c.attend(q), _stored_bytes(c)
    one = rows[:1]
    cases = [
        (dict(k=one), "v: pass k and v together"),
        (dict(v=one), "k: pass k and v together"),
        (dict(k=one, v=one, q=q[:, :32]), "q: expected shape"),
        (dict(k=one, v=one, q=q[:3]), "q: expected shape"),
        (dict(k=rows[:1, :1], v=rows[:1, :1]), "k: expected shape"),
        (dict(k=one, v=rows[:2]), "v: 2 tokens, k has 1"),
        (dict(k=one.astype(np.int32), v=one), "k:"),
        (dict(k=one, v=one, out_dtype=np.int32), "out_dtype"),
        (dict(k=one, v=one, return_lse=2), "return_lse"),
        (dict(k=rows, v=rows), "exceed capacity 8"),
    ]
    for kwargs, match in cases:
        query = kwargs.pop("q", q)
        with pytest.raises(pyfa.PyfaError, match=match):
            c.attend(query, **kwargs)
        assert len(c) == 5, kwargs
        for a, b in zip(_stored_bytes(c), stored):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(c.attend(q), before)
    np.testing.assert_array_equal(c.attend(q, k=one, v=one), _with_twin(kind, device, rows, one, q))


def _with_twin(kind, device, rows, one, q):
    twin = _small_cache(kind, device, capacity=8)
    twin.append(rows, rows)
    twin.append(one, one)
    return twin.attend(q)


@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_attend_with_rows_refused_by_the_library_appends_nothing(device, rng, kind, monkeypatch):
    """An attend the library refuses after the append was recorded (its run is given a cache size
    too small) raises that refusal; the recorded append is dropped with the encoder, not run with
    the next call, and the count stays."""
    import pyfa.kvcache as kvcache_module
    import pyfa.turboquant as tq_module
    module, runner, field = ((kvcache_module, "pyfa_decode_run", "k_cache") if kind == "dense"
                             else (tq_module, "pyfa_tq_decode_run", "k_codes"))
    c = _small_cache(kind, device, capacity=8)
    rows = rng.standard_normal((5, 2, 64)).astype(np.float32)
    c.append(rows, rows)
    stored = _stored_bytes(c)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    real = module.lib

    class Refusing:
        def __getattr__(self, name):
            return getattr(real, name)

    def refused(plan, enc, args):
        getattr(args, field).nbytes = 1
        return getattr(real, runner)(plan, enc, args)
    setattr(Refusing, runner, staticmethod(refused))
    monkeypatch.setattr(module, "lib", Refusing())
    with pytest.raises(pyfa.InvalidArgumentError, match=field):
        c.attend(q, k=rows[:1], v=rows[:1])
    monkeypatch.setattr(module, "lib", real)
    assert len(c) == 5
    twin = _small_cache(kind, device, capacity=8)
    twin.append(rows, rows)
    np.testing.assert_array_equal(c.attend(q), twin.attend(q))  # another call on this thread's encoder
    for a, b in zip(_stored_bytes(c), stored):
        np.testing.assert_array_equal(a, b)


class _FakeGpuArray:
    """Looks like a GPU array to pyfa (it has a __cuda_array_interface__)."""

    def __init__(self, shape=(1, 2, 64)):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f4", "data": (0, False), "version": 3}


def test_caches_on_devs_refuse_gpu_arrays(device):
    """A GPU array needs a cache on a GPU device: on the CPU (and the Metal executor) each
    argument is refused by name, and the cache is unchanged."""
    if not device.host_visible:
        pytest.skip("a GPU device reads GPU arrays (tests/test_cuda_caches.py)")
    rule = "a GPU array needs a GPU device; the device is"
    host = np.zeros((1, 2, 64), np.float32)
    for cache in (pyfa.KVCache(2, 64, 8, device=device), pyfa.TurboQuantKVCache(2, 64, 8, device=device)):
        with pytest.raises(pyfa.InvalidArgumentError, match=f"k: {rule}"):
            cache.append(_FakeGpuArray(), host)
        with pytest.raises(pyfa.InvalidArgumentError, match=f"v: {rule}"):
            cache.append(host, _FakeGpuArray())
        with pytest.raises(pyfa.InvalidArgumentError, match=f"q: {rule}"):
            cache.attend(_FakeGpuArray((4, 64)))
        assert len(cache) == 0
    with pytest.raises(pyfa.InvalidArgumentError, match="x: quantize takes host arrays"):
        pyfa.turboquant.quantize(_FakeGpuArray(), 4, device=device)


def _sorted_rows(a):
    """Rows of ``a [n, ...]`` in lexicographic order (a multiset to compare)."""
    flat = a.reshape(a.shape[0], -1)
    return flat[np.lexsort(flat.T[::-1])]


@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_concurrent_appends_lose_no_row(dev, kind):
    """8 threads x 50 appends of distinct rows (with attends between them):
    the cache ends up holding exactly the appended rows, each once."""
    import threading

    threads, per_thread, Hkv, D = 8, 50, 2, 64
    n = threads * per_thread
    rows = np.zeros((n, Hkv, D), np.float32)
    rows[np.arange(n), :, np.arange(n) % D] = 1 + np.arange(n)[:, None] // D  # one distinct row per token
    if kind == "dense":
        c = pyfa.KVCache(Hkv, D, n, dtype=np.float32, device=dev)
    else:
        c = pyfa.TurboQuantKVCache(Hkv, D, n, k_bits=8, v_bits=8, device=dev)
    q = np.ones((4, D), np.float32)
    errors, start = [], threading.Barrier(threads)

    def work(t):
        try:
            start.wait()
            for i in range(t * per_thread, (t + 1) * per_thread):
                c.append(rows[i:i + 1], 2 * rows[i:i + 1])
                if i % 10 == 0:
                    assert np.isfinite(c.attend(q)).all()
        except Exception as e:  # reported by the main thread
            errors.append(e)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for p in pool:
        p.start()
    for p in pool:
        p.join()
    assert not errors, errors
    assert len(c) == n
    if kind == "dense":
        k, v = (b.read().transpose(1, 0, 2) for b in (c._k, c._v))
        np.testing.assert_array_equal(_sorted_rows(k), _sorted_rows(rows))
        np.testing.assert_array_equal(_sorted_rows(v), _sorted_rows(2 * rows))
        return
    # TurboQuant rows come back within the 8-bit codec's error; the nearest appended row of each
    # stored row must be a distinct one (every row stored once).
    k, v = c.dequantize()
    for got, want in ((k, rows), (v, 2 * rows)):
        g, w = got.reshape(n, -1), want.reshape(n, -1)
        nearest = np.argmin(((g[:, None, :] - w[None, :, :]) ** 2).sum(-1), axis=1)
        assert sorted(nearest.tolist()) == list(range(n))


def _gpu_paths_on_cpu():
    """A CPU device that takes the paths of a GPU device (cuda) for host arrays: rows copied into
    device buffers, results read back. It runs the caches' staging code here, where no GPU is."""
    d = pyfa.Device("cpu")
    d._host_visible = False
    return d


@pytest.fixture
def allocations(monkeypatch):
    """(shape, storage) of every buffer pyfa allocates."""
    seen = []
    original = pyfa.Device.buffer

    def buffer(self, shape, dtype, storage="shared"):
        seen.append((tuple(shape), storage))
        return original(self, shape, dtype, storage)
    monkeypatch.setattr(pyfa.Device, "buffer", buffer)
    return seen


@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_host_appends_on_a_gpu_reuse_staging(rng, allocations, kind):
    gpu, cpu = _gpu_paths_on_cpu(), pyfa.Device("cpu")
    if kind == "dense":
        made = [pyfa.KVCache(2, 64, 16, dtype=np.float16, sliding_window=16, device=d) for d in (gpu, cpu)]
    else:
        made = [pyfa.TurboQuantKVCache(2, 64, 16, sliding_window=16, device=d) for d in (gpu, cpu)]
    c, ref = made
    rows = rng.standard_normal((60, 2, 64)).astype(np.float32)
    start = 0

    def append(n, dtype=np.float32):
        nonlocal start
        part = rows[start:start + n].astype(dtype)
        start += n
        del allocations[:]
        c.append(part, 2 * part)
        ref.append(part, 2 * part)
        return list(allocations)

    assert [a[1] for a in append(5)] == ["private", "private"]  # one staging buffer each for K and V
    k_stage, v_stage = c._staging[0], c._staging[1]
    assert append(3) == [] and append(5) == []  # reused, no allocation at all
    assert c._staging[0] is k_stage and c._staging[1] is v_stage
    assert append(7) == [((10, 2, 64), "private")] * 2  # grown: at least doubled
    assert append(20) == [((16, 2, 64), "private")] * 2  # 20 rows into 16 slots: the last 16; at most capacity
    assert append(4) == []
    # Another dtype replaces it (float64 rows are rounded on the host first, to the cache dtype for a
    # dense cache, to float32 for TurboQuant's encoder).
    assert [a[0] for a in append(2, np.float64 if kind == "dense" else np.float16)] == [(2, 2, 64)] * 2
    assert len(c) == len(ref) == 16
    if kind == "dense":
        for mine, theirs in ((c._k, ref._k), (c._v, ref._v)):
            np.testing.assert_array_equal(mine.read(), theirs.read())
    else:
        for mine, theirs in zip(c.codes(), ref.codes()):
            np.testing.assert_array_equal(mine, theirs)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    np.testing.assert_array_equal(c.attend(q), ref.attend(q))


def test_attend_allocates_nothing_after_the_first(rng):
    """Host-array attends on a GPU reuse the plan's workspace and the cache's staging buffers."""
    c = pyfa.TurboQuantKVCache(2, 64, 4096, device=_gpu_paths_on_cpu())
    c.append(rng.standard_normal((4096, 2, 64)), rng.standard_normal((4096, 2, 64)))
    q = rng.standard_normal((4, 64)).astype(np.float32)
    first = c.attend(q)
    before = pyfa.counters()
    again = c.attend(q)
    after = pyfa.counters()
    assert all(after[k] == before[k] for k in ("host_allocations", "device_allocations", "plans_created"))
    np.testing.assert_array_equal(first, again)


def test_rejected_append_on_a_gpu_changes_nothing(rng):
    c = pyfa.KVCache(2, 64, 10, dtype=np.float32, device=_gpu_paths_on_cpu())
    c.append(rng.standard_normal((8, 2, 64)), rng.standard_normal((8, 2, 64)))
    before = c._k.read(), c._v.read()
    for k, v, match in [(rng.standard_normal((3, 2, 64)), rng.standard_normal((3, 2, 64)), "exceed capacity"),
                        (rng.standard_normal((1, 2, 64)), rng.standard_normal((2, 2, 64)), "v: 2 tokens"),
                        (rng.standard_normal((1, 2, 64)), rng.standard_normal((1, 2, 32)), "v: expected shape")]:
        with pytest.raises(pyfa.InvalidArgumentError, match=match):
            c.append(k, v)
    assert len(c) == 8
    np.testing.assert_array_equal(c._k.read(), before[0])
    np.testing.assert_array_equal(c._v.read(), before[1])


# --------------------------------------------------------------------------- the append plan (C ABI)

def _append_plan(dev, **fields):
    from pyfa._native import ffi, lib
    base = {"num_kv_heads": 2, "head_dim": 64, "kv_capacity": 8, "k_dtype": lib.PYFA_DTYPE_F32,
            "v_dtype": lib.PYFA_DTYPE_F16, "cache_dtype": lib.PYFA_DTYPE_BF16}
    out = ffi.new("pyfa_plan **")
    status = lib.pyfa_kv_append_plan_new(out, dev.handle, ffi.new("pyfa_kv_append_plan_desc *", {**base, **fields}))
    if status != lib.PYFA_OK:
        return status, ffi.string(lib.pyfa_last_error()).decode()
    return status, ffi.gc(out[0], lib.pyfa_plan_free)


@pytest.mark.parametrize("fields,match", [
    ({"reserved": 1}, "reserved: must be 0"),
    ({"k_dtype": 3}, "k_dtype: u8 is not one of f32, f16, bf16"),
    ({"v_dtype": 6}, "v_dtype: i32 is not one of f32, f16, bf16"),
    ({"num_kv_heads": 0}, "num_kv_heads: must be > 0"),
    ({"kv_capacity": 0}, "kv_capacity: 0 must be in 1...2147483647"),
    ({"kv_capacity": 2**31}, "kv_capacity: 2147483648 must be in 1...2147483647"),
    ({"head_dim": 0}, "head_dim: must be > 0"),
    ({"cache_dtype": 3}, "cache_dtype: u8 is not one of f32, f16, bf16 (dense caches)"),
    ({"v_bits": 4}, "v_bits: 4 given to a dense cache (k_bits 0), which takes no TurboQuant options"),
    ({"seed_hi": 9}, "seed_hi: 9 given to a dense cache (k_bits 0)"),
    ({"norm_correction": 1}, "norm_correction: 1 given to a dense cache (k_bits 0)"),
    ({"k_bits": 6, "v_bits": 4, "cache_dtype": 3}, "k_bits: 6 is not a TurboQuant bit width"),
    ({"k_bits": 4, "v_bits": 4}, "cache_dtype: bf16 must be u8 for TurboQuant codes"),
    ({"k_bits": 4, "v_bits": 5, "cache_dtype": 3}, "v_bits: 5 is not a TurboQuant bit width"),
    ({"k_bits": 4, "v_bits": 4, "cache_dtype": 3, "head_dim": 80}, "head_dim: 80 is not supported by TurboQuant"),
    ({"k_bits": 4, "v_bits": 4, "cache_dtype": 3, "norm_correction": 3}, "norm_correction: 3 must be 0"),
])
def test_append_plan_rules(cpu, fields, match):
    from pyfa._native import lib
    status, msg = _append_plan(cpu, **fields)
    assert status == lib.PYFA_ERR_INVALID_ARGUMENT and match in msg, msg


def test_append_run_rules(cpu):
    """A run's memory, num_tokens and write_pos are checked, by name, before anything is written."""
    from pyfa._native import ffi, lib
    status, plan = _append_plan(cpu)
    assert status == lib.PYFA_OK, plan
    k = np.ones((3, 2, 64), np.float32)
    v = np.ones((3, 2, 64), np.float16)
    caches = [np.zeros((2, 8, 64), pyfa.bfloat16) for _ in range(2)]
    small = np.zeros(8, np.float32)
    state = np.zeros(4, np.int32)

    def tensor(t, a):
        t.address, t.nbytes = int(ffi.cast("uintptr_t", ffi.from_buffer(a))), a.nbytes

    def run(change):
        args = ffi.new("pyfa_kv_append_run_args *")
        for field, a in zip(("k", "v", "k_cache", "v_cache"), [k, v] + caches):
            tensor(getattr(args, field), a)
        args.num_tokens, args.write_pos, args.flags = 3, 6, lib.PYFA_RUN_FINISH
        change(args)
        status = lib.pyfa_kv_append_run(plan, cpu.encoder(), args)
        return status, ffi.string(lib.pyfa_last_error()).decode() if status else ""

    for change, match in [
        (lambda a: setattr(a, "num_tokens", 0), "num_tokens: 0 must be in 1...kv_capacity (8)"),
        (lambda a: setattr(a, "num_tokens", 9), "num_tokens: 9 must be in 1...kv_capacity (8)"),
        (lambda a: setattr(a, "write_pos", 8), "write_pos: 8 must be < kv_capacity (8)"),
        (lambda a: setattr(a.k, "address", 0), "k: address is 0"),
        (lambda a: setattr(a.v, "address", 0), "v: address is 0"),
        (lambda a: tensor(a.k_cache, caches[1]), "k_cache: overlaps v_cache in memory (K and V are stored apart)"),
        (lambda a: tensor(a.v, caches[1].reshape(-1)[:384]), "v_cache: overlaps v in memory"),
        (lambda a: tensor(a.v, small), "v: 32 bytes cannot hold 384 f16 values"),
        (lambda a: tensor(a.v_cache, small), "v_cache: 32 bytes cannot hold 1024 bf16 values"),
        (lambda a: tensor(a.k_scales, small), "k_scales: dense caches take no scales"),
        (lambda a: setattr(a, "ring", 1), "ring: 1 given without a state"),
        (lambda a: tensor(a.state, state), "write_pos: 6 given with a state, which says where rows go"),
        (lambda a: (tensor(a.state, state), setattr(a, "write_pos", 0), setattr(a, "ring", 2)),
         "ring: 2 must be 0 or 1"),
        (lambda a: (tensor(a.state, state[:2]), setattr(a, "write_pos", 0)), "state: 8 bytes cannot hold 4 i32 values"),
        (lambda a: (tensor(a.state, k.reshape(-1)[:4].view(np.int32)), setattr(a, "write_pos", 0)),
         "state: overlaps k in memory"),
        (lambda a: (tensor(a.state, caches[1].reshape(-1)[:8].view(np.int32)), setattr(a, "write_pos", 0)),
         "state: overlaps v_cache in memory"),
        (lambda a: (tensor(a.state, state), setattr(a, "write_pos", 0), setattr(a, "num_tokens", 0)),
         "num_tokens: must be > 0"),
        (lambda a: setattr(a, "flags", 8), "flags: unknown bits 0x8"),
    ]:
        status, msg = run(change)
        assert status == lib.PYFA_ERR_INVALID_ARGUMENT and match in msg, (match, msg)
    assert not any(c.view(np.uint16).any() for c in caches)  # nothing written by a refused run
    assert not state.any()
    # Nor recorded: a refused run leaves its encoder empty (V's memory is checked before K is recorded).
    enc = cpu.encoder()
    args = ffi.new("pyfa_kv_append_run_args *")
    for field, a in zip(("k", "v", "k_cache", "v_cache"), [k, v, caches[0], small]):
        tensor(getattr(args, field), a)
    args.num_tokens, args.write_pos = 3, 6
    assert lib.pyfa_kv_append_run(plan, enc, args) == lib.PYFA_ERR_INVALID_ARGUMENT
    assert lib.pyfa_encoder_commit(enc) == lib.PYFA_OK and lib.pyfa_encoder_wait(enc) == lib.PYFA_OK
    assert not caches[0].view(np.uint16).any()
    status, msg = run(lambda a: None)  # rows 6, 7, then 0 of the ring
    assert status == lib.PYFA_OK, msg
    for c, src in zip(caches, (k, v)):
        assert np.array_equal(c[:, [6, 7, 0]].astype(np.float32), np.ones((2, 3, 64), np.float32))
        assert not c[:, 1:6].astype(np.float32).any()


def test_append_run_rules_turboquant(cpu):
    """A TurboQuant plan's run: codes and scales of each stream, each sized for its bit width, apart
    from each other and from the rows (one dispatch may encode K and V at once)."""
    from pyfa._native import ffi, lib
    status, plan = _append_plan(cpu, k_bits=4, v_bits=2, cache_dtype=lib.PYFA_DTYPE_U8, head_dim=64, seed_lo=5)
    assert status == lib.PYFA_OK, plan
    k = np.ones((2, 2, 64), np.float32)
    v = np.ones((2, 2, 64), np.float16)
    mem = {"k_cache": np.zeros((2, 8, 32), np.uint8), "v_cache": np.zeros((2, 8, 16), np.uint8),
           "k_scales": np.zeros((2, 8), np.float32), "v_scales": np.zeros((2, 8), np.float32)}

    def tensor(t, a):
        t.address, t.nbytes = (int(ffi.cast("uintptr_t", ffi.from_buffer(a))), a.nbytes) if a is not None else (0, 0)

    def run(**change):
        args = ffi.new("pyfa_kv_append_run_args *")
        for field, a in {"k": k, "v": v, **mem, **change}.items():
            tensor(getattr(args, field), a)
        args.num_tokens, args.flags = 2, lib.PYFA_RUN_FINISH
        status = lib.pyfa_kv_append_run(plan, cpu.encoder(), args)
        return status, ffi.string(lib.pyfa_last_error()).decode() if status else ""

    rows = np.zeros((2, 2, 64), np.float32)  # memory for k or v, whose start other fields alias
    raw = rows.reshape(-1).view(np.uint8)
    vrows = np.zeros((2, 2, 64), np.float16)
    for change, match in [({"k_scales": None}, "k_scales: address is 0"),
                          ({"v_cache": np.zeros((2, 8, 15), np.uint8)}, "v_cache: 240 bytes cannot hold 256 u8 values"),
                          ({"v_scales": np.zeros(15, np.float32)}, "v_scales: 60 bytes cannot hold 16 f32 values"),
                          ({"v_scales": mem["k_cache"].reshape(-1)[:64].view(np.float32)},
                           "k_cache: overlaps v_scales in memory (codes and scales are stored apart)"),
                          ({"k": rows, "k_cache": raw[:512].reshape(2, 8, 32)}, "k_cache: overlaps k in memory"),
                          ({"k": rows, "v_scales": rows.reshape(-1)[:16]}, "v_scales: overlaps k in memory"),
                          ({"v": vrows, "v_cache": vrows.reshape(-1).view(np.uint8)[:256].reshape(2, 8, 16)},
                           "v_cache: overlaps v in memory")]:
        status, msg = run(**change)
        assert status == lib.PYFA_ERR_INVALID_ARGUMENT and match in msg, (match, msg)
    assert not any(a.any() for a in mem.values())
    assert run() == (lib.PYFA_OK, "")
    assert all(a[:, :2].any() and not a[:, 2:].any() for a in mem.values())


def test_appends_of_mixed_row_dtypes(device, rng):
    """k and v rows of different float types, host or device: each rounded once, to the cache's type."""
    c = pyfa.KVCache(2, 64, 8, dtype=np.float16, device=device)
    k = rng.standard_normal((3, 2, 64)).astype(pyfa.bfloat16)
    v = rng.standard_normal((3, 2, 64))  # float64
    c.append(k, v)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    kh, vh = k.astype(np.float16).astype(np.float64), v.astype(np.float16).astype(np.float64)
    want = reference.decode_attention(q, kh.transpose(1, 0, 2), vh.transpose(1, 0, 2), 3)
    check(c.attend(q), want)


@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_repeated_attends_match_the_full_path(device, rng, kind):
    """A decode loop's attends (numpy q, defaults) after the first take the repeat path on a host-visible
    device: bit for bit what the full path gives, as the cache grows past plan buckets and wraps its ring,
    for every q shape, dtype and scale seen; a call that differs in anything takes the full path."""
    if not device.host_visible:
        pytest.skip("the repeat path serves host-visible devices (numpy q read in place)")

    def make():
        if kind == "dense":
            return pyfa.KVCache(2, 64, 40, dtype=pyfa.bfloat16, sliding_window=24, device=device)
        return pyfa.TurboQuantKVCache(2, 64, 40, k_bits=4, v_bits=2, sliding_window=24, seed=3, device=device)
    fast, full = make(), make()
    hits = []
    repeat = fast._attend_repeat

    def counted(q, scale):
        out = repeat(q, scale)
        hits.append(out is not None)
        return out
    fast._attend_repeat = counted
    queries = [rng.standard_normal((4, 64)).astype(np.float32), rng.standard_normal((2, 64)).astype(np.float16),
               rng.standard_normal((4, 64)).astype(pyfa.bfloat16)]
    for step in range(50):  # buckets 1, 2, 4, ... 32 and a full ring from step 40 on
        rows = rng.standard_normal((1, 2, 64)).astype(np.float32)
        fast.append(rows, rows)
        full.append(rows, rows)
        for q, scale in [(queries[step % 3], None), (queries[0], 0.3)]:
            got = fast.attend(q, scale=scale)
            want = full.attend(q, scale=scale, softcap=0)  # an int softcap: never the repeat path
            assert got.dtype == q.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8)), step
    assert sum(hits) >= 70, sum(hits)  # all but the first call per (q shape, dtype, scale, length bucket)
    assert getattr(full._repeats, "entries", None) is None


@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_a_decode_step_allocates_nothing(device, rng, kind):
    """append one token + attend, within one length bucket: no allocation or plan beyond what the first
    such step made (numpy rows and q; a GPU stages host rows in buffers it keeps)."""
    c = pyfa.KVCache(2, 64, 64, device=device) if kind == "dense" else \
        pyfa.TurboQuantKVCache(2, 64, 64, k_bits=4, v_bits=4, device=device)
    rows = rng.standard_normal((33, 2, 64)).astype(np.float32)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    c.append(rows, rows)  # 33 tokens: lengths 34... stay in the bucket of 64
    c.append(rows[:1], rows[:1])
    c.attend(q)
    before = pyfa.counters()
    for i in range(10):
        c.append(rows[i:i + 1], rows[i:i + 1])
        c.attend(q)
    after = pyfa.counters()
    # Metal binds caller memory that is not page-aligned (numpy rows, q, the result) through a copy:
    # one allocation per array and call, by design (README, Metal); the plans are kept all the same.
    keys = ("plans_created",) if device.backend == "metal" else (
        "device_allocations", "pinned_allocations", "host_allocations", "plans_created")
    grown = {k: after[k] - before[k] for k in keys}
    assert grown == dict.fromkeys(grown, 0), grown


# ---- the length on the device (pyfa_kv_state) -------------------------------------------------------

@pytest.mark.parametrize("before,n,ring,after,slots", [
    ([0, 0, 0, 0], 3, 0, [0, 3, 0, 0], [0, 1, 2]),              # room: rows after the stored ones
    ([5, 6, 0, 0], 3, 0, [-1, 6, 0, 1], []),                    # no room, no ring: dropped and counted
    ([5, 6, 0, 0], 3, 1, [6, 8, 1, 0], [6, 7, 0]),              # a ring fills up and wraps
    ([0, 8, 5, 0], 10, 1, [7, 8, 7, 0], [7, 0, 1, 2, 3, 4, 5, 6]),  # 10 rows: the last 8 stay, oldest at 7
    ([0, -5, 99, 2], 1, 0, [0, 1, 0, 2], [0]),                  # kv_len < 0 read as 0, ring_start as 0
    ([0, 1000, 1000, 0], 1, 1, [0, 8, 1, 0], [0]),              # kv_len past capacity is full; bad ring_start 0
    ([0, 1000, -3, 0], 1, 0, [-1, 1000, -3, 1], []),            # full without a ring: dropped, the rest kept
])
def test_append_run_with_a_state(dev, before, n, ring, after, slots):
    """A run with a state advances it (kv_advance) and writes where it says: the last
    min(n, capacity) rows, from the slot the state names; values out of range are clamped, so no
    slot outside the cache is ever written."""
    from pyfa._native import ffi, lib
    status, plan = _append_plan(dev)
    assert status == lib.PYFA_OK, plan
    rows = min(n, 8)
    k = (np.arange(rows, dtype=np.float32) + 1)[:, None, None] * np.ones((rows, 2, 64), np.float32)
    v = k.astype(np.float16)
    caches = [np.zeros((2, 8, 64), pyfa.bfloat16) for _ in range(2)]
    state = np.array(before, np.int32)
    args = ffi.new("pyfa_kv_append_run_args *")
    for field, a in zip(("k", "v", "k_cache", "v_cache", "state"), [k, v] + caches + [state]):
        t = getattr(args, field)
        t.address, t.nbytes = int(ffi.cast("uintptr_t", ffi.from_buffer(a))), a.nbytes
    args.num_tokens, args.ring, args.flags = n, ring, lib.PYFA_RUN_FINISH
    assert lib.pyfa_kv_append_run(plan, dev.encoder(), args) == lib.PYFA_OK, ffi.string(lib.pyfa_last_error())
    assert state.tolist() == after
    for c in caches:
        got = c[:, :, 0].astype(np.float32)
        want = np.zeros((2, 8), np.float32)
        for i, slot in enumerate(slots):
            want[:, slot] = i + 1
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", ["dense", "tq"])
@pytest.mark.parametrize("window", [None, 5])
def test_length_on_the_device_matches_the_host_count(device, rng, kind, window):
    """A cache keeping its length on the device (as on CUDA) stores, attends and counts as one
    counting on the host, bit for bit, through ring wraps and appends longer than the ring."""
    def make():
        if kind == "dense":
            return pyfa.KVCache(2, 64, 8, sliding_window=window, device=device)
        return pyfa.TurboQuantKVCache(2, 64, 8, sliding_window=window, device=device)
    host, dev = make(), make()
    dev._keep_length_on_device()
    q = rng.standard_normal((4, 64)).astype(np.float32)
    np.testing.assert_array_equal(dev.attend(q), np.zeros((4, 64), np.float32))
    for n in (3, 4, 1) + ((12, 2) if window else ()):
        k, v = (rng.standard_normal((n, 2, 64)).astype(np.float32) for _ in range(2))
        host.append(k, v)
        dev.append(k, v)
        assert len(dev) == len(host)
        np.testing.assert_array_equal(dev.attend(q), host.attend(q))
        _, kv_len, ring_start, dropped = dev._state.read().tolist()
        assert (kv_len, ring_start, dropped) == (*host._ring(), 0)
    if window is None:
        with pytest.raises(pyfa.PyfaError, match="would exceed capacity 8"):
            dev.append(np.ones((1, 2, 64), np.float32), np.ones((1, 2, 64), np.float32))
        assert dev._state.read().tolist()[1:] == [8, 0, 0]  # refused on the host: nothing changed


def test_replayed_appends_move_the_length_the_host_reads_back(cpu, rng):
    """What a graph replay does, without a GPU: the recorded append run runs again with the host
    count left behind. Once the cache knows it was captured, the length is read back from the
    device; a replay that found a cache without a window full is reported once, then counted."""
    from pyfa._native import lib
    c = pyfa.KVCache(2, 64, 4, dtype=np.float32, device=cpu)
    c._keep_length_on_device()
    row = rng.standard_normal((1, 2, 64)).astype(np.float32)
    c.append(row, row)
    plan, args = c._append_runs[(np.dtype(np.float32), np.dtype(np.float32))]
    c._captured = True  # as _note_capture sets it when an append is recorded into a graph

    def replay():
        args.flags = lib.PYFA_RUN_FINISH
        assert lib.pyfa_kv_append_run(plan, cpu.encoder(), args) == lib.PYFA_OK

    for _ in range(3):
        replay()
    assert len(c) == 4
    q = rng.standard_normal((2, 64)).astype(np.float32)
    want = reference.decode_attention(q[None], np.repeat(row.transpose(1, 0, 2), 4, 1)[None],
                                      np.repeat(row.transpose(1, 0, 2), 4, 1)[None], 4)[0]
    np.testing.assert_allclose(c.attend(q), want, rtol=0, atol=2e-6)
    replay()  # the cache is full and has no window: dropped on the device
    with pytest.raises(pyfa.PyfaError, match="1 replayed append\\(s\\) found the cache full"):
        len(c)
    assert len(c) == 4  # reported once
    with pytest.raises(pyfa.PyfaError, match="would exceed capacity 4"):
        c.append(row, row)  # an eager append checks against the length read back
