"""Single-sequence KV caches for decode: a dense one (:class:`KVCache`) over
flash_attn_vec, and the shared ring bookkeeping that
:class:`pyfa.TurboQuantKVCache` reuses.

Both keep K and V in device buffers laid out ``[num_kv_heads, capacity, ...]``.
Without ``sliding_window`` a cache holds at most ``capacity`` tokens and an
append past that raises :class:`pyfa.PyfaError` without changing anything.
With ``sliding_window`` (``capacity >= sliding_window``) it is a ring buffer:
token ``t`` (counting every token ever appended) lives in slot
``t % capacity``, and attention sees the last ``sliding_window`` tokens.

A cache may be shared between threads: appends, attends and reads of one
cache are serialised by the cache's lock, so every append gets its own slots
(none is lost or overwritten by another) and an attend sees the rows of the
appends that finished before it, never a partly written one.
"""
from __future__ import annotations

import threading

import numpy as np

from . import _args, _io, cuda_interop, dtypes
from ._native import ffi, lib
from .device import Device
from .errors import check, invalid

_ACCEPTED = dtypes.FLOAT_TYPES + (np.dtype(np.float64),)


def _host_only(x, name: str) -> None:
    """Caches copy host rows into their own device buffers: GPU arrays are refused by name."""
    if cuda_interop.is_gpu_array(x):
        raise invalid(f"{name}: caches take host (numpy) arrays and copy them to their device; got a GPU array")


def _positive_int(value, name: str, hi: int = _args.U32_MAX) -> int:
    return _args.int_arg(value, name, 1, hi, rule=f"must be a positive int (at most {hi})")


