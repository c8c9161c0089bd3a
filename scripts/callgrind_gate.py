#!/usr/bin/env python3
"""Instruction-count regression gate for the CPU kernels.

Runs benchmarks/callgrind_workload.py under ``valgrind --tool=callgrind``
(pool on one thread, collection only inside the pool's threadgroup loop, one
dump per case) for each kernel ISA, and compares every case's instruction
count with benchmarks/callgrind_baseline.json:

    python3 scripts/callgrind_gate.py             # gate: exit 1 on a rise > threshold
    python3 scripts/callgrind_gate.py --update    # record the counts of this toolchain
    python3 scripts/callgrind_gate.py --selftest  # extra kernel work must fail the gate

Why instruction counts: they do not depend on load, clock or cache state, so
a 2-core CI machine shared with other jobs gets the same numbers as an idle
workstation, and a small threshold (THRESHOLD_PCT) cannot fire on noise.

What changes them besides the kernel code, and how the baseline keys that:
- the compiler that built libpyfa (its .comment "clang version ..." line),
  and the kernel ISA (avx2 / generic): a baseline entry exists per
  (compiler, ISA); a toolchain without an entry is reported as such (exit 3)
  with the --update command, never as a regression;
- glibc / valgrind (expf, memcpy and ld.so's lazy binding run inside the
  kernels): counted apart as "libc" and gated only when the glibc and
  valgrind versions match the recorded ones; the gated "pyfa" count is the
  instructions in libpyfa's own code.
Each case records per-function counts too, named in the failure message.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = REPO / "benchmarks" / "callgrind_workload.py"
BASELINE = REPO / "benchmarks" / "callgrind_baseline.json"
ISAS = ("avx2", "generic")
# Counts are exact for one build, so any change is a code change. 3% leaves
# room for incidental code-generation shifts (a different inlining or
# register choice after an edit elsewhere in the same body) without a
# baseline update, while the regressions this guards against cost far more:
# converting each block's V rows twice in attn_vec_body.h adds 8-26% to the
# decode cases (avx2 and generic), a lost vectorisation several times that.
THRESHOLD_PCT = 3.0
# Decreases are reported from this size on, so the baseline gets tightened.
REPORT_DECREASE_PCT = 1.0
# Changes are relative to at least this many instructions, so a count near
# zero (kv_append calls no libc) does not turn a few instructions of lazy
# symbol binding into an infinite rise.
FLOOR_IR = 1000
MARKER_C = r"""
#include <valgrind/callgrind.h>
void pyfa_gate_zero(void) { CALLGRIND_ZERO_STATS; }
void pyfa_gate_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""


class GateError(Exception):
    """The gate could not measure (a missing tool, a broken run): exit 2."""


# --------------------------------------------------------------------------- toolchain

def elf_comment(path: Path) -> list[str]:
    """Strings of an ELF64 little-endian file's .comment section (compiler idents)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise GateError(f"{path} is not an ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_off = sections[shstrndx][4]
    for name, _type, _flags, _addr, off, size in sections:
        end = data.index(b"\0", names_off + name)
        if data[names_off + name:end] == b".comment":
            return [s.decode("utf-8", "replace") for s in data[off:off + size].split(b"\0") if s]
    return []


def compiler_ident(lib: Path) -> str:
    """The clang that built libpyfa's C kernels (its .comment line)."""
    clangs = sorted({s for s in elf_comment(lib) if "clang version" in s})
    if not clangs:
        raise GateError(f"{lib} has no 'clang version' in .comment: cannot tell which compiler built the kernels")
    return " + ".join(clangs)


