"""KVCache and TurboQuantKVCache on the cuda device with GPU arrays: torch /
cupy tensors read in place, encoded (kv_append, hadamard_quantize_kv) and
attended on the caller's stream without waiting, results in the caller's
framework; host arrays beside them through the cache's staging buffer; every
rule for device tensors. Each GPU case skips without a CUDA device, torch
with CUDA or cupy."""
import ast
import os
import subprocess
import sys

import numpy as np
import pytest

import pyfa
from pyfa import reference

gpu = pytest.mark.skipif("cuda" not in pyfa.available_backends(), reason="no CUDA device here")
FLOATS = {"float32": np.float32, "float16": np.float16, "bfloat16": pyfa.bfloat16}
TOL = 2e-5  # decode against the float64 reference on the same rounded K/V (tests/test_cuda.py)
SLEEP_CYCLES = 2_000_000_000  # ~1 s of GPU clock: long enough to see a call return before it
# Whether this process's CUDA plan has the TurboQuant decode rotate q itself (CUDAPlan.envFlag's rule).
ROTATES_Q = os.environ.get("PYFA_CUDA_TQ_ROTATE_Q", "1").strip().lower() not in ("0", "off", "false", "no")


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    return torch


def _cuda(torch, a):
    """A CUDA tensor holding the values of the numpy array ``a`` in its dtype."""
    dtype = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
             pyfa.bfloat16: torch.bfloat16}[np.dtype(a.dtype)]
    return torch.from_numpy(np.ascontiguousarray(a.astype(np.float32))).to(dtype).cuda()


def _pair(kind, dev, cache_dtype=np.float16, cap=48, window=40):
    """Two equal caches: one fed GPU arrays, one host arrays."""
    if kind == "dense":
        return [pyfa.KVCache(2, 128, cap, dtype=cache_dtype, sliding_window=window, device=dev) for _ in range(2)]
    return [pyfa.TurboQuantKVCache(2, 128, cap, k_bits=4, v_bits=3, sliding_window=window, device=dev)
            for _ in range(2)]


def _stored(c):
    """The bytes a cache holds (slots never written hold whatever the allocation held)."""
    return [b.view(np.uint8) for b in ([c._k.read(), c._v.read()] if isinstance(c, pyfa.KVCache) else c.codes())]


@gpu
@pytest.mark.parametrize("kind, cache_dtype", [("dense", d) for d in FLOATS] + [("tq", "float16")])
@pytest.mark.parametrize("src", list(FLOATS))
def test_device_appends_equal_host_appends(rng, kind, src, cache_dtype):
    torch = _torch()
    dev = pyfa.Device("cuda")
    ours, twin = _pair(kind, dev, FLOATS[cache_dtype])
    k = rng.standard_normal((90, 2, 128)).astype(FLOATS[src])
    v = rng.standard_normal((90, 2, 128)).astype(FLOATS[src])
    for part in (slice(0, 1), slice(1, 30), slice(30, 90)):  # the last append is longer than the ring
        ours.append(_cuda(torch, k[part]), _cuda(torch, v[part]))
        twin.append(k[part], v[part])
    q = rng.standard_normal((8, 128)).astype(np.float32)
    out = ours.attend(_cuda(torch, q))
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.float32 and out.shape == (8, 128)
    torch.cuda.synchronize()
    for mine, theirs in zip(_stored(ours), _stored(twin)):
        np.testing.assert_array_equal(mine, theirs)
    np.testing.assert_array_equal(out.cpu().numpy(), twin.attend(q))
    if kind == "dense":
        kk = k[-40:].astype(FLOATS[cache_dtype]).transpose(1, 0, 2)
        vv = v[-40:].astype(FLOATS[cache_dtype]).transpose(1, 0, 2)
        np.testing.assert_allclose(out.cpu().numpy(), reference.decode_attention(q, kk, vv, 40), atol=TOL, rtol=0)


