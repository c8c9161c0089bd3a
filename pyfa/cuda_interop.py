"""GPU arrays (torch, cupy, anything exposing ``__cuda_array_interface__`` or a
CUDA ``__dlpack__``) used in place by the CUDA backend.

Element types never come from the CUDA-array-interface typestr alone: torch
reports bfloat16 as ``<V2`` (and some versions as ``<f2``), so torch tensors
are read through ``tensor.dtype`` and other producers' 16-bit types through
the DLPack dtype code (float = 2, bfloat = 4).
"""
from __future__ import annotations

import ctypes

import numpy as np

from . import dtypes
from .errors import invalid

_DLPACK_CUDA = 2
_CU_STREAM_LEGACY = 1


class GpuArray:
    """A foreign device array: its address, shape, dtype and the stream its
    producer orders work on. ``obj`` (the producer's object) is kept alive."""

    __slots__ = ("obj", "kind", "ptr", "shape", "dtype", "_stream", "device_id", "nbytes", "strides")

    def __init__(self, obj, kind: str, ptr: int, shape: tuple, dtype: np.dtype, stream, device_id: int,
                 nbytes: int | None = None, strides: tuple | None = None):
        # strides: element strides of a view read in place (nbytes then spans it), None when C-contiguous
        self.obj, self.kind, self.ptr, self.strides = obj, kind, int(ptr), strides
        self.shape, self.dtype, self._stream, self.device_id = tuple(shape), np.dtype(dtype), stream, device_id
        if nbytes is None:
            nbytes = self.dtype.itemsize
            for d in self.shape:
                nbytes *= int(d)
        self.nbytes = nbytes

    @property
    def stream(self) -> int:
        """The producer's current stream as a CUstream handle (read when first
        asked: torch's costs a few microseconds). The legacy default stream,
        which frameworks report as 0, is CU_STREAM_LEGACY (1): 0 would mean
        the encoder's own stream to pyfa."""
        if self._stream is None:
            if self.kind == "torch":
                self._stream = _torch_stream(self.device_id)
            else:
                self._stream = 0
        return int(self._stream) or _CU_STREAM_LEGACY

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index):
        """``a[None]``: the same memory with a leading axis of 1."""
        if index is not None:
            raise TypeError("GpuArray supports only [None]")
        return GpuArray(self.obj, self.kind, self.ptr, (1,) + self.shape, self.dtype, self._stream, self.device_id,
                        self.nbytes, None if self.strides is None else (0,) + self.strides)

    def ptr_of(self, a) -> int:
        """The address of a contiguous array that `empty` made."""
        if isinstance(a, GpuArray):
            return a.ptr
        if self.kind == "torch":
            return a.data_ptr()
        return a.__cuda_array_interface__["data"][0]

    # -- arrays of the same kind, on the same device and stream ------------------------------------
    def empty(self, shape, dtype):
        """A new contiguous array of the producer's kind (torch / cupy) on its device."""
        dtype = np.dtype(dtype)
        if self.kind == "torch":
            return self.obj.new_empty(shape, dtype=_TORCH_FROM_NP[dtype]())
        if self.kind == "cupy":
            import cupy

            with cupy.cuda.Device(self.device_id):
                return cupy.empty(tuple(shape), dtype=dtype)
        raise invalid("out: results for this array type need out= (pyfa creates torch and cupy arrays only)")

    def zeros(self, shape, dtype):
        """As :meth:`empty`, filled with zeros (queued on the producer's current stream)."""
        a = self.empty(shape, dtype)
        if self.kind == "torch":
            return a.zero_()
        a.fill(0)
        return a


_TORCH_DTYPES: dict = {}


def _torch_stream(device_id: int) -> int:
    """torch's current stream on a GPU, as a raw handle (the private accessor
    Triton uses costs well under a microsecond; the public one several)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device_id) if raw is not None else torch.cuda.current_stream(device_id).cuda_stream


def torch_stream_handle(device_id: int) -> int:
    """torch's current stream on a GPU as an encoder takes it: the legacy default stream, which
    torch reports as 0, is CU_STREAM_LEGACY (0 would mean the encoder's own stream)."""
    return _torch_stream(device_id) or _CU_STREAM_LEGACY


def _torch_dtypes():
    import torch

    _TORCH_DTYPES.update({torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16), torch.bfloat16: dtypes.bfloat16,
            torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64), torch.uint8: np.dtype(np.uint8),
            torch.bool: np.dtype(bool)})
    return _TORCH_DTYPES


