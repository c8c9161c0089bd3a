"""Inputs at the edges of the f32 range give the values their contracts say,
never a silent inf, NaN, zero row or aliasing artefact: TurboQuant's scaled
sum of squares (turboquant_params.h), merge with lse = +inf
(flash_attn_prefill_params.h), and outputs that alias an input."""
import numpy as np
import pytest

import pyfa
from pyfa import reference
from pyfa import turboquant as tq
from pyfa._io import to_device
from pyfa._native import ffi, lib
from pyfa.errors import check


def on_device(dev, a):
    """A buffer holding `a`: the array itself on host-visible devices, a copy
    on a GPU (the way the Python API passes host arrays)."""
    return to_device(dev, np.ascontiguousarray(a))


@pytest.mark.parametrize("nc", ["none", "norm_preserving", "unbiased"])
@pytest.mark.parametrize("exponent", [63, 100, -83, -120, -140])
def test_turboquant_rows_far_from_one_keep_codes_and_scale(device, rng, nc, exponent):
    """Rows scaled by 2^e encode to the codes of the unscaled row and its scale
    times 2^e, exactly: about 1e19 and 1e30 no longer overflow the sum of
    squares, about 1e-25 no longer quantise to zeros, and subnormal rows
    (2^-140) keep their direction."""
    x = rng.standard_normal((6, 128)).astype(np.float32)
    f = np.float32(2.0 ** exponent)
    if exponent < -126:  # subnormal rows: only the largest coordinates survive the scaling; keep them exact
        x = np.round(x * 4) / 4
    codes, scales = tq.quantize(x, 4, norm_correction=nc, device=device)
    codes_f, scales_f = tq.quantize(x * f, 4, norm_correction=nc, device=device)
    assert np.isfinite(scales_f).all() and (scales_f > 0).all()
    np.testing.assert_array_equal(codes_f, codes)
    np.testing.assert_array_equal(scales_f, (scales.astype(np.float64) * 2.0 ** exponent).astype(np.float32))


@pytest.mark.parametrize("magnitude", [1e19, 1e-25])
def test_turboquant_extreme_rows_round_trip(device, rng, magnitude):
    x = rng.standard_normal((4, 2, 64)) * magnitude
    cache = pyfa.TurboQuantKVCache(2, 64, 4, k_bits=8, v_bits=8, device=device)
    cache.append(x, x)
    k, _ = cache.dequantize()
    assert np.isfinite(k).all()
    assert np.linalg.norm(k - x) / np.linalg.norm(x) < 0.02


def _merge(dev, lse_a, lse_b, o_a, o_b):
    L, D = o_a.shape
    p = ffi.new("pyfa_merge_attn_params *", dict(batch=1, num_heads=1, seq_len=L, head_dim=D,
                                                 o_strides=[L * D, L * D, D]))
    bufs = [on_device(dev, np.ascontiguousarray(a, np.float32)) for a in (o_a, lse_a, o_b, lse_b)]
    out, lse = dev.buffer((L, D), np.float32), dev.buffer((L,), np.float32)
    enc = dev.encoder()
    check(lib.pyfa_merge_attention_states(enc, p, *(b.handle for b in bufs), out.handle, lse.handle))
    check(lib.pyfa_encoder_commit(enc))
    check(lib.pyfa_encoder_wait(enc))
    return out.read(), lse.read()


def test_merge_with_infinite_lse(device, rng):
    """+inf dominates: the +inf side's o (both: their mean), lse +inf."""
    inf = np.float32(np.inf)
    o_a, o_b = rng.standard_normal((2, 5, 64)).astype(np.float32)
    lse_a = np.array([inf, 1.0, inf, -inf, 3.0], np.float32)
    lse_b = np.array([2.0, inf, inf, inf, -inf], np.float32)
    out, lse = _merge(device, lse_a, lse_b, o_a, o_b)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(out[0], o_a[0])
    np.testing.assert_array_equal(out[1], o_b[1])
    np.testing.assert_allclose(out[2], (o_a[2] + o_b[2]) / 2, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out[3], o_b[3])
    np.testing.assert_array_equal(out[4], o_a[4])
    np.testing.assert_array_equal(lse, [inf, inf, inf, inf, 3.0])


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_attention_out_aliasing_an_input(device, rng, which):
    q, k, v = (rng.standard_normal((1, 2, 16, 64)).astype(np.float32) for _ in range(3))
    arrays = dict(q=q, k=k, v=v)
    before = arrays[which].copy()
    if not device.host_visible:
        # Host arrays reach a GPU as copies, so `out` cannot alias what the
        # kernel reads: the call is valid and lands its result in `out`.
        ref = reference.attention(q, k, v)
        pyfa.attention(q, k, v, out=arrays[which], device=device)
        np.testing.assert_allclose(arrays[which], ref, atol=1e-4, rtol=0)
        return
    with pytest.raises(pyfa.InvalidArgumentError, match=f"out: overlaps {which} in memory"):
        pyfa.attention(q, k, v, out=arrays[which], device=device)
    np.testing.assert_array_equal(arrays[which], before)


def test_decode_out_aliasing_q(dev):
    q = np.zeros((1, 4, 64), np.float32)
    k = np.zeros((1, 2, 32, 64), np.float32)
    bufs = dict(q=on_device(dev, q), k=on_device(dev, k), v=on_device(dev, k.copy()), kv_len=on_device(dev, np.array([8], np.int32)),
                ring=on_device(dev, np.zeros(1, np.int32)))
    p = ffi.new("pyfa_flash_attn_vec_params *", dict(batch=1, num_heads=4, num_kv_heads=2, head_dim=64,
                                                     kv_capacity=32, nwg=1, scale=0.125))
    status = lib.pyfa_flash_attn_vec(dev.encoder(), p, *(b.handle for b in bufs.values()), bufs["q"].handle,
                                     bufs["q"].handle, ffi.NULL)
    assert status == lib.PYFA_ERR_INVALID_ARGUMENT
    assert "out: overlaps q in memory" in ffi.string(lib.pyfa_last_error()).decode()
