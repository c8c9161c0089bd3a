#!/usr/bin/env bash
# The package as a user gets it: builds the wheel (the PEP 517 backend runs the
# SwiftPM build; incremental after scripts/build.sh), checks its tag and
# contents, installs it with the test extra into a fresh virtual environment
# and, from a directory outside the source tree, runs `python -m pyfa check` and the
# test suite against the installed package (tests/conftest.py stops the run
# if pyfa is imported from anywhere but that environment).
#
#   bash scripts/wheel_check.sh            # PYFA_WHEEL_CHECK_TIMEOUT=seconds per step (default 600)
#
# Needs python3 with pip and either the venv module or a pip-installable
# virtualenv; PyPI (or a configured index) for numpy, cffi, ml_dtypes and the
# test extra.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
limit=${PYFA_WHEEL_CHECK_TIMEOUT:-600}
work=$(mktemp -d "${TMPDIR:-/tmp}/pyfa-wheel-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "wheel check: $*" >&2; exit 1; }
step() { echo "wheel check: $*"; }

step "building the wheel"
timeout "$limit" python3 -m pip wheel -q --disable-pip-version-check --no-deps -w "$work/dist" "$src" \
    || fail "pip wheel failed"
wheels=("$work"/dist/pyfa-*.whl)
[ ${#wheels[@]} -eq 1 ] && [ -f "${wheels[0]}" ] || fail "expected one pyfa wheel in $work/dist, got: ${wheels[*]}"
wheel=${wheels[0]}
python3 - "$wheel" <<'EOF' || fail "the wheel's tag or contents are wrong"
import platform, sys, sysconfig, zipfile
from pathlib import Path

wheel = Path(sys.argv[1])
plat = sysconfig.get_platform()
if plat.startswith("macosx"):
    expected_tail, lib = f"_{platform.machine()}.whl", "libpyfa.dylib"
else:
    expected_tail, lib = "-py3-none-" + plat.replace("-", "_").replace(".", "_") + ".whl", "libpyfa.so"
names = set(zipfile.ZipFile(wheel).namelist())
needed = {f"pyfa/_lib/{lib}", "pyfa/_lib/include/pyfa.h", "pyfa/_lib/include/pyfa_params.h", "pyfa/__main__.py"}
problems = [f"missing {n}" for n in sorted(needed - names)]
if not any(n.endswith(".dist-info/RECORD") for n in names):
    problems.append("missing .dist-info/RECORD")
if not wheel.name.endswith(expected_tail) or "-py3-none-" not in wheel.name:
    problems.append(f"name {wheel.name} does not end in {expected_tail}")
if problems:
    sys.exit("; ".join(problems))
print(f"wheel check: {wheel.name}: {len(names)} files, tag and contents ok")
EOF

step "installing it into a fresh virtual environment"
if ! python3 -m venv "$work/venv" 2>"$work/venv.err"; then
    step "python3 -m venv failed ($(tail -1 "$work/venv.err")); trying virtualenv"
    rm -rf "$work/venv"
    timeout "$limit" python3 -m pip install -q --disable-pip-version-check --user virtualenv \
        || timeout "$limit" python3 -m pip install -q --disable-pip-version-check virtualenv \
        || fail "neither the venv module nor virtualenv is available"
    python3 -m virtualenv -q "$work/venv" || fail "virtualenv could not create $work/venv"
fi
py="$work/venv/bin/python"
timeout "$limit" "$py" -m pip install -q --disable-pip-version-check "$wheel[test]" || fail "pip install of the wheel failed"

# Outside the source tree: only the installed package can be imported.
run="$work/run"
mkdir -p "$run/docs" "$run/scripts"
cp -R "$src/tests" "$run/tests"
cp "$src/README.md" "$run/"
[ -f "$src/docs/API.md" ] && cp "$src/docs/API.md" "$run/docs/"
[ -f "$src/scripts/gen_api_docs.py" ] && cp "$src/scripts/gen_api_docs.py" "$run/scripts/"
cd "$run"
"$py" - "$work/venv" <<'EOF' || fail "pyfa is not imported from the fresh environment"
import sys
from pathlib import Path

import pyfa

origin = Path(pyfa.__file__).resolve()
if not origin.is_relative_to(Path(sys.argv[1]).resolve()):
    sys.exit(f"pyfa came from {origin}")
print(f"wheel check: pyfa imported from {origin.parent}")
EOF

step "python -m pyfa check (from $run)"
timeout "$limit" "$py" -m pyfa check || fail "python -m pyfa check failed"

step "the test suite against the installed package"
PYFA_EXPECT_PREFIX="$work/venv" timeout "$limit" "$py" -m pytest -q -p no:cacheprovider tests \
    || fail "the test suite failed against the installed package"
step "passed"
