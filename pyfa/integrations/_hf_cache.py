"""PyfaCache: a transformers ``Cache`` whose layers keep K and V where pyfa's decode
reads them in place, for the pyfa attention implementation. Imported through
``pyfa.integrations.transformers``.

Contract with transformers' attention modules: ``update(k, v, layer_idx)`` records
the new rows and returns them unchanged; the module's next attention call (pyfa's
:func:`attention_forward`, which recognises those exact tensors) attends over the
cache and appends the rows. So:

- decode steps (one query row, no padding) append the row and attend the cache:
  the model's KV is never concatenated into new tensors;
- the prompt (an empty cache) runs prefill attention on its own rows, then appends
  them (a TurboQuant cache: the prompt sees its exact rows, later steps the codes);
- anything else (a mask to apply: padded batches, chunks after the prompt) reads the
  visible cached rows back (dense: views or a copy; TurboQuant: dequantised), attends
  over them plus the new rows, then appends: correct, not fast.

Where the rows live:

- ``kind="dense"``: one pair of tensors ``[B, H_kv, capacity, D]`` per layer in the
  model's dtype on its device, a ring of ``capacity`` slots (position ``p`` in slot
  ``p % capacity``). A decode step is pyfa's append of the new rows into their slot and
  pyfa's decode of the whole batch (``kv_len``, and ``ring_start`` once a ring wrapped),
  prepared at the layer's first step and submitted together (:class:`_DenseStep`); the
  prompt's rows, and steps the prepared form does not fit (sinks, which need the LSE), are
  a torch copy into the slots and a :func:`pyfa.decode_attention` call.
- ``kind="turboquant"``: one :class:`pyfa.TurboQuantKVCache` per sequence (the codec
  holds a sequence), so a step appends and attends once per sequence.

Sliding-window layers (``layer_types`` of the config) hold ``sliding_window`` slots and
attend to the last ``sliding_window`` tokens; full-attention layers hold
``max_cache_len`` tokens and raise past that.
"""
from __future__ import annotations

import numpy as np
import torch
import transformers

try:
    from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
except ImportError as e:  # the per-layer cache API of transformers 5
    raise ImportError(f"PyfaCache needs the cache-layer API of transformers 5.x (tested with 5.24); "
                      f"found {transformers.__version__}") from e

import pyfa
from pyfa import _args, _plans, cuda_interop, dtypes
from pyfa._native import ffi, lib
from pyfa.errors import invalid

from . import transformers as hf

KINDS = ("dense", "turboquant")
_LAYER_TYPES = ("full_attention", "sliding_attention")


class _DenseRows:
    """A batch's K and V as tensors ``[B, H_kv, capacity, D]``: a ring (module docstring)."""

    def __init__(self, key_states, capacity: int):
        B, Hkv, _, D = key_states.shape
        self.k = torch.zeros((B, Hkv, capacity, D), dtype=key_states.dtype, device=key_states.device)
        self.v = torch.zeros_like(self.k)
        self.capacity, self.stored = capacity, 0
        self.prepared = None  # the _DenseStep, made at the first decode step that fits it

    def append(self, key, value) -> None:
        """Writes ``key``/``value [B, H_kv, n, D]`` into the slots of positions ``stored ..``,
        keeping the last ``capacity`` of them."""
        n, cap = key.shape[2], self.capacity
        keep = min(n, cap)
        first = (self.stored + n - keep) % cap
        head = min(keep, cap - first)  # rows up to the ring's end, then the rest from slot 0
        for dst, src in ((self.k, key), (self.v, value)):
            src = src[:, :, n - keep:]
            dst[:, :, first:first + head].copy_(src[:, :, :head])
            if keep > head:
                dst[:, :, :keep - head].copy_(src[:, :, head:])
        self.stored += n

    def step(self, call, query, key, value):
        """A decode step: the new rows ``key``/``value [B, H_kv, 1, D]`` appended, then the batch's
        decode of ``query [B, H, 1, D]``; ``[B, 1, H, D]`` in query's dtype. The prepared form
        (:class:`_DenseStep`) when the step fits it, else a torch copy and a decode call."""
        if self.prepared_fits(call, query, key, value):
            prepared = self.prepared
            if prepared is None:
                prepared = self.prepared = _DenseStep(self, call, query)
            if prepared.fits(call, query, key):
                return prepared.run(self, query, key, value)
        self.append(key, value)
        return self.decode(call, query)

    def prepared_fits(self, call, query, key, value) -> bool:
        """Whether a step can take the prepared form: no sinks (those need the LSE), and query
        and rows contiguous in the cache's dtype (projections and RoPE give them so)."""
        return (call.sinks is None and query.dtype == self.k.dtype == key.dtype == value.dtype
                and cuda_interop.numpy_dtype(query.dtype) in dtypes.FLOAT_TYPES
                and query.is_contiguous() and key.is_contiguous() and value.is_contiguous())

    def decode(self, call, query):
        """One decode call for the batch: ``[B, 1, H, D]`` in query's dtype."""
        cap, stored = self.capacity, self.stored
        lse = call.sinks is not None
        extra = dict(out_dtype=np.float32, return_lse=True) if lse else {}
        res = pyfa.decode_attention(hf._arg(query.select(2, 0)), hf._arg(self.k), hf._arg(self.v), min(stored, cap),
                                    ring_start=stored % cap if stored > cap else 0, scale=call.scale,
                                    softcap=call.softcap, device=call.device, **extra)
        out, l = res if lse else (res, None)
        return call.finish(hf._tensor(out).unsqueeze(1), hf._tensor(l).unsqueeze(2) if lse else None, query.dtype)

    def read(self, count: int):
        """The last ``count`` stored rows in order, ``[B, H_kv, count, D]`` each."""
        cap, stored = self.capacity, self.stored
        if stored <= cap:
            return self.k[:, :, stored - count:stored], self.v[:, :, stored - count:stored]
        start = stored % cap  # the oldest slot of a wrapped ring
        return tuple(torch.cat([t[:, :, start:], t[:, :, :start]], 2)[:, :, cap - count:] for t in (self.k, self.v))


