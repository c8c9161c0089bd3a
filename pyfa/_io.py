"""Turning user arrays into buffers for a device, and results back into arrays.

On host-visible devices (the CPU backend) C-contiguous numpy arrays are used
in place; anything else (non-contiguous, other array types) is copied into a
contiguous array first. Device-resident inputs are the GPU backends' business
(see pyfa/cuda_interop.py).
"""
from __future__ import annotations

import numpy as np

from . import dtypes
from ._native import ffi
from .device import Buffer, Device
from .errors import invalid


def as_array(x, name: str, allowed=dtypes.FLOAT_TYPES, ndims=None) -> np.ndarray:
    """A C-contiguous numpy array of an allowed dtype (copying only if needed)."""
    try:
        a = np.asarray(x)
    except Exception as e:  # objects numpy cannot read
        raise invalid(f"{name}: cannot be read as an array ({e})") from None
    if a.dtype not in allowed:
        raise invalid(f"{name}: dtype {a.dtype} not accepted (expected {', '.join(str(d) for d in allowed)})")
    if ndims is not None and a.ndim not in ndims:
        raise invalid(f"{name}: expected {' or '.join(f'{n}-D' for n in ndims)}, got shape {a.shape}")
    return np.ascontiguousarray(a)


def to_device(device: Device, a: np.ndarray) -> Buffer:
    """A buffer holding `a`: wrapped in place on host-visible devices, copied otherwise."""
    if device.host_visible:
        return device.wrap(a)
    b = device.buffer(a.shape, a.dtype, storage="private")
    b.write(a)
    return b


def output(device: Device, shape, dtype, out, name: str = "out"):
    """(array, buffer) for a result: `out` if given (checked), else a new array."""
    dtype = np.dtype(dtype)
    if out is None:
        a = np.empty(shape, dtype=dtype)
    else:
        if not isinstance(out, np.ndarray):
            raise invalid(f"{name}: must be a numpy array")
        if out.shape != tuple(shape) or out.dtype != dtype:
            raise invalid(f"{name}: expected shape {tuple(shape)} and dtype {dtype}, got {out.shape} {out.dtype}")
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise invalid(f"{name}: must be C-contiguous and writable")
        a = out
    if device.host_visible:
        return a, device.wrap(a)
    return a, device.buffer(a.shape, a.dtype, storage="private")


def finish(device: Device, a: np.ndarray, buffer: Buffer) -> np.ndarray:
    """Copies a device result into `a` where the device is not host-visible."""
    if not device.host_visible:
        a[...] = buffer.read()
    return a


def index_array(value, name: str, batch: int, lo: int, hi: int) -> np.ndarray:
    """An int32 [batch] array from an int or a sequence, each in [lo, hi]."""
    v = np.asarray(value)
    if v.dtype.kind not in "iu" or v.ndim > 1:
        raise invalid(f"{name}: expected an int or a 1-D sequence of ints, got {value!r}")
    v = np.broadcast_to(v.astype(np.int64), (batch,)) if v.ndim == 0 else v.astype(np.int64)
    if v.shape != (batch,):
        raise invalid(f"{name}: expected {batch} values (one per sequence), got {v.shape[0]}")
    bad = (v < lo) | (v > hi)
    if bad.any():
        i = int(np.argmax(bad))
        raise invalid(f"{name}[{i}]: {int(v[i])} must be in {lo}..{hi}")
    return np.ascontiguousarray(v.astype(np.int32))


def int_arg(value, name: str, lo: int, hi: int) -> int:
    """A Python int in [lo, hi] (bools and non-integers are rejected)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise invalid(f"{name}: expected an int, got {value!r}")
    if not lo <= int(value) <= hi:
        raise invalid(f"{name}: {int(value)} must be in {lo}..{hi}")
    return int(value)


LAYOUTS = ("bhsd", "bshd")


def layout_dims(shape, layout: str):
    """(batch, heads, seq, head_dim) of a 4-D ``shape`` in ``layout``."""
    if layout == "bhsd":
        b, h, s, d = shape
    else:
        b, s, h, d = shape
    return b, h, s, d


def layout_strides(layout: str, heads: int, seq: int, head_dim: int) -> list[int]:
    """Element strides (batch, head, row) of a contiguous ``[B, H, L, D]`` ("bhsd")
    or ``[B, L, H, D]`` ("bshd") array."""
    if layout not in LAYOUTS:
        raise invalid(f"layout: {layout!r} is not one of {', '.join(LAYOUTS)}")
    if layout == "bhsd":
        return [heads * seq * head_dim, seq * head_dim, head_dim]
    return [seq * heads * head_dim, head_dim, heads * head_dim]


def handle(buffer):
    """The C handle of a buffer, or NULL for None."""
    return ffi.NULL if buffer is None else buffer.handle
