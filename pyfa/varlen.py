"""Prefill over packed sequences: variable-length (flash-attn's
``flash_attn_varlen_func``) and against a paged KV cache (chunked prefill,
speculative decoding). Both run flash_attn_prefill in one dispatch for the
whole batch, without padding; contract in shaders/common/flash_attn_prefill_params.h
("Packed sequences") and paged_kv_params.h."""
from __future__ import annotations

import numpy as np

from . import _args, _io, cuda_interop
from ._native import ffi, lib
from .device import Device
from .errors import check, invalid
from .prefill import _out_dtype

_I32_MAX = _args.I32_MAX


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                     window=None, softcap=0.0, scale=None, device: Device | None = None, out=None, out_dtype=None,
                     return_lse=False):
    """Attention of packed variable-length sequences (flash-attn's ``flash_attn_varlen_func``).

    Parameters
    ----------
    q : array ``[total_q, H, D]``: the query rows of every sequence, one after another;
        float32 / float16 / bfloat16, ``D`` in {64, 80, 96, 128, 192, 256, 512}.
    k, v : arrays ``[total_k, H_kv, D]``, q's dtype, packed the same way; ``H % H_kv == 0``
        (GQA: head ``h`` reads KV head ``h // (H // H_kv)``).
    cu_seqlens_q, cu_seqlens_k : int32 ``[batch + 1]``: sequence ``b`` owns q rows
        ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and k / v rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``.
        Host values must start at 0, never decrease and end at ``total_q`` / ``total_k``, and each
        sequence needs ``q_len_b <= kv_len_b`` (a query row cannot sit before position 0); a sequence
        may have no rows. With GPU inputs they may be GPU int32 arrays (then ``max_seqlen_q`` and
        ``max_seqlen_k`` are required, and the kernels clamp the values instead of checking them).
    max_seqlen_q, max_seqlen_k : the longest sequence's rows / keys (default: from the host values).
        The launch tiles every sequence as the longest: its query tiles times the heads times the
        sequences must be at most 2^32 - 1 (PyfaError naming max_seqlen_q otherwise).
    causal : bottom-right per sequence, as flash-attn's varlen: query row ``i`` of sequence ``b`` sits at
        position ``kv_len_b - q_len_b + i`` and sees keys ``j <= kv_len_b - q_len_b + i``.
    window : None or a positive int: a query at position ``p`` sees keys with ``p - j < window``
        (as :func:`pyfa.attention`).
    softcap : ``> 0`` applies ``softcap * tanh(s / softcap)`` to the scores.
    scale : multiplies ``q·k`` (default ``1/sqrt(D)``).
    out : optional array ``[total_q, H, D]`` of the output dtype to write into; it is returned.
        q, k, v and out may be views (rows of a fused QKV projection's output, say) under
        :func:`pyfa.attention`'s rule for views; other arrays are copied (an out must follow it).
    out_dtype : None (q's dtype) or float32.
    return_lse : also return the float32 LSE ``[H, total_q]`` (flash-attn's varlen layout; ``-inf``
        for a row with no visible key). Two calls over disjoint keys of the same queries (a shared
        prefix and the rest, say) merge with ``pyfa.merge_attention_states(o_a[None], lse_a[None],
        o_b[None], lse_b[None], layout="bshd")``: ``[1, total_q, H, D]`` and ``[1, H, total_q]``.

    Masks are not accepted: packed rows have no ``[q_len, kv_len]`` mask plane.

    Returns
    -------
    array ``[total_q, H, D]`` (rows with no visible key are zeros), or ``(out, lse)``; numpy, or the
    inputs' framework's arrays.

    >>> import numpy as np, pyfa
    >>> q = np.ones((7, 2, 64), np.float32)          # sequences of 3 and 4 rows
    >>> cu = np.array([0, 3, 7], np.int32)
    >>> pyfa.varlen_attention(q, q, q, cu, cu, causal=True).shape
    (7, 2, 64)
    """
    device = _args.device_arg(device)
    q_arg, out_arg = q, out
    (q, k, v), views, like = _io.row_operands(device, (("q", q), ("k", k), ("v", v)), ndim=3)
    _same_dtype(q, k, v, "k", "v")
    if tuple(v.shape) != tuple(k.shape):
        raise invalid(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
    total_q, H, D = q.shape
    total_k, Hkv, Dk = k.shape
    if Dk != D:
        raise invalid(f"k: head_dim {Dk} differs from q's head_dim {D}")
    _rows(total_q, "q", "total_q")
    _rows(total_k, "k", "total_k")
    cu_q, cu_q_host = _metadata(device, cu_seqlens_q, "cu_seqlens_q", None, like)
    batch = cu_q_host.size - 1 if cu_q_host is not None else _gpu_len(cu_seqlens_q) - 1
    cu_k, cu_k_host = _metadata(device, cu_seqlens_k, "cu_seqlens_k", (batch + 1,), like)
    max_q = _longest(max_seqlen_q, "max_seqlen_q", cu_q_host, "cu_seqlens_q")
    max_k = _longest(max_seqlen_k, "max_seqlen_k", cu_k_host, "cu_seqlens_k")
    fields = _fields(batch, H, Hkv, D, max_q, max_k, causal, window, softcap, scale)
    fields.update(q_strides=_packed_strides(views[0]), k_strides=_packed_strides(views[1]),
                  v_strides=_packed_strides(views[2]))
    packed = ffi.new("pyfa_prefill_packed *", {"total_q": total_q, "total_k": total_k})

    def call(enc, params, bufs, out_buf, lse_buf):
        q_buf, k_buf, v_buf = bufs
        return lib.pyfa_flash_attn_prefill_varlen(enc, params, packed, q_buf.handle, k_buf.handle, v_buf.handle,
                                                  cu_q.handle, cu_k.handle, out_buf.handle, _io.handle(lse_buf))

    return _run(device, like, fields, (q, k, v), call, q_arg, out, out_arg, out_dtype, return_lse)


def paged_attention(q, k_pages, v_pages, block_table, cu_seqlens_q, kv_len, *, page_layout="nhd", max_seqlen_q=None,
                    causal=True, window=None, softcap=0.0, scale=None, device: Device | None = None, out=None,
                    out_dtype=None, return_lse=False):
    """Attention of packed new query rows against a paged KV cache (chunked prefill, speculative decoding;
    flash-attn's varlen call with ``block_table`` and ``seqused_k``).

    Parameters
    ----------
    q : array ``[total_q, H, D]``: the new rows of every sequence, packed by ``cu_seqlens_q``;
        float32 / float16 / bfloat16, ``D`` in {64, 80, 96, 128, 192, 256, 512}.
    k_pages, v_pages : the K and V pools, q's dtype: ``[num_pages, page_size, H_kv, D]``
        (``page_layout="nhd"``: flash-attn's / vLLM's paged cache) or ``[num_pages, H_kv, page_size, D]``
        ("hnd"); ``page_size`` a power of two up to 1024.
    block_table : int32 ``[batch, pages_per_seq]``: entry ``i`` of sequence ``b`` is the pool page of its
        positions ``[i * page_size, (i + 1) * page_size)``.
    cu_seqlens_q : int32 ``[batch + 1]``, as :func:`pyfa.varlen_attention`'s.
    kv_len : int32 ``[batch]``: the positions sequence ``b`` holds, its new rows included (append them to
        the pools before the call); at most ``pages_per_seq * page_size``, and ``q_len_b <= kv_len_b``.
        Host values are checked, as are the block_table entries each sequence uses; with GPU inputs
        the metadata may be GPU int32 arrays (then ``max_seqlen_q`` is required; the kernels clamp
        device values: an entry outside the pool reads the last page).
    page_layout : "nhd" or "hnd".
    max_seqlen_q : the longest sequence's new rows (default: from the host values); as in
        varlen_attention, its query tiles times the heads times the sequences must be at most
        2^32 - 1.
    causal : query row ``i`` of sequence ``b`` sits at position ``kv_len_b - q_len_b + i`` (default True).
    window, softcap, scale, out, out_dtype : as :func:`pyfa.varlen_attention`.
    return_lse : also return the float32 LSE ``[H, total_q]``.

    Returns
    -------
    array ``[total_q, H, D]``, or ``(out, lse)``.

    >>> import numpy as np, pyfa
    >>> pool = np.ones((4, 16, 2, 64), np.float32)   # 4 pages of 16 tokens, 2 KV heads
    >>> q = np.ones((5, 4, 64), np.float32)          # 5 new rows of one sequence
    >>> pyfa.paged_attention(q, pool, pool, [[2, 0]], [0, 5], [20]).shape
    (5, 4, 64)
    """
    device = _args.device_arg(device)
    q_arg, out_arg = q, out
    page_layout = _args.page_layout_arg(page_layout)
    (q,), (q_view,), _ = _io.row_operands(device, (("q", q),), ndim=3)
    k_pages = _io.as_array(k_pages, "k_pages", ndims=(4,), gpu=True)
    v_pages = _io.as_array(v_pages, "v_pages", ndims=(4,), gpu=True)
    like = _io.gpu_like(device, q, k_pages, v_pages)
    _same_dtype(q, k_pages, v_pages, "k_pages", "v_pages")
    if tuple(v_pages.shape) != tuple(k_pages.shape):
        raise invalid(f"v_pages: shape {tuple(v_pages.shape)} differs from k_pages's {tuple(k_pages.shape)}")
    total_q, H, D = q.shape
    if page_layout == "nhd":
        num_pages, page_size, Hkv, Dk = k_pages.shape
    else:
        num_pages, Hkv, page_size, Dk = k_pages.shape
    if Dk != D:
        raise invalid(f"k_pages: head_dim {Dk} differs from q's head_dim {D}")
    _rows(total_q, "q", "total_q")
    _args.u32_fields(num_pages=num_pages, page_size=page_size)
    table, table_host = _metadata(device, block_table, "block_table", None, like, ndim=2)
    batch, pages_per_seq = table_host.shape if table_host is not None else _gpu_shape(block_table, 2)
    cu_q, cu_q_host = _metadata(device, cu_seqlens_q, "cu_seqlens_q", (batch + 1,), like)
    lens, lens_host = _metadata(device, kv_len, "kv_len", (batch,), like)
    max_q = _longest(max_seqlen_q, "max_seqlen_q", cu_q_host, "cu_seqlens_q")
    # The longest kv_len: from the host values, else the most a sequence's pages hold.
    # (capped there, so a kv_len beyond its pages is refused by name, per sequence).
    cap = pages_per_seq * page_size
    max_k = min(max(1, int(lens_host.max())), cap) if lens_host is not None and lens_host.size else cap
    fields = _fields(batch, H, Hkv, D, max_q, max_k, causal, window, softcap, scale)
    fields.update(q_strides=_packed_strides(q_view), k_strides=[0, 0, D],
                  v_strides=[0, 0, D])  # k, v: not read (pool rows are contiguous)
    packed = ffi.new("pyfa_prefill_packed *", {"total_q": total_q})
    pages = _args.params("pyfa_kv_pages *", {
        "page_size": page_size, "num_pages": num_pages, "pages_per_seq": pages_per_seq,
        "layout": lib.PYFA_PAGES_NHD if page_layout == "nhd" else lib.PYFA_PAGES_HND})

    def call(enc, params, bufs, out_buf, lse_buf):
        q_buf, k_buf, v_buf = bufs
        return lib.pyfa_flash_attn_prefill_paged(enc, params, packed, pages, q_buf.handle, k_buf.handle, v_buf.handle,
                                                 cu_q.handle, lens.handle, table.handle, out_buf.handle,
                                                 _io.handle(lse_buf))

    return _run(device, like, fields, (q, k_pages, v_pages), call, q_arg, out, out_arg,
                out_dtype, return_lse)


def _same_dtype(q, k, v, k_name, v_name):
    for name, a in ((k_name, k), (v_name, v)):
        if a.dtype != q.dtype:
            raise invalid(f"{name}: dtype {a.dtype} differs from q's {q.dtype} (k and v must have q's dtype)")


def _rows(n, name, what):
    if n == 0:
        raise invalid(f"{name}: no rows ({what} must be > 0)")
    if n > _I32_MAX:
        raise invalid(f"{name}: {n} rows, more than {_I32_MAX} ({what})")


def _gpu_shape(value, ndim):
    g = cuda_interop.describe(value, "metadata")
    return tuple(g.shape) if len(g.shape) == ndim else (0,) * ndim


def _gpu_len(value):
    return _gpu_shape(value, 1)[0]


def _metadata(device, value, name, shape, like, ndim=1):
    """(buffer, host int32 values or None) of an int32 metadata array.

    Host values are checked by the library: on a device that reads host memory
    they are used in place, on a GPU they go into a shared buffer (which the
    library can still read). GPU int32 arrays (with GPU inputs) are used in place."""
    if cuda_interop.is_gpu_array(value):
        if like is None:
            raise invalid(f"{name}: a GPU array needs GPU q, k and v on a GPU device")
        g = cuda_interop.describe(value, name)
        if g.dtype != np.int32:
            raise invalid(f"{name}: GPU values must be int32, got {g.dtype}")
        if g.kind != like.kind or g.device_id != like.device_id:
            raise invalid(f"{name}: must come from the inputs' framework and GPU ({like.kind} on GPU {like.device_id})")
        if len(g.shape) != ndim or shape is not None and tuple(g.shape) != shape:
            raise invalid(f"{name}: expected shape {shape if shape is not None else f'{ndim}-D'}, got {tuple(g.shape)}")
        return device.wrap_device(g.ptr, g.nbytes, g.dtype, g.shape, keepalive=g.obj), None
    try:
        a = np.asarray(value)
    except Exception:
        raise invalid(f"{name}: expected an int32 array, got {_args.show(value)}") from None
    if a.dtype.kind not in "iu" or a.ndim != ndim:
        raise invalid(f"{name}: expected a {ndim}-D array of ints, got {_args.show(value)}")
    if shape is not None and a.shape != shape:
        raise invalid(f"{name}: expected shape {shape}, got {a.shape}")
    if ndim == 1 and name.startswith("cu_seqlens") and a.shape[0] < 2:
        raise invalid(f"{name}: needs batch + 1 >= 2 values, got {a.shape[0]}")
    if ndim == 2 and (a.shape[0] == 0 or a.shape[1] == 0):
        raise invalid(f"{name}: expected shape [batch >= 1, pages_per_seq >= 1], got {a.shape}")
    if a.size and (a.min() < -_I32_MAX - 1 or a.max() > _I32_MAX):
        raise invalid(f"{name}: values must fit int32")
    a = np.ascontiguousarray(a, dtype=np.int32)
    if device.host_visible:
        return device.wrap(a), a
    b = device.buffer(a.shape, np.int32, storage="shared")
    b.numpy()[...] = a
    return b, a


def _longest(value, name, cu_host, cu_name):
    """max_seqlen_*: the given value (>= 1), or the longest sequence of host cu_seqlens."""
    if value is not None:
        return _args.int_arg(value, name, 1, _I32_MAX)
    if cu_host is None:
        raise invalid(f"{name}: required when {cu_name} is a GPU array (its values are not read on the host)")
    return max(1, int(np.diff(cu_host.astype(np.int64)).max()))


def _fields(batch, H, Hkv, D, max_q, max_k, causal, window, softcap, scale):
    _args.u32_fields(batch=batch, num_heads=H, num_kv_heads=Hkv, head_dim=D)
    window = _args.optional_int(window, "window", 1, _I32_MAX)
    return {
        "batch": batch, "num_heads": H, "num_kv_heads": Hkv, "head_dim": D, "q_len": max_q, "kv_len": max_k,
        "q_offset": 0, "window": window or 0, "scale": _args.default_scale(scale, D),
        "softcap": _args.float_arg(softcap, "softcap"), "causal": int(_args.bool_arg(causal, "causal")),
    }


def _packed_strides(view) -> list[int]:
    """The params' (batch, head, row) element strides of a packed [rows, heads, D] array with
    element strides ``view`` (the batch stride is not read)."""
    return [0, view[1], view[0]]


def _run(device, like, fields, inputs, call, q_arg, out, out_arg, out_dtype, return_lse):
    q = inputs[0]
    return_lse = _args.bool_arg(return_lse, "return_lse")
    out_dtype = _out_dtype(out_dtype, q.dtype, "q")
    total_q, H = q.shape[0], q.shape[1]
    result, out_buf, out_view, fill_after = _io.output_rows(device, tuple(q.shape), out_dtype, out, like=like)
    params = _args.params("pyfa_flash_attn_prefill_params *", dict(fields, out_strides=_packed_strides(out_view)))
    lse, lse_buf = _io.output(device, (H, total_q), np.float32, None, "lse", like=like) if return_lse else (None, None)
    bufs = [_io.to_device(device, a, like) for a in inputs]
    enc = _io.encoder(device, like)
    check(call(enc, params, bufs, out_buf, lse_buf))
    _io.submit(enc, like)
    result = _io.finish_rows(device, result, out_buf, fill_after)
    result = _io.host_result(result, q_arg, out_arg)
    if return_lse:
        _io.finish(device, lse, lse_buf)
        return result, _io.host_result(lse, q_arg)
    return result
