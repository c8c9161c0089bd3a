"""Single-sequence KV caches for decode: a dense one (:class:`KVCache`) over
kv_append and flash_attn_vec, and the shared ring bookkeeping that
:class:`pyfa.TurboQuantKVCache` reuses.

Both keep K and V in device memory (private storage: on a GPU nothing of the
cache travels to or from the host per call), laid out
``[num_kv_heads, capacity, ...]``.
Without ``sliding_window`` a cache holds at most ``capacity`` tokens and an
append past that raises :class:`pyfa.PyfaError` without changing anything.
With ``sliding_window`` (``capacity >= sliding_window``) it is a ring buffer:
token ``t`` (counting every token ever appended) lives in slot
``t % capacity``, and attention sees the last ``sliding_window`` tokens.

An append encodes K and V on the device: one dispatch each, or on CUDA one for
both (a TurboQuant cache's when K and V have one bit width). Where rows come
from:

- host arrays (numpy, torch CPU tensors): read in place on host-visible
  devices; on a GPU copied once into the cache's staging buffer (kept and
  reused, grown only for a larger append). The call waits for its work.
- GPU arrays (torch / cupy CUDA tensors, on a cuda device): read in place;
  the work is queued on the caller's current stream and the call returns
  without waiting. ``attend`` with a GPU ``q`` likewise returns an array of
  the caller's framework, queued on its stream (temporaries come from that
  framework's allocator, so attends on different streams never share one).

Stream order is the caller's to keep between its own calls: calls with GPU
arrays run in the order of the streams they are queued on, calls with host
arrays on pyfa's own stream, which runs after work queued on CUDA's legacy
default stream (torch's and cupy's default). After GPU-array calls on
another stream, synchronise it before a host-array call or a read
(``dequantize``, ``codes``).

On a device with its own memory (CUDA) the cache's length also lives on the
device (a ``pyfa_kv_state``): an append advances it and writes where it says,
and an attend reads it, when their kernels run. So ``append`` and ``attend``
with GPU arrays can be captured in a CUDA graph (``torch.cuda.graph``), and
each replay appends after the rows of the replay before it, as eager calls
would. The host cannot follow replays: once a graph captured an append, what
needs the length on the host (``len(cache)``, reads, the capacity check of an
append to a cache without a window) reads it back from the device, which
waits for the device (synchronise the replays' stream first). A replayed
append that finds a cache without a window full writes nothing; the next
host read of the length raises :class:`pyfa.PyfaError` saying how many were
dropped. A cache's memory stays allocated after the cache is gone once a graph
captured an append or an attend of it, since the graph may replay later.

A cache may be shared between threads: appends, attends and reads of one
cache are serialised by the cache's lock, so every append gets its own slots
(none is lost or overwritten by another) and an attend sees the rows of the
appends that were issued before it (with GPU arrays: queued before it on the
same stream), never a partly written one. With GPU arrays the length advances
on the device in stream order, so appends to one cache on different streams
must be ordered by the caller (one stream per cache, or a synchronisation
between them), as attends after them must be.
"""
from __future__ import annotations

import threading

import numpy as np

from . import _args, _io, _plans, cuda_interop, dtypes
from ._native import ffi, lib
from .cuda_interop import GpuArray
from .device import Device
from .errors import check, invalid

_ACCEPTED = dtypes.FLOAT_TYPES + (np.dtype(np.float64),)
_SOURCE_TYPES = frozenset(dtypes.FLOAT_TYPES)  # row dtypes the append kernels read
_torch_tensor = None  # torch.Tensor once torch is imported (the torch fast paths compare types with it)


def _note_torch(t) -> bool:
    """Whether ``t`` is a plain torch.Tensor (then remembered as the type the fast paths compare with)."""
    global _torch_tensor
    if _torch_tensor is None:
        import torch

        _torch_tensor = torch.Tensor
    return type(t) is _torch_tensor


def _side_name(side: str) -> str:
    """What a side of _RingCache._side is, for messages."""
    return {"host": "a host array", "torch": "a torch CUDA tensor"}.get(side, f"a {side} GPU array")


K, V = 0, 1  # roles of a cache's two row streams (staging buffers, TurboQuant streams)
_GRAPH_KEPT = []  # memory of caches a CUDA graph captured: a replay may come after the cache is gone


def _positive_int(value, name: str, hi: int = _args.U32_MAX) -> int:
    return _args.int_arg(value, name, 1, hi, rule=f"must be a positive int (at most {hi})")


