"""`python -m pyfa info`: the package and library versions, the backends
compiled in and which open here, and for each device what it runs.

Everything is asked of the library: the kernel lists (head dims, dtypes,
TurboQuant widths) from pyfa.supported(), which reads the shader headers'
X-macro lists; the device facts from pyfa_device_info; which ops run by
running each once at a tiny shape (an op a backend lacks raises
UnsupportedError, shown as its message); plans by asking for one; the
device clock from pyfa_encoder_device_seconds. The one rule kept in Python is
pyfa._io.gpu_like's: GPU arrays (and so device kv_len tensors and CUDA graph
capture) go only to devices that are not host-visible.
"""
from __future__ import annotations

import importlib.metadata
import os
import sys

import numpy as np

import pyfa
from pyfa import _args, _plans, dtypes
from pyfa._native import LIBRARY_PATH, ffi, lib
from pyfa.errors import check

from ._measure import SHORT


def add_arguments(p) -> None:
    p.add_argument("--no-probe", dest="probe", action="store_false",
                   help="do not run each op once per device (only what the library reports)")


def version() -> str:
    try:
        return importlib.metadata.version("pyfa")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: a source tree)"


def library_lines() -> list[str]:
    kinds = ", ".join(SHORT[dtypes.from_code(c)] for c in pyfa.supported("attn_dtypes"))
    return [
        f"pyfa {version()}: package {os.path.dirname(pyfa.__file__)}",
        f"library {LIBRARY_PATH} (C ABI version {lib.pyfa_abi_version()})",
        f"kernels built for (every backend): head dims {_join(pyfa.supported('head_dims'))}; dtypes {kinds}; "
        f"TurboQuant head dims {_join(pyfa.supported('tq_head_dims'))}, bits {_join(pyfa.supported('tq_bits'))}",
    ]


def open_devices() -> list[tuple[str, pyfa.Device | None, str]]:
    """(backend, device or None, why not) for each backend compiled in, best first."""
    found = []
    for name in pyfa.backends():
        try:
            found.append((name, pyfa.Device(name), ""))
        except pyfa.PyfaError as e:
            found.append((name, None, str(e).splitlines()[0]))
    return found


def probe_ops(device: pyfa.Device) -> dict:
    """Each op run once at the smallest TurboQuant head dim: {op: "yes" or "no (the error's first line)"}."""
    D = min(pyfa.supported("tq_head_dims"))
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, D)).astype(np.float32)
    kv = rng.standard_normal((1, 8, D)).astype(np.float16)
    qp = rng.standard_normal((1, 2, 4, D)).astype(np.float16)
    rows = rng.standard_normal((4, 1, D))

    def prefill():
        o, lse = pyfa.attention(qp, qp[:, :1], qp[:, :1], causal=True, return_lse=True, device=device)
        pyfa.merge_attention_states(o, lse, o, lse, device=device)

    def cache(kind):
        c = kind(1, D, 8, device=device)
        c.append(rows, rows)
        c.attend(q)

    ops = {"decode": lambda: pyfa.decode_attention(q, kv, kv, 8, device=device),
           "prefill + merge": prefill,
           "KVCache": lambda: cache(pyfa.KVCache),
           "TurboQuantKVCache": lambda: cache(pyfa.TurboQuantKVCache)}
    found = {}
    for name, fn in ops.items():
        try:
            fn()
            found[name] = "yes"
        except pyfa.PyfaError as e:
            found[name] = f"no ({str(e).splitlines()[0]})"
    return found


def plans(device: pyfa.Device) -> str:
    """Whether the device makes the C ABI's plans (the prepared calls every op runs on where arrays are
    read in place): a decode plan asked for directly, "yes" or "no (why)"."""
    desc = _args.params("pyfa_decode_plan_desc *", {
        "attn": {"batch": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 64, "kv_capacity": 8, "nwg": 0,
                 "window": 0, "scale": 0.125, "softcap": 0.0},
        "q_dtype": lib.PYFA_DTYPE_F32, "kv_dtype": lib.PYFA_DTYPE_F16, "out_dtype": lib.PYFA_DTYPE_F32,
        "max_kv_len": 8, "return_lse": 0})
    try:
        _plans.new_plan(lib.pyfa_decode_plan_new, device, desc)
    except pyfa.PyfaError as e:
        return f"no ({str(e).splitlines()[0]})"
    return "yes"


def device_clock(device: pyfa.Device) -> bool:
    """Whether the backend reports device execution time (pyfa_encoder_device_seconds), which it
    does for an encoder after a wait: an empty submission is waited for, then the clock asked."""
    enc = device.encoder()
    check(lib.pyfa_encoder_commit(enc))
    check(lib.pyfa_encoder_wait(enc))
    return lib.pyfa_encoder_device_seconds(enc, ffi.new("double *")) == lib.PYFA_OK


def device_lines(device: pyfa.Device, probe: bool) -> list[str]:
    memory = f"{device.memory_bytes / 2**30:.1f} GiB" if device.memory_bytes else "unknown"
    lines = [f"  device: {device.name}",
             f"  GPU: {'yes' if device.is_gpu else 'no'}; compute units {device.compute_units}; memory {memory}; "
             f"SIMD width {device.simd_width}"]
    if probe:
        lines.append("  ops: " + ", ".join(f"{k} {v}" for k, v in probe_ops(device).items()))
    lines.append(f"  plans (pyfa_*_plan_new, prepared calls): {plans(device)}")
    if device.host_visible:
        lines.append("  arrays: numpy and torch CPU tensors read in place; no GPU arrays, so no device kv_len "
                     "tensors or CUDA graphs")
    else:
        lines.append("  arrays: torch / cupy GPU tensors read in place on the caller's stream; device kv_len / "
                     "ring_start tensors (CUDA graph capture): yes; caches keep their length on the device "
                     "(cache steps capture too); numpy arrays are copied")
    lines.append(f"  device clock (pyfa_encoder_device_seconds): {'yes' if device_clock(device) else 'no'}")
    return lines


def run(args, out=None) -> int:
    out = out or sys.stdout
    for line in library_lines():
        print(line, file=out)
    devices = open_devices()
    print(f"backends compiled in: {_join(n for n, _, _ in devices)}; open here: "
          f"{_join(n for n, d, _ in devices if d) or 'none'}", file=out)
    chosen = args.backend or "auto"  # info shows every backend unless one is named
    for name, device, why in devices:
        if chosen not in ("auto", name):
            continue
        print(f"{name}:", file=out)
        if device is None:
            print(f"  not available here: {why}", file=out)
            continue
        for line in device_lines(device, args.probe):
            print(line, file=out)
    if chosen not in ("auto", *pyfa.backends()):
        pyfa.Device(chosen)  # raises the library's error naming the backend
    default = pyfa.Device("auto") if chosen == "auto" else None
    if default is not None:
        print(f"default device (auto): {default.backend}", file=out)
    return 0


def _join(values) -> str:
    return ", ".join(str(v) for v in values)
