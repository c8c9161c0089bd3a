"""torch CPU tensors: read in place (the kernels get the tensor's own memory)
by every op on host-visible devices, results as torch tensors when the
leading array argument is one, and the rules for tensors pyfa cannot read."""
import numpy as np
import pytest

import pyfa
from pyfa import _io, reference
from pyfa.device import Device

torch = pytest.importorskip("torch")

from test_prefill import run_addresses  # noqa: E402,F401 (fixture: the addresses a prefill plan run is handed)

TORCH = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16, pyfa.bfloat16: torch.bfloat16}


def _tensor(a):
    """A torch CPU tensor holding the values of the numpy array ``a`` (bfloat16 through float32)."""
    return torch.from_numpy(np.ascontiguousarray(a.astype(np.float32))).to(TORCH[np.dtype(a.dtype)])


@pytest.fixture
def wrapped(monkeypatch):
    """Addresses of the host memory each call hands to the library: wrapped
    as buffers (Device.wrap) or passed to a plan run (_io.address)."""
    seen = []
    original, original_address = Device.wrap, _io.address

    def wrap(self, array):
        seen.append(array.__array_interface__["data"][0])
        return original(self, array)

    def address(a):
        seen.append(original_address(a))
        return seen[-1]
    monkeypatch.setattr(Device, "wrap", wrap)
    monkeypatch.setattr(_io, "address", address)
    return seen


def _host_visible(device):
    if not device.host_visible:
        pytest.skip("torch CPU tensors are copied to a GPU device, not wrapped")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, pyfa.bfloat16])
def test_as_array_views_the_tensor(dtype):
    t = _tensor(np.arange(12, dtype=np.float32).reshape(3, 4).astype(dtype))
    a = _io.as_array(t, "q")
    assert a.dtype == np.dtype(dtype) and a.shape == (3, 4)
    assert a.__array_interface__["data"][0] == t.data_ptr()
    t[1, 2] = 100.0  # one memory: a write through torch shows in the array
    assert a[1, 2] == 100.0


def test_as_array_copies_only_what_it_must():
    t = _tensor(np.ones((4, 6), np.float32)).t()  # a transposed view: not contiguous
    a = _io.as_array(t, "q")
    assert a.flags.c_contiguous and a.__array_interface__["data"][0] != t.data_ptr()
    np.testing.assert_array_equal(a, t.numpy())
    g = torch.ones(2, 3, requires_grad=True)
    assert _io.as_array(g, "q").__array_interface__["data"][0] == g.data_ptr()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, pyfa.bfloat16])
def test_decode_reads_tensors_in_place(device, rng, wrapped, dtype):
    _host_visible(device)
    q = rng.standard_normal((2, 4, 64)).astype(dtype)
    k = rng.standard_normal((2, 2, 40, 64)).astype(dtype)
    v = rng.standard_normal((2, 2, 40, 64)).astype(dtype)
    tq, tk, tv = _tensor(q), _tensor(k), _tensor(v)
    assert pyfa.decode_attention(tq, tk, tv, [40, 17], device=device).dtype == TORCH[np.dtype(dtype)]
    out = pyfa.decode_attention(tq, tk, tv, [40, 17], device=device, out_dtype=np.float32)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == (2, 4, 64)
    assert {tq.data_ptr(), tk.data_ptr(), tv.data_ptr()} <= set(wrapped)
    np.testing.assert_array_equal(out.numpy(), pyfa.decode_attention(q, k, v, [40, 17], device=device,
                                                                     out_dtype=np.float32))
    np.testing.assert_allclose(out.numpy(), reference.decode_attention(q, k, v, [40, 17]), atol=2e-5, rtol=0)


def test_decode_single_sequence_and_out(device, rng):
    _host_visible(device)
    q, k = rng.standard_normal((4, 64)).astype(np.float32), rng.standard_normal((2, 30, 64)).astype(np.float16)
    out = torch.full((4, 64), float("nan"))
    res = pyfa.decode_attention(_tensor(q), _tensor(k), _tensor(k), 30, device=device, out=out)
    assert res is out
    np.testing.assert_array_equal(out.numpy(), pyfa.decode_attention(q, k, k, 30, device=device))
    # The result follows q's type: a numpy q with torch caches gives numpy; a numpy out is filled.
    assert isinstance(pyfa.decode_attention(q, _tensor(k), _tensor(k), 30, device=device), np.ndarray)
    mine = np.zeros((4, 64), np.float32)
    res = pyfa.decode_attention(_tensor(q), _tensor(k), _tensor(k), 30, device=device, out=mine)
    assert isinstance(res, np.ndarray) and np.shares_memory(res, mine) and np.array_equal(mine, out.numpy())


