"""pyfa as a Hugging Face transformers attention implementation.

    import pyfa.integrations.transformers as pyfa_hf
    pyfa_hf.register()                    # once per process; returns the name, "pyfa"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="pyfa")

:func:`register` adds two entries under one name:

- ``transformers.AttentionInterface``: :func:`attention_forward`, which every attention
  layer calls with ``query [B, H, q_len, D]`` and ``key``/``value [B, H_kv, kv_len, D]``
  (the layer's whole cache after this step's update) and which returns
  ``(out [B, q_len, H, D] in query's dtype, None)``;
- ``transformers.AttentionMaskInterface`` (transformers >= 4.53): :func:`attention_mask`,
  which builds the mask the model hands to its layers. Without it transformers hands a
  custom implementation no mask at all, and padding would be ignored.

What runs for each call:

- no mask to apply and ``q_len == 1``: :func:`pyfa.decode_attention` over the keys as a
  cache of capacity ``kv_len`` (the query is the newest position: it sees every key, or
  the last ``window``);
- no mask and ``q_len > 1``: :func:`pyfa.attention` with the layer's causality; pyfa's
  causal mask is bottom-right aligned (the last query row sees the last key), which is
  transformers' mask whenever the queries are the last ``q_len`` positions of the keys;
- a decode step whose keys are, per sequence, one run of positions (the "decode runs" below:
  static caches, left-padded batches): :func:`pyfa.decode_attention` over that run, through
  ``torch.ops.pyfa`` (:mod:`pyfa.integrations.torch_ops`), so ``torch.compile`` keeps it in
  its graph;
- any other mask (padded prompts, packed sequences, overlays, right padding, a static cache's
  sliding-window layers): :func:`pyfa.attention` with that mask alone, as transformers' sdpa
  integration does (the mask then carries causality and windows). Correct, not fast.

Decode runs. For one query row under transformers' plain causal pattern (no window, no
overlay) with a padding mask, the query at position ``q`` sees, in each sequence, its real
tokens up to ``q``. With left padding (what ``generate`` pads with) those are one run of
slots, from the first real token to ``q``, which pyfa's decode reads directly (``ring_start``
the run's first slot, ``kv_len`` its length). :func:`attention_mask` then returns that
description instead of a mask: int32 ``[3, B, 1, 1]`` of ``kv_len``, ``ring_start`` and
``whole`` (1 when the sequence's visible keys are one run), which only pyfa's attention reads.

- A static cache (``cache_implementation="static"``, whose offset is a device tensor) gets the
  runs at every decode step, computed on the device without a host read: ``generate`` builds
  the mask ahead of each step and compiles the step (``torch.compile``, CUDA graphs), and the
  static tensors are the cache the decode reads in place. A sequence whose padding mask has a
  hole (right padding, which ``generate`` warns against) cannot be one run: its rows are NaN,
  not a plausible wrong answer. Sliding-window layers of a static cache (transformers rolls
  their tensors) take the masked path.
- A dynamic cache gets ``None`` without padding (as before) and the runs with left padding;
  a mask with a hole is built as sdpa's and takes the masked path, exactly.

Masks (:func:`attention_mask`): ``None`` when the pattern is exactly bottom-right causal,
without padding and without a window that can bind; otherwise transformers' own bool mask
(``sdpa_mask``: True = attend). A materialised mask that is exactly bottom-right causal with
the window ``local_size`` (a sliding-window layer whose context outgrew its window) is
remembered, by identity, as "causal, window W": layers that receive it take the unmasked
kernels with ``window=W`` without reading it. This holds for models whose attention
modules do not pass ``sliding_window`` too. Masks made elsewhere (older transformers,
user-built 4-D masks) are compared once per tensor version with the bottom-right causal
pattern of the layer's window (one device sync per mask, not per layer) and take the same
path when they match.

Conventions, mapped exactly:

- ``scaling`` -> ``scale`` (None: ``1/sqrt(D)`` in both).
- ``sliding_window=W``: transformers lets query position ``p`` see key ``j`` when
  ``p - j < W`` (``kv_idx > q_idx - sliding_window`` in masking_utils; its FA2 path passes
  ``window_size=(W-1, W-1)``): the last W positions, the query's own included, which is
  pyfa's ``window=W``.
- ``softcap``: both apply ``softcap * tanh(s / softcap)`` to the scaled scores, before the mask.
- float masks are additive (transformers' eager masks: 0 or ``finfo.min``); they are passed
  in the query's dtype.
- ``s_aux`` (attention sinks, gpt-oss: one logit per query head that joins the softmax's
  denominator only): pyfa runs with a float32 output and its LSE, and :func:`with_sinks`
  rescales each row by ``sigmoid(lse - sink)``.

:class:`PyfaCache` (``pyfa/integrations/_hf_cache.py``) is a transformers ``Cache`` that
keeps the model's K and V in pyfa caches; with it, decode steps attend the caches in place
(``attend``) instead of transformers' concatenated tensors.

Refused with NotImplementedError naming the feature: position biases, dropout > 0,
gradients (pyfa is inference-only), key and value head dims that differ, sinks of another
shape than ``[H]``, a sliding window on a non-causal layer without a mask, tensors on
devices other than the CPU and CUDA GPU 0.

Tensors: CUDA tensors go to pyfa's ``cuda`` backend and are read in place on torch's
current stream; CPU tensors are read in place as numpy arrays by the ``cpu`` backend.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np

import pyfa
from pyfa import _args
from pyfa.decode import decode_rows

__all__ = ["register", "attention_forward", "attention_mask", "with_sinks", "PyfaCache", "NAME"]

NAME = "pyfa"
_NAMES: set[str] = set()  # the names register() gave pyfa


def __getattr__(name):
    if name in ("PyfaCache", "PyfaCacheLayer"):  # imported on first use: it subclasses transformers' Cache
        from . import _hf_cache

        return getattr(_hf_cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def registered_names() -> frozenset:
    """The names pyfa is registered under (attn_implementation values that run it)."""
    return frozenset(_NAMES)

# A [B, 1, q, kv] mask is expanded to one call's [B, H, q, kv] up to this many
# bytes; larger masks run one pyfa.attention call per sequence instead.
_EXPAND_BYTES = 256 << 20


def register(name: str = NAME) -> str:
    """Registers pyfa with transformers under ``name`` (attention and, where
    transformers has it, mask interfaces); returns ``name`` for
    ``attn_implementation=``. Raises ImportError naming what is missing."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("pyfa.integrations.transformers needs transformers >= 4.48 "
                          "(pip install transformers)") from e
    interface = getattr(transformers, "AttentionInterface", None)
    if interface is None:
        raise ImportError(f"transformers {transformers.__version__} has no AttentionInterface (needs >= 4.48)")
    interface.register(name, attention_forward)
    masks = getattr(transformers, "AttentionMaskInterface", None)
    if masks is None:
        try:
            from transformers.masking_utils import AttentionMaskInterface as masks
        except ImportError:  # < 4.53: models build 4-D masks themselves (see attention_forward)
            masks = None
    if masks is not None:
        masks.register(name, attention_mask)
    _NAMES.add(name)
    return name


