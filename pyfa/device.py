"""Devices and buffers: thin owners of the C handles."""
from __future__ import annotations

import os
import threading

import numpy as np

from . import dtypes
from ._args import I64_MAX, int_arg, show, str_arg
from ._native import ffi, lib
from .errors import PyfaError, check, invalid

_STORAGE = {"shared": lib.PYFA_STORAGE_SHARED, "private": lib.PYFA_STORAGE_PRIVATE}


def backends() -> list[str]:
    """Backends compiled into the library, best first (e.g. ``['cuda', 'cpu']``)."""
    return ffi.string(lib.pyfa_backends()).decode().split(",")


class Buffer:
    """A typed, shaped span of device memory.

    ``shared`` storage is CPU-visible and :meth:`numpy` returns a zero-copy
    view; ``private`` storage lives on the device and is reached through
    :meth:`read` / :meth:`write` copies. Made by :meth:`Device.buffer`,
    :meth:`Device.wrap` and :meth:`Device.wrap_device`; attributes ``device``,
    ``dtype`` (numpy), ``shape`` (tuple) and ``storage`` (``"shared"`` or
    ``"private"``).
    """

    def __init__(self, device: "Device", handle, dtype: np.dtype, shape: tuple, storage: str, keepalive=None):
        self.device = device
        self._h = ffi.gc(handle, lib.pyfa_buffer_free)
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(s) for s in shape)
        self.storage = storage
        self._keepalive = keepalive  # caller memory a wrapped buffer points into

    @property
    def nbytes(self) -> int:
        """Size in bytes, as the library allocated it."""
        return int(lib.pyfa_buffer_nbytes(self._h))

    @property
    def handle(self):
        """The ``pyfa_buffer *`` of the C ABI (a cffi pointer), for calls into ``pyfa._native.lib``."""
        return self._h

    def numpy(self) -> np.ndarray:
        """Zero-copy view of shared storage; it keeps this buffer alive."""
        ptr = lib.pyfa_buffer_contents(self._h)
        if ptr == ffi.NULL:
            raise invalid("numpy: only shared storage has a CPU view; use read() for private buffers")
        raw = np.frombuffer(ffi.buffer(ptr, self.nbytes), dtype=np.uint8)
        view = _Owned(raw, self).view(self.dtype)
        return view.reshape(self.shape)

    def write(self, array) -> None:
        """Copies ``array`` (converted to the buffer's dtype, C order) into the buffer; its byte
        size must equal :attr:`nbytes`."""
        try:
            a = np.ascontiguousarray(array, dtype=self.dtype)
        except Exception as e:
            raise invalid(f"array: cannot be read as {self.dtype} ({e})") from None
        if a.nbytes != self.nbytes:
            raise invalid(f"write: array has {a.nbytes} bytes, buffer has {self.nbytes}")
        check(lib.pyfa_buffer_write(self._h, 0, ffi.from_buffer(a), a.nbytes))

    def read(self) -> np.ndarray:
        """A new numpy array of the buffer's shape and dtype holding a copy of its contents."""
        a = np.empty(self.shape, dtype=self.dtype)
        check(lib.pyfa_buffer_read(self._h, 0, ffi.from_buffer(a, require_writable=True), a.nbytes))
        return a

    def __repr__(self) -> str:
        return f"Buffer(shape={self.shape}, dtype={self.dtype}, storage={self.storage!r}, device={self.device.backend!r})"


class _Owned(np.ndarray):
    """ndarray subclass that holds a reference to its owner buffer."""

    def __new__(cls, raw: np.ndarray, owner):
        obj = raw.view(cls)
        obj._owner = owner
        return obj

    def __array_finalize__(self, obj):
        self._owner = getattr(obj, "_owner", None)


