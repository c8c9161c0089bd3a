"""numpy dtypes <-> pyfa dtype codes (PYFA_DTYPE_* in pyfa_params.h)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ._native import lib
from .errors import invalid

#: numpy's bfloat16 dtype (``ml_dtypes.bfloat16``): ``x.astype(pyfa.bfloat16)`` makes bfloat16
#: inputs, and bfloat16 outputs come back in it.
bfloat16 = np.dtype(ml_dtypes.bfloat16)

_TO_CODE = {
    np.dtype(np.float32): lib.PYFA_DTYPE_F32,
    np.dtype(np.float16): lib.PYFA_DTYPE_F16,
    bfloat16: lib.PYFA_DTYPE_BF16,
    np.dtype(np.uint8): lib.PYFA_DTYPE_U8,
    np.dtype(np.uint16): lib.PYFA_DTYPE_U16,
    np.dtype(np.uint32): lib.PYFA_DTYPE_U32,
    np.dtype(np.int32): lib.PYFA_DTYPE_I32,
}
_FROM_CODE = {v: k for k, v in _TO_CODE.items()}
FLOAT_TYPES = (np.dtype(np.float32), np.dtype(np.float16), bfloat16)


def code(dtype) -> int:
    try:
        return _TO_CODE[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise invalid(f"dtype: {dtype!r} is not supported (expected one of "
                      f"{', '.join(str(d) for d in _TO_CODE)})") from None


def from_code(c: int) -> np.dtype:
    return _FROM_CODE[c]