def tool_version(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


# --------------------------------------------------------------------------- measuring

def find_library() -> Path:
    for p in (Path(os.environ["PYFA_LIBRARY"]) if os.environ.get("PYFA_LIBRARY") else None,
              REPO / "pyfa" / "_lib" / "libpyfa.so", REPO / ".build" / "release" / "libpyfa.so"):
        if p is not None and p.is_file():
            return p
    raise GateError("libpyfa.so not found (build it with `bash scripts/build.sh`, or set PYFA_LIBRARY)")


def find_tool(*names: str) -> str:
    for n in names:
        path = shutil.which(n)
        if path:
            return path
    raise GateError(f"none of {names} is on PATH")


def prepare(lib: Path, work: Path) -> tuple[Path, Path]:
    """(a copy of libpyfa without DWARF, the marker library). valgrind 3.19
    gives up on clang 21's DWARF 5; symbols (all callgrind needs) stay."""
    stripped = work / "libpyfa.so"
    objcopy = find_tool("llvm-objcopy", "objcopy")
    subprocess.run([objcopy, "--strip-debug", str(lib), str(stripped)], check=True)
    src = work / "marker.c"
    src.write_text(MARKER_C)
    marker = work / "libmarker.so"
    cc = find_tool("clang", "cc", "gcc")
    r = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(marker), str(src)], capture_output=True, text=True)
    if r.returncode != 0:
        raise GateError(f"building the callgrind marker failed (needs valgrind/callgrind.h):\n{r.stderr}")
    return stripped, marker


