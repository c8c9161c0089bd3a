"""C-ABI fuzz harness: calls libpyfa's entry points with random parameter
structs (plausible ones, then a few fields replaced by edge values up to the
field's limits) and random buffers (sizes, dtypes, NULL), commits what
records, and checks that every call returns a status. The assertion is the
process surviving: run it in a subprocess (tests/test_fuzz_cabi.py does) so a
trap or a stray read is a failed test that names the seed and the call.

    python3 tests/fuzz_cabi.py --seed 1 --calls 2000 [--trace]

Each call is printed (with --trace) before it runs, so the last line of a dead
run is the call that killed it.
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from pyfa._native import ffi, lib  # noqa: E402

STATUSES = {lib.PYFA_OK, lib.PYFA_ERR_INVALID_ARGUMENT, lib.PYFA_ERR_UNSUPPORTED, lib.PYFA_ERR_OUT_OF_MEMORY,
            lib.PYFA_ERR_BACKEND_UNAVAILABLE, lib.PYFA_ERR_COMPILE, lib.PYFA_ERR_EXECUTION, lib.PYFA_ERR_INTERNAL}

HEAD_DIMS = [int(x) for x in ffi.string(lib.pyfa_supported(b"head_dims")).split(b",")]
TQ_HEAD_DIMS = [int(x) for x in ffi.string(lib.pyfa_supported(b"tq_head_dims")).split(b",")]
DTYPES = {lib.PYFA_DTYPE_F32: np.float32, lib.PYFA_DTYPE_F16: np.float16, lib.PYFA_DTYPE_U8: np.uint8,
          lib.PYFA_DTYPE_U32: np.uint32, lib.PYFA_DTYPE_I32: np.int32, lib.PYFA_DTYPE_BF16: np.uint16,
          lib.PYFA_DTYPE_U16: np.uint16}

U32_EDGES = [0, 1, 2, 3, 7, 8, 63, 64, 65, 255, 256, 1023, 1024, 1025, 65535, 65536, 2**30, 2**31 - 1, 2**31,
             2**32 - 2, 2**32 - 1]
I32_EDGES = [-2**31, -2**31 + 1, -65536, -1, 0, 1, 65536, 2**31 - 1]
I64_EDGES = [-2**63, -2**31, -1, 0, 1, 64, 2**31, 2**32, 2**62, 2**63 - 1]
F32_EDGES = [0.0, -0.0, 1.0, -1.0, 1e-45, 1e-30, 3.4e38, float("inf"), -float("inf"), float("nan"), 0.125, 30.0]


class Fuzzer:
    def __init__(self, seed: int, backend: str, trace: bool):
        self.rng = random.Random(seed)
        self.trace = trace
        out = ffi.new("pyfa_device **")
        assert lib.pyfa_device_new(out, backend.encode()) == lib.PYFA_OK, ffi.string(lib.pyfa_last_error())
        self.device = out[0]
        self.counts = {"calls": 0, "ok": 0, "errors": 0}

    # -- values ----------------------------------------------------------------------------------------
    def edge(self, ctype: str):
        r = self.rng
        if ctype == "float":
            return r.choice(F32_EDGES) if r.random() < 0.7 else r.uniform(-100, 100)
        if ctype == "int32_t":
            return r.choice(I32_EDGES) if r.random() < 0.7 else r.randint(-2**31, 2**31 - 1)
        if ctype == "int64_t":
            return r.choice(I64_EDGES) if r.random() < 0.7 else r.randint(-2**63, 2**63 - 1)
        return r.choice(U32_EDGES) if r.random() < 0.7 else r.randint(0, 2**32 - 1)

    def mutate(self, ctype_name: str, fields: dict) -> dict:
        """Replaces 0..3 fields (anywhere in the struct, array elements included) by edge values."""
        t = ffi.typeof(ctype_name)
        for _ in range(self.rng.choice([0, 1, 1, 2, 3])):
            path, ft = [], t
            while True:
                name, f = self.rng.choice(ft.fields)
                path.append(name)
                if f.type.kind == "struct":
                    ft = f.type
                    continue
                break
            target = fields
            for p in path[:-1]:
                target = target.setdefault(p, {})
            if f.type.kind == "array":
                arr = list(target.get(name, [0] * f.type.length))
                arr[self.rng.randrange(f.type.length)] = self.edge(f.type.item.cname)
                target[name] = arr
            else:
                target[name] = self.edge(f.type.cname)
        return fields

    def small(self, lo=1, hi=4):
        return self.rng.randint(lo, hi)

    # -- buffers ---------------------------------------------------------------------------------------
    def buffer(self, need: int, dtypes: list[int], fill=None):
        """A buffer of about ``need`` elements (sometimes fewer, sometimes another dtype, sometimes NULL)."""
        r = self.rng
        x = r.random()
        if x < 0.03:
            return ffi.NULL, None
        n = need if x < 0.8 else r.choice([0, 1, max(need - 1, 0), need * 2, r.randint(0, 4096)])
        n = min(n, 1 << 20)
        code = r.choice(dtypes) if r.random() < 0.9 else r.choice(list(DTYPES))
        a = np.zeros(n, DTYPES[code])
        if fill is not None and n:
            values = np.asarray(fill(n))
            with np.errstate(all="ignore"):  # wrapped into the buffer's dtype
                a[:] = (values if a.dtype.kind == "f" else values.astype(np.int64)).astype(a.dtype)
        elif a.dtype.kind == "f":
            a[:] = np.random.default_rng(r.getrandbits(32)).standard_normal(n)
        out = ffi.new("pyfa_buffer **")
        ptr = ffi.from_buffer(a) if n else ffi.NULL
        status = lib.pyfa_buffer_wrap(out, self.device, ptr, a.nbytes, code, 1, [n])
        self.check(status)
        if status != lib.PYFA_OK:
            return ffi.NULL, None
        self.owned.append((out[0], a))
        return out[0], a

    def lengths(self, n: int, cap: int):
        r = self.rng
        return lambda count: [r.choice([0, 1, cap, cap + 1, r.randint(0, max(cap, 1)), 2**31 - 1, 2**32 - 1])
                              if r.random() < 0.2 else r.randint(1, max(cap, 1)) for _ in range(count)]

    def check(self, status: int):
        assert status in STATUSES, f"unknown status {status}"
        if status != lib.PYFA_OK:
            ffi.string(lib.pyfa_last_error())  # readable after every failure

    # -- entry points ----------------------------------------------------------------------------------
    def vec_fields(self):
        r = self.rng
        Hkv = self.small(1, 2)
        return {"batch": self.small(1, 3), "num_heads": Hkv * self.small(1, 3), "num_kv_heads": Hkv,
                "head_dim": r.choice(HEAD_DIMS[:4]), "kv_capacity": self.small(1, 64), "nwg": r.choice([0, 1, 2, 5]),
                "window": r.choice([0, 0, self.small(1, 64)]), "scale": 0.125, "softcap": r.choice([0.0, 5.0])}

    def call_vec(self, tq: bool, mutate_after: bool):
        r = self.rng
        attn = self.vec_fields()
        if tq:
            attn["head_dim"] = r.choice(TQ_HEAD_DIMS[:2])
            fields = {"attn": attn, "k_bits": r.choice([2, 3, 4, 8]), "v_bits": r.choice([2, 3, 4, 8]),
                      "seed_lo": r.getrandbits(32), "seed_hi": r.getrandbits(32), "fused": r.choice([0, 1])}
            ctype = "pyfa_flash_attn_vec_tq_params"
        else:
            fields, ctype = attn, "pyfa_flash_attn_vec_params"
        fields = self.mutate(ctype, fields)
        entry = ("flash_attn_vec_tq" if tq else "flash_attn_vec") + ("+mutate" if mutate_after else "")
        p = ffi.new(ctype + " *", fields)
        a = p.attn if tq else p
        plan_tmp = ffi.new("uint64_t *")
        max_len = r.choice([0, 1, a.kv_capacity, r.getrandbits(32)])
        dtype = r.choice([lib.PYFA_DTYPE_F32, lib.PYFA_DTYPE_F16, lib.PYFA_DTYPE_BF16, 99])
        self.trace_call(entry + "_plan", fields, max_len=max_len, dtype=dtype)
        if tq:
            self.check(lib.pyfa_flash_attn_vec_tq_plan(self.device, p, max_len, plan_tmp))
        else:
            self.check(lib.pyfa_flash_attn_vec_plan(self.device, p, dtype, max_len, plan_tmp))
        B, H, Hkv, D, cap = a.batch, a.num_heads, a.num_kv_heads, a.head_dim, a.kv_capacity
        if B * H * D > 1 << 20 or B * Hkv * cap * D > 1 << 20:
            return  # sizes the buffers could not hold are the plan's to reject
        F = [lib.PYFA_DTYPE_F32, lib.PYFA_DTYPE_F16, lib.PYFA_DTYPE_BF16]
        q = self.buffer(B * H * D, F)
        if tq:
            kb, vb = p.k_bits % 16, p.v_bits % 16
            kv = [self.buffer(B * Hkv * cap * D * kb // 8, [lib.PYFA_DTYPE_U8]),
                  self.buffer(B * Hkv * cap, [lib.PYFA_DTYPE_F32]),
                  self.buffer(B * Hkv * cap * D * vb // 8, [lib.PYFA_DTYPE_U8]),
                  self.buffer(B * Hkv * cap, [lib.PYFA_DTYPE_F32])]
        else:
            kv = [self.buffer(B * Hkv * cap * D, F), self.buffer(B * Hkv * cap * D, F)]
        lens = self.buffer(B, [lib.PYFA_DTYPE_U32, lib.PYFA_DTYPE_I32], self.lengths(B, cap))
        rings = self.buffer(B, [lib.PYFA_DTYPE_U32, lib.PYFA_DTYPE_I32],
                            lambda n: [r.choice([0, 0, 0, cap - 1, cap, 2**31 - 1]) for _ in range(n)])
        tmp = self.buffer(min(int(plan_tmp[0]) // 4 + 1, 1 << 20), [lib.PYFA_DTYPE_F32])
        out = self.buffer(B * H * D, F)
        lse = self.buffer(B * H, [lib.PYFA_DTYPE_F32]) if r.random() < 0.5 else (ffi.NULL, None)
        bufs = [q, *kv, lens, rings, tmp, out, lse]
        handles = [b[0] for b in bufs]
        enc = self.encoder()
        self.trace_call(entry, fields, buffers=[0 if b[1] is None else b[1].size for b in bufs])
        fn = lib.pyfa_flash_attn_vec_tq if tq else lib.pyfa_flash_attn_vec
        status = fn(enc, p, *handles)
        self.check(status)
        if status == lib.PYFA_OK and mutate_after:
            for arr in (lens[1], rings[1]):
                if arr is not None and arr.size:
                    arr[r.randrange(arr.size)] = np.int64(r.choice([2**31 - 1, 2**30, 2**32 - 1])).astype(arr.dtype)
        self.finish(enc, status)

    def call_prefill(self):
        r = self.rng
        Hkv = self.small(1, 2)
        B, H, D, qL, kL = self.small(1, 2), Hkv * self.small(1, 2), r.choice(HEAD_DIMS[:3]), self.small(1, 9), \
            self.small(1, 20)

        def strides(h, s):
            return [h * s * D, s * D, D]
        mask_kind = r.choice([None, "2", "4"])
        fields = {"batch": B, "num_heads": H, "num_kv_heads": Hkv, "head_dim": D, "q_len": qL, "kv_len": kL,
                  "q_offset": kL - qL, "window": r.choice([0, 0, self.small(1, 20)]), "scale": 0.125,
                  "softcap": r.choice([0.0, 5.0]), "causal": r.choice([0, 1]),
                  "q_strides": strides(H, qL), "k_strides": strides(Hkv, kL), "v_strides": strides(Hkv, kL),
                  "out_strides": strides(H, qL),
                  "mask_strides": {None: [0, 0, 0], "2": [0, 0, kL], "4": [H * qL * kL, qL * kL, kL]}[mask_kind]}
        fields = self.mutate("pyfa_flash_attn_prefill_params", fields)
        p = ffi.new("pyfa_flash_attn_prefill_params *", fields)
        dtype = r.choice([lib.PYFA_DTYPE_F32, lib.PYFA_DTYPE_F16, lib.PYFA_DTYPE_BF16, lib.PYFA_DTYPE_U8])
        blk_bytes = ffi.new("uint64_t *")
        self.trace_call("flash_attn_prefill_plan", fields, dtype=dtype)
        self.check(lib.pyfa_flash_attn_prefill_plan(self.device, p, dtype, blk_bytes))
        F = [dtype if dtype in DTYPES and dtype != lib.PYFA_DTYPE_U8 else lib.PYFA_DTYPE_F32]
        n_q, n_k = B * H * qL * D, B * Hkv * kL * D
        if n_q > 1 << 20 or n_k > 1 << 20:
            return
        q, k, v = self.buffer(n_q, F), self.buffer(n_k, F), self.buffer(n_k, F)
        out = self.buffer(n_q, r.choice([F, [lib.PYFA_DTYPE_F32]]))
        mask = self.buffer({None: 0, "2": qL * kL, "4": B * H * qL * kL}[mask_kind], [lib.PYFA_DTYPE_U8] + F,
                           lambda n: [r.choice([0, 1]) for _ in range(n)]) if mask_kind else (ffi.NULL, None)
        blk = self.buffer(min(int(blk_bytes[0]) + 1, 1 << 20), [lib.PYFA_DTYPE_U8]) if r.random() < 0.5 \
            else (ffi.NULL, None)
        lse = self.buffer(B * H * qL, [lib.PYFA_DTYPE_F32]) if r.random() < 0.5 else (ffi.NULL, None)
        enc = self.encoder()
        self.trace_call("flash_attn_prefill", fields)
        status = lib.PYFA_OK
        if blk[0] != ffi.NULL:
            status = lib.pyfa_flash_attn_prefill_blk(enc, p, dtype, mask[0], blk[0])
            self.check(status)
        if status == lib.PYFA_OK:
            status = lib.pyfa_flash_attn_prefill(enc, p, q[0], k[0], v[0], mask[0], blk[0], out[0], lse[0])
            self.check(status)
        self.finish(enc, status)

    def call_packed_prefill(self, paged: bool, mutate_after: bool):
        """Varlen / paged prefill with metadata that is valid, near-valid or garbage; with mutate_after the
        metadata is rewritten with garbage after recording, so the kernels' clamps (not the host checks) meet it."""
        r = self.rng
        Hkv = self.small(1, 2)
        B, H, D = self.small(1, 3), Hkv * self.small(1, 2), r.choice(HEAD_DIMS[:3])
        q_lens = [self.small(0, 6) for _ in range(B)]
        q_lens[0] = max(q_lens[0], 1)
        k_lens = [n + self.small(0, 12) for n in q_lens]
        tq, tk = max(sum(q_lens), 1), max(sum(k_lens), 1)
        fields = {"batch": B, "num_heads": H, "num_kv_heads": Hkv, "head_dim": D, "q_len": max(max(q_lens), 1),
                  "kv_len": max(max(k_lens), 1), "window": r.choice([0, 0, self.small(1, 20)]), "scale": 0.125,
                  "softcap": r.choice([0.0, 5.0]), "causal": r.choice([0, 1]),
                  "q_strides": [0, D, H * D], "k_strides": [0, D, Hkv * D], "v_strides": [0, D, Hkv * D],
                  "out_strides": [0, D, H * D]}
        # One struct of three mutated at most (each mutation usually ends the call with an error).
        mutated = r.choice(["params", "packed", "pages", None, None, None])
        mut = lambda name, ctype, f: self.mutate(ctype, f) if mutated == name else f
        fields = mut("params", "pyfa_flash_attn_prefill_params", fields)
        p = ffi.new("pyfa_flash_attn_prefill_params *", fields)
        packed = ffi.new("pyfa_prefill_packed *", mut("packed", "pyfa_prefill_packed",
                                                      {"total_q": tq, "total_k": 0 if paged else tk}))
        F = [r.choice([lib.PYFA_DTYPE_F32, lib.PYFA_DTYPE_F16, lib.PYFA_DTYPE_BF16])]
        cu = lambda lens: np.concatenate([[0], np.cumsum(lens)]).tolist()
        garbage = lambda n: [r.choice(I32_EDGES + [0, 1, 3]) for _ in range(n)]
        meta = lambda values: self.buffer(len(values), [lib.PYFA_DTYPE_I32],
                                          (lambda n: (values + garbage(n))[:n]) if r.random() < 0.85 else garbage)
        q, out = self.buffer(tq * H * D, F), self.buffer(tq * H * D, r.choice([F, [lib.PYFA_DTYPE_F32]]))
        lse = self.buffer(H * tq, [lib.PYFA_DTYPE_F32]) if r.random() < 0.5 else (ffi.NULL, None)
        cq = meta(cu(q_lens))
        enc = self.encoder()
        if paged:
            ps = r.choice([1, 4, 16])
            pps = max(max((n + ps - 1) // ps for n in k_lens), 1)
            num_pages = B * pps + self.small(0, 2)
            pages = ffi.new("pyfa_kv_pages *", mut("pages", "pyfa_kv_pages", {
                "page_size": ps, "num_pages": num_pages, "pages_per_seq": pps, "layout": r.choice([0, 1])}))
            pool = num_pages * ps * Hkv * D
            if pool > 1 << 20:
                return
            k, v = self.buffer(pool, F), self.buffer(pool, F)
            lens = meta(k_lens)
            table = meta([r.randrange(num_pages) for _ in range(B * pps)])
            self.trace_call("flash_attn_prefill_paged", fields)
            status = lib.pyfa_flash_attn_prefill_paged(enc, p, packed, pages, q[0], k[0], v[0], cq[0], lens[0],
                                                       table[0], out[0], lse[0])
            mutable = [cq, lens, table]
        else:
            k, v = self.buffer(tk * Hkv * D, F), self.buffer(tk * Hkv * D, F)
            ck = meta(cu(k_lens))
            self.trace_call("flash_attn_prefill_varlen", fields)
            status = lib.pyfa_flash_attn_prefill_varlen(enc, p, packed, q[0], k[0], v[0], cq[0], ck[0], out[0],
                                                        lse[0])
            mutable = [cq, ck]
        self.check(status)
        if status == lib.PYFA_OK and mutate_after:
            for _, arr in mutable:
                if arr is not None and arr.size:
                    arr[r.randrange(arr.size)] = np.int64(r.choice(I32_EDGES)).astype(arr.dtype)
        self.finish(enc, status)

    def call_merge(self):
        r = self.rng
        B, H, L, D = self.small(1, 2), self.small(1, 3), self.small(1, 6), 8 * self.small(1, 16)
        fields = self.mutate("pyfa_merge_attn_params", {"batch": B, "num_heads": H, "seq_len": L, "head_dim": D,
                                                        "o_strides": [H * L * D, L * D, D]})
        p = ffi.new("pyfa_merge_attn_params *", fields)
        n = p.batch * p.num_heads * p.seq_len
        if n * max(p.head_dim, 1) > 1 << 20:
            n = 16
        F = [r.choice([lib.PYFA_DTYPE_F32, lib.PYFA_DTYPE_F16, lib.PYFA_DTYPE_BF16])]
        lse = lambda count: np.where(np.random.default_rng(r.getrandbits(32)).random(count) < 0.2, -np.inf, 1.0)
        bufs = [self.buffer(n * p.head_dim, F), self.buffer(n, [lib.PYFA_DTYPE_F32], lse),
                self.buffer(n * p.head_dim, F), self.buffer(n, [lib.PYFA_DTYPE_F32], lse),
                self.buffer(n * p.head_dim, r.choice([F, [lib.PYFA_DTYPE_F32]])),
                self.buffer(n, [lib.PYFA_DTYPE_F32]) if r.random() < 0.7 else (ffi.NULL, None)]
        enc = self.encoder()
        self.trace_call("merge_attention_states", fields)
        status = lib.pyfa_merge_attention_states(enc, p, *(b[0] for b in bufs))
        self.check(status)
        self.finish(enc, status)

    def call_tq_codec(self, which: str):
        r = self.rng
        Hkv, D, cap, bits = self.small(1, 2), r.choice(TQ_HEAD_DIMS[:2]), self.small(1, 32), r.choice([2, 3, 4, 8])
        n = self.small(1, cap)
        common = {"num_tokens": n, "num_kv_heads": Hkv, "head_dim": D, "kv_capacity": cap, "bits": bits,
                  "stream": r.choice([0, 1]), "seed_lo": r.getrandbits(32), "seed_hi": r.getrandbits(32),
                  "sequence": r.choice([0, 0, 1])}
        if which == "quantize":
            ctype, extra = "pyfa_tq_quantize_params", {"write_pos": r.randrange(cap), "norm_correction": r.choice([0, 1, 2])}
        elif which == "dequantize":
            ctype, extra = "pyfa_tq_dequantize_params", {"first_slot": r.randrange(cap)}
        else:
            ctype = "pyfa_tq_fwht_params"
            common = {"nrows": n, "head_dim": D, "transform": r.choice([0, 1, 2]), "stream": r.choice([0, 1]),
                      "seed_lo": r.getrandbits(32), "seed_hi": r.getrandbits(32)}
            extra = {}
        fields = self.mutate(ctype, {**common, **extra})
        p = ffi.new(ctype + " *", fields)
        F = [lib.PYFA_DTYPE_F32, lib.PYFA_DTYPE_F16, lib.PYFA_DTYPE_BF16]
        enc = self.encoder()
        self.trace_call(which, fields)
        if which == "fwht":
            rows = min(p.nrows * max(p.head_dim, 1), 1 << 20)
            status = lib.pyfa_fwht(enc, p, self.buffer(rows, F)[0], self.buffer(rows, [lib.PYFA_DTYPE_F32])[0])
        else:
            seqs = max(p.sequence + 1, 1) if p.sequence < 4 else 1
            cap_rows = min(seqs * p.num_kv_heads * p.kv_capacity, 1 << 16)
            codes = self.buffer(cap_rows * p.head_dim * (p.bits % 16) // 8, [lib.PYFA_DTYPE_U8])
            scales = self.buffer(cap_rows, [lib.PYFA_DTYPE_F32])
            rows = min(p.num_tokens * p.num_kv_heads * max(p.head_dim, 1), 1 << 20)
            if which == "quantize":
                status = lib.pyfa_hadamard_quantize_kv(enc, p, self.buffer(rows, F)[0], codes[0], scales[0])
            else:
                status = lib.pyfa_tq_dequantize_kv(enc, p, codes[0], scales[0],
                                                   self.buffer(rows, [lib.PYFA_DTYPE_F32])[0])
        self.check(status)
        self.finish(enc, status)

    def call_kv_append(self):
        r = self.rng
        cap = self.small(1, 32)
        fields = self.mutate("pyfa_kv_append_params", {
            "num_tokens": self.small(1, cap), "num_kv_heads": self.small(1, 3), "head_dim": self.small(1, 130),
            "kv_capacity": cap, "write_pos": r.randrange(cap), "sequence": r.choice([0, 0, 1])})
        p = ffi.new("pyfa_kv_append_params *", fields)
        F = [lib.PYFA_DTYPE_F32, lib.PYFA_DTYPE_F16, lib.PYFA_DTYPE_BF16]
        seqs = p.sequence + 1 if p.sequence < 4 else 1
        src = self.buffer(min(p.num_tokens * p.num_kv_heads * p.head_dim, 1 << 20), F)
        cache = self.buffer(min(seqs * p.num_kv_heads * p.kv_capacity * p.head_dim, 1 << 20), F)
        enc = self.encoder()
        self.trace_call("kv_append", fields)
        status = lib.pyfa_kv_append(enc, p, src[0], cache[0])
        self.check(status)
        self.finish(enc, status)

    def call_kv_append_plan(self, tq: bool):
        """pyfa_kv_append_plan_new / _run: a (mutated) ring-cache geometry, then a run over memory
        sized for the plan's fields or a little off, with num_tokens and write_pos at and past
        their edges."""
        r = self.rng
        cap = self.small(1, 24)
        F = [lib.PYFA_DTYPE_F32, lib.PYFA_DTYPE_F16, lib.PYFA_DTYPE_BF16]
        base = {"num_kv_heads": self.small(1, 3), "kv_capacity": cap, "k_dtype": r.choice(F), "v_dtype": r.choice(F)}
        if tq:
            base.update(head_dim=r.choice([64, 128]), cache_dtype=lib.PYFA_DTYPE_U8, k_bits=r.choice([2, 3, 4, 8]),
                        v_bits=r.choice([2, 3, 4, 8]), norm_correction=r.randint(0, 2), seed_lo=r.getrandbits(32))
        else:
            base.update(head_dim=self.small(1, 70), cache_dtype=r.choice(F))
        fields = self.mutate("pyfa_kv_append_plan_desc", base)
        self.trace_call("kv_append_plan_new", fields)
        out = ffi.new("pyfa_plan **")
        status = lib.pyfa_kv_append_plan_new(out, self.device, ffi.new("pyfa_kv_append_plan_desc *", fields))
        self.check(status)
        if status != lib.PYFA_OK:
            self.counts["errors"] += 1
            return
        plan = ffi.gc(out[0], lib.pyfa_plan_free)
        d = ffi.new("pyfa_kv_append_plan_desc *", fields)
        n = r.choice([0, 1, self.small(1, cap), cap, cap + 1])
        rows = min(max(n, 1) * d.num_kv_heads * d.head_dim, 1 << 18)
        slots = min(d.num_kv_heads * d.kv_capacity, 1 << 16)
        slack = r.choice([0, 0, 0, -1, 1])  # bytes too few or too many, sometimes
        keep = []  # the memory the run reads and writes (it finishes within this call)

        def tensor(t, elements, itemsize):
            a = np.zeros(max(elements * itemsize + slack, 1), np.uint8)
            keep.append(a)
            t.address, t.nbytes = int(ffi.cast("uintptr_t", ffi.from_buffer(a))), a.nbytes
        args = ffi.new("pyfa_kv_append_run_args *")
        tensor(args.k, rows, 4)
        tensor(args.v, rows, 4)
        if tq:
            for t, bits in ((args.k_cache, d.k_bits), (args.v_cache, d.v_bits)):
                tensor(t, slots * d.head_dim * (bits % 16) // 8, 1)
            tensor(args.k_scales, slots, 4)
            tensor(args.v_scales, slots, 4)
        else:
            tensor(args.k_cache, min(slots * d.head_dim, 1 << 20), 4)
            tensor(args.v_cache, min(slots * d.head_dim, 1 << 20), 4)
        args.num_tokens, args.write_pos = n, r.choice([0, r.randrange(cap), cap, 2**32 - 1])
        args.flags = r.choice([lib.PYFA_RUN_FINISH, lib.PYFA_RUN_FINISH, 0, 4])
        enc = self.encoder()
        self.trace_call("kv_append_run", {"num_tokens": n, "write_pos": args.write_pos, "flags": args.flags})
        status = lib.pyfa_kv_append_run(plan, enc, args)
        self.check(status)
        self.finish(enc, status)

    def call_paged_append(self, tq: bool):
        """kv_append_paged / tq_quantize_paged with pools sized for the (mutated) geometry, slot values
        mostly in the pool, some negative, outside it or repeated."""
        r = self.rng
        ps = r.choice([1, 2, 16])
        pages = {"page_size": ps, "num_pages": self.small(1, 4), "layout": r.choice([0, 1])}
        base = {"pages": pages, "num_tokens": self.small(1, 6), "num_kv_heads": self.small(1, 3)}
        if tq:
            base.update(head_dim=r.choice([64, 128]), k_bits=r.choice([2, 3, 4, 8]), v_bits=r.choice([2, 3, 4, 8]),
                        norm_correction=r.randint(0, 2), seed_lo=r.getrandbits(32), seed_hi=r.getrandbits(32))
        else:
            base.update(head_dim=self.small(1, 70))
        ctype = "pyfa_tq_quantize_paged_params" if tq else "pyfa_kv_append_paged_params"
        fields = self.mutate(ctype, base)
        p = ffi.new(ctype + " *", fields)
        F = [lib.PYFA_DTYPE_F32, lib.PYFA_DTYPE_F16, lib.PYFA_DTYPE_BF16]
        rows = min(p.pages.num_pages * p.pages.page_size * p.num_kv_heads, 1 << 16)
        n = min(p.num_tokens, 1 << 12)
        src = [self.buffer(min(n * p.num_kv_heads * max(p.head_dim, 1), 1 << 20), F) for _ in range(2)]
        slots_total = min(max(p.pages.num_pages * p.pages.page_size, 1), 2**31 - 1)

        def slot_values(m):  # distinct slots and padding, sometimes one value outside the pool or repeated
            v = r.sample(range(slots_total), min(m, slots_total)) + [-1] * max(m - slots_total, 0)
            if m and r.random() < 0.3:
                v[r.randrange(m)] = r.choice([slots_total, 2**31 - 1, -2**31, v[0]])
            return v

        slots = self.buffer(n, [lib.PYFA_DTYPE_I32], fill=slot_values)
        enc = self.encoder()
        self.trace_call("tq_quantize_paged" if tq else "kv_append_paged", fields)
        if tq:
            codes = [self.buffer(min(rows * p.head_dim * (b % 16) // 8, 1 << 20), [lib.PYFA_DTYPE_U8])
                     for b in (p.k_bits, p.v_bits)]
            scales = [self.buffer(rows, [lib.PYFA_DTYPE_F32]) for _ in range(2)]
            status = lib.pyfa_tq_quantize_paged(enc, p, src[0][0], src[1][0], codes[0][0], scales[0][0], codes[1][0],
                                                scales[1][0], slots[0])
        else:
            pools = [self.buffer(min(rows * max(p.head_dim, 1), 1 << 20), F) for _ in range(2)]
            status = lib.pyfa_kv_append_paged(enc, p, src[0][0], src[1][0], pools[0][0], pools[1][0], slots[0])
        self.check(status)
        self.finish(enc, status)

    def call_buffer_io(self):
        r = self.rng
        code = r.choice(list(DTYPES) + [0, 42, -1])
        shape = [r.choice([0, 1, 3, 64, -1, 2**31, 2**40, 2**62]) for _ in range(r.randint(0, 3))]
        self.trace_call("buffer_new", {"dtype": code, "shape": shape})
        out = ffi.new("pyfa_buffer **")
        total = math.prod(shape) if shape else 1
        if total < 0 or total > 1 << 22:  # the library rejects it, or it would really allocate it
            status = lib.pyfa_buffer_new(out, self.device, code, len(shape), shape, r.choice([0, 1, 7])) \
                if any(s < 0 for s in shape) or total > 2**62 else lib.PYFA_ERR_INVALID_ARGUMENT
            self.check(status)
            if status == lib.PYFA_OK:
                lib.pyfa_buffer_free(out[0])
            return
        status = lib.pyfa_buffer_new(out, self.device, code, len(shape), shape, r.choice([0, 1, 7]))
        self.check(status)
        if status != lib.PYFA_OK:
            return
        buf = out[0]
        host = ffi.new("char[]", 256)
        for _ in range(3):
            offset = r.choice([0, 1, 8, 2**63 - 1, 2**64 - 1, r.randint(0, 512)])
            nbytes = r.choice([0, 1, 16, 256, 2**64 - 1, 2**63])
            nbytes_ok = min(nbytes, 256)
            self.check(r.choice([lib.pyfa_buffer_read, lib.pyfa_buffer_write])(buf, offset, host, nbytes_ok))
        lib.pyfa_buffer_free(buf)

    # -- driver ----------------------------------------------------------------------------------------
    def encoder(self):
        out = ffi.new("pyfa_encoder **")
        assert lib.pyfa_encoder_new(out, self.device) == lib.PYFA_OK
        self.encoders.append(out[0])
        return out[0]

    def finish(self, enc, status):
        if status == lib.PYFA_OK:
            self.counts["ok"] += 1
        else:
            self.counts["errors"] += 1
        self.check(lib.pyfa_encoder_commit(enc))
        self.check(lib.pyfa_encoder_wait(enc))

    def trace_call(self, entry: str, fields: dict, **extra):
        if self.trace:
            print(f"CALL {entry} {fields} {extra}", flush=True)

    def run(self, calls: int):
        entries = [lambda: self.call_vec(False, False), lambda: self.call_vec(True, False),
                   lambda: self.call_vec(False, True), lambda: self.call_vec(True, True),
                   self.call_prefill, self.call_merge,
                   lambda: self.call_packed_prefill(False, False), lambda: self.call_packed_prefill(True, False),
                   lambda: self.call_packed_prefill(False, True), lambda: self.call_packed_prefill(True, True), lambda: self.call_tq_codec("quantize"),
                   lambda: self.call_tq_codec("dequantize"), lambda: self.call_tq_codec("fwht"), self.call_kv_append,
                   self.call_buffer_io, lambda: self.call_paged_append(False), lambda: self.call_paged_append(True),
                   lambda: self.call_kv_append_plan(False), lambda: self.call_kv_append_plan(True)]
        for _ in range(calls):
            self.owned, self.encoders = [], []
            self.counts["calls"] += 1
            self.rng.choice(entries)()
            for enc in self.encoders:
                lib.pyfa_encoder_free(enc)
            for buf, _ in self.owned:
                lib.pyfa_buffer_free(buf)
        lib.pyfa_device_free(self.device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=0, help="run seeds seed, seed+1, ... until this much time has passed")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--trace", action="store_true", help="print every call before it runs")
    args = ap.parse_args()
    start, seed, totals = time.monotonic(), args.seed, {}
    while True:
        print(f"SEED {seed}", flush=True)
        f = Fuzzer(seed, args.backend, args.trace)
        f.run(args.calls)
        for k, v in f.counts.items():
            totals[k] = totals.get(k, 0) + v
        seed += 1
        if time.monotonic() - start >= args.seconds:
            break
    print("RESULT " + " ".join(f"{k}={v}" for k, v in totals.items()) + " crashes=0", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
