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


def to_device(device: Device, a, like: GpuArray | None = None) -> Buffer:
    """A buffer holding `a`: GPU arrays wrapped in place; host arrays wrapped on
    host-visible devices, else copied (small ones into shared storage). The
    alignment an op needs of its rows is the library's check, made when the op
    takes the buffer."""
    if isinstance(a, GpuArray):
        return device.wrap_device(a.ptr, a.nbytes, a.dtype, a.shape, keepalive=a.obj)
    if device.host_visible:
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


def _result(shape, dtype, out, name, like):
    """(array, its GpuArray or None): the checked `out`, or a new array."""
    dtype = np.dtype(dtype)
    if like is not None:
        if out is None:
            a = like.empty(shape, dtype)
            return a, GpuArray(a, like.kind, like.ptr_of(a), shape, dtype, like._stream, like.device_id)
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
    return int(ffi.cast("uintptr_t", ffi.from_buffer(a))) if a.size else 0


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


def handle(buffer):
    """The C handle of a buffer, or NULL for None."""
    return ffi.NULL if buffer is None else buffer.handle