# --------------------------------------------------------------------------- masks

class _Remembered:
    """Masks known to be exactly bottom-right causal with a window (value: the
    window, None for none), by identity. An entry lives as long as its tensor."""

    def __init__(self, limit: int = 64):
        self._items: dict[int, tuple] = {}
        self._lock = threading.Lock()
        self._limit = limit

    def put(self, mask, key, window) -> None:
        ident = id(mask)
        ref = weakref.ref(mask, lambda _r, ident=ident: self._drop(ident))
        with self._lock:
            if len(self._items) >= self._limit:  # oldest out; a miss only costs a re-check
                self._items.pop(next(iter(self._items)))
            self._items[ident] = (ref, key, window)

    def get(self, mask, key):
        """(True, window) if ``mask`` was put with ``key``, else (False, None)."""
        item = self._items.get(id(mask))
        if item is None or item[0]() is not mask or item[1] != key:
            return False, None
        return True, item[2]

    def _drop(self, ident) -> None:
        with self._lock:
            item = self._items.get(ident)
            if item is not None and item[0]() is None:
                del self._items[ident]


_CAUSAL = _Remembered()   # made by attention_mask: key (q_len, kv_len)
_PREFIX = _Remembered()   # made by attention_mask: key (q_len, kv_len); value: the keys a static prefill sees
_CHECKED = _Remembered()  # compared in attention_forward: key (version, q_len, kv_len, window); value: bool