@pytest.mark.parametrize("dtype", [np.float16, pyfa.bfloat16])
def test_attention_and_merge_return_tensors(device, rng, wrapped, dtype):
    _host_visible(device)
    q = rng.standard_normal((1, 2, 20, 64)).astype(dtype)
    k = rng.standard_normal((1, 2, 50, 64)).astype(dtype)
    tq, tk = _tensor(q), _tensor(k)
    o, lse = pyfa.attention(tq, tk, tk, causal=True, return_lse=True, device=device)
    assert o.dtype == TORCH[np.dtype(dtype)] and lse.dtype == torch.float32 and isinstance(lse, torch.Tensor)
    assert {tq.data_ptr(), tk.data_ptr()} <= set(wrapped)
    want, want_lse = pyfa.attention(q, k, k, causal=True, return_lse=True, device=device)
    np.testing.assert_array_equal(o.float().numpy(), want.astype(np.float32))
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    out = torch.empty(q.shape, dtype=TORCH[np.dtype(dtype)])
    assert pyfa.attention(tq, tk, tk, causal=True, device=device, out=out) is out
    np.testing.assert_array_equal(out.float().numpy(), want.astype(np.float32))
    a, la = pyfa.attention(tq, tk[:, :, :25], tk[:, :, :25], return_lse=True, device=device)
    b, lb = pyfa.attention(tq, tk[:, :, 25:], tk[:, :, 25:], return_lse=True, device=device)
    m, lm = pyfa.merge_attention_states(a, la, b, lb, device=device)
    assert m.dtype == TORCH[np.dtype(dtype)] and lm.dtype == torch.float32
    want_m, want_lm = pyfa.merge_attention_states(*(x.float().numpy().astype(dtype) if x.dtype != torch.float32
                                                    else x.numpy() for x in (a, la, b, lb)), device=device)
    np.testing.assert_array_equal(m.float().numpy(), want_m.astype(np.float32))
    np.testing.assert_array_equal(lm.numpy(), want_lm)


@pytest.mark.parametrize("kind", ["dense", "tq"])
def test_caches_append_and_attend_tensors(device, rng, wrapped, kind):
    _host_visible(device)
    make = (lambda: pyfa.KVCache(2, 64, 32, dtype=np.float16, sliding_window=20, device=device)) if kind == "dense" \
        else (lambda: pyfa.TurboQuantKVCache(2, 64, 32, sliding_window=20, device=device))
    ours, theirs = make(), make()
    k, v = rng.standard_normal((40, 2, 64)).astype(pyfa.bfloat16), rng.standard_normal((40, 2, 64)).astype(np.float32)
    for part in (slice(0, 7), slice(7, 40)):  # the second append wraps the ring
        tk, tv = _tensor(k[part]), _tensor(v[part])
        del wrapped[:]
        ours.append(tk, tv)
        skip = max(0, len(tk) - 32)  # a ring keeps the last `capacity` rows: they start `skip` rows in
        assert {t.data_ptr() + skip * t[0].nbytes for t in (tk, tv)} <= set(wrapped)
        theirs.append(k[part], v[part])
    q = rng.standard_normal((4, 64)).astype(np.float16)
    got = ours.attend(_tensor(q))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float16  # q's dtype
    np.testing.assert_array_equal(got.numpy(), theirs.attend(q))
    assert isinstance(ours.attend(q), np.ndarray)
    empty = make().attend(_tensor(q))
    assert isinstance(empty, torch.Tensor) and not empty.any()


def test_tensor_rules(dev, rng):
    k = rng.standard_normal((2, 8, 64)).astype(np.float32)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    with pytest.raises(pyfa.InvalidArgumentError, match="q: dtype int64 not accepted"):
        pyfa.decode_attention(torch.ones(4, 64, dtype=torch.int64), k, k, 8, device=dev)
    with pytest.raises(pyfa.InvalidArgumentError, match="k_cache: a torch tensor on meta"):
        pyfa.decode_attention(q, torch.empty(2, 8, 64, device="meta"), k, 8, device=dev)
    with pytest.raises(pyfa.InvalidArgumentError, match="q: torch dtype torch.float8_e4m3fn cannot be read"):
        pyfa.decode_attention(torch.ones(4, 64).to(torch.float8_e4m3fn), k, k, 8, device=dev)
    for bad in (torch.empty(64, 4).t(), torch.empty(4, 64, requires_grad=True)):
        with pytest.raises(pyfa.InvalidArgumentError, match="out: must be a contiguous torch tensor"):
            pyfa.decode_attention(q, k, k, 8, device=dev, out=bad)
    with pytest.raises(pyfa.InvalidArgumentError, match="out: expected shape"):
        pyfa.decode_attention(q, k, k, 8, device=dev, out=torch.empty(4, 64, dtype=torch.float16))
    with pytest.raises(pyfa.InvalidArgumentError, match="out: must be a numpy array or a torch CPU tensor"):
        pyfa.decode_attention(q[None], k[None], k[None], 8, device=dev, out=[[[0.0] * 64] * 4])
    c = pyfa.KVCache(2, 64, 8, device=dev)
    with pytest.raises(pyfa.InvalidArgumentError, match="k: expected shape"):
        c.append(torch.ones(1, 3, 64), torch.ones(1, 3, 64))
    with pytest.raises(pyfa.InvalidArgumentError, match="v: dtype int32 not accepted"):
        c.append(torch.ones(1, 2, 64), torch.ones(1, 2, 64, dtype=torch.int32))
    assert len(c) == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float16, pyfa.bfloat16])
def test_attention_reads_and_writes_tensor_views_in_place(device, run_addresses, rng, dtype):
    """Transposed, sliced and broadcast torch CPU tensors reach the kernels as the tensors' own
    memory, an out view is written where it is, and the result is the contiguous call's."""
    _host_visible(device)
    B, H, Hkv, L, D = 2, 4, 2, 33, 64
    q = _tensor(rng.standard_normal((B, L, H, D)).astype(dtype)).transpose(1, 2)
    k = _tensor(rng.standard_normal((B, L, Hkv, D + 8)).astype(dtype))[..., :D].transpose(1, 2)
    v = _tensor(rng.standard_normal((1, Hkv, L, D)).astype(dtype)).expand(B, Hkv, L, D)
    store = torch.zeros((B, L, H, D), dtype=TORCH[np.dtype(dtype)])
    out = store.transpose(1, 2)
    assert pyfa.attention(q, k, v, causal=True, out=out, device=device) is out
    assert run_addresses == [(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())]
    whole = pyfa.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True, device=device)
    assert torch.equal(store.transpose(1, 2), whole)
