"""Serving-loop benchmarks: what a decode loop pays per call, per layer step and
per cache token, through the public API as users call it, beside the peer timed
in the same run (torch SDPA for the GPU cases).

Cases (shapes in the test ids; bf16, H_q / H_kv = 32 / 8, D = 128 on the GPU):

- call: one decode call on torch CUDA tensors (B=1, 4K cache), pyfa.decode_attention
  beside torch's scaled_dot_product_attention (flash backend, q [B, H, 1, D], k/v
  [B, H_kv, L, D], enable_gqa=True).
- step: a 32-layer decode step (32 calls, each layer its own K/V, then one
  torch.cuda.synchronize()), B = 1, 8 and L = 4K, 32K: torch flash, torch cuDNN,
  pyfa, and the pyfa step captured in a CUDA graph with kv_len a device int32 tensor.
- cache: pyfa.KVCache / pyfa.TurboQuantKVCache on the cuda device fed torch tensors:
  append one token, then attend, as two calls and as one (attend(q, k=, v=): "-fused"),
  against the GPU time of the step's kernels (the append's and the attend's; the attend's
  alone is recorded beside it); and the two-call step captured
  in a CUDA graph (the cache keeps its length on the device) and replayed ("-graph").
- cpu: a tiny decode on numpy (B=1, H=1, D=64, kv_len=1, f32) on the CPU backend,
  beside the same arithmetic in numpy. Runs without torch (CI runs it once).
- cpu-cache: one layer's decode step through pyfa.KVCache on the CPU backend (append a
  token to a full 1024-row ring, attend) beside the same step in numpy; reported only.

Instruments. "us" (wall): a timed round queues N calls (or steps) without a sync
inside the loop, then synchronizes once; us = round time / N. It is the larger of
the host's cost per call and the GPU's. "gpu_us": CUDA events around the same N
calls with the stream held (torch.cuda._sleep) until the host has queued them, so
the GPU runs them back to back: the device's own time per call. "kernel_us" of the
cache cases: the GPU busy time (kernels and copies, from torch.profiler / CUPTI) of
one step (append + attend), since the caches may run on streams the events do not see.

Targets (each pyfa row records its peer, ratio, target and whether it met it in
benchmark.extra_info; scripts/serving_report.py turns the JSON into a table):
call overhead <= torch flash's (aim <= 10 us); 32-layer step within 1.1x torch flash
at 4K and faster at 32K; graph-captured step faster than torch flash eager; cache
append+attend within 1.2x its kernels' GPU time; CPU tiny call <= 10 us.
They are recorded, not enforced, unless --serving-gates is given (benchmarks/conftest.py).

Variants that the current API refuses (a device kv_len for the graph, torch tensors
for the caches) skip with the library's message as the reason.

    python3 -m pytest benchmarks/test_serving_loop.py --benchmark-enable -rs \\
        --benchmark-json=serving.json | tee serving.txt
    python3 scripts/serving_report.py serving.json --skips serving.txt > docs/cuda/serving_<gpu>.md
"""
import statistics
import time

import numpy as np
import pytest

import pyfa
from gate_record import record_gate

try:
    import torch
except ImportError:  # the cpu cases run without it
    torch = None

HQ, HKV, D = 32, 8, 128
LAYERS = 32
CALL_L = 4096
STEP_SHAPES = [(1, 4096), (1, 32768), (8, 4096), (8, 32768)]
CACHE_LENGTHS = [4096, 32768]

# (case, shape, impl) -> wall us per call / step, for the rows that compare with a peer timed earlier.
_measured: dict = {}


# --------------------------------------------------------------------------- targets and gates

def _shape(B, L, layers=None, dtype="bf16", H=HQ, Hkv=HKV, d=D):
    prefix = f"layers{layers}-" if layers else ""
    return f"{prefix}B{B}-H{H}x{Hkv}-D{d}-L{L}-{dtype}"


def _group(benchmark, case, shape):
    """Names the pytest-benchmark group (before timing: the group is read then)."""
    benchmark.group = f"{case} {shape}"


UNITS = {"call": "call", "step": f"step ({LAYERS} calls)", "cache": "append + attend", "cpu": "call",
         "cpu-cache": "append + attend"}


