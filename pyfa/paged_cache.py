"""Paged KV pools for many sequences: :class:`PagedKVCache` (dense) and
:class:`TurboQuantPagedKVCache` (TurboQuant codes).

A pool holds one layer's K and V for every sequence in pages of ``page_size``
tokens (layouts in ``shaders/common/paged_kv_params.h``). The pools live on
the device (numpy arrays on the CPU and Metal backends, torch tensors, else
cupy arrays, on a cuda device); pages are handed out on the host from a free
list. ``add_sequence`` returns a new sequence id; ``append(seq_ids, k, v)``
writes a batch of token rows, row ``i`` to sequence ``seq_ids[i]`` (any number
of rows per sequence, in order), taking pages as sequences grow and encoding
the whole batch in one dispatch; ``free_sequence`` returns a sequence's pages.
``block_table(seq_ids)`` and ``kv_len(seq_ids)`` are the int32 arrays a paged
decode takes, kept between calls and rebuilt only when pages or lengths
changed; ``attend`` runs the paged decode over them.

An append that needs more pages than are free raises :class:`pyfa.PyfaError`
and changes nothing: pages are counted before any is taken, and pages taken
for an append whose dispatch fails go back to the free list. Pools, page
lists and lengths of one pool are guarded by its lock.
"""
from __future__ import annotations

import itertools
import threading

import numpy as np

from . import _args, _io, _plans, cuda_interop, dtypes
from . import paged_append as pa
from . import turboquant as tq
from ._native import ffi, lib
from .cuda_interop import GpuArray, _TORCH_FROM_NP
from .device import Device
from .errors import UnsupportedError, check, invalid

_TABLES_KEPT = 8  # distinct seq_ids lists whose block_table / kv_len stay cached


def _to_framework(a: np.ndarray, like):
    """A copy of host array ``a`` on the GPU of ``like`` (a torch or cupy array)."""
    if type(like).__module__.startswith("torch"):
        import torch

        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == dtypes.bfloat16 else torch.from_numpy(a)
        return t.to(like.device)
    import cupy

    if a.dtype == dtypes.bfloat16:
        raise UnsupportedError("q: bfloat16 host queries over cupy pools (cupy has no bfloat16); pass a GPU array")
    with cupy.cuda.Device(like.device.id):
        return cupy.asarray(a)


def _to_host(x):
    """A numpy copy of a torch or cupy GPU result."""
    if type(x).__module__.startswith("torch"):
        import torch

        x = x.cpu()
        return x.view(torch.int16).numpy().view(dtypes.bfloat16) if x.dtype == torch.bfloat16 else x.numpy()
    return x.get()


def _device_zeros(device: Device, shape, dtype):
    """Zeros of ``shape``: a numpy array where the device reads host memory, else a torch CUDA
    tensor (cupy when torch is absent) on device 0."""
    dtype = np.dtype(dtype)
    if device.host_visible:
        return np.zeros(shape, dtype)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        return torch.zeros(shape, dtype=_TORCH_FROM_NP[dtype](), device="cuda:0")
    try:
        import cupy
    except ImportError:
        raise UnsupportedError(f"device: a pool on a {device.backend!r} device is allocated with torch or cupy; "
                               "neither is installed") from None
    with cupy.cuda.Device(0):
        return cupy.zeros(tuple(shape), dtype=dtype)


def _device_ints(device: Device, values: np.ndarray, like):
    """int32 ``values`` where kernels read them: the array itself on host-visible devices, else a
    GPU copy in the framework of ``like`` (a torch or cupy array), queued on its current stream."""
    if device.host_visible:
        return values
    if type(like).__module__.startswith("torch"):
        import torch

        return torch.as_tensor(values, device=like.device)
    import cupy

    with cupy.cuda.Device(0):
        return cupy.asarray(values)


class _Sequence:
    __slots__ = ("pages", "length")

    def __init__(self):
        self.pages: list[int] = []
        self.length = 0


