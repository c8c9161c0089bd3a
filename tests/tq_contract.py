"""TurboQuant decode's accuracy contract, as the tests state it.

The decode is attention over the rows a cache dequantizes, computed in the
rotated domain (rotated q against ``c[idx] * scale / sqrt(D)``). A kernel may
multiply the codebook values rounded to f16 — CUDA's tensor-core kernel at
4-bit K and V does (one 4-byte table lookup per code byte) — and is exact
otherwise. So an output is within float32 rounding (the tests' TOL) of
attention over the rows dequantized with the f32 codebook, or of attention over
the rows dequantized with ``f16(c)`` in place of ``c`` (both K and V).

Every codebook value moves by at most ``rounding(bits)`` relative (2^-11), so
the two models differ by a few times that in scores and outputs; for rows of
unit-variance coordinates, by 2-5e-4
(tests/test_turboquant.py::test_the_f16_codebook_model_is_near_the_f32_one).
"""
import math

import numpy as np

from pyfa import reference
from pyfa import turboquant as tq
from test_decode import HALF_ULP

CODEBOOK_DTYPES = (np.float32, np.float16)


def codebook(bits: int, dtype) -> np.ndarray:
    """The float64 codebook at ``bits`` after rounding its f32 values to ``dtype``."""
    return tq.codebook(bits).astype(dtype).astype(np.float64)


def rounding(bits: int) -> float:
    """max |f16(c) - c| / |c| over the codebook at ``bits``: at most 2^-11."""
    c = tq.codebook(bits).astype(np.float64)
    return float(np.max(np.abs(codebook(bits, np.float16) - c) / np.abs(c)))


def decode_rows(codes, scales, bits: int, seed: int, stream: int, dtype) -> np.ndarray:
    """Rows ``[..., D]`` in the original domain from packed codes ``[..., D*bits/8]`` and scales
    ``[...]``, with the codebook rounded to ``dtype`` (float64 otherwise)."""
    idx = tq.unpack_codes(np.asarray(codes), bits)
    D = idx.shape[-1]
    y = codebook(bits, dtype)[idx] * (np.asarray(scales, np.float64)[..., None] / math.sqrt(D))
    return tq.unrotate(y, seed, stream)


def cache_rows(cache, dtype):
    """(k, v) ``[len, Hkv, D]`` of a TurboQuantKVCache in chronological order, as its dequantize
    gives them, with the codebook rounded to ``dtype``."""
    n, first = cache._ring()
    slots = (first + np.arange(n)) % cache.capacity
    kc, ks, vc, vs = cache.codes()
    rows = []
    for codes, scales, bits, stream in ((kc, ks, cache.k_bits, tq.STREAM_K), (vc, vs, cache.v_bits, tq.STREAM_V)):
        rows.append(decode_rows(codes[:, slots], scales[:, slots], bits, cache.seed, stream, dtype).transpose(1, 0, 2))
    return tuple(rows)


def cache_references(cache, q, **options):
    """float64 attention of q over the cache's rows, one per codebook rounding the contract allows
    (``return_lse=True`` among the options: (out, lse) pairs)."""
    refs = []
    for dtype in CODEBOOK_DTYPES:
        k, v = cache_rows(cache, dtype)
        refs.append(reference.decode_attention(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2), k.shape[0],
                                               window=cache.sliding_window, **options))
    return refs


def check(out, refs, tol: float, dtype=np.float32):
    """out of ``dtype`` is within tol plus the output's rounding (test_decode.check's bound) of
    one of refs, the float64 references of the codebook roundings in CODEBOOK_DTYPES."""
    assert out.dtype == dtype and out.shape == refs[0].shape
    assert np.isfinite(out).all()
    out = np.asarray(out, np.float64)
    errs, bounds = [], []
    for r in refs:
        errs.append(float(np.max(np.abs(out - r), initial=0.0)))
        bounds.append(tol + HALF_ULP[np.dtype(dtype)] * float(np.abs(r).max(initial=0)))
    if all(e > b for e, b in zip(errs, bounds)):
        names = ", ".join(f"{np.dtype(d).name} codebook {e:.3g} (bound {b:.3g})"
                          for d, e, b in zip(CODEBOOK_DTYPES, errs, bounds))
        raise AssertionError(f"TurboQuant decode: max error against the {names}")


def assert_close_to_one(x, refs, atol: float, what: str = "TurboQuant decode"):
    """x (an output or an LSE) is within atol of one of refs, as check's rule."""
    x = np.asarray(x, np.float64)
    errs = [float(np.max(np.abs(x - r), initial=0.0)) for r in refs]
    assert min(errs) <= atol, f"{what}: max error against the f32 / f16 codebook's reference {errs}; bound {atol:g}"
