"""pyfa as a transformers attention implementation (pyfa/integrations/transformers.py)
against transformers' own eager attention (sdpa ignores softcap and sinks), on small
models built from configs with random weights (nothing is downloaded: Llama, Mistral,
Gemma 2, Gemma 3, Qwen 3, gpt-oss): logits, greedy generation token for token, padded
batches, cached continuations, static caches, sliding windows (Mistral, Gemma 2/3,
gpt-oss), softcapping (Gemma 2), attention sinks (gpt-oss) and PyfaCache (dense and
TurboQuant), on the CPU and, where one opens, a CUDA GPU.

Tolerances. float32: both sides accumulate in f32 and differ only in summation
order (online softmax against matmul + softmax), a few ulp per layer; measured
differences are below 1e-5 on logits of order 1, the bound is 1e-4. Half
precision: the model's linear layers round to bf16/f16 the same way under both
implementations and dominate the error, so the test compares each side's
distance to a float32 eager reference and wants pyfa's no worse than eager's
(times 1.5, plus 1e-3 of slack). Greedy tokens run in float32, where the gaps
between the top logits of these models (~1e-3) are far above the differences; in
half precision they are not, so there the tests compare logits only.
"""
import inspect
import os

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the transformers integration needs it)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
if not hasattr(transformers, "AttentionInterface"):
    pytest.skip(f"transformers {transformers.__version__} has no AttentionInterface (needs >= 4.48)",
                allow_module_level=True)
if os.environ.get("PYFA_BACKEND") not in (None, "", "cpu", "cuda"):
    pytest.skip(f"the transformers integration runs on the cpu and cuda backends; PYFA_BACKEND="
                f"{os.environ['PYFA_BACKEND']} selects neither", allow_module_level=True)

import numpy as np  # noqa: E402

import pyfa  # noqa: E402
import tq_contract  # noqa: E402
from pyfa.integrations import transformers as pyfa_hf  # noqa: E402

try:
    from pyfa.integrations import _hf_cache  # noqa: E402 (PyfaCache: transformers 5's cache-layer API)
except ImportError:
    _hf_cache = None

NAME = pyfa_hf.register()
F32_TOL = dict(rtol=1e-4, atol=1e-4)


def _cuda_ok() -> str | None:
    """None when a CUDA GPU is usable by torch and pyfa, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        pyfa.Device("cuda")
    except pyfa.PyfaError as e:
        return f"pyfa cuda backend unavailable: {e}"
    return None


@pytest.fixture(params=["cpu", "cuda"])
def torch_device(request):
    """A torch device (tests/conftest.py's ``device`` is a pyfa one)."""
    if request.param == "cuda" and _cuda_ok():
        pytest.skip(_cuda_ok())
    return torch.device(request.param)


class Calls:
    """Counts the pyfa calls the integration makes: decode, unmasked prefill and
    masked prefill, with the windows they were given, attends of pyfa caches, the
    prepared decode steps of dense PyfaCache layers (append + decode), and decode
    steps over runs of slots (``runs``: static caches, padded batches)."""

    def __init__(self, monkeypatch):
        self.decode, self.prefill, self.masked, self.windows, self.attend, self.step = 0, 0, 0, set(), 0, 0
        self.runs = 0
        self.rows = 0  # of the decodes: those the repeat path ran from the layer's query (pyfa.decode.decode_rows)
        decode, attention, over_runs = pyfa.decode_attention, pyfa.attention, pyfa_hf._decode_over_runs
        if _hf_cache is not None:
            def counted_step(prepared, *a, _run=_hf_cache._DenseStep.run):
                self.step += 1
                return _run(prepared, *a)

            monkeypatch.setattr(_hf_cache._DenseStep, "run", counted_step)
        for cls in (pyfa.KVCache, pyfa.TurboQuantKVCache):
            def counted_attend(cache, *a, _attend=cls.attend, **k):
                self.attend += 1
                return _attend(cache, *a, **k)

            monkeypatch.setattr(cls, "attend", counted_attend)

        def counted_decode(*a, **k):
            self.decode += 1
            self.windows.add(k.get("window"))
            return decode(*a, **k)

        def counted_attention(*a, **k):
            if k.get("mask") is None:
                self.prefill += 1
                self.windows.add(k.get("window"))
            else:
                self.masked += 1
            return attention(*a, **k)

        def counted_runs(*a, **k):
            self.runs += 1
            return over_runs(*a, **k)

        def counted_rows(*a, _rows=pyfa_hf.decode_rows):
            out = _rows(*a)
            if out is not None:  # the repeat path ran the decode (a window never takes it)
                self.decode += 1
                self.rows += 1
                self.windows.add(None)
            return out

        monkeypatch.setattr(pyfa, "decode_attention", counted_decode)
        monkeypatch.setattr(pyfa_hf, "decode_rows", counted_rows)
        monkeypatch.setattr(pyfa_hf, "_decode_over_runs", counted_runs)
        monkeypatch.setattr(pyfa, "attention", counted_attention)


@pytest.fixture
def calls(monkeypatch):
    return Calls(monkeypatch)


def _use(model, impl: str):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:  # transformers < 4.5x: layers read the config at each forward
        model.config._attn_implementation = impl
    return model


VOCAB = 256
_MODELS = {  # kind: (config class, model class, extra config)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(query_pre_attn_scalar=64, final_logit_softcapping=None)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(query_pre_attn_scalar=64, sliding_window=8,
                                                           layer_types=["sliding_attention", "full_attention"])),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                                        layer_types=["sliding_attention", "full_attention"])),
}


