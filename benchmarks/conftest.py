import numpy as np
import pytest

import pyfa


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
