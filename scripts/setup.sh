#!/usr/bin/env bash
# Fresh-machine setup: Python dependencies, then the package itself (its build
# backend runs scripts/build.sh, which builds libpyfa with SwiftPM and puts it
# in pyfa/_lib), so `python3 -m pyfa` works from any directory.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v swift >/dev/null 2>&1; then
    echo "setup: the Swift toolchain (swift, Swift 6 or newer) is needed to build libpyfa: https://www.swift.org/install" >&2
    exit 1
fi
python3 -m pip install -q --disable-pip-version-check -r requirements.txt
python3 -m pip install -q --disable-pip-version-check --no-deps .
