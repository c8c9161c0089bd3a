#!/usr/bin/env bash
# Builds libpyfa (release; on Linux the Swift runtime is linked statically so
# the .so loads on machines without a Swift toolchain) and installs it with its headers into
# pyfa/_lib/, where the Python package finds it.
set -euo pipefail
cd "$(dirname "$0")/.."
# Apple platforms ship the Swift runtime with the OS (static linking is refused there).
static=()
[ "$(uname -s)" = Linux ] && static=(--static-swift-stdlib -Xswiftc -static-stdlib)
swift build -c release --product pyfa "${static[@]}"
bin=$(swift build -c release --show-bin-path)
mkdir -p pyfa/_lib/include
lib=libpyfa.so
[ -f "$bin/libpyfa.dylib" ] && lib=libpyfa.dylib
cp "$bin/$lib" pyfa/_lib/$lib.tmp && mv pyfa/_lib/$lib.tmp pyfa/_lib/$lib
cp shaders/common/*.h native/CPyfa/include/pyfa.h pyfa/_lib/include/
echo "built pyfa/_lib/$lib"
