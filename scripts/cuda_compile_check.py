"""Compiles every CUDA kernel specialisation the dispatchers can request, for
each architecture given (default sm_80 and sm_90a), with NVRTC and no GPU.
A kernel that does not compile fails with NVRTC's log. Uses pyfa's disk cache.

    python3 scripts/cuda_compile_check.py [sm_80 sm_90a ...]
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pyfa._native import ffi, lib  # noqa: E402


def main(archs):
    failed = False
    for arch in archs:
        count = ffi.new("uint32_t *")
        t0 = time.perf_counter()
        status = lib.pyfa_cuda_compile_all(arch.encode(), count)
        took = time.perf_counter() - t0
        if status != lib.PYFA_OK:
            failed = True
            print(f"cuda compile check {arch}: FAILED\n{ffi.string(lib.pyfa_last_error()).decode(errors='replace')}")
        else:
            print(f"cuda compile check {arch}: {count[0]} specialisations compiled in {took:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["sm_80", "sm_90a"]))