def _as_int(x) -> int:
    """An offset as an int (static caches hand a 0-d tensor; reading it syncs once per mask)."""
    return int(x.item()) if hasattr(x, "item") else int(x)


def _no_padding(padding, kv_offset: int, kv_length: int) -> bool:
    """True when the 2-D padding mask (True = real token) lets every key in
    ``[kv_offset, kv_offset + kv_length)`` through (a shorter mask pads with False)."""
    if padding is None:
        return True
    region = padding[:, kv_offset:kv_offset + kv_length]
    return region.shape[-1] == kv_length and bool(region.all())


def _window_cannot_bind(q_offset: int, q_length: int, kv_offset: int, size: int) -> bool:
    """True when a local pattern of ``size`` cannot hide any key from any query:
    every distance is below ``size`` (a sliding window) and every position lies in
    one block of ``size`` (chunked attention passes its chunk as local_size too)."""
    last = q_offset + q_length - 1
    return last - kv_offset < size and kv_offset // size == last // size


def _causal_pattern(q_len: int, kv_len: int, window, device):
    """bool ``[q_len, kv_len]``: bottom-right causal (query row i is position
    ``kv_len - q_len + i``), limited to the last ``window`` positions when given."""
    import torch

    pos = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    key = torch.arange(kv_len, device=device)[None, :]
    visible = key <= pos
    if window:
        visible &= (pos - key) < window
    return visible


def _matches_causal(mask, q_len: int, kv_len: int, window) -> bool:
    """Whether a ``[..., q_len, kv_len]`` mask (bool True = attend, or additive
    float: 0 attends, <= finfo.min / 2 or -inf blocks) is exactly the bottom-right
    causal pattern with ``window``. Reads the mask (one device sync)."""
    import torch

    if tuple(mask.shape[-2:]) != (q_len, kv_len):
        return False
    visible = _causal_pattern(q_len, kv_len, window, mask.device).expand(mask.shape)
    if mask.dtype == torch.bool:
        return torch.equal(mask, visible)
    blocked = mask <= torch.finfo(mask.dtype).min / 2
    return bool(torch.where(visible, mask == 0, blocked).all())


def _plain_causal():
    """transformers' causal mask function: the pattern without overlays, windows or chunks."""
    from transformers import masking_utils

    return masking_utils.causal_mask_function


def _decode_runs(batch_size: int, q_offset, padding, device):
    """A decode step's mask as pyfa reads it (module docstring, "Decode runs"): int32
    ``[3, B, 1, 1]`` of each sequence's ``kv_len``, ``ring_start`` and ``whole``.

    The query is position ``q_offset`` (an int, or a 0-d device tensor: read on the device) and
    sees the keys at or before it that ``padding`` (2-D, True = real token; None: no padding;
    positions past its end are padding, as transformers pads it) lets through. When those are
    one run of slots, ``ring_start`` is its first and ``kv_len`` its length, and ``whole`` is 1;
    otherwise (a hole: right padding; or no key at all) ``whole`` is 0."""
    import torch

    if padding is None:
        last = torch.as_tensor(q_offset, device=device)
        kv_len = (last + 1).to(torch.int32).expand(batch_size)
        first = torch.zeros(batch_size, dtype=torch.int32, device=last.device)
        whole = torch.ones_like(first)
    else:
        pos = torch.arange(padding.shape[-1], device=padding.device)
        seen = padding.bool() & (pos <= q_offset)
        count = seen.sum(-1)
        first = seen.to(torch.int32).argmax(-1)  # the first True; 0 for a row without one
        last = torch.where(seen, pos, -1).amax(-1)
        whole = (count > 0) & (count == last + 1 - first)
        kv_len = count.clamp(min=1)
    return torch.stack([kv_len.to(torch.int32), first.to(torch.int32), whole.to(torch.int32)]).view(
        3, batch_size, 1, 1)


