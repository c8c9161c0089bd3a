"""Decode attention over a dense KV cache (flash_attn_vec + reduce)."""
from __future__ import annotations

import threading

import numpy as np

from . import _args, _io, _plans, _token_major, cuda_interop, dtypes
from ._native import ffi, lib
from .device import Device
from .errors import check, invalid

_I32_MAX = _args.I32_MAX
# 1/sqrt(D) as default_scale computes it, looked up instead of recomputed per call.
_DEFAULT_SCALES = {d: _args.default_scale(None, d) for d in range(1, 1025)}


def decode_attention(q, k_cache, v_cache, kv_len, *, scale=None, softcap=0.0, window=None, ring_start=0,
                     device: Device | None = None, out=None, out_dtype=None, return_lse=False):
    """One query row per head against a KV cache.

    Parameters
    ----------
    q : array ``[B, H, D]`` (or ``[H, D]`` for one sequence), float32 / float16 / bfloat16; numpy, or a
        torch CPU tensor (read in place; the result is then a torch tensor), or a GPU array (below)
    k_cache, v_cache : arrays ``[B, H_kv, capacity, D]`` (or ``[H_kv, capacity, D]``), one float
        dtype for both; ``H % H_kv == 0`` (GQA: head ``h`` reads KV head ``h // (H // H_kv)``).
        Head-major shape. flash-attn's token-major cache ``[B, capacity, H_kv, D]`` goes in as
        ``k_cache.transpose(1, 2)`` and is read where it is (by the paged kernels, each sequence
        one run of pages) when ``ring_start`` is 0, H_kv > 1 and the batch is one C-contiguous
        array (or B = 1); other non-contiguous caches are copied per call.
    kv_len : int or ``[B]`` ints in ``1..capacity``: positions per sequence, from slot ``ring_start``.
    scale : multiplies ``q·k`` (default ``1/sqrt(D)``).
    softcap : ``> 0`` applies ``softcap * tanh(s / softcap)`` to the scores; 0 disables.
    window : None, or a positive int: only the last ``window`` positions are visible
        (flash-attn's ``window_size=(window - 1, 0)``).
    ring_start : int or ``[B]`` ints in ``0..capacity-1``: the slot of each sequence's oldest
        position; position ``p`` (0 the oldest) is in slot ``(ring_start + p) % capacity``, so
        slots ``ring_start ..`` hold the ``kv_len`` positions, wrapping at ``capacity``. A full
        ring's start, or where a shorter run begins (a left-padded sequence's first real token);
        slots outside the run are not read.
    out : optional array of the output's shape and dtype to write into: numpy or a contiguous torch
        CPU tensor (a GPU array when the inputs are); it is returned.
    out_dtype : None (q's dtype), float32, float16 or bfloat16: the output's dtype. Accumulation is
        float32 either way; the result is rounded once, to nearest even.
    return_lse : also return the float32 LSE ``[B, H]`` (``[H]`` for a 2-D ``q``): each row's natural
        log of ``sum_j exp(s_j)`` over its visible keys (scores after scale and softcap), the
        convention of :func:`pyfa.attention`'s LSE, so :func:`pyfa.merge_attention_states`
        combines decodes over disjoint parts of a cache.

    kv_len and ring_start may also be GPU int32 arrays of ``B`` values (with GPU inputs): the
    kernels read them when they run, so a CUDA graph that captured the call sees values written
    before each replay. Such values cannot be checked on the host: the kernels clamp them
    (``kv_len`` below 1 is an empty sequence whose output is zeros, above ``capacity`` is
    ``capacity``; ``ring_start`` outside ``0..capacity-1`` is 0).

    Returns
    -------
    array ``[B, H, D]`` (``[H, D]`` for a 2-D ``q``) of ``out_dtype``, or ``(out, lse)``.
    Other non-contiguous inputs are copied. With GPU arrays (torch / cupy) on the cuda device the inputs
    are read in place, the results are arrays of the same framework, and the work is queued on the
    caller's current stream without waiting.

    How these conventions map to flash-attn's and torch's: README.md, "Conventions for flash-attn and torch users".

    >>> import numpy as np, pyfa
    >>> q = np.ones((4, 64), np.float32); k = np.ones((2, 8, 64), np.float16)
    >>> pyfa.decode_attention(q, k, k, kv_len=5).shape
    (4, 64)
    """
    if (out is None and out_dtype is None and return_lse is False and (scale is None or type(scale) is float)
            and window is None and type(softcap) is float and softcap == 0.0 and type(ring_start) is int
            and ring_start == 0):
        result = _repeat_call(q, k_cache, v_cache, kv_len, device, scale)
        if result is not None:
            return result
        result = _token_major.repeat(q, k_cache, v_cache, kv_len, device, scale)
        if result is not None:
            return result
    pools = _token_major.pools(q, k_cache, v_cache, kv_len, ring_start, out)
    if pools is not None:
        return _token_major.decode(pools, kv_len, scale, softcap, window, device, out, out_dtype, return_lse,
                                   remember=out is None and out_dtype is None and return_lse is False and window is None
                                   and type(softcap) is float and softcap == 0.0 and (scale is None or type(scale) is float))
    device = _args.device_arg(device)
    q_arg, out_arg, scale_arg = q, out, scale
    return_lse = return_lse if return_lse is False else _args.bool_arg(return_lse, "return_lse")
    q = _io.as_array(q, "q", ndims=(2, 3), gpu=True)
    out_dtype = q.dtype if out_dtype is None else _args.out_dtype_arg(out_dtype, q.dtype, dtypes.FLOAT_TYPES)
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
    _args.u32_fields(batch=B, num_heads=H, num_kv_heads=Hkv, head_dim=D)
    # A window wider than any cache is no window: larger values clamp to the C field's range.
    if window is not None:
        window = _args.optional_int(window, "window", 1, float("inf"), rule="must be None or a positive int")
    window = min(window or 0, _args.U32_MAX)
    scale = _args.default_scale(scale, D) if scale is not None or not 0 < D <= 1024 else _DEFAULT_SCALES[D]
    softcap = 0.0 if type(softcap) is float and softcap == 0.0 else _args.float_arg(softcap, "softcap")
    if out is not None and single:
        try:
            out = out[None]
        except Exception:
            raise invalid(f"out: expected an array of shape {(H, D)} and dtype {out_dtype}, "
                          f"got {_args.show(out)}") from None
    if like is None and not device.host_visible:
        result, lse = _decode_copied(device, q, k, v, kv_len, ring_start, window, scale, softcap, out, out_dtype,
                                     return_lse)
    else:
        result, lse = _decode_planned(device, like, q, k, v, kv_len, ring_start, window, scale, softcap, out,
                                      out_dtype, return_lse, repeatable=not single and (scale_arg is None or type(
                                          scale_arg) is float), scale_key=scale_arg)
    if single:
        result = result[0]
        lse = None if lse is None else lse[0]
    result = _io.host_result(result, q_arg, out_arg)
    return (result, _io.host_result(lse, q_arg)) if return_lse else result


