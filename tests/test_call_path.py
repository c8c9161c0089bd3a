"""The serving call path: plans reused across calls, nothing allocated or
waited for per call, per-sequence values on the host (inline) or on the GPU
(read by the kernels, so a CUDA graph replay sees values written after the
capture), and the C ABI's plan/run rules. GPU cases need torch on a CUDA
device and skip visibly elsewhere."""
import gc

import numpy as np
import pytest

import pyfa
from pyfa import _plans, reference
from pyfa._native import ffi, lib


HAS_GPU = "cuda" in pyfa.available_backends()
gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA device here")


def _ref(q, k, v, lens, **kw):
    return np.stack([reference.decode_attention(q[b], k[b], v[b], int(lens[b]), **kw) for b in range(q.shape[0])])


def _delta(before, after):
    return {key: after[key] - before[key] for key in before}


def _page_aligned(a, page=16384):
    """A copy of `a` starting on a page and followed by a spare page (Metal
    wraps such memory in place; other memory it copies)."""
    raw = np.zeros(a.nbytes + 2 * page, np.uint8)
    start = -raw.ctypes.data % page
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def test_steady_state_call_allocates_nothing_on_host_devices(device, rng):
    if not device.host_visible:
        pytest.skip(f"{device.backend}: numpy inputs are copied to this device (see the GPU tests)")
    q = _page_aligned(rng.standard_normal((2, 4, 64)).astype(np.float32))
    k = _page_aligned(rng.standard_normal((2, 2, 300, 64)).astype(np.float16))
    out = _page_aligned(np.empty((2, 4, 64), np.float32))
    pyfa.decode_attention(q, k, k, [300, 120], device=device, out=out)  # makes the plan
    before = pyfa.counters()
    for _ in range(20):
        pyfa.decode_attention(q, k, k, [300, 120], device=device, out=out)
    d = _delta(before, pyfa.counters())
    assert d["plans_created"] == 0 and d["host_allocations"] == 0 and d["device_allocations"] == 0
    # A host-array call returns its result, so it may wait once (Metal's
    # command buffer); the CPU backend has nothing to wait for.
    assert d["pinned_allocations"] == 0 and d["synchronizations"] <= 20
    np.testing.assert_allclose(out, _ref(q, k, k, [300, 120]), atol=2e-5, rtol=0)


def test_plan_is_reused_as_the_cache_grows(cpu, rng):
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 70, 64)).astype(np.float32)
    pyfa.decode_attention(q, k[:, :, :40], k[:, :, :40], 40, device=cpu)
    before = pyfa.counters()
    for n in range(41, 65):  # one power-of-two bucket: 33..64
        kk = np.ascontiguousarray(k[:, :, :n])
        got = pyfa.decode_attention(q, kk, kk, n, device=cpu)
        np.testing.assert_allclose(got, _ref(q, kk, kk, [n]), atol=2e-5, rtol=0)
    assert _delta(before, pyfa.counters())["plans_created"] == 0


def test_plan_runs_follow_host_memory_rewritten_replaced_or_resized(cpu, rng):
    """A plan keeps its wraps of caller memory per argument and reuses them when a run passes
    the same memory: results follow arrays rewritten in place, other arrays in an argument's
    place, and memory of another size at the same address (a smaller cache over k's bytes)."""
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 32, 64)).astype(np.float32)
    v = rng.standard_normal((1, 2, 32, 64)).astype(np.float32)
    out = np.empty((1, 4, 64), np.float32)
    for _ in range(3):
        got = pyfa.decode_attention(q, k, v, 32, device=cpu, out=out)
        np.testing.assert_allclose(got, _ref(q, k, v, [32]), atol=2e-5, rtol=0)
        q[...] = rng.standard_normal(q.shape)
        k[...] = rng.standard_normal(k.shape)
    k2, v2 = k * 2 + 1, v - 1
    np.testing.assert_allclose(pyfa.decode_attention(q, k2, v2, 30, device=cpu, out=out), _ref(q, k2, v2, [30]),
                               atol=2e-5, rtol=0)
    small_k = k.reshape(-1)[:2 * 24 * 64].reshape(1, 2, 24, 64)  # k's first bytes: the same address
    small_v = v.reshape(-1)[:2 * 24 * 64].reshape(1, 2, 24, 64)
    assert small_k.ctypes.data == k.ctypes.data
    np.testing.assert_allclose(pyfa.decode_attention(q, small_k, small_v, 20, device=cpu, out=out),
                               _ref(q, small_k, small_v, [20]), atol=2e-5, rtol=0)


