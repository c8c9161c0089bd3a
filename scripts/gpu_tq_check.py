"""TurboQuant on the CUDA backend, checked and timed on a GPU machine; one line per case.

  codec    codes and scales from CUDA equal the CPU backend's byte for byte (every bit width and
           head dim, f32 rows in the three scale modes; f16 / bf16 rows at D=128), and
           tq_dequantize_kv gives the CPU's floats bit for bit;
  decode   flash_attn_vec_tq (fused and unfused tail) against our dense decode over the
           dequantized K/V and the float64 reference (GQA, window, ring, softcap, nwg), and the
           fused tail bit for bit equal to reduce + fwht_sign_undo; batched caches;
  timing   TQ-4 decode (fwht_sign_premult + flash_attn_vec_tq + fused reduce/undo) against our
           dense f16 decode at 32K positions: CUDA events around back-to-back launches, median of
           repeats (torch, else cupy).

    python3 scripts/gpu_tq_check.py [--no-timing | --timing-only] [--iters 20] [--reps 7]

Exit status 1 when a correctness check fails. Kernels compile on first use (NVRTC, disk-cached),
so a first run spends part of its time compiling.
"""
import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import pyfa  # noqa: E402
from pyfa import _io, reference  # noqa: E402
from pyfa import turboquant as tq  # noqa: E402
from pyfa._native import ffi, lib  # noqa: E402
from pyfa.errors import check  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
import tq_contract  # noqa: E402

FAILED = []


def report(name, ok, detail):
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


# --------------------------------------------------------------------------- codec

def check_codec(gpu, cpu):
    seed = 0x0123456789ABCDEF
    for D in tq.HEAD_DIMS:
        for bits in tq.BIT_WIDTHS:
            rng = np.random.default_rng(D * 16 + bits)
            x = (rng.standard_normal((384, D)) * rng.uniform(1e-3, 1e3, (384, 1))).astype(np.float32)
            x[1] = 0.0
            x[2] = 0.0
            x[2, 7] = 3.0  # one-hot
            dtypes = (np.float32, np.float16, pyfa.bfloat16) if D == 128 else (np.float32,)
            bad = []
            for dt in dtypes:
                xd = x.astype(dt)
                for nc in ("none", "norm_preserving", "unbiased"):
                    stream = tq.STREAM_V if nc == "unbiased" else tq.STREAM_K
                    c1, s1 = tq.quantize(xd, bits, seed=seed, stream=stream, norm_correction=nc, device=gpu)
                    c0, s0 = tq.quantize(xd, bits, seed=seed, stream=stream, norm_correction=nc, device=cpu)
                    if not (same_bits(c1, c0) and same_bits(s1, s0)):
                        rows = np.nonzero((c1 != c0).any(1) | (s1.view(np.uint32) != s0.view(np.uint32)))[0]
                        bad.append(f"{np.dtype(dt).name}/{nc}: {rows.size} rows differ (first {rows[:4]})")
            caches = []
            for dev in (gpu, cpu):
                c = pyfa.TurboQuantKVCache(1, D, 384, k_bits=bits, v_bits=bits, seed=seed, device=dev)
                c.append(x[:, None], x[::-1, None].copy())
                caches.append(c)
            (k1, v1), (k0, v0) = caches[0].dequantize(), caches[1].dequantize()
            deq_same = same_bits(k1, k0) and same_bits(v1, v0)
            idx = tq.unpack_codes(caches[1].codes()[0][0], bits)
            ref = tq.reference_decode(idx, caches[1].codes()[1][0], bits, seed=seed, stream=tq.STREAM_K)
            err = float(np.abs(k1[:, 0] - ref).max() / max(1.0, np.abs(ref).max()))
            ok = not bad and deq_same and err < 1e-5
            detail = (f"codes+scales identical ({len(dtypes)} dtypes x 3 modes x 384 rows)" if not bad else "; ".join(bad))
            report(f"codec D={D} bits={bits}", ok,
                   f"{detail}; dequantize {'bit-identical' if deq_same else 'DIFFERS'} to CPU, "
                   f"rel err vs float64 {err:.1e}")


