"""Appends into paged KV pools (the layout of ``shaders/common/paged_kv_params.h``):
:func:`paged_kv_append` for dense pools and :func:`paged_quantize` (exported as
``pyfa.turboquant.paged_quantize``) for TurboQuant pools. K and V of a batch
go in with one kernel dispatch.

Pools are written in place: numpy arrays (or torch CPU tensors) on devices
that read host memory (CPU, Metal), torch / cupy CUDA arrays on a cuda
device. Token ``i`` goes to flat slot ``slot_mapping[i] = page * page_size + t``
(vLLM's slot_mapping); a negative slot is padding and writes nothing. Host
slot values are checked: a slot outside the pool, or two tokens naming one
slot, raise :class:`pyfa.PyfaError` before anything is written. A CUDA int32
``slot_mapping`` is read by the kernel on the caller's stream without a sync:
values outside the pool write nothing, and where two tokens name one slot the
row written last is unspecified. With CUDA rows, pass ``slot_mapping`` as a CUDA int32 array
in a steady loop: host values are staged through a pinned buffer on every call.
"""
from __future__ import annotations

import numpy as np

from . import _args, _io, cuda_interop, dtypes, torch_cpu
from . import turboquant as tq
from ._native import lib
from .cuda_interop import GpuArray
from .device import Device
from .errors import check, invalid

LAYOUTS = {"nhd": lib.PYFA_PAGES_NHD, "hnd": lib.PYFA_PAGES_HND}
MAX_PAGE_SIZE = lib.PYFA_MAX_PAGE_SIZE
_ROWS = dtypes.FLOAT_TYPES + (np.dtype(np.float64),)


def layout_arg(page_layout) -> str:
    return _args.page_layout_arg(page_layout)


def pool_shape(layout: str, num_pages: int, page_size: int, num_kv_heads: int, *row) -> tuple:
    """The shape of a pool: ``[num_pages, page_size, Hkv, *row]`` (nhd) or ``[num_pages, Hkv, page_size, *row]``."""
    if layout == "nhd":
        return (num_pages, page_size, num_kv_heads, *row)
    return (num_pages, num_kv_heads, page_size, *row)


def pool_dims(shape: tuple, layout: str):
    """(num_pages, page_size, num_kv_heads) of a pool of ``shape`` in ``layout``."""
    if layout == "nhd":
        return shape[0], shape[1], shape[2]
    return shape[0], shape[2], shape[1]


def _pool(x, name: str, device: Device, allowed, ndim: int):
    """A pool argument written in place: (array, GpuArray or None). Host arrays must be C-contiguous
    and writable (they are wrapped, never copied); GPU arrays need a GPU device."""
    if cuda_interop.is_gpu_array(x):
        contiguous = x.is_contiguous() if torch_cpu.is_tensor(x) else getattr(getattr(x, "flags", None),
                                                                               "c_contiguous", True)
        if not contiguous:  # describe() would copy it, and the append would land in the copy
            raise invalid(f"{name}: must be C-contiguous (the pool is written in place)")
        g = cuda_interop.describe(x, name)
        if device.host_visible:
            raise invalid(f"{name}: a GPU array needs a GPU device; the device is {device.backend!r}")
        if g.device_id != 0:
            raise invalid(f"{name}: on CUDA device {g.device_id}; pyfa's cuda backend runs on device 0")
        a = g
    else:
        if not device.host_visible:
            raise invalid(f"{name}: a host array; on a {device.backend!r} device pools are GPU arrays "
                          "(torch / cupy), written in place")
        a = torch_cpu.as_numpy(x, name, writable=True) if torch_cpu.is_tensor(x) else x
        if not isinstance(a, np.ndarray):
            raise invalid(f"{name}: must be a numpy array, a torch tensor or a GPU array, got {type(x).__name__}")
        if not a.flags.c_contiguous or not a.flags.writeable:
            raise invalid(f"{name}: must be C-contiguous and writable (the pool is written in place)")
    if a.dtype not in allowed:
        raise invalid(f"{name}: dtype {a.dtype} not accepted (expected {', '.join(str(d) for d in allowed)})")
    if len(a.shape) != ndim:
        raise invalid(f"{name}: expected {ndim}-D, got shape {tuple(a.shape)}")
    return a


def _pool_buffer(device: Device, a):
    return _io.to_device(device, a) if isinstance(a, GpuArray) else device.wrap(a)