def is_decode_runs(mask) -> bool:
    """Whether ``mask`` is a :func:`_decode_runs` description (int32 ``[3, B, 1, 1]``), not a mask."""
    import torch

    return (isinstance(mask, torch.Tensor) and mask.dtype == torch.int32 and mask.dim() == 4
            and mask.shape[0] == 3 and mask.shape[2] == 1 and mask.shape[3] == 1)


def runs_as_mask(runs, kv_length: int):
    """The bool mask ``[B, 1, 1, kv_length]`` (True = attend) a :func:`_decode_runs` description
    stands for: slots ``ring_start .. ring_start + kv_len - 1`` of each sequence whose keys are one run."""
    import torch

    kv_len, first, whole = runs.view(3, -1)[:, :, None]
    pos = torch.arange(kv_length, device=runs.device)[None, :]
    return ((pos >= first) & (pos < first + kv_len) & whole.bool())[:, None, None, :]


def attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask=None, local_size=None, allow_is_causal_skip=True, **kwargs):
    """transformers mask-interface function (the arguments of
    ``masking_utils.sdpa_mask``): None when pyfa's unmasked kernels give the
    pattern exactly, else transformers' bool mask ``[B, 1, q_length, kv_length]``.

    ``allow_is_causal_skip`` is transformers' statement that the pattern is its
    causal (or sliding-window causal) one with nothing overlaid; masks it denies
    that for (bidirectional, packed, overlays) are always built."""
    from transformers import masking_utils

    def build():
        if mask_function is not None:
            kwargs["mask_function"] = mask_function
        return masking_utils.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                                       q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask,
                                       local_size=local_size, allow_is_causal_skip=False, **kwargs)

    static = hasattr(q_offset, "device")  # static caches count their tokens in a device tensor
    plain = local_size is None and mask_function in (None, _plain_causal())  # causal, nothing overlaid
    if (q_length == 1 and plain and type(kv_offset) is int and kv_offset == 0
            and (allow_is_causal_skip or static)):
        if static:  # no host read: generate builds this mask ahead of each compiled step
            return _decode_runs(batch_size, q_offset, attention_mask, kwargs.get("device"))
        if q_offset + 1 == kv_length:  # a dynamic cache: the keys are the past and this step's row
            if _no_padding(attention_mask, 0, kv_length):
                return None
            runs = _decode_runs(batch_size, q_offset, attention_mask, kwargs.get("device"))
            return runs if bool(runs[2].bool().all()) else build()  # a hole: the masked path is exact
    if not allow_is_causal_skip:
        return build()
    q_off, kv_off = _as_int(q_offset), _as_int(kv_offset)
    if plain and kv_off == 0 and q_off + q_length < kv_length and _no_padding(attention_mask, 0, q_off + q_length):
        # Keys past the queries (a static cache's prompt): causal over the first keys (_Call.attend).
        mask = build()
        _PREFIX.put(mask, (q_length, kv_length), q_off + q_length)
        return mask
    # Bottom-right: the last query is the last key (dynamic and sliding caches; not
    # static caches, whose keys run on past the queries).
    if q_off + q_length != kv_off + kv_length or not _no_padding(attention_mask, kv_off, kv_length):
        return build()
    if local_size is None or _window_cannot_bind(q_off, q_length, kv_off, local_size):
        return None
    mask = build()
    if mask is not None and _matches_causal(mask, q_length, kv_length, local_size):
        _CAUSAL.put(mask, (q_length, kv_length), local_size)
    return mask


