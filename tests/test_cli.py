"""`python -m pyfa` (pyfa/cli): the sub-commands in-process through main(argv),
one run through a subprocess from another directory, one-line errors for bad
arguments, and a check that finds a broken op."""
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pyfa
from pyfa.cli import _table, main, quick

ROOT = Path(__file__).resolve().parents[1]
# A bench small enough for the suite: one context, one repeat, no torch.
SMALL_BENCH = ["bench", "--context", "64", "--repeats", "1", "--heads", "4", "--kv-heads", "2", "--head-dim", "64"]


@pytest.fixture
def backend(dev):
    """The backend the suite runs on (tests/conftest.py `dev`): $PYFA_BACKEND's, else the CPU."""
    return dev.backend


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _check_rows(out: str) -> list[list[str]]:
    """check's table rows as cells (columns are two or more spaces apart; an op name may hold one)."""
    cells = [re.split(r"\s{2,}", line.strip()) for line in _lines(out)]
    return [c for c in cells if len(c) == 6 and c[-1] in ("PASS", "FAIL")]


def test_info_lists_backends_devices_and_ops(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"backends compiled in: {', '.join(pyfa.backends())}" in out
    assert f"C ABI version {pyfa._native.lib.pyfa_abi_version()}" in out
    assert "head dims " + ", ".join(str(d) for d in pyfa.supported("head_dims")) in out
    for name in pyfa.available_backends():
        block = _block(out, name)
        assert "  ops: decode yes, prefill + merge yes, KVCache yes, TurboQuantKVCache yes" in block
        assert "  plans (pyfa_*_plan_new, prepared calls): yes" in block
    for name in set(pyfa.backends()) - set(pyfa.available_backends()):
        assert f"{name}:\n  not available here: " in out


def _block(out: str, name: str) -> list[str]:
    """The indented lines under `name:` in info's output."""
    lines = out.splitlines()
    start = lines.index(f"{name}:") + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return lines[start:end]


def test_info_shows_an_op_that_fails(capsys, monkeypatch):
    def refuse(*args, **kw):
        raise pyfa.UnsupportedError("KVCache: refused for this test")
    monkeypatch.setattr(pyfa, "KVCache", refuse)
    assert main(["info", "--backend", "cpu"]) == 0
    block = _block(capsys.readouterr().out, "cpu")
    assert "  ops: decode yes, prefill + merge yes, KVCache no (KVCache: refused for this test), " \
           "TurboQuantKVCache yes" in block


def test_info_device_clock(capsys):
    """Metal reports each submission's device time; the CPU backend has no such clock."""
    assert main(["info", "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert "  device clock (pyfa_encoder_device_seconds): no" in _block(out, "cpu")
    if "metal" in pyfa.available_backends():
        assert "  device clock (pyfa_encoder_device_seconds): yes" in _block(out, "metal")


def test_info_one_backend_without_probe(capsys):
    assert main(["info", "--backend", "cpu", "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert "\ncpu:\n" in out and "ops:" not in out
    assert "device clock (pyfa_encoder_device_seconds): no" in out  # the CPU has no device clock


def test_check_passes_and_prints_every_op(capsys, backend):
    assert main(["check", "--backend", backend]) == 0
    out = capsys.readouterr().out
    rows = _check_rows(out)
    ops = {r[0] for r in rows}
    assert {"decode", "prefill", "merge", "KVCache", "kv_append", "TurboQuantKVCache"} <= ops
    assert {r[1] for r in rows if r[0] == "decode"} == {"f32", "f16", "bf16"}
    assert all(r[-1] == "PASS" for r in rows)
    assert _lines(out)[-1].startswith("PASS: ")


def _broken_decode(real):
    def decode(*args, **kw):
        result = real(*args, **kw)
        if isinstance(result, tuple):
            return (result[0] + np.asarray(1e-2, result[0].dtype),) + result[1:]
        return result + np.asarray(1e-2, result.dtype)
    return decode


def test_check_finds_a_broken_op(capsys, monkeypatch):
    monkeypatch.setattr(pyfa, "decode_attention", _broken_decode(pyfa.decode_attention))
    assert main(["check", "--backend", "cpu"]) == 1
    out = capsys.readouterr().out
    rows = {(r[0], r[1]): r[-1] for r in _check_rows(out)}
    assert {rows[("decode", dt)] for dt in ("f32", "f16", "bf16")} == {"FAIL"}
    assert rows[("decode lse", "f32")] == "PASS" and rows[("prefill", "f32")] == "PASS"
    assert _lines(out)[-1].startswith("FAIL: ")


def test_check_reports_an_op_that_raises(capsys, monkeypatch):
    def refuse(*args, **kw):
        raise pyfa.UnsupportedError("merge: refused for this test")
    monkeypatch.setattr(pyfa, "merge_attention_states", refuse)
    assert main(["check", "--backend", "cpu"]) == 1
    out = capsys.readouterr().out
    assert ["merge", "error", "8", "inf", "0", "FAIL"] in _check_rows(out)
    assert "UnsupportedError: merge: refused for this test" in out


def test_bench_table_and_plot(capsys, tmp_path, backend):
    png = tmp_path / "bench.png"
    assert main(SMALL_BENCH + ["--backend", backend, "--no-torch", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in _lines(out) if line.split()[0] in ("decode", "prefill", "tq")]
    assert [(r[0], r[1]) for r in rows] == [("decode", "64"), ("prefill", "64"), ("tq", "64")]
    for r in rows:
        assert float(r[2]) > 0 and r[-2:] == ["-", "-"]  # no torch columns
    assert "torch SDPA: skipped, not asked for (--no-torch)" in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot: not written, it needs matplotlib (pip install matplotlib)" in out and not png.exists()
    else:
        assert f"plot: {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_beside_torch(capsys):
    pytest.importorskip("torch", reason="torch is not installed: bench's SDPA column cannot run")
    assert main(SMALL_BENCH + ["--backend", "cpu", "--op", "decode,prefill", "--no-plot"]) == 0
    rows = [line.split() for line in _lines(capsys.readouterr().out) if line.split()[0] in ("decode", "prefill")]
    assert len(rows) == 2
    for r in rows:
        # The times print with 3 significant digits (up to 0.5% off each, so their quotient up to
        # about 1% off), the ratio with 2 decimals (up to 0.005 off): the two errors add, which
        # pytest.approx (the larger of rel and abs) would not allow.
        quotient = float(r[-2]) / float(r[2])
        assert float(r[-2]) > 0 and abs(float(r[-1]) - quotient) <= 0.005 + 0.011 * quotient + 1e-9


def test_plot_needs_matplotlib(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: the PNG path cannot run")
    from pyfa.cli import bench

    results = [{"op": "decode", "L": L, "median": L * 1e-6, "torch": L * 2e-6} for L in (64, 128)]
    assert bench.plot(results, str(tmp_path / "p.png"), "t") == f"plot: {tmp_path / 'p.png'}"
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_default_checks_and_times_a_decode(capsys, monkeypatch, backend):
    monkeypatch.setattr(quick, "DECODE_SHAPE", {"B": 1, "H": 4, "Hkv": 2, "D": 64, "L": 256})
    assert main(["--backend", backend]) == 0
    out = capsys.readouterr().out
    assert f"device: {backend} (" in out
    assert "check (quick set, every op and dtype): PASS: " in out
    assert "decode: B=1 Hq=4 Hkv=2 D=64 context=256" in out and "ok);" in out and "GB/s" in out


BAD = [  # argv, what the one error line says
    (["bench", "--head-dim", "100", "--op", "decode", "--context", "64", "--no-torch", "--no-plot"],
     "head_dim: 100 is not supported"),
    (["bench", "--heads", "3", "--kv-heads", "2", "--op", "prefill", "--context", "8", "--no-torch", "--no-plot"],
     "num_heads: 3 must be a multiple of num_kv_heads (2)"),
    (["bench", "--op", "tq", "--head-dim", "80", "--context", "8", "--no-torch", "--no-plot"],
     "head_dim: 80 is not supported by TurboQuant"),
    (["bench", "--batch", "0"], "argument --batch: 0 must be a positive integer"),
    (["bench", "--context", "64,x"], "argument --context: 'x' is not an integer"),
    (["bench", "--op", "decode,foo"], "argument --op: 'foo' is not one of decode, prefill, tq"),
    (["bench", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--backend", "nope"], "unknown backend 'nope'"),
    (["check", "--backend", "nope"], "unknown backend 'nope'"),
    (["check", "--quick", "--full"], "argument --full: not allowed with argument --quick"),
    (["frob"], "invalid choice: 'frob'"),
    (["info", "--probe"], "unrecognized arguments: --probe"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_get_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(_lines(err)) == 1 and err.startswith("python -m pyfa: error: ") and message in err, err


def test_missing_gpu_backend_is_one_line(capsys):
    missing = [b for b in pyfa.backends() if b not in pyfa.available_backends()]
    if not missing:
        pytest.skip("every backend compiled in opens here: no missing device to ask for")
    assert main(["check", "--backend", missing[0]]) == 2
    err = capsys.readouterr().err
    assert len(_lines(err)) == 1 and err.startswith(f"python -m pyfa: error: backend '{missing[0]}'")


def _run_module(args, cwd):
    # The pyfa this process runs, and whatever else PYTHONPATH gives (cffi on the GPU machine).
    paths = [str(Path(pyfa.__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    return subprocess.run([sys.executable, "-m", "pyfa", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_module_runs_from_another_directory(tmp_path):
    done = _run_module(["info", "--no-probe"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"package {Path(pyfa.__file__).resolve().parent}" in done.stdout and "backends compiled in:" in done.stdout
    assert done.stderr == ""


def test_module_error_has_no_traceback(tmp_path):
    done = _run_module(["bench", "--head-dim", "100", "--op", "decode", "--context", "8", "--no-torch", "--no-plot"],
                       tmp_path)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert _lines(done.stderr)[-1].startswith("python -m pyfa: error: head_dim: 100")
    assert len([line for line in _lines(done.stderr) if "error" in line]) == 1


def test_help_exits_zero(capsys):
    assert main(["--help"]) == 0 and "{info,check,bench}" in capsys.readouterr().out
    assert main(["bench", "--help"]) == 0 and "--kv-heads" in capsys.readouterr().out


def test_progress_redraws_one_line_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    p = _table.Progress(4, "check", stream)
    for i in range(4):
        p.step(f"case {i}")
    p.close()
    text = stream.getvalue()
    assert "\n" not in text and text.count("\r") == 6 and "[" + "#" * _table.Progress.WIDTH + "] 4/4 case 3" in text
    assert text.endswith("\r")


def test_progress_prints_about_ten_lines_elsewhere():
    stream = io.StringIO()
    p = _table.Progress(95, "check", stream)
    for i in range(95):
        p.step(f"case {i}")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "check 1/95 case 0" and lines[-1] == "check 95/95 case 94" and len(lines) == 11


def test_table_aligns_columns():
    text = _table.table(["op", "n"], [["decode", 3], ["kv_append", 12]], right={1})
    assert text.splitlines() == ["op          n", "---------  --", "decode      3", "kv_append  12"]