def _rows(k, v, device: Device, num_kv_heads: int, head_dim: int):
    """(k, v, like): both ``[n >= 1, num_kv_heads, head_dim]`` of one dtype, host or GPU arrays."""
    out = []
    for x, name in ((k, "k"), (v, "v")):
        a = _io.as_array(x, name, allowed=_ROWS, ndims=(3,), gpu=True)
        if isinstance(a, GpuArray):
            _io.gpu_input(device, a, name)
        if a.shape[0] < 1 or tuple(a.shape[1:]) != (num_kv_heads, head_dim):
            raise invalid(f"{name}: expected shape [n >= 1, num_kv_heads={num_kv_heads}, head_dim={head_dim}] "
                          f"(the pool's), got {tuple(a.shape)}")
        out.append(a)
    k, v = out
    like = _io.gpu_like(device, k, v)
    if k.shape[0] != v.shape[0]:
        raise invalid(f"v: {v.shape[0]} tokens, k has {k.shape[0]} (one v row per k row)")
    if k.dtype != v.dtype:
        raise invalid(f"v: dtype {v.dtype} must equal k's ({k.dtype}); one dispatch reads both")
    return k, v, like


def _slots(slot_mapping, n: int, device: Device, like):
    """slot_mapping as a device int32 buffer of ``n`` values: a CUDA int32 array in place (GPU rows
    only), else host ints (int32 range) that the library checks when it records the append."""
    if cuda_interop.is_gpu_array(slot_mapping):
        if like is None:
            raise invalid("slot_mapping: a GPU array needs GPU rows (k, v) on a GPU device")
        g = cuda_interop.describe(slot_mapping, "slot_mapping")
        if g.dtype != np.int32:
            raise invalid(f"slot_mapping: GPU values must be int32, got {g.dtype}")
        if g.ndim != 1 or g.shape[0] != n:
            raise invalid(f"slot_mapping: expected shape [{n}] (one slot per token), got {g.shape}")
        if g.kind != like.kind or g.device_id != like.device_id:
            raise invalid(f"slot_mapping: must come from the rows' framework and GPU ({like.kind} on GPU {like.device_id})")
        return _io.to_device(device, g)
    if torch_cpu.is_tensor(slot_mapping):
        slot_mapping = torch_cpu.as_numpy(slot_mapping, "slot_mapping")
    try:
        s = np.asarray(slot_mapping)
    except Exception:
        raise invalid(f"slot_mapping: expected a 1-D sequence of ints, got {_args.show(slot_mapping)}") from None
    if s.dtype.kind not in "iu" or s.ndim != 1:
        raise invalid(f"slot_mapping: expected a 1-D sequence of ints, got {_args.show(slot_mapping)}")
    if s.shape[0] != n:
        raise invalid(f"slot_mapping: {s.shape[0]} values, expected one per token ({n})")
    if s.size and (int(s.min()) < -_args.I32_MAX - 1 or int(s.max()) > _args.I32_MAX):
        raise invalid("slot_mapping: values must fit int32")
    return _io.to_device(device, np.ascontiguousarray(s, dtype=np.int32))


def paged_kv_append(k, v, k_pages, v_pages, slot_mapping, *, page_layout="nhd", device=None) -> None:
    """Writes rows ``k``, ``v [num_tokens, num_kv_heads, head_dim]`` into the dense pools ``k_pages``,
    ``v_pages`` (``[num_pages, page_size, Hkv, D]`` for ``page_layout="nhd"``,
    ``[num_pages, Hkv, page_size, D]`` for "hnd"; float16/bfloat16/float32, one dtype) at
    ``slot_mapping`` (ints ``[num_tokens]``; negative = padding), in one kv_append_paged dispatch.
    Rows (float16/bfloat16/float32; float64 host rows are rounded once on the host) are rounded to
    the pool dtype to nearest even. With CUDA arrays the work is queued on the rows' stream without
    waiting; otherwise the call waits. Raises PyfaError, writing nothing, on bad input."""
    device = _args.device_arg(device)
    layout = layout_arg(page_layout)
    kp = _pool(k_pages, "k_pages", device, dtypes.FLOAT_TYPES, 4)
    vp = _pool(v_pages, "v_pages", device, dtypes.FLOAT_TYPES, 4)
    if tuple(vp.shape) != tuple(kp.shape) or vp.dtype != kp.dtype:
        raise invalid(f"v_pages: shape {tuple(vp.shape)} {vp.dtype} must equal k_pages' "
                      f"({tuple(kp.shape)} {kp.dtype})")
    num_pages, page_size, num_kv_heads = pool_dims(tuple(kp.shape), layout)
    head_dim = kp.shape[3]
    k, v, like = _rows(k, v, device, num_kv_heads, head_dim)
    if like is None and k.dtype == np.float64:  # rounds once, straight to the pool dtype
        k, v = k.astype(kp.dtype), v.astype(kp.dtype)
    n = k.shape[0]
    slots = _slots(slot_mapping, n, device, like)
    params = _args.params("pyfa_kv_append_paged_params *", {
        "pages": {"page_size": page_size, "num_pages": num_pages, "layout": LAYOUTS[layout]},
        "num_tokens": n, "num_kv_heads": num_kv_heads, "head_dim": head_dim})
    buffers = [_io.to_device(device, k), _io.to_device(device, v), _pool_buffer(device, kp), _pool_buffer(device, vp), slots]
    enc = _io.encoder(device, like)
    check(lib.pyfa_kv_append_paged(enc, params, *(b.handle for b in buffers)))
    _io.submit(enc, like)


