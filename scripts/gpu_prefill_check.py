"""Prefill family on the CUDA backend: every variant against pyfa.reference
(one PASS/FAIL line per case, with its error), then causal bf16 timings with
torch SDPA (flash, cuDNN) as peers in the same run. Needs a CUDA device;
torch is optional (timings are skipped without it).

    python3 scripts/gpu_prefill_check.py [--no-timing] [--only SUBSTRING] [--backend cpu]

Tolerances (same reasoning as tests/test_prefill.py): the reference reads the
same rounded inputs, so the error is f32 accumulation plus the rounding of
the output to the I/O dtype (half an ulp: ROUND[dtype] of max|out|);
LSE within 1e-4 (f32 statistics). By default (PYFA_CUDA_PREFILL_P_TERMS=1)
the kernel rounds P to the I/O dtype as FlashAttention does, which adds up to
ROUND * 2 max|v|: the script widens the bound by that term in that mode
(PYFA_CUDA_PREFILL_P_TERMS=2, P exact, keeps the narrow bound).
"""
import argparse
import math
import os
import statistics
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import pyfa  # noqa: E402
from pyfa import _io, dtypes, prefill, reference  # noqa: E402
from pyfa._native import ffi, lib  # noqa: E402
from pyfa.errors import check  # noqa: E402

BF16 = pyfa.bfloat16
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
ROUND = {F32: 0.0, F16: 2.0**-11, np.dtype(BF16): 2.0**-8}
NAMES = {F32: "f32", F16: "f16", np.dtype(BF16): "bf16"}
HEAD_DIMS = [64, 80, 96, 128, 192, 256, 512]
# As the CUDA plan reads the knob: values >= 2 keep P exact, anything else rounds it (1).
_P_KNOB = os.environ.get("PYFA_CUDA_PREFILL_P_TERMS", "")
P_TERMS = 2 if _P_KNOB.isdigit() and int(_P_KNOB) >= 2 else 1

RESULTS = []


def report(name, ok, detail):
    RESULTS.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def make(rng, B, H, Hkv, qL, kL, D, dtype, layout="bhsd"):
    def arr(h, n):
        shape = (B, h, n, D) if layout == "bhsd" else (B, n, h, D)
        return rng.standard_normal(shape).astype(dtype)
    return arr(H, qL), arr(Hkv, kL), arr(Hkv, kL)


def compare(out, lse, ref, ref_lse, dtype, v):
    """(ok, detail) of out / lse against the float64 reference."""
    dtype = np.dtype(dtype)
    o = out.astype(np.float64)
    if np.isnan(o).any():
        return False, "NaN in out"
    err = float(np.abs(o - ref).max())
    bound = ROUND[dtype] * max(np.abs(ref).max(), 1.0) + 2e-5
    if P_TERMS == 1:
        bound += ROUND[dtype] * 2 * float(np.abs(v.astype(np.float64)).max())
    ok = err <= bound
    detail = f"max|out-ref| {err:.2e} (bound {bound:.2e})"
    if lse is not None:
        same_inf = np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        fin = np.isfinite(ref_lse)
        lerr = float(np.abs(lse[fin] - ref_lse[fin]).max(initial=0.0))
        ok = ok and same_inf and lerr <= 1e-4 and not np.isnan(lse).any()
        detail += f", max|lse-ref| {lerr:.2e}{'' if same_inf else ', -inf rows differ'}"
    return ok, detail


def plan_tile(dev, D, dtype):
    params = ffi.new("pyfa_flash_attn_prefill_params *", {
        "batch": 1, "num_heads": 1, "num_kv_heads": 1, "head_dim": D, "q_len": 1, "kv_len": 1, "scale": 1.0})
    check(lib.pyfa_flash_attn_prefill_plan(dev.handle, params, dtypes.code(dtype), ffi.new("uint64_t *")))
    return params.block_q, params.block_k


def block_mask(rng, shape, kind, dtype, tile):
    """Random mask with whole blocked / all-open / mixed 8x16 blocks and plan tiles."""
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
    return allowed if kind == "bool" else np.where(allowed, bias, -np.inf).astype(dtype)


