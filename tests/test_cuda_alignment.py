"""Device arrays of 16-bit (and byte) elements on the cuda backend must start on
16-byte boundaries; 4-byte elements (int32 per-sequence values, f32 masks) on
their own size: the kernels copy caches, queries and outputs in 16-byte pieces
(cp.async, vector loads, TMA), and a misaligned copy faults, which would poison
the CUDA context for the whole process. A contiguous view that starts at an
element offset is refused with the argument's name, nothing is written, and
the device keeps working.

Skips without torch or without a CUDA device.
"""
import numpy as np
import pytest

import pyfa
from pyfa import reference

from cuda_torch import torch_and_cuda_device

torch, DEVICE = torch_and_cuda_device()

B, H, HKV, D, CAP, LEN = 2, 8, 2, 128, 64, 50


def _randn(shape, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def _shifted(t, elements=1):
    """A contiguous copy of t that starts `elements` elements past a fresh allocation."""
    base = torch.zeros(t.numel() + elements, device="cuda", dtype=t.dtype)
    view = base[elements:].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    return view


def _host(t):
    return t.float().cpu().numpy()


@pytest.mark.parametrize("arg", ["q", "k", "v", "out"])
def test_misaligned_device_array_is_refused_and_the_device_keeps_working(arg):
    q, k, v = _randn((B, H, D), 1), _randn((B, HKV, CAP, D), 2), _randn((B, HKV, CAP, D), 3)
    out = torch.full((B, H, D), 7.0, device="cuda", dtype=torch.bfloat16)
    args = {"q": q, "k": k, "v": v, "out": out}
    args[arg] = _shifted(args[arg])
    before = args["out"].clone()
    name = {"k": "k_cache", "v": "v_cache"}.get(arg, arg)  # decode_attention's parameter names
    with pytest.raises(pyfa.PyfaError, match=rf"^{name}: .*is not 16-byte aligned"):
        pyfa.decode_attention(args["q"], args["k"], args["v"], LEN, out=args["out"], device=DEVICE)
    torch.cuda.synchronize()  # no fault was queued
    assert torch.equal(args["out"], before), "nothing is written"
    # The context is intact: the same call on aligned arrays runs and is right.
    got = pyfa.decode_attention(q, k, v, LEN, out=out, device=DEVICE)
    torch.cuda.synchronize()
    ref = reference.decode_attention(_host(q), _host(k), _host(v), LEN)
    assert np.abs(_host(got) - ref).max() < 1e-2  # bf16 output rounding (2^-9 relative) of values of order 1


def test_int32_lengths_need_only_their_own_alignment():
    q, k, v = _randn((B, H, D), 4), _randn((B, HKV, CAP, D), 5), _randn((B, HKV, CAP, D), 6)
    lens = torch.tensor([0, LEN, 17], dtype=torch.int32, device="cuda")[1:]  # 4 bytes past the allocation
    assert lens.data_ptr() % 16 == 4
    got = pyfa.decode_attention(q, k, v, lens, device=DEVICE)
    torch.cuda.synchronize()
    ref = reference.decode_attention(_host(q), _host(k), _host(v), np.array([LEN, 17]))
    assert np.abs(_host(got) - ref).max() < 1e-2


def test_misaligned_prefill_input_is_refused():
    L = 96
    q = _shifted(_randn((1, H, L, D), 7))
    k, v = _randn((1, HKV, L, D), 8), _randn((1, HKV, L, D), 9)
    with pytest.raises(pyfa.PyfaError, match=r"^q: .*is not 16-byte aligned"):
        pyfa.attention(q, k, v, causal=True, device=DEVICE)
    torch.cuda.synchronize()
