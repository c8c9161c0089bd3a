"""On the cuda backend an op's rows (caches, queries, outputs) must start on
16-byte boundaries, whatever their dtype: the kernels copy them in 16-byte
pieces (cp.async, vector loads, TMA), and a misaligned copy faults, which would
poison the CUDA context for the whole process. A contiguous view that starts
at an element offset is refused with the argument's name, nothing is written,
and the device keeps working. Values read one at a time (lengths, masks) need
only their own alignment.

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


def test_f32_rows_need_16_bytes_too():
    q = _shifted(_randn((B, H, D), 10, torch.float32))  # 4 bytes off
    k, v = _randn((B, HKV, CAP, D), 11), _randn((B, HKV, CAP, D), 12)
    with pytest.raises(pyfa.PyfaError, match=r"^q: .*is not 16-byte aligned"):
        pyfa.decode_attention(q, k.float(), v.float(), LEN, device=DEVICE)
    torch.cuda.synchronize()


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.bfloat16], ids=["bool", "bf16"])  # bool, or q's dtype
def test_masks_need_only_their_own_alignment(mask_dtype):
    L = 96
    q, k, v = _randn((1, H, L, D), 13), _randn((1, HKV, L, D), 14), _randn((1, HKV, L, D), 15)
    allowed = torch.rand((L, L), generator=torch.Generator(device="cuda").manual_seed(16), device="cuda") > 0.3
    mask = allowed if mask_dtype == torch.bool else torch.zeros((L, L), device="cuda").masked_fill(
        ~allowed, float("-inf")).to(mask_dtype)
    aligned = pyfa.attention(q, k, v, mask=mask, device=DEVICE)
    shifted = pyfa.attention(q, k, v, mask=_shifted(mask), device=DEVICE)  # 1 or 2 bytes off
    torch.cuda.synchronize()
    assert torch.equal(aligned, shifted)


@pytest.mark.parametrize("arg", ["q", "k", "out"])
def test_misaligned_varlen_rows_are_refused(arg):
    lens = [40, 56]
    total = sum(lens)
    cu = torch.tensor([0, lens[0], total], dtype=torch.int32, device="cuda")
    args = {"q": _randn((total, H, D), 17), "k": _randn((total, HKV, D), 18),
            "out": torch.zeros((total, H, D), device="cuda", dtype=torch.bfloat16)}
    v = _randn((total, HKV, D), 19)
    args[arg] = _shifted(args[arg])
    with pytest.raises(pyfa.PyfaError, match=rf"^{arg}: .*is not 16-byte aligned"):
        pyfa.varlen_attention(args["q"], args["k"], v, cu, cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                              causal=True, out=args["out"], device=DEVICE)
    torch.cuda.synchronize()


@pytest.mark.parametrize("arg", ["o_a", "o_b", "out"])
def test_misaligned_rows_of_a_buffer_op_are_refused(arg):
    """Ops that take buffers (not plans) check their rows where they take them, so a
    view off a 16-byte boundary is refused whoever wrapped it (here merge_attention_states)."""
    shape = (1, H, 4, D)
    args = {"o_a": _randn(shape, 21), "o_b": _randn(shape, 22), "out": torch.zeros(shape, device="cuda",
                                                                                   dtype=torch.bfloat16)}
    lse_a, lse_b = _randn(shape[:3], 23, torch.float32), _randn(shape[:3], 24, torch.float32)
    args[arg] = _shifted(args[arg])
    before = args["out"].clone()
    with pytest.raises(pyfa.PyfaError, match=rf"^{arg}: .*is not 16-byte aligned"):
        pyfa.merge_attention_states(args["o_a"], lse_a, args["o_b"], lse_b, out=args["out"], device=DEVICE)
    torch.cuda.synchronize()
    assert torch.equal(args["out"], before), "nothing is written"


def test_low_level_wrap_then_op_checks_the_rows():
    """Device.wrap_device gives a misaligned view only its element alignment (the call does
    not say it holds rows); the op that takes it as rows (the C ABI's pyfa_flash_attn_vec, as
    a Swift or C caller reaches it) refuses it, naming the argument, before anything runs."""
    from pyfa import _args, _io
    from pyfa._native import lib
    from pyfa.errors import check

    dev = pyfa.Device("cuda")
    q = _shifted(_randn((1, H, D), 31))
    k, v = _randn((1, HKV, CAP, D), 32), _randn((1, HKV, CAP, D), 33)
    out = torch.full((1, H, D), 7.0, device="cuda", dtype=torch.bfloat16)
    lens, rings = (torch.full((1,), n, device="cuda", dtype=torch.int32) for n in (LEN, 0))
    wrap = lambda t, dt: dev.wrap_device(t.data_ptr(), t.numel() * t.element_size(), dt, tuple(t.shape),  # noqa: E731
                                         keepalive=t)
    bufs = [wrap(t, pyfa.bfloat16) for t in (q, k, v)] + [wrap(t, np.int32) for t in (lens, rings)]
    params = _args.params("pyfa_flash_attn_vec_params *", {
        "batch": 1, "num_heads": H, "num_kv_heads": HKV, "head_dim": D, "kv_capacity": CAP, "nwg": 1,
        "window": 0, "scale": D ** -0.5, "softcap": 0.0})
    enc = dev.encoder()
    with pytest.raises(pyfa.PyfaError, match=r"^q: .*is not 16-byte aligned"):
        check(lib.pyfa_flash_attn_vec(enc, params, *(b.handle for b in bufs), _io.handle(None),
                                      wrap(out, pyfa.bfloat16).handle, _io.handle(None)))
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 7.0)), "nothing is written"