def run_attn(dev, rng, *, B=1, H=2, Hkv=1, qL=67, kL=131, D=128, dtype=BF16, layout="bhsd", mask=None,
             rank=2, **opts):
    """One attention case (opts: causal, window, softcap, q_offset) against the reference; with a
    mask also blk on == blk off."""
    q, k, v = make(rng, B, H, Hkv, qL, kL, D, dtype, layout)
    m = None
    if mask is not None:
        shape = (qL, kL) if rank == 2 else (B, H, qL, kL)
        m = block_mask(rng, shape, mask, dtype, plan_tile(dev, D, dtype))
    common = dict(mask=m, layout=layout, **opts)
    defaults = {key: val for key, val in (("causal", False), ("q_offset", None), ("window", None), ("softcap", 0.0))
                if key not in opts}
    out, lse = prefill._attention(q, k, v, scale=None, return_lse=True, device=dev, out=None,
                                  use_blk=True if m is not None else None, **defaults, **common)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **common)
    ok, detail = compare(out, lse, ref, ref_lse, dtype, v)
    if m is not None:
        no_blk, lse_no = prefill._attention(q, k, v, scale=None, return_lse=True, device=dev, out=None,
                                            use_blk=False, **defaults, **common)
        # Equal values (as tests/test_prefill.py compares them; +0 and -0 count as one).
        same = np.array_equal(out, no_blk) and np.array_equal(lse, lse_no)
        ok = ok and same
        detail += ", blk == no-blk" if same else ", blk != no-blk"
    return ok, detail


def correctness(dev, only, workers):
    """Runs the cases on `workers` threads (pipelines compile in parallel; every call has its own
    encoder), reporting in a fixed order."""
    cases = []  # (name, fn(rng) -> (ok, detail))
    for dtype in (np.float32, np.float16, BF16):
        dn = NAMES[np.dtype(dtype)]
        attn = []
        for D in HEAD_DIMS:
            attn.append((f"{dn} D={D} causal qL=67 kL=131", dict(D=D, dtype=dtype, causal=True)))
            attn.append((f"{dn} D={D} full qL=130 kL=64 bshd GQA4", dict(D=D, dtype=dtype, H=4, Hkv=1, qL=130,
                                                                           kL=64, layout="bshd")))
        for D in (64, 128, 512):
            attn += [
                (f"{dn} D={D} additive rank2 causal window=40 blk", dict(D=D, dtype=dtype, mask="additive",
                                                                        causal=True, window=40, qL=150, kL=300)),
                (f"{dn} D={D} bool rank4 bshd blk", dict(D=D, dtype=dtype, mask="bool", rank=4, B=2, qL=70, kL=200,
                                                         layout="bshd")),
                (f"{dn} D={D} softcap=5 causal q_offset=-5", dict(D=D, dtype=dtype, softcap=5.0, causal=True,
                                                                  q_offset=-5, qL=65, kL=100)),
                (f"{dn} D={D} window=1 causal lengths 1x1", dict(D=D, dtype=dtype, window=1, causal=True, qL=1, kL=1)),
                (f"{dn} D={D} q_offset=60 chunk GQA8 qL=40 kL=129", dict(D=D, dtype=dtype, H=8, Hkv=1, q_offset=60,
                                                                          causal=True, qL=40, kL=129)),
            ]
        attn.append((f"{dn} D=96 odd lengths 33x65 softcap window", dict(D=96, dtype=dtype, softcap=3.0, window=17,
                                                                         qL=33, kL=65)))
        attn.append((f"{dn} D=256 causal 257x257 B=2", dict(D=256, dtype=dtype, causal=True, qL=257, kL=257, B=2)))
        cases += [(name, lambda rng, kw=kw: run_attn(dev, rng, **kw)) for name, kw in attn]
        cases.append((f"{dn} fully masked rows", lambda rng, dtype=dtype: fully_masked(dev, rng, dtype)))
        for D, layout in ((64, "bhsd"), (136, "bshd"), (512, "bhsd")):
            cases.append((f"merge {dn} D={D} {layout}",
                          lambda rng, dtype=dtype, D=D, layout=layout: merge_case(dev, rng, dtype, D, layout)))
    cpu = pyfa.Device("cpu")
    for dtype, kind in ((np.float32, "additive"), (np.float16, "additive"), (BF16, "bool")):
        cases.append((f"blk bytes {NAMES[np.dtype(dtype)]} {kind} (device and CPU vs numpy)",
                      lambda rng, dtype=dtype, kind=kind: blk_case(dev, cpu, rng, dtype, kind)))
    cases = [c for c in cases if not only or only in c[0]]

    def run(case):
        name, fn = case
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        try:
            return fn(rng)
        except Exception as e:  # a failing case must not hide the others
            return False, f"{type(e).__name__}: {e}"

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for (name, _), (ok, detail) in zip(cases, pool.map(run, cases)):
            report(name, ok, detail)


