"""`python -m pyfa bench`: decode, prefill and TurboQuant decode timed as a
program calls them (the public Python functions), beside torch's
scaled_dot_product_attention on the same shapes when torch is installed;
a table, and a PNG plot of time against context length (needs matplotlib).

Each timing: one warm-up call (plans, kernel compiles), then the median of
--repeats calls each waited for, and a loop of --repeats calls waited for
once at the end (per call: what a model's step sees when calls queue on a
GPU). On CUDA the inputs are torch CUDA tensors (pyfa reads them in place)
and "waited for" is torch.cuda.synchronize(); numpy inputs there would be
copied to the device on every call. Rates: decode and TurboQuant count the
K/V bytes read (TurboQuant: its codes and scales), prefill the FLOPs of the
visible score and value products (4 * D per query-key pair).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import pyfa
from pyfa import turboquant

from . import backend_name
from ._table import Progress, table

OPS = ("decode", "prefill", "tq")
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(pyfa.bfloat16)}
# Default contexts: a laptop CPU times these in seconds; a GPU needs longer ones to leave launch overhead.
DEFAULT_CONTEXTS = {False: {"decode": (1024, 4096, 16384), "prefill": (256, 512, 1024), "tq": (1024, 4096, 16384)},
                    True: {"decode": (4096, 32768, 131072), "prefill": (1024, 4096, 16384),
                           "tq": (4096, 32768, 131072)}}


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def _list(kind, allowed=None):
    def parse(text: str):
        items = [kind(t.strip()) for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r} is an empty list")
        for item in items:
            if allowed is not None and item not in allowed:
                raise argparse.ArgumentTypeError(f"{item!r} is not one of {', '.join(allowed)}")
        return items
    return parse


def add_arguments(p) -> None:
    p.add_argument("--op", type=_list(str, OPS), default=list(OPS), metavar="OPS",
                   help="comma list of decode, prefill, tq (TurboQuantKVCache.attend); default all three")
    p.add_argument("--batch", type=_positive, default=1, help="sequences (tq: that many caches); default 1")
    p.add_argument("--heads", type=_positive, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=_positive, default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=_positive, default=128, help="head dim (default 128)")
    p.add_argument("--context", type=_list(_positive), default=None, metavar="LENGTHS",
                   help="comma list of context lengths (prefill: q_len = kv_len); default per op: "
                        "decode and tq 1024,4096,16384 on a CPU (4096,32768,131072 on a GPU), "
                        "prefill 256,512,1024 (1024,4096,16384)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float16",
                   help="q, K/V and output dtype (default float16; tq: q and torch's dense K/V)")
    p.add_argument("--bits", type=_positive, default=4, help="tq: K and V code width (default 4)")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="prefill without the causal mask")
    p.add_argument("--repeats", type=_positive, default=10, help="calls per timing (default 10)")
    p.add_argument("--no-torch", dest="torch", action="store_false", help="do not time torch SDPA")
    p.add_argument("--plot", default="pyfa_bench.png", metavar="PATH",
                   help="PNG of time against context (default ./pyfa_bench.png; needs matplotlib)")
    p.add_argument("--no-plot", dest="plot", action="store_const", const=None, help="write no plot")


def time_calls(fn, wait, repeats: int, loop: bool = True) -> tuple[float, float | None]:
    """(median seconds of `repeats` calls each followed by wait(), seconds per call of a loop of
    `repeats` calls with one wait() at the end, or None without `loop`), after one warm-up call."""
    fn()
    wait()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        wait()
        samples.append(time.perf_counter() - t0)
    if not loop:
        return statistics.median(samples), None
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    wait()
    return statistics.median(samples), (time.perf_counter() - t0) / repeats


class _Torch:
    """torch, when installed and wanted: tensors on the device's side and a wait for it."""

    def __init__(self, device: pyfa.Device, wanted: bool):
        self.mod, self.why = None, "not asked for (--no-torch)"
        if wanted:
            try:
                import torch
                import torch.nn.functional  # noqa: F401
                self.mod = torch
            except ImportError:
                self.why = "torch is not installed (pip install torch)"
        # pyfa reads torch CUDA tensors in place; on a host-visible device numpy arrays are the native input.
        self.cuda = self.mod is not None and device.backend == "cuda" and self.mod.cuda.is_available()

    def tensor(self, x32: np.ndarray, dtype: np.dtype):
        t = self.mod.from_numpy(x32).to(getattr(self.mod, dtype.name))
        return t.cuda() if self.cuda else t

    def wait(self):
        if self.cuda:
            self.mod.cuda.synchronize()

    def sdpa(self, q, k, v, **kw):
        F = self.mod.nn.functional
        if q.shape[1] != k.shape[1]:
            try:
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
            except TypeError:  # torch < 2.5: no enable_gqa
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(q, k, v, **kw)


def _inputs(rng, torch: _Torch, dtype, *shapes):
    """Random float32 data per shape: for pyfa (numpy of dtype, or torch CUDA tensors) and for torch."""
    data = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    mine = [torch.tensor(x, dtype) if torch.cuda else x.astype(dtype) for x in data]
    theirs = [torch.tensor(x, dtype) for x in data] if torch.mod is not None else None
    return mine, theirs


