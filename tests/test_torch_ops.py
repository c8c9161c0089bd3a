"""torch.ops.pyfa.decode_attention (pyfa/integrations/torch_ops.py): the operator equals
pyfa.decode_attention bit for bit, passes torch's operator checks (schema, shape function),
compiles into a graph without a break, and on a GPU a graph compiled with CUDA graphs
replays with the kv_len and q written before each replay.

Skips without torch; the CUDA cases skip without a CUDA device.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import pyfa  # noqa: E402
from pyfa import reference  # noqa: E402
from pyfa.integrations import torch_ops  # noqa: E402,F401  (registers torch.ops.pyfa)

B, H, HKV, D, CAP = 2, 8, 2, 64, 48


def _inputs(device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g).to(device=device, dtype=dtype)
               for s in ((B, H, D), (B, HKV, CAP, D), (B, HKV, CAP, D)))
    return q, k, v


def _ints(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)")
    try:
        pyfa.Device("cuda")
    except pyfa.PyfaError as e:
        pytest.skip(f"pyfa cuda backend unavailable: {e}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_operator_equals_the_python_call(dtype):
    q, k, v = _inputs("cpu", dtype)
    got = torch.ops.pyfa.decode_attention(q, k, v, _ints([30, CAP], "cpu"), _ints([0, 7], "cpu"), 0.2, 5.0, 16)
    want = pyfa.decode_attention(q, k, v, [30, CAP], ring_start=[0, 7], scale=0.2, softcap=5.0, window=16,
                                 device="cpu")
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.equal(got, want)


def test_operator_checks():
    q, k, v = _inputs("cpu")
    torch.library.opcheck(torch.ops.pyfa.decode_attention.default, (q, k, v, _ints([30, CAP], "cpu"),
                                                                    _ints([0, 0], "cpu")))
    torch.library.opcheck(torch.ops.pyfa.decode_attention.default, (q, k, v, _ints([30, CAP], "cpu")))


def test_without_ring_start():
    q, k, v = _inputs("cpu")
    got = torch.ops.pyfa.decode_attention(q, k, v, _ints([30, CAP], "cpu"))
    assert torch.equal(got, pyfa.decode_attention(q, k, v, [30, CAP], device="cpu"))


def test_bad_values_raise_by_name():
    q, k, v = _inputs("cpu")
    with pytest.raises(pyfa.PyfaError, match="kv_len"):
        torch.ops.pyfa.decode_attention(q, k, v, _ints([30, CAP + 1], "cpu"), _ints([0, 0], "cpu"))
    with pytest.raises(pyfa.PyfaError, match="ring_start"):
        torch.ops.pyfa.decode_attention(q, k, v, _ints([CAP, CAP], "cpu"), _ints([0, CAP], "cpu"))


def _step(q, k, v, kv_len, ring_start):
    """A model's attention step around the operator: a projection of q before, a residual after."""
    out = torch.ops.pyfa.decode_attention(q * 0.5, k, v, kv_len, ring_start)
    return out + q


def test_compiles_without_a_graph_break():
    q, k, v = _inputs("cpu")
    lens, rings = _ints([30, CAP], "cpu"), _ints([0, 3], "cpu")
    compiled = torch.compile(_step, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(q, k, v, lens, rings), _step(q, k, v, lens, rings), rtol=1e-6, atol=1e-6)


def test_cuda_graph_replays_follow_the_tensors():
    """Compiled with CUDA graphs (mode="reduce-overhead"), the step replays; kv_len and q
    written in place before a call are what it attends, as an eager call and the float64
    reference say."""
    _cuda()
    q, k, v = _inputs("cuda", torch.bfloat16)
    lens, rings = _ints([20, 33], "cuda"), _ints([0, 0], "cuda")
    compiled = torch.compile(_step, mode="reduce-overhead", fullgraph=True, dynamic=False)
    for _ in range(3):  # warm-up runs, then the recorded graph
        compiled(q, k, v, lens, rings)
    for i, (n0, n1) in enumerate(((1, 48), (37, 5), (48, 48))):
        lens.copy_(_ints([n0, n1], "cuda"))
        q.copy_(_inputs("cuda", torch.bfloat16, seed=10 + i)[0])
        got = compiled(q, k, v, lens, rings).clone()
        torch.cuda.synchronize()
        # an eager step: the same decode; the elementwise ops around it may round apart by an ulp
        torch.testing.assert_close(got, _step(q, k, v, lens, rings), rtol=2 ** -7, atol=2 ** -7)
        host = [t.float().cpu().numpy() for t in (q, k, v)]
        ref = reference.decode_attention(host[0] * 0.5, host[1], host[2], np.array([n0, n1])) + host[0]
        assert np.abs(got.float().cpu().numpy() - ref).max() < 5e-2  # bf16 rounding of values of order 1