# --------------------------------------------------------------------------- decode

DECODE_CASES = [  # (H, Hkv, D, k_bits, v_bits, capacity, appended, window, softcap, nwg)
    (16, 8, 128, 4, 4, 3000, 3000, None, 0.0, None),
    (16, 8, 256, 4, 4, 2048, 2048, None, 0.0, 5),
    (32, 4, 128, 4, 4, 1500, 1500, None, 0.0, None),  # GQA 8: several head passes
    (8, 2, 64, 2, 8, 700, 700, None, 0.0, 3),
    (6, 2, 256, 3, 2, 256, 613, 200, 0.0, 4),         # ring wrapped, window < capacity
    (2, 1, 512, 8, 3, 300, 300, None, 5.0, 2),        # softcap
    (4, 2, 128, 4, 2, 96, 250, 96, 2.0, 1),           # ring + softcap, nwg = 1 (direct)
    (16, 2, 64, 3, 4, 2048, 1500, None, 0.0, 7),
    (4, 4, 512, 8, 8, 1000, 1000, None, 0.0, None),
    (8, 8, 128, 4, 8, 5, 5, None, 0.0, None),         # fewer keys than one step
]


def check_decode(gpu, cpu):
    for case in DECODE_CASES:
        H, Hkv, D, kb, vb, cap, n, window, softcap, nwg = case
        rng = np.random.default_rng(sum(case[:6]))
        cache = pyfa.TurboQuantKVCache(Hkv, D, cap, k_bits=kb, v_bits=vb, seed=42, sliding_window=window, device=gpu)
        for part in np.array_split(np.arange(n), 3):
            cache.append(rng.standard_normal((len(part), Hkv, D)), rng.standard_normal((len(part), Hkv, D)))
        q = rng.standard_normal((H, D)).astype(np.float32) * 2
        fused = cache.attend(q, softcap=softcap, fused=True, nwg=nwg)
        unfused = cache.attend(q, softcap=softcap, fused=False, nwg=nwg)
        # Against the rows of the f32 codebook and of its f16 rounding, which a kernel may
        # multiply (tests/tq_contract.py): the float64 reference and our dense decode over each.
        e_ref, e_dense = [], []
        for dt in tq_contract.CODEBOOK_DTYPES:
            k, v = tq_contract.cache_rows(cache, dt)
            ref = reference.decode_attention(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2), k.shape[0],
                                             softcap=softcap, window=window)
            k, v = k.astype(np.float32), v.astype(np.float32)
            dense = pyfa.decode_attention(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2), k.shape[0], softcap=softcap,
                                          window=window, device=gpu)
            e_ref.append(float(np.abs(fused - ref).max()))
            e_dense.append(float(np.abs(fused - dense).max()))
        bitwise = same_bits(fused, unfused)
        # Rotated vs original domain: the same math in float32 (tests/test_turboquant.py: 2e-5).
        ok = min(e_ref) < 2e-5 and min(e_dense) < 2e-5 and bitwise and np.all(np.isfinite(fused))
        report(f"decode H={H}/{Hkv} D={D} k{kb}v{vb} len={min(n, cap)} cap={cap} window={window} "
               f"softcap={softcap} nwg={nwg}", ok,
               f"max|tq - float64| {e_ref[0]:.1e} / {e_ref[1]:.1e}, max|tq - dense| {e_dense[0]:.1e} / "
               f"{e_dense[1]:.1e} (f32 / f16 codebook), fused == unfused: {bitwise}")
    sys.path.insert(0, str(ROOT / "tests"))
    import test_turboquant as t

    t0 = time.perf_counter()
    try:
        t.test_batched_kernels_match_single_sequence_caches(gpu, np.random.default_rng(0))
        report("decode batched (B=2, per-sequence kv_len)", True, f"matches single-sequence caches "
               f"({time.perf_counter() - t0:.1f} s)")
    except AssertionError as e:
        report("decode batched (B=2, per-sequence kv_len)", False, str(e).splitlines()[0])


# --------------------------------------------------------------------------- timing