def paged_quantize(k, v, k_codes, k_scales, v_codes, v_scales, slot_mapping, *, k_bits, v_bits, seed=0,
                   norm_correction=tq.DEFAULT_NORM_CORRECTION, page_layout="nhd", device=None) -> None:
    """Encodes rows ``k``, ``v [num_tokens, num_kv_heads, head_dim]`` into TurboQuant pools at
    ``slot_mapping`` in one tq_quantize_paged dispatch, with the codec of
    :class:`pyfa.TurboQuantKVCache` (the stored codes and scales are the bytes its append stores
    for the same row, seed and norm_correction; K with the K stream and ``k_bits``, V with the V
    stream and ``v_bits``). Pools (``page_layout="nhd"``): ``k_codes`` uint8
    ``[num_pages, page_size, Hkv, head_dim*k_bits/8]``, ``k_scales`` float32
    ``[num_pages, page_size, Hkv]`` (``v_*`` with ``v_bits``); "hnd" swaps page_size and Hkv.
    ``norm_correction`` as :class:`pyfa.TurboQuantKVCache`'s. Written in place as
    :func:`pyfa.paged_kv_append` writes."""
    device = _args.device_arg(device)
    layout = layout_arg(page_layout)
    k_bits, v_bits = tq._bit_width(k_bits, "k_bits"), tq._bit_width(v_bits, "v_bits")
    seed = tq._check_seed(seed)
    mode = tq.norm_mode(norm_correction)
    u8, f32 = (np.dtype(np.uint8),), (np.dtype(np.float32),)
    kc, vc = _pool(k_codes, "k_codes", device, u8, 4), _pool(v_codes, "v_codes", device, u8, 4)
    ks, vs = _pool(k_scales, "k_scales", device, f32, 3), _pool(v_scales, "v_scales", device, f32, 3)
    num_pages, page_size, num_kv_heads = pool_dims(tuple(kc.shape), layout)
    k_rows = _io.as_array(k, "k", allowed=_ROWS, ndims=(3,), gpu=True)
    head_dim = tq._check_head_dim(k_rows.shape[2])
    geometry = (num_pages, page_size, num_kv_heads)
    for name, a, want in (("k_codes", kc, pool_shape(layout, *geometry, tq.row_bytes(head_dim, k_bits))),
                          ("v_codes", vc, pool_shape(layout, *geometry, tq.row_bytes(head_dim, v_bits))),
                          ("k_scales", ks, pool_shape(layout, *geometry)),
                          ("v_scales", vs, pool_shape(layout, *geometry))):
        if tuple(a.shape) != want:
            raise invalid(f"{name}: expected shape {list(want)} ({layout} pool of {num_pages} pages x {page_size} "
                          f"tokens x {num_kv_heads} KV heads at head_dim={head_dim}), got {list(a.shape)}")
    k, v, like = _rows(k_rows, v, device, num_kv_heads, head_dim)
    if like is None and k.dtype == np.float64:  # the encoder reads f32 / f16 / bf16
        k, v = k.astype(np.float32), v.astype(np.float32)
    n = k.shape[0]
    slots = _slots(slot_mapping, n, device, like)
    params = _args.params("pyfa_tq_quantize_paged_params *", {
        "pages": {"page_size": page_size, "num_pages": num_pages, "layout": LAYOUTS[layout]},
        "num_tokens": n, "num_kv_heads": num_kv_heads, "head_dim": head_dim, "k_bits": k_bits, "v_bits": v_bits,
        "norm_correction": mode, "seed_lo": seed & 0xFFFFFFFF, "seed_hi": seed >> 32})
    buffers = [_io.to_device(device, k), _io.to_device(device, v)] + [_pool_buffer(device, a) for a in (kc, ks, vc, vs)] + [slots]
    enc = _io.encoder(device, like)
    check(lib.pyfa_tq_quantize_paged(enc, params, *(b.handle for b in buffers)))
    _io.submit(enc, like)