class _PagedPool:
    """Page allocation, sequence bookkeeping and the decode tables of a pool."""

    def __init__(self, num_pages, page_size, num_kv_heads, head_dim, page_layout, device):
        self.num_pages = _args.int_arg(num_pages, "num_pages", 1, _args.I32_MAX, rule="must be a positive int")
        self.page_size = _args.int_arg(page_size, "page_size", 1, pa.MAX_PAGE_SIZE,
                                       rule=f"must be a power of two in 1..{pa.MAX_PAGE_SIZE}")
        if self.page_size & (self.page_size - 1):
            raise invalid(f"page_size: {self.page_size} must be a power of two in 1..{pa.MAX_PAGE_SIZE}")
        self.num_kv_heads = _args.int_arg(num_kv_heads, "num_kv_heads", 1, _args.U32_MAX, rule="must be a positive int")
        self.head_dim = _args.int_arg(head_dim, "head_dim", 1, _args.U32_MAX, rule="must be a positive int")
        if self.num_pages * self.page_size * self.num_kv_heads > _args.U32_MAX:
            raise invalid(f"num_pages: num_pages * page_size * num_kv_heads = "
                          f"{self.num_pages * self.page_size * self.num_kv_heads} must fit 32 bits")
        self.page_layout = pa.layout_arg(page_layout)
        self.device = _args.device_arg(device)
        self._lock = threading.RLock()
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._seqs: dict[int, _Sequence] = {}
        self._ids = itertools.count()
        self._pages_version = 0  # bumped when any page list changes (block tables)
        self._len_version = 0  # bumped when any length changes (kv_len)
        self._tables: dict = {}

    # -- bookkeeping -------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Live sequences."""
        return len(self._seqs)

    @property
    def free_pages(self) -> int:
        """Pages on the free list."""
        return len(self._free)

    @property
    def sequences(self) -> list[int]:
        """Ids of the live sequences, oldest first."""
        with self._lock:
            return list(self._seqs)

    def length(self, seq_id) -> int:
        """Tokens sequence ``seq_id`` holds."""
        with self._lock:
            return self._seq(seq_id, "seq_id").length

    def add_sequence(self) -> int:
        """A new empty sequence; returns its id (never reused by this pool)."""
        with self._lock:
            sid = next(self._ids)
            self._seqs[sid] = _Sequence()
            self._len_version += 1
            return sid

    def free_sequence(self, seq_id) -> None:
        """Ends sequence ``seq_id``: its pages return to the free list (their contents are left as they
        are and overwritten by later appends)."""
        with self._lock:
            seq = self._seq(seq_id, "seq_id")
            del self._seqs[seq_id]
            self._free.extend(reversed(seq.pages))
            self._pages_version += 1
            self._len_version += 1

    def _seq(self, seq_id, name: str) -> _Sequence:
        seq = self._seqs.get(seq_id) if isinstance(seq_id, (int, np.integer)) and not isinstance(seq_id, bool) else None
        if seq is None:
            raise invalid(f"{name}: {_args.show(seq_id)} is not a live sequence of this pool")
        return seq

    def _seq_ids(self, seq_ids, name: str = "seq_ids") -> tuple:
        try:
            ids = np.asarray(seq_ids)
        except Exception:
            raise invalid(f"{name}: expected a 1-D sequence of sequence ids, got {_args.show(seq_ids)}") from None
        if ids.dtype.kind not in "iu" or ids.ndim != 1:
            raise invalid(f"{name}: expected a 1-D sequence of sequence ids, got {_args.show(seq_ids)}")
        out = tuple(int(s) for s in ids)
        for i, s in enumerate(out):
            self._seq(s, f"{name}[{i}]")
        return out

    def _allocate(self, seq_ids: tuple):
        """(slot_mapping int32, pages taken per sequence) for rows of ``seq_ids``; pages come off the
        free list only when all of them are there, so a refusal changes nothing."""
        ps = self.page_size
        counts: dict[int, int] = {}
        for s in seq_ids:
            counts[s] = counts.get(s, 0) + 1
        need = {s: -(-(self._seqs[s].length + c) // ps) - len(self._seqs[s].pages) for s, c in counts.items()}
        total = sum(n for n in need.values() if n > 0)
        if total > len(self._free):
            raise invalid(f"append: {len(seq_ids)} tokens need {total} new pages, the pool has {len(self._free)} free "
                          f"(num_pages={self.num_pages}, page_size={ps}); free sequences or use a larger pool")
        taken = {s: [self._free.pop() for _ in range(n)] for s, n in need.items() if n > 0}
        slots = np.empty(len(seq_ids), np.int32)
        seen: dict[int, int] = {}
        for i, s in enumerate(seq_ids):
            seq = self._seqs[s]
            pos = seq.length + seen.get(s, 0)
            seen[s] = seen.get(s, 0) + 1
            pages = seq.pages
            page = pages[pos // ps] if pos // ps < len(pages) else taken[s][pos // ps - len(pages)]
            slots[i] = page * ps + pos % ps
        return slots, taken, counts

    def _release(self, taken: dict) -> None:
        for pages in reversed(list(taken.values())):
            self._free.extend(reversed(pages))

    def append(self, seq_ids, k, v) -> None:
        """Writes rows ``k``, ``v [num_tokens, num_kv_heads, head_dim]``, row ``i`` to sequence
        ``seq_ids[i]`` (ints ``[num_tokens]``; one sequence's rows in order), in one dispatch.
        Rows are host arrays (float16/bfloat16/float32/float64) or, on a cuda device, CUDA arrays
        (queued on their stream without waiting). Raises PyfaError, changing no sequence's
        contents or length, on bad input or when the free pages do not suffice."""
        k, v, like = pa._rows(k, v, self.device, self.num_kv_heads, self.head_dim)
        with self._lock:
            ids = self._seq_ids(seq_ids)
            if len(ids) != k.shape[0]:
                raise invalid(f"seq_ids: {len(ids)} ids, k has {k.shape[0]} rows (one id per row)")
            slots, taken, counts = self._allocate(ids)
            try:
                # GPU rows: the slots go up as a tensor of the rows' framework on its stream (no
                # host staging buffer per append); the pool computed them, so they need no check.
                self._run(k, v, like, slots)
            except BaseException:
                self._release(taken)
                raise
            for s, pages in taken.items():
                self._seqs[s].pages.extend(pages)
            for s, c in counts.items():
                self._seqs[s].length += c
            self._pages_version += bool(taken)
            self._len_version += 1

    # -- the append's plan run ---------------------------------------------------------------------
    def _plan(self, src_dtype):
        """The pool's pyfa_paged_append plan for rows of ``src_dtype`` (made once per dtype)."""
        plan = self._plans.get(src_dtype)
        if plan is None:
            desc = _args.params("pyfa_paged_append_plan_desc *", dict(
                self._desc, pages={"page_size": self.page_size, "num_pages": self.num_pages,
                                   "layout": pa.LAYOUTS[self.page_layout]},
                num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, src_dtype=dtypes.code(src_dtype)))
            plan = self._plans[src_dtype] = _plans.new_plan(lib.pyfa_paged_append_plan_new, self.device, desc)
        return plan

    def _run(self, k, v, like, slots) -> None:
        """One plan run writing rows k, v at ``slots`` (host int32, or a GPU int32 array with GPU rows):
        GPU arrays and (host-visible devices) host arrays in place; host arrays on a GPU device go
        through device copies, and the run then waits for its work."""
        args = ffi.new("pyfa_paged_append_run_args *")
        keep = []  # device copies that must live until the run is recorded
        for field, a in (("k", k), ("v", v)):
            if not isinstance(a, GpuArray) and cuda_interop.is_gpu_array(a):
                a = cuda_interop.describe(a, field)
            if isinstance(a, GpuArray) or self.device.host_visible:
                address, nbytes = _io.address(a), a.nbytes
            else:
                b = self.device.buffer(a.shape, a.dtype, storage="private")
                b.write(a)
                keep.append(b)
                address, nbytes = lib.pyfa_buffer_address(b.handle), b.nbytes
            t = getattr(args, field)
            t.address, t.nbytes = address, nbytes
        if not isinstance(slots, np.ndarray):  # a GPU int32 array the kernel reads
            g = slots if isinstance(slots, GpuArray) else cuda_interop.describe(slots, "slot_mapping")
            args.slot_mapping.device.address, args.slot_mapping.device.nbytes = g.ptr, g.nbytes
        elif self.device.host_visible:
            # The array itself: no inline-size limit (Metal's setBytes takes 4 KB).
            args.slot_mapping.device.address, args.slot_mapping.device.nbytes = _io.address(slots), slots.nbytes
        else:
            # On a GPU the slots travel with the launch (no copy, no allocation); the library checks them.
            host = ffi.from_buffer("int32_t[]", slots)
            keep.append(slots)
            args.slot_mapping.host = host
        for field, (address, nbytes) in zip(self._pool_fields, self._pool_tensors):
            t = getattr(args, field)
            t.address, t.nbytes = address, nbytes
        args.num_tokens = k.shape[0]
        stream = like.stream if like is not None else 0
        _plans.run(self.device, lib.pyfa_paged_append_run, self._plan(k.dtype), _plans.encoder(self.device, stream),
                   args)

    def _bind_pools(self, arrays) -> None:
        """Buffers over the pools (kept: they own nothing, they name the memory) and their tensors."""
        self._buffers = [pa._pool_buffer(self.device, pa._pool(a, name, self.device, (np.dtype(dt),), nd))
                         for a, name, dt, nd in arrays]
        self._pool_tensors = [(lib.pyfa_buffer_address(b.handle), b.nbytes) for b in self._buffers]
        self._plans = {}

    # -- decode tables -----------------------------------------------------------------------------
    def _table(self, kind: str, seq_ids):
        with self._lock:
            ids = self._seq_ids(seq_ids)
            version = self._pages_version if kind == "block_table" else self._len_version
            hit = self._tables.get((kind, ids))
            if hit is not None and hit[0] == version:
                return hit[1]
            if kind == "block_table":
                width = max([1] + [len(self._seqs[s].pages) for s in ids])
                host = np.zeros((len(ids), width), np.int32)  # unused columns: page 0 (never read past kv_len)
                for b, s in enumerate(ids):
                    pages = self._seqs[s].pages
                    host[b, :len(pages)] = pages
            else:
                host = np.array([self._seqs[s].length for s in ids], np.int32)
            value = _device_ints(self.device, host, self._pool_arrays()[0])
            if len(self._tables) >= _TABLES_KEPT:
                self._tables.clear()
            self._tables[(kind, ids)] = (version, value)
            return value

    def block_table(self, seq_ids):
        """int32 ``[len(seq_ids), pages_per_seq]``: the pages of each sequence in order
        (pages_per_seq = the most pages any of them holds, at least 1; unused entries 0), on the
        pool's device. The same array comes back until a page list changes: treat it as read-only."""
        return self._table("block_table", seq_ids)

    def kv_len(self, seq_ids):
        """int32 ``[len(seq_ids)]``: the tokens each sequence holds, on the pool's device; kept
        until a length changes (read-only)."""
        return self._table("kv_len", seq_ids)

    def _decode_args(self, scale, softcap, window, out_dtype, return_lse):
        return dict(page_layout=self.page_layout, scale=scale, softcap=softcap, window=window,
                    out_dtype=out_dtype, return_lse=return_lse, device=self.device)

    def _attend(self, decode, q, seq_ids, pools, kwargs):
        """decode(q, *pools, block_table, kv_len, **kwargs) for ``seq_ids``. A host q over pools on
        a GPU is copied to the pools' GPU and the results come back as numpy arrays (as a ring
        cache's attend does); GPU queries are read in place."""
        table = self.block_table(seq_ids)
        if self.device.host_visible:
            lens = self.kv_len(seq_ids)
        else:
            # Host lengths travel with the launch (no upload per step; they change every step)
            # and let the plan size the split for the batch's actual lengths.
            ids = self._seq_ids(seq_ids)
            lens = np.fromiter((self._seqs[s].length for s in ids), np.int32, len(ids))
        if self.device.host_visible or cuda_interop.is_gpu_array(q):
            return decode(q, *pools, table, lens, **kwargs)
        q = _io.as_array(q, "q", allowed=dtypes.FLOAT_TYPES + (np.dtype(np.float64),), ndims=(3,))
        if q.dtype == np.float64:
            q = q.astype(np.float32)
        res = decode(_to_framework(q, pools[0]), *pools, table, lens, **kwargs)
        return tuple(_to_host(r) for r in res) if isinstance(res, tuple) else _to_host(res)

    # -- reading back ------------------------------------------------------------------------------
    def _rows_of(self, pool: np.ndarray, seq: _Sequence) -> np.ndarray:
        """``[Hkv, length, ...]`` of a host copy of a pool, for one sequence."""
        pages = np.asarray(seq.pages, np.intp)
        n = seq.length
        taken = pool[pages]
        if self.page_layout == "nhd":  # [pages, page_size, Hkv, ...] -> [Hkv, tokens, ...]
            rows = taken.reshape((-1,) + taken.shape[2:])[:n]
            return np.ascontiguousarray(np.moveaxis(rows, 1, 0))
        rows = np.moveaxis(taken, 1, 0)  # [Hkv, pages, page_size, ...]
        return np.ascontiguousarray(rows.reshape((rows.shape[0], -1) + rows.shape[3:])[:, :n])

    @property
    def nbytes(self) -> int:
        """Bytes of the pools."""
        return sum(b.nbytes for b in self._buffers)


class PagedKVCache(_PagedPool):
    """Dense paged K and V pools of one layer for many sequences (module docstring).

    Parameters
    ----------
    num_pages, page_size : pages in each pool and tokens per page (a power of two up to 1024).
    num_kv_heads, head_dim : row shape.
    dtype : float16 (default), bfloat16 or float32: the pools' type.
    page_layout : "nhd" (``[num_pages, page_size, Hkv, D]``, default) or "hnd" (``[num_pages, Hkv, page_size, D]``).

    Attributes: ``k_pages``, ``v_pages`` (the pools: numpy arrays, or torch / cupy CUDA arrays on a
    cuda device), ``num_pages``, ``page_size``, ``num_kv_heads``, ``head_dim``, ``dtype``,
    ``page_layout``, ``device``, ``free_pages``, ``nbytes``; ``len(pool)`` is the number of live
    sequences, ``pool.length(seq_id)`` one sequence's tokens.

    >>> import numpy as np, pyfa
    >>> pool = pyfa.PagedKVCache(8, 16, 2, 64)
    >>> a, b = pool.add_sequence(), pool.add_sequence()
    >>> rows = np.ones((3, 2, 64), np.float32)
    >>> pool.append([a, a, b], rows, rows)
    >>> pool.length(a), pool.length(b), pool.free_pages, pool.gather(a)[0].shape
    (2, 1, 6, (2, 2, 64))
    """

    def __init__(self, num_pages, page_size, num_kv_heads, head_dim, *, dtype=np.float16, page_layout="nhd",
                 device=None):
        super().__init__(num_pages, page_size, num_kv_heads, head_dim, page_layout, device)
        self.dtype = _args.dtype_arg(dtype, "dtype", dtypes.FLOAT_TYPES)
        shape = pa.pool_shape(self.page_layout, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        self.k_pages = _device_zeros(self.device, shape, self.dtype)
        self.v_pages = _device_zeros(self.device, shape, self.dtype)
        self._bind_pools(((self.k_pages, "k_pages", self.dtype, 4), (self.v_pages, "v_pages", self.dtype, 4)))
        self._pool_fields = ("k_pages", "v_pages")
        self._desc = {"pool_dtype": dtypes.code(self.dtype)}

    def _pool_arrays(self):
        return self.k_pages, self.v_pages

    def _run(self, k, v, like, slots) -> None:
        if like is None and k.dtype == np.float64:  # rounds once, straight to the pool dtype
            k, v = k.astype(self.dtype), v.astype(self.dtype)
        super()._run(k, v, like, slots)

    def attend(self, q, seq_ids, *, scale=None, softcap=0.0, window=None, out_dtype=None, return_lse=False):
        """Paged decode of ``q [len(seq_ids), H, head_dim]`` over the sequences ``seq_ids`` with
        :func:`pyfa.paged_decode_attention` (its conventions: GQA, scale, softcap, window, LSE)."""
        from . import paged_decode_attention

        with self._lock:
            return self._attend(paged_decode_attention, q, seq_ids, (self.k_pages, self.v_pages),
                                self._decode_args(scale, softcap, window, out_dtype, return_lse))

    def gather(self, seq_id):
        """(k, v): copies of sequence ``seq_id``'s rows, ``[num_kv_heads, length, head_dim]`` of the
        pool dtype each (tests and debugging)."""
        with self._lock:
            seq = self._seq(seq_id, "seq_id")
            return tuple(self._rows_of(b.read(), seq) for b in self._buffers)


class TurboQuantPagedKVCache(_PagedPool):
    """TurboQuant paged pools of one layer for many sequences (module docstring): codes and
    float32 scales of K and V, encoded as :class:`pyfa.TurboQuantKVCache` encodes (the same bytes
    for the same row, seed and norm_correction).

    Parameters as :class:`PagedKVCache` (head_dim 64, 128, 256 or 512), and ``k_bits``, ``v_bits``
    (2, 3, 4 or 8), ``seed`` and ``norm_correction`` as :class:`pyfa.TurboQuantKVCache`'s.
    Attributes: ``k_codes``, ``k_scales``, ``v_codes``, ``v_scales`` (the pools: codes uint8
    ``[num_pages, page_size, Hkv, head_dim*bits/8]``, scales float32 ``[num_pages, page_size, Hkv]``
    for "nhd"; page_size and Hkv swapped for "hnd"), and those of :class:`PagedKVCache`.

    >>> import numpy as np, pyfa
    >>> pool = pyfa.TurboQuantPagedKVCache(4, 16, 2, 64)
    >>> s = pool.add_sequence()
    >>> pool.append([s, s], np.ones((2, 2, 64), np.float32), np.ones((2, 2, 64), np.float32))
    >>> pool.gather(s)[0].shape
    (2, 2, 64)
    """

    def __init__(self, num_pages, page_size, num_kv_heads, head_dim, *, k_bits=4, v_bits=4, seed=0,
                 norm_correction=tq.DEFAULT_NORM_CORRECTION, page_layout="nhd", device=None):
        super().__init__(num_pages, page_size, num_kv_heads, head_dim, page_layout, device)
        tq._check_head_dim(self.head_dim)
        self.k_bits, self.v_bits = tq._bit_width(k_bits, "k_bits"), tq._bit_width(v_bits, "v_bits")
        self.seed = tq._check_seed(seed)
        self.norm_correction = tq.norm_mode(norm_correction)
        geometry = (self.page_layout, self.num_pages, self.page_size, self.num_kv_heads)
        self.k_codes = _device_zeros(self.device, pa.pool_shape(*geometry, tq.row_bytes(self.head_dim, self.k_bits)),
                                     np.uint8)
        self.v_codes = _device_zeros(self.device, pa.pool_shape(*geometry, tq.row_bytes(self.head_dim, self.v_bits)),
                                     np.uint8)
        self.k_scales = _device_zeros(self.device, pa.pool_shape(*geometry), np.float32)
        self.v_scales = _device_zeros(self.device, pa.pool_shape(*geometry), np.float32)
        arrays = ((self.k_codes, "k_codes", np.uint8, 4), (self.k_scales, "k_scales", np.float32, 3),
                  (self.v_codes, "v_codes", np.uint8, 4), (self.v_scales, "v_scales", np.float32, 3))
        self._bind_pools(arrays)
        self._pool_fields = ("k_pages", "k_scales", "v_pages", "v_scales")  # the run's fields: codes in *_pages
        self._desc = {"pool_dtype": lib.PYFA_DTYPE_U8, "k_bits": self.k_bits, "v_bits": self.v_bits,
                      "norm_correction": self.norm_correction, "seed_lo": self.seed & 0xFFFFFFFF,
                      "seed_hi": self.seed >> 32}

    def _pool_arrays(self):
        return self.k_codes, self.k_scales, self.v_codes, self.v_scales

    def _run(self, k, v, like, slots) -> None:
        if like is None and k.dtype == np.float64:  # the encoder reads f32 / f16 / bf16
            k, v = k.astype(np.float32), v.astype(np.float32)
        super()._run(k, v, like, slots)

    def attend(self, q, seq_ids, *, scale=None, softcap=0.0, window=None, out_dtype=None, return_lse=False):
        """Paged decode of ``q [len(seq_ids), H, head_dim]`` over the codes of ``seq_ids`` with
        :func:`pyfa.turboquant.paged_decode` (its conventions, as :func:`pyfa.paged_decode_attention`)."""
        with self._lock:
            return self._attend(tq.paged_decode, q, seq_ids, (self.k_codes, self.k_scales, self.v_codes, self.v_scales),
                                dict(self._decode_args(scale, softcap, window, out_dtype, return_lse),
                                     k_bits=self.k_bits, v_bits=self.v_bits, seed=self.seed))

    def codes(self, seq_id):
        """Copies of sequence ``seq_id``'s ``(k_codes, k_scales, v_codes, v_scales)``: codes uint8
        ``[Hkv, length, head_dim*bits/8]``, scales float32 ``[Hkv, length]``."""
        with self._lock:
            seq = self._seq(seq_id, "seq_id")
            return tuple(self._rows_of(b.read(), seq) for b in self._buffers)

    def gather(self, seq_id):
        """(k, v): sequence ``seq_id`` decoded by the library (tq_dequantize_kv) to float32
        ``[num_kv_heads, length, head_dim]`` each, in the original domain (tests and debugging)."""
        with self._lock:
            kc, ks, vc, vs = self.codes(seq_id)
        n, Hkv, D = kc.shape[1], self.num_kv_heads, self.head_dim
        if n == 0:
            return np.zeros((Hkv, 0, D), np.float32), np.zeros((Hkv, 0, D), np.float32)
        out = []
        for stream, codes, scales, bits in ((tq.STREAM_K, kc, ks, self.k_bits), (tq.STREAM_V, vc, vs, self.v_bits)):
            params = _args.params("pyfa_tq_dequantize_params *", {
                "num_tokens": n, "num_kv_heads": Hkv, "head_dim": D, "kv_capacity": n, "first_slot": 0,
                "bits": bits, "stream": stream, "seed_lo": self.seed & 0xFFFFFFFF, "seed_hi": self.seed >> 32})
            cb, sb = _io.to_device(self.device, codes), _io.to_device(self.device, scales)
            result, ob = _io.output(self.device, (n, Hkv, D), np.float32, None)
            enc = self.device.encoder()
            check(lib.pyfa_tq_dequantize_kv(enc, params, cb.handle, sb.handle, ob.handle))
            _io.submit(enc)
            out.append(np.ascontiguousarray(np.moveaxis(_io.finish(self.device, result, ob), 1, 0)))
        return tuple(out)