class Frame:
    """torch or cupy: arrays, events and the current stream."""

    def __init__(self):
        try:
            import torch
            self.name, self.torch = "torch", torch
        except ImportError:
            import cupy
            self.name, self.cupy = "cupy", cupy

    def randn(self, shape, dtype):
        if self.name == "torch":
            t = {"f16": self.torch.float16, "f32": self.torch.float32}[dtype]
            return self.torch.randn(shape, device="cuda", dtype=t)
        return self.cupy.random.standard_normal(shape, dtype=np.float32).astype({"f16": np.float16, "f32": np.float32}[dtype])

    def randbytes(self, shape):
        if self.name == "torch":
            return self.torch.randint(0, 256, shape, device="cuda", dtype=self.torch.uint8)
        return self.cupy.random.randint(0, 256, shape, dtype=np.uint8)

    def uniform(self, shape, lo, hi):
        if self.name == "torch":
            return self.torch.empty(shape, device="cuda", dtype=self.torch.float32).uniform_(lo, hi)
        return self.cupy.random.uniform(lo, hi, shape).astype(np.float32)

    def full_i32(self, n, value):
        if self.name == "torch":
            return self.torch.full((n,), value, device="cuda", dtype=self.torch.int32)
        return self.cupy.full((n,), value, dtype=np.int32)

    def empty_f32(self, n):
        if self.name == "torch":
            return self.torch.empty((n,), device="cuda", dtype=self.torch.float32)
        return self.cupy.empty((n,), dtype=np.float32)

    def timed(self, launch, iters, reps, prepare):
        """Median µs per call: events around `iters` launches recorded by `prepare`."""
        samples = []
        for r in range(reps + 2):  # two warm-ups
            prepare()
            if self.name == "torch":
                start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
                start.record()
                launch()
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                start, end = self.cupy.cuda.Event(), self.cupy.cuda.Event()
                start.record()
                launch()
                end.record()
                end.synchronize()
                ms = self.cupy.cuda.get_elapsed_time(start, end)
            if r >= 2:
                samples.append(ms * 1000.0 / iters)
        return statistics.median(samples)


class Recorder:
    """Device buffers over framework arrays and an encoder on the framework's stream."""

    def __init__(self, dev, arrays):
        self.keep = arrays
        g = [pyfa.cuda_interop.describe(a, "x") for a in arrays]
        self.bufs = [_io.to_device(dev, x) for x in g]
        self.enc = _io.encoder(dev, g[0])

    def commit(self):
        check(lib.pyfa_encoder_commit(self.enc))


class PlanRecorder:
    """Runs of a prepared op (pyfa_*_plan_new) on framework arrays, recorded on the framework's stream."""

    def __init__(self, dev, arrays, plan):
        self.keep, self.plan = arrays, plan
        self.enc = _io.encoder(dev, pyfa.cuda_interop.describe(arrays[0], "x"))

    @staticmethod
    def tensor(a):
        d = pyfa.cuda_interop.describe(a, "x")
        return {"address": d.ptr, "nbytes": d.nbytes}

    def commit(self):
        check(lib.pyfa_encoder_commit(self.enc))

    def __del__(self):
        lib.pyfa_plan_free(self.plan)


