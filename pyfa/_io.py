"""Turning user arrays into buffers for a device, and results back into arrays.

On host-visible devices (the CPU backend) C-contiguous numpy arrays and torch
CPU tensors (pyfa/torch_cpu.py) are used in place; anything else
(non-contiguous, other array types) is copied into a contiguous array first.
Results of a call whose leading array argument is a torch CPU tensor are
torch CPU tensors over the result's memory. GPU arrays (torch, cupy,
``__cuda_array_interface__`` / ``__dlpack__``) on a CUDA device are used in
place (pyfa/cuda_interop.py): their buffers wrap the producer's memory,
temporaries come from the same framework, results are arrays of that
framework, and work runs on the producer's current stream without waiting.
Host inputs on a GPU device are copied to device buffers.
"""
from __future__ import annotations

import threading

import numpy as np

from . import _args, _plans, cuda_interop, dtypes, torch_cpu
from ._native import ffi, lib
from .device import Buffer, Device
from .errors import PyfaError, check, invalid
from .cuda_interop import GpuArray


def as_array(x, name: str, allowed=dtypes.FLOAT_TYPES, ndims=None, gpu: bool = False):
    """A C-contiguous numpy array of an allowed dtype (copying only if needed),
    or, for ops that take device arrays (``gpu=True``), a GpuArray."""
    if type(x) is np.ndarray and x.flags.c_contiguous and x.dtype in allowed and (ndims is None or x.ndim in ndims):
        return x
    if gpu:
        g = cuda_interop.torch_cuda(x, allowed, ndims)
        if g is not None:
            return g
    if gpu and cuda_interop.is_gpu_array(x):
        g = cuda_interop.describe(x, name)
        if g.dtype not in allowed:
            raise invalid(f"{name}: dtype {g.dtype} not accepted (expected {', '.join(str(d) for d in allowed)})")
        if ndims is not None and g.ndim not in ndims:
            raise invalid(f"{name}: expected {' or '.join(f'{n}-D' for n in ndims)}, got shape {g.shape}")
        return g
    try:
        a = torch_cpu.as_numpy(x, name) if torch_cpu.is_tensor(x) else np.asarray(x)
    except PyfaError:
        raise
    except Exception as e:  # objects numpy cannot read
        raise invalid(f"{name}: cannot be read as an array ({e})") from None
    if a.dtype not in allowed:
        raise invalid(f"{name}: dtype {a.dtype} not accepted (expected {', '.join(str(d) for d in allowed)})")
    if ndims is not None and a.ndim not in ndims:
        raise invalid(f"{name}: expected {' or '.join(f'{n}-D' for n in ndims)}, got shape {a.shape}")
    return np.ascontiguousarray(a)


def gpu_input(device: Device, g: GpuArray, name: str) -> None:
    """Checks that the GPU array argument `name` can be read by `device`: a GPU
    device (CUDA device 0, the one the backend opens) and a float dtype."""
    if device.host_visible:
        raise invalid(f"{name}: a GPU array needs a GPU device; the device is {device.backend!r} "
                      "(pass a host array)")
    if g.dtype not in dtypes.FLOAT_TYPES:
        raise invalid(f"{name}: dtype {g.dtype} not accepted for GPU arrays "
                      f"(expected {', '.join(str(d) for d in dtypes.FLOAT_TYPES)})")
    if g.device_id != 0:
        raise invalid(f"{name}: on CUDA device {g.device_id}; pyfa's cuda backend runs on device 0")


def gpu_like(device: Device, *arrays) -> GpuArray | None:
    """The first GpuArray among `arrays` (checking that all of them are, and that
    the device is a GPU), or None when all are host arrays."""
    gpu = [a for a in arrays if isinstance(a, GpuArray)]
    if not gpu:
        return None
    if len(gpu) != len(arrays):
        raise invalid("inputs: mix of device (GPU) and host arrays; pass all of them on one side")
    if device.host_visible:
        raise invalid(f"device: GPU arrays need a GPU device, got {device.backend!r}")
    for a in gpu[1:]:
        if a.kind != gpu[0].kind or a.device_id != gpu[0].device_id:
            raise invalid("inputs: GPU arrays must come from one framework and one device")
    return gpu[0]


# Host arrays up to this size go to GPU devices as shared buffers: the library
# can still read them (kv_len / ring_start checks) and the queue uploads them
# on the encoder's stream. Larger ones are copied into private buffers.
_SMALL_HOST_BYTES = 1 << 16

