"""Clusters of two query heads' blocks (CUDA, Hopper). Where the query heads
per KV head are even, the Hopper prefill at D 192 and 256 launches the blocks
of one query tile of two heads of one KV head as a cluster of 2
(co-scheduled; each copies its own tiles), and the kernel reads its place in
the launch order from the cluster (tile_slot in attn_prefill.cu).

Checked here, for the head dims that cluster (192, 256) and the options that
change which key tiles a block visits (causal with a q_offset, a window, a
mask with and without blk), and for calls the rule leaves alone (odd query
heads per KV head, other head dims):

- which calls launch clusters (``pyfa.counters()["cluster_launches"]``);
- that each output and LSE is bit-identical to the same call with every block
  alone (PYFA_CUDA_PREFILL_CLUSTER=0, in a subprocess: the backend reads the
  knob once): a block's work does not depend on how it was launched, so a
  wrong slot from the cluster order would show as a difference;
- that each is within test_prefill's bound of the float64 reference.

Two sequences, so that a slot mapping crossing sequences would show. Skips
without a CUDA device of compute capability 9.0 (the kernel that clusters is
sm_90a's), and where the environment turns clusters or that kernel off.
"""
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pyfa
from pyfa import prefill, reference
from test_prefill import case_inputs, check_close, check_lse, in_dtype

if "cuda" not in pyfa.available_backends():
    pytest.skip("no CUDA device here", allow_module_level=True)
if "(sm_90" not in pyfa.Device("cuda").name:  # the library's name for the device carries its target
    pytest.skip("clusters of the prefill: sm_90 only", allow_module_level=True)

# (D, dtype, H, HKV, q_len, kv_len, layout, options, pairs): options as pyfa.attention's, plus
# "mask" ("bool" / "additive") and "use_blk"; pairs: whether the call launches a cluster.
CASES = [
    (256, "bfloat16", 4, 2, 300, 1100, "bhsd", {}, True),
    (256, "float16", 8, 2, 300, 1100, "bshd", {"causal": True}, True),
    (256, "bfloat16", 4, 2, 257, 900, "bshd", {"causal": True, "q_offset": 700}, True),
    (256, "float16", 4, 2, 200, 1000, "bhsd", {"window": 300}, True),
    (256, "bfloat16", 4, 2, 200, 600, "bhsd", {"softcap": 20.0}, True),
    (256, "bfloat16", 4, 2, 200, 700, "bhsd", {"mask": "bool", "use_blk": False}, True),
    (256, "float16", 4, 2, 200, 700, "bhsd", {"mask": "additive", "use_blk": True}, True),
    (192, "bfloat16", 8, 4, 300, 1300, "bshd", {"causal": True}, True),
    (192, "float16", 4, 2, 130, 1000, "bhsd", {}, True),
    (256, "float16", 2, 1, 200, 500, "bhsd", {"causal": True}, True),
    (256, "bfloat16", 3, 1, 200, 700, "bhsd", {}, False),
    (256, "float16", 6, 2, 200, 700, "bhsd", {"causal": True}, False),
    (128, "bfloat16", 4, 2, 200, 700, "bhsd", {}, False),
    (64, "float16", 4, 2, 200, 700, "bshd", {"causal": True}, False),
    (512, "bfloat16", 4, 2, 130, 300, "bhsd", {}, False),
]
B = 2


def _inputs():
    return case_inputs(np.random.default_rng(11), CASES, B)


def _call(q, k, v, layout, opts, device):
    opts = dict(opts)
    use_blk = opts.pop("use_blk", None)
    kw = dict(scale=None, causal=False, q_offset=None, mask=None, window=None, softcap=0.0)
    kw.update(opts)
    return prefill._attention(q, k, v, layout=layout, return_lse=True, device=device, out=None, use_blk=use_blk, **kw)


SCRIPT = r"""
import pickle, sys
import numpy as np
import pyfa
sys.path.insert(0, sys.argv[2])
import test_cuda_prefill_cluster as t
dev = pyfa.Device("cuda")
before = pyfa.counters()["cluster_launches"]
outs = [tuple(np.asarray(x) for x in t._call(q, k, v, layout, opts, dev)) for q, k, v, layout, opts, _ in t._inputs()]
with open(sys.argv[1], "wb") as f:
    pickle.dump((outs, pyfa.counters()["cluster_launches"] - before), f)
"""


def test_paired_heads_match_lone_blocks(tmp_path):
    for knob in ("PYFA_CUDA_PREFILL_CLUSTER", "PYFA_CUDA_PREFILL_WGMMA"):  # (the subprocess imports this module with one)
        if os.environ.get(knob, "").strip().lower() in ("0", "off", "false", "no"):
            pytest.skip(f"{knob} turns the clustered kernel off here")
    dev = pyfa.Device("cuda")
    cases = _inputs()
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYFA_CUDA_PREFILL_CLUSTER="0")
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent), str(here), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "alone.pkl"), str(here)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "alone.pkl", "rb") as f:
        alone, alone_clusters = pickle.load(f)
    assert alone_clusters == 0, "PYFA_CUDA_PREFILL_CLUSTER=0 still launched clusters"
    for i, (q, k, v, layout, opts, pairs) in enumerate(cases):
        before = pyfa.counters()["cluster_launches"]
        out, lse = _call(q, k, v, layout, opts, dev)
        launched = pyfa.counters()["cluster_launches"] - before
        label = (CASES[i][:7], {n: o for n, o in opts.items() if n != "mask"})
        assert launched == (1 if pairs else 0), (label, launched)
        ref_out, ref_lse = alone[i]
        assert np.array_equal(out.view(np.uint16), ref_out.view(np.uint16)), label
        assert np.array_equal(lse, ref_lse, equal_nan=True), label
        kw = {n: o for n, o in opts.items() if n != "use_blk"}
        ref, r_lse = reference.attention(q, k, v, layout=layout, return_lse=True, **kw)
        check_close(out, ref, q.dtype, in_dtype(q, k, v, layout=layout, **kw))
        check_lse(lse, r_lse)