def _unmasked_window(mask, q_len: int, kv_len: int, window):
    """(True, window to use) when ``mask`` is exactly bottom-right causal (with
    that window), so the unmasked kernels give its result; else (False, None)."""
    known, w = _CAUSAL.get(mask, (q_len, kv_len))
    if known:
        return True, w
    try:
        version = mask._version
    except RuntimeError:  # an inference-mode tensor has no version counter: checked at each call
        version = None
    key = (version, q_len, kv_len, window)
    known, same = _CHECKED.get(mask, key) if version is not None else (False, None)
    if not known:
        same = _matches_causal(mask, q_len, kv_len, window)
        if version is not None:
            _CHECKED.put(mask, key, same)
    return (True, window) if same else (False, None)


# --------------------------------------------------------------------------- tensors <-> pyfa

def _pyfa_device(t) -> str:
    if t.is_cuda:
        if t.get_device() != 0:
            raise NotImplementedError(f"pyfa attention: tensors on {t.device}: pyfa's cuda backend runs on GPU 0")
        return "cuda"
    if t.device.type == "cpu":
        return "cpu"
    raise NotImplementedError(f"pyfa attention: tensors on {t.device.type} are not supported (CPU and CUDA only)")


def _arg(t):
    """What pyfa reads for a tensor: CUDA tensors themselves (in place), CPU
    tensors as numpy arrays over the same memory (bfloat16 through ml_dtypes)."""
    import torch

    if t.is_cuda:
        return t
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(pyfa.bfloat16)
    return t.numpy()


def _tensor(a):
    """A pyfa result as a torch tensor (numpy results wrapped without a copy)."""
    import torch

    if isinstance(a, torch.Tensor):
        return a
    if a.dtype == pyfa.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _prefill(q, k, v, *, mask, causal, window, scale, softcap, device, lse):
    """pyfa.attention on [B, H, L, D] tensors as they come: views of the projections' [B, L, H, D]
    memory and the cache's [B, H, L, D] are read in place, and the output is written as
    [B, q_len, H, D]. Returns (out [B, q_len, H, D] contiguous, and with ``lse`` True the float32
    output and LSE [B, H, q_len]; else q's dtype and None)."""
    import torch

    B, H, q_len, D = q.shape
    out = q.new_empty((B, q_len, H, D), dtype=torch.float32 if lse else q.dtype)
    extra = dict(out_dtype=np.float32, return_lse=True) if lse else {}
    res = pyfa.attention(q.detach(), k.detach(), v.detach(), scale=scale, causal=causal, mask=mask, window=window,
                         softcap=softcap, layout="bhsd", device=device, out=out.transpose(1, 2), **extra)
    return out, (_tensor(res[1]) if lse else None)


def _prefill_masked(q, k, v, mask, *, scale, softcap, device, lse):
    """pyfa.attention under a transformers mask ``[B or 1, H or 1, q_len, >= kv_len]``
    (bool or additive); the mask alone decides what is visible. Returns as :func:`_prefill`."""
    import torch

    B, H, q_len, _ = q.shape
    kv_len = k.shape[2]
    if mask.dim() == 2:
        mask = mask[None, None]
    if mask.dim() != 4 or mask.shape[0] not in (1, B) or mask.shape[1] not in (1, H) or mask.shape[2] != q_len \
            or mask.shape[3] < kv_len:
        raise ValueError(f"pyfa attention: attention_mask of shape {tuple(mask.shape)} does not fit "
                         f"query {tuple(q.shape)} and key {tuple(k.shape)}")
    mask = mask[..., :kv_len]  # transformers' eager and sdpa paths cut longer masks the same way
    if mask.dtype != torch.bool and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)  # pyfa's additive masks are in q's dtype (finfo.min stays a block)
    run = dict(causal=False, window=None, scale=scale, softcap=softcap, device=device, lse=lse)
    Bm, Hm = mask.shape[:2]
    if Bm == 1 and Hm == 1:  # one [q_len, kv_len] mask for every sequence and head
        return _prefill(q, k, v, mask=_arg(mask[0, 0]), **run)
    if (Bm, Hm) == (B, H) or B * H * q_len * kv_len * mask.element_size() <= _EXPAND_BYTES:
        return _prefill(q, k, v, mask=_arg(mask.expand(B, H, q_len, kv_len).contiguous()), **run)
    parts = []
    for b in range(B):  # large masks: one call per sequence, its mask shared by the heads
        m = mask[b if Bm > 1 else 0]
        m = m[0] if Hm == 1 else m.expand(H, q_len, kv_len)[None]
        parts.append(_prefill(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask=_arg(m.contiguous()), **run))
    return torch.cat([o for o, _ in parts], 0), (torch.cat([l for _, l in parts], 0) if lse else None)