# Kernels copy the rows of attention operands (q, k, v, out) in pieces of this many bytes.
ROW_PIECE_BYTES = 16


def to_device(device: Device, a, like: GpuArray | None = None) -> Buffer:
    """A buffer holding `a`: GPU arrays wrapped in place; host arrays wrapped on
    host-visible devices, else copied (small ones into shared storage). The
    alignment an op needs of its rows is the library's check, made when the op
    takes the buffer."""
    if isinstance(a, GpuArray):
        # a view (strides set) is wrapped from its first element to its last, as flat elements
        shape = a.shape if a.strides is None else (a.nbytes // a.dtype.itemsize,)
        return device.wrap_device(a.ptr, a.nbytes, a.dtype, shape, keepalive=a.obj)
    if device.host_visible:
        if not a.flags.c_contiguous and a.size:  # a view, likewise (the elements between are its base's)
            a = np.lib.stride_tricks.as_strided(a, (span_bytes(a) // a.itemsize,), (a.itemsize,),
                                                writeable=a.flags.writeable)
        return device.wrap(a)
    if a.nbytes <= _SMALL_HOST_BYTES:
        b = device.buffer(a.shape, a.dtype, storage="shared")
        b.numpy()[...] = a
        return b
    b = device.buffer(a.shape, a.dtype, storage="private")
    b.write(a)
    return b


def temporary(device: Device, shape, dtype, like: GpuArray | None = None) -> Buffer:
    """Device-only working memory; from `like`'s framework when given, so its
    allocator orders reuse on the caller's stream (the work is not waited for)."""
    if like is not None:
        return to_device(device, cuda_interop.describe(like.empty(tuple(shape), np.dtype(dtype)), "temporary"))
    return device.buffer(shape, dtype, storage="private")


def scratch(device: Device, nbytes: int, like: GpuArray | None = None) -> Buffer | None:
    """Device-only f32 working memory (None for 0 bytes); from `like`'s framework
    when given, so its allocator orders reuse on the stream."""
    return temporary(device, (nbytes // 4,), np.float32, like) if nbytes else None


def encoder(device: Device, like: GpuArray | None = None):
    """An encoder; for GPU arrays this thread's encoder, bound to `like`'s
    stream (GpuArray.stream: the legacy default stream as CU_STREAM_LEGACY)
    and emptied of anything a failed call left recorded, so no stream is
    created or destroyed per call."""
    if like is None:
        return device.encoder()
    enc = _plans.encoder(device, like.stream)
    check(lib.pyfa_encoder_reset(enc))
    _plans.begin_recording(enc)
    return enc


def submit(enc, like: GpuArray | None = None) -> None:
    """Commits; waits unless the work runs on a caller's stream (GPU arrays)."""
    check(lib.pyfa_encoder_commit(enc))
    if like is None:
        check(lib.pyfa_encoder_wait(enc))
    else:
        _plans.end_recording(enc)


def output(device: Device, shape, dtype, out, name: str = "out", like: GpuArray | None = None):
    """(array, buffer) for a result: `out` if given (checked), else a new array
    (of `like`'s framework for GPU inputs)."""
    a, g = _result(shape, dtype, out, name, like)
    if g is not None:
        return a, to_device(device, g)
    if device.host_visible:
        return a, device.wrap(a)
    return a, device.buffer(a.shape, a.dtype, storage="private")


def result_array(shape, dtype, out, name: str = "out", like: GpuArray | None = None):
    """(array, address) of a result for a plan run: `out` if given (checked),
    else a new array (of `like`'s framework for GPU inputs). Host arrays only
    where the device reads host memory (the caller checks)."""
    a, g = _result(shape, dtype, out, name, like)
    if g is not None:
        return a, g.ptr
    return a, address(a)


def result_rows(shape, dtype, out, like: GpuArray | None = None):
    """(array, address, span bytes, element strides) of an attention op's result for a plan run:
    ``out`` if given, which may be a strided view the kernels write in place (out_view), else a
    new C-contiguous array."""
    dtype = np.dtype(dtype)
    view = None if out is None else out_view(out, tuple(shape), dtype, like)
    if view is not None:
        target, strides = view
        return out, address(target), span_bytes(target), strides
    a, at = result_array(shape, dtype, out, like=like)
    return a, at, int(np.prod(shape)) * dtype.itemsize, c_strides(shape)


def output_rows(device: Device, shape, dtype, out, like: GpuArray | None = None):
    """(array, buffer, element strides, host view to fill afterwards or None) of an attention op's
    result for a dispatch: a strided ``out`` (out_view) is written in place where the device
    writes the caller's memory, and filled from a contiguous result after the call where the
    result is copied back from a device."""
    dtype = np.dtype(dtype)
    if out is not None:
        view = out_view(out, tuple(shape), dtype, like)
        if view is not None:
            target, strides = view
            if isinstance(target, GpuArray) or device.host_visible:
                return out, to_device(device, target, like), strides, None
            a, buf = output(device, shape, dtype, None, like=like)
            return a, buf, c_strides(shape), target
    a, buf = output(device, shape, dtype, out, like=like)
    return a, buf, c_strides(shape), None


def finish_rows(device: Device, a, buffer: Buffer, fill_after=None):
    """finish, then (output_rows' fourth value) the caller's strided view filled from the
    contiguous result ``a``; returns the array that holds the result."""
    finish(device, a, buffer)
    if fill_after is None:
        return a
    fill_after[...] = a
    return fill_after


_OUT_VIEW_RULE = (f"a non-contiguous output must start on a {ROW_PIECE_BYTES}-byte boundary, with its last axis "
                  f"(head_dim) contiguous and every other axis longer than 1 a non-negative multiple of "
                  f"{ROW_PIECE_BYTES} bytes apart")


def out_view_strides(a, name: str = "out") -> tuple:
    """view_strides of a non-contiguous output view (a host array or a GpuArray), whose elements
    must also each have memory of their own; raises naming ``name`` otherwise."""
    shape = tuple(a.shape)
    if isinstance(a, GpuArray):
        s = a.strides
    else:
        s = view_strides(shape, a.strides, a.itemsize, address(a)) if a.size else None
    if s is None:
        raise invalid(f"{name}: {_OUT_VIEW_RULE}")
    span = shape[-1]
    for stride, n in sorted((st, n) for st, n in zip(s[:-1], shape[:-1]) if n > 1):
        if stride < span:
            raise invalid(f"{name}: element strides {s} make elements of shape {shape} share memory; each output "
                          "element needs its own")
        span = stride * n
    return s


def out_view(out, shape, dtype, like):
    """(numpy view or GpuArray, element strides) of a non-contiguous ``out`` (numpy, a torch CPU
    or CUDA tensor), checked; None for a contiguous one or another array type (the contiguous
    rules then apply)."""
    name = "out"
    if cuda_interop.is_gpu_array(out):
        if type(out).__name__ != "Tensor" or out.is_contiguous():
            return None
        if like is None:
            raise invalid(f"{name}: must be a host array when the inputs are")
        if tuple(out.shape) != shape or cuda_interop.numpy_dtype(out.dtype) != dtype:
            raise invalid(f"{name}: expected shape {shape} and dtype {dtype}, got {tuple(out.shape)} {out.dtype}")
        if out.requires_grad:
            raise invalid(f"{name}: must be a tensor that does not require grad (pyfa writes it in place)")
        g = cuda_interop.torch_cuda_view(out, (dtype,), view_strides)
        if g is None:
            raise invalid(f"{name}: {_OUT_VIEW_RULE}")
        if g.device_id != like.device_id:
            raise invalid(f"{name}: on GPU {g.device_id}, the inputs are on GPU {like.device_id}")
        return g, out_view_strides(g, name)
    if torch_cpu.is_tensor(out):
        if out.is_contiguous():
            return None
        a = torch_cpu.as_numpy(out, name, writable=True, strided=True)
    elif isinstance(out, np.ndarray) and not out.flags.c_contiguous:
        a = out
    else:
        return None
    if like is not None:
        raise invalid(f"{name}: must be a GPU array when the inputs are")
    if a.shape != shape or a.dtype != dtype:
        raise invalid(f"{name}: expected shape {shape} and dtype {dtype}, got {a.shape} {a.dtype}")
    if not a.flags.writeable:
        raise invalid(f"{name}: must be writable")
    return a, out_view_strides(a, name)


def _result(shape, dtype, out, name, like):
    """(array, its GpuArray or None): the checked `out`, or a new array."""
    dtype = np.dtype(dtype)
    if like is not None:
        if out is None:
            a = like.empty(shape, dtype)
            return a, GpuArray(a, like.kind, like.ptr_of(a), shape, dtype, like._stream, like.device_id)
        if getattr(out, "requires_grad", False):
            raise invalid(f"{name}: must be a tensor that does not require grad (pyfa writes it in place)")
        g = cuda_interop.describe(out, name) if cuda_interop.is_gpu_array(out) else None
        if g is None:
            raise invalid(f"{name}: must be a GPU array when the inputs are")
        if g.shape != tuple(shape) or g.dtype != dtype:
            raise invalid(f"{name}: expected shape {tuple(shape)} and dtype {dtype}, got {g.shape} {g.dtype}")
        if g.obj is not out:
            raise invalid(f"{name}: must be C-contiguous")
        if g.device_id != like.device_id:
            raise invalid(f"{name}: on GPU {g.device_id}, the inputs are on GPU {like.device_id}")
        return out, g
    if out is None:
        return np.empty(shape, dtype=dtype), None
    if torch_cpu.is_tensor(out):
        out = torch_cpu.as_numpy(out, name, writable=True)
    if not isinstance(out, np.ndarray):
        raise invalid(f"{name}: must be a numpy array or a torch CPU tensor")
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise invalid(f"{name}: expected shape {tuple(shape)} and dtype {dtype}, got {out.shape} {out.dtype}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise invalid(f"{name}: must be C-contiguous and writable")
    return out, None


def address(a) -> int:
    """The address of a host array's or GpuArray's first byte (0 when empty)."""
    if isinstance(a, GpuArray):
        return a.ptr
    if not a.size:
        return 0
    if not a.flags.c_contiguous:  # a strided view (rows_operand): its first element's address
        return a.__array_interface__["data"][0]
    return int(ffi.cast("uintptr_t", ffi.from_buffer(a)))


def span_bytes(a) -> int:
    """Bytes from a host array's or GpuArray's first element to the end of its last (nbytes
    unless it is a strided view)."""
    if isinstance(a, GpuArray) or a.flags.c_contiguous or not a.size:
        return a.nbytes
    return a.itemsize * (1 + sum((n - 1) * s // a.itemsize for n, s in zip(a.shape, a.strides)))


def view_strides(shape, byte_strides, itemsize, start: int) -> tuple | None:
    """Element strides of a view the attention kernels can step through in place: its first
    element (at address ``start``) on a ROW_PIECE_BYTES boundary, the last axis (head_dim)
    contiguous, every other axis longer than 1 a non-negative whole number of ROW_PIECE_BYTES
    apart. An axis of extent 1 is never stepped along: its stride becomes 0. None when the view
    does not qualify (it is then copied, or refused as an output)."""
    if start % ROW_PIECE_BYTES:
        return None
    out = []
    for i, (n, b) in enumerate(zip(shape, byte_strides)):
        if n == 1:
            out.append(0)
        elif n == 0 or b < 0 or b % itemsize or (b != itemsize if i == len(shape) - 1 else b % ROW_PIECE_BYTES):
            return None
        else:
            out.append(b // itemsize)
    return tuple(out)


def c_strides(shape) -> tuple:
    """Element strides of a C-contiguous array of ``shape``."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= int(n)
    return tuple(reversed(out))


def rows_operand(x, name: str, ndim: int = 4):
    """(array, element strides) of an ``ndim``-D float operand of an attention op: a strided view
    (numpy, a torch CPU or CUDA tensor) is read in place when view_strides allows it, anything
    else is made C-contiguous as by as_array."""
    t = type(x)
    if t is np.ndarray:
        if not x.flags.c_contiguous and x.ndim == ndim and x.dtype in dtypes.FLOAT_TYPES and x.size:
            s = view_strides(x.shape, x.strides, x.itemsize, address(x))
            if s is not None:
                return x, s
    elif t.__name__ == "Tensor" and t.__module__ == "torch" and x.dim() == ndim and not x.is_contiguous():
        if x.is_cuda:
            g = cuda_interop.torch_cuda_view(x, dtypes.FLOAT_TYPES, view_strides)
            if g is not None:
                return g, g.strides
        elif x.device.type == "cpu" and x.numel():
            a = torch_cpu.as_numpy(x, name, strided=True)
            s = view_strides(a.shape, a.strides, a.itemsize, address(a)) if a.dtype in dtypes.FLOAT_TYPES else None
            if s is not None:
                return a, s
    a = as_array(x, name, ndims=(ndim,), gpu=True)
    return a, c_strides(a.shape)


def row_operands(device: Device, named, ndim: int = 4):
    """(arrays, their element strides, the first GpuArray or None) of attention operands
    ``named`` ((name, array) pairs; rows_operand): views where the device reads them in place,
    C-contiguous copies of host arrays a GPU device gets copies of anyway."""
    pairs = [rows_operand(x, name, ndim) for name, x in named]
    like = gpu_like(device, *(a for a, _ in pairs))
    if like is None and not device.host_visible:
        pairs = [(np.ascontiguousarray(a), c_strides(a.shape)) for a, _ in pairs]
    return [a for a, _ in pairs], [s for _, s in pairs], like


def host_result(a, first, out=None):
    """A result in the caller's array type: with ``out``, the caller's own tensor, or
    ``a`` for a numpy ``out`` (``a`` is it or a view of it); else a torch CPU tensor
    over ``a``'s memory when ``first`` (the call's leading array argument) is a
    torch CPU tensor; else ``a`` (numpy, or a GPU array)."""
    if out is not None:
        return out if torch_cpu.is_tensor(out) else a
    if isinstance(a, np.ndarray) and torch_cpu.is_cpu_tensor(first):
        return torch_cpu.from_numpy(a)
    return a


def finish(device: Device, a, buffer: Buffer):
    """Copies a device result into `a` where `a` is a host array and the device
    is not host-visible."""
    if isinstance(a, np.ndarray) and not device.host_visible:
        a[...] = buffer.read()
    return a


class SequenceValues:
    """kv_len / ring_start for a plan run: host values (an int32 C array the
    library checks during the run and sends with the launch) or a GPU int32
    array the kernels read (``longest`` is then None: the values are not known
    on the host)."""

    __slots__ = ("host", "gpu", "longest")

    def __init__(self, host=None, gpu=None, longest=None):
        self.host, self.gpu, self.longest = host, gpu, longest

    def set(self, field) -> None:
        if self.gpu is not None:
            field.host = ffi.NULL
            field.device.address, field.device.nbytes = self.gpu.ptr, self.gpu.nbytes
        else:
            field.host = self.host


_local = threading.local()


def _host_values(name: str, value: int, batch: int):
    """`batch` copies of `value` as an int32 C array, reused per thread and
    name: the library reads host values during the call that receives them."""
    key = (name, batch)
    arrays = getattr(_local, "values", None)
    if arrays is None:
        arrays = _local.values = {}
    entry = arrays.get(key)
    if entry is None:
        entry = arrays[key] = [ffi.new("int32_t[]", batch), None]
    if entry[1] != value:
        a = entry[0]
        for i in range(batch):
            a[i] = value
        entry[1] = value
    return entry[0]


def sequence_values(value, name: str, batch: int, like: GpuArray | None) -> SequenceValues:
    """Per-sequence values: an int or 1-D ints on the host, or (with GPU
    inputs) a GPU int32 array of ``batch`` values on the inputs' GPU."""
    I32_MAX = _args.I32_MAX
    if type(value) is int and -I32_MAX <= value <= I32_MAX:  # the common case, without numpy
        return SequenceValues(host=_host_values(name, value, batch), longest=max(value, 0))
    if cuda_interop.is_gpu_array(value):
        if like is None:
            raise invalid(f"{name}: a GPU array needs GPU inputs (q, caches) on a GPU device")
        g = cuda_interop.describe(value, name)
        if g.dtype != np.int32:
            raise invalid(f"{name}: GPU values must be int32, got {g.dtype}")
        if g.kind != like.kind or g.device_id != like.device_id:
            raise invalid(f"{name}: must come from the inputs' framework and GPU ({like.kind} on GPU {like.device_id})")
        if g.ndim > 1 or int(np.prod(g.shape, dtype=np.int64)) != batch:
            raise invalid(f"{name}: expected {batch} values (one per sequence), got shape {g.shape}")
        return SequenceValues(gpu=g)
    values = _args.index_array(value, name, batch, -I32_MAX, I32_MAX)
    longest = max(int(values.max()), 0) if values.size else 0
    return SequenceValues(host=ffi.new("int32_t[]", values.tolist()), longest=longest)


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
    if layout == "bhsd":
        return [heads * seq * head_dim, seq * head_dim, head_dim]
    return [seq * heads * head_dim, head_dim, heads * head_dim]


def layout_view(strides, layout: str) -> list[int]:
    """Element strides (batch, head, row) of a 4-D array with element ``strides`` in ``layout``."""
    b, x, y, _ = strides
    return [b, x, y] if layout == "bhsd" else [b, y, x]


def handle(buffer):
    """The C handle of a buffer, or NULL for None."""
    return ffi.NULL if buffer is None else buffer.handle
