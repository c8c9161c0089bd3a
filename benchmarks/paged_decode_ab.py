"""CPU paged decode / contiguous decode of this checkout beside another one, in one process.

    PYTHONPATH=. python3 benchmarks/paged_decode_ab.py OTHER_CHECKOUT [--lengths 1024,8192] [--rounds 11]

OTHER_CHECKOUT is a pyfa source tree with a built pyfa/_lib (for instance a `git worktree` of the
commit to compare against). Its pyfa package is imported a second time under another name, so
both libraries run in one process on the same arrays (test_paged_decode_bench.py's inputs: NHD
pool with shuffled pages, HND pool with pages in order), calls interleaved. On a shared machine
this is the comparison that holds: separate runs of the benchmark swing by 30% from run to run
(memory bandwidth taken by other jobs, transparent huge pages given or not), far more than the
differences measured. Each ratio divides by the contiguous time pooled over both checkouts when
--pool-contiguous is given (their dense decode is the same code), else by that checkout's own.
"""
import argparse
import importlib.util
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pyfa  # noqa: E402
from test_paged_decode_bench import hnd_in_order, inputs  # noqa: E402


def import_other(checkout: Path):
    """The other checkout's pyfa package, imported as pyfa_other from a copy."""
    src = checkout / "pyfa"
    if not (src / "_lib").is_dir():
        sys.exit(f"paged_decode_ab: {src}/_lib not found (build that checkout first: bash scripts/build.sh)")
    dst = Path(tempfile.mkdtemp(prefix="pyfa_ab_")) / "pyfa_other"
    shutil.copytree(src, dst)
    spec = importlib.util.spec_from_file_location("pyfa_other", dst / "__init__.py",
                                                  submodule_search_locations=[str(dst)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["pyfa_other"] = module
    spec.loader.exec_module(module)
    return module


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other", type=Path)
    ap.add_argument("--lengths", default="1024,8192")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--pool-contiguous", action="store_true")
    args = ap.parse_args()
    sides = {"other": import_other(args.other.resolve()), "this": pyfa}
    for L in (int(x) for x in args.lengths.split(",")):
        q, k, v, kp, vp, table = inputs(L)
        kh, vh, order = hnd_in_order(k, v)
        calls = {}
        for name, m in sides.items():
            cpu = m.Device("cpu")
            calls[name, "contiguous"] = lambda m=m, cpu=cpu: m.decode_attention(q, k, v, L, device=cpu)
            calls[name, "paged"] = lambda m=m, cpu=cpu: m.paged_decode_attention(q, kp, vp, table, L, device=cpu)
            calls[name, "paged_hnd"] = lambda m=m, cpu=cpu: m.paged_decode_attention(q, kh, vh, order, L,
                                                                                      page_layout="hnd", device=cpu)
        expected = calls["this", "contiguous"]()
        for key, call in calls.items():  # every call reads the same rows: f32 accumulation order apart
            np.testing.assert_allclose(call(), expected, atol=2e-5, rtol=0, err_msg=str(key))
        times = {key: [] for key in calls}
        for _ in range(args.rounds):
            for key, call in calls.items():
                t0 = time.perf_counter()
                call()
                times[key].append(time.perf_counter() - t0)
        pooled = np.median(times["other", "contiguous"] + times["this", "contiguous"])
        for name in sides:
            base = pooled if args.pool_contiguous else np.median(times[name, "contiguous"])
            print(f"L={L} {name:5s} contiguous {base * 1e3:.2f} ms | " + " | ".join(
                f"{kind} {np.median(times[name, kind]) * 1e3:.2f} ms x{np.median(times[name, kind]) / base:.2f}"
                for kind in ("paged", "paged_hnd")))


if __name__ == "__main__":
    main()
