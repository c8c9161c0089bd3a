"""scripts/cuda_pv_overlap.py counts a prefill loop's exponentials on either side of P V's wait."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "cuda_pv_overlap.py"
if not SCRIPT.is_file():  # the wheel check and the GPU bundle run a copy of tests/ without scripts/
    pytest.skip(f"no {SCRIPT} (not a source tree)", allow_module_level=True)
spec = importlib.util.spec_from_file_location("cuda_pv_overlap", SCRIPT)
overlap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(overlap)

SASS = """
        Function : kernel_a
        /*0010*/  WARPGROUP.ARRIVE ;
        /*0020*/  WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0030*/  MUFU.EX2 R1, R1 ;
        /*0040*/  WARPGROUP.ARRIVE ;
        /*0050*/  WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0060*/  MUFU.EX2 R2, R2 ;
        /*0070*/  @P0 MUFU.EX2 R3, R3 ;
        /*0080*/  WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0090*/  MUFU.EX2 R4, R4 ;
        /*00a0*/  WARPGROUP.ARRIVE ;
        /*00b0*/  WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*00c0*/  WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*00d0*/  MUFU.EX2 R5, R5 ;
        Function : kernel_b
        /*0010*/  MUFU.EX2 R1, R1 ;
"""


def test_counts_each_loop_body_and_function():
    found = overlap.functions(SASS)
    assert list(found) == ["kernel_a", "kernel_b"]
    # the peeled first tile (one wait, no S wait before it) is not a loop body
    assert overlap.loops(found["kernel_a"]) == [(2, 1), (0, 1)]
    assert overlap.loops(found["kernel_b"]) == []
