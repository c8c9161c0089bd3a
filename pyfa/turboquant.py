"""TurboQuant compressed KV cache (randomised Hadamard rotation + Lloyd-Max
scalar codebook + one scale per row), its codec as a float64 numpy reference,
and thin wrappers of the library's TurboQuant kernels.

The codec is specified in ``shaders/common/turboquant_params.h``; codes are a
pure function of (row, seed, bits, norm_correction) on every backend.

Choice of ``norm_correction`` (default ``True`` = the norm-preserving scale
``|x| sqrt(D) / |c[idx]|``, so that ``|x~| = |x|``). Measured with
``python scripts/tq_norm_correction.py --trials 24`` (CPU backend, D=128,
2048 keys and values ~ N(0, I), 8 query heads, K and V at the same width):
mean relative L2 error of the attention output (mean cosine).

q ~ N(0, I):

================  ===============  ===============  ===============  ===============
scale             2-bit            3-bit            4-bit            8-bit
================  ===============  ===============  ===============  ===============
|x| (none)        0.4667 (0.8858)  0.2619 (0.9657)  0.1384 (0.9905)  0.0094 (1.0000)
norm-preserving   0.4792 (0.8865)  0.2591 (0.9668)  0.1352 (0.9909)  0.0090 (1.0000)
unbiased          0.5425 (0.8812)  0.2672 (0.9665)  0.1363 (0.9909)  0.0090 (1.0000)
================  ===============  ===============  ===============  ===============

q ~ N(0, 9 I) (sharper attention):

================  ===============  ===============  ===============  ===============
|x| (none)        0.7426 (0.6932)  0.4297 (0.8963)  0.2255 (0.9701)  0.0176 (0.9998)
norm-preserving   0.7597 (0.7022)  0.4104 (0.9041)  0.2115 (0.9741)  0.0157 (0.9999)
unbiased          0.8550 (0.6938)  0.4219 (0.9033)  0.2139 (0.9740)  0.0157 (0.9999)
================  ===============  ===============  ===============  ===============

The norm-preserving scale has the lowest error at 3, 4 and 8 bits and the best
cosine at every width. The plain norm shrinks each row by about
``sqrt(1 - D_mse)``, which flattens the softmax; the unbiased scale
``|x|^2 / <x~, x>`` over-corrects (about ``1/(1 - D_mse)`` times the norm),
buying unbiased inner products with a larger reconstruction error. At 2 bits
the plain norm's shrinkage gives a lower L2 error (0.467 against 0.479) but a
lower cosine; 2-bit caches are a niche, so one default serves all widths.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from . import _args, _io, cuda_interop, dtypes
from ._native import ffi, lib
from .device import Device, supported
from .errors import check, invalid
from .kvcache import _RingCache

BIT_WIDTHS = supported("tq_bits")
HEAD_DIMS = supported("tq_head_dims")
STREAM_K, STREAM_V = lib.PYFA_TQ_STREAM_K, lib.PYFA_TQ_STREAM_V
NORM_MODES = {"none": lib.PYFA_TQ_NORM_NONE, "norm_preserving": lib.PYFA_TQ_NORM_PRESERVING,
              "unbiased": lib.PYFA_TQ_NORM_UNBIASED}
TRANSFORMS = {"fwht": lib.PYFA_TQ_FWHT_PLAIN, "sign_premult": lib.PYFA_TQ_FWHT_SIGN_PREMULT,
              "sign_undo": lib.PYFA_TQ_FWHT_SIGN_UNDO}
DEFAULT_NORM_CORRECTION = True
_CORRECTED = "norm_preserving"  # what norm_correction=True means


@functools.lru_cache(maxsize=None)
def _codebook(bits: int) -> np.ndarray:
    out = np.empty(1 << bits, np.float32)
    check(lib.pyfa_turboquant_codebook(bits, ffi.from_buffer("float[]", out, require_writable=True), out.size))
    out.setflags(write=False)
    return out


def codebook(bits: int) -> np.ndarray:
    """The float32 Lloyd-Max codebook of N(0, 1) at ``bits`` in {2, 3, 4, 8}: ``2**bits`` sorted,
    symmetric centroids, computed by the library."""
    return _codebook(_bit_width(bits, "bits"))


def _bit_width(bits, name: str) -> int:
    bits = _args.int_arg(bits, name, 0, 255, rule="must be a TurboQuant bit width (2, 3, 4 or 8)")
    if bits not in BIT_WIDTHS:
        raise invalid(f"{name}: {bits} is not a TurboQuant bit width (2, 3, 4 or 8)")
    return bits


def row_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one packed row."""
    return head_dim * bits // 8


