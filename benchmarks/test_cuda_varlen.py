"""pytest-benchmark cases (report only, no gates yet): CUDA packed prefill.

varlen: 32 prompts of mixed lengths (256..4096, seeded), bf16, H/H_kv 32/8,
D 128, causal, in one pyfa.varlen_attention call, beside (a) the same prompts
as 32 rectangular pyfa.attention calls (bshd views of the packed tensors, in
place) and (b) one rectangular call of batch 32 at the mean length.
paged: chunked prefill of 512 new rows per sequence against 4K / 16K cached
positions (8 sequences, page_size 16 and 64, NHD, pages shuffled), beside the
contiguous rectangular call on the same keys (q_offset bottom-right).
Times: CUDA events over back-to-back public calls after a warm-up; TFLOP/s
counts 4·H·D per visible (query, key) pair.

    python3 -m pytest benchmarks/test_cuda_varlen.py --benchmark-enable -s
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import pyfa  # noqa: E402
from cuda_timing import event_ms  # noqa: E402

try:
    DEVICE = pyfa.Device("cuda")
except pyfa.PyfaError as e:
    pytest.skip(f"pyfa cuda backend unavailable: {e}", allow_module_level=True)

H, HKV, D = 32, 8, 128


def causal_pairs(q_len, kv_len):
    """Visible (query, key) pairs of a bottom-right causal block."""
    first = kv_len - q_len + 1
    return q_len * first + q_len * (q_len - 1) // 2


def report(benchmark, row, run):
    benchmark.extra_info.update({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()})
    print("\n" + "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    benchmark.pedantic(lambda: (run(), torch.cuda.synchronize()), rounds=3, warmup_rounds=1)


def test_varlen_vs_rectangular(benchmark):
    lens = np.random.default_rng(0).integers(256, 4097, 32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    g = torch.Generator(device="cuda").manual_seed(0)
    total = int(cu[-1])
    q = torch.randn((total, H, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn((total, HKV, D), generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn((total, HKV, D), generator=g, device="cuda", dtype=torch.bfloat16)
    cu_t = torch.from_numpy(cu).cuda()
    flops = 4 * H * D * sum(causal_pairs(int(n), int(n)) for n in lens)
    longest = int(lens.max())
    run = lambda: pyfa.varlen_attention(q, k, v, cu_t, cu_t, max_seqlen_q=longest, max_seqlen_k=longest,
                                        causal=True, device=DEVICE)
    run_host_meta = lambda: pyfa.varlen_attention(q, k, v, cu, cu, causal=True, device=DEVICE)
    views = [(q[a:b][None], k[a:b][None], v[a:b][None]) for a, b in zip(cu[:-1], cu[1:])]

    def per_prompt():
        for qa, ka, va in views:
            pyfa.attention(qa, ka, va, causal=True, layout="bshd", device=DEVICE)

    mean = int(lens.mean())
    qm = torch.randn((32, mean, H, D), generator=g, device="cuda", dtype=torch.bfloat16)
    km = torch.randn((32, mean, HKV, D), generator=g, device="cuda", dtype=torch.bfloat16)
    mean_flops = 4 * H * D * 32 * causal_pairs(mean, mean)
    rect_mean = lambda: pyfa.attention(qm, km, km, causal=True, layout="bshd", device=DEVICE)
    row = {"prompts": 32, "tokens": total, "gpu": torch.cuda.get_device_name(),
           "varlen_TFLOPs": flops / event_ms(run) / 1e9,
           "varlen_host_meta_TFLOPs": flops / event_ms(run_host_meta) / 1e9,
           "per_prompt_rect_TFLOPs": flops / event_ms(per_prompt, iters=2) / 1e9,
           f"rect_B32_L{mean}_TFLOPs": mean_flops / event_ms(rect_mean) / 1e9}
    # The packed call computes what the per-prompt calls do.
    out = run()
    a, b = int(cu[3]), int(cu[4])
    ref = pyfa.attention(*views[3], causal=True, layout="bshd", device=DEVICE)[0]
    assert torch.equal(out[a:b], ref)
    report(benchmark, row, run)


@pytest.mark.parametrize("cached", [4096, 16384])
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_chunk_vs_contiguous(benchmark, cached, page_size):
    B, new = 8, 512
    kv = cached + new
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn((B * new, H, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn((B, kv, HKV, D), generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn((B, kv, HKV, D), generator=g, device="cuda", dtype=torch.bfloat16)
    pps = kv // page_size
    perm = torch.randperm(B * pps, generator=torch.Generator().manual_seed(1)).cuda()
    table = perm.view(B, pps).to(torch.int32)
    k_pages = torch.empty((B * pps, page_size, HKV, D), device="cuda", dtype=torch.bfloat16)
    v_pages = torch.empty_like(k_pages)
    k_pages[table.long().view(-1)] = k.view(B * pps, page_size, HKV, D)
    v_pages[table.long().view(-1)] = v.view(B * pps, page_size, HKV, D)
    cu_q = torch.arange(0, B * new + 1, new, device="cuda", dtype=torch.int32)
    kv_len = torch.full((B,), kv, device="cuda", dtype=torch.int32)
    run = lambda: pyfa.paged_attention(q, k_pages, v_pages, table, cu_q, kv_len, max_seqlen_q=new, device=DEVICE)
    q4 = q.view(B, new, H, D)
    contiguous = lambda: pyfa.attention(q4, k, v, causal=True, layout="bshd", device=DEVICE)
    flops = 4 * H * D * B * causal_pairs(new, kv)
    row = {"B": B, "new": new, "cached": cached, "page_size": page_size, "gpu": torch.cuda.get_device_name(),
           "paged_TFLOPs": flops / event_ms(run) / 1e9, "contiguous_TFLOPs": flops / event_ms(contiguous) / 1e9}
    assert torch.equal(run().view(B, new, H, D), contiguous())
    report(benchmark, row, run)
