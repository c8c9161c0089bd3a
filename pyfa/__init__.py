"""pyfa: flash-attention kernels for LLM inference (decode over a KV cache,
tiled prefill, TurboQuant-compressed KV decode) in one native library.

>>> import pyfa
>>> "cpu" in pyfa.backends()
True
"""
from . import reference
from .decode import decode_attention
from .device import Buffer, Device, available_backends, backends, counters, default_device, supported
from .dtypes import bfloat16
from .errors import (BackendUnavailableError, CompileError, ExecutionError, InternalError, InvalidArgumentError,
                     OutOfMemoryError, PyfaError, UnsupportedError)
from . import turboquant
from .kvcache import KVCache
from .turboquant import TurboQuantKVCache

__all__ = [
    "Buffer", "Device", "available_backends", "backends", "counters", "default_device", "supported", "bfloat16", "decode_attention", "reference",
    "PyfaError", "InvalidArgumentError", "UnsupportedError", "OutOfMemoryError", "BackendUnavailableError",
    "CompileError", "ExecutionError", "InternalError",
    "KVCache", "TurboQuantKVCache", "turboquant",
]

from .prefill import attention, merge_attention_states  # noqa: E402

__all__ += ["attention", "merge_attention_states"]

# paged KV pools: appends and the pool objects
from .paged_append import paged_kv_append  # noqa: E402
from .paged_cache import PagedKVCache, TurboQuantPagedKVCache  # noqa: E402

__all__ += ["paged_kv_append", "PagedKVCache", "TurboQuantPagedKVCache"]

# Paged decode (pyfa/paged.py; TurboQuant pools: pyfa.turboquant.paged_decode).
from .paged import paged_decode_attention  # noqa: E402

__all__ += ["paged_decode_attention"]

# Packed (varlen) prefill, and prefill over paged pools (chunked prefill).
from .varlen import paged_attention, varlen_attention  # noqa: E402

__all__ += ["varlen_attention", "paged_attention"]
