"""Executed-instruction mix and stall samples of a kernel, from Nsight Compute's
per-instruction source view (the .sass.csv.gz that scripts/gpu_prefill_ncu.sh writes):
two kernels' loops compared opcode by opcode, without a GPU.

    python3 scripts/ncu_sass_mix.py A.sass.csv.gz [B.sass.csv.gz ...] [--top N]

Per file: the executed warp instructions by opcode (predicate stripped), their share
and their share of the warp-state samples, then the stall reasons over all samples and
the instructions holding the most samples.
"""
import collections
import csv
import gzip
import re
import sys


def load(path):
    with gzip.open(path, "rt") as fh:
        rows = csv.reader(fh)
        next(rows)  # the kernel's name
        head = next(rows)
        src, execd, samples = head.index("Source"), head.index("Instructions Executed"), \
            head.index("Warp Stall Sampling (All Samples)")
        stalls = [i for i, h in enumerate(head) if h.startswith("stall_") and "Not Issued" not in h]
        out = []
        for row in rows:
            if len(row) <= max(stalls):
                continue
            out.append((row[src].strip(), int(row[execd] or 0), int(row[samples] or 0),
                        {head[i][6:]: int(row[i] or 0) for i in stalls}))
    return out


def opcode(text):
    text = re.sub(r"^@!?U?P\w+\s+", "", text)
    return text.split()[0] if text else "?"


def report(path, top):
    rows = load(path)
    total = sum(r[1] for r in rows)
    sampled = sum(r[2] for r in rows) or 1
    ops, op_samples, reasons = collections.Counter(), collections.Counter(), collections.Counter()
    for text, n, s, why in rows:
        ops[opcode(text)] += n
        op_samples[opcode(text)] += s
        reasons.update(why)
    print(f"== {path}: {total / 1e6:.0f}M warp instructions executed, {sampled} samples")
    for op, n in ops.most_common(top):
        print(f"  {op:32s} {n / 1e6:8.1f}M {100 * n / total:5.1f}%   samples {100 * op_samples[op] / sampled:5.1f}%")
    stalled = sum(reasons.values()) or 1
    print("  stall reasons: " + ", ".join(f"{k} {100 * v / stalled:.1f}%" for k, v in reasons.most_common(8)))
    for text, n, s, why in sorted(rows, key=lambda r: -r[2])[:8]:
        main = ", ".join(f"{k} {v}" for k, v in sorted(why.items(), key=lambda kv: -kv[1])[:2] if v)
        print(f"  {100 * s / sampled:5.1f}% of samples at {text[:56]:56s} ({main})")


def main(argv):
    top = 24
    if "--top" in argv:
        i = argv.index("--top")
        top = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    for path in argv:
        report(path, top)


if __name__ == "__main__":
    main(sys.argv[1:])
