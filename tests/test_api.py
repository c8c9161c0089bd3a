"""Library, device, buffer and error surface; thread safety."""
import re
import threading

import numpy as np
import pytest

import pyfa
from pyfa import _native, errors
from pyfa._native import ffi, lib

# The parameter-struct headers the binding reads: installed beside the library
# (pyfa/_lib/include), or shaders/common in a source tree without a build.
HEADERS = _native._find_header("pyfa_params.h").parent


def test_backends_and_default_device():
    names = pyfa.backends()
    assert names[-1] == "cpu" and len(set(names)) == len(names)
    d = pyfa.default_device()
    assert d.backend in names and d is pyfa.default_device()


def test_cpu_device_info(cpu):
    assert cpu.backend == "cpu" and cpu.compute_units >= 1 and "CPU" in cpu.name
    # Backend facts come from the device, not from its name.
    assert cpu.host_visible and not cpu.is_gpu and cpu.simd_width == 1


def test_supported_lists_come_from_the_shader_headers():
    assert pyfa.supported("head_dims") == (64, 80, 96, 128, 192, 256, 512)
    assert pyfa.supported("tq_head_dims") == (64, 128, 256, 512)
    assert pyfa.supported("tq_bits") == (2, 3, 4, 8)
    assert pyfa.supported("attn_dtypes") == (lib.PYFA_DTYPE_F32, lib.PYFA_DTYPE_F16, lib.PYFA_DTYPE_BF16)
    with pytest.raises(pyfa.InvalidArgumentError, match="what"):
        pyfa.supported("widths")


def test_every_status_code_has_an_exception_class():
    codes = {getattr(lib, n) for n in dir(lib) if n.startswith("PYFA_ERR_")}
    assert codes == set(errors.BY_STATUS), "each PYFA_ERR_* in pyfa.h needs a PyfaError subclass"
    assert lib.PYFA_OK not in errors.BY_STATUS
    assert issubclass(pyfa.InvalidArgumentError, ValueError)


def test_struct_sizes_agree_between_python_and_library():
    names = ["pyfa_device_info"] + re.findall(r"}\s*(pyfa_\w+_params)\s*;",
                                               "".join(p.read_text() for p in HEADERS.glob("*.h")))
    assert "pyfa_flash_attn_vec_params" in names
    for name in names:
        assert lib.pyfa_struct_size(name.encode()) == ffi.sizeof(name), name
    assert ffi.sizeof("pyfa_flash_attn_vec_params") == 40
    assert ffi.sizeof("pyfa_attn_reduce_params") == 16
    assert lib.pyfa_struct_size(b"pyfa_kv_pages") == ffi.sizeof("pyfa_kv_pages") == 16
    assert lib.pyfa_struct_size(b"no_such_struct") == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float16, pyfa.bfloat16, np.uint8, np.uint16, np.uint32, np.int32])
def test_shared_buffer_numpy_view_is_zero_copy(cpu, dtype):
    b = cpu.buffer((3, 5), dtype)
    view = b.numpy()
    assert view.shape == (3, 5) and view.dtype == np.dtype(dtype)
    data = (np.arange(15) % 7).astype(dtype).reshape(3, 5)
    view[...] = data
    np.testing.assert_array_equal(b.read(), data)          # the library sees the writes
    b.write(data[::-1].copy())
    np.testing.assert_array_equal(view, data[::-1])         # and the view sees library writes


def test_numpy_view_keeps_buffer_alive(cpu):
    view = cpu.buffer((1024,), np.float32).numpy()
    view[:] = 3.0
    import gc
    gc.collect()
    assert (view == 3.0).all()


def test_private_buffer_has_no_view(cpu):
    b = cpu.buffer((4,), np.float32, storage="private")
    with pytest.raises(pyfa.InvalidArgumentError, match="numpy: only shared storage"):
        b.numpy()
    b.write(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(b.read(), np.arange(4))


def test_wrap_shares_memory(cpu):
    a = np.zeros(8, np.float32)
    b = cpu.wrap(a)
    b.write(np.ones(8, np.float32))
    assert (a == 1).all()
    with pytest.raises(pyfa.InvalidArgumentError, match="C-contiguous"):
        cpu.wrap(np.zeros((4, 4), np.float32)[:, ::2])


def test_threads_decoding_at_once_on_one_device(cpu):
    """Several Python threads decode concurrently (cffi drops the GIL) and each
    gets its own correct result."""
    rng = np.random.default_rng(1)
    jobs = []
    for i in range(6):
        q = rng.standard_normal((8, 128)).astype(np.float32)
        k = rng.standard_normal((4, 512, 128)).astype(np.float16)
        v = rng.standard_normal((4, 512, 128)).astype(np.float16)
        n = 100 + 60 * i
        jobs.append((q, k, v, n, pyfa.reference.decode_attention(q, k, v, n)))
    errs = []

    def work(job):
        q, k, v, n, ref = job
        try:
            for _ in range(10):
                out = pyfa.decode_attention(q, k, v, n, device=cpu)
                assert np.abs(out - ref).max() < 2e-5
        except Exception as e:  # surfaced below
            errs.append(e)

    threads = [threading.Thread(target=work, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errs, errs
