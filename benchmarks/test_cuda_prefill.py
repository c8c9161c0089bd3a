"""pytest-benchmark cases: CUDA prefill (causal bf16, B=1, H=16, H_kv=8)
beside torch SDPA (flash and cuDNN) in the same run. pyfa takes the torch
tensors in place; times come from CUDA events over back-to-back calls after a
warm-up. TFLOP/s = 4·B·H·L²·D/2 / time (causal). Gates are ratios against
torch flash measured in the same run (set below the H200 figures of
docs/cuda/prefill_h200.md, as regression guards); D = 512 has no torch kernel
and reports only.

    python3 -m pytest benchmarks/test_cuda_prefill.py --benchmark-enable --benchmark-json=out.json
"""
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import pyfa  # noqa: E402
from cuda_timing import event_ms  # noqa: E402
from gate_record import record_gate  # noqa: E402

try:
    DEVICE = pyfa.Device("cuda")
except pyfa.PyfaError as e:
    pytest.skip(f"pyfa cuda backend unavailable: {e}", allow_module_level=True)

# (D, L, gate: pyfa TFLOP/s >= gate x torch flash TFLOP/s). Set about 20% under the ratios measured
# through this API on an H200 (0.50, 0.58, 0.63: each call includes ~0.2 ms of host work, which
# weighs most at L = 4096), so they catch regressions rather than noise.
CASES = [(128, 4096, 0.4), (128, 16384, 0.45), (256, 16384, 0.5), (512, 16384, None)]


@pytest.mark.parametrize("D,L,gate", CASES, ids=lambda v: str(v))
def test_prefill_vs_torch(request, benchmark, D, L, gate):
    H, Hkv = 16, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn((1, H, L, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn((1, Hkv, L, D), generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn((1, Hkv, L, D), generator=g, device="cuda", dtype=torch.bfloat16)
    flops = 4 * H * L * L * D / 2
    run = lambda: pyfa.attention(q, k, v, causal=True, device=DEVICE)
    row = {"D": D, "L": L, "H": H, "Hkv": Hkv, "gpu": torch.cuda.get_device_name()}
    row["pyfa_TFLOPs"] = flops / event_ms(run) / 1e9
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                ms = event_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
            row[f"{name}_TFLOPs"] = flops / ms / 1e9
        except RuntimeError:
            row[f"{name}_TFLOPs"] = None  # no kernel for this shape
    benchmark.extra_info.update({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()})
    benchmark.pedantic(lambda: (run(), torch.cuda.synchronize()), rounds=3, warmup_rounds=1)
    if gate is not None and row["flash_TFLOPs"]:
        ratio = row["pyfa_TFLOPs"] / row["flash_TFLOPs"]
        assert record_gate(request, f"cuda prefill causal H{H}x{Hkv} D{D} L{L} bf16 vs torch flash", ratio, ">=",
                           gate, f"pyfa {row['pyfa_TFLOPs']:.0f} / flash {row['flash_TFLOPs']:.0f} TFLOP/s"), row
