"""CUDA-event timing the GPU benchmarks share (torch must be importable)."""
import torch


def event_ms(fn, iters=5, rounds=3):
    """Milliseconds per call of ``fn``: CUDA events around ``iters`` back-to-back calls on torch's
    current stream, the median of ``rounds`` rounds, after one untimed call (compiles, plans)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return sorted(times)[rounds // 2]
