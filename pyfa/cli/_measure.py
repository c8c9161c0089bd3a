"""How `check` scores a result against the float64 reference: one Measure
per compared output, with the bound the test suite sets for it.

Bounds on max |out - ref| (the reference reads the same rounded inputs, so
only the kernels' float32 arithmetic and the output's rounding differ):

- F32_TOL = 2e-5 (tests/test_decode.py TOL, also test_kvcache.py,
  test_prefill.py, test_turboquant.py): float32 dot products over D <= 512
  terms and float32 accumulation of the weighted rows land near 1e-6; a
  misplaced key or a missing rescale is off by 1e-2 or more.
- plus HALF_ULP[out dtype] * max|ref| for a float16 / bfloat16 output: the
  float32 result rounded once to nearest even is within half an ulp of it,
  2^-11 (float16) or 2^-8 (bfloat16) relative (test_decode.py HALF_ULP,
  test_prefill.py ROUND). Prefill with float16 / bfloat16 inputs instead
  takes flash-attn's rule, as test_prefill.py does: F32_TOL plus twice the
  error of the same attention computed in the input dtype
  (reference.attention(rounding=...)), since kernels may round the softmax
  weights P to the input dtype before P V.
- plus, for float16 / bfloat16 caches, the CUDA tensor-core decode's split
  operands: q and the softmax weights P enter its 16-bit MMAs as hi + lo
  halves, good to SPLIT_REL relative (2^-22 float16, 2^-16 bfloat16; K and V
  exact). A weight is then off by at most SPLIT_REL * (1 + 2 * scale *
  max_j sum_i |q_i k_ji|) relative (its own rounding, and its score's against
  the row maximum's), so the output by that times max|v| (decode_split_bound).
- LSE: LSE_TOL * (1 + max|ref lse|) with LSE_TOL = 1e-4
  (test_decode_outputs.py, test_prefill.py check_lse: an f32 max plus the log
  of an f32 sum of exponentials is good to ~1e-6 relative; a wrong log base,
  a missing max or scale is off by more than 0.1), and -inf exactly where the
  reference has -inf (rows that see no key).
- merge_attention_states against the reference merge of the same parts:
  MERGE_TOL = 1e-5 absolute plus the output's rounding, and 1e-5 on the LSE
  (test_prefill.py's merge tests: two exponentials and a division in f32).
- kv_append: bit-exact (test_kv_append.py): a row converted to float32, then
  rounded to the cache dtype to nearest even, as numpy's astype does.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ..dtypes import bfloat16

F32_TOL = 2e-5
LSE_TOL = 1e-4
MERGE_TOL = 1e-5
HALF_ULP = {np.dtype(np.float32): 0.0, np.dtype(np.float16): 2.0**-11, np.dtype(bfloat16): 2.0**-8}
SPLIT_REL = {np.dtype(np.float32): 0.0, np.dtype(np.float16): 2.0**-22, np.dtype(bfloat16): 2.0**-16}
SHORT = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(bfloat16): "bf16"}


class Measure(NamedTuple):
    """One compared output: the table row it counts in (op, dtype), its error and bound."""

    op: str
    dtype: str
    error: float
    bound: float
    note: str = ""

    @property
    def ok(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.bound

    @property
    def ratio(self) -> float:
        """error / bound: which of a row's measures is its worst."""
        if not math.isfinite(self.error):
            return math.inf
        if self.bound == 0:
            return 0.0 if self.error == 0 else math.inf
        return self.error / self.bound


def decode_split_bound(q, k, v, scale) -> float:
    """The tensor-core decode's extra error for q [B, H, D] over k, v [B, H_kv, L, D] of a
    16-bit dtype (module docstring); 0 for float32 caches."""
    rel = SPLIT_REL[np.dtype(k.dtype)]
    if rel == 0.0:
        return 0.0
    q64 = np.abs(np.asarray(q, np.float64))
    k64 = np.abs(np.asarray(k, np.float64))
    group = q64.shape[1] // k64.shape[1]
    kk = np.repeat(k64, group, axis=1)                                  # [B, H, L, D]
    dots = np.einsum("bhd,bhld->bhl", q64, kk).max(initial=0.0)
    return rel * (1.0 + 2.0 * scale * dots) * float(np.abs(np.asarray(v, np.float64)).max(initial=0.0))


def output(op: str, row: str, out, ref, want_dtype, tol: float = F32_TOL, floor: float = 0.0,
           ref_in_dtype=None) -> Measure:
    """An attention output of dtype `want_dtype` against the float64 `ref`: its max
    absolute error and tol + HALF_ULP * max(max|ref|, floor); with `ref_in_dtype`
    (the same attention computed in the 16-bit input dtype), flash-attn's rule
    tol + 2 * max|ref_in_dtype - ref| instead (prefill: kernels may round P)."""
    want = np.dtype(want_dtype)
    ref = np.asarray(ref, np.float64)
    if ref_in_dtype is None:
        bound = tol + HALF_ULP[want] * max(float(np.abs(ref).max(initial=0.0)), floor)
    else:
        bound = tol + 2 * float(np.abs(np.asarray(ref_in_dtype, np.float64) - ref).max(initial=0.0))
    out = np.asarray(out)
    if out.dtype != want:
        return Measure(op, row, math.inf, bound, f"output dtype {out.dtype}, expected {want}")
    error = _max_abs(out, ref)
    note = _shape_note(out, ref) or ("NaN or inf in the output" if math.isinf(error) else "")
    return Measure(op, row, error, bound, note)


def lse(op: str, row: str, got, ref, tol: float = LSE_TOL, relative: bool = True) -> Measure:
    """An LSE against the reference's: -inf exactly where it has -inf, else within
    tol * (1 + max|ref|) (relative) or tol."""
    ref = np.asarray(ref, np.float64)
    finite = np.isfinite(ref)
    bound = tol * (1 + float(np.abs(ref[finite]).max(initial=0.0))) if relative else tol
    got = np.asarray(got)
    if got.dtype != np.float32:
        return Measure(op, row, math.inf, bound, f"lse dtype {got.dtype}, expected float32")
    if got.shape != ref.shape:
        return Measure(op, row, math.inf, bound, _shape_note(got, ref))
    g = got.astype(np.float64)
    if not np.array_equal(np.isneginf(g), np.isneginf(ref)):
        return Measure(op, row, math.inf, bound, "lse is -inf where the reference's is not (or the reverse)")
    return Measure(op, row, _max_abs(g[finite], ref[finite]), bound)


def exact(op: str, row: str, got, want) -> Measure:
    """Arrays that must be equal: error max |got - want|, bound 0."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return Measure(op, row, math.inf, 0.0, f"got {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}")
    return Measure(op, row, _max_abs(got, want.astype(np.float64)), 0.0)


def _max_abs(out: np.ndarray, ref: np.ndarray) -> float:
    if out.shape != ref.shape:
        return math.inf
    o = out.astype(np.float64)
    if not np.isfinite(o).all():
        return math.inf
    return float(np.abs(o - ref).max(initial=0.0))


def _shape_note(out, ref) -> str:
    return "" if out.shape == ref.shape else f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
