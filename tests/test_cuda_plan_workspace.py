"""A plan's run given its own workspace (pyfa.h: how a caller runs one plan on several streams at
once) leaves out what counts on the plan's own tickets, which one run at a time uses:

- a split decode then ends with its reduce dispatch instead of merging in its last workgroups
  (two launches instead of one), with the same bits;
- a prefill runs its blocks whole instead of split over their keys (no split launch), within the
  same bound of the float64 reference.

Runs of the C ABI's plans on torch CUDA memory. Skips without the cuda backend or torch, and
where this GPU's plan neither merges the decode's split nor splits the prefill.
"""
import numpy as np
import pytest

import pyfa
from pyfa import _plans, reference
from pyfa._native import ffi, lib
from test_prefill import check_close, check_lse, in_dtype

if "cuda" not in pyfa.available_backends():
    pytest.skip("no CUDA device here", allow_module_level=True)
torch = pytest.importorskip("torch", reason="torch is not installed")


def _tensor(field, t):
    field.address = t.data_ptr()
    field.nbytes = t.numel() * t.element_size()


def _workspace(plan):
    n = ffi.new("uint64_t *")
    assert lib.pyfa_plan_workspace_bytes(plan, n) == lib.PYFA_OK
    return torch.empty(max(1, int(n[0])), dtype=torch.uint8, device="cuda")


def _run(dev, runner, plan, args):
    """Runs `args` on torch's current stream; the counters it moved."""
    enc = _plans.encoder(dev, torch.cuda.current_stream().cuda_stream)
    before = pyfa.counters()
    _plans.run(dev, runner, plan, enc, args)
    torch.cuda.synchronize()
    after = pyfa.counters()
    return {name: after[name] - before[name] for name in ("kernel_launches", "split_launches")}


def test_decode_with_its_own_workspace_ends_with_its_reduce():
    dev = pyfa.Device("cuda")
    B, H, Hkv, D, L = 8, 32, 8, 128, 4096
    desc = {"attn": {"batch": B, "num_heads": H, "num_kv_heads": Hkv, "head_dim": D, "kv_capacity": L, "nwg": 0,
                     "window": 0, "scale": D ** -0.5, "softcap": 0.0},
            "q_dtype": lib.PYFA_DTYPE_F16, "kv_dtype": lib.PYFA_DTYPE_F16, "out_dtype": lib.PYFA_DTYPE_F16}
    plan = _plans.new_plan(lib.pyfa_decode_plan_new, dev, ffi.new("pyfa_decode_plan_desc *", desc))
    q = torch.randn(B, H, D, dtype=torch.float16, device="cuda")
    k, v = (torch.randn(B, Hkv, L, D, dtype=torch.float16, device="cuda") for _ in range(2))
    lengths = ffi.new("int32_t[]", [L - 37 * b for b in range(B)])
    rings = ffi.new("int32_t[]", [0] * B)
    workspace = _workspace(plan)
    results = []
    for own in (False, True, False):
        out = torch.full_like(q, float("nan"))
        args = ffi.new("pyfa_decode_run_args *")
        for field, t in (("q", q), ("k_cache", k), ("v_cache", v), ("out", out)):
            _tensor(getattr(args, field), t)
        if own:
            _tensor(args.workspace, workspace)
        args.kv_len.host, args.ring_start.host = lengths, rings
        results.append((out, _run(dev, lib.pyfa_decode_run, plan, args)["kernel_launches"]))
    (merged, merged_launches), (reduced, reduced_launches), (again, again_launches) = results
    if merged_launches != 1:
        pytest.skip(f"this GPU's plan does not merge this split in its last workgroups ({merged_launches} launches)")
    assert reduced_launches == 2 and again_launches == 1
    assert torch.equal(merged.view(torch.int16), reduced.view(torch.int16))
    assert torch.equal(merged.view(torch.int16), again.view(torch.int16))


def test_prefill_with_its_own_workspace_runs_whole(rng):
    dev = pyfa.Device("cuda")
    B, H, Hkv, q_len, kv_len, D = 1, 32, 8, 8, 4096, 128
    q = rng.standard_normal((B, H, q_len, D)).astype(np.float16)
    k, v = (rng.standard_normal((B, Hkv, kv_len, D)).astype(np.float16) for _ in range(2))
    strides = lambda a: [a.strides[0] // 2, a.strides[1] // 2, a.strides[2] // 2]  # noqa: E731
    attn = {"batch": B, "num_heads": H, "num_kv_heads": Hkv, "head_dim": D, "q_len": q_len, "kv_len": kv_len,
            "q_offset": kv_len - q_len, "window": 0, "scale": D ** -0.5, "softcap": 0.0, "causal": 1,
            "q_strides": strides(q), "k_strides": strides(k), "v_strides": strides(v), "out_strides": strides(q),
            "mask_strides": [0, 0, 0]}
    desc = {"attn": attn, "dtype": lib.PYFA_DTYPE_F16, "out_dtype": lib.PYFA_DTYPE_F16, "mask_dtype": -1,
            "use_blk": 0, "return_lse": 1}
    plan = _plans.new_plan(lib.pyfa_prefill_plan_new, dev, ffi.new("pyfa_prefill_plan_desc *", desc))
    tq, tk, tv = (torch.from_numpy(a).cuda() for a in (q, k, v))
    workspace = _workspace(plan)
    ref, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    splits = []
    for own in (False, True):
        out = torch.full_like(tq, float("nan"))
        lse = torch.full((B, H, q_len), float("nan"), dtype=torch.float32, device="cuda")
        args = ffi.new("pyfa_prefill_run_args *")
        for field, t in (("q", tq), ("k", tk), ("v", tv), ("out", out), ("lse", lse)):
            _tensor(getattr(args, field), t)
        if own:
            _tensor(args.workspace, workspace)
        splits.append(_run(dev, lib.pyfa_prefill_run, plan, args)["split_launches"])
        check_close(out.cpu().numpy(), ref, np.float16, in_dtype(q, k, v, causal=True))
        check_lse(lse.cpu().numpy(), ref_lse)
    if splits[0] != 1:
        pytest.skip(f"this GPU's plan does not split this prefill ({splits[0]} split launches)")
    assert splits[1] == 0