def _decode_planned(device, like, q, k, v, kv_len, ring_start, window, scale, softcap, out, out_dtype, return_lse,
                    repeatable=False, scale_key=None):
    """Arrays the device reads in place: a cached plan, run on this thread's encoder.
    `repeatable`: the call used every default the repeat path assumes, with the scale the
    caller gave (`scale_key`: None or a float)."""
    B, H, D = q.shape
    Hkv, capacity = k.shape[1], k.shape[2]
    lens = _io.sequence_values(kv_len, "kv_len", B, like)
    rings = _io.sequence_values(ring_start, "ring_start", B, like)
    # The split is sized for the longest host kv_len (rounded up to a power of
    # two, so a growing cache reuses its plan), or the capacity for device values.
    bucket = _plans.length_bucket(lens.longest if lens.longest is not None else capacity)
    key = ("decode", device, B, H, Hkv, D, window, scale, softcap, q.dtype, k.dtype, out_dtype, return_lse, bucket)
    plan = _plans.cached(key, lambda: _plans.new_plan(lib.pyfa_decode_plan_new, device, _args.params(
        "pyfa_decode_plan_desc *", {
            "attn": {"batch": B, "num_heads": H, "num_kv_heads": Hkv, "head_dim": D, "kv_capacity": capacity,
                     "nwg": 0, "window": window, "scale": scale, "softcap": softcap},
            "q_dtype": dtypes.code(q.dtype), "kv_dtype": dtypes.code(k.dtype), "out_dtype": dtypes.code(out_dtype),
            "max_kv_len": min(bucket, capacity), "return_lse": int(return_lse)})))
    result, out_address = _io.result_array((B, H, D), out_dtype, out, like=like)
    args = ffi.new("pyfa_decode_run_args *")
    a = args.q
    a.address, a.nbytes = _io.address(q), q.nbytes
    a = args.k_cache
    a.address, a.nbytes = _io.address(k), k.nbytes
    a = args.v_cache
    a.address, a.nbytes = _io.address(v), v.nbytes
    args.out.address, args.out.nbytes = out_address, B * H * D * np.dtype(out_dtype).itemsize
    lse = None
    if return_lse:
        lse, args.lse.address = _io.result_array((B, H), np.float32, None, "lse", like=like)
        args.lse.nbytes = B * H * 4
    lens.set(args.kv_len)
    rings.set(args.ring_start)
    args.kv_capacity = capacity
    stream = like.stream if like is not None else 0
    _plans.run(device, lib.pyfa_decode_run, plan, _plans.encoder(device, stream), args)
    if repeatable and out is None and not return_lse and out_dtype == q.dtype and type(ring_start) is int \
            and ring_start == 0 and window == 0 and softcap == 0.0 and (like is None or like.kind == "torch"):
        _remember(device, q, k, v, kv_len, lens, plan, args, capacity, scale_key)
    return result, lse


