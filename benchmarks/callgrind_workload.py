"""The fixed CPU-kernel workload that scripts/callgrind_gate.py counts under
valgrind --tool=callgrind.

Contract with the gate: each case's setup runs first; then the counters are
zeroed, the case's call runs, and a dump named after the case is written
(callgrind client requests in the library $PYFA_GATE_MARKER, which the gate
builds), and ``case <name>`` is printed in the same order; ``isa <name>``
says which kernel build ran. The gate collects only inside the CPU pool's
threadgroup loop (run_share: the kernels and what they call), so the counts
are the kernels' work, not Python's or the host code's.

The inputs are seeded and the pool runs on one thread (PYFA_NUM_THREADS=1,
set by the gate), so each case executes the same instructions every run.
Shapes are small: under callgrind the whole workload runs in seconds.

``--cases a,b`` runs a subset; ``--repeat-case NAME`` runs that case's call
twice in its segment (the gate's self-test: extra kernel work must fail).
"""
import argparse
import ctypes
import os
import re
import sys

import numpy as np

import pyfa


def _rng(name):
    return np.random.default_rng(sum(map(ord, name)))


def decode_f16_d128(cpu):
    """GQA decode, f32 q over an f16 cache (split-KV + reduce)."""
    r = _rng("decode_f16_d128")
    q = r.standard_normal((8, 128), dtype=np.float32)
    k, v = (r.standard_normal((2, 1024, 128), dtype=np.float32).astype(np.float16) for _ in range(2))
    return lambda: pyfa.decode_attention(q, k, v, kv_len=1000, device=cpu)


def decode_bf16_d256(cpu):
    """bf16 q and cache at head dim 256, with a window and softcap."""
    r = _rng("decode_bf16_d256")
    q = r.standard_normal((8, 256), dtype=np.float32).astype(pyfa.bfloat16)
    k, v = (r.standard_normal((2, 768, 256), dtype=np.float32).astype(pyfa.bfloat16) for _ in range(2))
    return lambda: pyfa.decode_attention(q, k, v, kv_len=768, window=512, softcap=30.0, device=cpu)


def prefill_causal_bf16_d128(cpu):
    r = _rng("prefill_causal_bf16_d128")
    q = r.standard_normal((1, 4, 192, 128), dtype=np.float32).astype(pyfa.bfloat16)
    k, v = (r.standard_normal((1, 2, 192, 128), dtype=np.float32).astype(pyfa.bfloat16) for _ in range(2))
    return lambda: pyfa.attention(q, k, v, causal=True, device=cpu)


def kv_append_f16(cpu):
    """256 f32 rows appended (converted) into an f16 dense cache."""
    r = _rng("kv_append_f16")
    rows = r.standard_normal((256, 2, 128), dtype=np.float32)
    cache = pyfa.KVCache(2, 128, 256, dtype=np.float16, sliding_window=256, device=cpu)
    return lambda: cache.append(rows, rows)


def tq_encode_d128(cpu):
    """TurboQuant 4-bit encode of 128 f16 rows (hadamard_quantize_kv)."""
    r = _rng("tq_encode_d128")
    rows = r.standard_normal((128, 2, 128), dtype=np.float32).astype(np.float16)
    cache = pyfa.TurboQuantKVCache(2, 128, 128, k_bits=4, v_bits=4, sliding_window=128, device=cpu)
    return lambda: cache.append(rows, rows)


def tq_decode_d128(cpu):
    """TurboQuant 4-bit decode over 768 positions (premult, vec_tq, reduce + undo)."""
    r = _rng("tq_decode_d128")
    rows = r.standard_normal((768, 2, 128), dtype=np.float32).astype(np.float16)
    cache = pyfa.TurboQuantKVCache(2, 128, 768, k_bits=4, v_bits=4, device=cpu)
    cache.append(rows, rows)  # before the case's marker: not counted in this case
    q = r.standard_normal((8, 128), dtype=np.float32)
    return lambda: cache.attend(q)


CASES = {f.__name__: f for f in (decode_f16_d128, decode_bf16_d256, prefill_causal_bf16_d128,
                                 kv_append_f16, tq_encode_d128, tq_decode_d128)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    ap.add_argument("--repeat-case", default=None, help="run this case's call twice (gate self-test)")
    args = ap.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names + ([args.repeat_case] if args.repeat_case else []) if n not in CASES]
    if unknown:
        sys.exit(f"callgrind_workload: unknown case(s) {unknown}; known: {list(CASES)}")
    if not os.environ.get("PYFA_GATE_MARKER"):
        sys.exit("callgrind_workload: run it through scripts/callgrind_gate.py ($PYFA_GATE_MARKER is not set)")
    marker = ctypes.CDLL(os.environ["PYFA_GATE_MARKER"])
    cpu = pyfa.Device("cpu")
    print("isa", re.search(r"(\w+) kernels", cpu.name).group(1), flush=True)
    for name in names:
        call = CASES[name](cpu)
        marker.pyfa_gate_zero()
        call()
        if name == args.repeat_case:
            call()
        marker.pyfa_gate_dump(name.encode())
        print(f"case {name}", flush=True)


if __name__ == "__main__":
    main()
