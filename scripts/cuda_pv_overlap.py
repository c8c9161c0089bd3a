"""How much of the warpgroup-MMA prefill's softmax runs under P V, from SASS (no GPU).

The loop issues S = Q Kᵀ and the previous tile's P V together, waits for S alone
(WARPGROUP.DEPBAR.LE gsb0, 0x1), runs the softmax, and waits for P V
(WARPGROUP.DEPBAR.LE gsb0, 0x0) only before P's fragments are rewritten. ptxas may
move the second wait up, before the exponentials, and then the softmax no longer runs
while the tensor cores work on P V. This counts, per loop body of each function, the
exponentials (MUFU.EX2) between the two waits ("under") and after the second one.

    bash scripts/cuda_sass.sh --sass flash_attn_prefill__fc2_64_128_128_0 | python3 scripts/cuda_pv_overlap.py

cuda_sass.sh compiles through the library's own path, with the NVRTC it loads;
another one (the GPU machine's CUDA 13.0 schedules differently from newer wheels, e.g.
the nvidia-cuda-nvrtc==13.0.* wheel unpacked in DIR):
    LD_LIBRARY_PATH=DIR/nvidia/cu13/lib PYFA_NVRTC=DIR/nvidia/cu13/lib/libnvrtc.so.13 bash scripts/cuda_sass.sh ...
(the library directory on LD_LIBRARY_PATH: NVRTC opens its builtins library by name).
Rebuild the library after editing a kernel: it embeds the sources.
"""
import re
import sys

FUNCTION = re.compile(r"^\s*Function : (\S+)")
WAIT_S = re.compile(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1\b")
WAIT_ALL = re.compile(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0\b")
ISSUE = re.compile(r"WARPGROUP\.ARRIVE\b")
EXP = re.compile(r"\bMUFU\.EX2\b")


def loops(lines):
    """(under, after) per loop body: exponentials between S's wait and P V's wait, and
    after P V's wait up to the next products' issue (or the end)."""
    out = []
    state, under, after = None, 0, 0
    for line in lines:
        if WAIT_S.search(line):
            if state == "after":
                out.append((under, after))
            state, under, after = "under", 0, 0
        elif WAIT_ALL.search(line):
            if state == "under":
                state = "after"
        elif ISSUE.search(line):
            if state == "after":
                out.append((under, after))
            state = None
        elif EXP.search(line):
            if state == "under":
                under += 1
            elif state == "after":
                after += 1
    if state == "after":
        out.append((under, after))
    return out


def functions(text):
    """{function name: its SASS lines} in cuobjdump -sass output."""
    out, name = {}, None
    for line in text.splitlines():
        m = FUNCTION.match(line)
        if m:
            name = m.group(1)
            out[name] = []
        elif name is not None:
            out[name].append(line)
    return out


def main():
    found = functions(sys.stdin.read())
    if not found:
        sys.exit("cuda_pv_overlap: no 'Function :' in the input (pipe cuda_sass.sh --sass into it)")
    for name, lines in found.items():
        bodies = loops(lines)
        text = "; ".join(f"{u} of {u + a} under P V" for u, a in bodies) or "no loop with both waits"
        print(f"{name}: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
