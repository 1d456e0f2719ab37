"""What the kernel checks (bench/*_check.py) measure: a relative L2 error and the median time of a GPU call."""

from __future__ import annotations

import statistics

import torch


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in fp32."""
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def median_ms(fn, repeats: int) -> float:
    """The median of `repeats` CUDA-event timings of `fn()` (each synchronized: the kernels it queued, not the
    host's issue time)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
