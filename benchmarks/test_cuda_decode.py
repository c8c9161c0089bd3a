"""pytest-benchmark cases: CUDA decode beside torch SDPA (flash) in the same
run. Times come from CUDA events (benchmarks/cuda_decode_bench.py); the
benchmark fixture times the same launches with a host sync for its own table.
Gates are ratios against the peer measured in the same run; cases without a
torch kernel (D = 512) gate against the device-to-device copy bandwidth.

    python3 -m pytest benchmarks/test_cuda_decode.py --benchmark-json=out.json
"""
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import pyfa  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import cuda_decode_bench as bench  # noqa: E402
from gate_record import record_gate  # noqa: E402

try:
    DEVICE = pyfa.Device("cuda")
except pyfa.PyfaError as e:  # torch sees a GPU but pyfa cannot open it: say why
    pytest.skip(f"pyfa cuda backend unavailable: {e}", allow_module_level=True)

# (Hq, Hkv, D, kv_len, B, gate): pyfa time <= gate x torch flash time, or for
# D = 512 GB/s >= gate x copy bandwidth. The gates guard against regressions
# of the kernel as measured on an H200 (docs/cuda/decode_h200.md), with margin.
CASES = [
    (16, 8, 256, 16384, 1, 1.15),
    (16, 8, 256, 65536, 8, 1.15),
    (16, 2, 512, 65536, 8, 0.25),
]


@pytest.fixture(scope="module")
def copy_gbps():
    return bench.copy_bandwidth()


@pytest.mark.parametrize("Hq,Hkv,D,L,B,gate", CASES, ids=lambda v: str(v))
def test_decode_vs_torch(request, benchmark, copy_gbps, Hq, Hkv, D, L, B, gate):
    row = bench.run_case(DEVICE, Hq, Hkv, D, L, B, iters=20, reps=7)
    benchmark.extra_info.update({k: v for k, v in row.items() if not k.endswith("_error")})
    benchmark.extra_info["copy_GBps"] = copy_gbps
    benchmark.extra_info["gpu"] = torch.cuda.get_device_name()
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn((B, Hq, D), generator=g, device="cuda", dtype=torch.float16)
    k = torch.randn((B, Hkv, L, D), generator=g, device="cuda", dtype=torch.float16)
    v = torch.randn((B, Hkv, L, D), generator=g, device="cuda", dtype=torch.float16)
    run = bench.PyfaDecode(DEVICE, q, k, v, L)

    def launch():
        run.record(10)
        run.commit()
        torch.cuda.synchronize()

    benchmark.pedantic(launch, rounds=5, warmup_rounds=1)
    case = f"cuda decode B{B} H{Hq}x{Hkv} D{D} L{L} f16"
    if row.get("flash_us") is not None:
        ratio = row["pyfa_kernel_us"] / row["flash_us"]
        ok = record_gate(request, case, ratio, "<=", gate, f"pyfa {row['pyfa_kernel_us']:.1f} us / torch flash "
                         f"{row['flash_us']:.1f} us")
    else:
        ratio = row["pyfa_kernel_GBps"] / copy_gbps
        ok = record_gate(request, case, ratio, ">=", gate, f"pyfa {row['pyfa_kernel_GBps']:.0f} GB/s / copy "
                         f"{copy_gbps:.0f} GB/s")
    assert ok, row
