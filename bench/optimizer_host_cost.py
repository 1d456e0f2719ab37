"""The host's share of one optimizer step: `--optim adamw_bf16_sr` (compiled: 16 parameters per call; and one call
per parameter, as it was before) against torch's foreach AdamW (a few calls for all), on 273 tiny bf16 parameters
(deepseek-llm-7b's count: 30 layers x 9 + 3), so that what is timed is the per-call cost, not the arithmetic.

    python bench/optimizer_host_cost.py            # CPU or GPU; prints ms per step for each

Why: on an H200 the full fine-tune with adamw_bf16_sr took 27 ms more per step than TRL's plain bf16 AdamW with the
same matmul time (bench/RESULTS.md, run 20261201T2200Z-compile-full). sft/safety/guards.py's NaN check reads the gradients'
norm on the host right before the optimizer step, so the GPU waits while the host issues that step: a host-bound
step shows up whole.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sft.speed.sr_adamw import AdamWBf16SR  # noqa: E402


def ms_per_step(optimizer, device: str, steps: int = 20) -> float:
    for _ in range(3):  # compile, and the states' first allocation
        optimizer.step()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16, device=device)) for _ in range(273)]
    for p in params:
        p.grad = torch.randn_like(p)
    print(f"{device}, torch {torch.__version__}, 273 parameters of 64 values:")
    for label, group_size in (("compiled, 16 per call: ", 16), ("compiled per parameter:", 1)):
        optimizer = AdamWBf16SR(params, lr=1e-4, compile=True)
        optimizer.group_size = group_size
        print(f"  adamw_bf16_sr, {label} {ms_per_step(optimizer, device):.1f} ms per step")
    print(f"  torch AdamW foreach:                   {ms_per_step(torch.optim.AdamW(params, lr=1e-4, foreach=True), device):.1f} ms"
          " per step")


if __name__ == "__main__":
    main()
