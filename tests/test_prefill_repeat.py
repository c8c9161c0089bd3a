"""The repeat path of pyfa.attention on torch CUDA tensors: a call repeating an earlier one's shapes,
dtypes, layout, causal flag and scale with the other options at their defaults skips the Python
checks and reuses the plan and run arguments; results and rules stay those of the full path.

Tolerance: the repeat path runs the kernel the full path runs on the same inputs, so its output is
compared with the full path's bit for bit; against the float64 reference, flash-attn's rule
(tests/test_prefill.py, check_close): twice the error of the same attention computed in float16,
plus 2e-5."""
import numpy as np
import pytest

import pyfa
from pyfa import prefill, reference

HAS_GPU = "cuda" in pyfa.available_backends()
pytestmark = pytest.mark.skipif(not HAS_GPU, reason="no CUDA device here")
B, H, HKV, D = 1, 4, 2, 128
STEADY = ("plans_created", "device_allocations", "pinned_allocations", "synchronizations",
          "host_to_device_copies", "device_to_host_copies")


def tensors(torch, rng, L, layout):
    shape = (lambda h: (B, h, L, D)) if layout == "bhsd" else (lambda h: (B, L, h, D))
    arrays = [rng.standard_normal(shape(h), dtype=np.float32).astype(np.float16) for h in (H, HKV, HKV)]
    return arrays, [torch.from_numpy(a).cuda() for a in arrays]


def assert_flash_rule(out, qn, kn, vn, **kw):
    ref = reference.attention(qn, kn, vn, **kw)
    ref16 = reference.attention(qn, kn, vn, rounding=np.float16, **kw)
    got = out.float().cpu().numpy().astype(np.float64)
    assert np.abs(got - ref).max() <= 2 * np.abs(ref16 - ref).max() + 2e-5


def repeat_only(monkeypatch):
    """Makes the full path fail: a call that returns took the repeat path."""
    def refuse(*a, **kw):
        raise AssertionError("the full path ran")
    monkeypatch.setattr(prefill, "_attention", refuse)


def full_path(q, k, v, dev, **kw):
    """pyfa.attention through every check (never the repeat path, and not remembered)."""
    opts = dict(scale=None, causal=False, q_offset=None, mask=None, window=None, softcap=0.0, layout="bhsd",
                return_lse=False, out=None, use_blk=None)
    opts.update(kw)
    return prefill._attention(q, k, v, device=dev, **opts)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
def test_repeat_path_matches_the_full_path(rng, monkeypatch, layout, causal):
    torch = pytest.importorskip("torch")
    dev = pyfa.Device("cuda")
    prefill._repeat.table = {}
    (qn, kn, vn), (q, k, v) = tensors(torch, rng, 300, layout)
    pyfa.attention(q, k, v, causal=causal, layout=layout, device=dev)  # full path, remembered
    assert prefill._repeat_call(q, k, v, None, dev, None, causal, layout) is not None
    # New contents in place, and a new tensor for v: the repeat path reads what the call passes.
    (qn, kn, vn2), (q2, k2, v2) = tensors(torch, rng, 300, layout)
    q.copy_(q2)
    k.copy_(k2)
    torch.cuda.synchronize()
    before = pyfa.counters()
    with monkeypatch.context() as m:
        repeat_only(m)
        got = pyfa.attention(q, k, v2, causal=causal, layout=layout, device=dev)
    after = pyfa.counters()
    for name in STEADY:
        assert after[name] == before[name], (name, before, after)
    assert after["kernel_launches"] > before["kernel_launches"]
    assert got.dtype == torch.float16 and got.shape == q.shape
    want = full_path(q, k, v2, dev, causal=causal, layout=layout)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert_flash_rule(got, qn, kn, vn2, causal=causal, layout=layout)


