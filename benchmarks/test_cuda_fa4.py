"""GPU gates against FlashAttention-4 (flash_attn.cute, `pip install flash-attn-4`;
Hopper / Blackwell) timed in the same run: causal bf16 prefill and f16 decode
over a long cache. Prefill shares the tensors (pyfa reads FA4's [B, S, H, D]
layout in place with layout="bshd"); decode gives each its own cache layout
(pyfa's K/V are [B, H_kv, L, D]). Times are CUDA events around back-to-back calls
(cuda_timing.event_ms). Without FA4, or on a GPU it does not support,
every case skips with the reason.

Bounds: regression guards at about 80% of the ratios measured on an H100
(docs/cuda/gates_h100.txt, FA4 4.0.0b36): prefill 0.376 (4K) and 0.285 (16K)
of FA4's TFLOP/s, decode 1.285x FA4's time. They catch a regression of pyfa's
kernels, not the gap to FA4 (the Hopper prefill kernel's work).

    python3 -m pytest -rs benchmarks/test_cuda_fa4.py --benchmark-enable
"""
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
try:
    from flash_attn.cute import flash_attn_func
except ImportError as e:
    pytest.skip(f"FlashAttention-4 is not installed (pip install flash-attn-4): {e}", allow_module_level=True)
except Exception as e:  # noqa: BLE001 - installed but broken (its CUDA / CuTe DSL libraries): say so and skip
    pytest.skip(f"FlashAttention-4 does not import: {type(e).__name__}: {e}", allow_module_level=True)
if torch.cuda.get_device_capability() < (9, 0):
    pytest.skip(f"FlashAttention-4 needs Hopper or newer; this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability()))}",
                allow_module_level=True)

import pyfa  # noqa: E402
from gate_record import record_gate  # noqa: E402
from cuda_timing import event_ms  # noqa: E402

try:
    DEVICE = pyfa.Device("cuda")
except pyfa.PyfaError as e:
    pytest.skip(f"pyfa cuda backend unavailable: {e}", allow_module_level=True)

H, HKV = 16, 8
# (D, L, bound): pyfa TFLOP/s >= bound x FA4 TFLOP/s.
PREFILL_CASES = [(128, 4096, 0.3), (128, 16384, 0.23)]
# (B, D, L, bound): pyfa time <= bound x FA4 time.
DECODE_CASES = [(8, 128, 65536, 1.6)]


def fa4(q, k, v, causal):
    """FA4's output (its flash_attn_func returns (out, lse) in some releases, out in others);
    skips the case with FA4's own message when it has no kernel for it."""
    try:
        res = flash_attn_func(q, k, v, causal=causal)
    except Exception as e:  # noqa: BLE001 - any refusal of FA4's is a reason to skip, reported as such
        pytest.skip(f"FlashAttention-4 refused this case: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return res[0] if isinstance(res, tuple) else res


@pytest.mark.parametrize("D,L,bound", PREFILL_CASES, ids=lambda v: str(v))
def test_prefill_vs_fa4(request, benchmark, D, L, bound):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn((1, L, H, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn((1, L, HKV, D), generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn((1, L, HKV, D), generator=g, device="cuda", dtype=torch.bfloat16)
    ref = fa4(q, k, v, True)
    run = lambda: pyfa.attention(q, k, v, causal=True, layout="bshd", device=DEVICE)  # noqa: E731
    assert (run().float() - ref.float()).abs().max().item() < 2e-2
    flops = 4 * H * L * L * D / 2
    pyfa_tflops = flops / event_ms(run) / 1e9
    fa4_tflops = flops / event_ms(lambda: fa4(q, k, v, True)) / 1e9
    ratio = pyfa_tflops / fa4_tflops
    benchmark.extra_info.update(D=D, L=L, H=H, Hkv=HKV, pyfa_TFLOPs=round(pyfa_tflops, 1),
                                fa4_TFLOPs=round(fa4_tflops, 1), ratio=round(ratio, 3), bound=bound,
                                gpu=torch.cuda.get_device_name())
    benchmark.pedantic(lambda: (run(), torch.cuda.synchronize()), rounds=3, warmup_rounds=1)
    assert record_gate(request, f"cuda prefill causal H{H}x{HKV} D{D} L{L} bf16 vs FA4", ratio, ">=", bound,
                       f"pyfa {pyfa_tflops:.0f} / FA4 {fa4_tflops:.0f} TFLOP/s"), benchmark.extra_info


@pytest.mark.parametrize("B,D,L,bound", DECODE_CASES, ids=lambda v: str(v))
def test_decode_vs_fa4(request, benchmark, B, D, L, bound):
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn((B, 1, H, D), generator=g, device="cuda", dtype=torch.float16)
    k = torch.randn((B, L, HKV, D), generator=g, device="cuda", dtype=torch.float16)
    v = torch.randn((B, L, HKV, D), generator=g, device="cuda", dtype=torch.float16)
    ref = fa4(q, k, v, False)
    # Each reads its own cache layout: pyfa's is q [B, H, D], K/V [B, H_kv, L, D].
    qp, kp, vp = q[:, 0].contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    run = lambda: pyfa.decode_attention(qp, kp, vp, L, device=DEVICE)  # noqa: E731
    assert (run().float() - ref[:, 0].float()).abs().max().item() < 2e-2
    pyfa_ms = event_ms(run)
    fa4_ms = event_ms(lambda: fa4(q, k, v, False))
    ratio = pyfa_ms / fa4_ms
    benchmark.extra_info.update(B=B, D=D, L=L, H=H, Hkv=HKV, pyfa_us=round(pyfa_ms * 1e3, 1),
                                fa4_us=round(fa4_ms * 1e3, 1), ratio=round(ratio, 3), bound=bound,
                                gpu=torch.cuda.get_device_name())
    benchmark.pedantic(lambda: (run(), torch.cuda.synchronize()), rounds=3, warmup_rounds=1)
    assert record_gate(request, f"cuda decode B{B} H{H}x{HKV} D{D} L{L} f16 vs FA4", ratio, "<=", bound,
                       f"pyfa {pyfa_ms * 1e3:.1f} us / FA4 {fa4_ms * 1e3:.1f} us"), benchmark.extra_info
