"""Prepared ops (the C ABI's plans) behind the functional API, and the
per-thread encoder they record on.

A plan is made once per thread for what fixes it (device, shapes, dtypes,
options, and a power-of-two bucket of the longest kv_len, which sizes the
split) and reused: a call then checks its arguments, fills one run-argument
struct and records the op; nothing is allocated on the device, so a call can
be captured in a CUDA graph once the same call ran outside the capture. Each
thread keeps its own plans in a small least-recently-used table: a plan's
workspace serves the stream order of one thread's calls (two streams of one
thread running the same shapes at the same time would share it).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from ._native import ffi, lib
from .errors import check

_MAX_PLANS = 64


class _ThreadState(threading.local):
    """This thread's plans, encoders and the encoder a multi-dispatch call is recording on. The class
    defaults make a lookup of a field not set yet a plain miss, not a caught AttributeError (whose
    message would be formatted on every call)."""
    plans = None
    encoders = None
    recording = None


_local = _ThreadState()


def _table() -> OrderedDict:
    t = _local.plans
    if t is None:
        t = _local.plans = OrderedDict()
    return t


def cached(key, make):
    """The plan for `key`, made by `make()` (a new plan handle) on a miss."""
    table = _table()
    plan = table.get(key)
    if plan is None:
        plan = make()
        table[key] = plan
        if len(table) > _MAX_PLANS:
            table.popitem(last=False)
    else:
        table.move_to_end(key)
    return plan


def new_plan(constructor, device, desc):
    """A plan handle from `constructor` (pyfa_decode_plan_new, ...), freed with the Python object."""
    out = ffi.new("pyfa_plan **")
    check(constructor(out, device.handle, desc))
    return ffi.gc(out[0], lib.pyfa_plan_free)


def length_bucket(n: int) -> int:
    """The smallest power of two >= n (at least 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def encoder(device, stream: int = 0):
    """This thread's encoder for `device`, bound to `stream` (0: its own), empty: what a
    multi-dispatch call (pyfa/_io.py) recorded before it failed is dropped first."""
    encoders = _local.encoders
    if encoders is None:
        encoders = _local.encoders = {}
    entry = encoders.get(device)
    if entry is None:
        entry = encoders[device] = [device.encoder(), 0]
    enc = entry[0]
    if _local.recording is enc:
        check(lib.pyfa_encoder_reset(enc))
        _local.recording = None
    if entry[1] != stream:
        check(lib.pyfa_encoder_set_stream(enc, stream))
        entry[1] = stream
    return enc


def begin_recording(enc) -> None:
    """`enc` (this thread's encoder) records a call of several dispatches; until end_recording,
    anything on it is that call's, and dropped if the call failed before submitting."""
    _local.recording = enc


def end_recording(enc) -> None:
    if _local.recording is enc:
        _local.recording = None


def discard_encoder(device) -> None:
    """Drops this thread's encoder for `device` (after a failed run left dispatches recorded)."""
    encoders = _local.encoders
    if encoders is not None:
        encoders.pop(device, None)


def run(device, runner, plan, enc, args, finish: bool = True) -> None:
    """Records a run and, with `finish`, finishes it (commit; wait unless on a caller's
    stream), in one call into the library. A failed run drops this thread's encoder."""
    args.flags = lib.PYFA_RUN_FINISH if finish else 0
    status = runner(plan, enc, args)
    if status != 0:
        discard_encoder(device)
        check(status)


# ---- what the repeat paths share (pyfa/decode.py, pyfa/paged.py, pyfa/prefill.py, pyfa/kvcache.py) --
def repeat_table(local) -> dict:
    """The table of remembered calls a repeat path keeps in the thread-local ``local``, with room for
    one more entry: past 64 the oldest is dropped (a model makes a few shapes, a sweep many)."""
    table = getattr(local, "table", None)
    if table is None:
        table = local.table = {}
    elif len(table) >= 64:
        table.pop(next(iter(table)))
    return table


# A host repeat path stores ffi.from_buffer(array) straight into the 64-bit address field of a kept
# run-argument struct, seen as a pointer: possible where pointers are 64-bit.
HOST_SLOTS = ffi.sizeof("void *") == 8


def address_slots(args, *fields):
    """The address fields of the run arguments ``args`` (a name, or a tuple of names for a nested
    field) as ``void *`` slots: ``slot[0] = ffi.from_buffer(a)`` points the field at ``a``."""
    return tuple(ffi.cast("void **", ffi.addressof(args, *(f if type(f) is tuple else (f,)))) for f in fields)


def repeat_length_kind(kv_len, tensor_type):
    """How a repeat path keys kv_len: an int's length_bucket, -1 for a tensor of
    ``tensor_type``, None for anything else (take the full path)."""
    tl = type(kv_len)
    if tl is int:
        return 1 << (kv_len - 1).bit_length() if kv_len >= 1 else None  # length_bucket, inline
    return -1 if tl is tensor_type else None


def repeat_bind_lengths(field, kv_len, kind, host, batch, gpu, capacity, int32) -> bool:
    """Puts a repeat call's kv_len into its kept run-argument field: the int into
    every slot of ``host`` (which the field points at), or the int32 tensor's
    address. False when the call must take the full path instead (an int past
    ``capacity``; a tensor of another dtype, GPU or size, or not contiguous)."""
    if kind == -1:
        if kv_len.dtype != int32 or kv_len.get_device() != gpu or kv_len.numel() != batch or kv_len.dim() > 1 \
                or not kv_len.is_contiguous():
            return False
        field.device.address, field.device.nbytes = kv_len.data_ptr(), 4 * batch
        return True
    if kv_len > capacity:
        return False
    for i in range(batch):
        host[i] = kv_len
    return True