class _DenseStep:
    """A dense layer's decode step, prepared at its first: pyfa's kv_append writes the new K
    and V rows into their slot (the batch's ``[B, H_kv, capacity, D]`` tensors taken as one
    cache of ``B * H_kv`` heads, which they are in memory) and pyfa's decode reads the batch,
    both recorded on this thread's encoder and submitted together. A step is then two calls
    into the library, with nothing checked again but what changes: the three addresses, the
    slot and the length. Everything the plans were made for (the call's options, the shapes,
    dtypes and device) is compared at each step (:meth:`fits`)."""

    def __init__(self, rows, call, query):
        B, Hkv, cap, D = rows.k.shape
        H = query.shape[1]
        self.device = _args.device_arg(call.device)
        self.cuda = query.is_cuda
        self.scale, self.softcap = call.scale, call.softcap
        self.query_shape = query.shape  # [B, H, 1, D]
        self.rows_shape = (B, Hkv, 1, D)
        dt = cuda_interop.numpy_dtype(query.dtype)
        code = dtypes.code(dt)
        self.append_plan = _plans.new_plan(lib.pyfa_kv_append_plan_new, self.device, _args.params(
            "pyfa_kv_append_plan_desc *", {"num_kv_heads": B * Hkv, "head_dim": D, "kv_capacity": cap,
                                           "k_dtype": code, "v_dtype": code, "cache_dtype": code}))
        a = self.append_args = ffi.new("pyfa_kv_append_run_args *")
        row_bytes = B * Hkv * D * dt.itemsize
        a.k.nbytes = a.v.nbytes = row_bytes
        a.k_cache.address, a.k_cache.nbytes = rows.k.data_ptr(), rows.k.numel() * dt.itemsize
        a.v_cache.address, a.v_cache.nbytes = rows.v.data_ptr(), rows.v.numel() * dt.itemsize
        a.num_tokens = 1
        scale = _args.default_scale(call.scale, D)
        # the key decode_attention's plans are cached under, so the two share plans
        self.plan_key = ("decode", self.device, B, H, Hkv, D, 0, scale, call.softcap, dt, dt, dt, False)
        self.plan_desc = {
            "attn": {"batch": B, "num_heads": H, "num_kv_heads": Hkv, "head_dim": D, "kv_capacity": cap,
                     "nwg": 0, "window": 0, "scale": scale, "softcap": call.softcap},
            "q_dtype": code, "kv_dtype": code, "out_dtype": code, "return_lse": 0}
        self.bucket, self.decode_plan = 0, None
        d = self.decode_args = ffi.new("pyfa_decode_run_args *")
        d.q.nbytes = d.out.nbytes = B * H * D * dt.itemsize
        d.k_cache.address, d.k_cache.nbytes = a.k_cache.address, a.k_cache.nbytes
        d.v_cache.address, d.v_cache.nbytes = a.v_cache.address, a.v_cache.nbytes
        self.lengths = ffi.new("int32_t[]", B)
        self.ring_starts = ffi.new("int32_t[]", B)
        d.kv_len.host, d.ring_start.host = self.lengths, self.ring_starts
        d.kv_capacity = cap
        self.out_shape = (B, H, D)

    def fits(self, call, query, key) -> bool:
        """Whether a step that fits the prepared form at all (_DenseRows.prepared_fits: dtypes,
        contiguity, no sinks) has the options and shapes this one was made for."""
        return (call.scale == self.scale and call.softcap == self.softcap
                and query.shape == self.query_shape and key.shape == self.rows_shape)

    def _plan(self, length: int):
        """The decode plan for ``length`` valid slots (by its power-of-two bucket, as decode_attention's)."""
        bucket = _plans.length_bucket(length)
        if bucket != self.bucket:
            desc = dict(self.plan_desc, max_kv_len=min(bucket, self.plan_desc["attn"]["kv_capacity"]))
            self.decode_plan = _plans.cached(self.plan_key + (bucket,), lambda: _plans.new_plan(
                lib.pyfa_decode_plan_new, self.device, _args.params("pyfa_decode_plan_desc *", desc)))
            self.bucket = bucket
        return self.decode_plan

    def run(self, rows, query, key, value):
        cap = rows.capacity
        stored = rows.stored + 1
        length = min(stored, cap)
        ring_start = stored % cap if stored > cap else 0
        plan = self._plan(length)
        for i in range(len(self.lengths)):
            self.lengths[i] = length
            self.ring_starts[i] = ring_start
        out = query.new_empty(self.out_shape)
        a, d = self.append_args, self.decode_args
        a.k.address, a.v.address, a.write_pos = key.data_ptr(), value.data_ptr(), rows.stored % cap
        d.q.address, d.out.address = query.data_ptr(), out.data_ptr()
        enc = _plans.encoder(self.device, cuda_interop.torch_stream_handle(0) if self.cuda else 0)
        # What was recorded is dropped if anything below raises: the next call's encoder() resets it.
        _plans.begin_recording(enc)
        _plans.run(self.device, lib.pyfa_kv_append_run, self.append_plan, enc, a, finish=False)
        _plans.run(self.device, lib.pyfa_decode_run, plan, enc, d)
        _plans.end_recording(enc)
        rows.stored = stored
        return out.unsqueeze(1)