def _model(kind: str, device, dtype=torch.float32, **overrides):
    """A 2-layer model of ``kind`` with random weights: hidden 128, 4 query heads over 2 KV
    heads of dim 64 (GQA), vocabulary 256. gpt-oss sinks get N(0, 2) logits so that they act."""
    config_class, model_class, extra = _MODELS[kind]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=256, vocab_size=VOCAB, **{**extra, **overrides})
    model = getattr(transformers, model_class)(cfg).eval()
    if kind == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model.to(device=device, dtype=dtype)


def _ids(device, B=2, L=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (B, L), generator=g).to(device)


def _left_padded(ids, pad=5):
    """A 2-D attention mask with the second sequence's first ``pad`` tokens as padding."""
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return mask


@torch.no_grad()
def _logits(model, impl, ids, mask=None, **kw):
    return _use(model, impl)(ids, attention_mask=mask, **kw).logits


@torch.no_grad()
def _generate(model, impl, ids, mask=None, n=12, **kw):
    mask = torch.ones_like(ids) if mask is None else mask
    out = _use(model, impl).generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                                      **kw)
    return out[:, ids.shape[1]:]


# --------------------------------------------------------------------------- float32 against eager

def test_llama_logits(torch_device, calls):
    model, ids = _model("llama", torch_device), _ids(torch_device)
    ref = _logits(model, "eager", ids, use_cache=False)
    got = _logits(model, NAME, ids, use_cache=False)
    torch.testing.assert_close(got, ref, **F32_TOL)
    assert (calls.prefill, calls.masked, calls.decode) == (2, 0, 0)  # one unmasked causal call per layer


def test_llama_padded_logits(torch_device, calls):
    model, ids = _model("llama", torch_device), _ids(torch_device)
    mask = _left_padded(ids)
    ref = _logits(model, "eager", ids, mask, use_cache=False)
    got = _logits(model, NAME, ids, mask, use_cache=False)
    real = mask.bool()  # padded query rows are garbage on both sides (no key visible)
    torch.testing.assert_close(got[real], ref[real], **F32_TOL)
    assert calls.masked == 2 and calls.prefill == 0


def test_llama_greedy_generation(torch_device, calls):
    model, ids = _model("llama", torch_device), _ids(torch_device)
    ref = _generate(model, "eager", ids)
    got = _generate(model, NAME, ids)
    assert torch.equal(got, ref), (got, ref)
    # The prefill (one unmasked call per layer), then decode calls only.
    assert calls.prefill == 2 and calls.masked == 0 and calls.decode == 2 * (ref.shape[1] - 1)


def test_llama_padded_greedy_generation(torch_device, calls):
    model, ids = _model("llama", torch_device), _ids(torch_device)
    mask = _left_padded(ids)
    ref = _generate(model, "eager", ids, mask)
    got = _generate(model, NAME, ids, mask)
    assert torch.equal(got, ref), (got, ref)
    # The padded prompt takes the masked prefill (one call a layer); each decode step reads each
    # sequence's real tokens as one run of slots (ring_start at its first) with the decode kernel.
    assert calls.masked == 2 and calls.prefill == 0 and calls.decode == 2 * (ref.shape[1] - 1)


def test_cached_continuation_is_bottom_right(torch_device, calls):
    """A second chunk of 6 queries over 16 cached keys: the unmasked causal call
    (pyfa's bottom-right alignment) equals the full sequence's last rows."""
    model, ids = _model("llama", torch_device), _ids(torch_device)
    full = _logits(model, "eager", ids, use_cache=False)
    with torch.no_grad():
        _use(model, NAME)
        cache = transformers.DynamicCache()
        # transformers 5.x renames past_key_values to cache (the old name warns)
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        model(ids[:, :10], use_cache=True, **{name: cache})
        calls.prefill = 0
        rest = model(ids[:, 10:], use_cache=True, **{name: cache}).logits
    torch.testing.assert_close(rest, full[:, 10:], **F32_TOL)
    assert calls.prefill == 2 and calls.masked == 0


def _static_generate(model, impl, ids, mask=None, n=8, **kw):
    try:
        return _generate(model, impl, ids, mask, n=n, cache_implementation="static", **kw)
    except (TypeError, ValueError) as e:  # this transformers has no such options
        pytest.skip(f"static-cache generation unavailable here: {e}")


@pytest.mark.parametrize("padded", [False, True])
def test_static_cache_generation(torch_device, calls, padded):
    """Static caches hand the whole cache (zeros past the sequence) with a mask. The prompt is
    causal over the cache's first keys (the masked prefill when padded); each decode step reads
    each sequence's tokens as one run of slots (after its left padding) with the decode kernel,
    through the torch operator."""
    model, ids = _model("llama", torch_device), _ids(torch_device)
    mask = _left_padded(ids) if padded else None
    ref = _static_generate(model, "eager", ids, mask, disable_compile=True)
    got = _static_generate(model, NAME, ids, mask, disable_compile=True)
    assert torch.equal(got, ref), (got, ref)
    # The prompt: causal over the cache's first keys (unmasked) or, padded, the masked prefill.
    assert (calls.masked, calls.prefill) == ((2, 0) if padded else (0, 2))
    assert calls.decode == calls.runs == 2 * (ref.shape[1] - 1)
    if not padded:
        with torch.inference_mode():  # masks without a version counter: checked, not remembered by version
            assert torch.equal(_static_generate(model, NAME, ids, mask, disable_compile=True), ref)


