"""cffi ABI-mode binding of libpyfa.

The cdef comes from the C headers themselves (pyfa.h and the parameter-struct
header it includes), with preprocessor lines removed, so Python never holds a
second copy of a declaration.
"""
from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import cffi

_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parent

# Header search order: the installed copy beside the library, then the source tree.
_HEADER_DIRS = [_HERE / "_lib" / "include", _REPO / "shaders" / "common", _REPO / "native" / "CPyfa" / "include"]
_ROOT_HEADER = "pyfa.h"

_LIB_CANDIDATES = [
    _HERE / "_lib" / "libpyfa.so",
    _HERE / "_lib" / "libpyfa.dylib",
    _REPO / ".build" / "release" / "libpyfa.so",
    _REPO / ".build" / "release" / "libpyfa.dylib",
]

_SKIP_BLOCKS = re.compile(r"__cplusplus|__METAL_VERSION__|__CUDACC_RTC__|PYFA_ABI_DECLARATIONS_ONLY")
_LOCAL_INCLUDE = re.compile(r'^#include\s+"([^"]+)"')
_INT_DEFINE = re.compile(r"^#define\s+([A-Z_][A-Z0-9_]*)\s+(-?\d+)\s*(/\*.*\*/)?\s*$")


def _find_header(name: str) -> Path:
    for d in _HEADER_DIRS:
        if (d / name).is_file():
            return d / name
    raise ImportError(f"pyfa: header {name} not found in {[str(d) for d in _HEADER_DIRS]}")


def header_cdef(name: str, seen: set | None = None) -> str:
    """Turns a C header into cffi cdef text: inlines local #include "x.h"
    headers once, drops blocks guarded by __cplusplus / __METAL_VERSION__ /
    __CUDACC_RTC__ / PYFA_ABI_DECLARATIONS_ONLY (functions the kernel languages share), keeps
    integer #defines, drops other preprocessor lines."""
    seen = set() if seen is None else seen
    if name in seen:
        return ""
    seen.add(name)
    # Backslash-newline joins lines before anything else, as in C, so a
    # multi-line macro is one preprocessor line (and dropped whole).
    text = _find_header(name).read_text().replace("\\\n", " ")
    out: list[str] = []
    depth_skip = 0  # nesting depth inside a skipped block
    depth = 0
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#if"):
            depth += 1
            if depth_skip or _SKIP_BLOCKS.search(s):
                depth_skip += 1
            continue
        if s.startswith("#endif"):
            depth -= 1
            if depth_skip:
                depth_skip -= 1
            continue
        if depth_skip:
            continue
        if s.startswith("#"):
            inc = _LOCAL_INCLUDE.match(s)
            if inc:
                out.append(header_cdef(inc.group(1), seen))
                continue
            m = _INT_DEFINE.match(s)
            if m:
                out.append(f"#define {m.group(1)} {m.group(2)}")
            continue
        out.append(line)
    return "\n".join(out)


def _library_path() -> Path:
    env = os.environ.get("PYFA_LIBRARY")
    if env:
        return Path(env)
    for p in _LIB_CANDIDATES:
        if p.is_file():
            return p
    raise ImportError(
        "pyfa: libpyfa not found; build it with `bash scripts/build.sh` "
        f"(looked in {[str(p) for p in _LIB_CANDIDATES]}; PYFA_LIBRARY overrides)"
    )


ffi = cffi.FFI()
CDEF = header_cdef(_ROOT_HEADER)
ffi.cdef(CDEF)
LIBRARY_PATH = _library_path()
lib = ffi.dlopen(str(LIBRARY_PATH))

if lib.pyfa_abi_version() != lib.PYFA_ABI_VERSION:
    raise ImportError(
        f"pyfa: {LIBRARY_PATH} has ABI version {lib.pyfa_abi_version()}, "
        f"the headers say {lib.PYFA_ABI_VERSION}; rebuild with `bash scripts/build.sh`"
    )


def _wheel_nvrtc() -> str | None:
    """libnvrtc from the nvidia-cuda-nvrtc wheel (CUDA 13 layout, then 12), if installed."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for rel in ("cu13/lib/libnvrtc.so.13", "cuda_nvrtc/lib/libnvrtc.so.12", "cuda_nvrtc/lib/libnvrtc.so.13"):
            p = Path(root) / rel
            if p.is_file():
                return str(p)
    return None


# The CUDA backend tries $PYFA_NVRTC and the system's libnvrtc first; the
# wheel's copy is its last resort.
_nvrtc = _wheel_nvrtc()
if _nvrtc:
    lib.pyfa_set_nvrtc_path(_nvrtc.encode())