def test_host_lengths_are_checked_per_call(device, rng):
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    k = rng.standard_normal((2, 2, 50, 64)).astype(np.float32)
    pyfa.decode_attention(q, k, k, [50, 10], device=device)
    with pytest.raises(pyfa.InvalidArgumentError, match=r"kv_len\[1\]: 51 must be in 1...kv_capacity \(50\)"):
        pyfa.decode_attention(q, k, k, [50, 51], device=device)
    with pytest.raises(pyfa.InvalidArgumentError, match=r"ring_start\[0\]: 50 must be in 0..<kv_capacity \(50\)"):
        pyfa.decode_attention(q, k, k, [20, 10], ring_start=[50, 0], device=device)
    # The thread's encoder is usable after a refused call.
    got = pyfa.decode_attention(q, k, k, [50, 10], device=device)
    np.testing.assert_allclose(got, _ref(q, k, k, [50, 10]), atol=2e-5, rtol=0)


def test_counters_are_readable():
    c = pyfa.counters()
    assert set(c) >= {"device_allocations", "synchronizations", "kernel_launches", "plans_created"}
    assert all(isinstance(v, int) and v >= 0 for v in c.values())
    assert lib.pyfa_counters_get(ffi.NULL) == lib.PYFA_ERR_INVALID_ARGUMENT


# ---- the C ABI's plan / run rules -----------------------------------------------------------------------

def _plan(dev, B=1, H=4, Hkv=2, D=64, cap=32, **desc):
    d = {"attn": {"batch": B, "num_heads": H, "num_kv_heads": Hkv, "head_dim": D, "kv_capacity": cap, "nwg": 0,
                  "window": 0, "scale": 0.125, "softcap": 0.0},
         "q_dtype": lib.PYFA_DTYPE_F32, "kv_dtype": lib.PYFA_DTYPE_F32, "out_dtype": lib.PYFA_DTYPE_F32}
    d.update(desc)
    out = ffi.new("pyfa_plan **")
    status = lib.pyfa_decode_plan_new(out, dev.handle, ffi.new("pyfa_decode_plan_desc *", d))
    return status, (ffi.gc(out[0], lib.pyfa_plan_free) if status == 0 else None)


def _tensor(t, a):
    t.address = int(ffi.cast("uintptr_t", ffi.from_buffer(a)))
    t.nbytes = a.nbytes


def _run_args(q, k, v, out, lens):
    a = ffi.new("pyfa_decode_run_args *")
    for field, arr in (("q", q), ("k_cache", k), ("v_cache", v), ("out", out)):
        _tensor(getattr(a, field), arr)
    keep = [ffi.new("int32_t[]", list(lens)), ffi.new("int32_t[]", [0] * len(lens))]
    a.kv_len.host, a.ring_start.host = keep
    return a, keep


def _last_error():
    return ffi.string(lib.pyfa_last_error()).decode()


def test_plan_rejects_bad_descriptions(cpu):
    status, _ = _plan(cpu, D=65)
    assert status == lib.PYFA_ERR_INVALID_ARGUMENT and "head_dim: 65" in _last_error()
    status, _ = _plan(cpu, q_dtype=lib.PYFA_DTYPE_U8)
    assert status == lib.PYFA_ERR_INVALID_ARGUMENT and "q_dtype" in _last_error()
    status, _ = _plan(cpu, max_kv_len=33)
    assert status == lib.PYFA_ERR_INVALID_ARGUMENT and "kv_len: 33 exceeds kv_capacity" in _last_error()
    assert lib.pyfa_decode_plan_new(ffi.NULL, cpu.handle, ffi.NULL) == lib.PYFA_ERR_INVALID_ARGUMENT


