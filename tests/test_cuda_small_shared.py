"""The cuda plan on a GPU with less shared memory per block (RTX 30 / 40 series:
99 KB; A100: 163 KB) than Hopper's 227 KB: a tensor-core decode whose block does
not fit runs the vector kernel, and the TurboQuant decode its vector kernel at
such head dims, instead of failing to launch. PYFA_CUDA_MAX_SHARED makes this
GPU's plan choose as such a device would; each case runs in a subprocess (the
plan reads it once), names the dense decode kernels it launched (torch.profiler:
the variant is a function constant in the name) and checks its outputs. The
TurboQuant kernels share one name, so there only the result is checked.

Skips without the cuda backend or torch with CUDA, and on GPUs whose blocks
cannot hold the tensor-core decode at D = 256 (there the default plan already
runs the vector kernel).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pyfa
import tq_contract

if "cuda" not in pyfa.available_backends():
    pytest.skip("no CUDA device here", allow_module_level=True)
torch = pytest.importorskip("torch", reason="torch is not installed")
if pyfa.Device("cuda").max_threadgroup_memory < 207_104:  # attn_vec_mma.cuh's block at D = 256
    pytest.skip("this GPU's blocks hold less than the tensor-core decode at D = 256", allow_module_level=True)

SCRIPT = r"""
import json, sys
import numpy as np
import torch
import pyfa
from pyfa import reference
import tq_contract

dev = pyfa.Device("cuda")
rng = np.random.default_rng(0)
report = {"dense": {}, "variants": {}}
for D in (128, 256):
    q = rng.standard_normal((2, 16, D)).astype(np.float16)
    k = rng.standard_normal((2, 4, 300, D)).astype(np.float16)
    v = rng.standard_normal((2, 4, 300, D)).astype(np.float16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = pyfa.decode_attention(q, k, v, 290, out_dtype=np.float32, device=dev)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.name.startswith("flash_attn_vec__fc")}
    # constants: q dtype, kv dtype, D, softcap, direct, VARIANT, ...
    report["variants"][str(D)] = sorted({int(n.split("__fc")[1].split("_")[5]) for n in names})
    ref = reference.decode_attention(q, k, v, 290)
    report["dense"][str(D)] = float(np.abs(out - ref).max())
cache = pyfa.TurboQuantKVCache(2, 128, 64, k_bits=4, v_bits=4, device=dev)
cache.append(rng.standard_normal((40, 2, 128)).astype(np.float32), rng.standard_normal((40, 2, 128)).astype(np.float32))
tq_q = np.linspace(-1, 1, 8 * 128, dtype=np.float32).reshape(8, 128)
report["tq"] = np.asarray(cache.attend(tq_q)).tolist()
report["tq_refs"] = [r.tolist() for r in tq_contract.cache_references(cache, tq_q)]
print(json.dumps(report))
"""


def _run(env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYFA_CUDA_")}  # the plan's own choices
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(pyfa.__file__).resolve().parent.parent), str(Path(__file__).parent)] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_99_kb_plan_runs_the_vector_kernels_and_agrees():
    big = _run({})
    small = _run({"PYFA_CUDA_MAX_SHARED": "101376"})
    # On this GPU the tensor-core decode serves both head dims (GQA group 4); with
    # 99 KB per block it fits neither, and the vector kernel runs.
    assert big["variants"] == {"128": [1], "256": [1]}
    assert small["variants"] == {"128": [0], "256": [0]}
    for run in (big, small):
        for D, err in run["dense"].items():
            assert err < 2e-5, (D, err)  # exact kernels against float64 on the same f16 K/V (tests/test_cuda.py)
    # The TurboQuant decode: tensor-core and vector kernels read the same codes; each is within
    # 2e-5 of attention over the dequantized cache, with the f32 codebook or its f16 rounding
    # (tq_contract.py; the tensor-core kernel multiplies the latter).
    for run in (big, small):
        tq_contract.check(np.array(run["tq"], np.float32), [np.array(r) for r in run["tq_refs"]], tol=2e-5)
