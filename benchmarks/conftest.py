import numpy as np
import pytest

import pyfa
from gate_record import GATES, terminal_summary


def pytest_addoption(parser):
    parser.addoption("--serving-gates", action="store_true", default=False,
                     help="fail serving-loop benchmarks (test_serving_loop.py) that miss their targets; "
                          "without it the targets are recorded in extra_info only")
    parser.addoption("--gate-json", default=None, metavar="PATH",
                     help="write every gate's outcome (case, value, bound, pass/fail) to PATH as JSON")


def pytest_configure(config):
    config.stash[GATES] = []


def pytest_terminal_summary(terminalreporter, config):
    terminal_summary(terminalreporter, config)


@pytest.fixture(scope="session")
def cpu():
    return pyfa.Device("cpu")


def enabled(config) -> bool:
    """True when pytest-benchmark is timing (--benchmark-enable / --benchmark-only)."""
    disabled = config.getoption("benchmark_disable", False) and not config.getoption("benchmark_enable", False)
    return not disabled and not config.getoption("benchmark_skip", False)


@pytest.fixture
def full_size(request):
    return enabled(request.config)
