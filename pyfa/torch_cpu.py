"""torch CPU tensors as numpy arrays over the same memory, and numpy results
back as torch tensors, without copies (CUDA tensors are pyfa/cuda_interop.py's).

numpy reads float32, float16 and integer tensors through ``Tensor.numpy()``
(a view). It has no bfloat16: those tensors are viewed as int16 and
reinterpreted as ml_dtypes' bfloat16, which has the same bits. torch is
imported only once a torch object has been passed in, so pyfa never needs it.
"""
from __future__ import annotations

import numpy as np

from . import dtypes
from .errors import invalid


def is_tensor(x) -> bool:
    """Whether ``x`` is a torch tensor (on any device)."""
    if not type(x).__module__.startswith("torch"):
        return False
    import torch

    return isinstance(x, torch.Tensor)


def is_cpu_tensor(x) -> bool:
    return is_tensor(x) and x.device.type == "cpu"


def as_numpy(t, name: str, writable: bool = False, strided: bool = False) -> np.ndarray:
    """A numpy array over the memory of the CPU tensor ``t``. A non-contiguous
    tensor is first made contiguous (a copy) unless ``writable`` asks for its
    own memory (an output), which must then be contiguous, or ``strided`` asks
    for a view with the tensor's strides (the caller checks them)."""
    import torch

    if t.device.type != "cpu":
        raise invalid(f"{name}: a torch tensor on {t.device}; pyfa reads torch CPU tensors, and CUDA tensors "
                      "on a cuda device")
    if writable and (t.requires_grad or not (strided or t.is_contiguous())):
        raise invalid(f"{name}: must be a {'' if strided else 'contiguous '}torch tensor that does not require grad")
    t = t.detach()
    if not strided and not t.is_contiguous():
        t = t.contiguous()
    try:
        if not writable:
            t = t.resolve_conj().resolve_neg()  # no-ops (no copy) unless such a lazy bit is set
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(dtypes.bfloat16)
        return t.numpy()
    except Exception as e:  # a dtype numpy has no counterpart for (complex32, float8, ...)
        raise invalid(f"{name}: torch dtype {t.dtype} cannot be read ({type(e).__name__}: {e})") from None


def from_numpy(a: np.ndarray):
    """A torch CPU tensor over the memory of ``a`` (bfloat16 through an int16 view)."""
    import torch

    if a.dtype == dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
