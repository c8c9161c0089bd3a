"""Gate outcomes of the benchmark suite: each gate records (case, value, bound,
pass/fail); the end of the run prints them, with the skipped gate tests and
their reasons, under "perf gates", and --gate-json writes them to a file
(scripts/gpu_run.sh's gates step, scripts/perf_gates.sh)."""
import json

import pytest

GATES = pytest.StashKey[list]()
# The files whose tests are gates: their skips are listed in the summary too.
GATE_FILES = ("test_cpu_gates.py", "test_cuda_decode.py", "test_cuda_prefill.py", "test_cuda_fa4.py",
              "test_serving_loop.py")


def record_gate(request, case, value, op, bound, detail="", enforced=True):
    """Records one gate (``value op bound``, op ">=", "<=" or "<") for the
    end-of-run summary and --gate-json, and returns whether it held. The test
    fails on it; ``enforced=False`` marks a target that is only reported
    (the serving targets without --serving-gates): a miss shows as "miss"."""
    ok = {">=": value >= bound, "<=": value <= bound, "<": value < bound}[op]
    request.config.stash[GATES].append({"test": request.node.nodeid, "case": case, "value": round(value, 4),
                                         "op": op, "bound": bound, "passed": ok, "enforced": enforced,
                                         "detail": detail})
    return ok


def _gate_skips(terminalreporter):
    """Skipped gate tests (files named in GATE_FILES) with pytest's reason."""
    out = []
    for rep in terminalreporter.stats.get("skipped", []):
        path = rep.nodeid.split("::")[0] if rep.nodeid else str(rep.location[0])
        if any(path.endswith(f) for f in GATE_FILES):
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            out.append({"test": rep.nodeid or path, "reason": reason.removeprefix("Skipped: ")})
    return out



def terminal_summary(terminalreporter, config):
    """The "perf gates" section, in runs that time (--benchmark-enable) or record a gate."""
    gates = config.stash.get(GATES, [])
    if not gates and not config.getoption("benchmark_enable", False):
        return
    skips = _gate_skips(terminalreporter)
    terminalreporter.section("perf gates")
    for g in gates:
        outcome = "pass" if g["passed"] else ("FAIL" if g["enforced"] else "miss")
        terminalreporter.write_line(f"{outcome}  {g['case']}: {g['value']:.3f} {g['op']} {g['bound']}  "
                                    f"{g['detail']}  ({g['test']})")
    for s in skips:
        terminalreporter.write_line(f"skip  {s['test']}: {s['reason']}")
    failed = sum(not g["passed"] and g["enforced"] for g in gates)
    missed = sum(not g["passed"] and not g["enforced"] for g in gates)
    terminalreporter.write_line(f"perf gates: {sum(g['passed'] for g in gates)} passed, {failed} failed, "
                                f"{missed} missed (reported only), {len(skips)} skipped")
    path = config.getoption("--gate-json")
    if path:
        with open(path, "w") as f:
            json.dump({"gates": gates, "skipped": skips}, f, indent=1)
