"""A few TQ-4 and dense f16 decodes (32K positions, Hq/Hkv = 16/8), recorded and run
once, for a profiler to take apart kernel by kernel:

    ncu --clock-control none --metrics gpu__time_duration.sum python3 scripts/gpu_tq_profile.py --once
    python3 scripts/gpu_tq_profile.py --case 8,128 --case 1,256     (batch, head dim) cases
    python3 scripts/gpu_tq_profile.py --nwg 16                      the TurboQuant decode's workgroups per
                                                                    sequence forced (0: the plan's)

Without a profiler it prints the per-call time of each (CUDA events, as gpu_tq_check.py).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_tq_check as chk  # noqa: E402
import pyfa  # noqa: E402


def main():
    dev, fw = pyfa.Device("cuda"), chk.Frame()
    L = 32768
    # --case B,D (repeatable) replaces the default cases
    cases = [tuple(int(x) for x in sys.argv[i + 1].split(",")) for i, a in enumerate(sys.argv) if a == "--case"]
    tq_nwg = int(sys.argv[sys.argv.index("--nwg") + 1]) if "--nwg" in sys.argv else 0
    for B, D in cases or [(1, 256), (1, 128)]:
        tr, trec, tbytes, tnwg, _ = chk.tq_recorder(dev, fw, B, 16, 8, D, L, 4, nwg=tq_nwg)
        dr, drec, dbytes, dnwg = chk.dense_recorder(dev, fw, B, 16, 8, D, L)
        for name, r, rec, nwg in (("tq4", tr, trec, tnwg), ("f16", dr, drec, dnwg)):
            rec(2)
            r.commit()
            fw.torch.cuda.synchronize()
            if "--once" in sys.argv:
                continue
            us = fw.timed(r.commit, 10, 3, lambda: rec(10))
            print(f"B={B} D={D} {name}: {us:.1f} us per call (nwg {nwg})", flush=True)


if __name__ == "__main__":
    main()