class _RingCache:
    """Shape checks and slot bookkeeping shared by the caches."""

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
        self._lock = threading.RLock()

    def __len__(self) -> int:
        """Tokens stored (at most ``capacity``); attention sees the last ``sliding_window`` of them."""
        return min(self._total, self.capacity)

    def _rows(self, x, name: str) -> np.ndarray:
        """``x`` checked as ``[n, num_kv_heads, head_dim]`` floats, n >= 1."""
        _host_only(x, name)
        a = _io.as_array(x, name, allowed=_ACCEPTED, ndims=(3,))
        if a.shape[0] < 1 or a.shape[1:] != (self.num_kv_heads, self.head_dim):
            raise invalid(f"{name}: expected shape [n >= 1, num_kv_heads={self.num_kv_heads}, "
                          f"head_dim={self.head_dim}], got {a.shape}")
        return a

    def _check_kv(self, k, v):
        k, v = self._rows(k, "k"), self._rows(v, "v")
        if k.shape[0] != v.shape[0]:
            raise invalid(f"v: {v.shape[0]} tokens, k has {k.shape[0]} (append needs one v row per k row)")
        return k, v

    def _plan_append(self, n: int):
        """(first source row, write slot, rows to write), or raises before anything changes."""
        if self.sliding_window is None and self._total + n > self.capacity:
            raise invalid(f"append: {n} tokens would exceed capacity {self.capacity} ({self._total} stored); "
                          "pass sliding_window for a ring buffer")
        skip = max(0, n - self.capacity)  # a ring keeps only the last `capacity` rows
        return skip, (self._total + skip) % self.capacity, n - skip

    def _ring(self):
        """(kv_len, ring_start) of the flash_attn_vec contract."""
        if self._total < self.capacity:
            return self._total, 0
        return self.capacity, self._total % self.capacity

    def _check_query(self, q, scale, softcap, out_dtype, return_lse):
        """(q, scale, softcap, output dtype, return_lse) of an attend; float64 q
        becomes float32 first, so its default output dtype is float32."""
        _host_only(q, "q")
        q = _io.as_array(q, "q", allowed=_ACCEPTED, ndims=(2,))
        if q.dtype == np.float64:
            q = q.astype(np.float32)
        H, D = q.shape
        if D != self.head_dim or H == 0 or H % self.num_kv_heads:
            raise invalid(f"q: expected shape [H, head_dim={self.head_dim}] with H a multiple of "
                          f"num_kv_heads ({self.num_kv_heads}), got {q.shape}")
        return (q, _args.default_scale(scale, self.head_dim), _args.float_arg(softcap, "softcap"),
                _args.out_dtype_arg(out_dtype, q.dtype, dtypes.FLOAT_TYPES), _args.bool_arg(return_lse, "return_lse"))

    @staticmethod
    def _empty_result(H, D, out_dtype, return_lse):
        """What attending an empty cache gives: zeros, and LSE -inf (no visible key)."""
        out = np.zeros((H, D), out_dtype)
        return (out, np.full(H, -np.inf, np.float32)) if return_lse else out

    def _decode(self, H, D, out_dtype, return_lse, call):
        """Runs ``call(enc, out_handle, lse_handle)`` and returns out (and the LSE)."""
        result, out = _io.output(self.device, (H, D), out_dtype, None)
        lse, lse_buf = _io.output(self.device, (H,), np.float32, None, "lse") if return_lse else (None, None)
        self._run(self.device, lambda enc: call(enc, out.handle, _io.handle(lse_buf)))
        _io.finish(self.device, result, out)
        if not return_lse:
            return result
        return result, _io.finish(self.device, lse, lse_buf)

    def _index(self, value: int) -> np.ndarray:
        return np.array([value], dtype=np.int32)

    @staticmethod
    def _write_rows(buffer, rows: np.ndarray, slot: int, capacity: int) -> None:
        """rows ``[n, Hkv, X]`` into ``buffer [Hkv, capacity, X]`` at slots slot.. (wrapping)."""
        n, Hkv = rows.shape[:2]
        row_bytes = rows[0, 0].nbytes
        per_head = np.ascontiguousarray(rows.transpose(1, 0, *range(2, rows.ndim)))
        first = min(n, capacity - slot)
        for h in range(Hkv):
            for start, count, at in ((0, first, slot), (first, n - first, 0)):
                if count:
                    chunk = per_head[h, start:start + count]
                    check(lib.pyfa_buffer_write(buffer.handle, (h * capacity + at) * row_bytes,
                                                ffi.from_buffer(chunk), chunk.nbytes))

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
        ``capacity >= sliding_window``).

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
        self._k = self.device.buffer(shape, self.dtype)
        self._v = self.device.buffer(shape, self.dtype)
        self._tmp = {}

    @property
    def nbytes(self) -> int:
        """Bytes of K and V storage."""
        return self._k.nbytes + self._v.nbytes

    def append(self, k, v) -> None:
        """Appends ``k``, ``v`` of shape ``[n, num_kv_heads, head_dim]`` (float16/bfloat16/float32/float64).
        Raises PyfaError, changing nothing, on bad shapes or (without a window) overflow."""
        k, v = self._check_kv(k, v)
        with self._lock:
            skip, slot, count = self._plan_append(k.shape[0])
            for buf, rows in ((self._k, k), (self._v, v)):
                self._write_rows(buf, rows[skip:].astype(self.dtype), slot, self.capacity)
            self._total += k.shape[0]

    def attend(self, q, *, scale=None, softcap=0.0, out_dtype=None, return_lse=False):
        """Decode attention of ``q [H, head_dim]`` (float16/bfloat16/float32/float64) over the cache;
        returns ``[H, head_dim]`` of ``out_dtype`` (None: q's dtype, float32 for a float64 q), zeros
        for an empty cache. ``return_lse``: also the float32 LSE ``[H]`` (as
        :func:`pyfa.decode_attention`'s; ``-inf`` for an empty cache), as ``(out, lse)``."""
        q, scale, softcap, out_dtype, return_lse = self._check_query(q, scale, softcap, out_dtype, return_lse)
        with self._lock:
            return self._attend(q, scale, softcap, out_dtype, return_lse)

    def _attend(self, q, scale, softcap, out_dtype, return_lse):
        H, D = q.shape
        kv_len, ring_start = self._ring()
        params = _args.params("pyfa_flash_attn_vec_params *", {
            "batch": 1, "num_heads": H, "num_kv_heads": self.num_kv_heads, "head_dim": D,
            "kv_capacity": self.capacity, "nwg": 0, "window": self.sliding_window or 0,
            "scale": scale, "softcap": softcap})
        tmp_bytes = ffi.new("uint64_t *")
        # The plan checks every option, so an empty cache rejects what a full one would.
        check(lib.pyfa_flash_attn_vec_plan(self.device.handle, params, dtypes.code(self.dtype), kv_len, tmp_bytes))
        if kv_len == 0:
            return self._empty_result(H, D, out_dtype, return_lse)
        tmp = self._scratch(int(tmp_bytes[0]))
        lens, rings = (_io.to_device(self.device, self._index(x)) for x in (kv_len, ring_start))
        qb = _io.to_device(self.device, q)
        return self._decode(H, D, out_dtype, return_lse, lambda enc, out, lse: check(lib.pyfa_flash_attn_vec(
            enc, params, qb.handle, self._k.handle, self._v.handle, lens.handle, rings.handle, _io.handle(tmp), out,
            lse)))

    def _scratch(self, nbytes: int):
        if nbytes == 0:
            return None
        if nbytes not in self._tmp:
            self._tmp = {nbytes: self.device.buffer((nbytes // 4,), np.float32, storage="private")}
        return self._tmp[nbytes]