def _decode(q, k, v, *, window, scale, softcap, device, lse):
    """pyfa.decode_attention of one query row per head over [B, H_kv, kv_len, D] keys taken
    as a full cache; returns as :func:`_prefill` ([B, 1, H, D], LSE [B, H, 1])."""
    k = k if k.is_contiguous() else k.contiguous()  # DynamicCache concatenates: normally contiguous
    v = v if v.is_contiguous() else v.contiguous()
    extra = dict(out_dtype=np.float32, return_lse=True) if lse else {}
    res = pyfa.decode_attention(_arg(q.select(2, 0)), _arg(k), _arg(v), k.shape[2], scale=scale, softcap=softcap,
                                window=window, device=device, **extra)
    if lse:
        return _tensor(res[0]).unsqueeze(1), _tensor(res[1]).unsqueeze(2)
    return _tensor(res).unsqueeze(1), None  # q's dtype: decode_attention's default


def _decode_over_runs(q, k, v, runs, *, window, scale, softcap, lse):
    """One query row per head over the runs of slots a :func:`_decode_runs` description gives
    (``k``/``v [B, H_kv, capacity, D]``, a static cache's whole tensors), through the torch
    operators (``torch.compile`` keeps them in its graph); returns as :func:`_prefill`. A sequence
    whose keys are not one run (``whole`` 0) gets NaN rows: its mask has a hole pyfa's decode
    cannot skip, and that is never silently a plausible result."""
    import torch

    from . import torch_ops  # noqa: F401  (registers torch.ops.pyfa)

    kv_len, ring_start, whole = runs.view(3, -1).unbind(0)
    k = k if k.is_contiguous() else k.contiguous()
    v = v if v.is_contiguous() else v.contiguous()
    opts = (scale, softcap, window or 0)
    if lse:
        out, l = torch.ops.pyfa.decode_attention_lse(q.select(2, 0), k, v, kv_len, ring_start, *opts)
    else:
        out, l = torch.ops.pyfa.decode_attention(q.select(2, 0), k, v, kv_len, ring_start, *opts), None
    out = torch.where(whole.bool()[:, None, None], out, float("nan"))
    return out.unsqueeze(1), (l.unsqueeze(2) if lse else None)


def with_sinks(out, lse, sinks):
    """Attention with sinks from attention without them. gpt-oss's eager attention takes the
    softmax over ``[scores, sink_h]`` and drops the sink's column, so with ``Z = sum_j exp(s_j)
    = exp(lse)`` each row is ``sum_j exp(s_j) v_j / (Z + exp(sink)) = out * Z / (Z + exp(sink))
    = out * sigmoid(lse - sink)``. sigmoid is stable for every lse, -inf included (a row that
    sees no key stays 0). ``out [B, q_len, H, D]`` and ``lse [B, H, q_len]`` float32,
    ``sinks [H]``; returns float32 ``[B, q_len, H, D]``."""
    import torch

    factor = torch.sigmoid(lse - sinks.detach().to(device=lse.device, dtype=torch.float32)[None, :, None])
    return out * factor.transpose(1, 2)[..., None]


