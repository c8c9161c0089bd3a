"""float64 numpy reference of pyfa's attention semantics (ARCHITECTURE.md,
"Numerical contracts"). Slow and simple on purpose: tests and the main job
compare the kernels against it."""
from __future__ import annotations

import math

import numpy as np


def _f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def softmax_rows(scores: np.ndarray, visible: np.ndarray):
    """Row softmax over visible entries; a row with none gives weights 0 and LSE -inf."""
    s = np.where(visible, scores, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.where(visible, np.exp(s - m_safe), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    w = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    with np.errstate(divide="ignore"):
        lse = np.where(total[..., 0] > 0, np.log(np.where(total[..., 0] > 0, total[..., 0], 1.0)) + m_safe[..., 0], -np.inf)
    return w, lse


def capped(scores: np.ndarray, softcap: float) -> np.ndarray:
    return softcap * np.tanh(scores / softcap) if softcap > 0 else scores


def decode_attention(q, k_cache, v_cache, kv_len, *, scale=None, softcap=0.0, window=None, ring_start=0):
    """Reference of :func:`pyfa.decode_attention`; returns float64 ``[B, H, D]`` (``[H, D]`` for 2-D q)."""
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
    for b in range(B):
        n, r = int(lens[b]), int(rings[b])
        slots = np.arange(n)  # only slots < kv_len are read, whatever the rest holds
        logical = (slots - r) % cap
        visible = np.ones(n, bool) if not window else logical >= n - window
        for h in range(H):
            kv = h // group
            s = capped(k[b, kv, :n] @ q[b, h] * scale, softcap)
            w, _ = softmax_rows(s[None], visible[None])
            out[b, h] = w[0] @ v[b, kv, :n]
    return out[0] if single else out