@gpu
@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_side_stream_append_returns_before_the_work(rng, kind):
    """Work on a side stream: the append returns while the stream is still busy (pyfa did not
    wait), and work queued after pyfa's on that stream sees its result."""
    torch = _torch()
    dev = pyfa.Device("cuda")
    ours, twin = _pair(kind, dev)
    k = rng.standard_normal((20, 2, 128)).astype(np.float16)
    q = rng.standard_normal((8, 128)).astype(np.float16)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        tk, tq = _cuda(torch, k), _cuda(torch, q)
        ours.append(tk[:1], tk[:1])  # compiles the kernels before the timed part
        tv = 2 * tk[1:]  # before the sleep: torch may allocate (and cudaMalloc may wait) for it
        torch.cuda._sleep(SLEEP_CYCLES)
        ours.append(tk[1:], tv)
        assert not s.query(), "append waited for the stream"
        doubled = ours.attend(tq) * 2
    s.synchronize()
    twin.append(k[:1], k[:1])
    twin.append(k[1:], 2 * k[1:])
    np.testing.assert_array_equal(doubled.cpu().numpy(), 2 * twin.attend(q))


@gpu
def test_default_stream_append_returns_before_the_work(rng):
    torch = _torch()
    c = pyfa.KVCache(2, 128, 64, device=pyfa.Device("cuda"))
    tk = _cuda(torch, rng.standard_normal((10, 2, 128)).astype(np.float16))
    c.append(tk[:1], tk[:1])
    torch.cuda._sleep(SLEEP_CYCLES)
    c.append(tk[1:], tk[1:])
    assert not torch.cuda.current_stream().query(), "append waited for the default stream"
    torch.cuda.synchronize()
    assert len(c) == 10


@gpu
@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_attend_returns_before_the_work(rng, kind):
    torch = _torch()
    c = _pair(kind, pyfa.Device("cuda"))[0]
    tk = _cuda(torch, rng.standard_normal((10, 2, 128)).astype(np.float16))
    tq = _cuda(torch, rng.standard_normal((8, 128)).astype(np.float16))
    c.append(tk, tk)
    c.attend(tq)
    torch.cuda._sleep(SLEEP_CYCLES)
    c.attend(tq)
    assert not torch.cuda.current_stream().query(), "attend waited for the stream"


@gpu
@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_host_and_device_inputs_mix(rng, kind):
    """Host rows (staged) and device rows into one cache; host and device queries of it."""
    torch = _torch()
    ours, twin = _pair(kind, pyfa.Device("cuda"))
    k = rng.standard_normal((30, 2, 128))
    ours.append(k[:10], k[:10])  # float64 host rows
    ours.append(_cuda(torch, k[10:].astype(np.float32)), _cuda(torch, k[10:].astype(np.float32)))
    twin.append(k[:10], k[:10])
    twin.append(k[10:].astype(np.float32), k[10:].astype(np.float32))
    q = rng.standard_normal((8, 128)).astype(np.float32)
    on_host = ours.attend(q)  # host q: pyfa's own stream, after the default stream's work; waits
    assert isinstance(on_host, np.ndarray)
    on_device = ours.attend(_cuda(torch, q))
    torch.cuda.synchronize()
    np.testing.assert_array_equal(on_host, twin.attend(q))
    np.testing.assert_array_equal(on_device.cpu().numpy(), on_host)


@gpu
@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_attend_with_rows_on_one_side(rng, kind):
    """attend(q, k=, v=) on torch CUDA tensors gives what append then attend give on a twin, step
    after step (the torch fast paths); rows and q on different sides are refused, naming k,
    before anything is appended."""
    torch = _torch()
    ours, twin = _pair(kind, pyfa.Device("cuda"))
    rows = _cuda(torch, rng.standard_normal((6, 2, 128)).astype(np.float16))
    for c in (ours, twin):
        c.append(rows, rows)
    for t in range(50):  # past the window (40) and the capacity (48)
        k, v = (_cuda(torch, rng.standard_normal((1, 2, 128)).astype(np.float16)) for _ in range(2))
        q = _cuda(torch, rng.standard_normal((8, 128)).astype(np.float16))
        twin.append(k, v)
        assert torch.equal(ours.attend(q, k=k, v=v), twin.attend(q)), f"step {t}"
    n = len(ours)
    host_q = rng.standard_normal((8, 128)).astype(np.float32)
    with pytest.raises(pyfa.PyfaError, match="k: a torch CUDA tensor and q a host array"):
        ours.attend(host_q, k=k, v=v)
    with pytest.raises(pyfa.PyfaError, match="k: a host array and q a torch CUDA tensor"):
        ours.attend(q, k=host_q[None, :2], v=host_q[None, :2])
    assert len(ours) == n
    assert torch.equal(ours.attend(q), twin.attend(q))


