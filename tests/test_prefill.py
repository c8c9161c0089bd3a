"""flash_attn_prefill (+ blk) and merge_attention_states against the float64 reference.

The parameter space is sampled, not crossed: every axis (dtype, head_dim, GQA
ratio, lengths, qL < kL and qL > kL, mask kind and rank, causal, window,
softcap, layout, LSE, q_offset) appears, and the tables combine axes pairwise.

Tolerances. The reference reads the same rounded q/k/v (and mask) values as
the kernel. f32: what differs is f32 accumulation (exp2 polynomial ~2e-7
relative, scale folded into q, summation order), so max |out - ref| <= 2e-5.
f16 / bf16 inputs: flash-attn's own rule (and, on devices that keep P exact,
also half an ulp of the output's dtype of max|ref| plus 2e-5). A kernel may round the softmax
weights P to the I/O dtype before P V, as FlashAttention does, so its error
against the float64 reference is bounded by that of the same attention
computed in the I/O dtype (reference.attention(rounding=dtype): q*scale,
scores, soft-cap steps, masked scores, P and the output each rounded):
  max |out - ref| <= 2 * max |ref_dtype - ref| + 2e-5
(whatever the output dtype), and the normalised MSE (mean (out-ref)^2 / mean
ref^2) <= 5e-4. |lse - ref_lse| <= 1e-4 (f32 statistics, |lse| ~
log(kv_len) + scores; P's rounding does not enter the LSE).
"""
import os

import numpy as np
import pytest

import pyfa
from pyfa import prefill, reference

BF16 = pyfa.bfloat16
# The MSL executor's perturbation mode adds fresh random ulps to every
# dispatch's math, so two runs that are bit-identical on a device (with and
# without blk) differ there by a few f32 ulps, which may flip the last bit of
# an f16 / bf16 output; they are then compared to that.
PERTURBED = os.environ.get("PYFA_MSL_PERTURB_ULPS", "0") not in ("", "0")
LAST_BIT = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 2.0**-10, BF16: 2.0**-7}


def assert_same_run(a, b):
    """Two dispatches of the same attention (with and without blk): bit-identical."""
    if PERTURBED:
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   rtol=LAST_BIT[np.dtype(a.dtype)], atol=1e-5)
    else:
        assert np.array_equal(a, b)
ROUND = {np.dtype(np.float32): 0.0, np.dtype(np.float16): 2.0**-11, BF16: 2.0**-8}
# Whether the device under test keeps P exact (set per test by _p_rounding): then f16 / bf16 outputs
# must also be within half an ulp of max|ref| (plus 2e-5), the bound of an f32 result rounded once.
P_EXACT = False


def p_exact(device) -> bool:
    """Whether ``device``'s f16 / bf16 prefill keeps the softmax weights exact: the CPU and Metal
    kernels, and CUDA with PYFA_CUDA_PREFILL_P_TERMS=2; CUDA's default rounds P to the I/O dtype."""
    knob = os.environ.get("PYFA_CUDA_PREFILL_P_TERMS", "")  # read as the CUDA plan reads it: digits, else 1
    return device.backend != "cuda" or (knob.isdigit() and int(knob) >= 2)


@pytest.fixture(autouse=True)
def _p_rounding(request):
    """P_EXACT for this test's device; tests without the device fixture get flash-attn's rule only."""
    global P_EXACT
    P_EXACT = "device" in request.fixturenames and p_exact(request.getfixturevalue("device"))
    yield
    P_EXACT = False


HEAD_DIMS = list(pyfa.supported("head_dims"))


def make(rng, B, H, Hkv, qL, kL, D, dtype, layout="bhsd"):
    def arr(h, n):
        shape = (B, h, n, D) if layout == "bhsd" else (B, n, h, D)
        return rng.standard_normal(shape).astype(dtype)
    return arr(H, qL), arr(Hkv, kL), arr(Hkv, kL)


def case_inputs(rng, cases, B):
    """(q, k, v, layout, options, flag) for each case (D, dtype name, H, Hkv, q_len, kv_len, layout,
    options, flag) of B sequences; an options' "mask" of "bool" or "additive" becomes a [q_len, kv_len]
    mask of that kind hiding about a fifth of the keys (never key 0)."""
    out = []
    for D, dtype, H, Hkv, qL, kL, layout, opts, flag in cases:
        dt = pyfa.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
        q, k, v = make(rng, B, H, Hkv, qL, kL, D, dt, layout)
        opts = dict(opts)
        if "mask" in opts:
            keep = rng.random((qL, kL)) < 0.8
            keep[:, 0] = True
            opts["mask"] = keep if opts["mask"] == "bool" else np.where(keep, 0.0, -np.inf).astype(dt)
        out.append((q, k, v, layout, opts, flag))
    return out


def check_close(out, ref, dtype, ref_dtype=None):
    """``out`` (of ``dtype``) against the float64 ``ref``: for f16 / bf16 inputs ``ref_dtype`` is the
    same attention computed in the input dtype (flash-attn's rule, the module docstring); None for f32
    inputs."""
    dtype = np.dtype(dtype)
    assert out.dtype == dtype and out.shape == ref.shape
    o = out.astype(np.float64)
    assert not np.isnan(o).any()
    bound = 2e-5 if ref_dtype is None else 2 * np.abs(ref_dtype - ref).max(initial=0.0) + 2e-5
    assert np.abs(o - ref).max() <= bound, (np.abs(o - ref).max(), bound)
    if ref_dtype is not None:
        denom = max(np.mean(ref**2), 1e-12)
        assert np.mean((o - ref) ** 2) / denom <= 5e-4
        if P_EXACT:
            exact = ROUND[dtype] * max(np.abs(ref).max(), 1.0) + 2e-5
            assert np.abs(o - ref).max() <= exact, ("exact P", np.abs(o - ref).max(), exact)


def in_dtype(q, k, v, **kw):
    """The attention computed in q's dtype (flash-attn's rule compares with its error), None for f32."""
    dtype = np.dtype(q.dtype)
    return None if dtype == np.float32 else reference.attention(q, k, v, rounding=dtype, **kw)


def check_lse(lse, ref_lse):
    assert lse.dtype == np.float32 and lse.shape == ref_lse.shape
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.abs(lse[fin] - ref_lse[fin]).max(initial=0.0) <= 1e-4


def run_both(q, k, v, device, **kw):
    """(out, lse, (ref, ref in q's dtype), ref_lse)."""
    out, lse = pyfa.attention(q, k, v, return_lse=True, device=device, **kw)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    return out, lse, (ref, in_dtype(q, k, v, **kw)), ref_lse


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
def test_head_dims_and_dtypes(device, rng, D, dtype):
    causal = D % 128 != 0
    q, k, v = make(rng, 1, 2, 1, 33, 65, D, dtype)
    out, lse, ref, ref_lse = run_both(q, k, v, causal=causal, device=device)
    check_close(out, ref[0], dtype, ref[1])
    check_lse(lse, ref_lse)