def test_run_rejects_memory_of_another_shape(cpu, rng):
    status, plan = _plan(cpu)
    assert status == 0
    enc = cpu.encoder()
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 32, 64)).astype(np.float32)
    out = np.full((1, 4, 64), 7.0, np.float32)
    small = np.zeros((1, 2, 16, 64), np.float32)
    args, keep = _run_args(q, small, small, out, [16])
    assert lib.pyfa_decode_run(plan, enc, args) == lib.PYFA_ERR_INVALID_ARGUMENT
    assert "k_cache:" in _last_error() and "cannot hold" in _last_error()
    args, keep = _run_args(q, k, k, out[:, :2], [32])
    assert lib.pyfa_decode_run(plan, enc, args) == lib.PYFA_ERR_INVALID_ARGUMENT and "out:" in _last_error()
    args, keep = _run_args(q, k, k, out, [32])
    args.lse.address, args.lse.nbytes = args.out.address, 16
    assert lib.pyfa_decode_run(plan, enc, args) == lib.PYFA_ERR_INVALID_ARGUMENT and "lse:" in _last_error()
    # A run over a smaller capacity than planned, on memory of that size.
    args, keep = _run_args(q, small, small, out, [16])
    args.kv_capacity = 16
    enc = cpu.encoder()
    assert lib.pyfa_decode_run(plan, enc, args) == 0, _last_error()
    assert lib.pyfa_encoder_finish(enc) == 0
    np.testing.assert_allclose(out, _ref(q, small, small, [16], scale=0.125), atol=2e-5, rtol=0)
    assert lib.pyfa_decode_run(ffi.NULL, enc, args) == lib.PYFA_ERR_INVALID_ARGUMENT and "plan" in _last_error()
    assert lib.pyfa_decode_run(plan, enc, ffi.NULL) == lib.PYFA_ERR_INVALID_ARGUMENT


def test_run_with_output_aliasing_an_input_is_refused(cpu, rng):
    status, plan = _plan(cpu)
    k = rng.standard_normal((1, 2, 32, 64)).astype(np.float32)
    q = np.ascontiguousarray(k[0, 0, :4].reshape(1, 4, 64))
    args, keep = _run_args(q, k, k, k, [32])
    before = k.copy()
    assert lib.pyfa_decode_run(plan, cpu.encoder(), args) == lib.PYFA_ERR_INVALID_ARGUMENT
    assert "out: overlaps" in _last_error()
    np.testing.assert_array_equal(k, before)


def test_freed_plan_handle_is_refused(cpu):
    out = ffi.new("pyfa_plan **")
    d = {"attn": {"batch": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "kv_capacity": 32, "scale": 1.0},
         "q_dtype": lib.PYFA_DTYPE_F32, "kv_dtype": lib.PYFA_DTYPE_F32, "out_dtype": lib.PYFA_DTYPE_F32}
    assert lib.pyfa_decode_plan_new(out, cpu.handle, ffi.new("pyfa_decode_plan_desc *", d)) == 0
    raw = out[0]
    lib.pyfa_plan_free(raw)
    out = ffi.new("uint64_t *")
    assert lib.pyfa_plan_workspace_bytes(raw, out) == lib.PYFA_ERR_INVALID_ARGUMENT
    assert "not a live handle" in _last_error()


# ---- GPU: torch tensors, device lengths, CUDA graphs -----------------------------------------------------

def _torch_inputs(torch, rng, B=2, H=8, Hkv=2, D=128, cap=1000, dtype="bfloat16"):
    t = lambda a: torch.from_numpy(a).to(getattr(torch, dtype)).cuda()
    q = t(rng.standard_normal((B, H, D)).astype(np.float32))
    k = t(rng.standard_normal((B, Hkv, cap, D)).astype(np.float32))
    v = t(rng.standard_normal((B, Hkv, cap, D)).astype(np.float32))
    return q, k, v


def _host(torch, x):
    return x.float().cpu().numpy()


