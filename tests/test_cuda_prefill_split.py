"""Key-split prefill blocks (CUDA, Hopper). Where a rectangular prefill's
blocks leave SMs idle (a grid smaller than the GPU: few heads, or few query
rows over many keys, as speculative decoding's verification; or a last wave
the split fills), the plan splits each block of the last wave over its key
tiles: every part leaves its unnormalised state in the plan's workspace, and
the last part of a block to finish merges them (flash_attn_prefill_params.h,
pyfa_prefill_split; cuda_layout.h, pyfa_cuda_prefill_split_parts).

Checked here, on torch CUDA tensors (the calls that run through plans):

- with every block split (PYFA_CUDA_PREFILL_SPLIT=2, 3 or 5, in a subprocess:
  the backend reads the knob once), each output and LSE is within
  test_prefill's bound of the float64 reference, over the head dims of the
  kernels that split (64 to 128), causal with a q_offset, a window, a soft
  cap, GQA, two sequences, partial query tiles, parts with no key tile
  (5 parts of 3 tiles) and f32 out; a second call, into an output filled
  with NaN, gives the same bits (the tickets come back to zero, so its parts
  merge again);
- which calls split (``pyfa.counters()["split_launches"]``): not masked
  calls, D 192 and up, D = 512, f32;
- the default rule, against cuda_layout.h's model written again here: few
  query rows over a long cache, a grid of few heads, a grid of a whole wave
  and 8 more blocks (split ones after whole ones: first_rank > 0), and a
  16-head 4K grid that it leaves whole, each within bound.

Skips without a CUDA device of compute capability 9.0 (the kernels that split
are sm_90a's) or without torch, and where the environment turns the split or
those kernels off.
"""
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pyfa
from pyfa import reference
from test_prefill import case_inputs, check_close, check_lse, in_dtype, make

if "cuda" not in pyfa.available_backends():
    pytest.skip("no CUDA device here", allow_module_level=True)
if "(sm_90" not in pyfa.Device("cuda").name:  # the library's name for the device carries its target
    pytest.skip("key-split prefill: sm_90 only", allow_module_level=True)
torch = pytest.importorskip("torch", reason="torch is not installed (the split is a plan's: GPU arrays)")
for _knob in ("PYFA_CUDA_PREFILL_SPLIT", "PYFA_CUDA_PREFILL_WGMMA"):
    if os.environ.get(_knob, "").strip().lower() in ("0", "off", "false", "no"):
        pytest.skip(f"{_knob} turns the split off here", allow_module_level=True)

# (D, dtype, H, HKV, q_len, kv_len, layout, options, splits): options as pyfa.attention's, plus
# "mask" and "out_dtype"; splits: whether the call's blocks split when the knob forces it.
CASES = [
    (64, "bfloat16", 4, 2, 400, 1500, "bhsd", {}, True),
    (64, "float16", 4, 2, 400, 1500, "bshd", {"causal": True}, True),
    (80, "bfloat16", 4, 4, 200, 900, "bhsd", {}, True),
    (96, "float16", 6, 2, 200, 900, "bshd", {"window": 300}, True),
    (128, "bfloat16", 8, 2, 300, 1100, "bhsd", {}, True),
    (128, "float16", 4, 2, 257, 900, "bshd", {"causal": True, "q_offset": 700}, True),
    (128, "bfloat16", 4, 2, 200, 700, "bhsd", {"softcap": 20.0}, True),
    (128, "bfloat16", 4, 2, 200, 300, "bhsd", {}, True),  # 3 key tiles: with 5 parts two are empty
    (128, "float16", 4, 2, 200, 1000, "bhsd", {"out_dtype": np.float32}, True),
    (128, "bfloat16", 8, 2, 8, 3000, "bhsd", {"causal": True}, True),  # 8 query rows over a long cache
    (192, "bfloat16", 4, 2, 300, 1300, "bshd", {"causal": True}, False),
    (256, "float16", 4, 2, 130, 1000, "bhsd", {}, False),
    (128, "bfloat16", 4, 2, 200, 700, "bhsd", {"mask": "bool"}, False),
    (512, "bfloat16", 4, 2, 130, 300, "bhsd", {}, False),
    (128, "float32", 4, 2, 100, 300, "bhsd", {}, False),
]
B = 2


def _inputs():
    return case_inputs(np.random.default_rng(17), CASES, B)


def _torch(a):
    """A numpy array (bfloat16 through ml_dtypes) as a torch CUDA tensor."""
    if a.dtype == pyfa.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(a).cuda()


