"""Decode over paged KV pools (contract: shaders/common/paged_kv_params.h).

A pool holds the K (or V) rows of every sequence of a batch in pages of
``page_size`` tokens; ``block_table[b, i]`` names the page holding positions
``[i * page_size, (i + 1) * page_size)`` of sequence ``b``. One plan run
decodes the whole batch (pyfa_paged_decode_run / pyfa_paged_tq_decode_run).
"""
from __future__ import annotations

import threading

import numpy as np

from . import _args, _io, _plans, cuda_interop, dtypes
from ._native import ffi, lib
from .errors import invalid

LAYOUTS = {"nhd": 0, "hnd": 1}  # PYFA_PAGES_NHD, PYFA_PAGES_HND


def layout_code(page_layout) -> int:
    return LAYOUTS[_args.page_layout_arg(page_layout)]


def pool_dims(shape, layout: int, name: str):
    """(num_pages, page_size, num_kv_heads, last) of a 4-D pool shape, or 3-D for scales."""
    if layout == 0:
        return shape[0], shape[1], shape[2], (shape[3] if len(shape) > 3 else None)
    return shape[0], shape[2], shape[1], (shape[3] if len(shape) > 3 else None)


def block_table_arg(block_table, batch: int, like):
    """block_table ``[batch, pages_per_seq]``: (host int32 array or GpuArray, pages_per_seq)."""
    if cuda_interop.is_gpu_array(block_table):
        if like is None:
            raise invalid("block_table: a GPU array needs GPU inputs (q, pools) on a GPU device")
        g = cuda_interop.describe(block_table, "block_table")
        if g.dtype != np.int32:
            raise invalid(f"block_table: GPU values must be int32, got {g.dtype}")
        if g.kind != like.kind or g.device_id != like.device_id:
            raise invalid(f"block_table: must come from the inputs' framework and GPU ({like.kind} on GPU {like.device_id})")
        if g.ndim != 2 or g.shape[0] != batch or g.shape[1] < 1:
            raise invalid(f"block_table: expected shape [batch={batch}, pages_per_seq >= 1], got {g.shape}")
        return g, g.shape[1]
    try:
        t = np.asarray(block_table)
    except Exception:
        raise invalid(f"block_table: expected a 2-D array of ints, got {_args.show(block_table)}") from None
    if t.dtype.kind not in "iu" or t.ndim != 2 or t.shape[0] != batch or t.shape[1] < 1:
        raise invalid(f"block_table: expected ints of shape [batch={batch}, pages_per_seq >= 1], "
                      f"got {t.dtype} {t.shape}")
    bad = (t < -_args.I32_MAX - 1) | (t > _args.I32_MAX)
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise invalid(f"block_table[{i}][{j}]: {int(t[i, j])} does not fit int32")
    return np.ascontiguousarray(t, dtype=np.int32), t.shape[1]