def numpy_dtype(torch_dtype):
    """The numpy dtype of a torch dtype pyfa reads or writes (bfloat16: ml_dtypes'), or None."""
    return (_TORCH_DTYPES or _torch_dtypes()).get(torch_dtype)


def _torch_from_np(name):
    found = []

    def get():
        if not found:
            import torch

            found.append(getattr(torch, name))
        return found[0]
    return get


_TORCH_FROM_NP = {np.dtype(np.float32): _torch_from_np("float32"), np.dtype(np.float16): _torch_from_np("float16"),
                  dtypes.bfloat16: _torch_from_np("bfloat16"), np.dtype(np.int32): _torch_from_np("int32"),
                  np.dtype(np.uint8): _torch_from_np("uint8")}


_NOT_GPU = (int, float, bool, list, tuple, np.ndarray)


def is_gpu_array(x) -> bool:
    t = type(x)
    if t in _NOT_GPU:
        return False
    if t is GpuArray:
        return True
    if t.__name__ == "Tensor" and t.__module__ == "torch":
        return x.is_cuda
    if isinstance(x, (np.ndarray, GpuArray)) or np.isscalar(x):
        return isinstance(x, GpuArray)
    if type(x).__module__.startswith("torch"):
        return bool(_safe(lambda: getattr(x, "is_cuda", False)))
    if _safe(lambda: hasattr(x, "__cuda_array_interface__")):
        return True
    dev = getattr(x, "__dlpack_device__", None)
    return dev is not None and _safe(dev) is not None and _safe(dev)[0] == _DLPACK_CUDA


def _safe(f):
    try:
        return f()
    except Exception:
        return None


def torch_cuda(x, allowed, ndims):
    """A GpuArray for a contiguous CUDA torch tensor of an allowed dtype and
    rank, or None (the caller then takes the general path, which also words
    the errors). The hot path of every call on torch tensors."""
    if type(x).__name__ != "Tensor" or not x.is_cuda or not x.is_contiguous():
        return None
    dt = (_TORCH_DTYPES or _torch_dtypes()).get(x.dtype)
    shape = x.shape
    if dt is None or dt not in allowed or (ndims is not None and len(shape) not in ndims):
        return None
    return GpuArray(x, "torch", x.data_ptr(), shape, dt, None, x.get_device(), x.numel() * dt.itemsize)


def torch_cuda_view(x, allowed, view_ok):
    """A GpuArray over a non-contiguous CUDA torch tensor of an allowed dtype, in place, when
    ``view_ok(shape, byte strides, itemsize, address)`` gives its element strides; else None."""
    if type(x).__name__ != "Tensor" or not x.is_cuda or x.is_contiguous():
        return None
    dt = (_TORCH_DTYPES or _torch_dtypes()).get(x.dtype)
    if dt is None or dt not in allowed:
        return None
    shape = tuple(x.shape)
    ptr = x.data_ptr()
    strides = view_ok(shape, tuple(s * dt.itemsize for s in x.stride()), dt.itemsize, ptr) if x.numel() else None
    if strides is None:
        return None
    if x.requires_grad:
        x = x.detach()
    span = dt.itemsize * (1 + sum((n - 1) * s for n, s in zip(shape, strides)))
    return GpuArray(x, "torch", ptr, shape, dt, None, x.get_device(), span, strides)


def describe(x, name: str) -> GpuArray:
    """The GpuArray for a device array, made C-contiguous by its own framework if it is not."""
    if isinstance(x, GpuArray):
        return x
    module = type(x).__module__
    if module.startswith("torch"):
        import torch

        if x.requires_grad:
            x = x.detach()
        if not x.is_contiguous():
            x = x.contiguous()
        dt = _TORCH_DTYPES.get(x.dtype) if _TORCH_DTYPES else _torch_dtypes().get(x.dtype)
        if dt is None:
            raise invalid(f"{name}: torch dtype {x.dtype} not supported")
        return GpuArray(x, "torch", x.data_ptr(), tuple(x.shape), dt, None, x.get_device())
    if module.startswith("cupy"):
        import cupy

        if not x.flags.c_contiguous:
            x = cupy.ascontiguousarray(x)
        cai = x.__cuda_array_interface__
        dt = _dtype_from_cai(x, cai, name)
        return GpuArray(x, "cupy", cai["data"][0], tuple(cai["shape"]), dt, cupy.cuda.get_current_stream().ptr,
                        x.device.id)
    if _safe(lambda: hasattr(x, "__cuda_array_interface__")):
        ptr, shape, typestr, strides, stream = _read_cai(x, name)
        if strides is not None and strides != _c_strides(shape, np.dtype(typestr).itemsize):
            raise invalid(f"{name}: must be C-contiguous")
        dt = _dtype_from_cai(x, {"typestr": typestr}, name)
        return GpuArray(x, "cai", ptr, shape, dt, stream, 0)
    info = _dlpack_info(x)
    if info is None:
        raise invalid(f"{name}: not a CUDA array")
    ptr, shape, dt, strides, device_id = info
    if strides is not None and tuple(strides) != _c_strides(shape, dt.itemsize):
        raise invalid(f"{name}: must be C-contiguous")
    return GpuArray(x, "dlpack", ptr, shape, dt, 0, device_id)