@gpu
def test_host_appends_reuse_the_staging_buffer(rng, monkeypatch):
    allocated = []
    original = pyfa.Device.buffer

    def buffer(self, shape, dtype, storage="shared"):
        allocated.append(storage)
        return original(self, shape, dtype, storage)
    monkeypatch.setattr(pyfa.Device, "buffer", buffer)
    c = pyfa.KVCache(2, 128, 64, device=pyfa.Device("cuda"))
    k = rng.standard_normal((40, 2, 128)).astype(np.float32)
    c.append(k[:8], k[:8])
    staging = dict(c._staging)
    del allocated[:]
    for i in range(8, 40, 4):
        c.append(k[i:i + 4], k[i:i + 4])
    assert allocated == [] and c._staging == staging  # no buffer, pinned or not, after the first append
    np.testing.assert_array_equal(c._k.read()[:, :40], k.astype(np.float16).transpose(1, 0, 2))


@gpu
def test_empty_cache_attend_gives_device_zeros(rng):
    torch = _torch()
    for c in _pair("dense", pyfa.Device("cuda"))[:1] + _pair("tq", pyfa.Device("cuda"))[:1]:
        out = c.attend(_cuda(torch, rng.standard_normal((4, 128)).astype(np.float32)))
        assert out.is_cuda and out.shape == (4, 128) and not out.any()


class _HostMemoryCai:
    """A __cuda_array_interface__ that points at host memory."""

    def __init__(self, a):
        self.a = a
        self.__cuda_array_interface__ = {"shape": a.shape, "typestr": "<f4", "data": (a.ctypes.data, False),
                                         "version": 3}


@gpu
@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_device_tensor_rules(rng, kind):
    torch = _torch()
    dev = pyfa.Device("cuda")
    c = _pair(kind, dev)[0]
    good = _cuda(torch, rng.standard_normal((3, 2, 128)).astype(np.float16))
    c.append(good, good)
    before = _stored(c)
    host = good.cpu().numpy()
    for k, v, match in [
        (good.double(), good, "k: torch dtype torch.float64 not supported"),
        (good, good.to(torch.int32), "v: dtype int32 not accepted"),
        (good[:, :1], good[:, :1], "k: expected shape"),
        (good, good[:2], "v: 2 tokens, k has 3"),
        (good, host, "v: must be a GPU array like k"),
        (host, good, "v: must be a host array like k"),
        (_HostMemoryCai(np.zeros((3, 2, 128), np.float32)), _HostMemoryCai(np.zeros((3, 2, 128), np.float32)),
         "k: data: .*not CUDA device memory"),
    ]:
        with pytest.raises(pyfa.InvalidArgumentError, match=match):
            c.append(k, v)
    for q, match in [(_cuda(torch, np.ones((8, 64), np.float32)), "q: expected shape"),
                     (torch.ones(8, 128, dtype=torch.float64, device="cuda"), "q: torch dtype torch.float64")]:
        with pytest.raises(pyfa.InvalidArgumentError, match=match):
            c.attend(q)
    if torch.cuda.device_count() > 1:
        other = good.to("cuda:1")
        with pytest.raises(pyfa.InvalidArgumentError, match="k: on CUDA device 1"):
            c.append(other, other)
    torch.cuda.synchronize()
    assert len(c) == 3
    for mine, theirs in zip(_stored(c), before):
        np.testing.assert_array_equal(mine, theirs)
    on_cpu = pyfa.KVCache(2, 128, 8, device="cpu")
    with pytest.raises(pyfa.InvalidArgumentError, match="k: a GPU array needs a GPU device; the device is 'cpu'"):
        on_cpu.append(good, good)
    with pytest.raises(pyfa.InvalidArgumentError, match="x: quantize takes host arrays"):
        pyfa.turboquant.quantize(good[:, 0], 4, device=dev)


