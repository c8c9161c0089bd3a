"""flash_attn_vec against the float64 reference."""
import numpy as np
import pytest

import pyfa
from pyfa import reference

# Tolerances on max |out - ref|, out being a convex combination of V rows
# (|v| ~ N(0,1)). f32 caches: f32 accumulation over <= 4K keys stays near 1e-6.
# f16/bf16 caches: the reference reads the same rounded values, so only the
# f32 accumulation differs; q given as f16/bf16 is likewise rounded on both
# sides. 2e-5 leaves margin for exp() and summation-order differences.
TOL = 2e-5


def make(rng, B, H, Hkv, D, cap, dtype, qdtype=np.float32):
    q = rng.standard_normal((B, H, D)).astype(qdtype)
    k = rng.standard_normal((B, Hkv, cap, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, cap, D)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("D", [64, 80, 96, 128, 192, 256, 512])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, pyfa.bfloat16])
def test_head_dims_and_dtypes(device, rng, D, dtype):
    q, k, v = make(rng, 1, 4, 2, D, 300, dtype)
    out = pyfa.decode_attention(q, k, v, 257, device=device)
    ref = reference.decode_attention(q, k, v, 257)
    assert out.dtype == np.float32 and out.shape == q.shape
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)
