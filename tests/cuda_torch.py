"""For test modules that run pyfa's cuda backend on torch CUDA tensors: torch and
the pyfa cuda Device, or the calling module skipped with the reason (no torch,
no CUDA device, or the backend unavailable)."""
import pytest

import pyfa


def torch_and_cuda_device():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
    try:
        return torch, pyfa.Device("cuda")
    except pyfa.PyfaError as e:
        pytest.skip(f"pyfa cuda backend unavailable: {e}", allow_module_level=True)
