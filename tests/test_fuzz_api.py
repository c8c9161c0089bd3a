"""Property-based fuzzing of the Python API (hypothesis): every call either
raises a PyfaError or returns what the float64 reference (pyfa/reference.py)
computes for the same arguments.

Each example draws a valid call (random shapes, dtypes and options) and, half
of the time, replaces one argument by a deliberately bad value. A valid call
must succeed; a call with a replaced argument may succeed only when the
reference accepts the same value and agrees.

Examples per test: $PYFA_FUZZ_EXAMPLES (then drawn at random; pytest's
``--hypothesis-seed=N`` fixes them), else 40 on the CPU backend and 8 on others
(the Metal executor is slow), derandomised so that CI runs the same examples.
A failure prints the example and a ``@reproduce_failure`` blob.
"""
import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import pyfa  # noqa: E402
from pyfa import reference  # noqa: E402
import tq_contract  # noqa: E402

DEVICE = pyfa.Device(os.environ.get("PYFA_BACKEND") or "cpu")
EXAMPLES = int(os.environ.get("PYFA_FUZZ_EXAMPLES") or (40 if DEVICE.backend == "cpu" else 8))
settings.register_profile("pyfa", max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
                          derandomize="PYFA_FUZZ_EXAMPLES" not in os.environ,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("pyfa")

BF16 = pyfa.bfloat16
FLOATS = [np.dtype(np.float32), np.dtype(np.float16), BF16]
ULP = {np.dtype(np.float32): 2.0**-23, np.dtype(np.float16): 2.0**-10, BF16: 2.0**-7}
HEAD_DIMS = list(pyfa.supported("head_dims"))
TQ_HEAD_DIMS = list(pyfa.supported("tq_head_dims"))


class _Opaque:
    """An object no argument accepts."""

    def __repr__(self):
        return "<opaque>"


# Values no argument of the API accepts as they are, or accepts only in some
# positions (0, -1, True, None): the reference decides for those.
BAD_SCALARS = [None, "a", "\udcff", [1.0], (2, 3), float("nan"), float("inf"), -float("inf"), -1, 0, 2**40, -2**70,
               2**64, 1j, np.array([1, 0]), np.float64(2.5), True, _Opaque(), b"cpu"]


def bad_array(a):
    """Array variants with a wrong dtype, rank or shape, or not arrays at all."""
    with np.errstate(invalid="ignore", over="ignore"):
        return st.sampled_from([
            a.astype(np.float64), a.astype(np.int32), a[..., :-1] if a.shape[-1] > 1 else a[..., :0], a[None],
            a.ravel(), a.tolist() if a.size < 64 else None, "array", _Opaque(), np.zeros(0, np.float32),
            a.astype(np.uint8),
        ])


def inject(draw, kwargs: dict, arrays=()):
    """Half of the time replaces one argument of ``kwargs`` by a bad value; returns its name or None."""
    name = draw(st.none() | st.sampled_from(sorted(kwargs)))
    if name is not None:
        kwargs[name] = draw(bad_array(kwargs[name]) if name in arrays else st.sampled_from(BAD_SCALARS))
    return name


def rand(draw, shape, dtype, scale=1.0):
    seed = draw(st.integers(0, 2**32 - 1))
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def tolerance(dtype, *values):
    """Absolute tolerance for an output of ``dtype``: its rounding plus float32 accumulation, relative to
    the largest magnitude of the values it combines."""
    mag = max([1.0] + [float(np.abs(np.asarray(v, np.float64)).max(initial=0)) for v in values])
    return (4 * ULP[np.dtype(dtype)] + 1e-4) * mag


def check(call, ref_call, bad, compare):
    """Runs ``call``; a PyfaError passes only with a bad argument. On success the reference must accept the
    same arguments and ``compare`` the two results."""
    try:
        got = call()
    except pyfa.PyfaError:
        assert bad is not None, "a valid call raised"
        return
    try:
        want = ref_call()
    except Exception as e:
        raise AssertionError(f"the library accepted {bad}= that the reference rejects: {e!r}") from None
    compare(got, want)


# --------------------------------------------------------------------------- decode_attention

@st.composite
def decode_calls(draw):
    B = draw(st.sampled_from([None, 1, 2, 3]))
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 3))
    D = draw(st.sampled_from(HEAD_DIMS[:4]))
    cap = draw(st.integers(1, 40))
    dt, qdt = draw(st.sampled_from(FLOATS)), draw(st.sampled_from(FLOATS))
    lead = () if B is None else (B,)
    n = 1 if B is None else B
    lens = draw(st.lists(st.integers(1, cap), min_size=n, max_size=n))
    rings = [draw(st.integers(0, cap - 1)) if ln == cap else 0 for ln in lens]
    kw = dict(q=rand(draw, lead + (H, D), qdt), k_cache=rand(draw, lead + (Hkv, cap, D), dt),
              v_cache=rand(draw, lead + (Hkv, cap, D), dt),
              kv_len=lens[0] if B is None and draw(st.booleans()) else lens,
              ring_start=rings[0] if B is None else rings,
              scale=draw(st.none() | st.floats(0.01, 2.0)), softcap=draw(st.sampled_from([0.0, 0.5, 5.0, 30.0])),
              window=draw(st.none() | st.integers(1, cap + 3)), out_dtype=draw(st.sampled_from([None] + FLOATS)),
              return_lse=draw(st.booleans()))
    bad = inject(draw, kw, arrays=("q", "k_cache", "v_cache"))
    return kw, bad