def test_static_cache_generation_with_sinks_and_windows(torch_device, calls):
    """gpt-oss over a static cache: its full layer's decode steps take the runs with the LSE
    (sinks); its sliding layer (transformers' rolling static window) the masked path."""
    model, ids = _model("gpt_oss", torch_device), _ids(torch_device, L=24)
    mask = _left_padded(ids)
    ref = _static_generate(model, "eager", ids, mask, disable_compile=True)
    got = _static_generate(model, NAME, ids, mask, disable_compile=True)
    assert torch.equal(got, ref), (got, ref)
    # Both layers decode; the sliding one's built mask is recognised as causal with its window.
    assert calls.runs == ref.shape[1] - 1 and calls.decode == 2 * (ref.shape[1] - 1)


def _compile_config(device):
    """generate's compile options: on a GPU transformers' defaults (inductor, CUDA graphs), whole
    graph; on the CPU dynamo alone (the "eager" backend), so tracing is what is tested."""
    config = transformers.CompileConfig(fullgraph=True)
    if device.type == "cpu":
        config = transformers.CompileConfig(fullgraph=True, backend="eager", mode=None)
        config._compile_all_devices = True
    return config


@pytest.mark.parametrize("padded", [False, True])
def test_static_cache_compiled_generation(torch_device, calls, padded):
    """generate compiles a static cache's decode steps (fullgraph: a graph break would raise);
    pyfa's attention is one operator of that graph. Tokens equal eager attention's."""
    from torch._dynamo.utils import counters

    if not hasattr(transformers, "CompileConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no CompileConfig")
    model, ids = _model("llama", torch_device), _ids(torch_device)
    mask = _left_padded(ids) if padded else None
    ref = _static_generate(model, "eager", ids, mask, disable_compile=True)
    torch._dynamo.reset()
    counters.clear()
    got = _static_generate(model, NAME, ids, mask, compile_config=_compile_config(torch_device))
    assert torch.equal(got, ref), (got, ref)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert calls.decode == 2 * (ref.shape[1] - 1)  # the operator ran pyfa's decode at every step


def test_mistral_sliding_window(torch_device, calls):
    """24 tokens through an 8-token window: the window binds, and transformers'
    convention (p - j < W) is pyfa's window=W."""
    model, ids = _model("mistral", torch_device, sliding_window=8), _ids(torch_device, L=24)
    ref = _logits(model, "eager", ids, use_cache=False)
    got = _logits(model, NAME, ids, use_cache=False)
    torch.testing.assert_close(got, ref, **F32_TOL)
    assert calls.masked == 0 and calls.windows == {8}  # the window mask was recognised, not read
    assert torch.equal(_generate(model, NAME, ids), _generate(model, "eager", ids))


def test_gemma2_softcap_and_alternating_windows(torch_device, calls):
    # Larger weights so that scores reach the cap (at the default 0.02 it would barely act).
    model, ids = _model("gemma2", torch_device, sliding_window=8, attn_logit_softcapping=1.0, initializer_range=0.2), \
        _ids(torch_device, L=24)
    ref = _logits(model, "eager", ids, use_cache=False)
    got = _logits(model, NAME, ids, use_cache=False)
    torch.testing.assert_close(got, ref, **F32_TOL)
    assert calls.windows == {8, None}  # one sliding and one full layer
    uncapped = _model("gemma2", torch_device, sliding_window=8, attn_logit_softcapping=None, initializer_range=0.2)
    assert (_logits(uncapped, "eager", ids, use_cache=False) - ref).abs().max() > 100 * F32_TOL["atol"], \
        "the softcap should change these logits, or this test checks nothing"
    mask = _left_padded(ids)
    assert torch.equal(_generate(model, NAME, ids, mask), _generate(model, "eager", ids, mask))


# --------------------------------------------------------------------------- the functions themselves

def _qkv(device, B=2, H=4, Hkv=2, q_len=5, kv_len=9, D=64, seed=3):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g).to(device) for s in
               ((B, H, q_len, D), (B, Hkv, kv_len, D), (B, Hkv, kv_len, D)))
    return q, k, v