@gpu
@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_cupy_in_place(rng, kind):
    cupy = pytest.importorskip("cupy")
    ours, twin = _pair(kind, pyfa.Device("cuda"))
    k = rng.standard_normal((50, 2, 128)).astype(np.float16)
    q = rng.standard_normal((8, 128)).astype(np.float32)
    ours.append(cupy.asarray(k), cupy.asarray(k))
    twin.append(k, k)
    out = ours.attend(cupy.asarray(q))
    assert isinstance(out, cupy.ndarray)
    cupy.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(out), twin.attend(q))
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        with pytest.raises(pyfa.InvalidArgumentError, match="v: a torch array, k is a cupy array"):
            ours.append(cupy.asarray(k), _cuda(torch, k))


@gpu
@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_torch_decode_loop_matches_host_twin(rng, kind, monkeypatch):
    """A decode loop on torch tensors, one token per step: appends take the torch fast path and
    attends repeat a remembered call, yet every step equals the host-fed twin's, across length
    buckets and the ring's wrap, with q's dtype, the scale and q's contiguity changing on the way
    (each change takes the full path once)."""
    torch = _torch()
    ours, twin = _pair(kind, pyfa.Device("cuda"))  # capacity 48, window 40
    checks = {"kv": 0, "q": 0}
    cls = type(ours).__mro__[1]  # _RingCache
    check_kv, check_query = cls._check_kv, cls._check_query

    def counted(name, check):
        def run(self, *a):
            checks[name] += self is ours  # the twin's host arrays take the general checks every time
            return check(self, *a)
        return run
    monkeypatch.setattr(cls, "_check_kv", counted("kv", check_kv))
    monkeypatch.setattr(cls, "_check_query", counted("q", check_query))
    rows = rng.standard_normal((70, 2, 128)).astype(np.float16)
    ours.append(_cuda(torch, rows[:3]), _cuda(torch, rows[:3]))
    twin.append(rows[:3], rows[:3])
    steps = range(3, 70)
    for t in steps:
        r = rows[t:t + 1]
        ours.append(_cuda(torch, r), _cuda(torch, 2 * r))
        twin.append(r, 2 * r)
        q = rng.standard_normal((8, 128)).astype(np.float32 if t % 10 == 0 else np.float16)
        scale = 0.1 if 20 <= t < 30 else None
        tq = _cuda(torch, q)
        if t % 13 == 0:
            tq = torch.cat([tq, tq], 1)[:, :128]  # a non-contiguous view: the full path copies it
        out = ours.attend(tq, scale=scale)
        assert isinstance(out, torch.Tensor) and out.dtype == tq.dtype and out.shape == (8, 128)
        np.testing.assert_array_equal(out.float().cpu().numpy(), twin.attend(q, scale=scale).astype(np.float32),
                                      err_msg=f"step {t}")
    # At most the first append checked its rows the general way (none once an earlier call showed pyfa
    # torch tensors); most attends repeated one before them.
    assert checks["kv"] <= 1
    assert checks["q"] < len(steps) // 2, checks


@gpu
def test_a_dense_cache_step_is_two_launches(rng):
    """On CUDA a dense cache's append is one launch (K, V and the length's advance) and its attend
    one (the split merges in its last workgroups): pyfa.counters() counts two per step."""
    torch = _torch()
    c = pyfa.KVCache(2, 128, 64, dtype=pyfa.bfloat16, sliding_window=64, device=pyfa.Device("cuda"))
    rows = _cuda(torch, rng.standard_normal((64, 2, 128)).astype(np.float32)).to(torch.bfloat16)
    q = _cuda(torch, rng.standard_normal((8, 128)).astype(np.float32)).to(torch.bfloat16)
    c.append(rows, rows)
    c.attend(q)
    before = pyfa.counters()["kernel_launches"]
    for t in range(10):
        c.append(rows[t:t + 1], rows[t:t + 1])
        c.attend(q)
    torch.cuda.synchronize()
    assert (pyfa.counters()["kernel_launches"] - before) == 20