def bench_one(op, L, args, device, torch: _Torch, dtype) -> dict:
    """One op at one context: pyfa's (median, loop) seconds, its rate, torch's median (or None)."""
    rng = np.random.default_rng(L)
    B, H, Hkv, D = args.batch, args.heads, args.kv_heads, args.head_dim
    theirs_fn = None
    if op == "decode":
        (q, k, v), theirs = _inputs(rng, torch, dtype, (B, H, D), (B, Hkv, L, D), (B, Hkv, L, D))
        mine_fn = lambda: pyfa.decode_attention(q, k, v, L, device=device)  # noqa: E731
        if theirs:
            tq_, tk, tv = theirs
            tq_ = tq_[:, :, None]
            theirs_fn = lambda: torch.sdpa(tq_, tk, tv)  # noqa: E731
        rate = 2 * B * Hkv * L * D * dtype.itemsize, "GB/s"
    elif op == "prefill":
        (q, k, v), theirs = _inputs(rng, torch, dtype, (B, H, L, D), (B, Hkv, L, D), (B, Hkv, L, D))
        mine_fn = lambda: pyfa.attention(q, k, v, causal=args.causal, device=device)  # noqa: E731
        if theirs:
            theirs_fn = lambda: torch.sdpa(*theirs, is_causal=args.causal)  # noqa: E731
        pairs = L * (L + 1) // 2 if args.causal else L * L
        rate = 4 * B * H * D * pairs, "TFLOP/s"
    else:
        (q,), theirs = _inputs(rng, torch, dtype, (B, H, D))
        caches = []
        for b in range(B):
            c = pyfa.TurboQuantKVCache(Hkv, D, L, k_bits=args.bits, v_bits=args.bits, device=device)
            c.append(*(rng.standard_normal((L, Hkv, D), dtype=np.float32) for _ in range(2)))
            caches.append(c)
        mine_fn = lambda: [c.attend(q[b]) for b, c in enumerate(caches)]  # noqa: E731
        if torch.mod is not None:
            (tq_, tk, tv) = _inputs(rng, torch, dtype, (B, H, D), (B, Hkv, L, D), (B, Hkv, L, D))[1]
            tq_ = tq_[:, :, None]
            theirs_fn = lambda: torch.sdpa(tq_, tk, tv)  # noqa: E731
        per_row = 2 * turboquant.row_bytes(D, args.bits) + 8  # K and V codes, two float32 scales
        rate = B * Hkv * L * per_row, "GB/s"
    mine = time_calls(mine_fn, torch.wait, args.repeats)
    theirs_t = time_calls(theirs_fn, torch.wait, args.repeats, loop=False)[0] if theirs_fn else None
    amount, unit = rate
    scale = 1e12 if unit == "TFLOP/s" else 1e9
    return {"op": op, "L": L, "median": mine[0], "loop": mine[1], "rate": amount / mine[0] / scale, "unit": unit,
            "torch": theirs_t}


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3g}"


def run(args, out=None) -> int:
    out = out or sys.stdout
    device = pyfa.Device(backend_name(args))
    dtype = DTYPES[args.dtype]
    torch = _Torch(device, args.torch)
    contexts = {op: args.context or DEFAULT_CONTEXTS[device.is_gpu][op] for op in args.op}
    shape = f"B={args.batch} H={args.heads}/{args.kv_heads} D={args.head_dim} {args.dtype}"
    print(f"bench on {device.backend} ({device.name}): {shape}; prefill {'causal' if args.causal else 'non-causal'}; "
          f"tq {args.bits}-bit K and V (torch: dense {args.dtype})", file=out)
    if torch.mod is None:
        print(f"torch SDPA: skipped, {torch.why}", file=out)
    elif device.is_gpu and not torch.cuda:
        print("torch SDPA: on the CPU (the device is not CUDA); compare with care", file=out)
    if not device.host_visible and not torch.cuda:
        print("pyfa inputs: numpy arrays, copied to the device and waited for in every call (torch CUDA "
              "tensors, read in place, need torch)", file=out)
    todo = [(op, L) for op in args.op for L in contexts[op]]
    progress = Progress(len(todo), "bench")
    results = []
    for op, L in todo:
        results.append(bench_one(op, L, args, device, torch, dtype))
        progress.step(f"{op} L={L}")
    progress.close()
    print(table(["op", "context", "pyfa ms", "ms/call in a loop", "rate", "torch SDPA ms", "torch/pyfa"],
                [[r["op"], r["L"], _ms(r["median"]), _ms(r["loop"]), f"{r['rate']:.3g} {r['unit']}", _ms(r["torch"]),
                  "-" if r["torch"] is None else f"{r['torch'] / r['median']:.2f}"] for r in results],
                right={1, 2, 3, 4, 5, 6}), file=out)
    print("ms: median of single calls, each waited for; torch/pyfa > 1: pyfa is faster", file=out)
    if args.plot:
        print(plot(results, args.plot, f"pyfa on {device.backend}: {shape}"), file=out)
    return 0


def plot(results: list[dict], path: str, title: str) -> str:
    """Writes the PNG (time against context, one panel per op); returns the line to print."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot: not written, it needs matplotlib (pip install matplotlib)"
    ops = list(dict.fromkeys(r["op"] for r in results))
    fig, axes = plt.subplots(1, len(ops), figsize=(4.5 * len(ops), 3.8), squeeze=False)
    for ax, op in zip(axes[0], ops):
        mine = [r for r in results if r["op"] == op]
        xs = [r["L"] for r in mine]
        ax.plot(xs, [r["median"] * 1e3 for r in mine], "o-", label="pyfa")
        if all(r["torch"] is not None for r in mine):
            ax.plot(xs, [r["torch"] * 1e3 for r in mine], "s--", label="torch SDPA")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
        ax.set_yscale("log")
        ax.set_xlabel("context")
        ax.set_ylabel("ms per call (median)")
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path}"
