"""The Hopper prefill's persistent blocks (flash_attn_prefill_persistent), which
serve unmasked rectangular calls at D 64 to 128. Where the plan's rule takes
them (D 80 to 128, more than one wave of blocks), the CUDA backend
launches one block an SM and each block runs a rank of every wave in turn:
the producer copies the next rank's query tile (into a second buffer) and
first K and V stages while the consumers finish the last rank.
PYFA_CUDA_PREFILL_PERSIST=N (N >= 2) runs every call the kernel serves in N
blocks, so small calls give each block many ranks (both Q buffers, the rings'
sequence running on across ranks, ranks without key tiles before and after
ranks with them); =0 launches the grid. Each run is a subprocess (the backend
reads the knobs once). A persistent block runs each rank's arithmetic as the
grid's block does, so its outputs and LSE must equal the grid launch's bit for
bit; both are checked against the float64 reference by test_prefill's rule.
With every tensor map the persistent kernel runs its body with the maps; with
PYFA_CUDA_PREFILL_TMA=kv (no map for q) or =0 (none) its body without them,
whose consumers copy every tile (the grid kernel then copies q alone, or every
tile).

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

# (D, dtype, B, H, Hkv, q_len, kv_len, layout, options): the head dims the kernel serves, both
# dtypes and layouts, GQA; a window, a soft cap, q_offset, f32 out; causal calls with more queries
# than keys (their first query tiles, the last ranks, have no key tile); a window whose last query
# tiles, the first ranks, see no key; a call of fewer ranks than the knob's blocks (the launch
# takes one block a rank).
CASES = [
    (128, "bfloat16", 2, 4, 2, 200, 333, "bhsd", {}),
    (128, "float16", 2, 4, 2, 200, 333, "bshd", {"causal": True}),
    (96, "bfloat16", 2, 4, 2, 200, 333, "bshd", {"causal": True, "window": 100}),
    (80, "float16", 2, 4, 2, 200, 333, "bhsd", {"softcap": 30.0}),
    (128, "bfloat16", 2, 4, 4, 620, 320, "bhsd", {"causal": True}),
    (96, "float16", 1, 6, 2, 300, 300, "bshd", {"causal": True, "q_offset": -50}),
    (128, "float16", 2, 4, 2, 200, 333, "bhsd", {"out_dtype": "float32"}),
    (80, "bfloat16", 1, 1, 1, 256, 256, "bshd", {"causal": True}),
    (128, "bfloat16", 2, 4, 2, 400, 333, "bhsd", {"causal": True, "window": 50, "q_offset": 233}),
    (64, "bfloat16", 2, 4, 2, 200, 333, "bhsd", {}),
    (64, "float16", 2, 6, 2, 500, 333, "bshd", {"causal": True}),
    (64, "bfloat16", 1, 4, 1, 400, 400, "bshd", {"causal": True, "window": 64, "softcap": 20.0}),
]
BLOCKS = 3

SCRIPT = r"""
import sys
import numpy as np
import pyfa
inputs = np.load(sys.argv[1])
dev = pyfa.Device("cuda")
outs = {}
before = pyfa.counters()["persistent_launches"]
for i, (layout, opts) in enumerate(eval(sys.argv[3])):
    q, k, v = (inputs[f"{n}{i}"] for n in "qkv")
    if q.dtype == np.uint16:  # bfloat16 travels as its bits
        q, k, v = (x.view(pyfa.bfloat16) for x in (q, k, v))
    if "out_dtype" in opts:
        opts = dict(opts, out_dtype=np.dtype(opts["out_dtype"]))
    out, lse = pyfa.attention(q, k, v, layout=layout, return_lse=True, device=dev, **opts)
    outs[f"out{i}"] = out.view(np.uint16) if out.dtype == pyfa.bfloat16 else out
    outs[f"lse{i}"] = lse