def _decode_copied(device, q, k, v, kv_len, ring_start, window, scale, softcap, out, out_dtype, return_lse):
    """Host arrays on a device with its own memory: copied in, the results copied back."""
    B, H, D = q.shape
    for name, value in (("kv_len", kv_len), ("ring_start", ring_start)):
        _io.sequence_values(value, name, B, None)  # refuses GPU arrays by name
    Hkv, capacity = k.shape[1], k.shape[2]
    params = _args.params("pyfa_flash_attn_vec_params *", {
        "batch": B, "num_heads": H, "num_kv_heads": Hkv, "head_dim": D, "kv_capacity": capacity,
        "nwg": 0, "window": window, "scale": scale, "softcap": softcap,
    })
    lens = _args.index_array(kv_len, "kv_len", B, -_I32_MAX, _I32_MAX)
    rings = _args.index_array(ring_start, "ring_start", B, -_I32_MAX, _I32_MAX)
    tmp_bytes = ffi.new("uint64_t *")
    max_len = max(int(lens.max()), 0) if lens.size else 0
    check(lib.pyfa_flash_attn_vec_plan(device.handle, params, dtypes.code(k.dtype), min(max_len, capacity),
                                       tmp_bytes))
    result, out_buf = _io.output(device, (B, H, D), out_dtype, out)
    lse, lse_buf = _io.output(device, (B, H), np.float32, None, "lse") if return_lse else (None, None)
    bufs = [_io.to_device(device, a) for a in (q, k, v, lens, rings)]
    tmp = _io.scratch(device, tmp_bytes[0])
    enc = _io.encoder(device)
    check(lib.pyfa_flash_attn_vec(enc, params, *(b.handle for b in bufs), _io.handle(tmp), out_buf.handle,
                                  _io.handle(lse_buf)))
    _io.submit(enc)
    _io.finish(device, result, out_buf)
    if return_lse:
        _io.finish(device, lse, lse_buf)
    return result, lse


