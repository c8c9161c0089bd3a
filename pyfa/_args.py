"""Argument conversion for every public function.

Each converter takes a user value and the argument's name and returns a plain
Python value (or a numpy array) of the type the library needs, or raises
:class:`pyfa.InvalidArgumentError` with the message ``"name: rule, got value"``.
No other exception type leaves a converter, whatever the value: objects whose
``__float__``, ``__index__``, ``__bool__`` or ``__repr__`` raise are reported
the same way.
"""
from __future__ import annotations

import math
import numbers
import operator
import threading
import warnings

import numpy as np

from ._native import ffi
from .errors import invalid

I32_MAX = 2**31 - 1
U32_MAX = 2**32 - 1
I64_MAX = 2**63 - 1
U64_MAX = 2**64 - 1


def show(value, limit: int = 80) -> str:
    """``repr(value)`` for a message, shortened to ``limit`` characters."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_bool(value) -> bool:
    return isinstance(value, (bool, np.bool_))


def float_arg(value, name: str, default=None) -> float:
    """A Python float from a real number (int, float, numpy scalar or 0-d array);
    ``None`` gives ``default`` when one is given. Bools, strings, sequences and
    complex numbers are rejected. Finiteness is the library's rule to check."""
    if value is None and default is not None:
        return float(default)
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if _is_bool(value) or not isinstance(value, (numbers.Real, np.integer, np.floating)):
        raise invalid(f"{name}: must be a real number, got {show(value)}")
    try:
        return float(value)
    except (OverflowError, ValueError, TypeError):
        raise invalid(f"{name}: must be a real number representable as a float, got {show(value)}") from None


def int_arg(value, name: str, lo: int, hi: int, rule: str | None = None) -> int:
    """A Python int in ``[lo, hi]`` from an int or numpy integer (bools, floats
    and strings are rejected). ``rule`` replaces the default wording."""
    rule = rule or f"must be an int in {lo}..{hi}"
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if _is_bool(value):
        raise invalid(f"{name}: {rule}, got {show(value)}")
    try:
        v = operator.index(value)
    except Exception:
        raise invalid(f"{name}: {rule}, got {show(value)}") from None
    if not lo <= v <= hi:
        raise invalid(f"{name}: {rule}, got {v}")
    return int(v)


def optional_int(value, name: str, lo: int, hi: int, rule: str | None = None) -> int | None:
    """None, or :func:`int_arg`."""
    return None if value is None else int_arg(value, name, lo, hi, rule)


def bool_arg(value, name: str) -> bool:
    """A bool from a bool, a numpy bool, or the ints 0 and 1."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if _is_bool(value):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise invalid(f"{name}: must be a bool, got {show(value)}")


def str_arg(value, name: str) -> str:
    """A str that passes through the C ABI unchanged (UTF-8, no NUL)."""
    if not isinstance(value, str):
        raise invalid(f"{name}: must be a str, got {show(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"{name}: must be encodable as UTF-8, got {show(value)}") from None
    if "\0" in value:
        raise invalid(f"{name}: must not contain NUL characters, got {show(value)}")
    return value


def choice_arg(value, name: str, choices) -> str:
    """One of the strings in ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise invalid(f"{name}: must be one of {', '.join(repr(c) for c in choices)}, got {show(value)}")
    return value


PAGE_LAYOUTS = ("hnd", "nhd")


def page_layout_arg(value) -> str:
    """A paged pool's layout, ``"nhd"`` or ``"hnd"`` in either case (FlashInfer writes
    ``"NHD"`` / ``"HND"``), as lower case."""
    if not isinstance(value, str) or value.lower() not in PAGE_LAYOUTS:
        raise invalid(f"page_layout: must be one of 'hnd', 'nhd' (either case), got {show(value)}")
    return value.lower()


def out_dtype_arg(value, default, allowed) -> np.dtype:
    """The ``out_dtype`` of an op: ``default`` (its input's dtype) for None,
    else one of ``allowed``."""
    if value is None:
        return np.dtype(default)
    return dtype_arg(value, "out_dtype", allowed)


