"""What the kernel checks (bench/*_check.py) measure: a relative L2 error and the median time of a GPU call."""

from __future__ import annotations

import json
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


def commit() -> str:
    """The commit the check ran at (bench/train_throughput.py's reading, BENCH_COMMIT where the tree has no git)."""
    from train_throughput import git_commit

    return git_commit()


def record(row: dict, verdict: str, results) -> None:
    """Print the check's row and its PASS/FAIL line (what bench/throughput.py shows), and append the row to the
    results file where one is given."""
    print(json.dumps(row), flush=True)
    print(verdict, flush=True)
    if results:
        with open(results, "a") as f:
            f.write(json.dumps(row) + "\n")