def length_hints(kv_len, batch: int, lens):
    """(max_kv_len, split_batch) plan hints: the longest host length's bucket and the
    batch's work in units of it (pyfa.h, paged decode): the batch itself for equal lengths,
    else rounded down to a power of two so similar batches share a plan (down: a smaller
    split batch splits more, never less than the work needs); (0, 0) for device lengths
    (plan as if every sequence were full)."""
    if lens.gpu is not None:
        return 0, 0
    values = np.full(batch, kv_len, np.int64) if type(kv_len) is int else \
        _args.index_array(kv_len, "kv_len", batch, -_args.I32_MAX, _args.I32_MAX).astype(np.int64)
    values = np.maximum(values, 0)
    longest = int(values.max()) if batch else 0
    if longest == 0:
        return 0, 0
    split = -(-int(values.sum()) // longest)
    return _plans.length_bucket(longest), batch if split >= batch else 1 << (split.bit_length() - 1)


def run(kind, device, like, q, pools, block_table, kv_len, pages, attn, extra, out, out_dtype, return_lse,
        remember=None):
    """One paged plan run. kind: "dense" (pools: k_pages, v_pages) or "tq" (k_codes,
    k_scales, v_codes, v_scales); attn: the pyfa_flash_attn_vec_params fields; extra: the
    TurboQuant fields (k_bits, v_bits, seeds, fused). Returns (out, lse or None).
    remember(plan, args): called after a run of host arrays on a host-visible device
    (the repeat path below keeps them)."""
    B, H, D = q.shape
    table, pps = block_table
    pages = dict(pages, pages_per_seq=pps)
    lens = _io.sequence_values(kv_len, "kv_len", B, like)
    max_len, split = length_hints(kv_len, B, lens)
    capacity = pages["page_size"] * pps
    hints = {"max_kv_len": min(max_len, capacity), "split_batch": split}
    staged = like is None and not device.host_visible
    if kind == "dense":
        desc_type, run_type, constructor, runner = ("pyfa_paged_decode_plan_desc *", "pyfa_paged_decode_run_args *",
                                                    lib.pyfa_paged_decode_plan_new, lib.pyfa_paged_decode_run)
        desc = {"attn": attn, "pages": pages, "q_dtype": dtypes.code(q.dtype), "kv_dtype": dtypes.code(pools[0][1].dtype),
                "out_dtype": dtypes.code(out_dtype), "return_lse": int(return_lse), **hints}
    else:
        desc_type, run_type, constructor, runner = ("pyfa_paged_tq_decode_plan_desc *",
                                                    "pyfa_paged_tq_decode_run_args *",
                                                    lib.pyfa_paged_tq_decode_plan_new, lib.pyfa_paged_tq_decode_run)
        desc = {"tq": dict(extra, attn=attn), "pages": pages, "q_dtype": dtypes.code(q.dtype),
                "out_dtype": dtypes.code(out_dtype), "return_lse": int(return_lse), **hints}
    key = ("paged", kind, device, repr(desc), q.dtype, out_dtype)
    plan = _plans.cached(key, lambda: _plans.new_plan(constructor, device, _args.params(desc_type, desc)))
    args = ffi.new(run_type)
    keep = []  # buffers and arrays the run reads, alive until it finished

    def bind(field, a):
        t = getattr(args, field)
        if staged:
            # Private memory: a run binds addresses, and only a buffer the queue
            # knows gets its shared (pinned) host copy uploaded before a dispatch.
            b = device.buffer(a.shape, a.dtype, storage="private")
            b.write(a)
            keep.append(b)
            t.address = lib.pyfa_buffer_address(b.handle)
        else:
            t.address = _io.address(a)
        t.nbytes = a.nbytes

    bind("q", q)
    for field, a in pools:
        bind(field, a)
    lens.set(args.kv_len)
    if isinstance(table, np.ndarray) and device.host_visible:
        # Host tables go as memory the library reads (and checks): no inline-size
        # limit (Metal's setBytes takes 4 KB). On a GPU they go as host values,
        # which the library checks and uploads with the launch.
        b = _io.to_device(device, table)
        keep += [b, table]
        args.block_table.host = ffi.NULL
        args.block_table.device.address = lib.pyfa_buffer_address(b.handle)
        args.block_table.device.nbytes = table.nbytes
    elif isinstance(table, np.ndarray):
        host = ffi.new("int32_t[]", table.reshape(-1).tolist())
        keep.append(host)
        args.block_table.host = host
    else:
        args.block_table.host = ffi.NULL
        args.block_table.device.address, args.block_table.device.nbytes = table.ptr, table.nbytes
    if staged:
        result, out_buf = _io.output(device, (B, H, D), out_dtype, out)
        lse, lse_buf = _io.output(device, (B, H), np.float32, None, "lse") if return_lse else (None, None)
        args.out.address, args.out.nbytes = lib.pyfa_buffer_address(out_buf.handle), out_buf.nbytes
        if return_lse:
            args.lse.address, args.lse.nbytes = lib.pyfa_buffer_address(lse_buf.handle), lse_buf.nbytes
        _plans.run(device, runner, plan, _plans.encoder(device, 0), args)
        _io.finish(device, result, out_buf)
        if return_lse:
            _io.finish(device, lse, lse_buf)
        return result, lse
    result, out_address = _io.result_array((B, H, D), out_dtype, out, like=like)
    args.out.address, args.out.nbytes = out_address, B * H * D * np.dtype(out_dtype).itemsize
    lse = None
    if return_lse:
        lse, args.lse.address = _io.result_array((B, H), np.float32, None, "lse", like=like)
        args.lse.nbytes = B * H * 4
    stream = like.stream if like is not None else 0
    _plans.run(device, runner, plan, _plans.encoder(device, stream), args)
    if remember is not None:
        remember(plan, args)
    return result, lse


def query_and_options(q, scale, softcap, window, out_dtype, return_lse, allowed=dtypes.FLOAT_TYPES):
    """The checks paged decodes share: q [B, H, D] and the options."""
    return_lse = return_lse if return_lse is False else _args.bool_arg(return_lse, "return_lse")
    q = _io.as_array(q, "q", allowed, ndims=(3,), gpu=True)
    out_dtype = q.dtype if out_dtype is None else _args.out_dtype_arg(out_dtype, q.dtype, dtypes.FLOAT_TYPES)
    if window is not None:
        window = _args.optional_int(window, "window", 1, float("inf"), rule="must be None or a positive int")
    window = min(window or 0, _args.U32_MAX)
    softcap = _args.float_arg(softcap, "softcap")
    return q, out_dtype, window, softcap, return_lse


def paged_decode_attention(q, k_pages, v_pages, block_table, kv_len, *, page_layout="nhd", scale=None, softcap=0.0,
                           window=None, device=None, out=None, out_dtype=None, return_lse=False, ring_start=None):
    """One query row per head for a batch of sequences whose KV rows live in paged pools.

    Parameters
    ----------
    q : array ``[B, H, D]``, float32 / float16 / bfloat16; numpy, a torch CPU tensor (read in
        place; the result is then a torch tensor), or a GPU array (below).
    k_pages, v_pages : pools of one shape and float dtype: ``[num_pages, page_size, H_kv, D]``
        (``page_layout="nhd"``: flash-attn's paged ``k_cache``, vLLM's and FlashInfer's NHD) or
        ``[num_pages, H_kv, page_size, D]`` (``"hnd"``: FlashInfer's HND). ``page_size`` is a
        power of two up to 1024; ``H % H_kv == 0`` (GQA as in :func:`pyfa.decode_attention`).
    block_table : ints ``[B, pages_per_seq]``: ``block_table[b, i]`` is the pool page holding
        positions ``i * page_size .. (i + 1) * page_size - 1`` of sequence ``b``; every entry in
        ``0..num_pages-1`` (also those past ``kv_len``: a table is reused as sequences grow).
    kv_len : int or ``[B]`` ints in ``0..pages_per_seq * page_size``: positions per sequence
        (position ``s`` is token ``s % page_size`` of page ``block_table[b, s // page_size]``).
        0 is an empty sequence: its output is zeros and its LSE ``-inf``.
    page_layout : ``"nhd"`` (default) or ``"hnd"``.
    scale, softcap, window, out, out_dtype, return_lse : as :func:`pyfa.decode_attention`
        (``window``: the last ``window`` positions of each sequence).
    ring_start : not accepted (None): paged sequences are not rings; a value raises, so code
        moved over from :func:`pyfa.decode_attention` does not silently drop it.

    With GPU arrays (torch / cupy) on the cuda device the pools are read in place and the work
    is queued on the caller's current stream; ``block_table`` and ``kv_len`` may then be GPU
    int32 arrays, read when the kernels run (so a CUDA graph that captured the call sees values
    written before each replay). Such values cannot be checked on the host: the kernels clamp
    them (an entry outside ``0..num_pages-1`` reads page ``num_pages - 1``; ``kv_len`` below 0
    is 0, above ``pages_per_seq * page_size`` is that).

    Returns
    -------
    array ``[B, H, D]`` of ``out_dtype``, or ``(out, lse)`` with the float32 LSE ``[B, H]``,
    which :func:`pyfa.merge_attention_states` combines with other decodes' (cascades).

    >>> import numpy as np, pyfa
    >>> q = np.ones((2, 4, 64), np.float32); pool = np.ones((8, 16, 2, 64), np.float16)
    >>> pyfa.paged_decode_attention(q, pool, pool, [[3, 1], [0, 2]], kv_len=[20, 5]).shape
    (2, 4, 64)
    """
    defaults = (out is None and out_dtype is None and return_lse is False and window is None and ring_start is None
                and type(softcap) is float and softcap == 0.0 and (scale is None or type(scale) is float)
                and type(page_layout) is str)
    if defaults:
        result = _repeat_call(q, k_pages, v_pages, block_table, kv_len, page_layout, device, scale)
        if result is not None:
            return result
    if ring_start is not None:
        raise invalid(f"ring_start: paged sequences are not rings (pass none), got {_args.show(ring_start)}")
    device = _args.device_arg(device)
    q_arg = q
    layout = layout_code(page_layout)
    q, out_dtype, window, softcap, return_lse = query_and_options(q, scale, softcap, window, out_dtype, return_lse)
    k = _io.as_array(k_pages, "k_pages", ndims=(4,), gpu=True)
    v = _io.as_array(v_pages, "v_pages", ndims=(4,), gpu=True)
    like = _io.gpu_like(device, q, k, v)
    if k.dtype != v.dtype:
        raise invalid(f"v_pages: dtype {v.dtype} differs from k_pages' {k.dtype}")
    if k.shape != v.shape:
        raise invalid(f"v_pages: shape {v.shape} differs from k_pages' {k.shape}")
    B, H, D = q.shape
    num_pages, page_size, Hkv, Dk = pool_dims(k.shape, layout, "k_pages")
    if Dk != D:
        raise invalid(f"k_pages: head_dim {Dk} (last dim of {k.shape}) does not match q's {D}")
    _args.u32_fields(batch=B, num_heads=H, num_kv_heads=Hkv, head_dim=D, num_pages=num_pages, page_size=page_size)
    scale_arg, scale = scale, _args.default_scale(scale, D)
    table = block_table_arg(block_table, B, like)
    attn = {"batch": B, "num_heads": H, "num_kv_heads": Hkv, "head_dim": D, "kv_capacity": 0, "nwg": 0,
            "window": window, "scale": scale, "softcap": softcap}
    pages = {"page_size": page_size, "num_pages": num_pages, "layout": layout}
    remember = None
    if defaults and _repeatable(q_arg, k_pages, v_pages, block_table, kv_len) and device.host_visible and like is None:
        remember = lambda plan, args: _remember(device, scale_arg, page_layout, q, k, v, block_table, kv_len, plan,
                                                args, page_size * table[1])
    elif defaults and like is not None and _torch_repeatable(q_arg, k_pages, v_pages, block_table, kv_len):
        remember = lambda plan, args: _remember_torch(device, scale_arg, page_layout, q_arg, k_pages, v_pages,
                                                      block_table, kv_len, plan, args, page_size * table[1])
    result, lse = run("dense", device, like, q, (("k_pages", k), ("v_pages", v)), table, kv_len, pages, attn, None,
                      out, out_dtype, return_lse, remember)
    result = _io.host_result(result, q_arg, out)
    return (result, _io.host_result(lse, q_arg)) if return_lse else result


# ---- the repeat path ---------------------------------------------------------------------------------
# A decode loop calls paged_decode_attention with the same shapes, dtypes and defaults every step. After
# one such call has gone through every check above, its plan and run-argument struct are kept (per
# thread) under everything those checks looked at: the device, the scale as given (None or a float),
# page_layout, each array's shape and dtype (and GPU), and how kv_len came (an int, by its
# _plans.length_bucket, which sizes the plan's split; or an int32 GPU tensor). A later call that matches
# runs with only what changes checked here: contiguity, the kv_len value (or the tensor's dtype, size and
# GPU), and the addresses. Two kinds of call are kept:
#   - numpy arrays (q, both pools, an int32 block_table; kv_len an int) on a host-visible device: the
#     library still checks every block_table entry and kv_len on each run (it reads the table from host
#     memory), so a bad value raises the same error as on the full path;
#   - torch CUDA tensors (q, both pools, an int32 block_table; kv_len an int or an int32 tensor): the
#     kernels clamp device values, as on the full path.
_repeat = threading.local()


def _repeatable(q, k, v, block_table, kv_len) -> bool:
    return (type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray
            and type(block_table) is np.ndarray and block_table.dtype == np.int32 and block_table.flags.c_contiguous
            and type(kv_len) is int and kv_len >= 1 and _plans.HOST_SLOTS)


def _remember(device, scale, page_layout, q, k, v, block_table, kv_len, plan, args, capacity):
    table = _plans.repeat_table(_repeat)
    B = q.shape[0]
    host = ffi.new("int32_t[]", B)
    reused = ffi.new("pyfa_paged_decode_run_args *", args[0])
    reused.kv_len.host = host
    reused.block_table.host = ffi.NULL
    # The five address fields seen as pointers, so a call stores ffi.from_buffer(...) into them as is.
    slots = _plans.address_slots(reused, "q", "k_pages", "v_pages", "out", ("block_table", "device"))
    key = (device, scale, page_layout, _plans.length_bucket(kv_len), q.shape, k.shape, v.shape, block_table.shape,
           q.dtype, k.dtype, v.dtype)
    table[key] = (plan, reused, host, B, capacity, slots)


def _repeat_call(q, k, v, block_table, kv_len, page_layout, device, scale):
    """The result of a call matching a remembered one, or None (take the full path)."""
    if _torch_tensor is not None and type(q) is _torch_tensor:
        table = getattr(_repeat, "table", None)
        return None if table is None else _repeat_torch(table, q, k, v, block_table, kv_len, page_layout, device,
                                                        scale)
    return _repeat_host(q, k, v, block_table, kv_len, page_layout, device, scale)


def _repeat_host(q, k, v, block_table, kv_len, page_layout, device, scale):
    """The numpy kind of _repeat_call."""
    table = getattr(_repeat, "table", None)
    if table is None or not _repeatable(q, k, v, block_table, kv_len):
        return None
    device = _args.device_arg(device)
    entry = table.get((device, scale, page_layout, 1 << (kv_len - 1).bit_length(), q.shape, k.shape, v.shape,
                       block_table.shape, q.dtype, k.dtype, v.dtype))
    if entry is None or not (q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous):
        return None
    plan, args, host, B, capacity, slots = entry
    if kv_len > capacity:
        return None
    for i in range(B):
        host[i] = kv_len
    out = np.empty(q.shape, q.dtype)
    from_buffer = ffi.from_buffer
    for slot, a in zip(slots, (q, k, v, out, block_table)):
        slot[0] = from_buffer(a)
    _plans.run(device, lib.pyfa_paged_decode_run, plan, _plans.encoder(device), args)
    return out


_torch_tensor = None
_torch_int32 = None


def _torch_repeatable(q, k, v, block_table, kv_len) -> bool:
    global _torch_tensor, _torch_int32
    if _torch_tensor is None:
        try:
            import torch
        except ImportError:
            return False
        _torch_tensor, _torch_int32 = torch.Tensor, torch.int32
    T = _torch_tensor
    if not (type(q) is T and type(k) is T and type(v) is T and type(block_table) is T):
        return False
    # Only a GPU table and GPU lengths are read in place: the full path turns CPU
    # tensors into host values, which a kept run would not see again.
    if block_table.dtype != _torch_int32 or not block_table.is_cuda:
        return False
    return (type(kv_len) is int and kv_len >= 1) or (type(kv_len) is T and kv_len.dtype == _torch_int32
                                                     and kv_len.is_cuda)


def _remember_torch(device, scale, page_layout, q, k, v, block_table, kv_len, plan, args, capacity):
    B = q.shape[0]
    if type(kv_len) is int:
        kind, host = _plans.length_bucket(kv_len), ffi.new("int32_t[]", B)
    else:
        kind, host = -1, None
    reused = ffi.new("pyfa_paged_decode_run_args *", args[0])
    reused.kv_len.host = host if host is not None else ffi.NULL
    reused.block_table.host = ffi.NULL  # the table is read from the device address each repeat sets
    key = _torch_key(device, scale, page_layout, kind, q, k, v, block_table)
    _plans.repeat_table(_repeat)[key] = (plan, reused, host, B, capacity, q.get_device())


def _torch_key(device, scale, page_layout, kind, q, k, v, block_table):
    """What a torch call is kept under (kind: _plans.repeat_length_kind of its kv_len)."""
    return (device, scale, page_layout, kind, q.shape, k.shape, v.shape, block_table.shape, q.dtype, k.dtype, v.dtype,
            q.get_device(), k.get_device(), v.get_device(), block_table.get_device())


def torch_repeat_entry(device, scale, page_layout, q, k, v, block_table, kv_len):
    """The (plan, run arguments, host lengths, B, capacity, GPU) a torch call of these arguments
    left on this thread's repeat path, or None (decode_attention's token-major caches reuse it)."""
    table = getattr(_repeat, "table", None)
    kind = _plans.repeat_length_kind(kv_len, _torch_tensor) if _torch_tensor is not None else None
    if table is None or kind is None:
        return None
    return table.get(_torch_key(device, scale, page_layout, kind, q, k, v, block_table))


def _repeat_torch(table, q, k, v, block_table, kv_len, page_layout, device, scale):
    T = _torch_tensor
    if type(k) is not T or type(v) is not T or type(block_table) is not T:
        return None
    kind = _plans.repeat_length_kind(kv_len, T)
    if kind is None:
        return None
    device = _args.device_arg(device)
    entry = table.get(_torch_key(device, scale, page_layout, kind, q, k, v, block_table))
    if entry is None or block_table.dtype != _torch_int32 or not (
            q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and block_table.is_contiguous()):
        return None
    plan, args, host, B, capacity, gpu = entry
    if not _plans.repeat_bind_lengths(args.kv_len, kv_len, kind, host, B, gpu, capacity, _torch_int32):
        return None
    out = q.new_empty(q.shape)
    args.q.address, args.k_pages.address, args.v_pages.address = q.data_ptr(), k.data_ptr(), v.data_ptr()
    args.out.address = out.data_ptr()
    args.block_table.device.address = block_table.data_ptr()
    _plans.run(device, lib.pyfa_paged_decode_run, plan, _plans.encoder(device, cuda_interop.torch_stream_handle(gpu)),
               args)
    return out
