"""The Hopper prefill without its TMA copies. In rectangular mode the CUDA
backend builds tensor maps at launch for K and V (from D 64) and q (from
D 80, and at D 64 in causal calls): the kernel's producer warpgroup copies
the K and V stages by TMA, and one thread the query tile. Where K's or V's
map cannot be built (a driver without cuTensorMapEncodeTiled, a tensor TMA
cannot view) the same launch copies the stages with the consumers' cp.async
instead, the producer idle; where q's alone cannot, the consumers copy Q into
the layout TMA would have written.
PYFA_CUDA_PREFILL_TMA=0 makes the backend build no map, =kv no map for q, so
those paths run here: each case runs in a subprocess (the backend reads the
knob once) and is checked against the float64 reference by test_prefill's rule.

Skips without the cuda backend.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pyfa
from pyfa import reference
from test_prefill import check_close, check_lse, in_dtype, make

if "cuda" not in pyfa.available_backends():
    pytest.skip("no CUDA device here", allow_module_level=True)

B, H, HKV, QL, KL = 2, 4, 2, 200, 333
# (D, dtype, causal, window, layout, q_len, kv_len): every head dim with TMA stages, both dtypes
# and layouts; then causal calls with 300 more queries than keys, whose first query tiles have no
# key tile (the consumers' copies of Q cross warpgroups, and such a block stores its zero rows
# over them: test_prefill.test_query_tiles_without_keys with q's map).
CASES = [
    (64, "bfloat16", True, None, "bshd", QL, KL),
    (64, "float16", False, None, "bhsd", QL, KL),
    (80, "float16", False, None, "bhsd", QL, KL),
    (96, "bfloat16", True, None, "bshd", QL, KL),
    (128, "float16", False, None, "bhsd", QL, KL),
    (128, "bfloat16", True, 100, "bshd", QL, KL),
    (192, "float16", True, None, "bhsd", QL, KL),
    (256, "bfloat16", False, None, "bshd", QL, KL),
    (64, "bfloat16", True, None, "bhsd", 620, 320),
    (128, "float16", True, None, "bshd", 620, 320),
]

SCRIPT = r"""
import sys
import numpy as np
import pyfa
inputs = np.load(sys.argv[1])
dev = pyfa.Device("cuda")
outs = {}
for i, (causal, window, layout) in enumerate(eval(sys.argv[3])):
    q, k, v = (inputs[f"{n}{i}"] for n in "qkv")
    if q.dtype == np.uint16:  # bfloat16 travels as its bits
        q, k, v = (x.view(pyfa.bfloat16) for x in (q, k, v))
    out, lse = pyfa.attention(q, k, v, causal=causal, window=window, layout=layout, return_lse=True, device=dev)
    outs[f"out{i}"] = out.view(np.uint16) if out.dtype == pyfa.bfloat16 else out
    outs[f"lse{i}"] = lse
np.savez(sys.argv[2], **outs)
"""


@pytest.mark.parametrize("knob", ["0", "kv"])
def test_prefill_without_tma_copies(tmp_path, knob):
    rng = np.random.default_rng(7)
    inputs, runs = {}, []
    for i, (D, dtype, causal, window, layout, ql, kl) in enumerate(CASES):
        dt = pyfa.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
        q, k, v = make(rng, B, H, HKV, ql, kl, D, dt, layout)
        for n, x in zip("qkv", (q, k, v)):
            inputs[f"{n}{i}"] = x.view(np.uint16) if dt == pyfa.bfloat16 else x
        runs.append((causal, window, layout))
    np.savez(tmp_path / "in.npz", **inputs)
    env = dict(os.environ, PYFA_CUDA_PREFILL_TMA=knob)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "in.npz"), str(tmp_path / "out.npz"), repr(runs)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    for i, (D, dtype, causal, window, layout, ql, kl) in enumerate(CASES):
        dt = pyfa.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
        q, k, v = (inputs[f"{n}{i}"].view(dt) for n in "qkv")
        kw = dict(causal=causal, window=window, layout=layout)
        ref, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
        out = got[f"out{i}"].view(dt) if dt == pyfa.bfloat16 else got[f"out{i}"]
        check_close(out, ref, dt, in_dtype(q, k, v, **kw))
        check_lse(got[f"lse{i}"], ref_lse)