def norm_mode(norm_correction) -> int:
    """PYFA_TQ_NORM_* code of ``norm_correction`` (bool, or 'none' / 'norm_preserving' / 'unbiased')."""
    if isinstance(norm_correction, (bool, np.bool_)):
        return NORM_MODES[_CORRECTED] if norm_correction else NORM_MODES["none"]
    if isinstance(norm_correction, str) and norm_correction in NORM_MODES:
        return NORM_MODES[norm_correction]
    raise invalid(f"norm_correction: must be a bool or one of {sorted(NORM_MODES)}, got {_args.show(norm_correction)}")


def _check_head_dim(head_dim) -> int:
    head_dim = _args.int_arg(head_dim, "head_dim", 1, _args.U32_MAX)
    if head_dim not in HEAD_DIMS:
        raise invalid(f"head_dim: {head_dim} is not supported by TurboQuant (the Hadamard rotation needs a "
                      "power of two: 64, 128, 256 or 512)")
    return int(head_dim)


def _check_seed(seed) -> int:
    return _args.int_arg(seed, "seed", 0, _args.U64_MAX, rule="must be an int in [0, 2**64)")


def _check_stream(stream) -> int:
    return _args.int_arg(stream, "stream", STREAM_K, STREAM_V, rule=f"must be {STREAM_K} (K) or {STREAM_V} (V)")


# --------------------------------------------------------------------------- reference (float64 numpy)