@gpu
def test_gpu_steady_state_call_allocates_and_waits_for_nothing(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _torch_inputs(torch, rng)
    lens = torch.tensor([1000, 333], dtype=torch.int32, device="cuda")
    dev = pyfa.Device("cuda")
    out = pyfa.decode_attention(q, k, v, lens, device=dev, out_dtype=np.float32)
    for host_lens in ([1000, 333], 700):
        pyfa.decode_attention(q, k, v, host_lens, device=dev, out_dtype=np.float32)
    before = pyfa.counters()
    for _ in range(50):
        pyfa.decode_attention(q, k, v, lens, device=dev, out_dtype=np.float32)
        pyfa.decode_attention(q, k, v, [1000, 333], device=dev, out_dtype=np.float32)
    d = _delta(before, pyfa.counters())
    assert d["device_allocations"] == 0 and d["pinned_allocations"] == 0 and d["plans_created"] == 0
    assert d["synchronizations"] == 0 and d["host_to_device_copies"] == 0 and d["device_to_host_copies"] == 0
    assert d["kernel_launches"] >= 100
    torch.cuda.synchronize()
    ref = _ref(_host(torch, q), _host(torch, k), _host(torch, v), [1000, 333])
    np.testing.assert_allclose(_host(torch, out), ref, atol=2e-5, rtol=0)


@gpu
def test_gpu_device_lengths_are_clamped_not_trusted(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _torch_inputs(torch, rng, cap=300)
    dev = pyfa.Device("cuda")
    lens = torch.tensor([5000, -7], dtype=torch.int32, device="cuda")
    out = pyfa.decode_attention(q, k, v, lens, device=dev, out_dtype=np.float32)
    torch.cuda.synchronize()
    got = _host(torch, out)
    ref = _ref(_host(torch, q)[:1], _host(torch, k)[:1], _host(torch, v)[:1], [300])
    np.testing.assert_allclose(got[:1], ref, atol=2e-5, rtol=0)  # clamped to kv_capacity
    assert np.all(got[1] == 0)  # negative: no visible key, zeros


@gpu
def test_gpu_device_lengths_bad_input(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _torch_inputs(torch, rng, cap=64)
    dev = pyfa.Device("cuda")
    with pytest.raises(pyfa.InvalidArgumentError, match="kv_len: GPU values must be int32"):
        pyfa.decode_attention(q, k, v, torch.tensor([64, 64], device="cuda"), device=dev)
    with pytest.raises(pyfa.InvalidArgumentError, match=r"kv_len: expected 2 values \(one per sequence\)"):
        pyfa.decode_attention(q, k, v, torch.tensor([64, 64, 64], dtype=torch.int32, device="cuda"), device=dev)
    with pytest.raises(pyfa.InvalidArgumentError, match="ring_start: expected 2 values"):
        pyfa.decode_attention(q, k, v, 64, ring_start=torch.zeros((2, 2), dtype=torch.int32, device="cuda"),
                              device=dev)
    qn = _host(torch, q)
    with pytest.raises(pyfa.InvalidArgumentError, match="kv_len: a GPU array needs GPU inputs"):
        pyfa.decode_attention(qn, _host(torch, k), _host(torch, v), torch.tensor([64, 64], dtype=torch.int32,
                                                                                  device="cuda"), device=dev)


@gpu
def test_gpu_large_batch_of_host_lengths(rng):
    """More host values than a launch carries inline: uploaded on the stream."""
    torch = pytest.importorskip("torch")
    B = 600
    q, k, v = _torch_inputs(torch, rng, B=B, H=2, Hkv=1, D=64, cap=40, dtype="float16")
    lens = rng.integers(1, 41, B)
    out = pyfa.decode_attention(q, k, v, lens.tolist(), device=pyfa.Device("cuda"), out_dtype=np.float32)
    torch.cuda.synchronize()
    np.testing.assert_allclose(_host(torch, out), _ref(_host(torch, q), _host(torch, k), _host(torch, v), lens),
                               atol=2e-5, rtol=0)


@gpu
def test_cuda_graph_replay_sees_new_inputs_and_outlives_the_plan(rng):
    torch = pytest.importorskip("torch")
    dev = pyfa.Device("cuda")
    q, k, v = _torch_inputs(torch, rng, B=2, cap=2048)
    lens = torch.tensor([2048, 1500], dtype=torch.int32, device="cuda")
    out = torch.empty((2, 8, 128), dtype=torch.float32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (plans, compiles) outside the capture
        pyfa.decode_attention(q, k, v, lens, device=dev, out=out, out_dtype=np.float32)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        pyfa.decode_attention(q, k, v, lens, device=dev, out=out, out_dtype=np.float32)
    for step in range(3):
        q.copy_(torch.randn_like(q))
        k[:, :, :100].copy_(torch.randn_like(k[:, :, :100]))
        lens.copy_(torch.tensor([2048 - 300 * step, 900 + step], dtype=torch.int32))
        g.replay()
        eager = pyfa.decode_attention(q, k, v, lens, device=dev, out_dtype=np.float32)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(_host(torch, out), _host(torch, eager))
        ref = _ref(_host(torch, q), _host(torch, k), _host(torch, v), lens.cpu().numpy())
        np.testing.assert_allclose(_host(torch, out), ref, atol=2e-5, rtol=0)
    # Freeing every plan (and its workspace) does not break a later replay.
    _plans._table().clear()
    gc.collect()
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    ref = _ref(_host(torch, q), _host(torch, k), _host(torch, v), lens.cpu().numpy())
    np.testing.assert_allclose(_host(torch, out), ref, atol=2e-5, rtol=0)


def _prefill_desc(**over):
    attn = {"batch": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 64, "q_len": 8, "kv_len": 8, "q_offset": 0,
            "scale": 0.125, "q_strides": [1024, 512, 64], "k_strides": [512, 512, 64], "v_strides": [512, 512, 64],
            "out_strides": [1024, 512, 64], "mask_strides": [0, 0, 8]}
    d = {"attn": attn, "dtype": lib.PYFA_DTYPE_F32, "out_dtype": lib.PYFA_DTYPE_F32, "mask_dtype": -1}
    d.update(over)
    return ffi.new("pyfa_prefill_plan_desc *", d)


def test_prefill_plan_rules(cpu):
    out = ffi.new("pyfa_plan **")
    for over, match in (({"mask_dtype": lib.PYFA_DTYPE_I32}, "mask_dtype: i32 not accepted"),
                        ({"use_blk": 1}, "use_blk: needs a mask"),
                        ({"out_dtype": lib.PYFA_DTYPE_F16}, "out_dtype: f16 must be the I/O dtype"),
                        ({"reserved": 1}, "reserved: must be 0"),
                        # 17 (query tile, key tile) pairs more than the blk pass's grid holds (the CPU's
                        # 48 x 48 tiles): one shared mask row
                        ({"mask_dtype": lib.PYFA_DTYPE_U8, "use_blk": 1, "attn": {
                            "batch": 1, "num_heads": 1, "num_kv_heads": 1, "head_dim": 64, "q_len": 2**31 - 1,
                            "kv_len": 2304, "scale": 0.125}}, "make 2147483664 tiles of 48 x 48 for blk to classify; "
                                                             "must be at most 2147483647")):
        assert lib.pyfa_prefill_plan_new(out, cpu.handle, _prefill_desc(**over)) == lib.PYFA_ERR_INVALID_ARGUMENT
        assert match in _last_error()


def test_prefill_plan_run_matches_the_reference_and_checks_its_memory(cpu, rng):
    out = ffi.new("pyfa_plan **")
    assert lib.pyfa_prefill_plan_new(out, cpu.handle, _prefill_desc(mask_dtype=lib.PYFA_DTYPE_U8, use_blk=1,
                                                                    return_lse=1)) == 0, _last_error()
    plan = ffi.gc(out[0], lib.pyfa_plan_free)
    q = rng.standard_normal((1, 2, 8, 64)).astype(np.float32)
    k = rng.standard_normal((1, 1, 8, 64)).astype(np.float32)
    mask = np.tril(np.ones((8, 8), bool))
    o = np.zeros((1, 2, 8, 64), np.float32)
    lse = np.zeros((1, 2, 8), np.float32)
    a = ffi.new("pyfa_prefill_run_args *")
    for field, arr in (("q", q), ("k", k), ("v", k), ("mask", mask), ("out", o), ("lse", lse)):
        _tensor(getattr(a, field), arr)
    a.flags = lib.PYFA_RUN_FINISH
    assert lib.pyfa_prefill_run(plan, cpu.encoder(), a) == 0, _last_error()
    ref = pyfa.attention(q, k, k, mask=mask, scale=0.125, device=cpu, out_dtype=np.float32)
    np.testing.assert_allclose(o, ref, atol=2e-5, rtol=0)
    a.mask.address = 0
    assert lib.pyfa_prefill_run(plan, cpu.encoder(), a) == lib.PYFA_ERR_INVALID_ARGUMENT
    assert "mask: the plan was made with a mask" in _last_error()
    _tensor(a.mask, mask)
    a.lse.nbytes = 8
    assert lib.pyfa_prefill_run(plan, cpu.encoder(), a) == lib.PYFA_ERR_INVALID_ARGUMENT and "lse:" in _last_error()
    _tensor(a.lse, lse)
    a.flags = 4
    assert lib.pyfa_prefill_run(plan, cpu.encoder(), a) == lib.PYFA_ERR_INVALID_ARGUMENT and "flags" in _last_error()


def test_tq_decode_plan_rules(cpu):
    tq = {"attn": {"batch": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "kv_capacity": 16,
                   "scale": 0.125}, "k_bits": 4, "v_bits": 4}
    out = ffi.new("pyfa_plan **")
    d = ffi.new("pyfa_tq_decode_plan_desc *", {"tq": tq, "q_dtype": lib.PYFA_DTYPE_F32,
                                                "out_dtype": lib.PYFA_DTYPE_F16})
    assert lib.pyfa_tq_decode_plan_new(out, cpu.handle, d) == 0, _last_error()
    lib.pyfa_plan_free(out[0])
    for field, value, match in (("out_dtype", lib.PYFA_DTYPE_U8, "out_dtype: u8"),
                                ("q_dtype", lib.PYFA_DTYPE_I32, "q_dtype: i32"),
                                ("return_lse", 2, "return_lse: 2 must be 0 or 1")):
        bad = ffi.new("pyfa_tq_decode_plan_desc *", d[0])
        setattr(bad, field, value)
        assert lib.pyfa_tq_decode_plan_new(out, cpu.handle, bad) == lib.PYFA_ERR_INVALID_ARGUMENT
        assert match in _last_error()
    d.tq.k_bits = 5
    assert lib.pyfa_tq_decode_plan_new(out, cpu.handle, d) == lib.PYFA_ERR_INVALID_ARGUMENT
    assert "k_bits" in _last_error()


@gpu
def test_gpu_repeated_calls_keep_every_rule(rng):
    """A call repeating an earlier one's shapes and defaults takes the short path; the results
    and every rule stay those of the full path."""
    torch = pytest.importorskip("torch")
    from pyfa import decode

    dev = pyfa.Device("cuda")
    q, k, v = _torch_inputs(torch, rng, B=2, cap=512)
    first = pyfa.decode_attention(q, k, v, 400, device=dev)
    assert getattr(decode._repeat, "table", None), "the first call was not remembered"
    host = lambda x: _host(torch, x)
    for n in (400, 300, 512):  # 300 is another length bucket: full path, then remembered too
        got = pyfa.decode_attention(q, k, v, n, device=dev)
        assert got.dtype == q.dtype and got.shape == q.shape
        ref = _ref(host(q), host(k), host(v), [n, n])
        np.testing.assert_allclose(host(got), ref, atol=1e-2, rtol=0)  # bf16 output: half an ulp at |x| < 2
    torch.cuda.synchronize()
    np.testing.assert_array_equal(host(first), host(pyfa.decode_attention(q, k, v, 400, device=dev)))
    with pytest.raises(pyfa.InvalidArgumentError, match=r"kv_len\[0\]: 513 must be in 1...kv_capacity \(512\)"):
        pyfa.decode_attention(q, k, v, 513, device=dev)
    lens = torch.tensor([512, 100], dtype=torch.int32, device="cuda")
    pyfa.decode_attention(q, k, v, lens, device=dev)
    got = pyfa.decode_attention(q, k, v, lens, device=dev)
    np.testing.assert_allclose(host(got), _ref(host(q), host(k), host(v), [512, 100]), atol=1e-2, rtol=0)
    with pytest.raises(pyfa.InvalidArgumentError, match="kv_len: GPU values must be int32"):
        pyfa.decode_attention(q, k, v, lens.long(), device=dev)
    with pytest.raises(pyfa.InvalidArgumentError, match=r"kv_len: expected 2 values"):
        pyfa.decode_attention(q, k, v, lens[:1], device=dev)
    # A cache that grows by a row a call takes the short path at each capacity.
    entries = len(decode._repeat.table)
    for cap in (513, 514, 600):
        kg, vg = (torch.cat([t, t[:, :, :cap - 512]], 2) for t in (k, v))
        got = pyfa.decode_attention(q, kg, vg, cap, device=dev)
        np.testing.assert_allclose(host(got), _ref(host(q), host(kg), host(vg), [cap, cap]), atol=1e-2, rtol=0)
    assert len(decode._repeat.table) == entries + 1  # 513.. is one more length bucket, one entry for all three
    # A non-contiguous cache of the same shape is made contiguous by the full path.
    kt = k.transpose(2, 3).contiguous().transpose(2, 3)
    got = pyfa.decode_attention(q, kt, v, 200, device=dev)
    np.testing.assert_allclose(host(got), _ref(host(q), host(k), host(v), [200, 200]), atol=1e-2, rtol=0)
    # Options the short path does not handle take the full path.
    got = pyfa.decode_attention(q, k, v, 512, device=dev, window=64, out_dtype=np.float32)
    np.testing.assert_allclose(host(got), _ref(host(q), host(k), host(v), [512, 512], window=64), atol=2e-5, rtol=0)


def test_host_repeated_calls_keep_every_rule(device, rng):
    """numpy calls repeating an earlier one's shapes and defaults take the short path on a
    host-visible device; results and rules stay those of the full path."""
    if not device.host_visible:
        pytest.skip(f"{device.backend}: numpy inputs are copied to this device")
    from pyfa import decode

    decode._repeat.table = {}
    q = rng.standard_normal((2, 4, 64), dtype=np.float32)
    k = rng.standard_normal((2, 2, 512, 64), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((2, 2, 512, 64), dtype=np.float32).astype(np.float16)
    first = pyfa.decode_attention(q, k, v, 400, device=device)
    assert len(decode._repeat.table) == 1, "the first call was not remembered"
    for n in (400, 200, 512, 1):  # 200 and 1 are other length buckets: full path, then remembered
        got = pyfa.decode_attention(q, k, v, n, device=device)
        assert got.dtype == q.dtype and got.shape == q.shape
        np.testing.assert_allclose(got, _ref(q, k, v, [n, n]), atol=2e-6, rtol=1e-5)
    assert len(decode._repeat.table) == 3
    np.testing.assert_array_equal(first, pyfa.decode_attention(q, k, v, 400, device=device))
    # New arrays of the same shapes are read at their own addresses.
    q2, k2 = q[::-1].copy(), k[::-1].copy()
    np.testing.assert_allclose(pyfa.decode_attention(q2, k2, v, 400, device=device), _ref(q2, k2, v, [400, 400]),
                               atol=2e-6, rtol=1e-5)
    for bad, match in ((513, r"kv_len\[0\]: 513 must be in 1...kv_capacity \(512\)"),
                       (0, r"kv_len\[0\]: 0 must be in 1...kv_capacity")):
        with pytest.raises(pyfa.InvalidArgumentError, match=match):
            pyfa.decode_attention(q, k, v, bad, device=device)
    # Non-contiguous arrays of the same shape are made contiguous by the full path.
    kt = np.ascontiguousarray(k.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    np.testing.assert_allclose(pyfa.decode_attention(q, kt, v, 200, device=device), _ref(q, k, v, [200, 200]),
                               atol=2e-6, rtol=1e-5)
    # Another dtype, or options the short path does not handle, take the full path.
    got = pyfa.decode_attention(q, k.astype(np.float32), v.astype(np.float32), 512, device=device)
    np.testing.assert_allclose(got, _ref(q, k, v, [512, 512]), atol=2e-6, rtol=1e-5)
    got = pyfa.decode_attention(q, k, v, 512, device=device, window=64, out_dtype=np.float16)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got, _ref(q, k, v, [512, 512], window=64), atol=2e-3, rtol=0)
    # A cache of another shape goes the full path and is refused there; later calls still run.
    with pytest.raises(pyfa.InvalidArgumentError, match="v_cache"):
        pyfa.decode_attention(q, k, v[:, :, :256], 200, device=device)
    np.testing.assert_array_equal(first, pyfa.decode_attention(q, k, v, 400, device=device))


def test_host_repeat_path_allocates_nothing_in_the_library(device, rng):
    if not device.host_visible:
        pytest.skip(f"{device.backend}: numpy inputs are copied to this device")
    q = rng.standard_normal((1, 4, 64), dtype=np.float32)
    k = rng.standard_normal((1, 2, 64, 64), dtype=np.float32)
    for _ in range(3):
        pyfa.decode_attention(q, k, k, 50, device=device)
    before = pyfa.counters()
    for n in range(33, 64):
        pyfa.decode_attention(q, k, k, n, device=device)
    d = _delta(before, pyfa.counters())
    assert d["plans_created"] == 0 and d["host_allocations"] == 0, d


def test_host_repeat_path_keys_on_the_scale_and_the_device_name(rng):
    """The short path takes an explicit float scale (a model passes its own) and a backend name;
    each scale is its own entry, so a call never runs with another call's scale."""
    from pyfa import decode

    decode._repeat.table = {}
    q = rng.standard_normal((1, 4, 64), dtype=np.float32)
    k = rng.standard_normal((1, 2, 128, 64), dtype=np.float32)
    for scale in (0.125, 0.5, 0.125, None):
        for _ in range(2):  # the second call of each takes the short path
            got = pyfa.decode_attention(q, k, k, 100, scale=scale, device="cpu")
            np.testing.assert_allclose(got, _ref(q, k, k, [100], scale=scale), atol=2e-6, rtol=1e-5)
    assert len(decode._repeat.table) == 3
    with pytest.raises(pyfa.InvalidArgumentError, match="unknown backend 'bogus'"):
        pyfa.decode_attention(q, k, k, 100, scale=0.125, device="bogus")


def test_host_repeat_path_is_taken(rng):
    """A numpy call matching a remembered one is answered by the short path itself."""
    from pyfa import decode

    cpu = pyfa.Device("cpu")
    decode._repeat.table = {}
    q = rng.standard_normal((1, 4, 64), dtype=np.float32)
    k = rng.standard_normal((1, 2, 64, 64), dtype=np.float32)
    pyfa.decode_attention(q, k, k, 50, device=cpu)
    got = decode._repeat_call(q, k, k, 60, cpu, None)
    assert got is not None, "a matching call took the full path"
    np.testing.assert_allclose(got, _ref(q, k, k, [60]), atol=2e-6, rtol=1e-5)


def test_host_repeat_path_serves_a_growing_cache(rng):
    """Caches that grow by a row a call (transformers' DynamicCache concatenates) keep one entry:
    the short path takes each capacity, in either direction, and the rules stay the full path's."""
    from pyfa import decode

    cpu = pyfa.Device("cpu")
    decode._repeat.table = {}
    q = rng.standard_normal((2, 4, 64), dtype=np.float32)
    caches = [rng.standard_normal((2, 2, n, 64), dtype=np.float32).astype(np.float16) for n in range(40, 64)]
    pyfa.decode_attention(q, caches[0], caches[0], 40, device=cpu)
    for k in caches[1:] + caches[::-1]:  # longer, then shorter again
        n = k.shape[2]
        v = k[:, ::-1].copy()
        got = decode._repeat_call(q, k, v, n, cpu, None)
        assert got is not None, f"capacity {n}: a matching call took the full path"
        np.testing.assert_allclose(got, _ref(q, k, v, [n, n]), atol=2e-6, rtol=1e-5)
        np.testing.assert_array_equal(pyfa.decode_attention(q, k, v, n - 3, device=cpu),
                                      pyfa.decode_attention(q, k.copy(), v.copy(), n - 3, device=cpu, window=n))
    assert len(decode._repeat.table) == 1
    k = caches[-1]
    with pytest.raises(pyfa.InvalidArgumentError, match=r"kv_len\[0\]: 64 must be in 1...kv_capacity \(63\)"):
        pyfa.decode_attention(q, k, k, 64, device=cpu)
    with pytest.raises(pyfa.InvalidArgumentError, match="v_cache"):  # k's and v's capacities differ
        pyfa.decode_attention(q, k, caches[-2], 40, device=cpu)


def test_dispatches_of_a_failed_call_do_not_reach_the_next_run(cpu):
    """A call recording several dispatches on this thread's encoder (pyfa/_io.py: GPU arrays) that
    fails before submitting leaves them behind; the next plan run on that encoder drops them."""
    from pyfa import _io, _plans
    cache = cpu.buffer((1, 4, 64), np.float32)
    cache.numpy()[:] = 0
    src = cpu.wrap(np.ones((1, 1, 64), np.float32))
    params = ffi.new("pyfa_kv_append_params *", {"num_tokens": 1, "num_kv_heads": 1, "head_dim": 64,
                                                 "kv_capacity": 4, "write_pos": 2})

    class Like:  # what _io.encoder reads of a GPU array
        stream = 0
    enc = _io.encoder(cpu, Like())
    assert lib.pyfa_kv_append(enc, params, src.handle, cache.handle) == lib.PYFA_OK
    # ... and the call raises here, before _io.submit.
    again = _plans.encoder(cpu)
    assert again == enc
    assert lib.pyfa_encoder_commit(again) == lib.PYFA_OK and lib.pyfa_encoder_wait(again) == lib.PYFA_OK
    assert not cache.numpy().any()
    # A call that submits leaves its work to run, and the encoder as it found it.
    enc = _io.encoder(cpu, Like())
    assert lib.pyfa_kv_append(enc, params, src.handle, cache.handle) == lib.PYFA_OK
    _io.submit(enc, Like())
    assert lib.pyfa_encoder_wait(enc) == lib.PYFA_OK
    assert cache.numpy()[0, 2].all() and _plans.encoder(cpu) == enc