# (B, H, Hkv, qL, kL, D, dtype, layout, causal): GQA ratios 1/2/4/8 x both layouts x odd lengths,
# qL < kL and qL > kL, each paired with a different dtype / head_dim.
SHAPES = [
    (1, 1, 1, 1, 1, 64, np.float32, "bhsd", True),
    (2, 2, 1, 7, 31, 128, BF16, "bshd", True),
    (1, 4, 1, 31, 7, 96, np.float16, "bhsd", True),
    (1, 8, 1, 65, 127, 64, BF16, "bhsd", False),
    (2, 8, 2, 129, 33, 80, np.float32, "bshd", False),
    (1, 4, 4, 127, 129, 192, np.float16, "bshd", True),
    (1, 2, 2, 400, 400, 64, BF16, "bshd", True),
    (1, 2, 1, 33, 400, 256, np.float32, "bhsd", True),
    (1, 8, 4, 129, 65, 128, np.float16, "bshd", True),
    (1, 2, 1, 7, 129, 512, BF16, "bhsd", True),
]


@pytest.mark.parametrize("B,H,Hkv,qL,kL,D,dtype,layout,causal", SHAPES)
def test_shapes_gqa_layouts(device, rng, B, H, Hkv, qL, kL, D, dtype, layout, causal):
    q, k, v = make(rng, B, H, Hkv, qL, kL, D, dtype, layout)
    out, lse, ref, ref_lse = run_both(q, k, v, causal=causal, layout=layout, device=device)
    check_close(out, ref[0], dtype, ref[1])
    check_lse(lse, ref_lse)


def plan_tile(device, D, dtype):
    """(block_q, block_k) of the device's prefill plan."""
    from pyfa import dtypes
    from pyfa._native import ffi, lib
    from pyfa.errors import check
    params = ffi.new("pyfa_flash_attn_prefill_params *", {
        "batch": 1, "num_heads": 1, "num_kv_heads": 1, "head_dim": D, "q_len": 1, "kv_len": 1, "scale": 1.0})
    check(lib.pyfa_flash_attn_prefill_plan(device.handle, params, dtypes.code(dtype), ffi.new("uint64_t *")))
    return params.block_q, params.block_k


def block_mask(rng, shape, kind, dtype, tile):
    """A random mask where ~20% of the 8x16 blocks are all blocked, ~20% all
    attended (zero bias / True), the rest mixed (with finite biases); then the
    same over the plan's tiles, so whole tiles are skipped / mask-free."""
    qL, kL = shape[-2:]
    allowed = rng.random(shape) > 0.3
    bias = rng.standard_normal(shape) * 0.5
    for block in ((8, 16), tile):
        for i in range(0, qL, block[0]):
            for j in range(0, kL, block[1]):
                r = rng.random()
                sl = (..., slice(i, i + block[0]), slice(j, j + block[1]))
                if r < 0.2:
                    allowed[sl] = False
                elif r < 0.4:
                    allowed[sl] = True
                    bias[sl] = 0.0
    if kind == "bool":
        return allowed
    return np.where(allowed, bias, -np.inf).astype(dtype)


# (kind, rank, causal, window, dtype, D, layout, qL, kL)
MASKS = [
    ("additive", 2, False, None, BF16, 128, "bhsd", 129, 400),
    ("additive", 4, True, None, np.float32, 64, "bshd", 127, 129),
    ("bool", 2, True, 50, np.float16, 96, "bhsd", 400, 400),
    ("bool", 4, False, None, BF16, 256, "bshd", 65, 129),
    ("additive", 2, True, 33, np.float16, 80, "bshd", 129, 65),
    ("bool", 2, False, 17, np.float32, 192, "bhsd", 33, 127),
]


@pytest.mark.parametrize("kind,rank,causal,window,dtype,D,layout,qL,kL", MASKS)
def test_masks_and_blk(device, rng, kind, rank, causal, window, dtype, D, layout, qL, kL):
    B, H, Hkv = 2, 2, 1
    q, k, v = make(rng, B, H, Hkv, qL, kL, D, dtype, layout)
    mask = block_mask(rng, (qL, kL) if rank == 2 else (B, H, qL, kL), kind, dtype, plan_tile(device, D, dtype))
    kw = dict(mask=mask, causal=causal, window=window, layout=layout, return_lse=True, device=device)
    with_blk, lse_blk = prefill._attention(q, k, v, scale=None, q_offset=None, softcap=0.0, out=None, use_blk=True, **kw)
    without, lse_no = prefill._attention(q, k, v, scale=None, q_offset=None, softcap=0.0, out=None, use_blk=False, **kw)
    assert_same_run(with_blk, without)
    assert_same_run(lse_blk, lse_no)
    ref, ref_lse = reference.attention(q, k, v, mask=mask, causal=causal, window=window, layout=layout, return_lse=True)
    check_close(with_blk, ref, dtype, in_dtype(q, k, v, mask=mask, causal=causal, window=window, layout=layout))
    check_lse(lse_blk, ref_lse)


# Any finite scale the validation accepts (negative, zero, subnormal, above 1/sqrt(D)): the output and
# LSE match the float64 reference, and blk's skipped mask reads leave the bits unchanged.
@pytest.mark.parametrize("scale", [-0.3, 0.0, 1e-40, 0.7])
@pytest.mark.parametrize("D,dtype", [(128, BF16), (64, np.float16), (80, np.float32)])
def test_any_finite_scale(device, rng, scale, D, dtype):
    B, H, Hkv, qL, kL = 1, 2, 1, 129, 300
    q, k, v = make(rng, B, H, Hkv, qL, kL, D, dtype)
    out, lse, ref, ref_lse = run_both(q, k, v, scale=scale, causal=True, device=device)
    check_close(out, ref[0], dtype, ref[1])
    check_lse(lse, ref_lse)
    mask = block_mask(rng, (qL, kL), "additive", dtype, plan_tile(device, D, dtype))
    kw = dict(mask=mask, causal=False, window=None, layout="bhsd", return_lse=True, device=device)
    with_blk, lse_blk = prefill._attention(q, k, v, scale=scale, q_offset=None, softcap=0.0, out=None, use_blk=True,
                                           **kw)
    without, lse_no = prefill._attention(q, k, v, scale=scale, q_offset=None, softcap=0.0, out=None, use_blk=False,
                                         **kw)
    ref_m, ref_lse_m = reference.attention(q, k, v, scale=scale, mask=mask, return_lse=True)
    check_close(without, ref_m, dtype, in_dtype(q, k, v, scale=scale, mask=mask))
    check_lse(lse_no, ref_lse_m)
    assert_same_run(with_blk, without)
    assert_same_run(lse_blk, lse_no)