class _Module(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.head_dim = groups, True, 64


def _eager(q, k, v, mask):
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward(_Module(q.shape[1] // k.shape[1]), q, k, v, mask, scaling=0.125)[0]


def _additive_causal(q_len, kv_len, device):
    """transformers' eager-style causal mask [2, 1, q_len, kv_len]: 0 or finfo.min."""
    visible = pyfa_hf._causal_pattern(q_len, kv_len, None, device)
    return torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None].expand(2, 1, q_len, kv_len)


@pytest.mark.parametrize("q_len", [1, 5])
def test_forward_recognises_a_plain_causal_float_mask(torch_device, calls, q_len):
    """A 4-D additive causal mask from elsewhere (older transformers, users) takes the unmasked kernels."""
    q, k, v = _qkv(torch_device, q_len=q_len)
    mask = _additive_causal(q_len, 9, torch_device)
    got, weights = pyfa_hf.attention_forward(_Module(2), q, k, v, mask, scaling=0.125)
    assert weights is None and got.shape == (2, q_len, 4, 64) and got.dtype == q.dtype
    torch.testing.assert_close(got, _eager(q, k, v, mask), **F32_TOL)
    assert calls.masked == 0 and calls.decode + calls.prefill == 1


@pytest.mark.parametrize("expand_bytes", [pyfa_hf._EXPAND_BYTES, 0])
def test_forward_applies_a_padding_mask(torch_device, calls, monkeypatch, expand_bytes):
    """A per-sequence mask runs as one call ([B, H, q, kv] expanded) or, past the
    size limit, one call per sequence; both equal eager attention."""
    monkeypatch.setattr(pyfa_hf, "_EXPAND_BYTES", expand_bytes)
    q, k, v = _qkv(torch_device)
    mask = _additive_causal(5, 9, torch_device).clone()
    mask[1, :, :, :3] = torch.finfo(torch.float32).min  # sequence 1: three padded keys
    got, _ = pyfa_hf.attention_forward(_Module(2), q, k, v, mask, scaling=0.125)
    torch.testing.assert_close(got, _eager(q, k, v, mask), **F32_TOL)
    assert calls.masked == (1 if expand_bytes else 2)


def test_mask_function_skips_only_what_the_kernels_do_exactly():
    kw = dict(batch_size=2, q_length=4, kv_length=12, q_offset=8, kv_offset=0, device="cpu")
    assert pyfa_hf.attention_mask(**kw) is None  # bottom-right causal, no padding
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[1, 0] = False
    padded = pyfa_hf.attention_mask(**kw, attention_mask=padding)
    assert padded is not None and not padded[1, 0, :, 0].any() and padded[0, 0, :, 0].all()
    static = pyfa_hf.attention_mask(**{**kw, "kv_length": 16})  # keys past the queries
    assert static is not None and not static[..., 12:].any()
    assert pyfa_hf._PREFIX.get(static, (4, 16)) == (True, 12)  # ... causal over the first 12: unmasked
    from transformers import masking_utils as mu

    sliding = mu.sliding_window_causal_mask_function(3)
    windowed = pyfa_hf.attention_mask(**kw, local_size=3, mask_function=sliding)  # the window binds
    assert windowed is not None and pyfa_hf._CAUSAL.get(windowed, (4, 12)) == (True, 3)  # ... and is recognised
    chunked = mu.chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long))  # local_size means a chunk here
    blocks = pyfa_hf.attention_mask(**{**kw, "q_length": 2, "q_offset": 10}, local_size=3, mask_function=chunked)
    assert blocks is not None and pyfa_hf._CAUSAL.get(blocks, (2, 12)) == (False, None)
    assert pyfa_hf.attention_mask(**kw, allow_is_causal_skip=False) is not None


def test_decode_runs_describe_each_sequences_visible_keys():
    """A decode step's mask (q_length 1, plain causal): with a static cache's device offset, the
    runs description (kv_len, ring_start, whole) without a host read; with a dynamic cache's int
    offset None (no padding), the runs (left padding) or a built mask (a hole)."""
    from transformers import masking_utils as mu

    padding = torch.ones(3, 10, dtype=torch.bool)
    padding[1, :4] = False  # left padding: positions 4..9
    padding[2, 3:5] = False  # a hole (right padding, then generated tokens)
    kw = dict(batch_size=3, q_length=1, kv_offset=0, mask_function=mu.causal_mask_function, device="cpu")
    runs = pyfa_hf.attention_mask(**kw, kv_length=16, q_offset=torch.tensor(9), attention_mask=padding,
                                  allow_is_causal_skip=False)
    assert pyfa_hf.is_decode_runs(runs) and runs.shape == (3, 3, 1, 1)
    assert runs.view(3, 3).tolist() == [[10, 6, 8], [0, 4, 0], [1, 1, 0]]
    built = mu.sdpa_mask(**{**kw, "q_length": 1}, kv_length=16, q_offset=9, attention_mask=padding,
                         allow_is_causal_skip=False)
    assert torch.equal(pyfa_hf.runs_as_mask(runs, 16)[:2], built[:2])  # the whole sequences' masks
    static = pyfa_hf.attention_mask(**kw, kv_length=16, q_offset=torch.tensor(9))
    assert static.view(3, 3).tolist() == [[10] * 3, [0] * 3, [1] * 3]
    short = pyfa_hf.attention_mask(**kw, kv_length=16, q_offset=torch.tensor(9), attention_mask=padding[:, :8],
                                   allow_is_causal_skip=False)  # keys 8 and 9 past the mask's end: padding
    assert short.view(3, 3).tolist() == [[8, 4, 6], [0, 4, 0], [1, 1, 0]]
    assert torch.equal(pyfa_hf.runs_as_mask(short, 16)[:2],
                       mu.sdpa_mask(**kw, kv_length=16, q_offset=9, attention_mask=padding[:, :8],
                                    allow_is_causal_skip=False)[:2])
    dynamic = dict(kw, kv_length=10, q_offset=9)
    assert pyfa_hf.attention_mask(**dynamic, attention_mask=torch.ones(3, 10, dtype=torch.bool)) is None
    left = padding.clone()
    left[2] = True
    assert pyfa_hf.attention_mask(**dynamic, attention_mask=left).view(3, 3).tolist() == \
        [[10, 6, 10], [0, 4, 0], [1, 1, 1]]
    holes = pyfa_hf.attention_mask(**dynamic, attention_mask=padding)
    assert holes.dtype == torch.bool and holes.shape == (3, 1, 1, 10)  # built: the masked path is exact
    windowed = pyfa_hf.attention_mask(**{**dynamic, "mask_function": mu.sliding_window_causal_mask_function(4)},
                                      local_size=4)
    assert not pyfa_hf.is_decode_runs(windowed)


