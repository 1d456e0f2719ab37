"""Where a profiled step's GPU waited, read from its Chrome trace (bench/train_throughput.py writes one per row
that BENCH_TRACE_ROWS names): each gap of `--min_us` or more between kernels, in time order, with the host's
view of it: the CUDA runtime calls that blocked the host across it (a synchronize, a blocking copy, an allocator's
cudaFree), and the host op that launched the kernel ending it, how long after the gap began.

A gap whose ending kernel was launched late was the host's own time (Python, launches); one whose kernel was
launched early but ran late waited on the host through a blocking call, listed beside it.

    python bench/trace_gaps.py ROW.trace.json.gz [--min_us 50] [--top 30] [--steps]

--steps: each profiled step apart (bench/throughput.py --profile_steps N profiles N; the first follows the
profiler's synchronize, the others are steady steps): its GPU time from the end of one optimizer step's kernels to
the end of the next's, the kernels' busy time in it, the idle rest, and how far ahead of the GPU the host launched
at the step's first and last kernels (a lead near zero: the host held the GPU back there).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from pathlib import Path

BLOCKING = ("Synchronize", "cudaMemcpy ", "cudaMemcpy(", "cudaFree", "cudaMalloc", "cudaHostAlloc", "cuMemMap",
            "cuMemUnmap", "cuMemCreate", "cuMemRelease", "cudaEventSynchronize")


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def gaps(events: list[dict], min_us: float) -> list[dict]:
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                     key=lambda e: e["ts"])
    runtime = sorted((e for e in events if e.get("cat") == "cuda_runtime" and "dur" in e), key=lambda e: e["ts"])
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and "dur" in e), key=lambda e: e["ts"])
    launch_of = {e["args"].get("correlation"): e for e in runtime if "correlation" in e.get("args", {})}
    op_starts = [e["ts"] for e in ops]
    found, end = [], None
    for k in kernels:
        if end is not None and k["ts"] - end >= min_us:
            launch = launch_of.get(k.get("args", {}).get("correlation"))
            blocking = [r for r in runtime if r["ts"] < k["ts"] and r["ts"] + r["dur"] > end
                        and any(b in r["name"] for b in BLOCKING)]
            found.append({"at_us": end, "gap_us": k["ts"] - end, "kernel": k["name"][:60],
                          "launched_after_us": None if launch is None else launch["ts"] - end,
                          "launched_by": None if launch is None else innermost(ops, op_starts, launch["ts"]),
                          "blocking": [f"{r['name']} {r['dur']:.0f}us" for r in blocking][:3]})
        end = k["ts"] + k["dur"] if end is None else max(end, k["ts"] + k["dur"])
    return found


def steps(events: list[dict]) -> list[dict]:
    """Each step of the trace, ending where the kernels of an optimizer step (the host op `Optimizer.step#...`) end:
    its GPU wall time, the kernels' busy time (their union), and the host's lead at its first and last kernel."""
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                     key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    optimizer_steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("cpu_op", "user_annotation")
                       and e.get("name", "").startswith("Optimizer.step#")]
    ends = []
    for begin, finish in sorted(optimizer_steps):
        theirs = [k["ts"] + k["dur"] for k in kernels
                  if begin <= launches.get(k.get("args", {}).get("correlation"), -1.0) <= finish]
        if theirs:
            ends.append(max(theirs))
    found, start = [], kernels[0]["ts"] if kernels else 0.0
    for end in ends:
        inside = [k for k in kernels if start <= k["ts"] < end]
        if not inside:
            continue
        busy = union_us([(k["ts"], min(k["ts"] + k["dur"], end)) for k in inside])
        lead = [k["ts"] - launches[k["args"]["correlation"]] for k in (inside[0], inside[-1])
                if k.get("args", {}).get("correlation") in launches]
        found.append({"wall_us": end - start, "busy_us": busy, "idle_us": end - start - busy, "kernels": len(inside),
                      "lead_us": lead})
        start = end
    return found


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, None
    for s, e in sorted(intervals):
        if reach is None or s > reach:
            total, reach = total + e - s, e
        elif e > reach:
            total, reach = total + e - reach, e
    return total


def innermost(ops: list[dict], starts: list[float], at: float) -> str:
    """The shortest host op running at `at` (the op that issued a launch), with its outermost one."""
    i = bisect.bisect_right(starts, at)
    around = [o for o in ops[max(0, i - 2000):i] if o["ts"] + o["dur"] >= at]
    if not around:
        return "(python)"
    inner, outer = min(around, key=lambda o: o["dur"]), max(around, key=lambda o: o["dur"])
    return inner["name"] if inner is outer else f"{outer['name'][:40]} > {inner['name'][:50]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("--min_us", type=float, default=50.0)
    p.add_argument("--top", type=int, default=30, help="the longest gaps listed (all are summed)")
    p.add_argument("--steps", action="store_true", help="each profiled step's busy and idle GPU time")
    args = p.parse_args()
    events = load(args.trace)
    if args.steps:
        for i, step in enumerate(steps(events), 1):
            print(f"step {i}: {step['wall_us'] / 1e3:7.1f} ms, kernels busy {step['busy_us'] / 1e3:7.1f} ms, idle "
                  f"{step['idle_us'] / 1e3:5.1f} ms ({step['kernels']} kernels); host ahead by "
                  + " -> ".join(f"{lead / 1e3:.1f}" for lead in step["lead_us"]) + " ms at its first -> last kernel")
    found = gaps(events, args.min_us)
    start = found[0]["at_us"] if found else 0.0
    print(f"{len(found)} gaps of {args.min_us:.0f} us or more, {sum(g['gap_us'] for g in found) / 1e3:.1f} ms in all")
    for g in sorted(found, key=lambda g: -g["gap_us"])[:args.top]:
        late = g["launched_after_us"]
        print(f"+{(g['at_us'] - start) / 1e3:8.2f} ms  gap {g['gap_us'] / 1e3:6.2f} ms  launched "
              f"{'?' if late is None else f'{late / 1e3:+.2f} ms'} by {g['launched_by']}  -> {g['kernel']}"
              + (f"  [host blocked: {', '.join(g['blocking'])}]" if g["blocking"] else ""))


if __name__ == "__main__":
    main()
