"""Every bad argument of the public API is an InvalidArgumentError that names
it (pyfa/_args.py), whatever its Python type; options are checked whether or
not a cache holds rows."""
import numpy as np
import pytest

import pyfa
from pyfa import _args


def _decode_arrays(B=None, H=4, Hkv=2, D=64, cap=16):
    lead = () if B is None else (B,)
    q = np.ones(lead + (H, D), np.float32)
    k = np.ones(lead + (Hkv, cap, D), np.float16)
    return q, k, k


def _prefill_arrays(D=64):
    q = np.ones((1, 2, 5, D), np.float32)
    return q, q, q


class _NoTypestr:
    __cuda_array_interface__ = {"shape": (4, 64), "data": (0, False), "version": 3}


class _RaisingCai:
    @property
    def __cuda_array_interface__(self):
        raise RuntimeError("no")


class _BadFloat:
    def __float__(self):
        raise RuntimeError("no")


CASES = [
    # (argument named in the message, call)
    ("scale", lambda d: pyfa.decode_attention(*_decode_arrays(), 4, scale=[1.0], device=d)),
    ("scale", lambda d: pyfa.decode_attention(*_decode_arrays(), 4, scale="a", device=d)),
    ("scale", lambda d: pyfa.decode_attention(*_decode_arrays(), 4, scale=10**400, device=d)),
    ("scale", lambda d: pyfa.decode_attention(*_decode_arrays(), 4, scale=_BadFloat(), device=d)),
    ("scale", lambda d: pyfa.attention(*_prefill_arrays(), scale=1j, device=d)),
    ("softcap", lambda d: pyfa.decode_attention(*_decode_arrays(), 4, softcap=None, device=d)),
    ("causal", lambda d: pyfa.attention(*_prefill_arrays(), causal=np.array([1, 0]), device=d)),
    ("causal", lambda d: pyfa.attention(*_prefill_arrays(), causal="yes", device=d)),
    ("return_lse", lambda d: pyfa.attention(*_prefill_arrays(), return_lse=2, device=d)),
    ("layout", lambda d: pyfa.attention(*_prefill_arrays(), layout=["bhsd"], device=d)),
    ("window", lambda d: pyfa.attention(*_prefill_arrays(), window=2.0, device=d)),
    ("q_offset", lambda d: pyfa.attention(*_prefill_arrays(), q_offset=2**40, device=d)),
    ("batch", lambda d: pyfa.decode_attention(*_decode_arrays(B=0), 4, device=d)),
    ("head_dim", lambda d: pyfa.decode_attention(*_decode_arrays(D=0), 1, device=d)),
    ("head_dim", lambda d: pyfa.attention(*_prefill_arrays(D=0), device=d)),
    ("kv_len", lambda d: pyfa.decode_attention(*_decode_arrays(), [1, [2]], device=d)),
    ("kv_len", lambda d: pyfa.decode_attention(*_decode_arrays(), 2**64 - 1, device=d)),
    ("out", lambda d: pyfa.decode_attention(*_decode_arrays(), 4, out=[0.0], device=d)),
    ("device", lambda d: pyfa.decode_attention(*_decode_arrays(), 4, device=3)),
    ("q", lambda d: pyfa.decode_attention(_NoTypestr(), *_decode_arrays()[1:], 4, device=d)),
    ("q", lambda d: pyfa.decode_attention(_RaisingCai(), *_decode_arrays()[1:], 4, device=d)),
    ("stream", lambda d: pyfa.turboquant.fwht(np.ones((2, 64), np.float32), "sign_premult", stream=-1, device=d)),
    ("stream", lambda d: pyfa.turboquant.quantize(np.ones((2, 64), np.float32), 4, stream=2, device=d)),
    ("transform", lambda d: pyfa.turboquant.fwht(np.ones((2, 64), np.float32), ["fwht"], device=d)),
    ("seed", lambda d: pyfa.turboquant.fwht(np.ones((2, 64), np.float32), seed=-1, device=d)),
    ("norm_correction", lambda d: pyfa.TurboQuantKVCache(1, 64, 4, norm_correction=[1], device=d)),
    ("k_bits", lambda d: pyfa.TurboQuantKVCache(1, 64, 4, k_bits=4.0, device=d)),
    ("bits", lambda d: pyfa.turboquant.codebook("4")),
    ("head_dim", lambda d: pyfa.KVCache(1, 0, 4, device=d)),
    ("capacity", lambda d: pyfa.KVCache(1, 64, 2**40, device=d)),
    ("dtype", lambda d: pyfa.KVCache(1, 64, 4, dtype="not a dtype", device=d)),
    ("sliding_window", lambda d: pyfa.KVCache(1, 64, 4, sliding_window=1.5, device=d)),
    ("backend", lambda d: pyfa.Device("\udcff")),
    ("backend", lambda d: pyfa.Device("cpu\0")),
    ("backend", lambda d: pyfa.Device(None)),
    ("storage", lambda d: d.buffer((2,), np.float32, storage=["shared"])),
    ("shape[0]", lambda d: d.buffer((2.5,), np.float32)),
    ("what", lambda d: pyfa.supported(b"head_dims")),
    ("array", lambda d: d.buffer((2,), np.float32).write("ab")),
]


@pytest.mark.parametrize("name,call", CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_bad_argument_is_invalid_argument_error(dev, name, call):
    with pytest.raises(pyfa.InvalidArgumentError) as e:
        call(dev)
    assert str(e.value).startswith(name), str(e.value)


def test_device_by_name(dev):
    q, k, v = _decode_arrays()
    by_name = pyfa.decode_attention(q, k, v, 4, device=dev.backend)
    np.testing.assert_array_equal(by_name, pyfa.decode_attention(q, k, v, 4, device=dev))
    assert _args.device_arg(dev.backend) is _args.device_arg(dev.backend)
    with pytest.raises(pyfa.InvalidArgumentError, match="backend: unknown backend 'tpu'"):
        pyfa.decode_attention(q, k, v, 4, device="tpu")


def test_field_out_of_c_range_names_the_field(dev):
    # A zero-size array can have dims no C field holds.
    q = np.zeros((2**33, 4, 0), np.float32)
    k = np.zeros((2**33, 2, 16, 0), np.float16)
    with pytest.raises(pyfa.InvalidArgumentError, match="batch: out of the range"):
        pyfa.decode_attention(q, k, k, 1, device=dev)


_OPTIONS = [("scale", float("nan"), "scale: must be finite"),
            ("softcap", -1.0, "softcap: must be finite and >= 0"),
            ("nwg", 0, "nwg: must be None or a positive int"),
            ("nwg", 5000, "nwg: 5000 exceeds 1024")]


@pytest.mark.parametrize("cache,option,value,match",
                         [("dense",) + o for o in _OPTIONS if o[0] != "nwg"] + [("tq",) + o for o in _OPTIONS])
def test_empty_cache_checks_options(dev, cache, option, value, match):
    c = pyfa.KVCache(2, 64, 8, device=dev) if cache == "dense" else pyfa.TurboQuantKVCache(2, 64, 8, device=dev)
    q = np.ones((4, 64), np.float32)
    for rows in (0, 3):
        if rows:
            c.append(np.ones((rows, 2, 64)), np.ones((rows, 2, 64)))
        with pytest.raises(pyfa.InvalidArgumentError, match=match):
            c.attend(q, **{option: value})
    assert (c.attend(q) != 0).any()
