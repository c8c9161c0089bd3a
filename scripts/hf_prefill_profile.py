#!/usr/bin/env python3
"""Where a transformers prefill spends its GPU time, per attention implementation:
one forward over a random prompt (as generate's first step makes it: a DynamicCache,
an all-ones padding mask, logits of the last token only) on the model of
hf_generate_bench.py, timed with CUDA events (median of --repeats, after one untimed
forward), then once under torch.profiler: the kernels grouped by name, largest first.

    python3 scripts/hf_prefill_profile.py --prompt 32768 --batch 1 --impls sdpa pyfa
"""
from __future__ import annotations

import argparse
import inspect
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--impls", nargs="+", default=["sdpa", "pyfa"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=12, help="kernel groups printed per implementation")
    args = ap.parse_args(argv)

    import torch
    import transformers

    import hf_generate_bench as bench
    from pyfa.integrations import transformers as pyfa_hf

    transformers.logging.set_verbosity_error()
    pyfa_hf.register()
    model_args = bench.parse(["--prompts", str(args.prompt)])
    device = torch.device("cuda")
    model, _ = bench.build_model(model_args, torch, transformers, device, torch.bfloat16)
    ids = torch.randint(3, model_args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    def forward():
        with torch.no_grad():
            return model(ids, attention_mask=torch.ones_like(ids), use_cache=True,
                         past_key_values=transformers.DynamicCache(), **keep)

    for impl in args.impls:
        bench.use(model, impl)
        forward()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            forward()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            forward()
            torch.cuda.synchronize()
        groups = defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type.name == "CUDA":
                g = groups[e.name[:90]]
                g[0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                g[1] += 1
        busy = sum(g[0] for g in groups.values()) / 1e3
        print(f"== {impl}: B {args.batch}, prompt {args.prompt}: forward {statistics.median(times):.1f} ms "
              f"(runs {', '.join(f'{t:.1f}' for t in times)}), kernels {busy:.1f} ms under the profiler", flush=True)
        for name, (us, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"  {us / 1e3:9.2f} ms  {n:5d}x  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