@gpu
@pytest.mark.parametrize("bits, launches", [((4, 4), 1), ((4, 3), 3)])
def test_a_turboquant_cache_append_launches(rng, bits, launches):
    """On CUDA a TurboQuant cache's append of one bit width is one launch (K, V and the length's
    advance, the last workgroup storing it); of two widths, three (the advance, K's encoder,
    V's). One-token appends wrap the ring, then a bf16 append longer than the ring keeps its
    last 64 rows; they decode to the bits of a CPU cache given the same rows at once."""
    torch = _torch()
    dev = pyfa.Device("cuda")
    c, twin = (pyfa.TurboQuantKVCache(2, 128, 64, k_bits=bits[0], v_bits=bits[1], sliding_window=64, device=d)
               for d in (dev, pyfa.Device("cpu")))
    # Values bf16 holds exactly, so the bf16 rows and the f32 ones encode alike.
    k = rng.standard_normal((170, 2, 128)).astype(pyfa.bfloat16).astype(np.float32)
    v = rng.standard_normal((170, 2, 128)).astype(pyfa.bfloat16).astype(np.float32)
    c.append(_cuda(torch, k[:50]), _cuda(torch, v[:50]))
    before = pyfa.counters()["kernel_launches"]
    for t in range(50, 100):
        c.append(_cuda(torch, k[t:t + 1]), _cuda(torch, v[t:t + 1]))
    torch.cuda.synchronize()
    assert (pyfa.counters()["kernel_launches"] - before) == 50 * launches
    c.append(_cuda(torch, k[100:]).to(torch.bfloat16), _cuda(torch, v[100:]).to(torch.bfloat16))
    twin.append(k, v)
    assert len(c) == len(twin) == 64
    for a, b in zip(c.dequantize(), twin.dequantize()):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@gpu
@pytest.mark.parametrize("case", [  # H, Hkv, D, k_bits, v_bits, capacity, appended, window, softcap, nwg, out dtype, lse
    (16, 8, 128, 4, 4, 4096, 4000, None, 0.0, 7, np.float16, True),
    (8, 2, 64, 4, 4, 1000, 1500, 600, 5.0, 5, np.float32, False),     # ring wrapped, window, softcap
    (32, 2, 256, 4, 4, 2048, 2048, None, 0.0, 9, pyfa.bfloat16, True),  # GQA 16: two passes of heads
    (4, 4, 512, 4, 4, 512, 500, None, 0.0, 3, np.float32, True),
    (8, 2, 128, 3, 8, 800, 800, None, 2.0, 4, np.float16, True),      # the vector kernel
    (8, 2, 128, 4, 4, 800, 800, None, 0.0, 300, np.float32, True),    # nwg past the merge's cap: the fused tail
])
def test_tq_split_merged_in_its_last_workgroups_matches_the_tails(rng, case):
    """A TurboQuantKVCache's split decode (fused = True, through its plan) ends in its last
    workgroups — each merges its rows and takes them through the undo: one launch, the decode,
    which rotates q itself — with the bits of the reduce + undo tail (fused = False), five calls
    in a row, so each leaves the tickets as it found them; past the CUDA plan's 16 workgroups
    (PYFA_CUDA_VEC_MERGE_LAST_MAX_NWG) the fused tail runs (a launch more)."""
    H, Hkv, D, kb, vb, cap, n, window, softcap, nwg, out_dtype, lse = case
    cache = pyfa.TurboQuantKVCache(Hkv, D, cap, k_bits=kb, v_bits=vb, seed=7, sliding_window=window,
                                   device=pyfa.Device("cuda"))
    for part in np.array_split(np.arange(n), 2):
        cache.append(rng.standard_normal((len(part), Hkv, D)), rng.standard_normal((len(part), Hkv, D)))
    q = rng.standard_normal((H, D)).astype(np.float32)
    kw = dict(nwg=nwg, softcap=softcap, out_dtype=out_dtype, return_lse=lse)
    want = cache.attend(q, fused=False, **kw)
    got = [cache.attend(q, fused=True, **kw) for _ in range(5)]
    before = pyfa.counters()["kernel_launches"]
    cache.attend(q, fused=True, **kw)
    launches = pyfa.counters()["kernel_launches"] - before
    for g in got:
        for a, b in zip(g if lse else [g], want if lse else [want]):
            assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
    assert launches == (2 if nwg > 16 else 1) + (0 if ROTATES_Q else 1), f"{launches} launches per call"