def fully_masked(dev, rng, dtype):
    """A fully masked row and query tile: zeros and -inf, never NaN."""
    q, k, v = make(rng, 1, 2, 2, 70, 100, 64, dtype)
    allowed = np.ones((70, 100), bool)
    allowed[3] = False
    allowed[50:] = False
    allowed[:, 10] = False
    out, lse = pyfa.attention(q, k, v, mask=allowed, return_lse=True, device=dev)
    ref, ref_lse = reference.attention(q, k, v, mask=allowed, return_lse=True)
    ok, detail = compare(out, lse, ref, ref_lse, dtype, v)
    zeros = np.all(out[:, :, 3] == 0) and np.all(out[:, :, 50:] == 0) and np.all(np.isneginf(lse[:, :, 50:]))
    return ok and zeros, detail + ("" if zeros else ", masked rows not zero/-inf")


def blk_case(dev, cpu, rng, dtype, kind):
    """The pre-pass bytes of `dev` and of the CPU (each with its own tile) against numpy."""
    mask = block_mask(rng, (300, 500), kind, dtype, plan_tile(dev, 128, dtype))
    ok, tiles = True, []
    for d in (dev, cpu):
        params = ffi.new("pyfa_flash_attn_prefill_params *", {
            "batch": 1, "num_heads": 1, "num_kv_heads": 1, "head_dim": 128, "q_len": 300, "kv_len": 500,
            "scale": 1.0, "mask_strides": [0, 0, 500]})
        nbytes = ffi.new("uint64_t *")
        check(lib.pyfa_flash_attn_prefill_plan(d.handle, params, dtypes.code(dtype), nbytes))
        buf = _io.to_device(d, mask.view(np.uint8) if kind == "bool" else mask)
        blk = d.buffer((nbytes[0],), np.uint8)
        enc = d.encoder()
        check(lib.pyfa_flash_attn_prefill_blk(enc, params, dtypes.code(dtype), buf.handle, blk.handle))
        check(lib.pyfa_encoder_commit(enc))
        check(lib.pyfa_encoder_wait(enc))
        want = classify(mask, kind, params.block_q, params.block_k)
        ok = ok and np.array_equal(blk.read().reshape(want.shape), want)
        tiles.append((params.block_q, params.block_k))
    return ok, f"tiles {tiles}"


def merge_case(dev, rng, dtype, D, layout):
    """merge_attention_states over any multiple of 8, with one-sided and two-sided -inf rows."""
    shape = (2, 3, 37, D) if layout == "bhsd" else (2, 37, 3, D)
    o_a = rng.standard_normal(shape).astype(dtype)
    o_b = rng.standard_normal(shape).astype(dtype)
    l_a = (rng.standard_normal((2, 3, 37)) * 3).astype(np.float32)
    l_b = (rng.standard_normal((2, 3, 37)) * 3).astype(np.float32)
    l_a[0, 0, :5] = -np.inf
    l_b[0, 0, :3] = -np.inf  # rows 0-2: both empty
    o, lse = pyfa.merge_attention_states(o_a, l_a, o_b, l_b, layout=layout, device=dev)
    ref, ref_lse = reference.merge_attention_states(o_a, l_a, o_b, l_b, layout=layout)
    err = float(np.abs(o.astype(np.float64) - ref).max())
    bound = ROUND[np.dtype(dtype)] * max(np.abs(ref).max(), 1.0) + 1e-5
    fin = np.isfinite(ref_lse)
    lerr = float(np.abs(lse[fin] - ref_lse[fin]).max())
    ok = (err <= bound and lerr <= 1e-5 and np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
          and not np.isnan(o.astype(np.float32)).any())
    return ok, f"max|o-ref| {err:.2e} (bound {bound:.2e}), max|lse-ref| {lerr:.2e}"


