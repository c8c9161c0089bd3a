import zlib
import os

import numpy as np
import pytest

import pyfa


AVAILABLE = pyfa.available_backends()
# Backends the suite runs on: every backend that opens here, or PYFA_TEST_BACKENDS.
TEST_BACKENDS = os.environ.get("PYFA_TEST_BACKENDS", ",".join(AVAILABLE)).split(",")


@pytest.fixture(params=[b for b in ["cpu", "cuda", "metal"] if b in pyfa.backends()])
def device(request):
    if request.param not in AVAILABLE or request.param not in TEST_BACKENDS:
        pytest.skip(f"backend {request.param} has no device here")
    return pyfa.Device(request.param)


@pytest.fixture
def cpu():
    return pyfa.Device("cpu")


@pytest.fixture
def rng(request):
    # A fresh, reproducible stream per test.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """An op whose kernels a GPU backend does not have yet reports
    UnsupportedError ("no CUDA implementation yet"): such cases skip, saying so,
    instead of failing; every other error still fails."""
    outcome = yield
    exc = outcome.excinfo[1] if outcome.excinfo else None
    if isinstance(exc, pyfa.UnsupportedError) and "no CUDA implementation yet" in str(exc):
        outcome.force_exception(pytest.skip.Exception(str(exc).splitlines()[0], _use_item_location=True))