def test_forward_over_decode_runs(torch_device):
    """attention_forward given the runs of a static cache's step: each sequence equals eager
    attention over its mask; a sequence with a hole is NaN, never a plausible wrong row."""
    from transformers import masking_utils as mu

    q, k, v = _qkv(torch_device, B=3, q_len=1, kv_len=16)
    padding = torch.ones(3, 10, dtype=torch.bool, device=torch_device)
    padding[1, :4] = False
    padding[2, 3:5] = False
    kw = dict(batch_size=3, q_length=1, kv_length=16, kv_offset=0, mask_function=mu.causal_mask_function,
              attention_mask=padding, device=torch_device)
    runs = pyfa_hf.attention_mask(**kw, q_offset=torch.tensor(9, device=torch_device), allow_is_causal_skip=False)
    built = mu.sdpa_mask(**kw, q_offset=9, allow_is_causal_skip=False)
    with torch.no_grad():
        got, _ = pyfa_hf.attention_forward(_Module(2), q, k, v, runs, scaling=0.125)
        ref = _eager(q, k, v, torch.where(built, 0.0, torch.finfo(torch.float32).min))
    torch.testing.assert_close(got[:2], ref[:2], **F32_TOL)
    assert got[2].isnan().all()


def test_refusals(torch_device):
    q, k, v = _qkv(torch_device)
    with pytest.raises(NotImplementedError, match="s_aux"):  # one sink logit per query head
        pyfa_hf.attention_forward(_Module(2), q, k, v, None, s_aux=torch.zeros(2, device=torch_device))
    with pytest.raises(NotImplementedError, match="inference-only"):
        pyfa_hf.attention_forward(_Module(2), q.requires_grad_(), k, v, None)
    module = _Module(2).train()
    with pytest.raises(NotImplementedError, match="dropout"):
        pyfa_hf.attention_forward(module, q.detach(), k, v, None, dropout=0.1)


def test_decode_steps_take_the_repeat_path(torch_device, calls):
    """A decode call of a shape the thread ran before goes from the layer's ``[B, H, 1, D]`` query
    straight into ``[B, 1, H, D]`` (pyfa.decode.decode_rows, CUDA tensors), with the full call's
    bits, also over a cache grown by a row; what the full path refuses is still refused."""
    q, k, v = _qkv(torch_device, q_len=1, kv_len=10)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a projection's [B, 1, H, D] memory, as transformers'
    first, _ = pyfa_hf.attention_forward(_Module(2), q, k[:, :, :9], v[:, :, :9], None, scaling=0.125)
    assert (calls.decode, calls.rows) == (1, 0)
    again, _ = pyfa_hf.attention_forward(_Module(2), q, k[:, :, :9].contiguous(), v[:, :, :9].contiguous(), None,
                                         scaling=0.125)
    grown, _ = pyfa_hf.attention_forward(_Module(2), q, k, v, None, scaling=0.125)
    fast = 2 if torch_device.type == "cuda" else 0  # CPU tensors go to the cpu backend as numpy arrays
    assert (calls.decode, calls.rows) == (3, fast)
    for got in (first, again, grown):
        assert got.shape == (2, 1, 4, 64) and got.dtype == q.dtype and got.is_contiguous()
    assert torch.equal(again, first)
    torch.testing.assert_close(first, _eager(q, k[:, :, :9], v[:, :, :9], None), **F32_TOL)
    torch.testing.assert_close(grown, _eager(q, k, v, None), **F32_TOL)
    with pytest.raises(NotImplementedError, match="inference-only"):
        pyfa_hf.attention_forward(_Module(2), q.clone().requires_grad_(), k, v, None, scaling=0.125)
    with pytest.raises(NotImplementedError, match="dropout"):
        pyfa_hf.attention_forward(_Module(2).train(), q, k, v, None, scaling=0.125, dropout=0.1)
    with pytest.raises(NotImplementedError, match="s_aux"):
        pyfa_hf.attention_forward(_Module(2), q, k, v, None, scaling=0.125, s_aux=torch.zeros(2, device=q.device))
    assert calls.rows == fast
    # Options the repeat path does not take go the full path, also once an entry of the shape exists.
    for kw in (dict(softcap=5.0), dict(sliding_window=4), dict(s_aux=torch.zeros(4, device=q.device))):
        pyfa_hf.attention_forward(_Module(2), q, k, v, None, scaling=0.125, **kw)
    assert calls.rows == fast
    # A cache in another dtype than the query's: the full path casts it to the query's, so an
    # entry that a direct decode_attention call over the uncast cache left must not serve it.
    kh, vh = k.half(), v.half()
    pyfa.decode_attention(q.select(2, 0), kh, vh, 10, scale=0.125)
    mixed, _ = pyfa_hf.attention_forward(_Module(2), q, kh, vh, None, scaling=0.125)
    assert calls.rows == fast
    torch.testing.assert_close(mixed, _eager(q, kh.float(), vh.float(), None), **F32_TOL)


# --------------------------------------------------------------------------- Gemma 3, Qwen 3, gpt-oss (sinks)

