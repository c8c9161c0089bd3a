"""Exceptions. Each status code of pyfa.h (PYFA_ERR_*) has a subclass of
PyfaError; the mapping is built from the header's constants, and a test
checks that every code has one."""
from __future__ import annotations

from ._native import ffi, lib


class PyfaError(Exception):
    """An error reported by pyfa: the argument and the rule it broke, or what failed."""

    status = None

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status


class InvalidArgumentError(PyfaError, ValueError):
    """An argument breaks a documented rule."""

    status = lib.PYFA_ERR_INVALID_ARGUMENT


class UnsupportedError(PyfaError):
    """Valid input that this backend or build does not implement."""

    status = lib.PYFA_ERR_UNSUPPORTED


class OutOfMemoryError(PyfaError, MemoryError):
    """A device or host allocation failed."""

    status = lib.PYFA_ERR_OUT_OF_MEMORY


class BackendUnavailableError(PyfaError):
    """The backend is not compiled in, or its driver/device is missing."""

    status = lib.PYFA_ERR_BACKEND_UNAVAILABLE


class CompileError(PyfaError):
    """A kernel failed to compile at run time (NVRTC on CUDA; Metal's compiler, on Linux the
    executor's clang); the message carries the compiler's log."""

    status = lib.PYFA_ERR_COMPILE


class ExecutionError(PyfaError):
    """Submitted work failed on the device (a kernel fault, a failed launch or copy)."""

    status = lib.PYFA_ERR_EXECUTION


class InternalError(PyfaError):
    """A broken invariant inside pyfa: a bug to report, not a usage error."""

    status = lib.PYFA_ERR_INTERNAL


BY_STATUS = {cls.status: cls for cls in PyfaError.__subclasses__()}


def check(status: int) -> None:
    """Raises the PyfaError subclass for a non-zero status, with the library's message."""
    if status == lib.PYFA_OK:
        return
    message = ffi.string(lib.pyfa_last_error()).decode("utf-8", "replace")
    raise BY_STATUS.get(status, PyfaError)(message, status)


def invalid(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(message, lib.PYFA_ERR_INVALID_ARGUMENT)