ROTATION_CASES = [  # H, Hkv, D, k / v bits, q dtype, capacity, appended, window, nwg (None: the plan's)
    (16, 8, 128, (4, 4), "bfloat16", 4096, 3000, None, None),
    (8, 2, 64, (4, 4), "float16", 1000, 1500, 600, 1),    # ring wrapped; one workgroup (the undo's own launch)
    (32, 2, 256, (4, 4), "float32", 512, 500, None, 40),  # GQA 16: two passes of heads; past the merge's cap
    (4, 4, 512, (4, 4), "bfloat16", 512, 300, None, 3),
    (16, 2, 128, (3, 8), "float16", 800, 700, None, 5),   # the vector kernel: passes of its heads
    (8, 8, 64, (2, 4), "float32", 300, 500, 200, None),
    (8, 2, 512, (8, 3), "bfloat16", 256, 256, None, 1),
]


def tq_rotation_outputs():
    """The bytes of TurboQuant decodes (out, lse) of ROTATION_CASES, and the launches of one call
    of each; the same on every run of a process with the same knobs."""
    rng = np.random.default_rng(11)
    outputs, launches = [], []
    for H, Hkv, D, (kb, vb), q_dtype, cap, n, window, nwg in ROTATION_CASES:
        cache = pyfa.TurboQuantKVCache(Hkv, D, cap, k_bits=kb, v_bits=vb, seed=5, sliding_window=window,
                                       device=pyfa.Device("cuda"))
        for part in np.array_split(np.arange(n), 2):
            cache.append(rng.standard_normal((len(part), Hkv, D)), rng.standard_normal((len(part), Hkv, D)))
        q = rng.standard_normal((H, D)).astype(FLOATS[q_dtype])
        before = pyfa.counters()["kernel_launches"]
        out, lse = cache.attend(q, nwg=nwg, return_lse=True)
        launches.append(pyfa.counters()["kernel_launches"] - before)
        outputs += [out.view(np.uint8), lse.view(np.uint8)]
    return outputs, launches


@gpu
def test_the_decode_kernels_q_rotation_gives_the_rotation_kernels_bits(tmp_path):
    """Both CUDA TurboQuant decodes (the tensor-core one at 4-bit K and V, the vector one at the other
    widths) rotate q themselves (q_in), a launch less per call, with the bits of the separate
    fwht_sign_premult launch (PYFA_CUDA_TQ_ROTATE_Q=0, in a subprocess since the knob is read once):
    f32, f16 and bf16 q, D 64 to 512, one or more passes of heads, every tail."""
    if not ROTATES_Q:
        pytest.skip("PYFA_CUDA_TQ_ROTATE_Q turns the rotation in the decode off in this process")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path / "separate.npz"
    code = ("import numpy as np, tests.test_cuda_caches as t; o, n = t.tq_rotation_outputs(); "
            f"np.savez({str(path)!r}, *o); print(n)")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYFA_CUDA_TQ_ROTATE_Q="0"), cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    fused, launches = tq_rotation_outputs()
    separate = np.load(path)
    assert len(separate.files) == len(fused)
    for i, got in enumerate(fused):
        assert np.array_equal(got, separate[f"arr_{i}"]), f"output {i}: bits differ"
    assert [n + 1 for n in launches] == ast.literal_eval(r.stdout.strip().splitlines()[-1]), (launches, r.stdout)
