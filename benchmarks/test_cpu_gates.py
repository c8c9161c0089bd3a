"""CPU ratio gates for CI: pyfa's public calls against a peer timed in the
same run (numpy float32 decode and prefill; torch CPU SDPA when torch is
installed), with bounds that hold on a loaded 2-core machine.

    python3 -m pytest -q -p no:cacheprovider benchmarks/test_cpu_gates.py --benchmark-enable

Timing: pyfa and the peer alternate in blocks (BLOCKS x PER_BLOCK calls each);
each side's time is its fastest call. Alternating puts load from other
processes on both sides alike, and the minimum discards calls that load
slowed. A measurement under the bound is repeated, up to ATTEMPTS in all:
load only ever makes a call slower, so a burst that hit one side's calls
passes on a later attempt, while a real regression stays under the bound on
every attempt. A gate fails with the case, each attempt's ratio (peer time /
pyfa time) and its bound.

Bounds (MIN_RATIO) sit well under the ratios measured on a 2-core machine
shared with other jobs (the spread is beside them), so they fire on a gross
regression of pyfa's kernels or call path, not on scheduling noise. Without
--benchmark-enable (the default in pyproject) each case runs once as a smoke
test: results checked, no gate.
"""
import math
import time

import numpy as np
import pytest

import pyfa
from gate_record import record_gate
from test_decode_bench import numpy_decode
from test_prefill_bench import numpy_attention

BLOCKS, PER_BLOCK, ATTEMPTS = 3, 4, 3

# case -> bound: the ratio (peer time / pyfa time) must be at least this. Spread
# measured over 10 runs of this file on a 2-core machine at load average 5-7
# (other builds and tests running): decode-numpy 16.6-35.4x, decode-torch
# 18.4-40.2x, prefill-numpy 10.8-101x, prefill-torch 0.95-3.7x; on an idle
# 2-core machine numpy's prefill is faster and prefill-numpy sits near 5x, and
# one CI run measured 2.6x (pyfa's calls 1.5x slower there than in the next
# case of the same run). The bounds sit about 2x under the lowest: they catch
# a kernel that lost its vectorisation or a call that fell to a slow path;
# instruction counts (scripts/callgrind_gate.py) catch the small regressions.
MIN_RATIO = {"decode-numpy": 4.0, "decode-torch": 4.0, "prefill-numpy": 2.0, "prefill-torch": 0.5}
# torch's CPU kernels use AVX-512 (and AMX for bf16) where the CPU has them; pyfa's are AVX2.
# On such a CPU (torch.backends.cpu.get_cpu_capability() == "AVX512") the ratio against torch
# measures that ISA gap: a 2-core Xeon with AVX-512 and AMX measured decode-torch 2.22-2.35x
# and prefill-torch 0.37x (three attempts of one CI run, no other job); these bounds sit about
# 2x under, for the same purpose as the ones above.
AVX512_TORCH_MIN_RATIO = {"decode-torch": 1.0, "prefill-torch": 0.18}


def torch_bound(torch, case: str) -> float:
    """The bound of a torch gate on this CPU (see AVX512_TORCH_MIN_RATIO)."""
    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", lambda: "")()
    return AVX512_TORCH_MIN_RATIO[case] if capability.startswith("AVX512") else MIN_RATIO[case]


def alternating_min(pyfa_call, peer_call):
    """(fastest pyfa time, fastest peer time) over BLOCKS alternating blocks of
    PER_BLOCK calls each. Blocks, not single calls, alternate: BLAS and OpenMP
    worker threads keep spinning for a while after the peer's call and would
    take cores from the pyfa call right after it; later calls in a block run
    without them."""
    best_pyfa = best_peer = math.inf
    for _ in range(BLOCKS):
        for call, side in ((pyfa_call, 0), (peer_call, 1)):
            for _ in range(PER_BLOCK):
                t0 = time.perf_counter()
                call()
                t = time.perf_counter() - t0
                if side == 0:
                    best_pyfa = min(best_pyfa, t)
                else:
                    best_peer = min(best_peer, t)
    return best_pyfa, best_peer


