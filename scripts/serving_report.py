#!/usr/bin/env python3
"""Markdown tables from the serving-loop benchmarks' pytest-benchmark JSON
(benchmarks/test_serving_loop.py run with --benchmark-json), for committing
under docs/cuda/:

    python3 scripts/serving_report.py serving.json [--skips serving.txt] [-o docs/cuda/serving_h100.md]

Reads only what the benchmarks put in each entry's extra_info: case, shape,
impl, unit, per_round, us (wall time per unit), gpu_us (+ gpu_held), kernel_us, and on the rows that
carry a target: peer, peer_us, ratio (us / peer_us), target, met. ``--skips``
takes the pytest output of the same run (-v and/or -rs) and lists what was not
measured and why. Standard library only.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

CASES = {"call": "Call overhead (one decode call, torch CUDA tensors)",
         "step": "32-layer decode step (32 calls + one synchronize)",
         "cache": "Cache: append one token + attend",
         "cpu": "CPU backend: tiny decode call (numpy)",
         "cpu-cache": "CPU backend: cache append one token + attend, 1024-row ring (numpy)"}
ORDER = list(CASES)


def us(x) -> str:
    if x is None:
        return "—"
    return f"{x:,.1f}" if x >= 10 else f"{x:.2f}"


def ratio(x) -> str:
    return "—" if x is None else f"{x:.2f}×"


def status(info) -> str:
    met = info.get("met")
    return "—" if met is None else ("met" if met else "**missed**")


def rows(benchmarks):
    """Entries with the benchmarks' extra_info, in case order then run order."""
    out = [b for b in benchmarks if b.get("extra_info", {}).get("case") in CASES]
    return sorted(out, key=lambda b: ORDER.index(b["extra_info"]["case"]))


def skipped(text: str):
    """(per-test [(test id, reason)], summary [(count, location, reason)]) from pytest output."""
    tests, summary = [], []
    for line in text.splitlines():
        m = re.match(r"^(\S+::\S+) SKIPPED(?: \((.*?)\))?\s*(?:\[\s*\d+%\])?\s*$", line)
        if m:
            tests.append((m.group(1).split("::", 1)[1], m.group(2) or ""))
            continue
        m = re.match(r"^SKIPPED \[(\d+)\] (\S+?): (.*)$", line)
        if m and "serving_loop" in m.group(2):
            summary.append((int(m.group(1)), m.group(2), m.group(3)))
    return tests, summary


def report(data: dict, skips_text: str | None = None, code_commit: str | None = None) -> str:
    """The markdown report; ``code_commit`` (a bundle's COMMIT) names the code that ran, which
    pytest-benchmark's own commit_info (the git checkout around the run) may not be."""
    entries = rows(data.get("benchmarks", []))
    infos = [b["extra_info"] for b in entries]
    gpu = next((i["gpu"] for i in infos if i.get("gpu")), None)
    torch_version = next((i["torch"] for i in infos if i.get("torch")), None)
    commit = data.get("commit_info", {})
    machine = data.get("machine_info", {})
    lines = ["# Serving-loop benchmarks", ""]
    where = [f"GPU: {gpu}" if gpu else "GPU: none (CPU cases only)",
             f"CPU: {machine.get('cpu', {}).get('brand_raw', machine.get('processor', '?'))}",
             f"Python {machine.get('python_version', '?')}"]
    if torch_version:
        where.append(f"torch {torch_version}")
    if code_commit:
        where.append(f"commit {code_commit[:10]}")
    elif commit.get("id"):
        where.append(f"commit {commit['id'][:10]}{' (dirty)' if commit.get('dirty') else ''}")
    if data.get("datetime"):
        where.append(data["datetime"][:19].replace("T", " ") + " UTC")
    lines += [" · ".join(where), "",
              "Made by `scripts/serving_report.py` from `benchmarks/test_serving_loop.py` "
              "(its docstring says how each number is taken). µs: wall time per call or step of "
              "a loop queued without a sync inside, then one synchronize; GPU µs: CUDA events over "
              "the same calls queued ahead of the GPU (its own time); ratio: pyfa µs / peer µs.", ""]

    lines += ["## Targets", "",
              "| case | shape | pyfa | pyfa µs | pyfa GPU µs | peer | peer µs | ratio | target | status |",
              "|---|---|---|---:|---:|---|---:|---:|---|---|"]
    targets = [i for i in infos if "target" in i]
    for i in targets:
        gpu_col = us(i.get("gpu_us", i.get("kernel_us"))) + (" †" if i.get("gpu_held") is False else "")
        lines.append(f"| {i['case']} | {i['shape']} | {i['impl']} | {us(i.get('us'))} | {gpu_col} | "
                     f"{i.get('peer', '—')} | {us(i.get('peer_us'))} | {ratio(i.get('ratio'))} | "
                     f"{i['target']} | {status(i)} |")
    if not targets:
        lines.append("| — | no target rows in this run | | | | | | | | |")

    lines += ["", "## All measurements", ""]
    for case in ORDER:
        these = [i for i in infos if i["case"] == case]
        if not these:
            continue
        lines += [f"### {CASES[case]}", "", "| shape | impl | µs | GPU µs | per | timed round |", "|---|---|---:|---:|---|---:|"]
        for i in these:
            gpu_col = us(i.get("gpu_us", i.get("kernel_us")))
            if i.get("gpu_held") is False:
                gpu_col += " †"
            lines.append(f"| {i['shape']} | {i['impl']} | {us(i.get('us'))} | {gpu_col} | {i.get('unit', '—')} | "
                         f"{i.get('per_round', '—')} |")
        if any(i.get("gpu_held") is False for i in these):
            lines += ["", "† the calls waited for the GPU while being queued (or torch has no "
                          "`torch.cuda._sleep`), so this GPU time includes the host's gaps."]
        if case == "cache":
            attend = ", ".join(f"{i['impl']} {i['shape'].split('-')[-2]}: {us(i['attend_kernel_us'])}"
                               for i in these if i.get("attend_kernel_us") is not None)
            lines += ["", "GPU µs of cache rows: the GPU busy time (torch.profiler) of the step's kernels, the "
                          "append's and the attend's, which is the peer of the target row."
                          + (f" The attend's alone: {attend} µs." if attend else "")]
        lines.append("")

    if skips_text is not None:
        tests, summary = skipped(skips_text)
        lines += ["## Not measured", ""]
        if not tests and not summary:
            lines.append("Nothing was skipped.")
        if tests:
            lines += ["Skipped tests:", ""]
            lines += [f"- `{name}`: {why}" if why else f"- `{name}`" for name, why in tests]
        if summary:
            lines += ["", "Reasons (pytest -rs: count, reason, where it was raised):", ""] if tests else []
            lines += [f"- {n} × {why} ({where})" for n, where, why in summary]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="pytest-benchmark JSON (--benchmark-json) of benchmarks/test_serving_loop.py")
    ap.add_argument("--skips", help="pytest output of the same run (-v / -rs), to list what was skipped and why")
    ap.add_argument("-o", "--out", help="write the markdown here (default: stdout)")
    ap.add_argument("--commit", help="the commit of the code that ran (default: a bundle's COMMIT file, if any)")
    args = ap.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    skips = None
    if args.skips:
        with open(args.skips, errors="replace") as f:
            skips = f.read()
    commit_file = Path(__file__).resolve().parent.parent / "COMMIT"
    code_commit = args.commit or (commit_file.read_text().strip() if commit_file.is_file() else None)
    text = report(data, skips, code_commit)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
