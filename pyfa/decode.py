"""Decode attention over a dense KV cache (flash_attn_vec + reduce)."""
from __future__ import annotations

import numpy as np

from . import _args, _io, dtypes
from ._native import ffi, lib
from .device import Device
from .errors import check, invalid

_I32_MAX = _args.I32_MAX


def decode_attention(q, k_cache, v_cache, kv_len, *, scale=None, softcap=0.0, window=None, ring_start=0,
                     device: Device | None = None, out=None) -> np.ndarray:
    """One query row per head against a KV cache.

    Parameters
    ----------
    q : array ``[B, H, D]`` (or ``[H, D]`` for one sequence), float32 / float16 / bfloat16; numpy, or a
        torch CPU tensor (read in place; the result is then a torch tensor), or a GPU array (below)
    k_cache, v_cache : arrays ``[B, H_kv, capacity, D]`` (or ``[H_kv, capacity, D]``), one float
        dtype for both; ``H % H_kv == 0`` (GQA: head ``h`` reads KV head ``h // (H // H_kv)``).
    kv_len : int or ``[B]`` ints in ``1..capacity``: valid slots per sequence (slot ``s < kv_len``).
    scale : multiplies ``q·k`` (default ``1/sqrt(D)``).
    softcap : ``> 0`` applies ``softcap * tanh(s / softcap)`` to the scores; 0 disables.
    window : None, or a positive int: only the last ``window`` positions are visible.
    ring_start : int or ``[B]``: physical slot of the oldest entry of a ring-buffer cache;
        slot ``s`` holds logical position ``(s - ring_start) % capacity``. Non-zero only for a
        full ring (``kv_len == capacity``).
    out : optional float32 array of the output's shape: numpy or a contiguous torch CPU tensor (a GPU
        array when the inputs are); it is returned.

    Returns
    -------
    float32 array ``[B, H, D]`` (``[H, D]`` for a 2-D ``q``). Non-contiguous inputs are copied.
    With GPU arrays (torch / cupy) on the cuda device the inputs are read in place, the result
    is an array of the same framework, and the work is queued on the caller's current stream
    without waiting.

    >>> import numpy as np, pyfa
    >>> q = np.ones((4, 64), np.float32); k = np.ones((2, 8, 64), np.float16)
    >>> pyfa.decode_attention(q, k, k, kv_len=5).shape
    (4, 64)
    """
    device = _args.device_arg(device)
    q_arg, out_arg = q, out
    q = _io.as_array(q, "q", ndims=(2, 3), gpu=True)
    single = q.ndim == 2
    k = _io.as_array(k_cache, "k_cache", ndims=(q.ndim + 1,), gpu=True)
    v = _io.as_array(v_cache, "v_cache", ndims=(k.ndim,), gpu=True)
    if single:
        q, k, v = q[None], k[None], v[None]
    like = _io.gpu_like(device, q, k, v)
    if k.dtype != v.dtype:
        raise invalid(f"v_cache: dtype {v.dtype} differs from k_cache's {k.dtype}")
    if k.shape != v.shape:
        raise invalid(f"v_cache: shape {v.shape} differs from k_cache's {k.shape}")
    B, H, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise invalid(f"k_cache: shape {k.shape} does not match q {q.shape} (expected [B={B}, H_kv, capacity, D={D}])")
    Hkv, capacity = k.shape[1], k.shape[2]
    if capacity > _I32_MAX:
        raise invalid(f"k_cache: capacity {capacity} exceeds {_I32_MAX}")
    # A window wider than any cache is no window: larger values clamp to the C field's range.
    window = _args.optional_int(window, "window", 1, float("inf"), rule="must be None or a positive int")
    scale = _args.default_scale(scale, D)
    softcap = _args.float_arg(softcap, "softcap")
    # The struct first: it bounds every dimension (a zero-size array's can be huge).
    params = _args.params("pyfa_flash_attn_vec_params *", {
        "batch": B, "num_heads": H, "num_kv_heads": Hkv, "head_dim": D, "kv_capacity": capacity,
        "nwg": 0, "window": min(window or 0, _args.U32_MAX), "scale": scale, "softcap": softcap,
    })
    lens = _args.index_array(kv_len, "kv_len", B, -_I32_MAX, _I32_MAX)
    rings = _args.index_array(ring_start, "ring_start", B, -_I32_MAX, _I32_MAX)
    tmp_bytes = ffi.new("uint64_t *")
    max_len = max(int(lens.max()), 0) if lens.size else 0
    check(lib.pyfa_flash_attn_vec_plan(device.handle, params, dtypes.code(k.dtype), min(max_len, capacity),
                                       tmp_bytes))

    if out is not None and single:
        try:
            out = out[None]
        except Exception:
            raise invalid(f"out: expected an array of shape {(H, D)} and dtype float32, got {_args.show(out)}") from None
    result, out_buf = _io.output(device, (B, H, D), np.float32, out, like=like)
    bufs = [_io.to_device(device, a, like) for a in (q, k, v, lens, rings)]
    tmp = _io.scratch(device, tmp_bytes[0], like)
    enc = _io.encoder(device, like)
    check(lib.pyfa_flash_attn_vec(enc, params, *(b.handle for b in bufs), tmp.handle if tmp else ffi.NULL,
                                  out_buf.handle))
    _io.submit(enc, like)
    _io.finish(device, result, out_buf)
    return _io.host_result(result[0] if single else result, q_arg, out_arg)