def _refuse_unsupported(module, query, key, value, dropout, kwargs) -> None:
    import torch

    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("pyfa attention: position_bias is not supported")
    if dropout and getattr(module, "training", False):
        raise NotImplementedError(f"pyfa attention: dropout ({dropout}) is not supported (inference only)")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise NotImplementedError("pyfa attention is inference-only: run under torch.no_grad() / "
                                  "torch.inference_mode(), or use another implementation to train")
    if key.shape[-1] != value.shape[-1] or key.shape[-1] != query.shape[-1]:
        raise NotImplementedError(f"pyfa attention: query, key and value head dims must be equal, got "
                                  f"{query.shape[-1]}, {key.shape[-1]}, {value.shape[-1]}")
    if key.shape[0] != query.shape[0]:
        raise NotImplementedError(f"pyfa attention: key batch {key.shape[0]} differs from query batch "
                                  f"{query.shape[0]}")
    sinks = kwargs.get("s_aux")
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise NotImplementedError(f"pyfa attention: s_aux (attention sinks) must hold one logit per query head, "
                                  f"shape ({query.shape[1]},), got {tuple(sinks.shape)}")


class _Call:
    """One attention call's options, mapped to pyfa's (see the module docstring)."""

    def __init__(self, module, query, scaling, sliding_window, softcap, kwargs):
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", True)
        self.causal = bool(causal)
        self.window = int(sliding_window) if sliding_window else None
        self.scale = None if scaling is None else float(scaling)
        self.softcap = float(softcap) if softcap else 0.0
        self.sinks = kwargs.get("s_aux")
        self.device = _pyfa_device(query)

    def unmasked(self, mask, q_len: int, kv_len: int):
        """(mask to apply or None, window): a mask that is exactly bottom-right causal
        (with a window) becomes None and that window."""
        if mask is not None and self.causal:
            unmasked, w = _unmasked_window(mask, q_len, kv_len, self.window)
            if unmasked:
                return None, w
        return mask, self.window

    def finish(self, out, lse, dtype):
        """The call's result from pyfa's: sinks applied (from the float32 output and LSE), in ``dtype``."""
        if self.sinks is not None:
            out = with_sinks(out, lse, self.sinks)
        return out if out.dtype == dtype else out.to(dtype)

    def attend(self, query, key, value, mask):
        """Attention of ``query [B, H, q_len, D]`` over ``key``/``value [B, H_kv, kv_len, D]``
        under ``mask`` (see attention_forward); returns ``[B, q_len, H, D]`` in query's dtype."""
        if key.dtype != query.dtype:
            key, value = key.to(query.dtype), value.to(query.dtype)
        q_len, kv_len = query.shape[2], key.shape[2]
        lse = self.sinks is not None
        if is_decode_runs(mask):
            if q_len != 1:
                raise ValueError(f"pyfa attention: a decode-runs mask is for one query row, got {q_len}")
            out, l = _decode_over_runs(query, key, value, mask, window=self.window, scale=self.scale,
                                       softcap=self.softcap, lse=lse)
            return self.finish(out, l, query.dtype)
        if mask is not None:
            known, seen = _PREFIX.get(mask, (q_len, kv_len))
            if known:  # causal over the first `seen` keys: the unmasked kernel over those
                key, value, mask, kv_len = key[:, :, :seen], value[:, :, :seen], None, seen
        mask, window = self.unmasked(mask, q_len, kv_len)
        run = dict(scale=self.scale, softcap=self.softcap, device=self.device, lse=lse)
        if mask is None:
            if window is not None and not self.causal:
                raise NotImplementedError("pyfa attention: a sliding window on a non-causal layer needs a mask "
                                          "(transformers' bidirectional windows are two-sided)")
            if q_len == 1:
                out, l = _decode(query, key, value, window=window, **run)
            else:
                out, l = _prefill(query, key, value, mask=None, causal=self.causal, window=window, **run)
        else:
            out, l = _prefill_masked(query, key, value, mask, **run)
        return self.finish(out, l, query.dtype)