class _RingCache:
    """Shape checks, slot bookkeeping and row sources shared by the caches."""

    def __init__(self, num_kv_heads, head_dim, capacity, sliding_window, device):
        self.num_kv_heads = _positive_int(num_kv_heads, "num_kv_heads")
        self.head_dim = _positive_int(head_dim, "head_dim")
        self.capacity = _positive_int(capacity, "capacity", _args.I32_MAX)
        if sliding_window is not None:
            sliding_window = _positive_int(sliding_window, "sliding_window")
            if self.capacity < sliding_window:
                raise invalid(f"capacity: {self.capacity} must be >= sliding_window ({sliding_window}) "
                              "for a ring-buffer cache")
        self.sliding_window = sliding_window
        self.device = _args.device_arg(device)
        self._total = 0  # tokens ever appended; read and advanced under _lock
        self._staged = {}  # device buffers for host queries and results on a GPU
        self._lock = threading.RLock()
        self._staging = {}  # role -> device buffer for host rows (GPU devices); used under _lock
        self._append_runs = {}  # (k dtype, v dtype) -> (plan, run arguments); used under _lock
        self._host_visible = self.device.host_visible
        self._repeats = threading.local()  # this thread's remembered attends (_attend_repeat)
        self._state = None  # the length on the device (pyfa_kv_state), where the device has its own memory
        self._captured = False  # a graph captured an append: replays move the length without the host
        self._kept = False  # the memory is in _GRAPH_KEPT (a graph captured an append or an attend)
        self._dropped_seen = 0  # appends the state counted as dropped, as reported
        if not self._host_visible:
            self._keep_length_on_device()

    def _keep_length_on_device(self) -> None:
        """Keeps the length in a device pyfa_kv_state that appends advance and attends read when their
        kernels run (what graph capture needs). On where the device has its own memory; tests also turn
        it on elsewhere, before the first append."""
        self._state = self.device.buffer((4,), np.int32, storage="private")
        self._state.write(np.zeros(4, np.int32))
        self._state_address = lib.pyfa_buffer_address(self._state.handle)
        self._capturing_flag = ffi.new("uint32_t *")

    def _capturing(self, enc) -> bool:
        """Whether a graph is capturing `enc`'s stream, asked before recording a GPU-array call on it;
        if so, the cache's memory is kept for the graph's replays."""
        check(lib.pyfa_encoder_is_capturing(enc, self._capturing_flag))
        if not self._capturing_flag[0]:
            return False
        self._keep_for_graphs()
        return True

    def _note_capture(self, enc) -> bool:
        """Before recording a GPU-array append on `enc`: whether a graph captures it (the host count
        then stops following the device)."""
        if not self._capturing(enc):
            return False
        self._captured = True
        return True

    def _keep_for_graphs(self) -> None:
        """Keeps the cache's memory for the process's life: a graph that captured a call may replay
        after the cache is gone."""
        if not self._kept:
            self._kept = True
            _GRAPH_KEPT.append((self._state,) + tuple(b for _, b in self._append_memory()))

    def _sync_length(self) -> None:
        """The host count re-read from the device state once a graph captured an append (replays move it);
        raises, once, for appends a replay dropped because a cache without a window was full."""
        if not self._captured:
            return
        _, kv_len, ring_start, dropped = (int(x) for x in self._state.read())
        kv_len = min(max(kv_len, 0), self.capacity)  # as the kernels clamp what they read
        ring_start = ring_start if 0 <= ring_start < self.capacity else 0
        self._total = kv_len if kv_len < self.capacity else self.capacity + ring_start
        if dropped > self._dropped_seen:
            n, self._dropped_seen = dropped - self._dropped_seen, dropped
            raise invalid(f"append: {n} replayed append(s) found the cache full ({self.capacity} tokens, no "
                          "sliding_window) and wrote nothing")

    def __len__(self) -> int:
        """Tokens stored (at most ``capacity``); attention sees the last ``sliding_window`` of them."""
        with self._lock:
            self._sync_length()
            return min(self._total, self.capacity)

    def _rows(self, x, name: str):
        """``x`` checked as ``[n, num_kv_heads, head_dim]`` floats, n >= 1: a numpy array, or a
        GpuArray that this cache's device reads."""
        a = _io.as_array(x, name, allowed=_ACCEPTED, ndims=(3,), gpu=True)
        if isinstance(a, GpuArray):
            _io.gpu_input(self.device, a, name)
        if a.shape[0] < 1 or tuple(a.shape[1:]) != (self.num_kv_heads, self.head_dim):
            raise invalid(f"{name}: expected shape [n >= 1, num_kv_heads={self.num_kv_heads}, "
                          f"head_dim={self.head_dim}], got {tuple(a.shape)}")
        return a

    def _check_kv(self, k, v):
        """(k, v, like): both host arrays (like None) or both GPU arrays of one framework (like = k)."""
        k, v = self._rows(k, "k"), self._rows(v, "v")
        like = k if isinstance(k, GpuArray) else None
        if isinstance(v, GpuArray) != (like is not None):
            side = "a GPU array" if like is not None else "a host array"
            raise invalid(f"v: must be {side} like k (k and v are read on one side)")
        if like is not None and like.kind == "torch":
            _note_torch(like.obj)
        if like is not None and v.kind != k.kind:
            raise invalid(f"v: a {v.kind} array, k is a {k.kind} array (pass both from one framework)")
        if k.shape[0] != v.shape[0]:
            raise invalid(f"v: {v.shape[0]} tokens, k has {k.shape[0]} (append needs one v row per k row)")
        return k, v, like

    def _plan_append(self, n: int, capturing: bool = False):
        """(first source row, write slot, rows to pass), or raises before anything changes. With the
        length on the device the run passes n as num_tokens and the library places the rows (slot 0).
        A captured append is checked when it replays, on the device (a full cache without a window
        drops it and counts the drop), since the length is the replays' then; an eager one after a
        capture reads back the length the replays left."""
        if capturing:
            return max(0, n - self.capacity), 0, min(n, self.capacity)
        if self._captured and self.sliding_window is None:
            self._sync_length()
        if self.sliding_window is None and self._total + n > self.capacity:
            raise invalid(f"append: {n} tokens would exceed capacity {self.capacity} ({self._total} stored); "
                          "pass sliding_window for a ring buffer")
        skip = max(0, n - self.capacity)  # a ring keeps only the last `capacity` rows
        if self._state is not None:
            return skip, 0, n - skip
        return skip, (self._total + skip) % self.capacity, n - skip

    def _append_run(self, k_dtype, v_dtype):
        """(plan, run arguments) of appends from k and v rows of these dtypes, made on first use
        with the cache memory bound. Kept per cache, not per thread: an append plan has no
        workspace, and appends run under the cache's lock."""
        runs = self._append_runs
        entry = runs.get((k_dtype, v_dtype))
        if entry is None:
            desc = _args.params("pyfa_kv_append_plan_desc *", {
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "kv_capacity": self.capacity,
                "k_dtype": dtypes.code(k_dtype), "v_dtype": dtypes.code(v_dtype), **self._append_desc()})
            plan = _plans.new_plan(lib.pyfa_kv_append_plan_new, self.device, desc)
            args = ffi.new("pyfa_kv_append_run_args *")
            for field, buffer in self._append_memory():
                t = getattr(args, field)
                t.address, t.nbytes = lib.pyfa_buffer_address(buffer.handle), buffer.nbytes
            if self._state is not None:
                args.state.address, args.state.nbytes = self._state_address, 16
                args.ring = int(self.sliding_window is not None)
            entry = runs[(k_dtype, v_dtype)] = (plan, args)
        return entry

    def _source(self, rows, first: int, role: int):
        """(address, bytes, keepalive) of ``rows[first:]`` for an append: GPU arrays in place; host
        rows in place on host-visible devices, else copied into the staging buffer of ``role``
        (K or V)."""
        if isinstance(rows, GpuArray):
            row = rows.nbytes // rows.shape[0]
            return rows.ptr + first * row, row * (rows.shape[0] - first), rows
        part = rows[first:]  # a leading-axis slice of a C-contiguous array: contiguous
        if self._host_visible:
            return _io.address(part), part.nbytes, part
        buf = self._stage(part, role)
        return lib.pyfa_buffer_address(buf.handle), part.nbytes, buf

    def _append(self, k, v, finish: bool = True, side: str | None = None):
        """Appends ``k``, ``v`` (any rows ``append`` takes); returns (how many, what the run reads:
        keep it alive until the run is submitted). ``finish=False`` leaves the run recorded on this
        thread's encoder for the next run to submit. ``side``:
        where the rows must be ("host", or a GPU array's framework: "torch", "cupy", ...), else
        PyfaError before anything changes."""
        if side in (None, "host") and self._fast_rows(k, v):
            return k.shape[0], self._append_rows(k, v, None, finish)
        if side in (None, "torch") and self._append_torch(k, v, finish):
            return k.shape[0], None  # the caller's tensors
        k, v, like = self._check_kv(k, v)
        found = like.kind if like is not None else "host"
        if side is not None and found != side:
            raise invalid(f"k: {_side_name(found)} and q {_side_name(side)}: pass q, k and v from one side "
                          "(one call's work runs on one stream)")
        if like is None:  # float64 rounds once, on the host, to what the append reads
            k, v = (a.astype(self._float64_rows_as) if a.dtype == np.float64 else a for a in (k, v))
        return k.shape[0], self._append_rows(k, v, like, finish)

    @staticmethod
    def _side(q) -> str:
        """Where ``q`` is: "host" (numpy, torch CPU tensors, anything read as a host array) or the
        framework of a GPU array."""
        if type(q) is np.ndarray:
            return "host"
        if _torch_tensor is not None and type(q) is _torch_tensor:
            return "torch" if q.is_cuda else "host"
        a = _io.as_array(q, "q", allowed=_ACCEPTED, ndims=(2,), gpu=True)
        return a.kind if isinstance(a, GpuArray) else "host"

    def _attend_after_append(self, q, k, v, attend):
        """``attend()`` after appending ``k``, ``v``, both in one submission under the cache's lock.
        If the attend raises, the recorded append is dropped with this thread's encoder and the
        count goes back: nothing is stored."""
        if k is None or v is None:
            raise invalid(f"{'k' if k is None else 'v'}: pass k and v together (the rows appended before "
                          "attending), or neither")
        side = self._side(q)
        with self._lock:
            n, _read = self._append(k, v, finish=False, side=side)  # _read: alive until attend() submits
            try:
                return attend()
            except BaseException:
                _plans.discard_encoder(self.device)
                self._total -= n
                raise

    def _append_rows(self, k, v, like, finish: bool = True):
        """Appends checked rows (``k``, ``v`` of dtypes the kernels read) in one run that encodes
        K and V; nothing changes when it raises. Returns what the run reads (host rows or the
        staging buffers)."""
        with self._lock:
            stream = like.stream if like is not None else 0
            enc = _plans.encoder(self.device, stream)
            capturing = like is not None and self._state is not None and self._note_capture(enc)
            skip, slot, count = self._plan_append(k.shape[0], capturing)
            plan, args = self._append_run(k.dtype, v.dtype)
            args.k.address, args.k.nbytes, keep_k = self._source(k, skip, K)
            args.v.address, args.v.nbytes, keep_v = self._source(v, skip, V)
            args.num_tokens, args.write_pos = count if self._state is None else k.shape[0], slot
            _plans.run(self.device, lib.pyfa_kv_append_run, plan, enc, args, finish)
            self._total += k.shape[0]
        return keep_k, keep_v

    def _fast_rows(self, k, v) -> bool:
        """Whether ``k``, ``v`` are numpy rows an append takes as they are on a host-visible device
        (one dtype the kernels read, ``[n >= 1, num_kv_heads, head_dim]``, C-contiguous), so the
        general checks can be skipped; anything else takes them."""
        if type(k) is not np.ndarray or type(v) is not np.ndarray or not self._host_visible:
            return False
        shape = k.shape
        return (len(shape) == 3 and shape[0] >= 1 and shape[1] == self.num_kv_heads and shape[2] == self.head_dim
                and v.shape == shape and k.dtype == v.dtype and k.dtype in _SOURCE_TYPES
                and k.flags.c_contiguous and v.flags.c_contiguous)

    def _append_torch(self, k, v, finish: bool = True) -> bool:
        """Appends ``k``, ``v`` when they are torch CUDA tensors an append reads as they are (on
        CUDA device 0 with a GPU cache device, one float dtype the kernels read, ``[n >= 1,
        num_kv_heads, head_dim]``, contiguous), queued on torch's current stream, and returns True;
        False for anything else (the general checks then take them). The torch decode loop's path:
        what the general path would check is checked here, with no intermediate objects."""
        T = _torch_tensor
        if T is None or type(k) is not T or type(v) is not T or self._host_visible:
            return False
        dt = cuda_interop._TORCH_DTYPES.get(k.dtype)
        shape = k.shape
        if (dt not in _SOURCE_TYPES or v.dtype != k.dtype or len(shape) != 3 or shape[0] < 1
                or shape[1] != self.num_kv_heads or shape[2] != self.head_dim or v.shape != shape
                or not (k.is_cuda and v.is_cuda) or k.get_device() != 0 or v.get_device() != 0
                or not k.is_contiguous() or not v.is_contiguous()):
            return False
        n = shape[0]
        with self._lock:
            enc = _plans.encoder(self.device, cuda_interop.torch_stream_handle(0))
            capturing = self._state is not None and self._note_capture(enc)
            skip, slot, count = self._plan_append(n, capturing)
            plan, args = self._append_run(dt, dt)
            row = dt.itemsize * shape[1] * shape[2]
            args.k.address, args.k.nbytes = k.data_ptr() + skip * row, count * row
            args.v.address, args.v.nbytes = v.data_ptr() + skip * row, count * row
            args.num_tokens, args.write_pos = count if self._state is None else n, slot
            _plans.run(self.device, lib.pyfa_kv_append_run, plan, enc, args, finish)
            self._total += n
        return True

    def _stage(self, rows: np.ndarray, role: int):
        """``rows`` copied into the device staging buffer of ``role``. It is reused by the next
        host append (host appends wait for their work, so it is free again) and replaced only
        by one of another dtype or with more rows (at least doubling, at most ``capacity``)."""
        buf = self._staging.get(role)
        n = rows.shape[0]
        if buf is None or buf.dtype != rows.dtype or buf.shape[0] < n:
            grown = n if buf is None or buf.dtype != rows.dtype else min(max(n, 2 * buf.shape[0]), self.capacity)
            buf = self.device.buffer((grown,) + rows.shape[1:], rows.dtype, storage="private")
            self._staging[role] = buf
        check(lib.pyfa_buffer_write(buf.handle, 0, ffi.from_buffer(rows), rows.nbytes))
        return buf

    def _ring(self):
        """(kv_len, ring_start) of the flash_attn_vec contract (re-read from the device once captured)."""
        self._sync_length()
        if self._total < self.capacity:
            return self._total, 0
        return self.capacity, self._total % self.capacity

    def _check_query(self, q, scale, softcap, out_dtype, return_lse):
        """(q, like, scale, softcap, output dtype, return_lse) of an attend: q a numpy array (float64
        becomes float32 first, so its default output dtype is float32) or a GpuArray (like = q)."""
        q = _io.as_array(q, "q", allowed=_ACCEPTED, ndims=(2,), gpu=True)
        like = None
        if isinstance(q, GpuArray):
            _io.gpu_input(self.device, q, "q")
            like = q
            if q.kind == "torch":
                _note_torch(q.obj)  # later torch attends may then repeat this one
        elif q.dtype == np.float64:
            q = q.astype(np.float32)
        H, D = q.shape
        if D != self.head_dim or H == 0 or H % self.num_kv_heads:
            raise invalid(f"q: expected shape [H, head_dim={self.head_dim}] with H a multiple of "
                          f"num_kv_heads ({self.num_kv_heads}), got {tuple(q.shape)}")
        return (q, like, _args.default_scale(scale, self.head_dim), _args.float_arg(softcap, "softcap"),
                _args.out_dtype_arg(out_dtype, q.dtype, dtypes.FLOAT_TYPES), _args.bool_arg(return_lse, "return_lse"))

    def _repeat_key(self, q, scale, softcap, out_dtype, return_lse):
        """(q's shape, dtype, the scale as given) when an attend may take or seed the repeat path,
        every option but scale at its default: a numpy q of a float type the kernels read on a
        host-visible device, or a torch CUDA q on a GPU device; else None."""
        if not (out_dtype is None and return_lse is False and type(softcap) is float and softcap == 0.0
                and (scale is None or type(scale) is float)):
            return None
        if type(q) is np.ndarray:
            return (q.shape, q.dtype, scale) if q.dtype in _SOURCE_TYPES and self._host_visible else None
        if _torch_tensor is not None and type(q) is _torch_tensor and not self._host_visible:
            return (q.shape, q.dtype, scale) if cuda_interop._TORCH_DTYPES.get(q.dtype) in _SOURCE_TYPES else None
        return None

    def _attend_planned(self, kind, q, like, desc, constructor, runner, tensors, out_dtype, return_lse,
                        repeat_key=None):
        """One attend as a plan run: the plan (cached per thread by `desc`) checks
        every option, so an empty cache rejects what a full one would; `tensors`
        are (field, buffer) of the cache's memory. Returns (out, lse or None).
        `repeat_key`: the call may be remembered under it for _attend_repeat."""
        H, D = q.shape
        device_state = self._state is not None
        if device_state:
            # The kernels read the length; the split is sized for the capacity, so the plan a graph
            # captures is the one eager calls made, whatever length its replays reach.
            kv_len, ring_start = (-1 if self._captured else min(self._total, self.capacity)), 0
            bucket = _plans.length_bucket(self.capacity)
        else:
            kv_len, ring_start = self._ring()
            bucket = _plans.length_bucket(kv_len)  # sizes the split; a growing cache keeps its plan within a bucket
        key = (kind, self.device, repr(desc), q.dtype, out_dtype, return_lse, bucket)
        plan = _plans.cached(key, lambda: _plans.new_plan(constructor, self.device, _args.params(
            "pyfa_tq_decode_plan_desc *" if kind == "tq" else "pyfa_decode_plan_desc *",
            dict(desc, q_dtype=dtypes.code(q.dtype), out_dtype=dtypes.code(out_dtype), return_lse=int(return_lse),
                 max_kv_len=min(bucket, self.capacity)))))
        # A GPU-array attend that a graph captures, or may replay beside, runs even over an empty cache.
        may_replay = device_state and like is not None and (
            self._kept or self._capturing(_plans.encoder(self.device, like.stream)))
        if kv_len == 0 and not may_replay:
            out = self._zeros((H, D), like, out_dtype)
            lse = self._zeros((H,), like, np.float32, -np.inf) if return_lse else None
            return out, lse
        args = ffi.new("pyfa_tq_decode_run_args *" if kind == "tq" else "pyfa_decode_run_args *")
        for field, buffer in tensors:
            t = getattr(args, field)
            t.address, t.nbytes = lib.pyfa_buffer_address(buffer.handle), buffer.nbytes
        if device_state:
            self._bind_state(args)
        else:
            _io.sequence_values(kv_len, "kv_len", 1, None).set(args.kv_len)
            _io.sequence_values(ring_start, "ring_start", 1, None).set(args.ring_start)
        staged = like is None and not self.device.host_visible
        if staged:
            # Host arrays on a GPU: q goes up and the results come back through
            # device buffers this cache keeps (the call waits for them).
            qb = self._query_buffer(("q", q.shape, q.dtype), q.shape, q.dtype)
            qb.write(q)
            outs = [self._query_buffer(("out", H, out_dtype), (H, D), out_dtype)]
            outs += [self._query_buffer(("lse", H), (H,), np.float32)] if return_lse else []
            for field, b in zip(("q", "out", "lse"), [qb] + outs):
                t = getattr(args, field)
                t.address, t.nbytes = lib.pyfa_buffer_address(b.handle), b.nbytes
            _plans.run(self.device, runner, plan, _plans.encoder(self.device, 0), args)
            results = [b.read() for b in outs]
            return results[0], (results[1] if return_lse else None)
        result, out_address = _io.result_array((H, D), out_dtype, None, like=like)
        args.q.address, args.q.nbytes = _io.address(q), q.nbytes
        args.out.address, args.out.nbytes = out_address, H * D * np.dtype(out_dtype).itemsize
        lse = None
        if return_lse:
            lse, args.lse.address = _io.result_array((H,), np.float32, None, "lse", like=like)
            args.lse.nbytes = H * 4
        stream = like.stream if like is not None else 0
        _plans.run(self.device, runner, plan, _plans.encoder(self.device, stream), args)
        if repeat_key is not None:
            if like is None and type(result) is np.ndarray and _plans.HOST_SLOTS:
                self._remember_attend(repeat_key + (bucket,), plan, runner, args, kind)
            elif like is not None and like.kind == "torch" and _note_torch(result):
                self._remember_attend(repeat_key + (bucket,), plan, runner, args, kind, gpu=True)
        return result, lse

    def _bind_state(self, args) -> None:
        """Points a decode run's kv_len and ring_start at the device state's fields."""
        for field, offset in (("kv_len", 4), ("ring_start", 8)):
            t = getattr(args, field)
            t.host = ffi.NULL
            t.device.address, t.device.nbytes = self._state_address + offset, 4

    # ---- the repeat path ----------------------------------------------------------------------------
    # A decode loop attends with the same q shape and dtype and the defaults every step. After such a
    # call on a numpy q on a host-visible device has gone through every check, its plan and run
    # arguments (the cache memory bound) are kept for this thread under what the checks looked at (q's
    # shape and dtype, the scale as given, the length bucket that picked the plan); a later call that
    # matches sets q's and the result's addresses and the cache's current length and runs. The same
    # for a torch CUDA q on a GPU device (entries of their own), whose result is a new torch tensor
    # and whose run is queued on torch's current stream.

    def _remember_attend(self, key, plan, runner, args, kind, gpu=False):
        name = "gpu_entries" if gpu else "entries"
        entries = getattr(self._repeats, name, None)
        if entries is None:
            entries = {}
            setattr(self._repeats, name, entries)
        elif len(entries) >= 8 and key not in entries:
            entries.pop(next(iter(entries)))
        kept = ffi.new("pyfa_tq_decode_run_args *" if kind == "tq" else "pyfa_decode_run_args *", args[0])
        lengths = ffi.new("int32_t[2]")  # kv_len, ring_start: written per call (the device state's otherwise)
        if self._state is None:
            kept.kv_len.host, kept.ring_start.host = lengths, lengths + 1
        entries[key] = (plan, runner, kept, lengths, None if gpu else _plans.address_slots(kept, "q", "out"))

    def _attend_repeat(self, q, scale):
        """The result of an attend matching a remembered one (every default: a numpy ``q`` on a
        host-visible device, a torch CUDA ``q`` on a GPU device), or None (take the full path)."""
        gpu = not self._host_visible
        entries = getattr(self._repeats, "gpu_entries" if gpu else "entries", None)
        if entries is None or not (q.is_cuda and q.get_device() == 0 and q.is_contiguous() if gpu
                                   else q.flags.c_contiguous):
            return None
        with self._lock:
            if self._state is not None:  # as _attend_planned: the capacity's plan, the device's length
                if self._total == 0 and not self._captured:
                    return None
                kv_len, ring_start = self.capacity, 0
            else:
                kv_len, ring_start = self._ring()
                if kv_len == 0:
                    return None
            entry = entries.get((q.shape, q.dtype, scale, 1 << (kv_len - 1).bit_length()))
            if entry is None:
                return None
            plan, runner, args, lengths, slots = entry
            lengths[0], lengths[1] = kv_len, ring_start
            if gpu:
                out = q.new_empty(q.shape)
                args.q.address, args.out.address = q.data_ptr(), out.data_ptr()
                enc = _plans.encoder(self.device, cuda_interop.torch_stream_handle(0))
                if self._state is not None and not self._kept:
                    self._capturing(enc)
            else:
                out = np.empty(q.shape, q.dtype)
                slots[0][0] = ffi.from_buffer(q)
                slots[1][0] = ffi.from_buffer(out)
                enc = _plans.encoder(self.device, 0)
            _plans.run(self.device, runner, plan, enc, args)
        return out

    def _query_buffer(self, key, shape, dtype):
        """A private device buffer of this cache, kept per `key` while its shape holds."""
        b = self._staged.get(key)
        if b is None:
            b = self._staged[key] = self.device.buffer(shape, dtype, storage="private")
        return b

    @staticmethod
    def _zeros(shape, like: GpuArray | None, dtype=np.float32, value=0.0):
        """The result of an attend over an empty cache (zeros; the LSE is -inf)."""
        if like is None:
            return np.full(shape, value, dtype)
        a = like.zeros(shape, dtype)
        if value != 0.0:
            a.fill_(value) if like.kind == "torch" else a.fill(value)
        return a

    @staticmethod
    def _run(device: Device, record) -> None:
        enc = device.encoder()
        record(enc)
        check(lib.pyfa_encoder_commit(enc))
        check(lib.pyfa_encoder_wait(enc))