outs["persistent"] = np.array(pyfa.counters()["persistent_launches"] - before)
np.savez(sys.argv[2], **outs)
"""


def run(tmp_path, name, inputs, runs, **knobs):
    env = dict(os.environ, **knobs)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "in.npz"), str(tmp_path / f"{name}.npz"),
                           repr(runs)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(tmp_path / f"{name}.npz")


@pytest.mark.parametrize("tma", ["1", "kv", "0"])
def test_persistent_blocks_equal_the_grid_and_the_reference(tmp_path, tma):
    rng = np.random.default_rng(11)
    inputs, runs, arrays = {}, [], []
    for i, (D, dtype, B, H, Hkv, ql, kl, layout, opts) in enumerate(CASES):
        dt = pyfa.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
        q, k, v = make(rng, B, H, Hkv, ql, kl, D, dt, layout)
        for n, x in zip("qkv", (q, k, v)):
            inputs[f"{n}{i}"] = x.view(np.uint16) if dt == pyfa.bfloat16 else x
        runs.append((layout, opts))
        arrays.append((q, k, v))
    np.savez(tmp_path / "in.npz", **inputs)
    name = pyfa.Device("cuda").name
    if "sm_90a" not in name:
        pytest.skip(f"the persistent kernel runs on sm_90a only; this device: {name}")
    persistent = run(tmp_path, "persistent", inputs, runs, PYFA_CUDA_PREFILL_PERSIST=str(BLOCKS),
                     PYFA_CUDA_PREFILL_TMA=tma)
    grid = run(tmp_path, "grid", inputs, runs, PYFA_CUDA_PREFILL_PERSIST="0", PYFA_CUDA_PREFILL_TMA=tma)
    # Every call ran persistent blocks (the kernel serves them all), none with the knob at 0.
    assert int(persistent["persistent"]) == len(CASES)
    assert int(grid["persistent"]) == 0
    for i, (D, dtype, B, H, Hkv, ql, kl, layout, opts) in enumerate(CASES):
        assert np.array_equal(persistent[f"out{i}"], grid[f"out{i}"]), f"case {i}: out differs from the grid's"
        assert np.array_equal(persistent[f"lse{i}"], grid[f"lse{i}"], equal_nan=True), f"case {i}: lse differs"
        q, k, v = arrays[i]
        kw = {n: x for n, x in opts.items() if n != "out_dtype"}
        ref, ref_lse = reference.attention(q, k, v, layout=layout, return_lse=True, **kw)
        out_dt = np.dtype(opts.get("out_dtype", q.dtype))
        out = persistent[f"out{i}"].view(pyfa.bfloat16) if out_dt == pyfa.bfloat16 else persistent[f"out{i}"]
        check_close(out, ref, out_dt, in_dtype(q, k, v, layout=layout, **kw))
        check_lse(persistent[f"lse{i}"], ref_lse)


def test_the_rule_takes_persistent_blocks_past_one_wave():
    """Without the knob (cuda_layout.h, pyfa_cuda_prefill_persistent_pays): a call at D 80 to 128
    of more ranks than SMs runs persistent blocks, over any number of keys; one of fewer ranks, one
    at D 64 and a masked call do not. The inputs are numpy arrays, whose calls bind no key split
    (a plan's call of just over one wave over many key tiles may split its last wave's keys instead)."""
    dev = pyfa.Device("cuda")
    if "sm_90a" not in dev.name:
        pytest.skip(f"the persistent kernel runs on sm_90a only; this device: {dev.name}")
    knobs = [n for n in ("PYFA_CUDA_PREFILL_PERSIST", "PYFA_CUDA_PREFILL_WGMMA", "PYFA_CUDA_PREFILL_TMA")
             if n in os.environ]
    if knobs:
        pytest.skip(f"the plan's rule without knobs; set here: {knobs}")
    rng = np.random.default_rng(5)
    H, D = 8, 128
    ql = 128 * (dev.compute_units // H + 1)  # (ql / 128) * H ranks > compute_units
    q, k, v = make(rng, 1, H, H // 2, ql, ql, D, pyfa.bfloat16, "bshd")
    count = lambda: pyfa.counters()["persistent_launches"]  # noqa: E731
    before = count()
    out, lse = pyfa.attention(q, k, v, causal=True, layout="bshd", return_lse=True, device=dev)
    assert count() == before + 1
    ref, ref_lse = reference.attention(q, k, v, causal=True, layout="bshd", return_lse=True)
    check_close(out, ref, pyfa.bfloat16, in_dtype(q, k, v, causal=True, layout="bshd"))
    check_lse(lse, ref_lse)
    small = [x[:, :256] for x in (q, k, v)]  # 2 * 8 ranks
    pyfa.attention(*small, causal=True, layout="bshd", device=dev)
    mask = np.ones((ql, ql), dtype=bool)
    pyfa.attention(q, k, v, mask=mask, layout="bshd", device=dev)
    q64, k64, v64 = make(rng, 1, H, H // 2, 192 * (dev.compute_units // H + 1), 256, 64, pyfa.bfloat16, "bshd")
    pyfa.attention(q64, k64, v64, layout="bshd", device=dev)  # more ranks of 192 rows than SMs, at D 64
    assert count() == before + 1
    long_k = np.concatenate([k] * 4, axis=1)[:, :8193]  # 65 key tiles
    pyfa.attention(q, long_k, long_k, layout="bshd", device=dev)
    assert count() == before + 2
    pyfa.attention(*(x[..., :96].copy() for x in (q, k, v)), causal=True, layout="bshd", device=dev)
    assert count() == before + 3