def compare_lse(lse, want_lse):
    """LSEs agree where finite (f32 sums and logs: relative 1e-3 leaves margin) and are -inf together."""
    assert lse.dtype == np.float32 and lse.shape == np.shape(want_lse)
    fin = np.isfinite(want_lse)
    assert (np.isfinite(lse) == fin).all() and (lse[~fin] == -np.inf).all()
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=0, atol=1e-3 * max(1, np.abs(want_lse[fin]).max(initial=0)))


@given(decode_calls())
def test_fuzz_decode_attention(case):
    kw, bad = case

    def compare(got, want):
        if kw["return_lse"] is True:
            (got, lse), (want, want_lse) = got, want
            compare_lse(lse, want_lse)
        expected = np.asarray(kw["q"]).dtype if kw["out_dtype"] is None else np.dtype(kw["out_dtype"])
        assert got.dtype == expected and got.shape == np.shape(want)
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=0, atol=tolerance(got.dtype, kw["v_cache"]))
    ref_kw = {n: v for n, v in kw.items() if n != "out_dtype"}
    check(lambda: pyfa.decode_attention(**kw, device=DEVICE), lambda: reference.decode_attention(**ref_kw), bad,
          compare)


# --------------------------------------------------------------------------- attention

@st.composite
def attention_calls(draw):
    B, Hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 2))
    D = draw(st.sampled_from(HEAD_DIMS[:2]))
    qL, kL = draw(st.integers(1, 9)), draw(st.integers(1, 20))
    dt = draw(st.sampled_from(FLOATS))
    layout = draw(st.sampled_from(["bhsd", "bshd"]))

    def shape(heads, seq):
        return (B, heads, seq, D) if layout == "bhsd" else (B, seq, heads, D)
    mask_kind = draw(st.sampled_from([None, "bool2", "bool4", "add2", "add4"]))
    mask = None
    if mask_kind:
        mshape = (qL, kL) if mask_kind.endswith("2") else (B, H, qL, kL)
        seed = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        keep = seed.random(mshape) < 0.7
        mask = keep if mask_kind.startswith("bool") else \
            np.where(keep, seed.standard_normal(mshape), -np.inf).astype(dt)
    kw = dict(q=rand(draw, shape(H, qL), dt), k=rand(draw, shape(Hkv, kL), dt), v=rand(draw, shape(Hkv, kL), dt),
              scale=draw(st.none() | st.floats(0.01, 2.0)), causal=draw(st.booleans()),
              q_offset=draw(st.none() | st.integers(-5, 25)), mask=mask, window=draw(st.none() | st.integers(1, 25)),
              softcap=draw(st.sampled_from([0.0, 0.5, 5.0])), layout=layout, return_lse=draw(st.booleans()))
    bad = inject(draw, kw, arrays=("q", "k", "v"))
    return kw, bad


@given(attention_calls())
def test_fuzz_attention(case):
    kw, bad = case

    def compare(got, want):
        if kw["return_lse"] is True:
            (got, lse), (want, want_lse) = got, want
            compare_lse(lse, want_lse)
        assert got.shape == np.shape(want)
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=0, atol=tolerance(got.dtype, kw["v"]))
    check(lambda: pyfa.attention(**kw, device=DEVICE), lambda: reference.attention(**kw), bad, compare)


# --------------------------------------------------------------------------- merge_attention_states

@st.composite
def merge_calls(draw):
    B, H, L = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 6))
    D = 8 * draw(st.integers(1, 64))
    dt = draw(st.sampled_from(FLOATS))
    layout = draw(st.sampled_from(["bhsd", "bshd"]))
    oshape = (B, H, L, D) if layout == "bhsd" else (B, L, H, D)

    def lse():
        x = rand(draw, (B, H, L), np.float32, 3.0)
        # -inf: that side saw no key. (+inf is not an LSE any attention produces.)
        x[np.random.default_rng(draw(st.integers(0, 2**32 - 1))).random(x.shape) < 0.2] = -np.inf
        return x
    kw = dict(o_a=rand(draw, oshape, dt), lse_a=lse(), o_b=rand(draw, oshape, dt), lse_b=lse(), layout=layout)
    bad = inject(draw, kw, arrays=("o_a", "lse_a", "o_b", "lse_b"))
    return kw, bad


