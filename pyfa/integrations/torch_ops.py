"""pyfa's decode as a torch operator, for code that ``torch.compile`` traces.

    import pyfa.integrations.torch_ops    # registers torch.ops.pyfa.* once per process
    out = torch.ops.pyfa.decode_attention(q, k_cache, v_cache, kv_len)    # ring_start, scale, ... optional

A Python call into the library is opaque to ``torch.compile``: the graph breaks there, and
a model compiled with CUDA graphs ("reduce-overhead") leaves every layer's attention out
of them. A registered operator with a shape function is one node of the graph instead;
it runs the library when the compiled code runs, on torch's current stream, and a CUDA
graph captures its kernels like torch's own.

Operators:

- :func:`decode_attention` (``torch.ops.pyfa.decode_attention``);
- :func:`decode_attention_lse` (``torch.ops.pyfa.decode_attention_lse``): the float32 output
  and its LSE, for callers that merge or rescale rows (attention sinks, split KV).
"""
from __future__ import annotations

import numpy as np

import pyfa

try:
    import torch
except ImportError:  # the module still imports (its docs are generated anywhere); nothing registers
    torch = None

__all__ = ["decode_attention", "decode_attention_lse"]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: torch.Tensor,
                     ring_start: torch.Tensor | None = None, scale: float | None = None, softcap: float = 0.0,
                     window: int = 0) -> torch.Tensor:
    """:func:`pyfa.decode_attention` with its per-call values as tensors; registered as
    ``torch.ops.pyfa.decode_attention``.

    ``q [B, H, D]``, ``k_cache``/``v_cache [B, H_kv, capacity, D]`` (float32 / float16 /
    bfloat16, one device: the CPU, or CUDA GPU 0); ``kv_len`` and ``ring_start``: int32
    ``[B]`` on q's device (on a GPU the kernels read them when they run, so a captured graph
    sees the values they hold at each replay, clamped as pyfa.decode_attention says; on the
    CPU they are checked); ``ring_start`` None for caches that are not rings (an eager call
    then takes pyfa's repeat path); ``scale`` None for ``1/sqrt(D)``; ``softcap`` 0.0 and
    ``window`` 0 disable. ``ring_start`` begins each sequence's run of ``kv_len`` positions
    (pyfa.decode_attention). Returns ``[B, H, D]`` in q's dtype, a new tensor. Bad input raises
    :class:`pyfa.PyfaError` when the operator runs."""
    return _decode(q, k_cache, v_cache, kv_len, ring_start, scale, softcap, window)


def decode_attention_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: torch.Tensor,
                         ring_start: torch.Tensor | None = None, scale: float | None = None, softcap: float = 0.0,
                         window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_attention` returning ``(out [B, H, D] float32, lse [B, H] float32)``: each
    row's natural-log ``sum_j exp(s_j)`` over its visible keys (-inf for a row that sees none),
    as :func:`pyfa.decode_attention` with ``out_dtype=float32, return_lse=True``; registered as
    ``torch.ops.pyfa.decode_attention_lse``."""
    return _decode(q, k_cache, v_cache, kv_len, ring_start, scale, softcap, window, out_dtype=np.float32,
                   return_lse=True)


def _decode(q, k_cache, v_cache, kv_len, ring_start, scale, softcap, window, **extra):
    """pyfa.decode_attention with the operators' conventions (None / 0 for "none") mapped to its own."""
    return pyfa.decode_attention(q, k_cache, v_cache, kv_len, ring_start=0 if ring_start is None else ring_start,
                                 scale=scale, softcap=float(softcap), window=window or None,
                                 device="cuda" if q.is_cuda else "cpu", **extra)


def _decode_attention_shape(q, k_cache, v_cache, kv_len, ring_start=None, scale=None, softcap=0.0, window=0):
    return torch.empty_like(q)


def _decode_attention_lse_shape(q, k_cache, v_cache, kv_len, ring_start=None, scale=None, softcap=0.0, window=0):
    return torch.empty_like(q, dtype=torch.float32), q.new_empty(q.shape[:-1], dtype=torch.float32)


if torch is not None:
    torch.library.custom_op("pyfa::decode_attention", mutates_args=())(decode_attention).register_fake(
        _decode_attention_shape)
    torch.library.custom_op("pyfa::decode_attention_lse", mutates_args=())(decode_attention_lse).register_fake(
        _decode_attention_lse_shape)
