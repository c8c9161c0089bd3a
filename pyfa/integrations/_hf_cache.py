"""PyfaCache: a transformers ``Cache`` whose layers keep K and V in pyfa caches
(:class:`pyfa.KVCache` or :class:`pyfa.TurboQuantKVCache`), read in place by the
pyfa attention implementation. Imported through ``pyfa.integrations.transformers``.

Contract with transformers' attention modules: ``update(k, v, layer_idx)`` records
the new rows and returns them unchanged; the module's next attention call (pyfa's
:func:`attention_forward`, which recognises those exact tensors) attends over the
cache and appends the rows. So:

- decode steps (one query row, no padding) append the row and run the cache's
  ``attend`` per sequence: the model's KV is never materialised as tensors;
- the prompt (an empty cache) runs prefill attention on its own rows, then appends
  them (a TurboQuant cache: the prompt sees its exact rows, later steps the codes);
- anything else (a mask to apply: padded batches, chunks after the prompt) reads the
  visible cached rows back (dense: a copy; TurboQuant: dequantised), attends over
  them plus the new rows, then appends: correct, not fast.

Batches: a pyfa cache holds one sequence, so a layer holds one cache per sequence
of the first update's batch, and a decode step makes one ``attend`` call per
sequence. Sliding-window layers (``layer_types`` of the config) use ring caches of
capacity ``sliding_window`` that attend to the last ``sliding_window`` tokens;
full-attention layers hold ``max_cache_len`` tokens and raise past that.
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
from pyfa.errors import invalid

from . import transformers as hf

KINDS = ("dense", "turboquant")
_LAYER_TYPES = ("full_attention", "sliding_attention")
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: pyfa.bfloat16}


class PyfaCacheLayer(CacheLayerMixin):
    """One decoder layer's KV: a pyfa cache per sequence (module docstring)."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: "PyfaCache", sliding_window: int | None):
        super().__init__()
        self.owner = owner
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.caches: list = []
        self.cumulative_length = 0  # tokens given to update (what transformers' masks count)
        self.stored = 0  # tokens appended to the pyfa caches

    def lazy_initialization(self, key_states, value_states) -> None:
        B, Hkv, _, D = key_states.shape
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.shape = (B, Hkv, D)
        device = hf._pyfa_device(key_states)
        self.caches = [self._new_cache(Hkv, D, key_states.dtype, device) for _ in range(B)]
        self.is_initialized = True

    def _new_cache(self, num_kv_heads: int, head_dim: int, dtype, device: str):
        """One sequence's pyfa cache: a ring of ``sliding_window`` rows, or ``max_cache_len`` rows."""
        o = self.owner
        capacity = self.sliding_window or o.max_cache_len
        if o.kind == "dense":
            return pyfa.KVCache(num_kv_heads, head_dim, capacity, dtype=_NUMPY_DTYPES[dtype],
                                sliding_window=self.sliding_window, device=device)
        return pyfa.TurboQuantKVCache(num_kv_heads, head_dim, capacity, k_bits=o.k_bits, v_bits=o.v_bits, seed=o.seed,
                                      norm_correction=o.norm_correction, sliding_window=self.sliding_window,
                                      device=device)

    def update(self, key_states, value_states, *args, **kwargs):
        """Records ``key_states``/``value_states [B, H_kv, n, D]`` for the attention call that follows
        and returns them as they are (see the module docstring)."""
        self.owner._check_ready()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
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
        return self.sliding_window or self.owner.max_cache_len

    # ----------------------------------------------------------------- called by attention_forward

    def attention(self, call, query, key, value, mask):
        """The attention of this layer's pending call: ``key``/``value`` are the rows the last
        update recorded. Returns ``[B, q_len, H, D]`` in query's dtype."""
        n = key.shape[2]
        past = self.stored
        visible = past if self.sliding_window is None else min(past, self.sliding_window - 1)
        plain, _ = call.unmasked(mask, query.shape[2], visible + n)
        if plain is None and query.shape[2] == 1 and past > 0 and call.causal:
            self._append(key, value)
            return self._decode(call, query)
        if visible > 0:
            k_past, v_past = self._read(visible)
            key, value = torch.cat([k_past, key], 2), torch.cat([v_past, value], 2)
        out = call.attend(query, key, value, mask)
        self._append(key[:, :, -n:], value[:, :, -n:])
        return out

    def _append(self, key, value) -> None:
        for b, cache in enumerate(self.caches):  # [H_kv, n, D] -> the caches' [n, H_kv, D] rows
            cache.append(hf._arg(key[b].transpose(0, 1).contiguous()), hf._arg(value[b].transpose(0, 1).contiguous()))
        self.stored += key.shape[2]

    def _decode(self, call, query):
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

    def _read(self, count: int):
        """The last ``count`` stored rows in order, as K and V tensors ``[B, H_kv, count, D]``
        on the cache's device in its dtype (dense: copies; TurboQuant: dequantised)."""
        if self.device.type == "cuda":  # appends were queued on torch's stream; reads run on pyfa's
            torch.cuda.current_stream(self.device).synchronize()
        ks, vs = [], []
        for cache in self.caches:
            with cache._lock:
                if isinstance(cache, pyfa.TurboQuantKVCache):
                    k, v = cache._dequantize()  # [len, H_kv, D] float32, oldest first
                    k, v = torch.from_numpy(k[-count:]), torch.from_numpy(v[-count:])
                else:
                    kv_len, start = cache._ring()
                    order = (start + np.arange(kv_len - count, kv_len)) % cache.capacity
                    k, v = (hf._tensor(buf.read()[:, order]).transpose(0, 1) for buf in (cache._k, cache._v))
            ks.append(k)
            vs.append(v)
        to = dict(device=self.device, dtype=self.dtype)
        return (torch.stack(ks).transpose(1, 2).to(**to).contiguous(),
                torch.stack(vs).transpose(1, 2).to(**to).contiguous())

    # ----------------------------------------------------------------- what a pyfa cache cannot do

    def reset(self) -> None:
        self.caches, self.cumulative_length, self.stored, self.is_initialized = [], 0, 0, False

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
    """A transformers cache in pyfa caches, for models running ``attn_implementation="pyfa"``.

    Parameters
    ----------
    config : the model's config (its decoder config gives the layers and their windows).
    max_cache_len : positive int: tokens a full-attention layer holds (prompt + generated).
    kind : "dense" (:class:`pyfa.KVCache` in the model's dtype) or "turboquant"
        (:class:`pyfa.TurboQuantKVCache`; head_dim 64, 128, 256 or 512).
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

    def _check_ready(self) -> None:
        """Refuses an update that another attention implementation would read: it would see
        only the new rows (update returns those), so results would be wrong, not slow."""
        impl = getattr(self.config, "_attn_implementation", None)
        if impl not in hf.registered_names():
            raise invalid(f"cache: a PyfaCache is read by pyfa's attention only; the model runs "
                          f"attn_implementation={impl!r} (register() and use {hf.NAME!r})")
        layer = hf.pending_layer()
        if layer is not None and layer.owner is self:
            raise invalid("cache: the attention call after the last update() did not receive the rows it returned "
                          "(a model that changes K/V between the cache and attention cannot use a PyfaCache)")
