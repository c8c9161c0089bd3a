"""The CPU backend's paged decode walks every KV head of a (sequence, split) in one threadgroup
(PYFA_CPU_VEC_VARIANT_ALL_KV_HEADS, native/CPUKernels/attn_vec_body.h). These tests pin what that
promises on the CPU backend only (the other backends keep per-head workgroups; their paged decode is
checked against the float64 reference in test_paged_decode.py):
- each head sees the same blocks and operations as the per-head dense decode, so with the same
  split (nwg) the outputs and LSEs are bit for bit the dense decode's over the gathered caches;
- the split is sized for batch units, not batch * num_kv_heads, so a batch of one still spreads
  over the threads;
- states beyond the scratch bound (PYFA_CPU_VEC_ALL_KV_HEADS_MAX_SCRATCH) keep per-head
  threadgroups, and stay correct (float64 reference, test_paged_decode.py's tolerances)."""
import numpy as np
import pytest

import pyfa
from pyfa import reference
from test_paged_decode import check, gather, make_pool, TOL


def dense_nwg(cpu, B, H, Hkv, D, L, dtype=np.float16):
    """nwg the dense decode's plan picks for B sequences of L positions."""
    from pyfa import dtypes
    from pyfa._native import ffi, lib
    p = ffi.new("pyfa_flash_attn_vec_params *")
    p.batch, p.num_heads, p.num_kv_heads, p.head_dim, p.kv_capacity, p.scale = B, H, Hkv, D, L, 0.125
    tmp = ffi.new("uint64_t *")
    assert lib.pyfa_flash_attn_vec_plan(cpu.handle, p, dtypes.code(np.dtype(dtype)), L, tmp) == 0
    return p.nwg


def paged_nwg(cpu, B, H, Hkv, D, L, page_size=16, layout=0):
    """nwg the paged decode's plan picks, read from its workspace (batch * H * nwg * (D + 2) f32
    partial rows when nwg > 1, none when nwg == 1)."""
    from pyfa import _plans
    from pyfa._native import ffi, lib
    desc = ffi.new("pyfa_paged_decode_plan_desc *")
    desc.attn.batch, desc.attn.num_heads, desc.attn.num_kv_heads, desc.attn.head_dim = B, H, Hkv, D
    desc.attn.scale = 0.125
    pps = -(-L // page_size)
    desc.pages.page_size, desc.pages.num_pages, desc.pages.pages_per_seq = page_size, B * pps, pps
    desc.pages.layout = layout
    desc.q_dtype = desc.kv_dtype = desc.out_dtype = lib.PYFA_DTYPE_F16
    desc.max_kv_len, desc.split_batch = L, B
    plan = _plans.new_plan(lib.pyfa_paged_decode_plan_new, cpu, desc)
    n = ffi.new("uint64_t *")
    assert lib.pyfa_plan_workspace_bytes(plan, n) == 0
    return 1 if n[0] == 0 else n[0] // (B * H * (D + 2) * 4)


def assert_paged_is_dense_bitwise(cpu, rng, *, B, H, Hkv, D, lens, page_size, layout, dtype):
    k, v, table = make_pool(rng, B, Hkv, D, page_size, lens, dtype, layout)
    q = rng.standard_normal((B, H, D)).astype(np.float32)
    out, lse = pyfa.paged_decode_attention(q, k, v, table, list(lens), page_layout=layout, return_lse=True,
                                           device=cpu)
    kc = np.ascontiguousarray(gather(k, table, layout))
    vc = np.ascontiguousarray(gather(v, table, layout))
    dense, dense_lse = pyfa.decode_attention(q, kc, vc, list(lens), return_lse=True, device=cpu)
    np.testing.assert_array_equal(out, dense)
    np.testing.assert_array_equal(lse, dense_lse)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, pyfa.bfloat16])
def test_one_split_is_the_dense_decode_bit_for_bit(cpu, rng, page_size, layout, dtype):
    # At most 300 positions: both plans take nwg = 1 (a split keeps >= 256 positions), whatever
    # the thread count; sequences of 1, 37 and 300 positions end inside, at and across pages.
    B, H, Hkv, D, lens = 3, 8, 4, 128, (1, 37, 300)
    assert paged_nwg(cpu, B, H, Hkv, D, 300, page_size) == dense_nwg(cpu, B, H, Hkv, D, 300) == 1
    assert_paged_is_dense_bitwise(cpu, rng, B=B, H=H, Hkv=Hkv, D=D, lens=lens, page_size=page_size,
                                  layout=layout, dtype=dtype)


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_two_splits_are_the_dense_decode_bit_for_bit(cpu, rng, layout):
    # One sequence of 600 positions over 2 KV heads: both plans split it in two (at most 600 / 256
    # splits; the dense plan's 4 * threads / 2 heads is at least 2), the second split starting at
    # position 300, inside a page, so its blocks straddle pages. Partial states and the reduce
    # then match too.
    B, H, Hkv, D, L = 1, 8, 2, 128, 600
    assert paged_nwg(cpu, B, H, Hkv, D, L) == dense_nwg(cpu, B, H, Hkv, D, L) == 2
    assert_paged_is_dense_bitwise(cpu, rng, B=B, H=H, Hkv=Hkv, D=D, lens=(L,), page_size=16, layout=layout,
                                  dtype=np.float16)


@pytest.mark.parametrize("B", [1, 2, 8])
def test_split_gives_every_thread_work(cpu, B):
    # A threadgroup carries all 8 KV heads of its sequence, so there are B * nwg of them: the
    # plan splits more than the dense decode's B * 8 per-head threadgroups need, and at least
    # one threadgroup per thread where the positions allow (>= 256 per split).
    threads = cpu.compute_units
    H, Hkv, D, L = 16, 8, 128, 8192
    nwg = paged_nwg(cpu, B, H, Hkv, D, L)
    assert B * nwg >= min(threads, B * (L // 256)), (B, nwg, threads)
    assert nwg >= dense_nwg(cpu, B, H, Hkv, D, L)


def test_states_beyond_the_scratch_bound_keep_per_head_threadgroups(cpu):
    # num_heads * D states: 128 x 512 (~0.5 MB of scratch) walk all heads, 256 x 512 (> 1 MB)
    # keep the dense decode's per-head split. 16384 positions allow 64 splits, so the two plans
    # differ (4 * threads vs 4 * threads / 2 KV heads) below 32 threads.
    threads = cpu.compute_units
    if threads >= 32:
        pytest.skip(f"{threads} threads: both plans reach the 64-split cap, the test cannot tell them apart")
    B, Hkv, D, L = 1, 2, 512, 16384
    assert paged_nwg(cpu, B, 128, Hkv, D, L) == 2 * dense_nwg(cpu, B, 128, Hkv, D, L)
    assert paged_nwg(cpu, B, 256, Hkv, D, L) == dense_nwg(cpu, B, 256, Hkv, D, L)


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_states_beyond_the_scratch_bound_are_correct(cpu, rng, layout):
    B, H, Hkv, D, lens = 2, 256, 2, 512, (40, 17)
    k, v, table = make_pool(rng, B, Hkv, D, 16, lens, np.float16, layout)
    q = rng.standard_normal((B, H, D)).astype(np.float32)
    out, lse = pyfa.paged_decode_attention(q, k, v, table, list(lens), page_layout=layout, return_lse=True,
                                           device=cpu)
    ref, ref_lse = reference.decode_attention(q, gather(k, table, layout), gather(v, table, layout), list(lens),
                                              return_lse=True)
    check(out, ref)
    np.testing.assert_allclose(lse, ref_lse, atol=TOL, rtol=0)
