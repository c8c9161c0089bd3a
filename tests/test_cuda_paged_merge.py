"""Dense paged decode plans on CUDA end a split as the plans over contiguous caches do: the last
workgroup of each row merges it, so a call is one launch where theirs is, with their bits.
(TurboQuant pools keep the reduce + undo tail: flash_attn_vec_tq's merge is never paged.)
Skips without the cuda backend."""
import numpy as np
import pytest

import pyfa

try:
    DEVICE = pyfa.Device("cuda")
except pyfa.PyfaError as e:
    pytest.skip(f"pyfa cuda backend unavailable: {e}", allow_module_level=True)


def launches(call):
    before = pyfa.counters()["kernel_launches"]
    result = call()
    return result, pyfa.counters()["kernel_launches"] - before


@pytest.mark.parametrize("page_size", [16, 256])
def test_paged_decode_merges_like_the_contiguous_decode(rng, page_size):
    """A split paged decode (shuffled pages) takes a KVCache's one launch over the same keys and
    gives its bits: the same split, merged by the same code."""
    H, Hkv, D, L = 32, 8, 128, 4096
    q = rng.standard_normal((H, D)).astype(pyfa.bfloat16)
    k = rng.standard_normal((L, Hkv, D)).astype(pyfa.bfloat16)
    v = rng.standard_normal((L, Hkv, D)).astype(pyfa.bfloat16)
    cache = pyfa.KVCache(Hkv, D, L, dtype=pyfa.bfloat16, device=DEVICE)
    cache.append(k, v)
    pages = L // page_size
    table = rng.permutation(pages).astype(np.int32)[None]
    pool_k, pool_v = np.empty((pages, page_size, Hkv, D), k.dtype), np.empty((pages, page_size, Hkv, D), v.dtype)
    pool_k[table[0]] = k.reshape(pages, page_size, Hkv, D)
    pool_v[table[0]] = v.reshape(pages, page_size, Hkv, D)
    dense, dense_launches = launches(lambda: cache.attend(q))
    for _ in range(3):  # each call leaves the tickets as it found them
        paged, paged_launches = launches(
            lambda: pyfa.paged_decode_attention(q[None], pool_k, pool_v, table, L, device=DEVICE))
        assert dense_launches == 1 and paged_launches == 1, (dense_launches, paged_launches)
        assert np.array_equal(paged[0].view(np.uint16), dense.view(np.uint16))