def _numpy(t):
    t = t.cpu()
    return t.view(torch.int16).numpy().view(pyfa.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()


def _call(q, k, v, layout, opts, device, nan_out=False):
    """pyfa.attention on torch CUDA copies of the inputs; (out, lse) as numpy arrays. ``nan_out``:
    into an output filled with NaN first, so that rows the call leaves unwritten show."""
    opts = {n: (_torch(o) if n == "mask" else o) for n, o in opts.items()}
    tq = _torch(q)
    if nan_out:
        dtype = torch.float32 if opts.get("out_dtype") == np.float32 else tq.dtype
        opts["out"] = torch.full(tq.shape, float("nan"), dtype=dtype, device=tq.device)
    out, lse = pyfa.attention(tq, _torch(k), _torch(v), layout=layout, return_lse=True, device=device, **opts)
    return _numpy(out), _numpy(lse)


SCRIPT = r"""
import pickle, sys
import numpy as np
import pyfa
sys.path.insert(0, sys.argv[2])
import test_cuda_prefill_split as t
dev = pyfa.Device("cuda")
outs = []
for q, k, v, layout, opts, _ in t._inputs():
    before = pyfa.counters()["split_launches"]
    first = tuple(np.asarray(x) for x in t._call(q, k, v, layout, opts, dev))
    split = pyfa.counters()["split_launches"] - before
    again = tuple(np.asarray(x) for x in t._call(q, k, v, layout, opts, dev, nan_out=True))
    same = all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(first, again))
    outs.append((first, split, same))
with open(sys.argv[1], "wb") as f:
    pickle.dump(outs, f)
"""


def _label(i, opts):
    return CASES[i][:7], {n: o for n, o in opts.items() if n != "mask"}


@pytest.mark.parametrize("parts", [2, 3, 5])
def test_every_block_split_matches_the_reference(tmp_path, parts):
    cases = _inputs()
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYFA_CUDA_PREFILL_SPLIT=str(parts))
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent), str(here), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "split.pkl"), str(here)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "split.pkl", "rb") as f:
        results = pickle.load(f)
    for i, ((q, k, v, layout, opts, splits), ((out, lse), launched, same)) in enumerate(zip(cases, results)):
        label = _label(i, opts)
        assert launched == (1 if splits else 0), (label, launched)
        assert same, ("a second call gave other bits", label)
        kw = {n: o for n, o in opts.items() if n != "out_dtype"}
        ref, r_lse = reference.attention(q, k, v, layout=layout, return_lse=True, **kw)
        check_close(out, ref, out.dtype if out.dtype == np.float32 else q.dtype,
                    in_dtype(q, k, v, layout=layout, **kw))
        check_lse(lse, r_lse)


def _split_parts(blocks, slots, key_tiles):
    """cuda_layout.h's pyfa_cuda_prefill_split_parts, written again."""
    if slots == 0 or blocks % slots == 0:
        return 0
    waves, rest = divmod(blocks, slots)
    whole = (waves + 1) * key_tiles
    best, parts = whole, 0
    s = 2
    while s <= 16 and key_tiles // s >= 4:
        rounds = -(-rest * s // slots)
        t = waves * key_tiles + rounds * (-(-key_tiles // s) + 4) + 2
        if t < best:
            best, parts = t, s
        s += 1
    return parts if 20 * best <= 19 * whole else 0


# (H, HKV, q_len, kv_len, D, causal, key tiles a block visits, parts on 132 SMs): the rule's cases;
# tiles as the plan counts them (128 keys at D 64 and 128; with one query tile under causal masking,
# those up to its last row).
RULE_CASES = [
    (32, 8, 8, 4096, 128, True, 32, 4),    # speculative decoding's verification: 32 blocks
    (4, 2, 2048, 2048, 64, False, 16, 3),  # 44 blocks of 192 rows
    (16, 8, 4096, 4096, 64, False, 32, 0),  # 352 blocks: the model leaves it whole
    (16, 8, 2048, 2048, 128, True, 16, 0),  # several query tiles under causal masking: never split
    (140, 35, 8, 4096, 128, True, 32, 8),  # 140 blocks: a whole wave, then 8 blocks in 8 parts each
]


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda c: f"H{c[0]}x{c[1]}-q{c[2]}-kv{c[3]}-D{c[4]}-causal{int(c[5])}")
def test_the_rule(case):
    if os.environ.get("PYFA_CUDA_PREFILL_SPLIT", "").strip():
        pytest.skip("PYFA_CUDA_PREFILL_SPLIT overrides the rule here")
    H, HKV, q_len, kv_len, D, causal, tiles, parts_on_132 = case
    dev = pyfa.Device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q_tiles = -(-q_len // (192 if D == 64 else 128))
    expected = 0 if causal and q_tiles > 1 else _split_parts(q_tiles * H, sms, tiles)
    if sms == 132:
        assert expected == parts_on_132
    rng = np.random.default_rng(5)
    q, k, v = make(rng, 1, H, HKV, q_len, kv_len, D, pyfa.bfloat16, "bhsd")
    before = pyfa.counters()["split_launches"]
    out, lse = _call(q, k, v, "bhsd", {"causal": causal}, dev)
    launched = pyfa.counters()["split_launches"] - before
    assert launched == (1 if expected else 0), (sms, expected, launched)
    ref, r_lse = reference.attention(q, k, v, layout="bhsd", causal=causal, return_lse=True)
    check_close(out, ref, q.dtype, in_dtype(q, k, v, layout="bhsd", causal=causal))
    check_lse(lse, r_lse)
