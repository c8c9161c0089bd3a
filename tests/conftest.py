import os
import re
import zlib
from pathlib import Path

import numpy as np
import pytest

import pyfa


def _check_package_origin() -> None:
    """$PYFA_EXPECT_PREFIX (set by scripts/wheel_check.sh, which runs this suite
    against an installed wheel) names the environment pyfa must be imported
    from: a source tree that shadows the installed package stops the run."""
    prefix = os.environ.get("PYFA_EXPECT_PREFIX")
    if not prefix:
        return
    origin = Path(pyfa.__file__).resolve()
    if not origin.is_relative_to(Path(prefix).resolve()):
        raise pytest.UsageError(f"pyfa was imported from {origin}, not from the environment {prefix} "
                                "($PYFA_EXPECT_PREFIX): the run would not test the installed package")


_check_package_origin()
AVAILABLE = pyfa.available_backends()
_NAMED = os.environ.get("PYFA_BACKEND") or os.environ.get("PYFA_TEST_BACKENDS")


def _test_backends() -> list[str]:
    """Backends the suite runs on: $PYFA_BACKEND (one backend, which is then
    also the default device of calls that name none) or $PYFA_TEST_BACKENDS
    (a comma list); by default the CPU and every GPU that opens. A device that
    opens but runs on the CPU without being the CPU backend (the Metal
    backend's MSL executor on Linux) runs only when named."""
    if _NAMED:
        return _NAMED.split(",")
    return [b for b in AVAILABLE if b == "cpu" or pyfa.Device(b).is_gpu]


TEST_BACKENDS = _test_backends()


def _fixture_backends() -> list[str]:
    """The device fixture's parameters: the selected backends, plus (unless
    backends were named) compiled-in GPU backends without a device here, which
    skip saying so. A device that opens but is not selected is left out
    rather than skipped, so the skips count only GPU cases that did not run."""
    compiled = [b for b in ["cpu", "cuda", "metal"] if b in pyfa.backends()]
    if _NAMED:
        return [b for b in compiled if b in TEST_BACKENDS]
    return [b for b in compiled if b in TEST_BACKENDS or b not in AVAILABLE]


@pytest.fixture(params=_fixture_backends())
def device(request):
    if request.param not in AVAILABLE:
        pytest.skip(f"backend {request.param} has no device here")
    if request.param not in TEST_BACKENDS:
        pytest.skip(f"backend {request.param} not selected (PYFA_BACKEND={request.param} runs it)")
    return pyfa.Device(request.param)


@pytest.fixture(params=[b for b in _fixture_backends() if b != "cpu"])
def accelerator(request):
    """A non-CPU backend the suite runs on (the device fixture's rules), for
    tests that compare it with the CPU backend."""
    if request.param not in AVAILABLE:
        pytest.skip(f"backend {request.param} has no device here")
    if request.param not in TEST_BACKENDS:
        pytest.skip(f"backend {request.param} not selected (PYFA_BACKEND={request.param} runs it)")
    return pyfa.Device(request.param)


@pytest.fixture
def cpu():
    return pyfa.Device("cpu")


@pytest.fixture
def dev():
    """The device of tests that run on one backend (bad input, low-level
    calls): $PYFA_BACKEND's when set, else the CPU."""
    return pyfa.Device(os.environ.get("PYFA_BACKEND") or "cpu")


@pytest.fixture
def rng(request):
    # A fresh, reproducible stream per test.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


_NOT_YET = re.compile(r"no (CUDA|Metal) implementation yet")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """An op whose kernels a GPU backend does not have yet reports
    UnsupportedError ("no CUDA implementation yet", "no Metal implementation
    yet"): such cases skip, saying so, instead of failing; every other error
    still fails."""
    outcome = yield
    exc = outcome.excinfo[1] if outcome.excinfo else None
    if isinstance(exc, pyfa.UnsupportedError) and _NOT_YET.search(str(exc)):
        outcome.force_exception(pytest.skip.Exception(str(exc).splitlines()[0], _use_item_location=True))
