#!/usr/bin/env python3
"""The attention part of a transformers decode step, timed on its own: for each of a model's
layers, the cache's ``update`` and the attention implementation's call, as a transformers
model makes them, with nothing else of the model between them. Generation
(scripts/hf_generate_bench.py) is host-bound at batch 1, and its host drifts by 10% between
runs; this loop measures the difference the attention path makes per layer.

Implementations, taking turns within one process (each figure the median of its rounds):

- ``sdpa``: transformers' ``DynamicCache`` (each update concatenates) and its sdpa function;
- ``pyfa``: ``DynamicCache`` and pyfa's attention function;
- ``pyfa-cache``: a dense :class:`PyfaCache` and pyfa's attention function;
- ``pyfa-cache@PATH`` (with ``--cache-module PATH``): the same with another copy of
  ``pyfa/integrations/_hf_cache.py`` (an A/B of that file).

Per implementation: microseconds per decode step of ``--layers`` layers (wall time of a
round of ``--steps`` steps over the number of steps, the GPU synchronised at the round's
end), and per layer. Every round starts from the prompt's cache (the caches are rewound),
so the first round has met every length the others time.

    python3 scripts/hf_attention_bench.py [--batches 1 8] [--context 2048] [--json out.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the pyfa next to this script


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--context", type=int, default=2048, help="tokens in each cache before the timed steps")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=32, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--impls", nargs="+", default=["sdpa", "pyfa", "pyfa-cache"])
    ap.add_argument("--cache-module", help="another _hf_cache.py, timed as pyfa-cache@PATH beside the others")
    ap.add_argument("--json", help="write the rows here")
    return ap.parse_args(argv)


def load_cache_module(path: str):
    """A copy of pyfa/integrations/_hf_cache.py loaded as a sibling module (its relative
    imports resolve inside pyfa.integrations)."""
    spec = importlib.util.spec_from_file_location("pyfa.integrations._hf_cache_ab", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class Module:
    """What the attention functions read of a transformers attention module."""

    def __init__(self, groups: int, layer: int):
        self.is_causal, self.training, self.num_key_value_groups, self.layer_idx = True, False, groups, layer


def main(argv=None) -> int:
    args = parse(argv)
    import torch
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import pyfa.integrations.transformers as pyfa_hf

    name = pyfa_hf.register()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    H, Hkv, D, layers = args.heads, args.kv_heads, args.head_dim, args.layers
    cfg = transformers.LlamaConfig(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=Hkv, head_dim=D,
                                   num_hidden_layers=layers, intermediate_size=64, vocab_size=64)
    cfg._attn_implementation = name
    modules = [Module(H // Hkv, i) for i in range(layers)]
    cache_modules = {"pyfa-cache": pyfa_hf.PyfaCache}
    impls = list(args.impls)
    if args.cache_module:
        label = f"pyfa-cache@{args.cache_module}"
        cache_modules[label] = load_cache_module(args.cache_module).PyfaCache
        impls.append(label)
    capacity = args.context + args.steps
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"attention of a decode step: {layers} layers, heads {H}/{Hkv}, D {D}, {args.dtype}, context "
          f"{args.context}; {gpu}, torch {torch.__version__}, transformers {transformers.__version__}")
    rows = []
    for B in args.batches:
        g = torch.Generator(device="cpu").manual_seed(0)
        rand = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
        prompt_q, prompt_kv = rand(B, H, args.context, D), rand(B, Hkv, args.context, D)
        q, k, v = rand(B, H, 1, D), rand(B, Hkv, 1, D), rand(B, Hkv, 1, D)
        runs = {}
        for impl in impls:
            attend = sdpa_attention_forward if impl == "sdpa" else pyfa_hf.attention_forward
            if impl in ("sdpa", "pyfa"):
                cache = transformers.DynamicCache(config=cfg)
            else:
                cache = cache_modules[impl](cfg, max_cache_len=capacity)
            with torch.no_grad():
                for i in range(layers):  # the prompt: what generate's prefill leaves in the cache
                    kk, vv = cache.update(prompt_kv, prompt_kv, i)
                    attend(modules[i], prompt_q, kk, vv, None, scaling=None, dropout=0.0)
            runs[impl] = (cache, attend)
        sync()

        def step(cache, attend):
            for i in range(layers):
                kk, vv = cache.update(k, v, i)
                attend(modules[i], q, kk, vv, None, scaling=None, dropout=0.0)

        def rewind(cache, n):
            """The cache as it was ``n`` steps ago, so every round sees the same lengths (torch's
            cuDNN attention builds a plan per new length: generation meets each length once per
            token; a warmed-up round here meets only lengths it has seen)."""
            if isinstance(cache, transformers.DynamicCache):
                cache.crop(args.context)
                return
            for layer in cache.layers:
                layer.stored -= n
                layer.cumulative_length -= n
                layer.rows.stored -= n

        times = {impl: [] for impl in impls}
        with torch.no_grad():
            for r in range(args.rounds + 1):  # round 0 warms up (plans, kernels, allocator)
                for impl in impls:
                    cache, attend = runs[impl]
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        step(cache, attend)
                    sync()
                    if r:
                        times[impl].append((time.perf_counter() - t0) / args.steps * 1e6)
                    rewind(cache, args.steps)
        base = statistics.median(times[impls[0]])
        for impl in impls:
            us = statistics.median(times[impl])
            row = dict(batch=B, context=args.context, impl=impl, step_us=round(us, 1),
                       layer_us=round(us / layers, 2), vs_first=round(us / base, 3),
                       min_step_us=round(min(times[impl]), 1))
            rows.append(row)
            print(json.dumps(row))
    print(f"\n| B | impl | step µs ({layers} layers) | per layer µs | vs {impls[0]} |")
    print("|---:|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['batch']} | {row['impl']} | {row['step_us']:.0f} | {row['layer_us']:.1f} | "
              f"{row['vs_first']:.2f}× |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=gpu, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