def dtype_arg(value, name: str, allowed) -> np.dtype:
    """A numpy dtype among ``allowed``."""
    try:
        with warnings.catch_warnings():  # numpy's deprecated aliases ("a") are rejected below anyway
            warnings.simplefilter("ignore")
            dt = np.dtype(value)
    except Exception:
        dt = None
    if dt is None or dt not in allowed:
        raise invalid(f"{name}: must be one of {', '.join(str(d) for d in allowed)}, got {show(value)}")
    return dt


_devices: dict = {}
_devices_lock = threading.Lock()


_device_module = None


def device_arg(device):
    """The device of a call: None gives the default device, a
    :class:`pyfa.Device` is used as is, a backend name (``"cpu"``, ``"cuda"``,
    ``"metal"``, ``"auto"``) opens that backend's device once per process."""
    global _device_module
    if _device_module is None:
        from . import device as d

        _device_module = d
    Device, default_device = _device_module.Device, _device_module.default_device
    if type(device) is Device:
        return device
    if device is None:
        return _device_module._default or default_device()
    if isinstance(device, Device):
        return device
    if isinstance(device, str):
        name = str_arg(device, "device")
        with _devices_lock:
            if name not in _devices:
                _devices[name] = Device(name)
            return _devices[name]
    raise invalid(f"device: must be a pyfa.Device, a backend name or None, got {show(device)}")


def index_array(value, name: str, batch: int, lo: int, hi: int) -> np.ndarray:
    """An int32 ``[batch]`` array from an int or a 1-D sequence of ints, each in ``[lo, hi]``."""
    rule = "expected an int or a 1-D sequence of ints"
    try:
        v = np.asarray(value)
    except Exception:
        raise invalid(f"{name}: {rule}, got {show(value)}") from None
    if v.dtype.kind not in "iu" or v.ndim > 1:
        raise invalid(f"{name}: {rule}, got {show(value)}")
    if v.ndim == 1 and v.shape[0] != batch:
        raise invalid(f"{name}: expected {batch} values (one per sequence), got {v.shape[0]}")
    if v.dtype == np.uint64:
        big = v > np.uint64(hi)
        if big.any():
            i = int(np.argmax(big)) if v.ndim else 0
            raise invalid(f"{name}[{i}]: {int(v.reshape(-1)[i])} must be in {lo}..{hi}")
    v = v.astype(np.int64)
    v = np.broadcast_to(v, (batch,)) if v.ndim == 0 else v
    bad = (v < lo) | (v > hi)
    if bad.any():
        i = int(np.argmax(bad))
        raise invalid(f"{name}[{i}]: {int(v[i])} must be in {lo}..{hi}")
    return np.ascontiguousarray(v.astype(np.int32))


def default_scale(scale, head_dim: int) -> float:
    """``scale`` as a float, ``1/sqrt(head_dim)`` when None (1.0 for head_dim 0,
    which the library rejects by name)."""
    return float_arg(scale, "scale", default=1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0)


def u32_fields(**fields) -> None:
    """Dimensions bound for uint32 struct fields, checked before anything is
    sized from them (a zero-size array's dims can be huge); the message is
    the one a struct field out of range gives."""
    for name, value in fields.items():
        if not 0 <= value <= U32_MAX:
            raise invalid(f"{name}: out of the range of its C field, got {show(value)}")


def params(ctype: str, fields: dict):
    """``ffi.new(ctype, fields)`` for a parameter struct, a field out of its C
    type's range being an InvalidArgumentError that names the field."""
    try:
        return ffi.new(ctype, fields)
    except (OverflowError, TypeError, ValueError):
        pass
    p = ffi.new(ctype)
    _assign(p, fields, "")
    return p  # unreachable unless the failing field could not be found


def _assign(p, fields: dict, prefix: str) -> None:
    for key, value in fields.items():
        name = prefix + key
        if isinstance(value, dict):
            _assign(getattr(p, key), value, name + ".")
            continue
        try:
            setattr(p, key, value)
        except (OverflowError, TypeError, ValueError):
            raise invalid(f"{name}: out of the range of its C field, got {show(value)}") from None