def test_other_options_take_the_full_path(rng, monkeypatch):
    """Options the repeat path does not handle, another scale, a non-contiguous tensor: each is the
    full path's result (checked against the reference), none replaces the remembered plan, and bad
    input is refused as before."""
    torch = pytest.importorskip("torch")
    dev = pyfa.Device("cuda")
    prefill._repeat.table = {}
    (qn, kn, vn), (q, k, v) = tensors(torch, rng, 200, "bhsd")
    pyfa.attention(q, k, v, device=dev)
    entries = len(prefill._repeat.table)
    assert entries == 1
    got = pyfa.attention(q, k, v, scale=0.05, device=dev)  # another scale: a second entry
    assert_flash_rule(got, qn, kn, vn, scale=0.05)
    assert len(prefill._repeat.table) == 2
    with monkeypatch.context() as m:  # ... which the next such call takes
        repeat_only(m)
        got = pyfa.attention(q, k, v, scale=0.05, device=dev)
    assert_flash_rule(got, qn, kn, vn, scale=0.05)
    remembered = dict(prefill._repeat.table)
    mask = torch.ones((200, 200), dtype=torch.bool, device="cuda").tril()
    got = pyfa.attention(q, k, v, mask=mask, device=dev)
    assert_flash_rule(got, qn, kn, vn, mask=np.tril(np.ones((200, 200), bool)))
    got = pyfa.attention(q, k, v, device=dev, out_dtype=np.float32)
    assert got.dtype == torch.float32
    assert_flash_rule(got, qn, kn, vn)
    got, lse = pyfa.attention(q, k, v, device=dev, return_lse=True)
    assert_flash_rule(got, qn, kn, vn)
    kt = k.transpose(2, 3).contiguous().transpose(2, 3)  # same shape, not contiguous
    assert_flash_rule(pyfa.attention(q, kt, v, device=dev), qn, kn, vn)
    # None of those calls replaced a remembered plan or struct; the next default call repeats the first.
    assert prefill._repeat.table.keys() == remembered.keys()
    assert all(prefill._repeat.table[key][0] is plan and prefill._repeat.table[key][1] is args
               for key, (plan, args, _gpu) in remembered.items())
    with monkeypatch.context() as m:
        repeat_only(m)
        got = pyfa.attention(q, k, v, device=dev)
    assert_flash_rule(got, qn, kn, vn)
    # Bad input: refused by the full path, also where it matches a remembered key but for the flaw.
    with pytest.raises(pyfa.InvalidArgumentError, match="layout"):
        pyfa.attention(q, k, v, layout=["bhsd"], device=dev)
    with pytest.raises(pyfa.InvalidArgumentError, match="causal"):
        pyfa.attention(q, k, v, causal=np.array([1, 0]), device=dev)
    with pytest.raises(pyfa.InvalidArgumentError, match="v: shape"):
        pyfa.attention(q, k, v[:, :, :100], device=dev)
    with pytest.raises(pyfa.InvalidArgumentError, match="k: dtype"):
        pyfa.attention(q, k.float(), v.float(), device=dev)
    with pytest.raises(pyfa.InvalidArgumentError, match="layout"):
        pyfa.attention(q, k, v, layout="sbhd", device=dev)


def test_views_and_out_repeat_too(rng, monkeypatch):
    """Views read in place and an out view (as the transformers integration passes them) take the
    repeat path after one full call, keyed by their strides; a view whose first element is off a
    16-byte boundary takes the full path, which copies it."""
    torch = pytest.importorskip("torch")
    dev = pyfa.Device("cuda")
    prefill._repeat.table = {}
    L = 150
    t = lambda *shape: torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).half().cuda()
    q, k, v = t(B, L, H, D).transpose(1, 2), t(B, L, HKV, D + 8)[..., :D].transpose(1, 2), t(B, HKV, L, D)
    store = torch.empty((B, L, H, D), dtype=torch.float16, device="cuda")
    out = store.transpose(1, 2)
    assert pyfa.attention(q, k, v, causal=True, out=out, device=dev) is out
    assert len(prefill._repeat.table) == 1
    q2 = t(B, L, H, D).transpose(1, 2)
    with monkeypatch.context() as m:
        repeat_only(m)
        assert pyfa.attention(q2, k, v, causal=True, out=out, device=dev) is out
    fresh = pyfa.attention(q2, k, v, causal=True, device=dev)  # no out: another key, the full path
    want = full_path(q2.contiguous(), k.contiguous(), v, dev, causal=True)
    torch.cuda.synchronize()
    assert torch.equal(out, want) and torch.equal(fresh, want)
    # The same strides from an address 8 bytes past a boundary: copied by the full path.
    wide = t(B, L, HKV, D + 8)
    k_off = wide[..., 4:D + 4].transpose(1, 2)
    assert k_off.stride() == k.stride() and k_off.data_ptr() % 16 == 8
    got = pyfa.attention(q2, k_off, v, causal=True, out=out, device=dev)
    want = full_path(q2.contiguous(), k_off.contiguous(), v, dev, causal=True)
    torch.cuda.synchronize()
    assert got is out and torch.equal(out, want)
    # An out that requires grad matches the remembered key but is refused, as by the full path.
    grad_out = store.clone().requires_grad_().transpose(1, 2)
    with pytest.raises(pyfa.InvalidArgumentError, match="out: must be a tensor that does not require grad"):
        pyfa.attention(q2, k, v, causal=True, out=grad_out, device=dev)
    # A call that copied an input is not remembered: its plan has the copy's strides.
    prefill._repeat.table = {}
    pyfa.attention(q2, k_off, v, causal=True, out=out, device=dev)
    assert not prefill._repeat.table