def classify(mask, kind, bq, bk):
    """numpy blk classification of a rank-2 mask (contract in flash_attn_prefill_params.h)."""
    qL, kL = mask.shape
    nq, nk = -(-qL // bq), -(-kL // bk)
    out = np.empty((nq, nk), np.uint8)
    for i in range(nq):
        for j in range(nk):
            t = mask[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            if kind == "bool":
                blocked, noop = ~t, t
            else:
                bits = t.view(np.uint16 if t.dtype.itemsize == 2 else np.uint32).astype(np.uint32)
                ninf = {2: 0xfc00 if t.dtype == np.float16 else 0xff80, 4: 0xff800000}[t.dtype.itemsize]
                blocked = bits == ninf
                noop = (bits & (0x7fff if t.dtype.itemsize == 2 else 0x7fffffff)) == 0
            out[i, j] = lib.PYFA_BLK_SKIP if blocked.all() else lib.PYFA_BLK_ZERO if noop.all() else lib.PYFA_BLK_MIXED
    return out


# ------------------------------------------------------------------ timing
def timing(dev):
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        print("timing: torch not installed, skipped")
        return

    def timed(launch, reps=3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for r in range(reps + 1):  # the first is warm-up
            start.record()
            launch()
            end.record()
            end.synchronize()
            if r:
                samples.append(start.elapsed_time(end) * 1e-3)
        return statistics.median(samples)

    B, H, Hkv = 1, 16, 8
    print(f"timing: causal bf16, B={B} H={H} Hkv={Hkv}, bhsd, P terms {P_TERMS}; TFLOP/s = 4*B*H*L^2*D/2 / time")
    for D in (128, 256, 512):
        for L in (4096, 16384):
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn((B, H, L, D), generator=g, device="cuda", dtype=torch.bfloat16)
            k = torch.randn((B, Hkv, L, D), generator=g, device="cuda", dtype=torch.bfloat16)
            v = torch.randn((B, Hkv, L, D), generator=g, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            params = ffi.new("pyfa_flash_attn_prefill_params *", {
                "batch": B, "num_heads": H, "num_kv_heads": Hkv, "head_dim": D, "q_len": L, "kv_len": L,
                "q_offset": 0, "scale": 1.0 / math.sqrt(D), "causal": 1,
                "q_strides": [H * L * D, L * D, D], "k_strides": [Hkv * L * D, L * D, D],
                "v_strides": [Hkv * L * D, L * D, D], "out_strides": [H * L * D, L * D, D]})
            check(lib.pyfa_flash_attn_prefill_plan(dev.handle, params, lib.PYFA_DTYPE_BF16, ffi.new("uint64_t *")))
            g_arrays = [pyfa.cuda_interop.describe(t, "x") for t in (q, k, v, out)]
            bufs = [_io.to_device(dev, a) for a in g_arrays]
            enc = _io.encoder(dev, g_arrays[0])

            def launch():
                check(lib.pyfa_flash_attn_prefill(enc, params, bufs[0].handle, bufs[1].handle, bufs[2].handle,
                                                  ffi.NULL, ffi.NULL, bufs[3].handle, ffi.NULL))
                check(lib.pyfa_encoder_commit(enc))

            flops = 4 * B * H * L * L * D / 2
            t0 = time.perf_counter()
            launch()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            kr = k.repeat_interleave(H // Hkv, dim=1)
            vr = v.repeat_interleave(H // Hkv, dim=1)
            # The last 64 query rows (they see every key) against an f32 torch computation.
            s = (q[:, :, -64:].float() @ kr.float().transpose(-1, -2)) / math.sqrt(D)
            s = s + torch.triu(torch.full((64, L), float("-inf"), device="cuda"), diagonal=L - 64 + 1)
            want = torch.softmax(s, dim=-1) @ vr.float()
            err = float((out[:, :, -64:].float() - want).abs().max())
            del s, want
            row = [f"D={D:3d} L={L:5d}: pyfa {flops / timed(launch) / 1e12:6.1f} TF "
                   f"(first call {first:.1f} s, last 64 rows max|err| {err:.1e})"]
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                if D > 256:
                    continue
                try:
                    with sdpa_kernel(backend):
                        ref = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
                        t = timed(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True))
                    err = float((ref.float() - out.float()).abs().max())
                    row.append(f"torch {name} {flops / t / 1e12:6.1f} TF (max|diff| {err:.1e})")
                except RuntimeError as e:
                    row.append(f"torch {name} n/a ({str(e).splitlines()[0][:60]})")
            print(", ".join(row), flush=True)
            del q, k, v, out, kr, vr, bufs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--timing-only", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--workers", type=int, default=8, help="threads running cases (NVRTC compiles in parallel)")
    ap.add_argument("--backend", default="cuda", help="another backend runs the same cases (a dry run of the script)")
    args = ap.parse_args()
    if args.backend not in pyfa.available_backends():
        print(f"FAIL: no {args.backend} backend here")
        return 1
    dev = pyfa.Device(args.backend)
    t0 = time.perf_counter()
    if not args.timing_only:
        correctness(dev, args.only, args.workers)
        print(f"correctness: {sum(RESULTS)}/{len(RESULTS)} passed in {time.perf_counter() - t0:.1f} s", flush=True)
    if not args.no_timing:
        timing(dev)
        if not args.timing_only and P_TERMS == 1:
            # The exact-P mode (P in two terms) in a fresh process: the knob is read at load.
            env = dict(os.environ, PYFA_CUDA_PREFILL_P_TERMS="2")
            subprocess.run([sys.executable, __file__, "--timing-only"], env=env, check=False)
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
