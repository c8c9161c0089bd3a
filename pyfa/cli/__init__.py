"""`python -m pyfa`: the main job.

    python -m pyfa [--backend B]          what is here, a quick check, one decode timing
    python -m pyfa info                   version, backends, devices, what each supports
    python -m pyfa check [--full]         every op against the float64 reference
    python -m pyfa bench [--op ...]       decode / prefill / TurboQuant timings beside torch SDPA

Errors: a bad option, or an argument the library refuses (a head dim it has no
kernels for, a backend with no device here), print one line
`python -m pyfa: error: ...` on stderr and exit with status 2; a failure while
running (a kernel fault) exits with 1, as does a failed check.
"""
from __future__ import annotations

import argparse
import os
import sys

import pyfa

PROG = "python -m pyfa"
# Errors that mean "the request cannot be served as asked": the user's to fix, like a bad option.
USAGE_ERRORS = (pyfa.InvalidArgumentError, pyfa.UnsupportedError, pyfa.BackendUnavailableError)


class UsageError(Exception):
    """A bad command line, reported in one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `prog: error: message (see --help)`, exit status 2."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def _backend_option(p, top: bool) -> None:
    # The sub-commands' copy has no default, so `--backend` given before the sub-command stays in force.
    kw = {"default": None} if top else {"default": argparse.SUPPRESS}
    p.add_argument("--backend", "--device", dest="backend", metavar="NAME",
                   help="auto, cpu, cuda or metal (default: $PYFA_BACKEND when set, as for pyfa.default_device(), "
                        "else auto: the best GPU that opens, else the CPU)", **kw)


def backend_name(args) -> str:
    """The backend a command runs on: --backend, else $PYFA_BACKEND, else auto."""
    return args.backend or os.environ.get("PYFA_BACKEND") or "auto"


def parser() -> argparse.ArgumentParser:
    from . import bench, check, info

    top = _Parser(prog=PROG, description="pyfa's main job: with no command, says what is here, runs a quick "
                                         "check and times one decode (well under a minute on a laptop).",
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    _backend_option(top, True)
    sub = top.add_subparsers(dest="command", metavar="{info,check,bench}", parser_class=_Parser)
    for name, module, text in (("info", info, "version, backends, devices and what each supports"),
                               ("check", check, "every op against the float64 reference; exit 0 when all pass"),
                               ("bench", bench, "time decode / prefill / TurboQuant beside torch SDPA")):
        p = sub.add_parser(name, help=text, description=module.__doc__)
        _backend_option(p, False)
        module.add_arguments(p)
    return top


def main(argv=None) -> int:
    """Runs the main job on `argv` (default sys.argv[1:]); returns the exit status."""
    from . import bench, check, info, quick

    try:
        try:
            args = parser().parse_args(argv)
        except SystemExit as e:  # --help
            return int(e.code or 0)
        command = {"info": info.run, "check": check.run, "bench": bench.run}.get(args.command, quick.run)
        return command(args)
    except UsageError as e:
        return _error(str(e), 2)
    except USAGE_ERRORS as e:
        return _error(str(e), 2)
    except pyfa.PyfaError as e:
        return _error(str(e), 1)
    except KeyboardInterrupt:
        return _error("interrupted", 130)
    except BrokenPipeError:
        # The reader left (`| head`): quiet, with stdout pointed at devnull so the interpreter's final
        # flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _error(message: str, status: int) -> int:
    # One line: a library message may carry a compiler log on later lines, which a usage error never has.
    first, *rest = message.strip().splitlines() or [""]
    print(f"{PROG}: error: {first}", file=sys.stderr)
    if rest and status == 1:
        print("\n".join(rest), file=sys.stderr)
    return status
