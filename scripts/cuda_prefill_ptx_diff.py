"""Checks that rectangular flash_attn_prefill specialisations compile to the
same PTX as at an earlier revision (NVRTC, no GPU): the packed modes
(varlen, paged) must not change the rectangular kernel's code, whose speed
is benchmarked against FlashAttention. Register numbers and labels are
normalised; anything else that differs is reported.

    python3 scripts/cuda_prefill_ptx_diff.py BASE_REV [NEW_REV]   # NEW_REV default: the working tree
"""
import ctypes
import ctypes.util
import glob
import os
import re
import subprocess
import sys
import sysconfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Constants in the dispatcher's order (PYFA_PREFILL_FC_*): dtype, head_dim, block_q, block_k,
# has_mask, mask_kind, causal, window, softcap, blk, lse, out dtype. Each backend tile of the CUDA plan.
CASES = [(2, 128, 64, 64, 0, 0, 1, 0, 0, 0, 0, 2), (1, 64, 64, 64, 0, 0, 0, 1, 1, 0, 1, 0),
         (2, 256, 64, 32, 1, 0, 1, 1, 1, 1, 1, 0), (1, 512, 64, 32, 0, 0, 1, 0, 0, 0, 1, 1),
         (0, 128, 16, 32, 1, 1, 1, 0, 0, 1, 1, 0), (0, 64, 16, 32, 0, 0, 0, 1, 1, 0, 0, 0)]
OPTIONS = [b"-arch=sm_90a", b"-std=c++17", b"-default-device", b"-diag-suppress=177", b"-DPYFA_PREFILL_P_TERMS=2"]


def nvrtc():
    found = ctypes.util.find_library("nvrtc")
    candidates = [found] if found else []
    candidates += sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "lib", "libnvrtc.so*")))
    for c in candidates:
        if c and "builtins" not in c:
            return ctypes.CDLL(c)
    sys.exit("cuda_prefill_ptx_diff: libnvrtc not found")


def sources(rev):
    """{file name: text} of shaders/cuda and shaders/common at `rev` (None: the working tree)."""
    out = {}
    for d in ("shaders/cuda", "shaders/common"):
        if rev is None:
            for n in glob.glob(os.path.join(REPO, d, "*")):
                out[os.path.basename(n)] = open(n).read()
            continue
        names = subprocess.check_output(["git", "-C", REPO, "ls-tree", "--name-only", f"{rev}:{d}"]).decode().split()
        for n in names:
            out[n] = subprocess.check_output(["git", "-C", REPO, "show", f"{rev}:{d}/{n}"]).decode()
    return out


def ptx(lib, files, constants):
    src = files["attn_prefill.cu"] + "\n"
    args = ", ".join(map(str, constants))
    src += ('extern "C" __global__ void __launch_bounds__(128) entry(const __grid_constant__ pyfa_cuda_args a) '
            f"{{ flash_attn_prefill_body<{args}>(a); }}\n")
    headers = [(n, t) for n, t in files.items() if not n.endswith(".cu")]
    texts = (ctypes.c_char_p * len(headers))(*[t.encode() for _, t in headers])
    names = (ctypes.c_char_p * len(headers))(*[n.encode() for n, _ in headers])
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"attn_prefill.cu", len(headers), texts, names) == 0
    opts = (ctypes.c_char_p * len(OPTIONS))(*OPTIONS)
    if lib.nvrtcCompileProgram(prog, len(OPTIONS), opts) != 0:
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        sys.exit(f"cuda_prefill_ptx_diff: {constants} does not compile:\n{log.value.decode()}")
    n = ctypes.c_size_t()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    out = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, out)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return out.value.decode()


def normalised(text):
    lines = []
    for line in text.splitlines():
        if line.startswith("//") or line.strip().startswith(".reg"):
            continue
        line = re.sub(r"%(r|rd|f|fd|p|rs|h|hh)\d+", r"%\1", line)
        lines.append(re.sub(r"\$L__BB\d+_\d+", "L", line))
    return lines


def main(argv):
    if not argv:
        sys.exit(__doc__)
    base, new = sources(argv[0]), sources(argv[1] if len(argv) > 1 else None)
    # A kernel with the KV_MODE constant takes one more template argument (0: rectangular).
    new_has_mode = "int KV_MODE>" in new["attn_prefill.cu"]
    base_has_mode = "int KV_MODE>" in base["attn_prefill.cu"]
    lib = nvrtc()
    failed = 0
    for c in CASES:
        a = normalised(ptx(lib, base, c + ((0,) if base_has_mode else ())))
        b = normalised(ptx(lib, new, c + ((0,) if new_has_mode else ())))
        same = a == b
        failed += not same
        print(f"{c}: {'same PTX' if same else f'PTX differs ({len(a)} vs {len(b)} lines)'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