def signs(seed: int, stream: int, head_dim: int) -> np.ndarray:
    """The ±1 vector of ``stream`` (0 = K, 1 = V): splitmix64 as in turboquant_params.h. float64 ``[D]``."""
    i = np.arange(head_dim, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + np.uint64(0x9E3779B97F4A7C15) * (((np.uint64(stream) << np.uint64(32)) | i) + np.uint64(1))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return np.where(z >> np.uint64(63), -1.0, 1.0)


def hadamard(head_dim: int) -> np.ndarray:
    """Unnormalised Walsh-Hadamard matrix ``[D, D]`` in natural (Sylvester) order, float64."""
    h = np.ones((1, 1))
    while h.shape[0] < head_dim:
        h = np.block([[h, h], [h, -h]])
    return h


def rotate(x, seed: int, stream: int) -> np.ndarray:
    """``y = H (s * x) / sqrt(D)`` over the last axis, float64."""
    x = np.asarray(x, np.float64)
    D = x.shape[-1]
    return (x * signs(seed, stream, D)) @ hadamard(D).T / math.sqrt(D)


def unrotate(y, seed: int, stream: int) -> np.ndarray:
    """Inverse of :func:`rotate`: ``x = s * (H y) / sqrt(D)``, float64."""
    y = np.asarray(y, np.float64)
    D = y.shape[-1]
    return (y @ hadamard(D).T / math.sqrt(D)) * signs(seed, stream, D)


def reference_encode(x, bits: int, *, seed: int = 0, stream: int = STREAM_K, norm_correction=False):
    """Float64 codec: rows ``x [..., D]`` -> (indices int ``[..., D]``, scales float64 ``[...]``).

    Matches the kernels' codes except where a coordinate lies within rounding
    of a cell boundary (the kernels work in float32)."""
    x = np.asarray(x, np.float64)
    D = x.shape[-1]
    c = codebook(bits).astype(np.float64)
    norm = np.linalg.norm(x, axis=-1)
    inv = np.divide(1.0, norm, out=np.zeros_like(norm), where=norm > 0)
    t = rotate(x, seed, stream) * math.sqrt(D) * inv[..., None]
    thresholds = (c[1:] + c[:-1]) / 2
    idx = np.searchsorted(thresholds, t, side="left")
    return idx, reference_scale(x, idx, bits, seed=seed, stream=stream, norm_correction=norm_correction)


def reference_scale(x, idx, bits: int, *, seed: int = 0, stream: int = STREAM_K, norm_correction=False):
    """Float64 scale of rows ``x [..., D]`` encoded as ``idx [..., D]`` (turboquant_params.h)."""
    x = np.asarray(x, np.float64)
    D = x.shape[-1]
    cv = codebook(bits).astype(np.float64)[np.asarray(idx)]
    norm = np.linalg.norm(x, axis=-1)
    inv = np.divide(1.0, norm, out=np.zeros_like(norm), where=norm > 0)
    mode = norm_mode(norm_correction)
    if mode == NORM_MODES["norm_preserving"]:
        q2 = (cv * cv).sum(-1)
        return np.where(q2 > 0, norm * np.sqrt(D / np.where(q2 > 0, q2, 1)), norm)
    if mode == NORM_MODES["unbiased"]:
        t = rotate(x, seed, stream) * math.sqrt(D) * inv[..., None]
        ct = (cv * t).sum(-1)
        return np.where(ct > 0, norm * D / np.where(ct > 0, ct, 1), norm)
    return norm


def reference_decode(idx, scale, bits: int, *, seed: int = 0, stream: int = STREAM_K) -> np.ndarray:
    """Float64 rows in the original domain: ``x~ = R^T (c[idx] * scale / sqrt(D))``."""
    idx = np.asarray(idx)
    D = idx.shape[-1]
    y = codebook(bits).astype(np.float64)[idx] * (np.asarray(scale, np.float64)[..., None] / math.sqrt(D))
    return unrotate(y, seed, stream)


def pack_codes(idx, bits: int) -> np.ndarray:
    """Indices ``[..., D]`` -> packed uint8 ``[..., D*bits/8]`` (8 coordinates per ``bits`` bytes, little-endian)."""
    idx = np.asarray(idx, np.uint64)
    g = idx.reshape(*idx.shape[:-1], -1, 8)
    w = (g << (np.uint64(bits) * np.arange(8, dtype=np.uint64))).sum(-1, dtype=np.uint64)
    b = (w[..., None] >> (np.uint64(8) * np.arange(bits, dtype=np.uint64))) & np.uint64(0xFF)
    return b.astype(np.uint8).reshape(*idx.shape[:-1], -1)


def unpack_codes(codes, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`: int64 ``[..., D]``."""
    codes = np.asarray(codes, np.uint8)
    b = codes.reshape(*codes.shape[:-1], -1, bits).astype(np.uint64)
    w = (b << (np.uint64(8) * np.arange(bits, dtype=np.uint64))).sum(-1, dtype=np.uint64)
    idx = (w[..., None] >> (np.uint64(bits) * np.arange(8, dtype=np.uint64))) & np.uint64((1 << bits) - 1)
    return idx.astype(np.int64).reshape(*codes.shape[:-1], -1)


# --------------------------------------------------------------------------- kernel wrappers

def fwht(x, transform: str = "fwht", *, seed: int = 0, stream: int = STREAM_K, device: Device | None = None):
    """The library's FWHT kernels on rows ``x [n, D]`` (float32/float16/bfloat16) -> float32 ``[n, D]``.

    ``transform``: 'fwht' (``H x / sqrt(D)``), 'sign_premult' (``H (s*x) / sqrt(D)``) or
    'sign_undo' (``s * (H x) / sqrt(D)``)."""
    device = _args.device_arg(device)
    transform = _args.choice_arg(transform, "transform", sorted(TRANSFORMS))
    x = _io.as_array(x, "x", ndims=(2,))
    seed = _check_seed(seed)
    stream = _check_stream(stream)
    params = _args.params("pyfa_tq_fwht_params *", {
        "nrows": x.shape[0], "head_dim": x.shape[1], "transform": TRANSFORMS[transform], "stream": stream,
        "seed_lo": seed & 0xFFFFFFFF, "seed_hi": seed >> 32})
    result, out = _io.output(device, x.shape, np.float32, None)
    src = _io.to_device(device, x)
    _RingCache._run(device, lambda enc: check(lib.pyfa_fwht(enc, params, src.handle, out.handle)))
    return _io.finish(device, result, out)


def quantize(x, bits: int, *, seed: int = 0, stream: int = STREAM_K, norm_correction=DEFAULT_NORM_CORRECTION,
             device: Device | None = None):
    """Encodes host rows ``x [n, D]`` with hadamard_quantize_kv -> (codes uint8 ``[n, D*bits/8]``,
    scales float32 ``[n]``)."""
    if cuda_interop.is_gpu_array(x):
        raise invalid("x: quantize takes host arrays (numpy, torch CPU tensors); got a GPU array")
    x = _io.as_array(x, "x", ndims=(2,))
    stream = _check_stream(stream)
    n = x.shape[0]
    if n == 0:
        raise invalid("x: expected [n >= 1, D] rows, got 0 rows")
    cache = TurboQuantKVCache(1, x.shape[1], n, k_bits=bits, v_bits=bits, seed=seed,
                              norm_correction=norm_correction, device=device)
    src = _io.to_device(cache.device, np.ascontiguousarray(x[:, None, :]))
    params = _args.params("pyfa_tq_quantize_params *", {
        "num_tokens": n, "num_kv_heads": 1, "head_dim": cache.head_dim, "kv_capacity": n, "write_pos": 0,
        "bits": cache.bits[stream], "stream": stream, "norm_correction": cache.norm_correction, **cache._seed_fields()})
    cache._run(cache.device, lambda enc: check(lib.pyfa_hadamard_quantize_kv(
        enc, params, src.handle, cache._codes[stream].handle, cache._scales[stream].handle)))
    codes, scales = cache._read(stream)
    return codes[0], scales[0]


class TurboQuantKVCache(_RingCache):
    """A TurboQuant-compressed KV cache for one sequence.

    Parameters
    ----------
    num_kv_heads, capacity : positive ints.
    head_dim : 64, 128, 256 or 512.
    k_bits, v_bits : bit widths of K and V codes, each in {2, 3, 4, 8}.
    seed : int in [0, 2**64): draws the K and V sign vectors of the rotation.
    norm_correction : True (default): store the norm-preserving scale
        ``|x| sqrt(D) / |c[idx]|``, which measured best (module docstring); False: ``|x|``;
        or one of 'none', 'norm_preserving', 'unbiased'.
    sliding_window : None, or the number of latest tokens attention sees (ring buffer;
        flash-attn's ``window_size=(sliding_window - 1, 0)``).

    Storage per token and KV head: ``D*k_bits/8 + D*v_bits/8`` bytes of codes plus two float32
    scales (136 B at D=128, 4 bits, against 512 B of float16 K+V).

    Attributes: ``num_kv_heads``, ``head_dim``, ``capacity``, ``sliding_window``, ``k_bits``,
    ``v_bits``, ``seed``, ``device``; ``len(cache)`` is the number of tokens stored. ``attend``
    follows :func:`pyfa.decode_attention`'s conventions (GQA, scale, softcap, LSE). On a cuda
    device the length lives on the device, as :class:`pyfa.KVCache`'s does, so a step (append,
    attend) captures in a CUDA graph.

    >>> import numpy as np, pyfa
    >>> c = pyfa.TurboQuantKVCache(2, 64, 16)
    >>> c.append(np.ones((3, 2, 64), np.float32), np.ones((3, 2, 64), np.float32))
    >>> len(c), c.dequantize()[0].shape
    (3, (3, 2, 64))
    """

    def __init__(self, num_kv_heads, head_dim, capacity, *, k_bits=4, v_bits=4, seed=0,
                 norm_correction=DEFAULT_NORM_CORRECTION, sliding_window=None, device=None):
        super().__init__(num_kv_heads, head_dim, capacity, sliding_window, device)
        _check_head_dim(self.head_dim)
        self.bits = (self._bits(k_bits, "k_bits"), self._bits(v_bits, "v_bits"))
        self.k_bits, self.v_bits = self.bits
        self.seed = _check_seed(seed)
        self.norm_correction = norm_mode(norm_correction)
        Hkv, cap, D = self.num_kv_heads, self.capacity, self.head_dim
        # Device memory: a shared buffer would travel to and from the host with every call on a GPU.
        self._codes = [self.device.buffer((Hkv, cap, row_bytes(D, b)), np.uint8, storage="private")
                       for b in self.bits]
        self._scales = [self.device.buffer((Hkv, cap), np.float32, storage="private") for _ in self.bits]

    @staticmethod
    def _bits(bits, name):
        return _bit_width(bits, name)

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales."""
        return sum(b.nbytes for b in self._codes + self._scales)

    def _seed_fields(self):
        return {"seed_lo": self.seed & 0xFFFFFFFF, "seed_hi": self.seed >> 32}

    def _append_desc(self) -> dict:
        return {"cache_dtype": dtypes.code(np.uint8), "k_bits": self.k_bits, "v_bits": self.v_bits,
                "norm_correction": self.norm_correction, **self._seed_fields()}

    def _append_memory(self):
        return (("k_cache", self._codes[STREAM_K]), ("v_cache", self._codes[STREAM_V]),
                ("k_scales", self._scales[STREAM_K]), ("v_scales", self._scales[STREAM_V]))

    def append(self, k, v) -> None:
        """Encodes and appends ``k``, ``v`` of shape ``[n, num_kv_heads, head_dim]`` (one dispatch
        each, or on CUDA one for both when ``k_bits == v_bits``): host arrays (numpy or torch CPU
        tensors, float16/bfloat16/float32/float64) or, on a cuda device, CUDA arrays
        (float16/bfloat16/float32, read in place, encoded on the caller's stream without waiting).
        Raises PyfaError, changing nothing, on bad input or (without a window) overflow."""
        self._append(k, v)

    _float64_rows_as = np.dtype(np.float32)  # float64 rows enter the encoder as float32 (it reads f32/f16/bf16)

    def attend(self, q, *, k=None, v=None, scale=None, softcap=0.0, fused=True, nwg=None, out_dtype=None,
               return_lse=False):
        """Decode attention of ``q [H, head_dim]`` (float16/bfloat16/float32/float64) over the codes,
        in the rotated domain; returns ``[H, head_dim]`` in the original domain, of ``out_dtype``
        (None: q's dtype, float32 for a float64 q), zeros for an empty cache, in q's array type:
        numpy, a torch CPU tensor, or (a CUDA ``q`` on a cuda device) an array of q's framework,
        queued on its current stream without waiting. ``return_lse``: also the float32 LSE ``[H]``
        as ``(out, lse)`` (the rotation is orthogonal, so it is the LSE of the original-domain
        scores; ``-inf`` for an empty cache). ``fused`` picks the fused reduce + undo tail (on
        CUDA a split of up to 16 workgroups merges and undoes in its last workgroups instead: no
        tail launch); every tail gives identical bits. ``nwg`` overrides the backend plan's
        workgroups per sequence (tests and tuning).

        Accuracy: float32 attention over the rows :meth:`dequantize` gives, except that a kernel
        may multiply the codebook values rounded to f16 (within 2^-11 relative; CUDA's
        tensor-core kernel at 4-bit K and V does, for one table lookup per code byte): about
        1e-3 of an output of unit-variance rows, far under the codec's own error.

        ``k``, ``v``: rows to encode and append first, as :meth:`append` takes them, on q's side;
        the attention then sees them. One submission, all or nothing (as
        :meth:`pyfa.KVCache.attend`)."""
        if k is not None or v is not None:
            return self._attend_after_append(q, k, v, lambda: self.attend(
                q, scale=scale, softcap=softcap, fused=fused, nwg=nwg, out_dtype=out_dtype, return_lse=return_lse))
        repeat_key = self._repeat_key(q, scale, softcap, out_dtype, return_lse) \
            if fused is True and nwg is None else None
        if repeat_key is not None:
            out = self._attend_repeat(q, scale)
            if out is not None:
                return out
        q_arg = q
        q, like, scale, softcap, out_dtype, return_lse = self._check_query(q, scale, softcap, out_dtype, return_lse)
        fused = _args.bool_arg(fused, "fused")
        nwg = self._nwg(nwg)
        H, D = q.shape
        desc = {"tq": {"attn": {"batch": 1, "num_heads": H, "num_kv_heads": self.num_kv_heads, "head_dim": D,
                                "kv_capacity": self.capacity, "nwg": nwg, "window": self.sliding_window or 0,
                                "scale": scale, "softcap": softcap},
                       "k_bits": self.k_bits, "v_bits": self.v_bits, "fused": int(fused), **self._seed_fields()}}
        tensors = (("k_codes", self._codes[0]), ("k_scales", self._scales[0]), ("v_codes", self._codes[1]),
                   ("v_scales", self._scales[1]))
        with self._lock:
            out, lse = self._attend_planned("tq", q, like, desc, lib.pyfa_tq_decode_plan_new, lib.pyfa_tq_decode_run,
                                            tensors, out_dtype, return_lse, repeat_key)
        out = _io.host_result(out, q_arg)
        return (out, _io.host_result(lse, q_arg)) if return_lse else out

    @staticmethod
    def _nwg(nwg) -> int:
        return _args.optional_int(nwg, "nwg", 1, _args.U32_MAX, rule="must be None or a positive int") or 0

    def dequantize(self):
        """(k, v): float32 ``[len, num_kv_heads, head_dim]`` each, in chronological order and the
        original domain, decoded by the library (tq_dequantize_kv)."""
        with self._lock:
            return self._dequantize()

    def _dequantize(self):
        n, first = self._ring()
        shape = (n, self.num_kv_heads, self.head_dim)
        if n == 0:
            return np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        results = []
        for stream in (STREAM_K, STREAM_V):
            params = _args.params("pyfa_tq_dequantize_params *", {
                "num_tokens": n, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "kv_capacity": self.capacity, "first_slot": first, "bits": self.bits[stream], "stream": stream,
                **self._seed_fields()})
            result, out = _io.output(self.device, shape, np.float32, None)
            self._run(self.device, lambda enc: check(lib.pyfa_tq_dequantize_kv(
                enc, params, self._codes[stream].handle, self._scales[stream].handle, out.handle)))
            results.append(_io.finish(self.device, result, out))
        return tuple(results)

    def _read(self, stream: int):
        """(codes uint8 [Hkv, capacity, row_bytes], scales float32 [Hkv, capacity]) copies, by physical slot."""
        return self._codes[stream].read(), self._scales[stream].read()

    def codes(self):
        """Copies of the stored codes and scales by physical slot:
        ``(k_codes, k_scales, v_codes, v_scales)``, codes uint8 ``[Hkv, capacity, D*bits/8]``,
        scales float32 ``[Hkv, capacity]``."""
        with self._lock:
            return (*self._read(STREAM_K), *self._read(STREAM_V))


# ---- paged decode over TurboQuant pools (pyfa/paged.py runs it) ------------------------------------
def paged_decode(q, k_codes, k_scales, v_codes, v_scales, block_table, kv_len, *, k_bits, v_bits, seed=0,
                 page_layout="nhd", scale=None, softcap=0.0, window=None, fused=True, device: Device | None = None,
                 out_dtype=None, return_lse=False):
    """Decode a batch of sequences over TurboQuant codes kept in paged pools.

    Parameters
    ----------
    q : array ``[B, H, D]``, float32 / float16 / bfloat16 (original domain; the op rotates it
        into the codes' domain and the output back, as :meth:`TurboQuantKVCache.attend` does);
        numpy, a torch CPU tensor, or a GPU array on the cuda device.
    k_codes, v_codes : uint8 pools ``[num_pages, page_size, H_kv, D * bits / 8]``
        (``page_layout="nhd"``) or ``[num_pages, H_kv, page_size, D * bits / 8]`` (``"hnd"``):
        the bytes :func:`quantize` / :class:`TurboQuantKVCache` store per row.
    k_scales, v_scales : float32 pools ``[num_pages, page_size, H_kv]`` (``"hnd"``:
        ``[num_pages, H_kv, page_size]``), one scale per row, paged like the codes.
    block_table, kv_len, page_layout : as :func:`pyfa.paged_decode_attention`.
    k_bits, v_bits : the codes' widths, each in {2, 3, 4, 8}; D in {64, 128, 256, 512}.
    seed : the seed the codes were made with (it draws the rotation's signs).
    scale, softcap, window, out_dtype, return_lse : as :func:`pyfa.decode_attention`.
    fused : the fused reduce + undo tail (identical bits either way).

    Returns
    -------
    array ``[B, H, D]`` of ``out_dtype`` (None: q's dtype) in the original domain, or
    ``(out, lse)`` with the float32 LSE ``[B, H]`` (the rotation is orthogonal: it is the
    LSE of the original-domain scores; ``-inf`` for an empty sequence).
    """
    from . import paged

    device = _args.device_arg(device)
    q_arg = q
    layout = paged.layout_code(page_layout)
    kb, vb = _bit_width(k_bits, "k_bits"), _bit_width(v_bits, "v_bits")
    seed = _check_seed(seed)
    fused = _args.bool_arg(fused, "fused")
    q, out_dtype, window, softcap, return_lse = paged.query_and_options(q, scale, softcap, window, out_dtype,
                                                                         return_lse)
    u8, f32 = (np.dtype(np.uint8),), (np.dtype(np.float32),)
    kc = _io.as_array(k_codes, "k_codes", u8, ndims=(4,), gpu=True)
    ks = _io.as_array(k_scales, "k_scales", f32, ndims=(3,), gpu=True)
    vc = _io.as_array(v_codes, "v_codes", u8, ndims=(4,), gpu=True)
    vs = _io.as_array(v_scales, "v_scales", f32, ndims=(3,), gpu=True)
    like = _io.gpu_like(device, q, kc, ks, vc, vs)
    B, H, D = q.shape
    num_pages, page_size, Hkv, _ = paged.pool_dims(kc.shape, layout, "k_codes")
    for name, codes, bits in (("k_codes", kc, kb), ("v_codes", vc, vb)):
        if paged.pool_dims(codes.shape, layout, name)[:3] != (num_pages, page_size, Hkv) or \
                codes.shape[3] != row_bytes(D, bits):
            raise invalid(f"{name}: shape {codes.shape} does not match a {page_layout} pool of {num_pages} pages of "
                          f"{page_size} tokens x {Hkv} heads with {row_bytes(D, bits)}-byte rows (head_dim {D}, "
                          f"{bits} bits)")
    for name, scales in (("k_scales", ks), ("v_scales", vs)):
        if scales.shape != kc.shape[:3]:
            raise invalid(f"{name}: shape {scales.shape} does not match the codes' pages {kc.shape[:3]}")
    _args.u32_fields(batch=B, num_heads=H, num_kv_heads=Hkv, head_dim=D, num_pages=num_pages, page_size=page_size)
    scale = _args.default_scale(scale, D)
    table = paged.block_table_arg(block_table, B, like)
    attn = {"batch": B, "num_heads": H, "num_kv_heads": Hkv, "head_dim": D, "kv_capacity": 0, "nwg": 0,
            "window": window, "scale": scale, "softcap": softcap}
    extra = {"k_bits": kb, "v_bits": vb, "fused": int(fused), "seed_lo": seed & 0xFFFFFFFF, "seed_hi": seed >> 32}
    pages = {"page_size": page_size, "num_pages": num_pages, "layout": layout}
    pools = (("k_codes", kc), ("k_scales", ks), ("v_codes", vc), ("v_scales", vs))
    result, lse = paged.run("tq", device, like, q, pools, table, kv_len, pages, attn, extra, None, out_dtype,
                            return_lse)
    result = _io.host_result(result, q_arg)
    return (result, _io.host_result(lse, q_arg)) if return_lse else result


# Paged pools: the append lives in paged_append.py (it imports this module's codec helpers).
from .paged_append import paged_quantize  # noqa: E402