def _record(benchmark, case, shape, impl, per_round, us, gpu=None, **extra):
    """extra_info of a row: wall ``us`` per unit of the case (a call, a step, a
    token), ``per_round`` units per timed round, ``gpu`` = gpu_us()'s (us, held)."""
    benchmark.extra_info.update(case=case, shape=shape, impl=impl, unit=UNITS[case], per_round=per_round, **extra)
    if us is not None:
        benchmark.extra_info["us"] = round(us, 3)
        _measured[(case, shape, impl)] = us
    if gpu is not None:
        benchmark.extra_info.update(gpu_us=round(gpu[0], 3), gpu_held=gpu[1])


def _target(request, benchmark, *, peer, peer_us, us, target, limit, strict=False, absolute=False):
    """Records pyfa's ratio to ``peer`` (us / peer_us) and whether it meets
    ``limit`` (a ratio, or with ``absolute`` a bound in us; ``strict``: below
    it); fails the test only under --serving-gates."""
    info = benchmark.extra_info
    info.update(peer=peer, target=target, limit=limit)
    if peer_us is not None:
        info["peer_us"] = round(peer_us, 3)
    ratio = us / peer_us if (us is not None and peer_us) else None
    if ratio is not None:
        info["ratio"] = round(ratio, 3)
    value = us if absolute else ratio
    if value is None:
        return
    enforced = request.config.getoption("--serving-gates", default=False)
    met = record_gate(request, f"{info['case']} {info['shape']} {info['impl']}", value, "<" if strict else "<=",
                      limit, f"{target} ({'us' if absolute else 'ratio to ' + peer})", enforced=enforced)
    info["met"] = met
    if not met and enforced:
        pytest.fail(f"{info['case']} {info['shape']}: {target} missed "
                    f"({us:.2f} us{'' if ratio is None else f', {ratio:.3f}x {peer}'})")


def _median_us(benchmark, calls):
    """pytest-benchmark's median round time per call in us (None when timing is disabled)."""
    stats = getattr(benchmark, "stats", None)
    return stats.stats.median / calls * 1e6 if stats else None


# --------------------------------------------------------------------------- GPU instruments

@pytest.fixture(scope="module")
def gpu():
    """(pyfa cuda device, keyword arguments of a call as users write it): calls
    name no device when the default device is the cuda one."""
    if torch is None:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)")
    try:
        dev = pyfa.Device("cuda")
    except pyfa.PyfaError as e:
        pytest.skip(f"pyfa cuda backend unavailable: {e}")
    kw = {} if pyfa.default_device().backend == "cuda" else {"device": dev}
    return dev, kw


def _gpu_info(benchmark):
    benchmark.extra_info.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__)


_cycles_per_us = None


