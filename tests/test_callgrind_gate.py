"""scripts/callgrind_gate.py's comparison and parsing, on made-up counts and a
hand-written callgrind dump (no valgrind needed). The gate end to end, with
extra kernel work that must fail it, runs in CI as
`python3 scripts/callgrind_gate.py --selftest` (scripts/perf_gates.sh)."""
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "callgrind_gate.py"
if not SCRIPT.is_file():  # the wheel check and the GPU bundle run a copy of tests/ without scripts/
    pytest.skip(f"no {SCRIPT} (not a source tree)", allow_module_level=True)
_spec = importlib.util.spec_from_file_location("callgrind_gate", SCRIPT)
gate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gate)

ENV = {"compiler": "clang version 99.0.0 (test)", "glibc": "2.36", "valgrind": "valgrind-3.19.0"}


def counts(pyfa, libc=5000, fn="pyfa_cpu_flash_attn_vec_avx2"):
    return {"pyfa": pyfa, "libc": libc, "functions": {fn: pyfa}}


def baseline(cases, isa="avx2", env=ENV):
    return {"toolchains": {gate.toolchain_key(env, isa): {"glibc": env["glibc"], "valgrind": env["valgrind"],
                                                         "cases": cases}}}


def test_rise_over_threshold_fails_naming_case_counts_and_limit():
    base = baseline({"decode": counts(1_000_000)})
    failures, _notes, missing = gate.compare({"avx2": {"decode": counts(1_040_000)}}, base, ENV)
    assert not missing
    assert len(failures) == 1
    msg = failures[0]
    assert "[avx2] decode: pyfa instructions 1,000,000 -> 1,040,000 (+4.00%, limit +3%)" in msg
    assert "pyfa_cpu_flash_attn_vec_avx2 +40,000" in msg


def test_rise_within_threshold_passes():
    base = baseline({"decode": counts(1_000_000)})
    failures, notes, _ = gate.compare({"avx2": {"decode": counts(1_029_000)}}, base, ENV)
    assert failures == [] and notes == []


def test_decrease_is_reported_for_tightening():
    base = baseline({"decode": counts(1_000_000)})
    failures, notes, _ = gate.compare({"avx2": {"decode": counts(900_000)}}, base, ENV)
    assert failures == []
    assert any("decode: pyfa instructions 1,000,000 -> 900,000 (-10.00%)" in n and "--update" in n for n in notes)


def test_other_compiler_is_missing_baseline_not_a_regression():
    base = baseline({"decode": counts(1_000_000)})
    other = dict(ENV, compiler="clang version 100.0.0 (newer)")
    failures, _notes, missing = gate.compare({"avx2": {"decode": counts(5_000_000)}}, base, other)
    assert failures == []
    assert missing == [gate.toolchain_key(other, "avx2")]


def test_libc_gated_only_with_the_recorded_glibc_and_valgrind():
    base = baseline({"decode": counts(1_000_000, libc=10_000)})
    measured = {"avx2": {"decode": counts(1_000_000, libc=20_000)}}
    failures, _, _ = gate.compare(measured, base, ENV)
    assert any("libc instructions 10,000 -> 20,000" in f for f in failures)
    failures, notes, _ = gate.compare(measured, base, dict(ENV, glibc="2.41"))
    assert failures == []
    assert any("libc counts not compared" in n and "2.41" in n for n in notes)


def test_counts_near_zero_use_the_floor():
    # kv_append calls no libc: 0 -> 20 instructions is 2% of the floor, not an infinite rise.
    base = baseline({"append": counts(100_000, libc=0)})
    failures, _, _ = gate.compare({"avx2": {"append": counts(100_000, libc=20)}}, base, ENV)
    assert failures == []
    failures, _, _ = gate.compare({"avx2": {"append": counts(100_000, libc=500)}}, base, ENV)
    assert failures and "libc instructions 0 -> 500" in failures[0]


def test_case_missing_from_baseline_fails():
    failures, _, _ = gate.compare({"avx2": {"new_case": counts(10)}}, baseline({}), ENV)
    assert failures == ["[avx2] new_case: not in the baseline (record it with --update)"]


DUMP = """version: 1
creator: callgrind-3.19.0
desc: Trigger: Client Request: decode_f16_d128
events: Ir
ob=/tmp/x/libpyfa.so
fl=???
fn=run_share
0 600
cob=/tmp/x/libpyfa.so
cfn=pyfa_cpu_flash_attn_vec_avx2
calls=4 0
0 9000
fn=pyfa_cpu_flash_attn_vec_avx2
0 8000
cob=/usr/lib/libm.so.6
cfn=expf
calls=10 0
0 1000
ob=/usr/lib/libm.so.6
fn=expf
0 1000
totals: 9600
"""


def test_parse_dump_counts_self_cost_only(tmp_path):
    path = tmp_path / "cg.out.1"
    path.write_text(DUMP)
    case, per_fn, total = gate.parse_dump(path)
    assert case == "decode_f16_d128" and total == 9600
    assert per_fn == {"libpyfa.so:run_share": 600, "libpyfa.so:pyfa_cpu_flash_attn_vec_avx2": 8000,
                      "libm.so.6:expf": 1000}
    summary = gate.summarise(per_fn)
    assert (summary["pyfa"], summary["libc"]) == (8600, 1000)


def test_parse_dump_without_totals_is_an_error(tmp_path):
    path = tmp_path / "cg.out.1"
    path.write_text(DUMP.replace("totals: 9600\n", ""))
    with pytest.raises(gate.GateError, match="no totals"):
        gate.parse_dump(path)


def test_compiler_ident_of_the_built_library():
    lib = REPO / "pyfa" / "_lib" / "libpyfa.so"
    if not lib.is_file():
        pytest.skip("pyfa/_lib/libpyfa.so is not built")
    assert gate.compiler_ident(lib).startswith("clang version ")


def test_committed_baseline_covers_every_workload_case():
    spec = importlib.util.spec_from_file_location("callgrind_workload", REPO / "benchmarks" / "callgrind_workload.py")
    workload = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workload)
    entries = gate.load_baseline(gate.BASELINE)["toolchains"]
    assert entries, "benchmarks/callgrind_baseline.json has no toolchain entry"
    for key, entry in entries.items():
        assert set(entry["cases"]) == set(workload.CASES), key
