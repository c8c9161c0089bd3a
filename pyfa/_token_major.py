"""Dense caches in flash-attn's token-major layout, decoded where they are.

``flash_attn_with_kvcache`` keeps a cache as ``[B, capacity, H_kv, D]``; passed to
:func:`pyfa.decode_attention` as ``k_cache.transpose(1, 2)`` it has the head-major shape
``[B, H_kv, capacity, D]`` with token-major strides. Those bytes are a paged pool in the NHD
layout (``[num_pages, page_size, H_kv, D]``) whose pages each hold ``page_size`` consecutive
slots of one sequence: page ``i`` of sequence ``b`` is pool page ``b * pages_per_seq + i``.
decode_attention reads such a cache in place through the paged decode with that fixed block
table (:func:`pools`, :func:`decode`), and repeats a torch CUDA call as its other repeat paths do
(:func:`repeat`).

``page_size`` is the largest power of two that divides ``capacity``, at most the paged kernels'
largest page. The block tables are prefixes of one ``arange`` per framework and GPU (``_table``),
never written after they are made, so a CUDA graph that captured a call may read one later.
"""
from __future__ import annotations

import threading

import numpy as np

from . import _args, _plans, cuda_interop, dtypes, paged
from ._native import ffi, lib
from .errors import PyfaError

_MAX_PAGE_SIZE = lib.PYFA_MAX_PAGE_SIZE
_bases: dict = {}  # (framework, GPU) or ("host", -1) -> the longest int32 arange made there
_kept: list = []  # every base made: a captured graph may read any of them
_tables_lock = threading.Lock()
_head_dims: frozenset | None = None


class Pools:
    """What decode_attention passes to the paged decode for a token-major cache: the pools
    ``[B * pages_per_seq, page_size, H_kv, D]`` (views of the caches' memory), the block
    table, and q (and out) with a leading batch axis where the call was for one sequence."""

    __slots__ = ("q", "k", "v", "table", "out", "single", "k_cache", "v_cache")

    def __init__(self, q, k, v, table, out, single, k_cache, v_cache):
        self.q, self.k, self.v, self.table, self.out, self.single = q, k, v, table, out, single
        self.k_cache, self.v_cache = k_cache, v_cache  # the caller's views


def _kind(x) -> str | None:
    """"numpy", "torch" (CPU or CUDA) or "cupy" for the arrays this path reads, else None."""
    t = type(x)
    if t is np.ndarray:
        return "numpy"
    if t.__name__ == "Tensor" and t.__module__ == "torch":
        return "torch"
    if t.__module__.startswith("cupy") and t.__name__ == "ndarray":
        return "cupy"
    return None