def _read_cai(x, name: str):
    """(data pointer, shape, typestr, strides or None, stream) of a
    ``__cuda_array_interface__``, each checked for its type (version 2/3 layout)."""
    def bad(what):
        return invalid(f"{name}: __cuda_array_interface__ {what}")

    try:
        cai = x.__cuda_array_interface__
    except Exception as e:
        raise bad(f"cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(cai, dict):
        raise bad(f"must be a dict, got {type(cai).__name__}")

    def ints(key, value, lo, hi):
        if not isinstance(value, (tuple, list)) or not all(
                isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi for v in value):
            raise bad(f"{key} must be a tuple of ints in {lo}..{hi}, got {value!r:.80}")
        return tuple(value)

    shape = ints("shape", cai.get("shape"), 0, 2**63 - 1)
    typestr = cai.get("typestr")
    try:
        valid_type = isinstance(typestr, str) and np.dtype(typestr).kind in "biuf"
    except Exception:
        valid_type = False
    if not valid_type:
        raise bad(f"typestr must be a numpy type string, got {typestr!r:.80}")
    data = cai.get("data")
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise bad(f"data must be (pointer, read_only), got {data!r:.80}")
    ptr = ints("data pointer", data[:1], 0, 2**64 - 1)[0]
    strides = cai.get("strides")
    if strides is not None:
        strides = ints("strides", strides, -(2**63), 2**63 - 1)
        if len(strides) != len(shape):
            raise bad(f"strides has {len(strides)} entries for {len(shape)} dims")
    stream = cai.get("stream") or 0
    if not isinstance(stream, int) or isinstance(stream, bool) or not 0 <= stream < 2**64:
        raise bad(f"stream must be an int in 0..2**64-1, got {stream!r:.80}")
    return ptr, shape, typestr, strides, stream


def _c_strides(shape, itemsize):
    strides, acc = [], itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


def _dtype_from_cai(x, cai, name):
    typestr = cai["typestr"]
    if typestr[1:] in ("f8", "f4", "i4", "u1", "b1"):  # unambiguous: the dtype check names what it refuses
        return np.dtype(typestr)
    # 16-bit floats: ask DLPack, whose type codes tell f16 from bf16.
    info = _dlpack_info(x)
    if info is not None:
        return info[2]
    if typestr[1:] == "f2":
        return np.dtype(np.float16)
    raise invalid(f"{name}: element type {typestr!r} is ambiguous (bf16 or f16?) and the array has no __dlpack__")


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


_DL_TYPES = {(2, 32): np.dtype(np.float32), (2, 16): np.dtype(np.float16), (4, 16): dtypes.bfloat16,
             (0, 32): np.dtype(np.int32), (1, 8): np.dtype(np.uint8), (1, 32): np.dtype(np.uint32),
             (6, 8): np.dtype(bool)}


def _dlpack_info(x):
    """(data pointer, shape, dtype, strides in elements or None, device id) from an
    unversioned DLPack capsule, or None. The capsule is not consumed, so its
    destructor releases the producer's tensor."""
    if not hasattr(x, "__dlpack__"):
        return None
    try:
        capsule = x.__dlpack__()
    except Exception:
        return None
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    is_valid = ctypes.pythonapi.PyCapsule_IsValid
    is_valid.restype, is_valid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
    if not is_valid(capsule, b"dltensor"):
        return None
    t = _DLTensor.from_address(get(capsule, b"dltensor"))
    if t.device.device_type != _DLPACK_CUDA or t.dtype.lanes != 1:
        return None
    dt = _DL_TYPES.get((t.dtype.code, t.dtype.bits))
    if dt is None:
        return None
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = tuple(t.strides[i] for i in range(t.ndim)) if t.strides else None
    if strides is not None:
        strides = tuple(s * dt.itemsize for s in strides)
    return (t.data or 0) + t.byte_offset, shape, dt, strides, t.device.device_id
