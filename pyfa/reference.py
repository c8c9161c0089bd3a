"""float64 numpy reference of pyfa's attention semantics: what each op
computes, written as plainly as possible. Slow and simple on purpose: tests
and the main job compare the kernels against it. How these semantics map to
flash-attn's and torch's: README.md, "Conventions for flash-attn and torch
users"."""
from __future__ import annotations

import math

import numpy as np


def _f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def softmax_rows(scores: np.ndarray, visible: np.ndarray):
    """Row softmax over visible entries; a row with none gives weights 0 and LSE -inf."""
    s = np.where(visible, scores, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.where(visible, np.exp(s - m_safe), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    w = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    with np.errstate(divide="ignore"):
        lse = np.where(total[..., 0] > 0, np.log(np.where(total[..., 0] > 0, total[..., 0], 1.0)) + m_safe[..., 0], -np.inf)
    return w, lse


def capped(scores: np.ndarray, softcap: float) -> np.ndarray:
    """Soft-capped scores ``softcap * tanh(scores / softcap)``; ``softcap <= 0`` leaves them as they are."""
    return softcap * np.tanh(scores / softcap) if softcap > 0 else scores


def decode_attention(q, k_cache, v_cache, kv_len, *, scale=None, softcap=0.0, window=None, ring_start=0,
                     return_lse=False):
    """Reference of :func:`pyfa.decode_attention`; returns float64 ``[B, H, D]`` (``[H, D]`` for 2-D q),
    and with ``return_lse`` also the float64 natural-log LSE ``[B, H]`` (``[H]``; ``-inf`` for a row
    with no visible key, e.g. ``kv_len`` 0)."""
    q, k, v = _f64(q), _f64(k_cache), _f64(v_cache)
    single = q.ndim == 2
    if single:
        q, k, v = q[None], k[None], v[None]
    B, H, D = q.shape
    Hkv, cap = k.shape[1], k.shape[2]
    group = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    lens = np.broadcast_to(np.asarray(kv_len), (B,))
    rings = np.broadcast_to(np.asarray(ring_start), (B,))
    out = np.zeros((B, H, D))
    lse = np.full((B, H), -np.inf)
    for b in range(B):
        n, r = int(lens[b]), int(rings[b])
        logical = np.arange(n)  # position p is in slot (r + p) % cap; no other slot is read
        slots = (logical + r) % cap
        visible = np.ones(n, bool) if not window else logical >= n - window
        for h in range(H):
            kv = h // group
            s = capped(k[b, kv, slots] @ q[b, h] * scale, softcap)
            w, row_lse = softmax_rows(s[None], visible[None])
            out[b, h] = w[0] @ v[b, kv, slots]
            lse[b, h] = row_lse[0]
    if single:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


def _to_bhsd(x: np.ndarray, layout: str) -> np.ndarray:
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def attention(q, k, v, *, scale=None, causal=False, q_offset=None, mask=None, window=None, softcap=0.0,
              layout="bhsd", return_lse=False, rounding=None):
    """Reference of :func:`pyfa.attention`: float64 output in q's layout (and the
    float64 natural-log LSE ``[B, H, q_len]`` when ``return_lse``).

    ``rounding`` (a float16 / bfloat16 dtype) computes instead as a framework does in that dtype
    (flash-attn's tests' ``attention_ref`` without upcast): q * scale, the scores, each soft-cap
    step, the masked scores, the softmax weights and the output are each rounded to it (products
    accumulate exactly). Its error against the float64 result is what flash-attn's accuracy rule
    compares a kernel's error with. Values past the dtype's range (65504 for float16) become
    infinite there, as they would in a framework's computation."""
    q, k, v = (_to_bhsd(_f64(x), layout) for x in (q, k, v))
    B, H, qL, D = q.shape
    Hkv, kL = k.shape[1], k.shape[2]
    k = np.repeat(k, H // Hkv, axis=1)
    v = np.repeat(v, H // Hkv, axis=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if rounding is not None:
        r = np.dtype(rounding)

        def rnd(x):
            return x.astype(r).astype(np.float64)
        s = rnd(np.einsum("bhid,bhjd->bhij", rnd(q * scale), k))
        if softcap > 0:
            s = rnd(rnd(np.tanh(rnd(s / softcap))) * softcap)
    else:
        rnd = None
        s = capped(np.einsum("bhid,bhjd->bhij", q, k) * scale, softcap)
    visible = np.ones((B, H, qL, kL), bool)
    if mask is not None:
        m = np.asarray(mask)
        m = m if m.ndim == 4 else m[None, None]
        if m.dtype == bool:
            visible &= m
        else:
            m = m.astype(np.float64)
            visible &= m != -np.inf
            s = s + np.where(np.isfinite(m), m, 0.0)
            s = s if rnd is None else rnd(s)
    pos = (kL - qL if q_offset is None else q_offset) + np.arange(qL)[:, None]
    key = np.arange(kL)[None, :]
    if causal:
        visible &= key <= pos
    if window:
        visible &= pos - key < window
    w, lse = softmax_rows(s, visible)
    out = _to_bhsd(w @ v if rnd is None else rnd(rnd(w) @ v), layout)
    return (out, lse) if return_lse else out


def merge_attention_states(o_a, lse_a, o_b, lse_b, *, layout="bhsd"):
    """Reference of :func:`pyfa.merge_attention_states`: float64 ``(o, lse)``."""
    la, lb = _f64(lse_a), _f64(lse_b)
    m = np.maximum(la, lb)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    wa, wb = np.exp(la - m_safe), np.exp(lb - m_safe)
    total = wa + wb
    fa = np.divide(wa, total, out=np.zeros_like(wa), where=total > 0)[..., None]
    fb = np.divide(wb, total, out=np.zeros_like(wb), where=total > 0)[..., None]
    o = _to_bhsd(_to_bhsd(_f64(o_a), layout) * fa + _to_bhsd(_f64(o_b), layout) * fb, layout)
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, np.log(np.where(total > 0, total, 1.0)) + m_safe, -np.inf)
    return o, lse