def _element_strides(x, kind: str):
    if kind == "torch":
        return tuple(x.stride())
    size = x.dtype.itemsize
    if any(s % size for s in x.strides):
        return None
    return tuple(s // size for s in x.strides)


def _token_major(x, kind: str, shape) -> bool:
    """Whether ``x`` (of head-major ``shape``, 3-D or 4-D) has the strides of a transposed
    C-contiguous ``[(B,) capacity, H_kv, D]`` array."""
    strides = _element_strides(x, kind)
    if strides is None:
        return False
    Hkv, capacity, D = shape[-3:]
    want = (D, Hkv * D, 1)
    if strides[-3:] != want:
        return False
    return len(shape) == 3 or shape[0] == 1 or strides[0] == capacity * Hkv * D


def _lengths_in_range(kv_len, batch: int, capacity: int) -> bool:
    """Whether a host kv_len holds ``batch`` values in decode_attention's range 1..capacity (the
    paged decode also takes 0: such calls, and malformed ones, take the dense path, which words
    their errors). GPU values pass: the paged path checks their dtype and size, and the kernels
    clamp them as the dense ones do."""
    if type(kv_len) is int:
        return 1 <= kv_len <= capacity
    if cuda_interop.is_gpu_array(kv_len):
        return True
    try:
        values = _args.index_array(kv_len, "kv_len", batch, -_args.I32_MAX, _args.I32_MAX)
    except PyfaError:
        return False
    return bool(values.size == batch and (values >= 1).all() and (values <= capacity).all())


def _capturing(kind: str, device) -> bool:
    """Whether a CUDA graph is capturing the current stream of ``device`` (torch or cupy)."""
    if kind == "torch":
        import torch

        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()
    import cupy

    with cupy.cuda.Device(device):
        return cupy.cuda.get_current_stream().is_capturing()


def _table(kind: str, like, batch: int, pages_per_seq: int):
    """The block table ``[batch, pages_per_seq]`` int32 (entry ``[b, i]`` = ``b * pages_per_seq
    + i``) where the pools are: numpy for host arrays (torch CPU tensors included), else on the
    GPU of ``like``. Every table is a prefix of one ``arange`` per place, made by an eager call
    and replaced by one twice as long when a longer table is asked for (the shorter ones stay
    alive: a captured graph may read them). None where none can be made now: a graph is
    capturing the stream of the call that would make it (that call copies the caches)."""
    gpu = kind == "cupy" or (kind == "torch" and like.is_cuda)
    place = (kind, like.get_device() if kind == "torch" else like.device.id) if gpu else ("host", -1)
    n = batch * pages_per_seq
    base = _bases.get(place)
    if base is None or len(base) < n:
        size = max(n, 2 * len(base)) if base is not None else n
        if not gpu:
            base = np.arange(size, dtype=np.int32)
            base.flags.writeable = False
        elif _capturing(kind, place[1]):
            return None
        elif kind == "torch":
            import torch

            with torch.cuda.device(place[1]):
                base = torch.arange(size, dtype=torch.int32, device=like.device)
                # Written on this stream; later calls may come on others: the one wait of a base's life.
                torch.cuda.current_stream().synchronize()
        else:
            import cupy

            with cupy.cuda.Device(place[1]):
                base = cupy.arange(size, dtype=cupy.int32)
                cupy.cuda.get_current_stream().synchronize()
        with _tables_lock:
            _kept.append(base)
            if len(_bases.get(place, ())) < size:
                _bases[place] = base
            base = _bases[place]
    table = base[:n]
    return table.view(batch, pages_per_seq) if kind == "torch" and gpu else table.reshape(batch, pages_per_seq)


def pools(q, k_cache, v_cache, kv_len, ring_start, out):
    """:class:`Pools` for a decode_attention call whose caches are token-major views that the
    paged decode reads as they are, or None (the call takes the dense path, copying them).
    Taken: q, k_cache and v_cache numpy arrays, torch tensors or cupy arrays of one kind,
    k_cache and v_cache of one float dtype and shape ``[B, H_kv, capacity, D]`` (``[H_kv,
    capacity, D]`` with a 2-D q) with token-major strides, ``H_kv > 1``, a head dim the kernels
    take, ``ring_start`` 0 (a paged sequence is not a ring), a host kv_len in ``1..capacity``."""
    global _head_dims
    kind = _kind(k_cache)
    if kind is None or _kind(v_cache) != kind or _kind(q) != kind:
        return None
    if k_cache.is_contiguous() if kind == "torch" else k_cache.flags.c_contiguous:
        return None
    if not (type(ring_start) is int and ring_start == 0):
        return None
    qs, shape = tuple(q.shape), tuple(k_cache.shape)
    if len(qs) not in (2, 3) or len(shape) != len(qs) + 1 or tuple(v_cache.shape) != shape:
        return None
    dtype = cuda_interop.numpy_dtype(k_cache.dtype) if kind == "torch" else k_cache.dtype
    if k_cache.dtype != v_cache.dtype or dtype not in dtypes.FLOAT_TYPES:
        return None
    Hkv, capacity, D = shape[-3:]
    B = shape[0] if len(shape) == 4 else 1
    if Hkv < 2 or qs[-1] != D or qs[-2] % Hkv or (len(qs) == 3 and qs[0] != B):
        return None
    if _head_dims is None:
        from .device import supported

        _head_dims = frozenset(supported("head_dims"))
    if D not in _head_dims or capacity < 1 or B * capacity * Hkv > 0xFFFFFFFF:
        return None
    if not (_token_major(k_cache, kind, shape) and _token_major(v_cache, kind, shape)):
        return None
    if kind != "numpy" and (k_cache.device != v_cache.device or q.device != k_cache.device):
        return None
    if not _lengths_in_range(kv_len, B, capacity):
        return None
    page_size = min(capacity & -capacity, _MAX_PAGE_SIZE)
    pages_per_seq = capacity // page_size
    table = _table(kind, k_cache, B, pages_per_seq)
    if table is None:
        return None
    single = len(qs) == 2
    if single and out is not None and _kind(out) is None:
        return None
    pool_shape = (B * pages_per_seq, page_size, Hkv, D)
    k, v = (c[None] if single else c for c in (k_cache, v_cache))
    k, v = (c.swapaxes(1, 2).reshape(pool_shape) for c in (k, v))  # views: token-major memory is contiguous
    return Pools(q[None] if single else q, k, v, table, out[None] if single and out is not None else out, single,
                 k_cache, v_cache)


def decode(pools: Pools, kv_len, scale, softcap, window, device, out, out_dtype, return_lse, remember=False):
    """decode_attention's result for a call :func:`pools` took: the paged decode over the pools.
    ``remember``: the call used the repeat path's defaults (a torch CUDA call is then kept for
    :func:`repeat`)."""
    res = paged.paged_decode_attention(pools.q, pools.k, pools.v, pools.table, kv_len, page_layout="nhd", scale=scale,
                                       softcap=softcap, window=window, device=device, out=pools.out,
                                       out_dtype=out_dtype, return_lse=return_lse)
    if remember and not pools.single and _torch_cuda(pools.q):
        _remember(pools, kv_len, _args.device_arg(device), scale)
    result, lse = res if return_lse else (res, None)
    if pools.single:
        result, lse = result[0], (None if lse is None else lse[0])
    if out is not None:
        result = out
    return (result, lse) if return_lse else result


# ---- the repeat path ---------------------------------------------------------------------------------
# A decode loop over token-major torch CUDA caches calls with the same shapes and defaults every step.
# After such a call went through every check, a copy of the run struct the paged repeat path kept is
# bound to the call's block table and kept (per thread) under the caches' shapes and strides, the
# device, the scale as given and how kv_len came; a matching call sets the four addresses and runs,
# without building the pool views. (A copy: the paged repeat path points its own struct at its
# callers' tables.)
_repeat = threading.local()
_torch_tensor = None
_torch_int32 = None


def _torch_cuda(x) -> bool:
    global _torch_tensor, _torch_int32
    if _torch_tensor is None:
        if type(x).__name__ != "Tensor":
            return False
        import torch

        _torch_tensor, _torch_int32 = torch.Tensor, torch.int32
    return type(x) is _torch_tensor and x.is_cuda


def _remember(pools: Pools, kv_len, device, scale) -> None:
    entry = paged.torch_repeat_entry(device, scale, "nhd", pools.q, pools.k, pools.v, pools.table, kv_len)
    if entry is None:
        return
    plan, kept, host, B, capacity, gpu = entry
    args = ffi.new("pyfa_paged_decode_run_args *", kept[0])
    host = ffi.new("int32_t[]", B) if host is not None else None
    args.kv_len.host = host if host is not None else ffi.NULL
    args.block_table.device.address = pools.table.data_ptr()
    key = _key(device, scale, _plans.repeat_length_kind(kv_len, _torch_tensor), pools.q, pools.k_cache, pools.v_cache)
    _plans.repeat_table(_repeat)[key] = (plan, args, host, B, capacity, gpu, pools.table)


def _key(device, scale, kind, q, k, v):
    """What a torch call over token-major caches is kept under: the caches' shape and strides."""
    return (device, scale, kind, k.shape, k.stride(), v.stride(), q.shape, q.dtype, k.dtype, v.dtype, q.get_device(),
            k.get_device(), v.get_device())


def repeat(q, k, v, kv_len, device, scale):
    """The result of a torch CUDA call over token-major caches matching a remembered one, or None
    (take the full path)."""
    table = getattr(_repeat, "table", None)
    T = _torch_tensor
    if table is None or type(q) is not T or type(k) is not T or type(v) is not T:
        return None
    kind = _plans.repeat_length_kind(kv_len, T)
    if kind is None:
        return None
    device = _args.device_arg(device)
    entry = table.get(_key(device, scale, kind, q, k, v))
    if entry is None or v.shape != k.shape or not q.is_contiguous():
        return None
    plan, args, host, B, capacity, gpu, _table = entry
    if not _plans.repeat_bind_lengths(args.kv_len, kv_len, kind, host, B, gpu, capacity, _torch_int32):
        return None
    out = q.new_empty(q.shape)
    args.q.address, args.k_pages.address, args.v_pages.address = q.data_ptr(), k.data_ptr(), v.data_ptr()
    args.out.address = out.data_ptr()
    _plans.run(device, lib.pyfa_paged_decode_run, plan, _plans.encoder(device, cuda_interop.torch_stream_handle(gpu)),
               args)
    return out