def gate(request, benchmark, case, pyfa_call, peer_call, shape, bound=None):
    """Times the pair; records and enforces the ratio (at least ``bound``, by default
    MIN_RATIO's) when benchmarking is enabled."""
    benchmark.group = "cpu-gates"
    benchmark.extra_info.update(case=case, shape=shape)
    benchmark.pedantic(pyfa_call, rounds=3 if not benchmark.disabled else 1, warmup_rounds=1)
    if benchmark.disabled:
        return
    peer_call()  # warm-up outside the timed rounds
    bound, tries = MIN_RATIO[case] if bound is None else bound, []
    for _ in range(ATTEMPTS):
        t_pyfa, t_peer = alternating_min(pyfa_call, peer_call)
        ratio = t_peer / t_pyfa
        tries.append(f"{ratio:.2f}x (pyfa {t_pyfa * 1e3:.3f} ms, peer {t_peer * 1e3:.3f} ms)")
        if ratio >= bound:
            break
    benchmark.extra_info.update(pyfa_ms=round(t_pyfa * 1e3, 3), peer_ms=round(t_peer * 1e3, 3),
                                ratio=round(ratio, 3), bound=bound, attempts=len(tries))
    detail = f"[{shape}] " + "; ".join(tries) + " (peer time / pyfa time)"
    ok = record_gate(request, case, ratio, ">=", bound, detail)
    assert ok, f"gate {case}: pyfa is {ratio:.2f}x the peer on every attempt, bound >= {bound}x; {detail}"


# --------------------------------------------------------------------------- decode

DEC_H, DEC_HKV, DEC_D, DEC_L = 16, 8, 128, 4096


def decode_inputs():
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, DEC_H, DEC_D), dtype=np.float32)
    k = rng.standard_normal((1, DEC_HKV, DEC_L, DEC_D), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((1, DEC_HKV, DEC_L, DEC_D), dtype=np.float32).astype(np.float16)
    return q, k, v


DEC_SHAPE = f"decode B1 H{DEC_H}x{DEC_HKV} D{DEC_D} L{DEC_L} f16 KV"


def test_decode_vs_numpy(request, benchmark, cpu):
    q, k, v = decode_inputs()
    run = lambda: pyfa.decode_attention(q, k, v, DEC_L, device=cpu)  # noqa: E731
    peer = lambda: numpy_decode(q, k, v, DEC_L)  # noqa: E731
    np.testing.assert_allclose(run(), peer(), rtol=2e-3, atol=2e-3)
    gate(request, benchmark, "decode-numpy", run, peer, DEC_SHAPE)


def test_decode_vs_torch(request, benchmark, cpu):
    torch = pytest.importorskip("torch", reason="torch is not installed: the torch SDPA gates skip")
    import torch.nn.functional as F

    q, k, v = decode_inputs()
    tq = torch.from_numpy(q)[:, :, None].to(torch.float16)
    tk, tv = torch.from_numpy(k), torch.from_numpy(v)
    run = lambda: pyfa.decode_attention(q, k, v, DEC_L, device=cpu)  # noqa: E731
    peer = lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)  # noqa: E731
    threads = torch.get_num_threads()
    torch.set_num_threads(cpu.compute_units)  # the same cores pyfa's pool uses
    try:
        np.testing.assert_allclose(run(), peer()[:, :, 0].float().numpy(), rtol=1e-2, atol=1e-2)
        gate(request, benchmark, "decode-torch", run, peer, DEC_SHAPE, torch_bound(torch, "decode-torch"))
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- prefill

PF_H, PF_D, PF_L = 4, 128, 512
PF_SHAPE = f"prefill causal B1 H{PF_H} D{PF_D} L{PF_L} bf16"


def prefill_inputs():
    rng = np.random.default_rng(12)
    return [rng.standard_normal((1, PF_H, PF_L, PF_D), dtype=np.float32).astype(pyfa.bfloat16) for _ in range(3)]


def test_prefill_vs_numpy(request, benchmark, cpu):
    q, k, v = prefill_inputs()
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    out = np.empty_like(q)
    run = lambda: pyfa.attention(q, k, v, causal=True, device=cpu, out=out)  # noqa: E731
    peer = lambda: numpy_attention(q32, k32, v32, True, 1.0 / np.sqrt(PF_D))  # noqa: E731
    run()
    ref = peer()
    assert np.abs(out.astype(np.float32) - ref).max() <= 2.0**-8 * np.abs(ref).max() + 1e-4
    gate(request, benchmark, "prefill-numpy", run, peer, PF_SHAPE)


def test_prefill_vs_torch(request, benchmark, cpu):
    torch = pytest.importorskip("torch", reason="torch is not installed: the torch SDPA gates skip")
    import torch.nn.functional as F

    q, k, v = prefill_inputs()
    tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16) for x in (q, k, v))
    run = lambda: pyfa.attention(q, k, v, causal=True, device=cpu)  # noqa: E731
    peer = lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)  # noqa: E731
    threads = torch.get_num_threads()
    torch.set_num_threads(cpu.compute_units)
    try:
        assert np.abs(run().astype(np.float32) - peer().float().numpy()).max() < 3e-2
        gate(request, benchmark, "prefill-torch", run, peer, PF_SHAPE, torch_bound(torch, "prefill-torch"))
    finally:
        torch.set_num_threads(threads)