# ---- the repeat path ---------------------------------------------------------------------------------
# A model calls decode with the same shapes, dtypes and defaults every step. After one such call on
# torch CUDA tensors, or on numpy arrays on a host-visible device, has gone through every check above,
# its plan and its run-argument struct are kept (per thread) under everything those checks looked at:
# the device, the scale as given (None or a float), each array's shape but the caches' capacity (a
# cache that grows by a row a step, as transformers' DynamicCache, is one entry) and dtype (and GPU),
# and how kv_len came (an int, by its _plans.length_bucket, or an int32 tensor). A later call that
# matches runs with only what changes checked here: contiguity, the capacity (k's and v's equal), the
# kv_len value (or the tensor's dtype, size and GPU), and the addresses. Anything else takes the full
# path above.
_repeat = threading.local()
_torch_tensor = None
_torch_int32 = None


def _remember(device, q, k, v, kv_len, lens, plan, args, capacity, scale):
    B = q.shape[0]
    if type(q) is np.ndarray:  # host arrays (numpy, or torch CPU tensors read as numpy)
        if type(kv_len) is not int or not _plans.HOST_SLOTS:
            return
        host = ffi.new("int32_t[]", B)
        key = (device, scale, _plans.length_bucket(kv_len), q.shape, _uncapped(k.shape), _uncapped(v.shape), q.dtype,
               k.dtype, v.dtype)
        gpu = None
    else:
        global _torch_tensor, _torch_int32
        t = q.obj
        if _torch_tensor is None:
            import torch

            _torch_tensor, _torch_int32 = torch.Tensor, torch.int32
        if type(t) is not _torch_tensor or type(k.obj) is not _torch_tensor or type(v.obj) is not _torch_tensor:
            return
        if lens.gpu is None:
            if type(kv_len) is not int:
                return
            kind = _plans.length_bucket(kv_len)
            host = ffi.new("int32_t[]", B)
        else:
            if type(lens.gpu.obj) is not _torch_tensor:
                return
            kind, host = -1, None
        gpu = t.get_device()
        key = (device, scale, kind, t.shape, _uncapped(k.obj.shape), _uncapped(v.obj.shape), t.dtype, k.obj.dtype,
               v.obj.dtype, gpu, k.obj.get_device(), v.obj.get_device())
    reused = ffi.new("pyfa_decode_run_args *", args[0])
    reused.kv_len.host = host if host is not None else ffi.NULL
    zeros = ffi.new("int32_t[]", B)  # ring_start: kept alive with the entry that points at it
    reused.ring_start.host = zeros
    # Host arrays: the four address fields seen as pointers, so a call stores
    # ffi.from_buffer(...) into them without converting it to an int.
    slots = None if gpu is not None else _plans.address_slots(reused, "q", "k_cache", "v_cache", "out")
    # Host arrays: the k and v objects the slots point at, kept so their memory stays put (a decode
    # loop passes the same caches every step: their addresses are then not taken again).
    seen = [None, None]
    # [capacity, k's bytes per slot, v's]: the capacity the struct holds now, and what a new one's
    # nbytes fields take.
    caps = [capacity, k.nbytes // capacity, v.nbytes // capacity]
    _plans.repeat_table(_repeat)[key] = (plan, reused, host, B, caps, q.shape, gpu, zeros, slots, seen)


def _uncapped(shape):
    """A cache's shape without its capacity (the second-last axis): what the repeat paths key."""
    return shape[:-2] + shape[-1:]


def _recap(args, caps, capacity) -> None:
    """Points a kept run-argument struct at caches of ``capacity`` slots (the repeat paths' caches grow)."""
    caps[0] = args.kv_capacity = capacity
    args.k_cache.nbytes, args.v_cache.nbytes = caps[1] * capacity, caps[2] * capacity


def _repeat_call(q, k, v, kv_len, device, scale):
    """The result of a call matching a remembered one, or None (take the full path)."""
    table = getattr(_repeat, "table", None)
    if table is None:
        return None
    if type(q) is np.ndarray:
        return _repeat_host(table, q, k, v, kv_len, device, scale)
    return _repeat_torch(table, q, q.shape, None, k, v, kv_len, device, scale)


def decode_rows(query, k_cache, v_cache, kv_len: int, scale, device):
    """For integrations whose decode queries come as ``[B, H, 1, D]`` (a transformers layer's at a
    decode step, its memory ``[B, H, D]`` contiguous): what
    ``decode_attention(query.select(2, 0), k_cache, v_cache, kv_len, scale=scale, device=device)``
    returns, as ``[B, 1, H, D]`` (the layout the layer's output takes), when a call of the same
    shapes, dtypes and GPUs took decode_attention's checks before on this thread (the repeat
    path); else None, and the caller makes that call. Saves the view and the reshape of each
    step's query and output (several microseconds of torch's host time a layer)."""
    table = getattr(_repeat, "table", None)
    if table is None:
        return None
    s = query.shape
    if len(s) != 4 or s[2] != 1:
        return None
    return _repeat_torch(table, query, (s[0], s[1], s[3]), (s[0], 1, s[1], s[3]), k_cache, v_cache, kv_len, device,
                         scale)


def _repeat_torch(table, q, q_shape, out_shape, k, v, kv_len, device, scale):
    """The repeat path for torch tensors: ``q`` read as a contiguous array of ``q_shape``, the
    result a new tensor of ``out_shape`` (None: the remembered q's shape) over the same memory
    order."""
    T = _torch_tensor
    if type(q) is not T or type(k) is not T or type(v) is not T:
        return None
    kind = _plans.repeat_length_kind(kv_len, T)
    if kind is None:
        return None
    device = _args.device_arg(device)
    ks = k.shape
    capacity = ks[-2]
    # the shapes _uncapped, inline on the hot path
    key = (device, scale, kind, q_shape, ks[:-2] + ks[-1:], v.shape[:-2] + v.shape[-1:], q.dtype, k.dtype, v.dtype,
           q.get_device(), k.get_device(), v.get_device())
    entry = table.get(key)
    if entry is None or v.shape[-2] != capacity or not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        return None
    plan, args, host, B, caps, shape, gpu, _zeros, _slots, _seen = entry
    if not _plans.repeat_bind_lengths(args.kv_len, kv_len, kind, host, B, gpu, capacity, _torch_int32):
        return None
    if capacity != caps[0]:
        _recap(args, caps, capacity)
    out = q.new_empty(shape if out_shape is None else out_shape)
    args.q.address, args.k_cache.address = q.data_ptr(), k.data_ptr()
    args.v_cache.address, args.out.address = v.data_ptr(), out.data_ptr()
    _plans.run(device, lib.pyfa_decode_run, plan, _plans.encoder(device, cuda_interop.torch_stream_handle(gpu)), args)
    return out


def _repeat_host(table, q, k, v, kv_len, device, scale):
    """The repeat path for numpy arrays on a host-visible device (the CPU backend's decode loop)."""
    if type(k) is not np.ndarray or type(v) is not np.ndarray or type(kv_len) is not int or kv_len < 1:
        return None
    device = _args.device_arg(device)
    bucket = 1 << (kv_len - 1).bit_length()  # _plans.length_bucket, inline on the hot path
    ks = k.shape
    capacity = ks[-2]
    # the shapes _uncapped, inline on the hot path
    entry = table.get((device, scale, bucket, q.shape, ks[:-2] + ks[-1:], v.shape[:-2] + v.shape[-1:], q.dtype,
                       k.dtype, v.dtype))
    if entry is None or v.shape[-2] != capacity or not (q.flags.c_contiguous and k.flags.c_contiguous
                                                         and v.flags.c_contiguous):
        return None
    plan, args, host, B, caps, shape, _gpu, _zeros, slots, seen = entry
    if kv_len > capacity:
        return None
    if capacity != caps[0]:
        _recap(args, caps, capacity)
    for i in range(B):
        host[i] = kv_len
    out = np.empty(shape, q.dtype)
    from_buffer = ffi.from_buffer
    slots[0][0] = from_buffer(q)
    if k is not seen[0]:
        slots[1][0] = from_buffer(k)
        seen[0] = k
    if v is not seen[1]:
        slots[2][0] = from_buffer(v)
        seen[1] = v
    slots[3][0] = from_buffer(out)
    _plans.run(device, lib.pyfa_decode_run, plan, _plans.encoder(device), args)
    return out