def _sleep_rate():
    """GPU clock cycles per us of torch.cuda._sleep (None where torch lacks it)."""
    global _cycles_per_us
    if _cycles_per_us is None and hasattr(torch.cuda, "_sleep"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        _cycles_per_us = 20_000_000 / (start.elapsed_time(end) * 1000.0)
    return _cycles_per_us


def gpu_us(enqueue, n, reps=5):
    """(median GPU us per ``enqueue()``, held) over ``n`` calls queued while the
    stream is held, so the device runs them back to back whatever the host's
    speed. A rep whose queueing outlasted the hold is repeated with a hold four
    times its queueing time; after three such overruns the calls are taken to
    wait for the GPU themselves (a synchronisation inside them), holding cannot
    help, and the events time them as they run (held is False: host gaps count)."""
    rate = _sleep_rate()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    hold_us, samples, overruns = (2000.0 if rate else 0.0), [], 0
    while len(samples) < reps:
        torch.cuda.synchronize()
        if hold_us:
            torch.cuda._sleep(int(hold_us * rate))
        t0 = time.perf_counter()
        start.record()
        for _ in range(n):
            enqueue()
        end.record()
        queued_us = (time.perf_counter() - t0) * 1e6
        end.synchronize()
        if hold_us and queued_us > 0.8 * hold_us:
            overruns += 1
            hold_us = 0.0 if overruns >= 3 else min(4 * queued_us + 1000.0, 2e6)
            continue
        samples.append(start.elapsed_time(end) * 1000.0 / n)
    return statistics.median(samples), bool(hold_us)


def kernel_us(fn, reps=20):
    """GPU busy us per ``fn()`` (union of the device intervals of kernels, copies and
    memsets that torch.profiler / CUPTI saw, on any stream), or None when the
    profiler recorded no device activity."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, until = 0.0, None
    for s, e in spans:
        if until is None or s > until:
            busy += e - s
            until = e
        elif e > until:
            busy += e - until
            until = e
    return busy / reps if spans else None


def _loop(fn, n):
    """n calls of fn without a sync inside, then one torch.cuda.synchronize()."""
    def run():
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return run


def _sdpa_backend(name):
    from torch.nn.attention import SDPBackend

    return {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION}[name]


def _probe_sdpa(impl, q4, k, v):
    """Runs one torch SDPA call under ``impl``'s backend or skips with torch's reason."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    try:
        with sdpa_kernel(_sdpa_backend(impl)):
            F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
            torch.cuda.synchronize()
    except RuntimeError as e:
        pytest.skip(f"{impl} has no kernel for this case: {str(e).splitlines()[0]}")


# --------------------------------------------------------------------------- call overhead

CALL_IMPLS = ["torch-flash", "pyfa"]


@pytest.mark.parametrize("impl", CALL_IMPLS, ids=lambda i: f"{i}-{_shape(1, CALL_L)}")
def test_call_overhead(benchmark, request, gpu, full_size, impl):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    dev, kw = gpu
    B, L, n = 1, CALL_L, (100 if full_size else 3)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn((B, HQ, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn((B, HKV, L, D), generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn((B, HKV, L, D), generator=g, device="cuda", dtype=torch.bfloat16)
    _gpu_info(benchmark)
    shape = _shape(B, L)
    _group(benchmark, "call", shape)
    if impl == "pyfa":
        call = lambda: pyfa.decode_attention(q, k, v, L, **kw)  # noqa: E731
        call()
        benchmark.pedantic(_loop(call, n), rounds=20 if full_size else 1, warmup_rounds=2 if full_size else 0)
        us = _median_us(benchmark, n)
        _record(benchmark, "call", shape, impl, n, us, gpu_us(call, min(n, 50)) if full_size else None)
        peer = "torch-flash"
        _target(request, benchmark, peer=peer, peer_us=_measured.get(("call", shape, peer)), us=us,
                target="<= 1.00x torch-flash (aim <= 10 us)", limit=1.0)
        return
    q4 = q.view(B, HQ, 1, D)
    _probe_sdpa(impl, q4, k, v)
    call = lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)  # noqa: E731
    with sdpa_kernel(_sdpa_backend(impl)):
        benchmark.pedantic(_loop(call, n), rounds=20 if full_size else 1, warmup_rounds=2 if full_size else 0)
        _record(benchmark, "call", shape, impl, n, _median_us(benchmark, n),
                gpu_us(call, min(n, 50)) if full_size else None)


# --------------------------------------------------------------------------- 32-layer decode step

class _Layers:
    """q, K and V of each of 32 layers for one (B, L), kept while tests of that
    shape run (B=8, L=32K holds 32 GiB of K/V; the previous shape is freed first)."""

    shape = None
    qs = ks = vs = ()

    @classmethod
    def get(cls, B, L):
        if cls.shape != (B, L):
            cls.qs = cls.ks = cls.vs = ()
            torch.cuda.empty_cache()
            g = torch.Generator(device="cuda").manual_seed(B * 1_000_003 + L)
            new = lambda *s: torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
            cls.qs = [new(B, HQ, D) for _ in range(LAYERS)]
            cls.ks = [new(B, HKV, L, D) for _ in range(LAYERS)]
            cls.vs = [new(B, HKV, L, D) for _ in range(LAYERS)]
            cls.shape = (B, L)
        return cls.qs, cls.ks, cls.vs

    @classmethod
    def release(cls):
        cls.qs = cls.ks = cls.vs = ()
        cls.shape = None
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()


STEP_IMPLS = ["torch-flash", "torch-cudnn", "pyfa", "pyfa-graph"]
STEP_CASES = [(impl, B, L) for B, L in STEP_SHAPES for impl in STEP_IMPLS]  # peers first within a shape


def _capture(calls):
    """A CUDA graph of ``calls()`` after two warm-up runs on a side stream (torch's recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            calls()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = calls()
    return graph, outputs


def device_kv_len_or_skip(q, k, v, lens, kw):
    """One eager call with a device kv_len; skips with the library's message if it is refused."""
    try:
        pyfa.decode_attention(q, k, v, lens, **kw)
    except pyfa.PyfaError as e:
        pytest.skip(f"the current API refuses a device kv_len: {e}")
    torch.cuda.synchronize()


@pytest.mark.parametrize("impl,B,L", STEP_CASES, ids=[f"{i}-{_shape(B, L, LAYERS)}" for i, B, L in STEP_CASES])
def test_decode_step(benchmark, request, gpu, full_size, impl, B, L):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    if not full_size and (B, L) != STEP_SHAPES[0]:
        pytest.skip("larger shapes only when benchmarking is enabled")
    dev, kw = gpu
    qs, ks, vs = _Layers.get(B, L)
    layers = list(zip(qs, ks, vs))
    _gpu_info(benchmark)
    shape = _shape(B, L, LAYERS)
    _group(benchmark, "step", shape)
    rounds, warmup = (30, 3) if full_size else (1, 0)

    if impl.startswith("torch"):
        q4s = [q.view(B, HQ, 1, D) for q in qs]
        _probe_sdpa(impl, q4s[0], ks[0], vs[0])

        def calls():
            for q4, k, v in zip(q4s, ks, vs):
                F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

        with sdpa_kernel(_sdpa_backend(impl)):
            benchmark.pedantic(_loop(calls, 1), rounds=rounds, warmup_rounds=warmup)
            _record(benchmark, "step", shape, impl, 1, _median_us(benchmark, 1),
                    gpu_us(calls, 1) if full_size else None)
        return

    if impl == "pyfa":
        def calls():
            return [pyfa.decode_attention(q, k, v, L, **kw) for q, k, v in layers]

        calls()
        benchmark.pedantic(_loop(calls, 1), rounds=rounds, warmup_rounds=warmup)
        us = _median_us(benchmark, 1)
        _record(benchmark, "step", shape, impl, 1, us, gpu_us(calls, 1) if full_size else None)
        flash = _measured.get(("step", shape, "torch-flash"))
        cudnn = _measured.get(("step", shape, "torch-cudnn"))
        if us is not None and cudnn:
            benchmark.extra_info["ratio_vs_torch_cudnn"] = round(us / cudnn, 3)
        if L <= 4096:
            _target(request, benchmark, peer="torch-flash", peer_us=flash, us=us,
                    target="<= 1.10x torch-flash", limit=1.1)
        else:
            _target(request, benchmark, peer="torch-flash", peer_us=flash, us=us,
                    target="< 1.00x torch-flash", limit=1.0, strict=True)
        return

    # pyfa-graph: the same 32 calls captured once, replayed per step.
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    device_kv_len_or_skip(qs[0], ks[0], vs[0], lens, kw)
    graph, _outputs = _capture(lambda: [pyfa.decode_attention(q, k, v, lens, **kw) for q, k, v in layers])
    try:
        benchmark.pedantic(_loop(graph.replay, 1), rounds=rounds, warmup_rounds=warmup)
        us = _median_us(benchmark, 1)
        _record(benchmark, "step", shape, impl, 1, us, gpu_us(graph.replay, 1) if full_size else None)
        _target(request, benchmark, peer="torch-flash", peer_us=_measured.get(("step", shape, "torch-flash")), us=us,
                target="< 1.00x torch-flash eager", limit=1.0, strict=True)
    finally:
        del graph, _outputs
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- cache append + attend

CACHE_KINDS = ["KVCache", "TurboQuantKVCache-4bit"]
CACHE_CASES = [(kind, L) for L in CACHE_LENGTHS for kind in CACHE_KINDS]


def _cache(kind, L, dev):
    # A ring of capacity L with a window of L: full after the first fill, so every
    # timed step appends one token and attends over exactly L.
    if kind == "KVCache":
        return pyfa.KVCache(HKV, D, L, dtype=pyfa.bfloat16, sliding_window=L, device=dev)
    return pyfa.TurboQuantKVCache(HKV, D, L, k_bits=4, v_bits=4, sliding_window=L, device=dev)


def _cache_case(gpu, full_size, kind, L):
    """(cache, L rows to fill it, one k row, one v row, q) of a cache case, the step cases' K/V
    (up to 32 GiB) released first; the 32K shapes only when benchmarking."""
    dev, _kw = gpu
    _Layers.release()
    if not full_size and L != CACHE_LENGTHS[0]:
        pytest.skip("larger shapes only when benchmarking is enabled")
    g = torch.Generator(device="cuda").manual_seed(L)
    new = lambda *s: torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return _cache(kind, L, dev), new(L, HKV, D), new(1, HKV, D), new(1, HKV, D), new(HQ, D)


@pytest.mark.parametrize("form", ["calls", "fused"])
@pytest.mark.parametrize("kind,L", CACHE_CASES, ids=[f"{k}-{_shape(1, L)}" for k, L in CACHE_CASES])
def test_cache_append_attend(benchmark, request, gpu, full_size, kind, L, form):
    """calls: cache.append(k, v) then cache.attend(q); fused: cache.attend(q, k=k, v=v), one call."""
    cache, rows, k1, v1, q = _cache_case(gpu, full_size, kind, L)
    try:
        cache.append(rows, rows)
        cache.attend(q)
    except pyfa.PyfaError as e:
        pytest.skip(f"{kind} on the cuda device refuses torch tensors: {e}")
    torch.cuda.synchronize()
    _gpu_info(benchmark)
    shape = _shape(1, L)
    _group(benchmark, "cache", shape)
    n = 50 if full_size else 2

    def step():
        if form == "fused":
            return cache.attend(q, k=k1, v=v1)
        cache.append(k1, v1)
        return cache.attend(q)

    benchmark.pedantic(_loop(step, n), rounds=20 if full_size else 1, warmup_rounds=2 if full_size else 0)
    us = _median_us(benchmark, n)
    # The step's kernels (the append's and the attend's) are the peer; the attend's alone is recorded beside.
    step_us = kernel_us(step) if full_size else None
    attend_us = kernel_us(lambda: cache.attend(q)) if full_size else None
    _record(benchmark, "cache", shape, kind if form == "calls" else f"{kind}-fused", n, us,
            kernel_us=None if step_us is None else round(step_us, 3))
    if attend_us is not None:
        benchmark.extra_info["attend_kernel_us"] = round(attend_us, 3)
    if full_size and step_us is None:
        benchmark.extra_info["kernel_us_note"] = "torch.profiler recorded no device activity (no CUPTI?)"
    _target(request, benchmark, peer="append + attend kernels' GPU time", peer_us=step_us, us=us,
            target="<= 1.20x the kernels' own time", limit=1.2)


@pytest.mark.parametrize("kind,L", CACHE_CASES, ids=[f"{k}-graph-{_shape(1, L)}" for k, L in CACHE_CASES])
def test_cache_append_attend_graph(benchmark, request, gpu, full_size, kind, L):
    """The same step captured in a CUDA graph (the cache keeps its length on the device, so each
    replay appends after the last), replayed; the peer is the eager step's kernels' GPU time."""
    cache, rows, k1, v1, q = _cache_case(gpu, full_size, kind, L)

    def step():
        cache.append(k1, v1)
        return cache.attend(q)

    cache.append(rows, rows)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a capture that fails is a failure, not a skip
        step()
    _gpu_info(benchmark)
    shape = _shape(1, L)
    _group(benchmark, "cache", shape)
    n = 50 if full_size else 2
    rounds, warmup = (20, 2) if full_size else (1, 0)
    ring_start = int(cache._state.read()[2])
    benchmark.pedantic(_loop(graph.replay, n), rounds=rounds, warmup_rounds=warmup)
    # Each replay appended one token to the full ring: its oldest slot moved by one per replay.
    assert int(cache._state.read()[2]) == (ring_start + (rounds + warmup) * n) % L
    us = _median_us(benchmark, n)
    step_us = kernel_us(step) if full_size else None
    _record(benchmark, "cache", shape, f"{kind}-graph", n, us, kernel_us=None if step_us is None else round(step_us, 3))
    _target(request, benchmark, peer="append + attend kernels' GPU time (eager)", peer_us=step_us, us=us,
            target="<= 1.20x the kernels' own time", limit=1.2)
    del graph
    torch.cuda.synchronize()


# --------------------------------------------------------------------------- CPU backend

CPU_SHAPE = _shape(1, 1, dtype="f32", H=1, Hkv=1, d=64)


@pytest.mark.parametrize("impl", ["numpy", "pyfa-cpu"], ids=lambda i: f"{i}-{CPU_SHAPE}")
def test_cpu_tiny_decode(benchmark, request, cpu, impl):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 64), dtype=np.float32)
    k = rng.standard_normal((1, 1, 1, 64), dtype=np.float32)
    v = rng.standard_normal((1, 1, 1, 64), dtype=np.float32)
    scale = 1.0 / np.sqrt(64)

    def numpy_decode():
        s = (k[0, 0, :1] @ q[0, 0]) * scale
        w = np.exp(s - s.max())
        return (w / w.sum()) @ v[0, 0, :1]

    _group(benchmark, "cpu", CPU_SHAPE)
    fn = numpy_decode if impl == "numpy" else (lambda: pyfa.decode_attention(q, k, v, 1, device=cpu))
    # Fixed rounds after a warm-up, both sides alike: a decode loop's steady state. (Calibrated
    # rounds followed the first call, which makes the plan: ~70 rounds for pyfa against ~3,700
    # for numpy, and a median that moved with them.)
    out = benchmark.pedantic(fn, rounds=3000, warmup_rounds=100)
    # One visible key: its weight is 1 and the output is its value row.
    np.testing.assert_allclose(np.asarray(out).reshape(-1), v.reshape(-1), rtol=1e-6, atol=1e-7)
    us = _median_us(benchmark, 1)
    _record(benchmark, "cpu", CPU_SHAPE, impl, 1, us)
    if impl == "pyfa-cpu":
        _target(request, benchmark, peer="numpy", peer_us=_measured.get(("cpu", CPU_SHAPE, "numpy")), us=us,
                target="<= 10 us per call", limit=10.0, absolute=True)


CPU_CACHE_SHAPE = _shape(1, 1024, dtype="f32", H=1, Hkv=1, d=64)


@pytest.mark.parametrize("impl", ["numpy", "pyfa-cpu"], ids=lambda i: f"{i}-{CPU_CACHE_SHAPE}")
def test_cpu_cache_step(benchmark, request, cpu, impl):
    """A decode step of one layer on the CPU backend: append one token to a full ring of 1024 rows
    (sliding window 1024, so the work per step stays the same) and attend, against the same step
    in numpy (write the row into a ring array, then softmax(q k^T) v over it). Reported, not gated."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((1024, 1, 64), dtype=np.float32)
    q = rng.standard_normal((1, 64), dtype=np.float32)
    scale = 1.0 / np.sqrt(64)
    if impl == "numpy":
        ring_k, ring_v = rows[:, 0].copy(), rows[:, 0].copy()
        pos = [0]

        def step():
            ring_k[pos[0]] = rows[pos[0], 0]
            ring_v[pos[0]] = rows[pos[0], 0]
            pos[0] = (pos[0] + 1) % 1024
            s = (ring_k @ q[0]) * scale
            w = np.exp(s - s.max())
            return (w / w.sum()) @ ring_v
    else:
        cache = pyfa.KVCache(1, 64, 1024, dtype=np.float32, sliding_window=1024, device=cpu)
        cache.append(rows, rows)
        pos = [0]

        def step():
            r = rows[pos[0]:pos[0] + 1]
            pos[0] = (pos[0] + 1) % 1024
            cache.append(r, r)
            return cache.attend(q)
    _group(benchmark, "cpu-cache", CPU_CACHE_SHAPE)
    out = benchmark(step)
    assert np.isfinite(np.asarray(out)).all()
    us = _median_us(benchmark, 1)
    _record(benchmark, "cpu-cache", CPU_CACHE_SHAPE, impl, 1, us)