def test_gemma3_qwen3_logits_and_generation(torch_device, calls):
    """Gemma 3: a sliding (8) and a global layer, q/k norms; Qwen 3: q/k norms, no window."""
    ids = _ids(torch_device, L=24)
    for kind, windows in (("gemma3", {8, None}), ("qwen3", {None})):
        model = _model(kind, torch_device)
        calls.windows = set()
        ref = _logits(model, "eager", ids, use_cache=False)
        torch.testing.assert_close(_logits(model, NAME, ids, use_cache=False), ref, **F32_TOL)
        assert calls.windows == windows and calls.masked == 0, (kind, calls.windows)
        assert torch.equal(_generate(model, NAME, ids), _generate(model, "eager", ids)), kind


def test_gpt_oss_sinks(torch_device, calls):
    """gpt-oss: sinks on every layer, a sliding (8) and a full layer, MoE. Logits of a full
    forward, of a padded batch, and greedy generation (plain and padded) against eager."""
    model, ids = _model("gpt_oss", torch_device), _ids(torch_device, L=24)
    ref = _logits(model, "eager", ids, use_cache=False)
    torch.testing.assert_close(_logits(model, NAME, ids, use_cache=False), ref, **F32_TOL)
    assert calls.windows == {8, None} and calls.masked == 0
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: sinks switched off
    assert (_logits(model, "eager", ids, use_cache=False) - ref).abs().max() > 100 * F32_TOL["atol"], \
        "the sinks should change these logits, or this test checks nothing"
    model = _model("gpt_oss", torch_device)
    mask = _left_padded(ids)
    real = mask.bool()
    torch.testing.assert_close(_logits(model, NAME, ids, mask, use_cache=False)[real],
                               _logits(model, "eager", ids, mask, use_cache=False)[real], **F32_TOL)
    assert torch.equal(_generate(model, NAME, ids), _generate(model, "eager", ids))
    assert torch.equal(_generate(model, NAME, ids, mask), _generate(model, "eager", ids, mask))