def run_callgrind(isa: str, lib: Path, marker: Path, work: Path, workload_args: list[str]) -> subprocess.Popen:
    out = work / isa
    out.mkdir()
    env = dict(os.environ, PYFA_LIBRARY=str(lib), PYFA_NUM_THREADS="1", PYFA_GATE_MARKER=str(marker),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("PYFA_CPU_BARRIER_STRESS", None)
    env.pop("PYFA_BACKEND", None)
    env["PYFA_CPU_ISA"] = isa
    cmd = [find_tool("valgrind"), "--tool=callgrind", f"--callgrind-out-file={out}/cg.out",
           "--collect-atstart=no", "--toggle-collect=run_share", "--compress-strings=no", "--compress-pos=no",
           sys.executable, str(WORKLOAD), *workload_args]
    return subprocess.Popen(cmd, env=env, cwd=str(work), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def parse_dump(path: Path) -> tuple[str, dict[str, int], int]:
    """(case name, self instructions per 'object:function', total) of one
    uncompressed callgrind dump. A cost line right after ``calls=`` is the
    callee's inclusive cost and is not the caller's own."""
    case, ob, fn, per_fn, total = None, "?", "?", {}, None
    after_calls = False
    for line in path.read_text().splitlines():
        if line.startswith("desc: Trigger: Client Request: "):
            case = line.split(": ", 3)[3].strip()
        elif line.startswith("ob="):
            ob = Path(line[3:]).name
        elif line.startswith("fn="):
            fn = line[3:]
        elif line.startswith("calls="):
            after_calls = True
        elif line and (line[0].isdigit() or line[0] in "+-*"):
            if after_calls:
                after_calls = False
                continue
            cost = int(line.split()[-1]) if len(line.split()) > 1 else 0
            key = f"{ob}:{fn}"
            per_fn[key] = per_fn.get(key, 0) + cost
        elif line.startswith("totals:"):
            total = int(line.split()[1])
    if total is None:
        raise GateError(f"{path}: no totals line (truncated dump?)")
    return case, per_fn, total


def summarise(per_fn: dict[str, int]) -> dict:
    """A case's counts: pyfa (libpyfa's code, gated), libc (everything else
    the kernels called) and the libpyfa functions."""
    pyfa_fns = {k.split(":", 1)[1]: v for k, v in per_fn.items() if k.startswith("libpyfa") and v}
    return {"pyfa": sum(pyfa_fns.values()),
            "libc": sum(v for k, v in per_fn.items() if not k.startswith("libpyfa")),
            "functions": dict(sorted(pyfa_fns.items(), key=lambda kv: -kv[1]))}


def collect(proc: subprocess.Popen, isa: str, work: Path) -> dict:
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise GateError(f"callgrind run ({isa}) exited {proc.returncode}:\n{stdout}\n{stderr[-3000:]}")
    seen_isa = re.search(r"^isa (\S+)$", stdout, re.M)
    if not seen_isa or seen_isa.group(1) != isa:
        raise GateError(f"asked for the {isa} kernels, the workload ran {seen_isa and seen_isa.group(1)!r} "
                        "(a CPU without AVX2+FMA+F16C runs generic only)")
    cases = {}
    for dump in sorted((work / isa).glob("cg.out.*"), key=lambda p: int(p.suffix[1:])):
        name, per_fn, total = parse_dump(dump)
        counts = summarise(per_fn)
        if counts["pyfa"] + counts["libc"] != total:
            raise GateError(f"{dump}: per-function sum {counts['pyfa'] + counts['libc']} != totals {total}")
        if counts["pyfa"] == 0:
            raise GateError(f"case {name} ({isa}) collected no instructions in libpyfa: "
                            "is the pool's run_share still a function of its own?")
        cases[name] = counts
    expected = re.findall(r"^case (\S+)$", stdout, re.M)
    if list(cases) != expected:
        raise GateError(f"{isa}: dumps {list(cases)} do not match the workload's cases {expected}")
    return cases


def measure(workload_args: list[str], isas=ISAS) -> dict:
    """{isa: {case: counts}}, the ISAs measured in parallel."""
    lib = find_library()
    with tempfile.TemporaryDirectory(prefix="pyfa-callgrind-") as tmp:
        work = Path(tmp)
        stripped, marker = prepare(lib, work)
        procs = {isa: run_callgrind(isa, stripped, marker, work, workload_args) for isa in isas}
        return {isa: collect(p, isa, work) for isa, p in procs.items()}


def host_isas() -> tuple:
    """The kernel ISAs this CPU runs: avx2 needs AVX2, FMA and F16C (kernels.c)."""
    try:
        flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
    except (OSError, AttributeError):
        flags = set()
    return ISAS if {"avx2", "fma", "f16c"} <= flags else ("generic",)


def environment(lib: Path) -> dict:
    return {"compiler": compiler_ident(lib), "glibc": platform.libc_ver()[1] or "unknown",
            "valgrind": tool_version([find_tool("valgrind"), "--version"])}


def toolchain_key(env: dict, isa: str) -> str:
    return f"{env['compiler']} | isa={isa}"


# --------------------------------------------------------------------------- comparing

def pct(new: int, old: int) -> float:
    """Change from ``old`` to ``new`` in percent of max(old, FLOOR_IR)."""
    return (new - old) / max(old, FLOOR_IR) * 100.0


def compare(measured: dict, baseline: dict, env: dict, threshold: float = THRESHOLD_PCT) -> tuple[list, list, list]:
    """(failures, notes, missing toolchain keys). A failure names the case,
    the count, the baseline, the rise and the limit; notes report decreases
    and what was not compared."""
    failures, notes, missing = [], [], []
    entries = baseline.get("toolchains", {})
    for isa, cases in measured.items():
        key = toolchain_key(env, isa)
        entry = entries.get(key)
        if entry is None:
            missing.append(key)
            continue
        libc_comparable = entry.get("glibc") == env["glibc"] and entry.get("valgrind") == env["valgrind"]
        if not libc_comparable:
            notes.append(f"[{isa}] libc counts not compared: recorded with glibc {entry.get('glibc')} / "
                         f"{entry.get('valgrind')}, this is glibc {env['glibc']} / {env['valgrind']}")
        for case, now in cases.items():
            base = entry["cases"].get(case)
            if base is None:
                failures.append(f"[{isa}] {case}: not in the baseline (record it with --update)")
                continue
            parts = [("pyfa", now["pyfa"], base["pyfa"])]
            if libc_comparable:
                parts.append(("libc", now["libc"], base["libc"]))
            for part, n, b in parts:
                change = pct(n, b)
                if change > threshold:
                    worst = _function_changes(now["functions"], base.get("functions", {})) if part == "pyfa" else ""
                    failures.append(f"[{isa}] {case}: {part} instructions {b:,} -> {n:,} ({change:+.2f}%, "
                                    f"limit +{threshold:g}%)" + (f"; by function: {worst}" if worst else ""))
                elif change <= -REPORT_DECREASE_PCT:
                    notes.append(f"[{isa}] {case}: {part} instructions {b:,} -> {n:,} ({change:+.2f}%): "
                                 "lower than the baseline; tighten it with --update")
        for case in entry["cases"]:
            if case not in cases:
                notes.append(f"[{isa}] {case}: in the baseline, not measured")
    return failures, notes, missing


def _function_changes(now: dict, base: dict, top: int = 3) -> str:
    deltas = sorted(((now.get(f, 0) - base.get(f, 0), f) for f in set(now) | set(base)), reverse=True)
    return ", ".join(f"{f} {d:+,}" for d, f in deltas[:top] if d > 0)


def table(measured: dict, baseline: dict, env: dict) -> str:
    rows = [f"{'isa':8} {'case':28} {'pyfa Ir':>14} {'baseline':>14} {'change':>8} {'libc Ir':>12}"]
    for isa, cases in measured.items():
        entry = baseline.get("toolchains", {}).get(toolchain_key(env, isa), {"cases": {}})
        for case, now in cases.items():
            base = entry["cases"].get(case, {}).get("pyfa")
            change = f"{pct(now['pyfa'], base):+.2f}%" if base else "-"
            rows.append(f"{isa:8} {case:28} {now['pyfa']:>14,} {base or 0:>14,} {change:>8} {now['libc']:>12,}")
    return "\n".join(rows)


# --------------------------------------------------------------------------- main

def load_baseline(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"toolchains": {}}


def update(measured: dict, env: dict, path: Path) -> None:
    baseline = load_baseline(path)
    baseline["note"] = ("Instruction counts of benchmarks/callgrind_workload.py per toolchain; "
                        "update deliberately with `python3 scripts/callgrind_gate.py --update`.")
    for isa, cases in measured.items():
        baseline["toolchains"][toolchain_key(env, isa)] = {
            "glibc": env["glibc"], "valgrind": env["valgrind"], "recorded": time.strftime("%Y-%m-%d"),
            "cases": cases}
    path.write_text(json.dumps(baseline, indent=1, sort_keys=True) + "\n")
    print(f"callgrind_gate: wrote {len(measured)} toolchain entr{'y' if len(measured) == 1 else 'ies'} to {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="CPU-kernel instruction-count gate (valgrind --tool=callgrind)")
    ap.add_argument("--update", action="store_true", help="record this toolchain's counts in the baseline")
    ap.add_argument("--selftest", action="store_true",
                    help="run one case twice in its segment and require the gate to fail on it")
    ap.add_argument("--baseline", type=Path, default=BASELINE)
    ap.add_argument("--isa", choices=ISAS, action="append", help="measure only this ISA (repeatable)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        env = environment(find_library())
        isas = tuple(args.isa or host_isas())
        if not args.isa and isas != ISAS:
            print("callgrind_gate: this CPU has no AVX2+FMA+F16C: measuring the generic kernels only")
        if args.selftest:
            return selftest(env, load_baseline(args.baseline), isas)
        measured = measure([], isas)
    except GateError as e:
        print(f"callgrind_gate: cannot measure: {e}", file=sys.stderr)
        return 2
    if args.update:
        update(measured, env, args.baseline)
        return 0
    baseline = load_baseline(args.baseline)
    failures, notes, missing = compare(measured, baseline, env)
    print(table(measured, baseline, env))
    for n in notes:
        print("note:", n)
    print(f"callgrind_gate: {sum(map(len, measured.values()))} cases in {time.monotonic() - t0:.0f} s")
    if missing:
        print("callgrind_gate: no baseline for " + "; ".join(missing) + "\n  recorded: "
              + ("; ".join(baseline.get("toolchains", {})) or "none")
              + "\n  counts depend on the compiler and ISA; after checking the kernels did not regress, "
                "record them with `python3 scripts/callgrind_gate.py --update` and commit "
              + str(args.baseline.relative_to(REPO) if args.baseline.is_relative_to(REPO) else args.baseline),
              file=sys.stderr)
        return 3
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    if failures:
        print("callgrind_gate: kernel instruction counts rose; if intended, update the baseline with "
              "`python3 scripts/callgrind_gate.py --update` and say why in the commit", file=sys.stderr)
        return 1
    print("callgrind_gate: pass")
    return 0


def selftest(env: dict, baseline: dict, isas: tuple) -> int:
    """Extra kernel work (one case's call run twice) must fail the gate, naming that case."""
    case = "decode_f16_d128"
    measured = measure(["--cases", case, "--repeat-case", case], isas[:1])
    failures, _notes, missing = compare(measured, baseline, env)
    if missing:
        print(f"callgrind_gate --selftest: no baseline for {missing}", file=sys.stderr)
        return 3
    named = [f for f in failures if f"] {case}: pyfa instructions" in f]
    print("\n".join(failures) or "(no failures)")
    if not named:
        print("callgrind_gate --selftest: doubled work in the workload did NOT fail the gate", file=sys.stderr)
        return 1
    print("callgrind_gate --selftest: pass (the gate fails on extra kernel work)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
