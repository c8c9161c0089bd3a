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
_local = threading.local()


def _table() -> OrderedDict:
    t = getattr(_local, "plans", None)
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
    """This thread's encoder for `device`, bound to `stream` (0: its own)."""
    encoders = getattr(_local, "encoders", None)
    if encoders is None:
        encoders = _local.encoders = {}
    entry = encoders.get(device)
    if entry is None:
        entry = encoders[device] = [device.encoder(), 0]
    if entry[1] != stream:
        check(lib.pyfa_encoder_set_stream(entry[0], stream))
        entry[1] = stream
    return entry[0]


def discard_encoder(device) -> None:
    """Drops this thread's encoder for `device` (after a failed run left dispatches recorded)."""
    encoders = getattr(_local, "encoders", None)
    if encoders is not None:
        encoders.pop(device, None)


def run(device, runner, plan, enc, args) -> None:
    """Records a run and finishes it (commit; wait unless on a caller's stream),
    in one call into the library."""
    args.flags = lib.PYFA_RUN_FINISH
    status = runner(plan, enc, args)
    if status != 0:
        discard_encoder(device)
        check(status)