class _SequenceCaches:
    """A batch's K and V in one pyfa cache per sequence (TurboQuant: module docstring)."""

    def __init__(self, caches, key_states):
        self.caches = caches
        self.capacity = caches[0].capacity
        self.device, self.dtype = key_states.device, key_states.dtype

    def append(self, key, value) -> None:
        for b, cache in enumerate(self.caches):  # [H_kv, n, D] -> the caches' [n, H_kv, D] rows
            cache.append(hf._arg(key[b].transpose(0, 1).contiguous()), hf._arg(value[b].transpose(0, 1).contiguous()))

    def decode(self, call, query):
        """One ``attend`` per sequence: ``[B, 1, H, D]`` in query's dtype."""
        lse = call.sinks is not None
        outs, lses = [], []
        for b, cache in enumerate(self.caches):
            res = cache.attend(hf._arg(query[b, :, 0, :].contiguous()), scale=call.scale, softcap=call.softcap,
                               out_dtype=np.float32 if lse else None, return_lse=lse)
            out, l = (res if lse else (res, None))
            outs.append(hf._tensor(out))
            lses.append(hf._tensor(l) if lse else None)
        out = torch.stack(outs)[:, None]
        return call.finish(out, torch.stack(lses)[:, :, None] if lse else None, query.dtype)

    def step(self, call, query, key, value):
        """The rows appended, then one ``attend`` per sequence: ``[B, 1, H, D]`` in query's dtype."""
        self.append(key, value)
        return self.decode(call, query)

    def read(self, count: int):
        """The last ``count`` rows in order, dequantised, as ``[B, H_kv, count, D]`` in the model's dtype."""
        if self.device.type == "cuda":  # appends were queued on torch's stream; the reads run on pyfa's
            torch.cuda.current_stream(self.device).synchronize()
        ks, vs = [], []
        for cache in self.caches:
            with cache._lock:
                k, v = cache._dequantize()  # [len, H_kv, D] float32, oldest first
            ks.append(torch.from_numpy(k[-count:]))
            vs.append(torch.from_numpy(v[-count:]))
        to = dict(device=self.device, dtype=self.dtype)
        return (torch.stack(ks).transpose(1, 2).to(**to).contiguous(),
                torch.stack(vs).transpose(1, 2).to(**to).contiguous())


