"""pyfa.decode_attention captured in a CUDA graph (torch.cuda.graph) with kv_len a
device int32 tensor: replaying after q, the cache contents and kv_len were changed
in place gives what an eager call on the new values gives (bit for bit: the same
kernels read the same inputs), and what the float64 reference gives.

Skips without torch, without a CUDA device, and while the API refuses a device
kv_len (the reason is the library's message).
"""
import numpy as np
import pytest

import pyfa
from pyfa import reference

from cuda_torch import torch_and_cuda_device

torch, DEVICE = torch_and_cuda_device()

B, H, HKV, D, CAP = 3, 8, 2, 128, 512
# Lengths per replay: full, short and uneven, the extremes (1 and capacity) side by side.
LENGTHS = [[CAP, CAP, CAP], [1, 300, 77], [CAP, 2, CAP - 1]]
# max |out - reference| by output dtype. The reference reads the same rounded q/K/V,
# so only f32 accumulation order (~1e-6 on outputs of order 1) and the output's own
# rounding (half an ulp: 2^-9 relative for bf16, 2^-12 for f16) remain.
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _filled(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def _device_lengths_or_skip(q, k, v, lens, **kw):
    try:
        pyfa.decode_attention(q, k, v, lens, device=DEVICE, **kw)
    except pyfa.PyfaError as e:
        pytest.skip(f"the current API refuses a device kv_len: {e}")
    torch.cuda.synchronize()


def _capture(call):
    """(graph, its output) after two warm-up calls on a side stream (torch's recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def _reference(q, k, v, lens, **kw):
    host = lambda t: t.float().cpu().numpy()  # noqa: E731  (exact: bf16/f16 widen to f32 exactly)
    return reference.decode_attention(host(q), host(k), host(v), lens.cpu().numpy(), **kw)


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_replay_follows_values_changed_in_place(dtype, window):
    q, k, v = _filled((B, H, D), dtype, 1), _filled((B, HKV, CAP, D), dtype, 2), _filled((B, HKV, CAP, D), dtype, 3)
    lens = torch.full((B,), CAP, dtype=torch.int32, device="cuda")
    _device_lengths_or_skip(q, k, v, lens, window=window)
    graph, out = _capture(lambda: pyfa.decode_attention(q, k, v, lens, window=window, device=DEVICE))
    for i, lengths in enumerate(LENGTHS):
        if i:  # new values in the captured tensors' memory, as a serving loop writes them
            q.copy_(_filled(q.shape, dtype, 10 * i))
            k.copy_(_filled(k.shape, dtype, 10 * i + 1))
            v.copy_(_filled(v.shape, dtype, 10 * i + 2))
            lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        eager = pyfa.decode_attention(q, k, v, lens, window=window, device=DEVICE)
        assert torch.equal(out, eager), f"replay {i} (kv_len {lengths}) differs from an eager call"
        ref = _reference(q, k, v, lens, window=window)
        err = float(np.abs(out.float().cpu().numpy() - ref).max())
        assert err <= TOL[out.dtype], f"replay {i} (kv_len {lengths}): max error {err} against the reference"


def test_replays_of_a_two_layer_step_keep_their_own_inputs():
    """Two calls in one graph (two layers, each its own cache) sharing one device kv_len."""
    dtype = torch.bfloat16
    layers = [(_filled((B, H, D), dtype, 4 * j), _filled((B, HKV, CAP, D), dtype, 4 * j + 1),
               _filled((B, HKV, CAP, D), dtype, 4 * j + 2)) for j in range(2)]
    lens = torch.tensor(LENGTHS[1], dtype=torch.int32, device="cuda")
    _device_lengths_or_skip(*layers[0], lens)
    graph, outs = _capture(lambda: [pyfa.decode_attention(q, k, v, lens, device=DEVICE) for q, k, v in layers])
    for lengths in LENGTHS:
        lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        for (q, k, v), out in zip(layers, outs):
            assert torch.equal(out, pyfa.decode_attention(q, k, v, lens, device=DEVICE)), f"kv_len {lengths}"


# ---- KVCache / TurboQuantKVCache steps captured in a graph -----------------------------------------
# On a GPU a cache keeps its length on the device: the append advances it and writes where it says,
# the attend reads it, so a captured step appends after the previous replay's row.

def _cache(kind, cap, window):
    """A bf16 dense or 4-bit TurboQuant cache of `cap` slots on the GPU."""
    if kind == "dense":
        return pyfa.KVCache(HKV, D, cap, dtype=pyfa.bfloat16, sliding_window=window, device=DEVICE)
    return pyfa.TurboQuantKVCache(HKV, D, cap, k_bits=4, v_bits=4, sliding_window=window, device=DEVICE)


def _twins(kind, cap, window, seed, fused=False):
    """(eager, captured, feed, step): twin caches, the input tensors a graph captures (filled anew
    by feed(t), as a decode loop writes them) and a step (append one token, attend) on either;
    with `fused` the captured cache's step is one call, attend(q, k=, v=)."""
    dtype = torch.bfloat16
    eager, captured = _cache(kind, cap, window), _cache(kind, cap, window)
    k_in, v_in, q_in = (torch.empty(s, dtype=dtype, device="cuda") for s in ((1, HKV, D), (1, HKV, D), (H, D)))

    def feed(t):
        for j, x in enumerate((k_in, v_in, q_in)):
            x.copy_(_filled(x.shape, dtype, seed * t + j))

    def step(c):
        if fused and c is captured:
            return c.attend(q_in, k=k_in, v=v_in)
        c.append(k_in, v_in)
        return c.attend(q_in)

    return eager, captured, feed, step


@pytest.mark.parametrize("form", ["calls", "fused"])
@pytest.mark.parametrize("window", [None, 24], ids=["no-window", "ring"])
@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_cache_step_replays_like_eager_steps(kind, window, form):
    """A graph of (append one token, attend: two calls, or one attend with k and v), replayed with
    new rows and q each time, gives what the
    same eager steps on a twin cache give, bit for bit, through the ring's wrap; len() reads the
    length the replays left; a replay into a full cache without a window writes nothing and is
    reported; the graph still replays after the cache object is gone."""
    cap = 32
    eager, captured, feed, step = _twins(kind, cap, window, 3, fused=form == "fused")
    t = 0
    for _ in range(3):  # eager warm-up on both: plans made, kernels compiled
        feed(t)
        assert torch.equal(step(captured), step(eager))
        t += 1
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(captured)
    torch.cuda.synchronize()
    assert captured._captured and len(captured) == 3  # capture ran nothing
    replays = cap - 3 if window is None else 2 * cap
    for i in range(replays):
        feed(t)
        graph.replay()
        want = step(eager)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"replay {i} differs from the eager step"
        t += 1
    assert len(captured) == len(eager) == min(3 + replays, cap)
    if window is None:  # full: one more replay is dropped on the device and reported once
        graph.replay()
        torch.cuda.synchronize()
        with pytest.raises(pyfa.PyfaError, match="1 replayed append"):
            len(captured)
        assert len(captured) == cap
        q = _filled((H, D), torch.bfloat16, 99)
        assert torch.equal(captured.attend(q), eager.attend(q))
    del captured
    import gc
    gc.collect()
    graph.replay()  # the captured memory stays allocated: no fault
    torch.cuda.synchronize()


def test_a_cache_without_a_window_captures_twice():
    """A second capture of a cache without a window (after the first set the cache's captured
    state) must not read the length back, which a capture cannot wait for: graphs of one step and
    of two steps capture, and replays of each append in turn, as eager steps on a twin do."""
    eager, captured, feed, step = _twins("dense", 16, None, 5)
    feed(0)
    for c in (eager, captured):
        step(c)
    torch.cuda.synchronize()
    one, two = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(one):
        out_one = step(captured)
    with torch.cuda.graph(two):
        out_two = [step(captured), step(captured)]
    torch.cuda.synchronize()
    t = 1
    for _ in range(3):
        feed(t)
        one.replay()
        want = step(eager)
        torch.cuda.synchronize()
        assert torch.equal(out_one, want)
        two.replay()
        want = [step(eager), step(eager)]
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out_two, want))
        t += 1
    assert len(captured) == len(eager) == 10


def test_a_captured_attend_keeps_the_cache_memory():
    """A graph that captured only an attend replays after the cache object is gone: the cache's
    memory is kept, and the replay gives the attend it captured."""
    from pyfa import kvcache
    dtype = torch.bfloat16
    c = _cache("dense", 64, None)
    rows, q = _filled((20, HKV, D), dtype, 7), _filled((H, D), dtype, 8)
    c.append(rows, rows)
    want = c.attend(q)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = c.attend(q)
    assert any(kept[0] is c._state for kept in kvcache._GRAPH_KEPT)
    del c
    import gc
    gc.collect()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
