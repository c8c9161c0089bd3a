"""`python -m pyfa check`: every op against the float64 reference on one
device, then a table of op, dtype, cases, worst error and its bound, and
PASS / FAIL. Exit status 0 only when every row passes."""
from __future__ import annotations

import math
import sys
import zlib

import numpy as np

import pyfa

from . import _cases
from . import backend_name
from ._table import Progress, table


def add_arguments(p) -> None:
    level = p.add_mutually_exclusive_group()
    level.add_argument("--quick", dest="full", action="store_false",
                       help="a few shapes per op and dtype (default; well under a minute on a laptop CPU)")
    level.add_argument("--full", dest="full", action="store_true",
                       help="also every head dim, GQA group, window / ring pair and the tests' shape table")
    p.set_defaults(full=False)


def run_cases(device: pyfa.Device, full: bool, stream=None) -> tuple[list, float]:
    """Runs every case with a progress bar on `stream`; returns (measures, seconds). A case that raises
    counts as one failed measure carrying the message (a self-test reports; it does not stop)."""
    todo = _cases.cases(full)
    progress = Progress(len(todo), "check", stream)
    found = []
    for label, fn in todo:
        rng = np.random.default_rng(zlib.crc32(label.encode()))  # each case reproducible on its own
        try:
            found += fn(device, rng)
        except Exception as e:  # noqa: BLE001 - reported in the table, as FAIL
            op = label.split(" ")[0]
            found.append(_cases.M.Measure(op, "error", math.inf, 0.0, f"{label}: {type(e).__name__}: {e}"))
        progress.step(label)
    return found, progress.close()


def rows(measures) -> list[dict]:
    """One row per (op, dtype) in first-seen order: its case count, its worst measure (largest
    error / bound) and whether every measure passed."""
    by_key: dict = {}
    for m in measures:
        r = by_key.setdefault((m.op, m.dtype), {"op": m.op, "dtype": m.dtype, "cases": 0, "worst": m, "ok": True})
        r["cases"] += 1
        r["ok"] = r["ok"] and m.ok
        if m.ratio > r["worst"].ratio:
            r["worst"] = m
    return list(by_key.values())


def report(measures) -> tuple[str, bool]:
    """The table, notes of failed measures, and whether all passed."""
    summary = rows(measures)
    lines = [table(["op", "dtype", "cases", "max error", "bound", "result"],
                   [[r["op"], r["dtype"], r["cases"], _num(r["worst"].error), _num(r["worst"].bound),
                     "PASS" if r["ok"] else "FAIL"] for r in summary], right={2, 3, 4})]
    notes = [m.note for m in measures if not m.ok and m.note]
    lines += [f"  {n.splitlines()[0]}" for n in dict.fromkeys(notes)]
    return "\n".join(lines), all(r["ok"] for r in summary)


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else "0" if x == 0 else f"{x:.2e}"


def run(args, out=None) -> int:
    out = out or sys.stdout
    device = pyfa.Device(backend_name(args))
    print(f"check on {device.backend} ({device.name}), {'full' if args.full else 'quick'} set; "
          "bounds: the test suite's (pyfa/cli/_measure.py)", file=out)
    measures, seconds = run_cases(device, args.full)
    text, ok = report(measures)
    print(text, file=out)
    failed = sum(not m.ok for m in measures)
    print(f"{'PASS' if ok else 'FAIL'}: {len(measures) - failed} of {len(measures)} comparisons within their "
          f"bounds ({seconds:.1f} s)", file=out)
    return 0 if ok else 1