class _Pending(threading.local):
    """A PyfaCache layer's update awaiting its attention call on this thread (class defaults: a
    lookup before any update is a plain None, not a caught AttributeError per attention call)."""
    layer = key = value = None


_PENDING = _Pending()


def pending_cache_layer(layer, key, value) -> None:
    """Called by :class:`PyfaCache` layers' ``update``: the next attention call of this thread
    whose key and value are exactly these tensors reads ``layer`` instead (see attention_forward)."""
    _PENDING.layer, _PENDING.key, _PENDING.value = layer, key, value


def pending_layer():
    """The cache layer whose update still awaits its attention call on this thread, or None."""
    return _PENDING.layer


def _take_pending(key, value):
    layer = _PENDING.layer
    if layer is None or _PENDING.key is not key or _PENDING.value is not value:
        return None
    _PENDING.layer = _PENDING.key = _PENDING.value = None
    return layer


_GRAD = []  # torch.is_grad_enabled, once torch is imported
_CUDA = []  # pyfa's cuda device, once a CUDA call came


def _decode_repeat(query, key, value, scaling, dropout, sliding_window, softcap, kwargs):
    """A decode step's attention (one query row, no mask, no window, soft cap or sinks, inference,
    keys in the query's dtype) on CUDA tensors whose shapes an earlier call of this thread checked: pyfa's decode repeat path
    (:func:`pyfa.decode.decode_rows`) straight from ``query [B, H, 1, D]`` into ``[B, 1, H, D]``,
    without the views and checks of the full path below (what they would refuse cannot reach the
    kernels: the repeat path matches only shapes, dtypes and GPUs a full call accepted). None when
    anything differs: the full path then takes the call."""
    if dropout or sliding_window or softcap or (scaling is not None and type(scaling) is not float) \
            or kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None:
        return None
    if not _GRAD:
        import torch

        _GRAD.append(torch.is_grad_enabled)
    # Keys of another dtype than the query's are cast by the full path (Call.attend): the repeat
    # path's entries may hold such caches uncast (a user's own decode_attention call).
    if not query.is_cuda or key.dtype is not query.dtype or value.dtype is not query.dtype \
            or _GRAD[0]() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return None
    if not _CUDA:
        try:
            _CUDA.append(_args.device_arg("cuda"))  # the device the full path's calls name "cuda"
        except pyfa.PyfaError:
            return None  # the full path says why (or refuses the call first)
    return decode_rows(query, key, value, key.shape[2], scaling, _CUDA[0])


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                      softcap=None, **kwargs):
    """transformers attention-interface function (see the module docstring).

    ``query [B, H, q_len, D]``, ``key``/``value [B, H_kv, kv_len, D]`` (``H % H_kv == 0``),
    ``attention_mask``: None, or ``[B or 1, 1 or H, q_len, >= kv_len]`` bool (True = attend)
    or additive float; ``s_aux``: None or per-head sink logits ``[H]``. With a
    :class:`PyfaCache`, ``key``/``value`` are this step's new rows only and the cache layer
    supplies the rest. Returns ``(out [B, q_len, H, D] contiguous in query's dtype, None)``."""
    if attention_mask is None and _PENDING.layer is None:
        out = _decode_repeat(query, key, value, scaling, dropout, sliding_window, softcap, kwargs)
        if out is not None:
            return out, None
    _refuse_unsupported(module, query, key, value, dropout, kwargs)
    call = _Call(module, query, scaling, sliding_window, softcap, kwargs)
    layer = _take_pending(key, value)
    if layer is not None:
        out = layer.attention(call, query, key, value, attention_mask)
    else:
        out = call.attend(query, key, value, attention_mask)
    return out.contiguous(), None