class KVCache(_RingCache):
    """A dense KV cache for one sequence, attended with flash_attn_vec.

    Parameters
    ----------
    num_kv_heads, head_dim, capacity : positive ints; the cache holds K and V as
        ``[num_kv_heads, capacity, head_dim]`` of ``dtype`` on ``device``.
    dtype : float16 (default), bfloat16 or float32: the storage type.
    sliding_window : None, or the number of latest tokens attention sees (ring buffer,
        ``capacity >= sliding_window``; flash-attn's ``window_size=(sliding_window - 1, 0)``).

    Attributes: ``num_kv_heads``, ``head_dim``, ``capacity``, ``sliding_window``, ``dtype``,
    ``device``; ``len(cache)`` is the number of tokens stored.

    ``attend`` follows :func:`pyfa.decode_attention`'s conventions (GQA, scale, softcap, LSE);
    against flash-attn's and torch's: README.md, "Conventions for flash-attn and torch users".
    On a cuda device the length also lives on the device, so ``append`` and ``attend`` with CUDA
    tensors can be captured in a CUDA graph, each replay appending after the last (the module's
    documentation says what the host reads back after a capture).

    >>> import numpy as np, pyfa
    >>> c = pyfa.KVCache(2, 64, 16)
    >>> c.append(np.ones((3, 2, 64), np.float32), np.ones((3, 2, 64), np.float32))
    >>> len(c), c.attend(np.ones((4, 64), np.float32)).shape
    (3, (4, 64))
    """

    def __init__(self, num_kv_heads, head_dim, capacity, *, dtype=np.float16, sliding_window=None, device=None):
        super().__init__(num_kv_heads, head_dim, capacity, sliding_window, device)
        self.dtype = _args.dtype_arg(dtype, "dtype", dtypes.FLOAT_TYPES)
        shape = (self.num_kv_heads, self.capacity, self.head_dim)
        self._k = self.device.buffer(shape, self.dtype, storage="private")
        self._v = self.device.buffer(shape, self.dtype, storage="private")

    @property
    def nbytes(self) -> int:
        """Bytes of K and V storage."""
        return self._k.nbytes + self._v.nbytes

    def append(self, k, v) -> None:
        """Appends ``k``, ``v`` of shape ``[n, num_kv_heads, head_dim]``: host arrays (numpy or torch
        CPU tensors, float16/bfloat16/float32/float64) or, on a cuda device, CUDA arrays
        (float16/bfloat16/float32, read in place, queued on the caller's stream). One kv_append
        dispatch each for K and V; rows are rounded to the cache dtype to nearest even. Raises
        PyfaError, changing nothing, on bad input or (without a window) overflow."""
        self._append(k, v)

    @property
    def _float64_rows_as(self):  # float64 rows round once, on the host, straight to the cache dtype
        return self.dtype

    def _append_desc(self) -> dict:
        return {"cache_dtype": dtypes.code(self.dtype)}

    def _append_memory(self):
        return (("k_cache", self._k), ("v_cache", self._v))

    def attend(self, q, *, k=None, v=None, scale=None, softcap=0.0, out_dtype=None, return_lse=False):
        """Decode attention of ``q [H, head_dim]`` (float16/bfloat16/float32/float64) over the cache;
        returns ``[H, head_dim]`` of ``out_dtype`` (None: q's dtype, float32 for a float64 q), zeros
        for an empty cache, in q's array type: numpy, a torch CPU tensor, or (a CUDA ``q`` on a cuda
        device) an array of q's framework, queued on its current stream without waiting.
        ``return_lse``: also the float32 LSE ``[H]`` (as :func:`pyfa.decode_attention`'s; ``-inf``
        for an empty cache), as ``(out, lse)``.

        ``k``, ``v``: rows to append first, as :meth:`append` takes them, on q's side (host arrays
        with a host ``q``, CUDA arrays of q's framework with a CUDA one); the attention then sees
        them (flash-attn's ``flash_attn_with_kvcache(q, k_cache, v_cache, k, v)``). The append and
        the attention are one submission, and the call is all or nothing: if either is refused,
        nothing is appended."""
        if k is not None or v is not None:
            return self._attend_after_append(q, k, v, lambda: self.attend(
                q, scale=scale, softcap=softcap, out_dtype=out_dtype, return_lse=return_lse))
        repeat_key = self._repeat_key(q, scale, softcap, out_dtype, return_lse)
        if repeat_key is not None:
            out = self._attend_repeat(q, scale)
            if out is not None:
                return out
        q_arg = q
        q, like, scale, softcap, out_dtype, return_lse = self._check_query(q, scale, softcap, out_dtype, return_lse)
        H, D = q.shape
        desc = {"attn": {"batch": 1, "num_heads": H, "num_kv_heads": self.num_kv_heads, "head_dim": D,
                         "kv_capacity": self.capacity, "nwg": 0, "window": self.sliding_window or 0,
                         "scale": scale, "softcap": softcap},
                "kv_dtype": dtypes.code(self.dtype)}
        with self._lock:
            out, lse = self._attend_planned("dense", q, like, desc, lib.pyfa_decode_plan_new, lib.pyfa_decode_run,
                                            (("k_cache", self._k), ("v_cache", self._v)), out_dtype, return_lse,
                                            repeat_key)
        out = _io.host_result(out, q_arg)
        return (out, _io.host_result(lse, q_arg)) if return_lse else out