@pytest.mark.parametrize("q_len", [1, 5])
def test_forward_sinks_match_gpt_oss_eager(torch_device, q_len):
    """attention_forward with s_aux against gpt-oss's eager_attention_forward, which
    appends the sink as a softmax column and drops it: unmasked and padded."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    q, k, v = _qkv(torch_device, q_len=q_len)
    module = _Module(2)
    module.sinks = torch.nn.Parameter(torch.tensor([-3.0, 0.0, 1.5, 4.0], device=torch_device))
    for mask in (None, _additive_causal(q_len, 9, torch_device).clone()):
        if mask is not None:
            mask[1, :, :, :3] = torch.finfo(torch.float32).min
        full = mask if mask is not None else _additive_causal(q_len, 9, torch_device)
        with torch.no_grad():
            got, _ = pyfa_hf.attention_forward(module, q, k, v, mask, scaling=0.125, s_aux=module.sinks)
            ref = gpt_oss_eager(module, q, k, v, full, scaling=0.125)[0]
        torch.testing.assert_close(got, ref, **F32_TOL)


# --------------------------------------------------------------------------- dtypes

@pytest.mark.parametrize("kind", ["llama", "gemma3", "gpt_oss"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_models(torch_device, kind, dtype):
    """bf16 / f16 logits of a padded batch: pyfa's distance to the float32 reference no worse
    than eager's (module docstring). Token-for-token generation is asserted in float32 only:
    in half precision both implementations round the same logits differently, and these
    random models have near-ties (gaps ~1e-3) that such rounding can flip."""
    dtype = getattr(torch, dtype)
    ids = _ids(torch_device, L=24)
    mask = _left_padded(ids)
    real = mask.bool()
    reference = _logits(_model(kind, torch_device), "eager", ids, mask)[real]
    model = _model(kind, torch_device, dtype)
    errors = {impl: ((_logits(model, impl, ids, mask)[real].float() - reference).norm() / reference.norm()).item()
              for impl in ("eager", NAME)}
    assert errors[NAME] <= 1.5 * errors["eager"] + 1e-3, errors


# --------------------------------------------------------------------------- PyfaCache

def _cache_kwarg(model) -> str:
    # transformers 5.x renames past_key_values to cache (the old name warns)
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _generate_cached(model, ids, mask=None, n=12, **cache_options):
    cache = pyfa_hf.PyfaCache(model.config, max_cache_len=ids.shape[1] + n, **cache_options)
    return _generate(model, NAME, ids, mask, n=n, **{_cache_kwarg(model): cache}), cache


@pytest.mark.parametrize("kind", ["llama", "gemma3", "gpt_oss"])
def test_pyfa_cache_greedy_generation(torch_device, calls, kind):
    """A dense PyfaCache: the same tokens as eager with transformers' cache; the prompt runs
    prefill attention (one call per layer), every later step one decode call per layer for
    the whole batch, nothing else. Gemma 3 and gpt-oss have a sliding layer (window 8 < 24
    tokens): its ring of 8 rows keeps what the window needs (the decode reads it wrapped)."""
    model, ids = _model(kind, torch_device), _ids(torch_device, L=24)
    ref = _generate(model, "eager", ids)
    got, cache = _generate_cached(model, ids)
    assert torch.equal(got, ref), (got, ref)
    steps = ref.shape[1] - 1
    assert (calls.prefill, calls.masked, calls.decode + calls.step, calls.attend) == (2, 0, 2 * steps, 0)
    # the prepared step (kv_append + decode in one submission) unless the model has sinks (gpt-oss)
    assert calls.step == (0 if kind == "gpt_oss" else 2 * steps)
    assert cache.get_seq_length() == 24 + steps
    capacities = [layer.capacity for layer in cache.layers]
    assert capacities == ([8, 36] if kind != "llama" else [36, 36])


def test_pyfa_cache_padded_batch_and_continuation(torch_device, calls):
    """Masked steps (a left-padded batch) and a second chunk of queries after the prompt
    read the cached rows back and attend them with the new ones: the same as eager."""
    model, ids = _model("gemma3", torch_device), _ids(torch_device, L=24)
    mask = _left_padded(ids)
    got, _ = _generate_cached(model, ids, mask)
    assert torch.equal(got, _generate(model, "eager", ids, mask))
    assert calls.masked > 0  # the full layer: every step (padding); the sliding one once its window passed the pads
    full = _logits(model, "eager", ids, use_cache=False)
    cache = pyfa_hf.PyfaCache(model.config, max_cache_len=24)
    with torch.no_grad():
        _use(model, NAME)(ids[:, :10], use_cache=True, **{_cache_kwarg(model): cache})
        rest = model(ids[:, 10:], use_cache=True, **{_cache_kwarg(model): cache}).logits
    torch.testing.assert_close(rest, full[:, 10:], **F32_TOL)


@pytest.mark.parametrize("kind", ["gpt_oss", "gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_pyfa_cache_decode_logits(torch_device, dtype, kind, calls):
    """gpt-oss (sinks: a decode call per layer) and Gemma 3 (the prepared append + decode
    step), each with a sliding layer whose window the 16-token prompt outgrows, decoding
    over a dense PyfaCache in the model's dtype against pyfa attention over transformers'
    DynamicCache (checked against eager above): the cache stores the model's rows exactly,
    so the two differ by summation order only (the CPU gives identical bits; a GPU may split
    the keys differently) and, in half precision, by the rounding of each layer's attention
    output: a few of its ulps (bf16 2**-8, f16 2**-11 relative) on logits of order 1,
    bounded by 2e-2 and 4e-3."""
    tol = {"float32": F32_TOL, "bfloat16": dict(rtol=2e-2, atol=2e-2), "float16": dict(rtol=4e-3, atol=4e-3)}[dtype]
    model, ids = _model(kind, torch_device, getattr(torch, dtype)), _ids(torch_device)
    _use(model, NAME)
    with torch.no_grad():
        steps = {}
        for name, cache in (("pyfa", pyfa_hf.PyfaCache(model.config, max_cache_len=20)),
                            ("dynamic", transformers.DynamicCache(config=model.config))):
            kw = {_cache_kwarg(model): cache}
            model(ids, use_cache=True, **kw)
            steps[name] = torch.cat([model(ids[:, i:i + 1], use_cache=True, **kw).logits for i in range(4)], 1)
    torch.testing.assert_close(steps["pyfa"].float(), steps["dynamic"].float(), **tol)
    assert calls.step == (0 if kind == "gpt_oss" else 2 * 4)


def test_turboquant_cache_against_its_dequantised_rows(torch_device):
    """A TurboQuant layer's decode equals exact attention over the rows it dequantises
    (the codes are what it attends), and the model's decode logits approach eager's as the
    bits grow. Bounds from pyfa's codec measurements (pyfa/turboquant.py: relative error of
    an attention output 0.009-0.018 at 8 bits, 0.14-0.23 at 4), which the residual stream
    dilutes in the logits: 8-bit within 2% of the logits' norm (measured 0.4%), 4-bit
    within 30% (measured 6%), and 8-bit closer than 4-bit."""
    model, ids = _model("llama", torch_device), _ids(torch_device)
    ref = _logits(model, "eager", ids, use_cache=False)[:, -4:]
    errors = {}
    for bits in (4, 8):
        cache = pyfa_hf.PyfaCache(model.config, max_cache_len=16, kind="turboquant", k_bits=bits, v_bits=bits)
        kw = {_cache_kwarg(model): cache}
        with torch.no_grad():
            _use(model, NAME)(ids[:, :12], use_cache=True, **kw)
            got = torch.cat([model(ids[:, i:i + 1], use_cache=True, **kw).logits for i in range(12, 16)], 1)
        errors[bits] = ((got - ref).norm() / ref.norm()).item()
        layer = cache.layers[1]
        q = torch.randn(2, 4, 1, 64, generator=torch.Generator().manual_seed(5)).to(torch_device)
        call = pyfa_hf._Call(_Module(2), q, 0.125, None, None, {})
        k, v = layer._read(16)
        got = layer.rows.decode(call, q).transpose(1, 2)
        # ... or over the rows of the f16-rounded codebook, which a kernel may multiply (tq_contract.py)
        rows16 = [tq_contract.cache_rows(c, np.float16) for c in layer.rows.caches]
        k16, v16 = (torch.from_numpy(np.stack([r[i] for r in rows16]).transpose(0, 2, 1, 3).copy()).to(k) for i in (0, 1))
        misses = []
        for kk, vv in ((k, v), (k16, v16)):
            try:
                torch.testing.assert_close(got, _eager(q, kk, vv, None).transpose(1, 2), **F32_TOL)
                break
            except AssertionError as e:
                misses.append(str(e))
        else:
            raise AssertionError("\n".join(misses))
    assert errors[8] < 0.02 and errors[4] < 0.3 and errors[8] < errors[4], errors


@pytest.mark.skipif(_hf_cache is None, reason="PyfaCache needs transformers 5's cache-layer API")
def test_pyfa_cache_failed_step_writes_nothing(torch_device, monkeypatch):
    """A dense layer's prepared step (append and decode recorded together) whose decode the
    library refuses raises that refusal and leaves the layer as it was: no row written (the
    recorded append is dropped, not run with a later call), the count not advanced; the
    step then runs as if it had never failed, wrapping the ring (capacity 8) like its twin."""
    B, H, Hkv, D, dt = 2, 4, 2, 64, torch.float32
    g = torch.Generator().manual_seed(3)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(torch_device)  # noqa: E731
    prompt = rand(B, Hkv, 7, D), rand(B, Hkv, 7, D)
    rows = [_hf_cache._DenseRows(prompt[0], 8) for _ in range(2)]
    q = rand(B, H, 1, D)
    call = pyfa_hf._Call(_Module(2), q, None, None, None, {})
    steps = [(rand(B, Hkv, 1, D), rand(B, Hkv, 1, D), rand(B, H, 1, D)) for _ in range(3)]
    for r in rows:
        r.append(*prompt)
        r.step(call, steps[0][2], *steps[0][:2])
    assert rows[1].prepared is not None
    kept = (rows[1].stored, rows[1].k.clone(), rows[1].v.clone())
    real = _hf_cache.lib

    class Refusing:  # the decode run asks for a capacity larger than the tensors: the library refuses it
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def pyfa_decode_run(plan, enc, args):
            kept_capacity, args.kv_capacity = args.kv_capacity, 1 << 30
            try:
                return real.pyfa_decode_run(plan, enc, args)
            finally:
                args.kv_capacity = kept_capacity

    monkeypatch.setattr(_hf_cache, "lib", Refusing())
    with pytest.raises(pyfa.InvalidArgumentError, match="k_cache"):
        rows[1].step(call, steps[1][2], *steps[1][:2])
    monkeypatch.setattr(_hf_cache, "lib", real)
    rows[1].decode(call, q)  # another call on this thread's encoder: a recorded append kept would run with it
    assert rows[1].stored == kept[0] and torch.equal(rows[1].k, kept[1]) and torch.equal(rows[1].v, kept[2])
    for k, v, query in steps[1:]:  # past the ring's end: stored 9, then 10 of capacity 8
        outs = [r.step(call, query, k, v) for r in rows]
        assert torch.equal(outs[0], outs[1])
    assert torch.equal(rows[0].k, rows[1].k) and torch.equal(rows[0].v, rows[1].v)
    torch.testing.assert_close(outs[1].transpose(1, 2), _eager(query, *rows[1].read(8), None).transpose(1, 2),
                               **F32_TOL)


def test_pyfa_cache_refusals(torch_device):
    model, ids = _model("llama", torch_device), _ids(torch_device)
    cfg = model.config
    for bad, match in ((dict(max_cache_len=0), "max_cache_len"), (dict(max_cache_len=True), "max_cache_len"),
                       (dict(kind="int8"), "kind"), (dict(kind="turboquant", k_bits=5), "k_bits"),
                       (dict(kind="turboquant", v_bits=1), "v_bits")):
        with pytest.raises(pyfa.InvalidArgumentError, match=match):
            pyfa_hf.PyfaCache(cfg, **{"max_cache_len": 8, **bad})
    with pytest.raises(pyfa.InvalidArgumentError, match="config"):
        pyfa_hf.PyfaCache({"num_hidden_layers": 2}, max_cache_len=8)
    chunked = transformers.LlamaConfig(num_hidden_layers=1, layer_types=["chunked_attention"])
    chunked.attention_chunk_size = 4
    with pytest.raises(pyfa.InvalidArgumentError, match="chunked_attention"):
        pyfa_hf.PyfaCache(chunked, max_cache_len=8)
    with pytest.raises(pyfa.InvalidArgumentError, match="attn_implementation='eager'"):
        _generate(model, "eager", ids, **{_cache_kwarg(model): pyfa_hf.PyfaCache(cfg, max_cache_len=40)})
    with pytest.raises(pyfa.PyfaError, match="capacity"):  # 16 prompt tokens + 12 new > 20
        _generate(model, NAME, ids, **{_cache_kwarg(model): pyfa_hf.PyfaCache(cfg, max_cache_len=20)})
    cache, (k, v) = pyfa_hf.PyfaCache(cfg, max_cache_len=8), _qkv(torch_device, B=1)[1:]
    cache.update(k, v, 0)
    with pytest.raises(pyfa.InvalidArgumentError, match="did not receive the rows"):  # no attention call between
        cache.update(k, v, 1)
    assert pyfa_hf._take_pending(k, v) is cache.layers[0]
    with pytest.raises(pyfa.InvalidArgumentError, match="key_states"):  # the layer holds one sequence
        cache.update(torch.cat([k, k]), torch.cat([v, v]), 0)
    with pytest.raises(NotImplementedError, match="beam"):
        _generate(model, NAME, ids, num_beams=2, **{_cache_kwarg(model): pyfa_hf.PyfaCache(cfg, max_cache_len=40)})