class Device:
    """A pyfa device: ``Device("auto")`` takes the best backend that opens
    (CUDA, Metal), else the CPU; ``"cpu"``, ``"cuda"`` or ``"metal"`` names one,
    and raises :class:`pyfa.BackendUnavailableError` saying why when it does
    not open.

    Attributes (from the library): ``backend``, ``name``, ``compute_units``,
    ``memory_bytes``, ``max_threads_per_threadgroup``,
    ``max_threadgroup_memory``, ``simd_width``, ``is_gpu``.

    >>> import pyfa
    >>> pyfa.Device("cpu").backend
    'cpu'
    """

    def __init__(self, backend: str = "auto"):
        out = ffi.new("pyfa_device **")
        check(lib.pyfa_device_new(out, str_arg(backend, "backend").encode()))
        self._h = ffi.gc(out[0], lib.pyfa_device_free)
        info = ffi.new("pyfa_device_info *")
        check(lib.pyfa_device_info_get(self._h, info))
        self.backend = ffi.string(info.backend).decode()
        self.name = ffi.string(info.name).decode()
        self.compute_units = int(info.compute_units)
        self.memory_bytes = int(info.memory_bytes)
        self.max_threads_per_threadgroup = int(info.max_threads_per_threadgroup)
        self.max_threadgroup_memory = int(info.max_threadgroup_memory)
        self.simd_width = int(info.simd_width)
        self.is_gpu = bool(info.is_gpu)
        self._host_visible = bool(info.host_visible)
        self._local = threading.local()

    @property
    def handle(self):
        """The ``pyfa_device *`` of the C ABI (a cffi pointer), for calls into ``pyfa._native.lib``."""
        return self._h

    @property
    def host_visible(self) -> bool:
        """True when kernels read host memory directly (numpy arrays are wrapped, not copied)."""
        return self._host_visible

    def buffer(self, shape, dtype, storage: str = "shared") -> Buffer:
        """A new buffer of ``shape`` and ``dtype`` (numpy dtype; bf16 as ``ml_dtypes.bfloat16``)."""
        if not isinstance(storage, str) or storage not in _STORAGE:
            raise invalid(f"storage: {show(storage)} is not 'shared' or 'private'")
        shape = _shape(shape)
        out = ffi.new("pyfa_buffer **")
        check(lib.pyfa_buffer_new(out, self._h, dtypes.code(dtype), len(shape), shape, _STORAGE[storage]))
        return Buffer(self, out[0], dtype, shape, storage)

    def wrap(self, array: np.ndarray) -> Buffer:
        """Zero-copy buffer over a C-contiguous numpy array (CPU backend)."""
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            raise invalid("array: wrap needs a C-contiguous numpy array")
        shape = _shape(array.shape)
        out = ffi.new("pyfa_buffer **")
        ptr = ffi.from_buffer(array, require_writable=False) if array.size else ffi.NULL
        check(lib.pyfa_buffer_wrap(out, self._h, ptr, array.nbytes, dtypes.code(array.dtype), len(shape), shape))
        return Buffer(self, out[0], array.dtype, shape, "shared", keepalive=(array, ptr))

    def wrap_device(self, address: int, nbytes: int, dtype, shape, keepalive=None) -> Buffer:
        """Zero-copy buffer over device memory (CUDA backend): a torch / cupy
        tensor's address; ``keepalive`` (the tensor) lives as long as the buffer.
        Host-visible devices (CPU, Metal) refuse: a raw address there cannot be
        checked, and ``wrap`` takes host arrays."""
        if self._host_visible:
            raise invalid(f"address: wrap_device needs a device with its own memory (CUDA); the {self.backend!r} "
                          f"backend reads host memory: wrap a numpy array with wrap()")
        shape = _shape(shape)
        out = ffi.new("pyfa_buffer **")
        check(lib.pyfa_buffer_wrap(out, self._h, ffi.cast("void *", int(address)), int(nbytes), dtypes.code(dtype),
                                   len(shape), shape))
        return Buffer(self, out[0], dtype, shape, "private", keepalive=keepalive)

    def encoder(self):
        """A fresh encoder (encoders are per-thread objects)."""
        out = ffi.new("pyfa_encoder **")
        check(lib.pyfa_encoder_new(out, self._h))
        return ffi.gc(out[0], lib.pyfa_encoder_free)

    def __repr__(self) -> str:
        return f"Device(backend={self.backend!r}, name={self.name!r})"


def _shape(shape) -> list[int]:
    """A shape as int64 dims (negative dims are the library's to reject, by name)."""
    dims = shape if isinstance(shape, (tuple, list)) else (shape,)
    return [int_arg(s, f"shape[{i}]", -I64_MAX - 1, I64_MAX, rule="must be an int64") for i, s in enumerate(dims)]



def supported(what: str) -> tuple[int, ...]:
    """What the kernels are built for: ``"head_dims"``, ``"tq_head_dims"``,
    ``"tq_bits"`` or ``"attn_dtypes"`` (dtype codes), as the library reports it."""
    text = lib.pyfa_supported(str_arg(what, "what").encode())
    if text == ffi.NULL:
        raise invalid(f"what: {what!r} is not one of 'head_dims', 'tq_head_dims', 'tq_bits', 'attn_dtypes'")
    return tuple(int(v) for v in ffi.string(text).decode().split(","))


def counters() -> dict:
    """Process-wide counts of what calls cost beyond their kernels: device,
    pinned and host allocations, GPU synchronisations, host<->device copies,
    GPU kernel launches (and of them, launches of clusters of blocks), prefill
    dispatches whose blocks' keys were split, prefill dispatches of persistent
    blocks, and plans made (a steady-state call adds only launches)."""
    c = ffi.new("pyfa_counters *")
    check(lib.pyfa_counters_get(c))
    return {name: int(getattr(c, name)) for name in (
        "device_allocations", "pinned_allocations", "host_allocations", "synchronizations",
        "host_to_device_copies", "device_to_host_copies", "kernel_launches", "plans_created", "cluster_launches",
        "split_launches", "persistent_launches")}


def available_backends() -> list[str]:
    """Backends whose device opens on this machine, best first (e.g. ``['cuda', 'cpu']``)."""
    names = []
    for name in backends():
        try:
            Device(name)
        except PyfaError:
            continue
        names.append(name)
    return names


_default: Device | None = None
_default_lock = threading.Lock()


def default_device() -> Device:
    """The process-wide default device, opened on first use: ``$PYFA_BACKEND``
    (``cpu``, ``cuda``, ``metal``) when set, else ``Device("auto")``."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Device(os.environ.get("PYFA_BACKEND") or "auto")
        return _default