@given(merge_calls())
def test_fuzz_merge_attention_states(case):
    kw, bad = case

    def compare(got, want):
        (o, lse), (want_o, want_lse) = got, want
        fin = np.isfinite(want_lse)
        assert (np.isfinite(lse) == fin).all()
        np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=0, atol=1e-5 * max(1, np.abs(want_lse[fin]).max(initial=0)))
        np.testing.assert_allclose(o.astype(np.float64), want_o, rtol=0, atol=tolerance(o.dtype, kw["o_a"], kw["o_b"]))
    check(lambda: pyfa.merge_attention_states(**kw, device=DEVICE),
          lambda: reference.merge_attention_states(**kw), bad, compare)


# --------------------------------------------------------------------------- caches

@st.composite
def cache_sessions(draw):
    tq = draw(st.booleans())
    Hkv = draw(st.integers(1, 2))
    D = draw(st.sampled_from(TQ_HEAD_DIMS[:2] if tq else HEAD_DIMS[:3]))
    cap = draw(st.integers(1, 24))
    window = draw(st.none() | st.integers(1, cap))
    ctor = dict(num_kv_heads=Hkv, head_dim=D, capacity=cap, sliding_window=window)
    if tq:
        ctor.update(k_bits=draw(st.sampled_from([2, 3, 4, 8])), v_bits=draw(st.sampled_from([2, 3, 4, 8])),
                    seed=draw(st.integers(0, 2**64 - 1)), norm_correction=draw(st.sampled_from(
                        [True, False, "none", "norm_preserving", "unbiased"])))
    else:
        ctor.update(dtype=draw(st.sampled_from(FLOATS)))
    bad = inject(draw, ctor)
    ops = []
    for _ in range(draw(st.integers(1, 5))):
        if draw(st.booleans()):
            n = draw(st.integers(1, cap + 4))
            kw = dict(k=rand(draw, (n, Hkv, D), np.float32), v=rand(draw, (n, Hkv, D), np.float32))
            ops.append(("append", kw, inject(draw, kw, arrays=("k", "v"))))
        else:
            kw = dict(q=rand(draw, (Hkv * draw(st.integers(1, 3)), D), np.float32),
                      scale=draw(st.none() | st.floats(0.01, 2.0)), softcap=draw(st.sampled_from([0.0, 5.0])))
            if tq:
                kw.update(fused=draw(st.booleans()), nwg=draw(st.none() | st.integers(1, 8)))
            ops.append(("attend", kw, inject(draw, kw, arrays=("q",))))
    return tq, ctor, bad, ops


@given(cache_sessions())
def test_fuzz_caches(session):
    """A cache's attend equals the reference over the rows it holds (dense: the appended rows rounded to its
    dtype; TurboQuant: its own dequantized rows); a failed append changes nothing."""
    tq, ctor, bad, ops = session
    try:
        cache = (pyfa.TurboQuantKVCache if tq else pyfa.KVCache)(**ctor, device=DEVICE)
    except pyfa.PyfaError:
        assert bad is not None, "a valid constructor raised"
        return
    if bad is not None:
        return  # accepted odd values (0 bits? None window?) are checked by test_args.py's rules
    rows_k, rows_v = [], []
    for op, kw, bad in ops:
        if op == "append":
            before = len(cache)
            try:
                cache.append(**kw)
            except pyfa.PyfaError:
                assert len(cache) == before
                if bad is None:  # valid rows raise only on overflow without a window
                    assert ctor["sliding_window"] is None and before + len(kw["k"]) > ctor["capacity"]
                continue
            rows_k.append(np.asarray(kw["k"], np.float64))
            rows_v.append(np.asarray(kw["v"], np.float64))
            continue
        try:
            got = cache.attend(**kw)
        except pyfa.PyfaError:
            assert bad is not None, "a valid attend raised"
            continue
        H, D = np.shape(kw["q"])
        if len(cache) == 0:
            assert (got == 0).all() and got.shape == (H, D)
            continue
        if tq:  # the rows of the f32 codebook, or of its f16 rounding, which a kernel may multiply (tq_contract.py)
            models = [tq_contract.cache_rows(cache, dt) for dt in tq_contract.CODEBOOK_DTYPES]
            k, v = models[0]
        else:
            k, v = (np.concatenate(r)[-len(cache):].astype(ctor["dtype"]).astype(np.float64) for r in (rows_k, rows_v))
        ref_kw = {key: kw[key] for key in ("q", "scale", "softcap")}
        try:
            want = reference.decode_attention(**ref_kw, k_cache=k.transpose(1, 0, 2), v_cache=v.transpose(1, 0, 2),
                                              kv_len=len(cache), window=ctor["sliding_window"])
        except Exception as e:
            raise AssertionError(f"the cache accepted {bad}= that the reference rejects: {e!r}") from None
        atol = (2e-4 if tq else 1e-4) * max(1, np.abs(v).max())
        if tq:
            f16 = reference.decode_attention(**ref_kw, k_cache=models[1][0].transpose(1, 0, 2),
                                             v_cache=models[1][1].transpose(1, 0, 2), kv_len=len(cache),
                                             window=ctor["sliding_window"])
            tq_contract.assert_close_to_one(got, [want, f16], atol)
        else:
            np.testing.assert_allclose(got, want, rtol=0, atol=atol)
