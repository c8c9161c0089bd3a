#!/usr/bin/env python3
"""Greedy generation with transformers, attn_implementation "pyfa" beside "sdpa"
in one process on one randomly initialised model (nothing is downloaded).

Default model: a Llama of 16 layers, hidden 4096, 32 query / 8 KV heads (head_dim
128), intermediate 8192, vocab 32000, bf16 (about 2.5 B parameters, 5 GB). Cases:
random prompts of 2K and 32K tokens, batch 1 and 8, 64 new tokens; a case that
runs out of GPU memory is reported as OOM and the others go on.

Implementations (``--impls``, the first is the baseline): any attn_implementation
name ("sdpa", "eager", "pyfa": transformers' DynamicCache, which concatenates each
layer's K and V with the new rows at every step), that name with "-static"
(transformers' StaticCache, written in place, whose decode steps generate compiles with
torch.compile and CUDA graphs: "sdpa-static", "pyfa-static"), "pyfa-cache" (pyfa
attention over a dense PyfaCache: the batch's K and V written in place, one decode
call a layer) and "pyfa-tq4" (a 4-bit TurboQuant PyfaCache).

Per case and implementation: prefill ms (generate's start to the first token's
logits), decode tok/s (batch x (new tokens - 1) over the time from the first to
the last token's logits, the GPU synchronised at each), end-to-end tok/s, and how
many leading tokens agree with sdpa's (random weights make near-ties, so bf16
implementations may part ways; the count is information, not a check). Every
case runs each implementation once untimed at its own prompt length, batch and
number of new tokens before the timed runs: every shape a timed run meets has
been seen (pyfa compiles its kernels on first use; torch's cuDNN attention, which
sdpa picks on Hopper, builds a plan per new sequence length, about 50 ms each).
Then ``--repeats`` timed runs (default 3), the implementations taking turns; each
figure is the median of its runs (batch-1 generation is bound by the host, whose
speed drifts by 10% and more between runs on a shared machine).

    python3 scripts/hf_generate_bench.py [--json hf.json] [--md hf.md]
    python3 scripts/hf_generate_bench.py --quick     # (or --tiny) tiny model, CPU or GPU, seconds
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the pyfa next to this script


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompts", type=int, nargs="+", default=[2048, 32768], help="prompt lengths")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per implementation (median reported)")
    ap.add_argument("--impls", nargs="+", default=["sdpa", "sdpa-static", "pyfa", "pyfa-static", "pyfa-cache"],
                    help="first is the baseline of the ratio; attn_implementation names (+ -static), pyfa-cache, "
                         "pyfa-tq4")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--quick", "--tiny", action="store_true", help="tiny model and prompts: a smoke run")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--md", help="write the markdown table here")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.vocab = 2, 256, 4, 2, 512, 1000
        args.impls = args.impls + [i for i in ("pyfa-tq4",) if i not in args.impls]
        args.prompts, args.batches, args.new_tokens, args.repeats = [64], [1, 2], 8, 1
    return args


def build_model(args, torch, transformers, device, dtype):
    cfg = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        vocab_size=args.vocab, max_position_embeddings=max(args.prompts) + args.new_tokens + 16)
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: 2.5 B parameters on the CPU take minutes
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype).eval(), cfg


def use(model, impl):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl
    return model


def make_stamps(torch, transformers, device):
    """A logits processor that records when each token's logits are ready."""
    class Stamps(transformers.LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return scores

    return Stamps()


# Implementations that run pyfa attention over a PyfaCache: name -> PyfaCache options.
CACHED = {"pyfa-cache": dict(kind="dense"), "pyfa-tq4": dict(kind="turboquant", k_bits=4, v_bits=4)}


def generate(torch, transformers, model, impl, ids, n, device):
    """(output tokens [B, n], prefill s, decode s, total s)."""
    kw = {}
    if impl.endswith("-static"):
        kw["cache_implementation"] = "static"
        impl = impl[:-len("-static")]
    if impl in CACHED:
        from pyfa.integrations import transformers as pyfa_hf

        cache = pyfa_hf.PyfaCache(model.config, max_cache_len=ids.shape[1] + n, **CACHED[impl])
        kw["cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"] = cache
        impl = pyfa_hf.NAME
    use(model, impl)
    stamps = make_stamps(torch, transformers, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, logits_processor=transformers.LogitsProcessorList([stamps]),
                         **kw)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    return out[:, ids.shape[1]:], stamps.times[0] - t0, stamps.times[-1] - stamps.times[0], t1 - t0


def agreement(a, b) -> int:
    """Leading tokens on which every sequence of a and b agree."""
    same = (a == b).all(dim=0)
    return int(same.long().cumprod(0).sum())


def fmt(x, digits=1):
    return "—" if x is None else f"{x:,.{digits}f}"


def markdown(rows, meta) -> str:
    base = meta["impls"][0]
    lines = [f"Greedy generation, {meta['model']}, {meta['dtype']}, {meta['new_tokens']} new tokens; "
             f"{meta['device_name']}, torch {meta['torch']}, transformers {meta['transformers']}; "
             f"each figure the median of {meta.get('repeats', 1)} timed runs.", "",
             f"| prompt | B | impl | prefill ms | decode tok/s | e2e tok/s | decode vs {base} | tokens equal to {base} |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['prompt']} | {r['batch']} | {r['impl']} | {r['error']} | | | | |")
            continue
        ratio = "—" if r.get("decode_ratio") is None else f"{r['decode_ratio']:.2f}×"
        agree = "—" if r.get("agree") is None else f"{r['agree']}/{meta['new_tokens']}"
        lines.append(f"| {r['prompt']} | {r['batch']} | {r['impl']} | {fmt(r['prefill_ms'])} | "
                     f"{fmt(r['decode_tok_s'])} | {fmt(r['e2e_tok_s'])} | {ratio} | {agree} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse(argv)
    import torch
    import transformers

    import pyfa
    from pyfa.integrations import transformers as pyfa_hf

    transformers.logging.set_verbosity_error()
    pyfa_hf.register()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    model, cfg = build_model(args, torch, transformers, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    meta = {
        "model": f"Llama {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads} "
                 f"(D {args.hidden // args.heads}), intermediate {args.intermediate}, vocab {args.vocab}, "
                 f"{n_params / 1e9:.2f} B parameters",
        "dtype": args.dtype, "new_tokens": args.new_tokens, "impls": args.impls, "device": device.type,
        "repeats": args.repeats,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__, "transformers": transformers.__version__, "pyfa_backends": pyfa.backends(),
    }
    print(meta["model"], "on", meta["device_name"], flush=True)
    oom = getattr(torch.cuda, "OutOfMemoryError", RuntimeError)
    rows = []
    g = torch.Generator().manual_seed(1)
    for prompt in args.prompts:
        for batch in args.batches:
            ids = torch.randint(3, args.vocab, (batch, prompt), generator=g).to(device)
            tokens, case = {}, {}
            for impl in args.impls:  # untimed: every shape of the timed runs seen once
                case[impl] = {"prompt": prompt, "batch": batch, "impl": impl, "runs": []}
                try:
                    with torch.inference_mode():
                        generate(torch, transformers, model, impl, ids, args.new_tokens, device)
                except oom:
                    case[impl]["error"] = "OOM"
                except Exception as e:  # one failing case must not hide the others
                    case[impl]["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            for _ in range(args.repeats):  # implementations take turns, so drift hits each alike
                for impl in args.impls:
                    row = case[impl]
                    if row.get("error"):
                        continue
                    try:
                        with torch.inference_mode():
                            out, prefill, decode, total = generate(torch, transformers, model, impl, ids,
                                                                   args.new_tokens, device)
                    except oom:
                        row["error"] = "OOM"
                        continue
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                        continue
                    tokens[impl] = out
                    row["runs"].append({"prefill_ms": prefill * 1e3,
                                        "decode_tok_s": batch * (args.new_tokens - 1) / decode,
                                        "e2e_tok_s": batch * args.new_tokens / total})
            for impl in args.impls:
                row = case[impl]
                if row["runs"]:  # each figure the median of the runs
                    for key in ("prefill_ms", "decode_tok_s", "e2e_tok_s"):
                        row[key] = statistics.median(r[key] for r in row["runs"])
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
            base = next((r for r in rows[-len(args.impls):] if r["impl"] == args.impls[0]), None)
            for r in rows[-len(args.impls):]:
                if base and not base.get("error") and not r.get("error"):
                    r["decode_ratio"] = r["decode_tok_s"] / base["decode_tok_s"]
                    r["agree"] = agreement(tokens[r["impl"]], tokens[args.impls[0]])
    text = markdown(rows, meta)
    print(text)
    if args.md:
        Path(args.md).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 1 if any(r.get("error") and r["error"] != "OOM" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