def dense_recorder(dev, fw, B, Hq, Hkv, D, L, planned=False):
    q, k, v = fw.randn((B, Hq, D), "f16"), fw.randn((B, Hkv, L, D), "f16"), fw.randn((B, Hkv, L, D), "f16")
    params = ffi.new("pyfa_flash_attn_vec_params *", {
        "batch": B, "num_heads": Hq, "num_kv_heads": Hkv, "head_dim": D, "kv_capacity": L, "nwg": 0,
        "window": 0, "scale": 1.0 / math.sqrt(D), "softcap": 0.0})
    if planned:  # the prepared op a plan runs (DecodePlan: the split merged in its last workgroups)
        plan = ffi.new("pyfa_plan **")
        check(lib.pyfa_decode_plan_new(plan, dev.handle, ffi.new("pyfa_decode_plan_desc *", {
            "attn": params[0], "q_dtype": lib.PYFA_DTYPE_F16, "kv_dtype": lib.PYFA_DTYPE_F16,
            "out_dtype": lib.PYFA_DTYPE_F16, "max_kv_len": L})))
        out, lens = fw.randn((B, Hq, D), "f16"), fw.full_i32(B, L)
        rings = ffi.new("int32_t[]", B)  # zeros on the host, kept alive with the recorder
        r = PlanRecorder(dev, [q, k, v, out, lens, rings], plan[0])
        t = PlanRecorder.tensor
        args = ffi.new("pyfa_decode_run_args *", {
            "q": t(q), "k_cache": t(k), "v_cache": t(v), "out": t(out), "kv_len": {"host": ffi.NULL, "device": t(lens)},
            "ring_start": {"host": rings, "device": {"address": 0, "nbytes": 0}}})

        def record_planned(n):
            for _ in range(n):
                check(lib.pyfa_decode_run(r.plan, r.enc, args))
        nwg = ffi.new("pyfa_flash_attn_vec_params *", params[0])
        check(lib.pyfa_flash_attn_vec_plan(dev.handle, nwg, lib.PYFA_DTYPE_F16, L, ffi.new("uint64_t *")))
        return r, record_planned, 2 * B * Hkv * L * D * 2, int(nwg.nwg)
    tmp_bytes = ffi.new("uint64_t *")
    check(lib.pyfa_flash_attn_vec_plan(dev.handle, params, lib.PYFA_DTYPE_F16, L, tmp_bytes))
    r = Recorder(dev, [q, k, v, fw.full_i32(B, L), fw.full_i32(B, 0), fw.empty_f32(max(1, tmp_bytes[0] // 4)),
                       fw.empty_f32(B * Hq * D)])
    b = r.bufs

    def record(n):
        for _ in range(n):
            check(lib.pyfa_flash_attn_vec(r.enc, params, b[0].handle, b[1].handle, b[2].handle, b[3].handle,
                                          b[4].handle, b[5].handle if tmp_bytes[0] else ffi.NULL, b[6].handle,
                                          ffi.NULL))
    return r, record, 2 * B * Hkv * L * D * 2, int(params.nwg)


def tq_recorder(dev, fw, B, Hq, Hkv, D, L, bits, planned=False, nwg=0):
    rb = D * bits // 8
    q = fw.randn((B, Hq, D), "f16")
    kc, vc = fw.randbytes((B, Hkv, L, rb)), fw.randbytes((B, Hkv, L, rb))
    # Scales near |x| of N(0, 1) rows (sqrt(D)), so scores have realistic magnitudes.
    ks, vs = fw.uniform((B, Hkv, L), 0.8 * math.sqrt(D), 1.2 * math.sqrt(D)), fw.uniform((B, Hkv, L), 0.8, 1.2)
    params = ffi.new("pyfa_flash_attn_vec_tq_params *", {
        "attn": {"batch": B, "num_heads": Hq, "num_kv_heads": Hkv, "head_dim": D, "kv_capacity": L, "nwg": nwg,
                 "window": 0, "scale": 1.0 / math.sqrt(D), "softcap": 0.0},
        "k_bits": bits, "v_bits": bits, "seed_lo": 7, "fused": 1})
    if planned:  # the prepared op a plan runs (TQDecodePlan: the split merged and undone in its last workgroups)
        plan = ffi.new("pyfa_plan **")
        check(lib.pyfa_tq_decode_plan_new(plan, dev.handle, ffi.new("pyfa_tq_decode_plan_desc *", {
            "tq": params[0], "q_dtype": lib.PYFA_DTYPE_F16, "out_dtype": lib.PYFA_DTYPE_F32, "max_kv_len": L})))
        out, lens = fw.empty_f32(B * Hq * D), fw.full_i32(B, L)
        rings = ffi.new("int32_t[]", B)  # zeros on the host, kept alive with the recorder
        r = PlanRecorder(dev, [q, kc, ks, vc, vs, out, lens, rings], plan[0])
        t = PlanRecorder.tensor
        args = ffi.new("pyfa_tq_decode_run_args *", {
            "q": t(q), "k_codes": t(kc), "k_scales": t(ks), "v_codes": t(vc), "v_scales": t(vs), "out": t(out),
            "kv_len": {"host": ffi.NULL, "device": t(lens)},
            "ring_start": {"host": rings, "device": {"address": 0, "nbytes": 0}}})

        def record_planned(n):
            for _ in range(n):
                check(lib.pyfa_tq_decode_run(r.plan, r.enc, args))
        sized = ffi.new("pyfa_flash_attn_vec_tq_params *", params[0])
        check(lib.pyfa_flash_attn_vec_tq_plan(dev.handle, sized, L, ffi.new("uint64_t *")))
        return r, record_planned, 2 * B * Hkv * L * (rb + 4), int(sized.attn.nwg), out
    tmp_bytes = ffi.new("uint64_t *")
    check(lib.pyfa_flash_attn_vec_tq_plan(dev.handle, params, L, tmp_bytes))
    out = fw.empty_f32(B * Hq * D)
    r = Recorder(dev, [q, kc, ks, vc, vs, fw.full_i32(B, L), fw.full_i32(B, 0), fw.empty_f32(tmp_bytes[0] // 4), out])
    b = r.bufs

    def record(n):
        for _ in range(n):
            check(lib.pyfa_flash_attn_vec_tq(r.enc, params, *(x.handle for x in b), ffi.NULL))
    return r, record, 2 * B * Hkv * L * (rb + 4), int(params.attn.nwg), out


def check_timing(gpu, iters, reps):
    fw = Frame()
    L = 32768
    # Each op as the buffer ABI records it (decode + reduce dispatches), then through its plan
    # (pyfa_*_plan_new / run: what decode_attention on torch tensors and the caches run).
    for planned in (False, True):
        for B, Hq, Hkv, D in [(1, 16, 8, 256), (1, 16, 8, 128), (8, 16, 8, 256), (8, 16, 8, 128)]:
            dr, drec, dbytes, dnwg = dense_recorder(gpu, fw, B, Hq, Hkv, D, L, planned)
            d_us = fw.timed(dr.commit, iters, reps, lambda: drec(iters))
            del dr
            tr, trec, tbytes, tnwg, out = tq_recorder(gpu, fw, B, Hq, Hkv, D, L, 4, planned)
            t_us = fw.timed(tr.commit, iters, reps, lambda: trec(iters))
            finite = bool(np.all(np.isfinite(np.asarray(out.cpu() if fw.name == "torch" else out.get()))))
            del tr
            ratio = d_us / t_us
            report(f"time{' plan' if planned else ''} B={B} H={Hq}/{Hkv} D={D} len={L}", finite,
                   f"dense f16 {d_us:.1f} us ({dbytes / d_us / 1e3:.0f} GB/s, nwg {dnwg}) | TQ-4 {t_us:.1f} us "
                   f"({tbytes / t_us / 1e3:.0f} GB/s of codes+scales, nwg {tnwg}) | speed-up {ratio:.2f}x "
                   f"(target >= 2x, aim 3x) [{fw.name}]")


def main():
    ap = argparse.ArgumentParser()
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--no-timing", action="store_true")
    only.add_argument("--timing-only", action="store_true", help="skip the codec and decode checks")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--device", default="cuda", help="backend under test (cpu: a dry run of the script)")
    args = ap.parse_args()
    gpu, cpu = pyfa.Device(args.device), pyfa.Device("cpu")
    print(f"device: {gpu.name}", flush=True)
    t0 = time.perf_counter()
    if not args.timing_only:
        check_codec(gpu, cpu)
        print(f"-- codec checks {time.perf_counter() - t0:.1f} s", flush=True)
        t1 = time.perf_counter()
        check_decode(gpu, cpu)
        print(f"-- decode checks {time.perf_counter() - t1:.1f} s", flush=True)
    if not args.no_timing:
        t2 = time.perf_counter()
        check_timing(gpu, args.iters, args.reps)
        print(f"-- timing {time.perf_counter() - t2:.1f} s", flush=True)
    print(f"{'FAILED: ' + ', '.join(FAILED) if FAILED else 'all checks passed'} ({time.perf_counter() - t0:.1f} s)")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
