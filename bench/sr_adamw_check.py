"""`--optim adamw_bf16_sr` (sft/speed/sr_adamw.py) on one GPU: its step time against plain bf16 fused AdamW (what TRL's
full fine-tune runs) and torchao's 8-bit AdamW with stochastic rounding (our plan until now), over the parameters of
deepseek-llm-7b's shape; and on the GPU the compiled update against the eager one (bit for bit) and the tiny
updates that plain bf16 AdamW drops. PASS/FAIL lines, a JSON line at the end, exit status 1 on a FAIL.

    python bench/sr_adamw_check.py                  # 7B's parameters (~6.9e9: needs ~85 GB with fp32 states)
    python bench/sr_adamw_check.py --layers 8       # fewer decoder layers (the step time scales with them)
    python bench/sr_adamw_check.py --cpu_smoke      # plumbing on a CPU: one tiny layer, eager

Bytes per parameter and step (read + write): plain bf16 AdamW and ours with bf16 states 14, ours with fp32 states
22, torchao 8-bit ~10 plus its dequantize/quantize work. The GB/s column is those bytes over the measured time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
FAILS: list[str] = []
BYTES = {"plain_bf16_fused": 14, "ours_bf16_states": 14, "ours_fp32_states": 22, "torchao_8bit_sr": 10}


def verdict(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILS.append(name)


def shapes(layers: int, tiny: bool) -> list[tuple[int, ...]]:
    h, i, v = (64, 128, 256) if tiny else (4096, 11008, 102400)
    layer = [(h, h)] * 4 + [(i, h), (i, h), (h, i), (h,), (h,)]
    return [(v, h)] + layer * layers + [(h,), (v, h)]


def step_time(make, params, grads, warmup: int, iters: int) -> tuple[float, float]:
    """-> (first step's seconds: state creation and compiles, ms per later step)."""
    import torch

    optimizer = make(params)
    for p, g in zip(params, grads):
        p.grad = g
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    optimizer.step()
    sync()
    first = time.perf_counter() - start
    for _ in range(warmup):
        optimizer.step()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        optimizer.step()
    sync()
    ms = (time.perf_counter() - start) * 1e3 / iters
    optimizer.state.clear()
    del optimizer
    return first, ms


def main(argv: list[str] | None = None) -> int:
    import torch

    from sft.speed.sr_adamw import AdamWBf16SR

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=30, help="decoder layers (deepseek-llm-7b: 30)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--cpu_smoke", action="store_true")
    args = p.parse_args(argv)
    device = "cpu" if args.cpu_smoke else "cuda"
    if args.cpu_smoke:
        args.layers, args.warmup, args.iters = 1, 1, 2

    # correctness on this device: compiled (the GPU default) against eager, bit for bit; tiny updates kept
    def small_run(compile: bool):
        generator = torch.Generator(device).manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, device=device, generator=generator).bfloat16())
              for s in [(256, 64), (1000,)]]
        optimizer = AdamWBf16SR(ps, lr=1e-2, weight_decay=0.1, compile=compile)
        for _ in range(3):
            for q in ps:
                q.grad = torch.randn(q.shape, device=device, generator=generator).bfloat16()
            optimizer.step()
        return ps

    same = all(torch.equal(a, b) for a, b in zip(small_run(False), small_run(not args.cpu_smoke)))
    verdict("compiled_equals_eager", same, "weights after 3 steps, bit for bit")
    ones = torch.nn.Parameter(torch.ones(1 << 16, device=device, dtype=torch.bfloat16))
    optimizer = AdamWBf16SR([ones], lr=1e-4)
    for _ in range(100):
        ones.grad = torch.ones_like(ones)
        optimizer.step()
    drift = (1 - ones.float().mean().item()) / (100 * 1e-4)
    verdict("tiny_updates_kept", abs(drift - 1) < 0.03, f"moved {drift:.3f} of what fp32 AdamW moves (plain bf16: 0)")
    del ones, optimizer

    sizes = shapes(args.layers, args.cpu_smoke)
    n = sum(torch.Size(s).numel() for s in sizes)
    generator = torch.Generator(device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=generator).bfloat16() * 0.02) for s in sizes]
    grads = [torch.randn(s, device=device, generator=generator).bfloat16() * 1e-3 for s in sizes]
    print(f"{len(sizes)} parameters, {n / 1e9:.2f}e9 values (bf16), on {device}", flush=True)
    makers = {
        "plain_bf16_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-5, weight_decay=0.1, fused=device == "cuda"),
        "ours_bf16_states": lambda ps: AdamWBf16SR(ps, lr=1e-5, weight_decay=0.1),
        "ours_fp32_states": lambda ps: AdamWBf16SR(ps, lr=1e-5, weight_decay=0.1, state_dtype="float32"),
    }
    try:
        from torchao.optim import AdamW8bit

        from sft.speed.lowbit import prepare_optimizer

        prepare_optimizer("adamw_torch_8bit")
        makers["torchao_8bit_sr"] = lambda ps: AdamW8bit(ps, lr=1e-5, weight_decay=0.1, bf16_stochastic_round=True)
    except ImportError:
        print("torchao not importable: its row is left out", flush=True)
    results = {}
    for name, make in makers.items():
        try:
            first, ms = step_time(make, params, grads, args.warmup, args.iters)
        except torch.OutOfMemoryError:
            print(f"{name}: out of memory (use --layers)", flush=True)
            torch.cuda.empty_cache()
            continue
        results[name] = {"ms": round(ms, 2), "first_step_s": round(first, 1),
                         "gb_s": round(BYTES[name] * n / ms / 1e6, 0)}
        print(f"{name}: {ms:.2f} ms per step ({results[name]['gb_s']:.0f} GB/s at {BYTES[name]} B/parameter); first "
              f"step {first:.1f} s", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    if not args.cpu_smoke and {"plain_bf16_fused", "ours_bf16_states"} <= results.keys():
        ratio = results["ours_bf16_states"]["ms"] / results["plain_bf16_fused"]["ms"]
        verdict("step_time_vs_plain_bf16", ratio <= 1.25,
                f"ours (bf16 states) takes {ratio:.2f}x the plain bf16 fused AdamW step")
    print(json.dumps({"sr_adamw_check": results, "parameters": n, "fails": FAILS}), flush=True)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