def test_blk_classification(device, rng):
    """The pre-pass bytes, read back through the low-level API."""
    from pyfa import _io
    from pyfa._native import ffi, lib
    from pyfa.errors import check
    qL, kL = 100, 150
    mask = np.zeros((qL, kL), np.float32)
    params = ffi.new("pyfa_flash_attn_prefill_params *", {
        "batch": 1, "num_heads": 1, "num_kv_heads": 1, "head_dim": 64, "q_len": qL, "kv_len": kL,
        "scale": 1.0, "mask_strides": [0, 0, kL]})
    nbytes = ffi.new("uint64_t *")
    check(lib.pyfa_flash_attn_prefill_plan(device.handle, params, lib.PYFA_DTYPE_F32, nbytes))
    bq, bk = params.block_q, params.block_k
    nq, nk = params.num_q_blocks, params.num_k_blocks
    assert (nq, nk) == (-(-qL // bq), -(-kL // bk)) and nbytes[0] == nq * nk
    mask[:bq, :bk] = -np.inf                  # tile (0, 0): all blocked
    mask[bq:2 * bq, bk:2 * bk] = 1.5          # tile (1, 1): a bias, mixed
    mask[(nq - 1) * bq:, (nk - 1) * bk:] = -np.inf  # ragged corner tile: blocked where it exists
    mask[0, 2 * bk] = -np.inf                 # tile (0, 2): one blocked entry, mixed
    buf = _io.to_device(device, mask)
    blk = device.buffer((nbytes[0],), np.uint8)
    enc = device.encoder()
    check(lib.pyfa_flash_attn_prefill_blk(enc, params, lib.PYFA_DTYPE_F32, buf.handle, blk.handle))
    check(lib.pyfa_encoder_commit(enc))
    check(lib.pyfa_encoder_wait(enc))
    got = blk.read().reshape(nq, nk)
    want = np.full((nq, nk), lib.PYFA_BLK_ZERO)
    want[0, 0] = want[nq - 1, nk - 1] = lib.PYFA_BLK_SKIP
    want[1, 1] = want[0, 2] = lib.PYFA_BLK_MIXED
    assert np.array_equal(got, want)


def test_blk_refuses_more_tiles_than_a_grid_holds(device):
    """The pre-pass runs a threadgroup a (query tile, key tile): a shape with more than 2^31 - 1
    tiles is refused by name before anything runs (here every query row reads one shared mask
    row, so the mask itself is small)."""
    from pyfa import _io
    from pyfa._native import ffi, lib
    from pyfa.errors import PyfaError, check
    def planned(qL, kL):
        params = ffi.new("pyfa_flash_attn_prefill_params *", {
            "batch": 1, "num_heads": 1, "num_kv_heads": 1, "head_dim": 64, "q_len": qL, "kv_len": kL,
            "scale": 1.0, "mask_strides": [0, 0, 0]})
        check(lib.pyfa_flash_attn_prefill_plan(device.handle, params, lib.PYFA_DTYPE_F32, ffi.new("uint64_t *")))
        return params

    qL = 2**31 - 1
    tile = planned(qL, 1)
    # the fewest key tiles that pass the limit: just over 2^31 - 1 tiles, below 2^32
    kL = -(-2**31 // tile.num_q_blocks) * tile.block_k
    params = planned(qL, kL)
    assert 2**31 - 1 < params.num_q_blocks * params.num_k_blocks <= 2**31 - 1 + params.num_q_blocks
    mask = _io.to_device(device, np.zeros(kL, np.float32))
    blk = device.buffer((16,), np.uint8)
    with pytest.raises(PyfaError, match=r"q_len/kv_len: .* tiles .* must be at most 2147483647"):
        check(lib.pyfa_flash_attn_prefill_blk(device.encoder(), params, lib.PYFA_DTYPE_F32, mask.handle, blk.handle))


def _run_blk(device, mask, io_dtype, batch, heads, qL, kL, strides, head_dim=64):
    """blk bytes of the device's pre-pass over `mask` (bool or io_dtype, flat
    with element strides `strides`), at the device's tile for head_dim."""
    from pyfa import _io, dtypes
    from pyfa._native import ffi, lib
    from pyfa.errors import check
    params = ffi.new("pyfa_flash_attn_prefill_params *", {
        "batch": batch, "num_heads": heads, "num_kv_heads": 1, "head_dim": head_dim, "q_len": qL, "kv_len": kL,
        "scale": 1.0, "mask_strides": strides})
    nbytes = ffi.new("uint64_t *")
    check(lib.pyfa_flash_attn_prefill_plan(device.handle, params, dtypes.code(io_dtype), nbytes))
    buf = _io.to_device(device, mask.view(np.uint8) if mask.dtype == bool else mask)
    blk = device.buffer((nbytes[0],), np.uint8)
    enc = device.encoder()
    check(lib.pyfa_flash_attn_prefill_blk(enc, params, dtypes.code(io_dtype), buf.handle, blk.handle))
    check(lib.pyfa_encoder_commit(enc))
    check(lib.pyfa_encoder_wait(enc))
    return blk.read(), (params.block_q, params.block_k)


def _blk_reference(plane, bq, bk):
    """The blk classification of one [qL, kL] mask plane at tile (bq, bk),
    from pyfa_params.h's rules: SKIP when every entry blocks (bool False,
    additive -inf), ZERO when every entry is a no-op (bool True, additive
    +-0), MIXED otherwise; ragged last tiles cover what remains."""
    from pyfa._native import lib
    qL, kL = plane.shape
    blocked = ~plane if plane.dtype == bool else np.isneginf(plane.astype(np.float64))
    no_op = plane if plane.dtype == bool else plane.astype(np.float64) == 0.0
    out = np.empty((-(-qL // bq), -(-kL // bk)), np.uint8)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            tile = (slice(i * bq, (i + 1) * bq), slice(j * bk, (j + 1) * bk))
            out[i, j] = (lib.PYFA_BLK_SKIP if blocked[tile].all() else
                         lib.PYFA_BLK_ZERO if no_op[tile].all() else lib.PYFA_BLK_MIXED)
    return out


# (kind, dtype, rank, qL, kL, D)
BLK_MASKS = [
    ("bool", np.float16, 2, 100, 150, 64),
    ("additive", np.float32, 2, 129, 400, 128),
    ("additive", np.float16, 4, 65, 129, 96),
    ("additive", BF16, 2, 33, 257, 256),
    ("bool", BF16, 4, 31, 70, 512),
    ("additive", np.float32, 4, 40, 100, 512),
    # rows whose bytes are a multiple of 4 (whole 32-bit words on CUDA), a ragged last key tile
    ("bool", np.float16, 2, 100, 260, 64),
    ("additive", BF16, 4, 65, 198, 128),
    ("additive", np.float16, 2, 300, 388, 128),
]


@pytest.mark.parametrize("kind,dtype,rank,qL,kL,D", BLK_MASKS)
def test_blk_matches_reference_bytes(device, rng, kind, dtype, rank, qL, kL, D):
    """Every backend's blk equals, byte for byte, the classification of the
    header's rules at that backend's tile shape (so backends with one tile
    shape produce identical bytes), on random block masks plus the edge
    values: -0.0 (a no-op), the most negative finite value (a bias, not a
    block)."""
    B, H = 2, 3
    tile = plan_tile(device, D, dtype)
    if (qL - 1) // tile[0] == 0 and (kL - 1) // tile[1] == 0:
        kL += tile[1]  # one tile would be both the SKIP and the ZERO tile below: a second (ragged) key tile
    mask = block_mask(rng, (qL, kL) if rank == 2 else (B, H, qL, kL), kind, dtype, tile)
    planes = mask.reshape(-1, qL, kL)
    bq, bk = tile
    planes[:, :bq, :bk] = False if kind == "bool" else -np.inf      # a SKIP tile in every plane
    last = (slice((qL - 1) // bq * bq, None), slice((kL - 1) // bk * bk, None))
    planes[:, last[0], last[1]] = True if kind == "bool" else 0.0  # a ragged ZERO tile
    if kind == "additive":
        planes[0, -1, -1] = -0.0                                    # still a no-op
        planes[0, qL // 2, kL // 2] = {np.float32: np.finfo(np.float32).min, np.float16: -65504.0}.get(dtype, -3.3e38)
    strides = [0, 0, kL] if rank == 2 else [H * qL * kL, qL * kL, kL]
    got, got_tile = _run_blk(device, mask, dtype, B, H, qL, kL, strides, head_dim=D)
    assert got_tile == tile
    want = np.concatenate([_blk_reference(plane, *tile).reshape(-1) for plane in planes])
    assert np.array_equal(got, want)
    from pyfa._native import lib
    assert {lib.PYFA_BLK_SKIP, lib.PYFA_BLK_ZERO} <= set(want.tolist())


@pytest.mark.parametrize("kind,dtype", [("bool", np.float32), ("additive", BF16)])
def test_blk_of_one_row_shared_by_every_query_row(device, rng, kind, dtype):
    """mask_strides [0, 0, 0]: every query row reads the same kv_len entries (a padding row)."""
    qL, kL = 300, 520
    tile = plan_tile(device, 64, dtype)
    row = rng.random(kL) > 0.5
    row[:tile[1]] = False                        # a SKIP key tile
    row[tile[1]:2 * tile[1]] = True              # a ZERO key tile
    mask = row if kind == "bool" else np.where(row, 0.0, -np.inf).astype(dtype)
    got, got_tile = _run_blk(device, mask, dtype, 1, 1, qL, kL, [0, 0, 0])
    assert got_tile == tile
    want = _blk_reference(np.broadcast_to(mask, (qL, kL)), *tile).reshape(-1)
    assert np.array_equal(got, want)
    from pyfa._native import lib
    assert {lib.PYFA_BLK_SKIP, lib.PYFA_BLK_ZERO, lib.PYFA_BLK_MIXED} <= set(want.tolist())


# (window, softcap, q_offset, causal, dtype, D, qL, kL)
OPTIONS = [
    (7, 0.0, None, True, BF16, 64, 65, 65),
    (None, 5.0, None, True, np.float32, 128, 33, 129),
    (31, 3.0, None, False, np.float16, 96, 127, 127),
    (None, 0.0, 60, True, np.float32, 80, 40, 129),   # chunk 60..99 of a 129-key cache
    (16, 10.0, -5, True, BF16, 192, 31, 65),          # rows before position 0 see no key
    (1, 0.0, None, True, np.float16, 256, 7, 400),
    # large caps: a tanh whose error is a few ulps of the cap in every score, whatever the score, would
    # miss the LSE's 1e-4 at a cap of 10^4 (a float32 emulation; not yet seen on a GPU)
    (None, 1000.0, None, False, np.float16, 64, 65, 129),
    (None, 1e4, None, True, BF16, 128, 33, 200),
]


@pytest.mark.parametrize("window,softcap,q_offset,causal,dtype,D,qL,kL", OPTIONS)
def test_window_softcap_offset(device, rng, window, softcap, q_offset, causal, dtype, D, qL, kL):
    q, k, v = make(rng, 1, 4, 2, qL, kL, D, dtype)
    out, lse, ref, ref_lse = run_both(q, k, v, causal=causal, window=window, softcap=softcap, q_offset=q_offset,
                                      device=device)
    check_close(out, ref[0], dtype, ref[1])
    check_lse(lse, ref_lse)


# D = 512 with 16-bit inputs, every feature across several query tiles and key-tile edges. On Hopper
# the two warpgroups of a block split the head dim (each adds the other's half of every score) and a
# 64-key tile streams in two 32-key stages: kv_len 97 ends a tile after one stage and a key, 300
# inside a stage; q_offset 100 and -5 put the causal diagonal inside tiles, the window ends mid-stage,
# and the masks hold SKIP / ZERO tiles of the plan's tile, so blk must stay bit-identical.
# (dtype, layout, H, Hkv, qL, kL, causal, q_offset, window, softcap, mask kind, out_dtype)
D512 = [
    (BF16, "bhsd", 4, 2, 200, 300, True, 100, None, 0.0, None, None),
    (np.float16, "bshd", 2, 1, 130, 97, False, None, None, 0.0, "bool", np.float32),
    (BF16, "bshd", 2, 2, 70, 230, True, -5, 40, 8.0, "additive", None),
    (np.float16, "bhsd", 2, 1, 129, 129, True, None, 33, 0.0, None, None),
]


@pytest.mark.parametrize("dtype,layout,H,Hkv,qL,kL,causal,q_offset,window,softcap,kind,out_dtype", D512)
def test_head_dim_512_features(device, rng, dtype, layout, H, Hkv, qL, kL, causal, q_offset, window, softcap,
                               kind, out_dtype):
    q, k, v = make(rng, 2, H, Hkv, qL, kL, 512, dtype, layout)
    mask = None if kind is None else block_mask(rng, (qL, kL), kind, dtype, plan_tile(device, 512, dtype))
    kw = dict(causal=causal, q_offset=q_offset, window=window, softcap=softcap, mask=mask, layout=layout)
    out, lse = pyfa.attention(q, k, v, return_lse=True, out_dtype=out_dtype, device=device, **kw)
    if mask is not None:
        with_blk, lse_blk = prefill._attention(q, k, v, scale=None, out=None, use_blk=True, return_lse=True,
                                               device=device, out_dtype=out_dtype, **kw)
        without, lse_no = prefill._attention(q, k, v, scale=None, out=None, use_blk=False, return_lse=True,
                                             device=device, out_dtype=out_dtype, **kw)
        assert_same_run(with_blk, without)
        assert_same_run(lse_blk, lse_no)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    check_close(out, ref, out_dtype or dtype, in_dtype(q, k, v, **kw))
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("kind", ["additive", "bool"])
def test_fully_masked_rows_and_inf_key(device, rng, kind):
    q, k, v = make(rng, 1, 2, 2, 70, 100, 64, np.float16)
    allowed = np.ones((70, 100), bool)
    allowed[3] = False           # one fully masked row
    allowed[50:] = False         # a fully masked query tile
    allowed[:, 10] = False       # a -inf key for every row
    mask = allowed if kind == "bool" else np.where(allowed, 0.0, -np.inf).astype(np.float16)
    out, lse, ref, ref_lse = run_both(q, k, v, mask=mask, device=device)
    check_close(out, ref[0], np.float16, ref[1])
    assert not np.isnan(out.astype(np.float32)).any()
    assert np.all(out[:, :, 3] == 0) and np.all(out[:, :, 50:] == 0)
    assert np.all(np.isneginf(lse[:, :, 3])) and np.all(np.isneginf(lse[:, :, 50:]))
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("D,dtype,causal,jump", [(64, BF16, False, 0.0), (128, np.float16, True, 0.0),
                                                   (256, BF16, False, 25.0), (256, np.float16, True, 0.0),
                                                   (512, BF16, True, 25.0), (192, np.float16, False, 25.0)])
def test_scores_rising_along_the_keys(device, rng, D, dtype, causal, jump):
    """Logits that rise along the keys (about 0.03 a key, so about 2 a 64-key tile) move a row's
    maximum in every tile, by less than a kernel's slack within a few tiles and by more over many;
    `jump` adds a step of that many (natural units) in the last keys. Kernels that keep a stale
    maximum (CUDA from D 256) must give the reference's output and LSE all the same."""
    qL, kL = 64, 600
    q, k, v = make(rng, 1, 2, 1, qL, kL, D, dtype)
    q = (q * 0.3).astype(dtype)
    q[..., 0] = 4.0
    rise = 0.03 * np.arange(kL) + np.where(np.arange(kL) >= kL - 10, jump, 0.0)
    k[..., 0] = (rise * np.sqrt(D) / 4.0).astype(dtype)  # q . k / sqrt(D) gains rise[j] at key j
    out, lse, ref, ref_lse = run_both(q, k, v, causal=causal, device=device)
    check_close(out, ref[0], dtype, ref[1])
    check_lse(lse, ref_lse)


def test_causal_rows_without_keys_are_zero(device, rng):
    q, k, v = make(rng, 1, 2, 2, 40, 20, 64, np.float32)  # qL > kL: rows 0..19 see no key
    out, lse = pyfa.attention(q, k, v, causal=True, return_lse=True, device=device)
    assert np.all(out[:, :, :20] == 0) and np.all(np.isneginf(lse[:, :, :20]))
    check_close(out, reference.attention(q, k, v, causal=True), np.float32)


@pytest.mark.parametrize("D,dtype", [(64, BF16), (128, np.float16), (256, BF16)])
def test_query_tiles_without_keys(device, rng, D, dtype):
    """Causal with 300 more queries than keys: the first 300 rows see no key, so whole query tiles
    (of 128 and 192 rows) have no key tile. Their rows are zeros with an LSE of -inf, and the
    rows after them are the reference's (a block without key tiles still reads its query copies
    and stores its rows: CUDA's staged output store reuses the query tile's memory)."""
    q, k, v = make(rng, 1, 4, 2, 620, 320, D, dtype)
    out, lse = pyfa.attention(q, k, v, causal=True, return_lse=True, device=device)
    o = out.astype(np.float32)
    assert np.all(o[:, :, :300] == 0) and np.all(np.isneginf(lse[:, :, :300]))
    ref, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    check_close(out, ref, dtype, in_dtype(q, k, v, causal=True))
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("dtype,layout", [(np.float32, "bhsd"), (BF16, "bshd"), (np.float16, "bhsd")])
def test_merge_halves_equals_whole(device, rng, dtype, layout):
    q, k, v = make(rng, 1, 4, 2, 33, 129, 128, dtype, layout)
    split = 50
    ks = (slice(None), slice(None), slice(0, split)) if layout == "bhsd" else (slice(None), slice(0, split))
    ke = (slice(None), slice(None), slice(split, None)) if layout == "bhsd" else (slice(None), slice(split, None))
    # Causal over the whole = causal on the first part (positions kept) + causal on the rest.
    o_a, l_a = pyfa.attention(q, k[ks], v[ks], causal=True, q_offset=129 - 33, layout=layout, return_lse=True,
                              device=device)
    mask_b = np.arange(split, 129)[None, :] <= (129 - 33 + np.arange(33))[:, None]
    o_b, l_b = pyfa.attention(q, k[ke], v[ke], mask=mask_b, layout=layout, return_lse=True, device=device)
    o, lse = pyfa.merge_attention_states(o_a, l_a, o_b, l_b, layout=layout, device=device)
    ref, ref_lse = reference.attention(q, k, v, causal=True, layout=layout, return_lse=True)
    o64 = o.astype(np.float64)
    if dtype == np.float32:
        check_close(o, ref, dtype)
    else:
        # Each part within flash-attn's rule of its own, then the merge's rounding to the I/O dtype.
        parts = [dict(k=k[ks], v=v[ks], causal=True, q_offset=129 - 33), dict(k=k[ke], v=v[ke], mask=mask_b)]
        part_err = max(np.abs(in_dtype(q, **p, layout=layout) - reference.attention(q, **p, layout=layout)).max()
                       for p in parts)
        assert np.abs(o64 - ref).max() <= 2 * part_err + ROUND[np.dtype(dtype)] * np.abs(ref).max() + 2e-5
    check_lse(lse, ref_lse)
    m_ref, m_lse = reference.merge_attention_states(o_a, l_a, o_b, l_b, layout=layout)
    assert np.abs(o64 - m_ref).max() <= ROUND[np.dtype(dtype)] * np.abs(m_ref).max() + 1e-5
    assert np.abs(lse - m_lse).max() <= 1e-5


def test_merge_both_empty_gives_zeros(device, rng):
    o_a = rng.standard_normal((1, 2, 3, 64)).astype(np.float32)
    o_b = rng.standard_normal((1, 2, 3, 64)).astype(np.float32)
    l_a = np.full((1, 2, 3), -np.inf, np.float32)
    l_b = l_a.copy()
    l_b[0, 1, 2] = 0.5   # one row where only b saw keys
    o, lse = pyfa.merge_attention_states(o_a, l_a, o_b, l_b, device=device)
    assert not np.isnan(o).any()
    assert np.all(o[0, 0] == 0) and np.all(np.isneginf(lse[0, 0]))
    np.testing.assert_allclose(o[0, 1, 2], o_b[0, 1, 2], rtol=1e-6)
    assert lse[0, 1, 2] == np.float32(0.5)


def test_out_argument(device, rng):
    q, k, v = make(rng, 1, 2, 2, 9, 9, 64, BF16)
    out = np.empty_like(q)
    res = pyfa.attention(q, k, v, device=device, out=out)
    assert res is out
    check_close(out, reference.attention(q, k, v), BF16, in_dtype(q, k, v))


def _other_layout(rng, dims, dtype, layout, pad=0):
    """A view in ``layout`` of ``dims`` = (B, H, L, D) over memory of the other layout, whose rows
    are ``pad`` elements longer than D (a slice of wider rows)."""
    B, H, L, D = dims
    store = rng.standard_normal((B, H, L, D + pad) if layout == "bshd" else (B, L, H, D + pad)).astype(dtype)
    return store[..., :D].transpose(0, 2, 1, 3)


# (dtype, D, layout): q and out views of the other layout's memory, k a view of wider rows, v one
# [1, H_kv, kv_len, D] array broadcast to the batch (stride 0)
STRIDED = [(np.float32, 64, "bhsd"), (np.float16, 128, "bshd"), (BF16, 80, "bhsd"), (BF16, 256, "bshd")]


@pytest.fixture
def run_addresses(monkeypatch):
    """The (q, k, v, out) addresses each prefill plan run hands the library (the path of arrays the
    device reads in place: host arrays on a host-visible device, GPU arrays on a GPU)."""
    from pyfa import _plans
    from pyfa._native import lib
    seen, original = [], _plans.run

    def run(device, runner, plan, enc, args, *rest, **kw):
        if runner == lib.pyfa_prefill_run:
            seen.append((args.q.address, args.k.address, args.v.address, args.out.address))
        return original(device, runner, plan, enc, args, *rest, **kw)
    monkeypatch.setattr(_plans, "run", run)
    return seen


def _at(a):
    return a.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype,D,layout", STRIDED)
def test_strided_views_are_read_and_written_in_place(device, rng, run_addresses, dtype, D, layout):
    """Strided views (transposed, sliced, broadcast) give the result of their contiguous copies,
    bit for bit; where the device reads host memory, the run is handed the views' own memory,
    and a strided ``out`` is written where it is."""
    B, H, Hkv, qL, kL = 2, 4, 2, 37, 70
    shape = (lambda b, h, n: (b, h, n, D)) if layout == "bhsd" else (lambda b, h, n: (b, n, h, D))
    q = _other_layout(rng, (B, H, qL, D), dtype, layout)
    k = rng.standard_normal(shape(B, Hkv, kL)[:3] + (D + 8,)).astype(dtype)[..., :D]
    v = np.broadcast_to(rng.standard_normal(shape(1, Hkv, kL)).astype(dtype), shape(B, Hkv, kL))
    assert q.shape == shape(B, H, qL) and not q.flags.c_contiguous and not k.flags.c_contiguous
    out = _other_layout(rng, (B, H, qL, D), dtype, layout)
    kw = dict(causal=True, layout=layout, softcap=20.0)
    got = pyfa.attention(q, k, v, out=out, device=device, **kw)
    assert got is out
    if device.host_visible:
        assert run_addresses == [(_at(q), _at(k), _at(v), _at(out))]
    copies = [np.ascontiguousarray(a) for a in (q, k, v)]
    assert_same_run(out, pyfa.attention(*copies, device=device, **kw))
    check_close(np.ascontiguousarray(out), reference.attention(*copies, **kw), dtype, in_dtype(*copies, **kw))
    assert_same_run(pyfa.attention(q, k, v, device=device, **kw), np.ascontiguousarray(out))


def test_views_the_kernels_cannot_step_through_are_copied(device, rng):
    """Inputs whose rows are not whole 16-byte pieces apart (or whose head_dim is strided) are
    copied; the result is the contiguous one."""
    q, k, v = make(rng, 1, 2, 1, 20, 30, 64, np.float32)
    odd = rng.standard_normal((1, 1, 30, 65)).astype(np.float32)[..., :64]  # rows 260 bytes apart
    odd[...] = k
    columns = np.asfortranarray(v)  # head_dim not contiguous
    assert_same_run(pyfa.attention(q, odd, columns, device=device), pyfa.attention(q, k, v, device=device))


def test_views_starting_off_a_16_byte_boundary_are_copied(device, rng, run_addresses):
    q, k, v = make(rng, 1, 2, 1, 20, 30, 64, np.float16)
    wide = np.zeros((1, 1, 30, 72), np.float16)
    off = wide[..., 4:68]  # rows 144 bytes apart, the first 8 bytes past a boundary
    off[...] = k
    aligned = np.zeros((1, 1, 30, 80), np.float16)[..., 8:72]  # the same strides from a boundary
    aligned[...] = k
    assert _at(off) % 16 == 8 and _at(aligned) % 16 == 0
    got = pyfa.attention(q, off, v, device=device)
    assert_same_run(got, pyfa.attention(q, aligned, v, device=device))
    assert_same_run(got, pyfa.attention(q, k, v, device=device))
    if device.host_visible:  # the first run got a copy of off, the second the aligned view itself
        assert run_addresses[0][1] != _at(off) and run_addresses[1][1] == _at(aligned)


def test_strided_outputs_that_cannot_be_written_in_place_are_refused(device, rng):
    q, k, v = make(rng, 1, 2, 1, 8, 8, 64, np.float32)
    wide = np.zeros((1, 2, 8, 65), np.float32)
    rule = "out: a non-contiguous output must start on a 16-byte boundary, with its last axis"
    with pytest.raises(pyfa.PyfaError, match=rule):
        pyfa.attention(q, k, v, out=wide[..., :64], device=device)  # rows 260 bytes apart
    with pytest.raises(pyfa.PyfaError, match=rule):
        pyfa.attention(q, k, v, out=np.asfortranarray(np.zeros_like(q)), device=device)
    off = np.zeros((1, 2, 8, 72), np.float32)[..., 2:66]  # rows 288 bytes apart, starting 8 bytes in
    with pytest.raises(pyfa.PyfaError, match=rule):
        pyfa.attention(q, k, v, out=off, device=device)
    assert not off.any()
    shared = np.lib.stride_tricks.as_strided(np.zeros(8 * 64, np.float32), q.shape, (0, 0, 256, 4))
    with pytest.raises(pyfa.PyfaError, match=r"out: element strides \(0, 0, 64, 1\) make elements of shape"):
        pyfa.attention(q, k, v, out=shared, device=device)  # both heads would write one row
    assert not wide.any() and not shared.any()


def _raw_params(q):
    """C ABI prefill params for a contiguous [B, H, L, D] array serving as its own k, v and out."""
    from pyfa._native import ffi
    B, H, L, D = q.shape
    s = [H * L * D, L * D, D]
    return ffi.new("pyfa_flash_attn_prefill_params *", {
        "batch": B, "num_heads": H, "num_kv_heads": H, "head_dim": D, "q_len": L, "kv_len": L, "scale": 1.0,
        "q_strides": s, "k_strides": s, "v_strides": s, "out_strides": s})


def test_abi_strides_rules(device):
    """The C ABI's own rules for strides (any caller): row strides in whole 16-byte pieces, and
    out's elements apart from each other."""
    from pyfa import _io
    from pyfa._native import ffi, lib
    from pyfa.errors import check
    q = np.zeros((1, 2, 8, 64), np.float16)
    params = _raw_params(q)
    buf = _io.to_device(device, q)
    out = _io.to_device(device, np.full(q.shape, 3.0, np.float16))
    enc = device.encoder()
    params.k_strides = [1024, 512, 60]  # 120 bytes between key rows
    with pytest.raises(pyfa.PyfaError, match=r"k_strides: \(1024, 512, 60\) elements of 2 bytes; the stride of an "
                                             r"axis longer than 1 must be a multiple of 16 bytes \(8 elements"):
        check(lib.pyfa_flash_attn_prefill(enc, params, buf.handle, buf.handle, buf.handle, ffi.NULL, ffi.NULL,
                                          out.handle, ffi.NULL))
    params.k_strides = [1024, 512, 64]
    params.out_strides = [1024, 0, 64]  # both heads into one plane
    with pytest.raises(pyfa.PyfaError, match="out_strides: \\(1024, 0, 64\\) elements make rows of out share memory"):
        check(lib.pyfa_flash_attn_prefill(enc, params, buf.handle, buf.handle, buf.handle, ffi.NULL, ffi.NULL,
                                          out.handle, ffi.NULL))
    params.out_strides = [7, 512, 64]  # the batch axis has extent 1: its stride is never applied
    check(lib.pyfa_flash_attn_prefill(enc, params, buf.handle, buf.handle, buf.handle, ffi.NULL, ffi.NULL,
                                      out.handle, ffi.NULL))
    check(lib.pyfa_encoder_commit(enc))
    check(lib.pyfa_encoder_wait(enc))
    assert np.array_equal(out.read(), np.zeros(q.shape, np.float16))  # zero q, k, v: the mean of zero rows


@pytest.mark.parametrize("dtype,layout", [(np.float16, "bhsd"), (BF16, "bshd")])
def test_f32_output_on_request(device, rng, dtype, layout):
    """out_dtype=float32 with 16-bit inputs: the f32 result itself (no rounding term in the bound), which
    the default output is rounded from, to nearest even, once."""
    q, k, v = make(rng, 2, 4, 2, 70, 90, 128, dtype, layout)
    kw = dict(causal=True, window=40, softcap=10.0, layout=layout)
    out32, lse = pyfa.attention(q, k, v, out_dtype=np.float32, return_lse=True, device=device, **kw)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    ref16 = in_dtype(q, k, v, **kw)
    check_close(out32, ref, np.float32, ref16)
    check_lse(lse, ref_lse)
    out = pyfa.attention(q, k, v, device=device, **kw)
    check_close(out, ref, dtype, ref16)
    assert np.mean(out == out32.astype(dtype)) >= 0.99  # separate kernels may differ in a last f32 bit
    filled = np.full(q.shape, np.nan, np.float32)
    assert pyfa.attention(q, k, v, out=filled, out_dtype="float32", device=device, **kw) is filled
    check_close(filled, ref, np.float32, ref16)


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_merge_f32_output_on_request(device, rng, dtype):
    o_a, o_b = (rng.standard_normal((2, 3, 5, 64)).astype(dtype) for _ in range(2))
    l_a, l_b = (rng.standard_normal((2, 3, 5)).astype(np.float32) for _ in range(2))
    l_b[1, 2] = -np.inf
    o, lse = pyfa.merge_attention_states(o_a, l_a, o_b, l_b, out_dtype=np.float32, device=device)
    m_ref, m_lse = reference.merge_attention_states(o_a, l_a, o_b, l_b)
    assert o.dtype == np.float32
    np.testing.assert_allclose(o, m_ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(lse, m_lse, atol=1e-5, rtol=0)
    default, _ = pyfa.merge_attention_states(o_a, l_a, o_b, l_b, device=device)
    assert default.dtype == dtype and np.mean(default == o.astype(dtype)) >= 0.99


# Bad input -> PyfaError naming the argument.
def _bad(**over):
    rng = np.random.default_rng(1)
    q, k, v = make(rng, 1, 4, 2, 8, 8, 64, np.float32)
    args = dict(q=q, k=k, v=v)
    args.update(over)
    return args


BAD = [
    ("k", dict(k=np.zeros((1, 2, 8, 128), np.float32), v=np.zeros((1, 2, 8, 128), np.float32))),
    ("num_heads", dict(k=np.zeros((1, 3, 8, 64), np.float32), v=np.zeros((1, 3, 8, 64), np.float32))),
    ("mask", dict(mask=np.zeros((8, 9), np.float32))),
    ("mask", dict(mask=np.zeros((1, 4, 8), np.float32))),
    ("mask", dict(mask=np.zeros((8, 8), np.float16))),
    ("head_dim", dict(q=np.zeros((1, 4, 8, 72), np.float32), k=np.zeros((1, 2, 8, 72), np.float32),
                      v=np.zeros((1, 2, 8, 72), np.float32))),
    ("q_len", dict(q=np.zeros((1, 4, 0, 64), np.float32))),
    ("kv_len", dict(k=np.zeros((1, 2, 0, 64), np.float32), v=np.zeros((1, 2, 0, 64), np.float32))),
    ("window", dict(window=0)),
    ("window", dict(window=-3)),
    ("k", dict(k=np.zeros((1, 2, 8, 64), np.float16))),
    ("layout", dict(layout="sbhd")),
    ("softcap", dict(softcap=-1.0)),
    ("out_dtype: must be q's dtype \\(float32\\) or float32", dict(out_dtype=np.float16)),
    ("out_dtype: must be one of float32, float16, bfloat16", dict(out_dtype=np.float64)),
    ("out: expected shape .* and dtype float32", dict(out=np.zeros((1, 4, 8, 64), np.float16))),
]


@pytest.mark.parametrize("name,over", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_input(device, name, over):
    args = _bad(**over)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(pyfa.PyfaError, match=name):
        pyfa.attention(q, k, v, device=device, **args)


def test_low_level_rules(device):
    """Rules only the C ABI can break: blk without a mask, a wrong tile, short buffers."""
    from pyfa import _io
    from pyfa._native import ffi, lib
    from pyfa.errors import check
    q = np.zeros((1, 1, 8, 64), np.float32)
    params = _raw_params(q)
    buf = _io.to_device(device, q)
    out = _io.to_device(device, np.zeros_like(q))
    blk = device.buffer((64,), np.uint8)
    enc = device.encoder()
    with pytest.raises(pyfa.PyfaError, match="blk: needs a mask"):
        check(lib.pyfa_flash_attn_prefill(enc, params, buf.handle, buf.handle, buf.handle, ffi.NULL, blk.handle,
                                          out.handle, ffi.NULL))
    short = _io.to_device(device, np.zeros((1, 1, 4, 64), np.float32))
    with pytest.raises(pyfa.PyfaError, match="k: buffer holds"):
        check(lib.pyfa_flash_attn_prefill(enc, params, buf.handle, short.handle, buf.handle, ffi.NULL, ffi.NULL,
                                          out.handle, ffi.NULL))
    params.block_q, params.block_k = 7, 7
    with pytest.raises(pyfa.PyfaError, match="block_q/block_k"):
        check(lib.pyfa_flash_attn_prefill(enc, params, buf.handle, buf.handle, buf.handle, ffi.NULL, ffi.NULL,
                                          out.handle, ffi.NULL))
    params.block_q = params.block_k = 0
    params.mask_strides = [0, 0, 8]
    bad_mask = _io.to_device(device, np.zeros((8, 8), np.int32))
    with pytest.raises(pyfa.PyfaError, match="mask: dtype"):
        check(lib.pyfa_flash_attn_prefill(enc, params, buf.handle, buf.handle, buf.handle, bad_mask.handle, ffi.NULL,
                                          out.handle, ffi.NULL))
    mask = _io.to_device(device, np.zeros((8, 8), np.float32))
    with pytest.raises(pyfa.PyfaError, match="blk: buffer holds"):
        check(lib.pyfa_flash_attn_prefill(enc, params, buf.handle, buf.handle, buf.handle, mask.handle,
                                          device.buffer((0,), np.uint8).handle, out.handle, ffi.NULL))
    with pytest.raises(pyfa.PyfaError, match="mask: dtype f32"):  # additive mask of another dtype than the I/O one
        check(lib.pyfa_flash_attn_prefill_blk(enc, params, lib.PYFA_DTYPE_BF16, mask.handle, blk.handle))
    params.mask_strides = [0, 0, 9]  # rows 9 keys apart: the 8x8 mask is too short
    with pytest.raises(pyfa.PyfaError, match="mask: buffer holds"):
        check(lib.pyfa_flash_attn_prefill(enc, params, buf.handle, buf.handle, buf.handle, mask.handle, ffi.NULL,
                                          out.handle, ffi.NULL))
    params.mask_strides = [0, 0, 0]
    half_out = device.buffer(q.shape, np.float16)  # out: the I/O dtype or f32, never narrower
    with pytest.raises(pyfa.PyfaError, match="out: dtype f16 not accepted \\(expected f32\\)"):
        check(lib.pyfa_flash_attn_prefill(enc, params, buf.handle, buf.handle, buf.handle, ffi.NULL, ffi.NULL,
                                          half_out.handle, ffi.NULL))
    half = _io.to_device(device, q.astype(np.float16))
    bf16_out = device.buffer(q.shape, BF16)
    with pytest.raises(pyfa.PyfaError, match="out: dtype bf16 not accepted \\(expected f16 or f32\\)"):
        check(lib.pyfa_flash_attn_prefill(enc, params, half.handle, half.handle, half.handle, ffi.NULL, ffi.NULL,
                                          bf16_out.handle, ffi.NULL))
    merge = ffi.new("pyfa_merge_attn_params *", {"batch": 1, "num_heads": 1, "seq_len": 8, "head_dim": 64,
                                                 "o_strides": [512, 512, 64]})
    lse = _io.to_device(device, np.zeros(8, np.float32))
    with pytest.raises(pyfa.PyfaError, match="out: dtype bf16 not accepted \\(expected f16 or f32\\)"):
        check(lib.pyfa_merge_attention_states(enc, merge, half.handle, lse.handle, half.handle, lse.handle,
                                              bf16_out.handle, ffi.NULL))


def test_merge_bad_input(device):
    o = np.zeros((1, 2, 3, 64), np.float32)
    lse = np.zeros((1, 2, 3), np.float32)
    with pytest.raises(pyfa.PyfaError, match="lse_b"):
        pyfa.merge_attention_states(o, lse, o, lse.astype(np.float64), device=device)
    with pytest.raises(pyfa.PyfaError, match="o_b"):
        pyfa.merge_attention_states(o, lse, o.astype(np.float16), lse, device=device)
    with pytest.raises(pyfa.PyfaError, match="lse_a"):
        pyfa.merge_attention_states(o, lse[:, :, :2], o, lse, device=device)
    with pytest.raises(pyfa.PyfaError, match="head_dim"):
        pyfa.merge_attention_states(np.zeros((1, 2, 3, 4), np.float32), lse, np.zeros((1, 2, 3, 4), np.float32), lse,
                                    device=device)
    half = o.astype(np.float16)
    with pytest.raises(pyfa.PyfaError, match="out_dtype: must be o_a's dtype \\(float16\\) or float32"):
        pyfa.merge_attention_states(half, lse, half, lse, out_dtype=BF16, device=device)
    with pytest.raises(pyfa.PyfaError, match="out: expected shape .* and dtype float16"):
        pyfa.merge_attention_states(half, lse, half, lse, out=np.zeros(o.shape, np.float32), device=device)


def test_struct_sizes():
    from pyfa._native import ffi, lib
    for name in ("pyfa_flash_attn_prefill_params", "pyfa_merge_attn_params"):
        assert lib.pyfa_struct_size(name.encode()) == ffi.sizeof(name)


def _random_cases(n, seed=20261122):
    """Reproducible random combinations of every axis, on top of the tables above."""
    r = np.random.default_rng(seed)
    lengths = [1, 7, 31, 33, 48, 65, 127, 129, 200]
    cases = []
    for _ in range(n):
        Hkv = int(r.choice([1, 2]))
        cases.append(dict(
            B=int(r.integers(1, 3)), Hkv=Hkv, H=Hkv * int(r.choice([1, 2, 4, 8])), D=int(r.choice(HEAD_DIMS)),
            qL=int(r.choice(lengths)), kL=int(r.choice(lengths)),
            dtype=[np.float32, np.float16, BF16][r.integers(3)], layout=["bhsd", "bshd"][r.integers(2)],
            causal=bool(r.integers(2)), window=[None, None, int(r.integers(1, 80))][r.integers(3)],
            softcap=[0.0, 0.0, 4.0][r.integers(3)], mask=[None, "additive", "bool"][r.integers(3)],
            rank=int(r.choice([2, 4])), q_offset=[None, None, int(r.integers(-20, 60))][r.integers(3)]))
    return cases


@pytest.mark.parametrize("case", _random_cases(40), ids=lambda c: "-".join(str(v) for v in c.values()))
def test_random_combinations(device, rng, case):
    c = case
    q, k, v = make(rng, c["B"], c["H"], c["Hkv"], c["qL"], c["kL"], c["D"], c["dtype"], c["layout"])
    kw = dict(causal=c["causal"], window=c["window"], softcap=c["softcap"], q_offset=c["q_offset"],
              layout=c["layout"])
    if c["mask"]:
        shape = (c["qL"], c["kL"]) if c["rank"] == 2 else (c["B"], c["H"], c["qL"], c["kL"])
        kw["mask"] = block_mask(rng, shape, c["mask"], c["dtype"], plan_tile(device, c["D"], c["dtype"]))
        forced = [prefill._attention(q, k, v, scale=None, return_lse=True, device=device, out=None, use_blk=u, **kw)
                  for u in (True, False)]
        assert_same_run(forced[0][0], forced[1][0])
        assert_same_run(forced[0][1], forced[1][1])
    out, lse, ref, ref_lse = run_both(q, k, v, device, **kw)
    check_close(out, ref[0], c["dtype"], ref[1])
    check_lse(lse, ref_lse)
