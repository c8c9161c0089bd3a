#!/usr/bin/env bash
# Fresh-machine setup: Python dependencies, then the native library.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check -r requirements.txt
bash scripts/build.sh