class PyfaCacheLayer(CacheLayerMixin):
    """One decoder layer's KV (module docstring)."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: "PyfaCache", sliding_window: int | None):
        super().__init__()
        self.owner = owner
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.capacity = sliding_window or owner.max_cache_len
        self.rows = None  # _DenseRows or _SequenceCaches, made at the first update
        self.cumulative_length = 0  # tokens given to update (what transformers' masks count)
        self.stored = 0  # tokens appended to the rows

    def lazy_initialization(self, key_states, value_states) -> None:
        B, Hkv, _, D = key_states.shape
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.shape = (B, Hkv, D)
        o = self.owner
        if o.kind == "dense":
            hf._pyfa_device(key_states)  # refuses devices pyfa does not run on, now
            self.rows = _DenseRows(key_states, self.capacity)
        else:
            device = hf._pyfa_device(key_states)
            self.rows = _SequenceCaches([
                pyfa.TurboQuantKVCache(Hkv, D, self.capacity, k_bits=o.k_bits, v_bits=o.v_bits, seed=o.seed,
                                       norm_correction=o.norm_correction, sliding_window=self.sliding_window,
                                       device=device) for _ in range(B)], key_states)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Records ``key_states``/``value_states [B, H_kv, n, D]`` for the attention call that follows
        and returns them as they are (see the module docstring)."""
        if not self.is_initialized:
            self.owner._check_implementation()
            self.lazy_initialization(key_states, value_states)
        self.owner._check_pending()
        B, Hkv, _, D = key_states.shape
        if (B, Hkv, D) != self.shape or tuple(value_states.shape) != tuple(key_states.shape):
            raise invalid(f"key_states: PyfaCache layer holds batch {self.shape[0]}, {self.shape[1]} KV heads of "
                          f"dim {self.shape[2]}; got key {tuple(key_states.shape)}, value {tuple(value_states.shape)}")
        if key_states.device != self.device:
            raise invalid(f"key_states: on {key_states.device}, the cache is on {self.device}")
        self.cumulative_length += key_states.shape[2]
        hf.pending_cache_layer(self, key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the keys attention sees, as transformers' dynamic layers
        count them: all past tokens, or for a sliding layer the last ``sliding_window - 1``."""
        past = self.cumulative_length
        if self.sliding_window is None:
            return past + query_length, 0
        visible = min(past, self.sliding_window - 1)
        return visible + query_length, past - visible

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.capacity

    # ----------------------------------------------------------------- called by attention_forward

    def attention(self, call, query, key, value, mask):
        """The attention of this layer's pending call: ``key``/``value`` are the rows the last
        update recorded. Returns ``[B, q_len, H, D]`` in query's dtype."""
        n = key.shape[2]
        past = self.stored
        visible = past if self.sliding_window is None else min(past, self.sliding_window - 1)
        if hf.is_decode_runs(mask):  # a padded batch's decode step: the mask it describes
            mask = hf.runs_as_mask(mask, visible + n)
        plain, _ = call.unmasked(mask, query.shape[2], visible + n)
        if plain is None and query.shape[2] == 1 and past > 0 and call.causal:
            self._check_room(1)
            out = self.rows.step(call, query, key, value)
            self.stored += 1
            return out
        if visible > 0:
            k_past, v_past = self._read(visible)
            key, value = torch.cat([k_past, key], 2), torch.cat([v_past, value], 2)
        out = call.attend(query, key, value, mask)
        self._append(key[:, :, -n:], value[:, :, -n:])
        return out

    def _check_room(self, n: int) -> None:
        """Raises before any row is written when ``n`` more tokens do not fit a full-attention layer."""
        if not self.is_sliding and self.stored + n > self.capacity:
            raise invalid(f"append: {self.stored} stored + {n} new tokens exceed the layer's capacity of "
                          f"{self.capacity} (max_cache_len)")

    def _append(self, key, value) -> None:
        n = key.shape[2]
        self._check_room(n)
        self.rows.append(key, value)
        self.stored += n

    def _read(self, count: int):
        """The last ``count`` stored rows in order, as K and V tensors ``[B, H_kv, count, D]``
        on the cache's device in its dtype."""
        return self.rows.read(count)

    def reset(self) -> None:
        self.rows, self.cumulative_length, self.stored, self.is_initialized = None, 0, 0, False

    # ----------------------------------------------------------------- what a pyfa cache cannot do

    def _unsupported(self, what: str):
        raise NotImplementedError(f"PyfaCache: {what} is not supported (pyfa caches only append; "
                                  "use greedy or sampling without beams)")

    def offload(self):
        self._unsupported("offloading")

    def prefetch(self):
        self._unsupported("offloading")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("crop (assisted decoding)")

    def reorder_cache(self, beam_idx) -> None:
        self._unsupported("reorder_cache (beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("batch_repeat_interleave (num_return_sequences > 1)")

    def batch_select_indices(self, indices) -> None:
        self._unsupported("batch_select_indices")


class PyfaCache(Cache):
    """A transformers cache that pyfa's decode reads in place, for models running
    ``attn_implementation="pyfa"`` (module docstring).

    Parameters
    ----------
    config : the model's config (its decoder config gives the layers and their windows).
    max_cache_len : positive int: tokens a full-attention layer holds (prompt + generated).
    kind : "dense" (tensors in the model's dtype, one decode call a layer for the batch) or
        "turboquant" (a :class:`pyfa.TurboQuantKVCache` per sequence; head_dim 64, 128, 256 or 512).
    k_bits, v_bits, seed, norm_correction : TurboQuant options (as pyfa.TurboQuantKVCache's).

    >>> cache = PyfaCache(model.config, max_cache_len=4096, kind="turboquant", k_bits=4, v_bits=4)
    >>> model.generate(ids, max_new_tokens=64, past_key_values=cache)   # or cache=cache
    """

    def __init__(self, config, max_cache_len, *, kind="dense", k_bits=4, v_bits=4, seed=0,
                 norm_correction=pyfa.turboquant.DEFAULT_NORM_CORRECTION):
        if not isinstance(config, transformers.PretrainedConfig):
            raise invalid(f"config: must be a transformers PretrainedConfig (the model's config), "
                          f"got {type(config).__name__}")
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise invalid(f"max_cache_len: must be a positive int, got {max_cache_len!r}")
        if kind not in KINDS:
            raise invalid(f"kind: must be one of {KINDS}, got {kind!r}")
        if kind == "turboquant":  # checked now, not at the first token
            pyfa.TurboQuantKVCache(1, 64, 1, k_bits=k_bits, v_bits=v_bits, seed=seed,
                                   norm_correction=norm_correction, device="cpu")
        self.config = config.get_text_config(decoder=True)
        self._max_cache_len, self.kind = max_cache_len, kind
        self.k_bits, self.v_bits, self.seed, self.norm_correction = k_bits, v_bits, seed, norm_correction
        layer_types, layer_kwargs = get_layer_types_and_kwargs(self.config)
        if isinstance(layer_kwargs, dict):  # some transformers 5 releases (5.17): one dict for all layers
            layer_kwargs = [layer_kwargs] * len(layer_types)
        layers = []
        for i, (kind_i, kw) in enumerate(zip(layer_types, layer_kwargs)):
            if kind_i not in _LAYER_TYPES:
                raise invalid(f"config: layer {i} is {kind_i!r}; PyfaCache holds {' and '.join(_LAYER_TYPES)} layers")
            window = kw.get("sliding_window") if kind_i == "sliding_attention" else None
            if window is not None and window > max_cache_len:
                window = None  # the window cannot bind within max_cache_len tokens: a plain cache is exact
            layers.append(PyfaCacheLayer(self, window))
        super().__init__(layers=layers)

    @property
    def max_cache_len(self) -> int:
        """Tokens a full-attention layer holds. (A property: some transformers versions define
        one on Cache, which a plain attribute could not replace.)"""
        return self._max_cache_len

    def _check_implementation(self) -> None:
        """Refuses a layer's first update when another attention implementation would read it: it
        would see only the new rows (update returns those), so results would be wrong, not slow.
        Checked once per layer (reading the config costs microseconds); a model switched to another
        implementation later is caught by :meth:`_check_pending` at its next layer's update."""
        impl = getattr(self.config, "_attn_implementation", None)
        if impl not in hf.registered_names():
            raise invalid(f"cache: a PyfaCache is read by pyfa's attention only; the model runs "
                          f"attn_implementation={impl!r} (register() and use {hf.NAME!r})")

    def _check_pending(self) -> None:
        """Refuses an update while an earlier one still awaits its attention call."""
        layer = hf.pending_layer()
        if layer is not None and layer.owner is self:
            self._check_implementation()  # the likely reason, named when it is
            raise invalid("cache: the attention call after the last update() did not receive the rows it returned "
                          "(a model that changes K/V between the cache and attention cannot use a PyfaCache)")
