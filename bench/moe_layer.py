"""Time one DeepSeek MoE layer's routed experts (router + experts, forward + backward) under each of transformers'
experts implementations, against a dense MLP of the same active FLOPs, and append one JSON line to
bench/results.jsonl.

    python bench/moe_layer.py                       # CPU: hidden 512, 16 experts, top-2, 2048 tokens, fp32
    python bench/moe_layer.py --device cuda --dtype bfloat16 --tokens 16384 --hidden 2048 --experts 64 --top_k 6 \
        --moe_intermediate 1408 --implementations eager grouped_mm --record      # one DeepSeek-V2-Lite MoE layer

transformers 5.24 (integrations/moe.py) picks the experts' forward from `config._experts_implementation`:
  - "grouped_mm" (the default whenever the model class allows it, which DeepSeek V2/V3 do): tokens sorted by expert,
    then ONE grouped matrix product per projection over the fused [E, 2I, H] / [E, H, I] weights
    (torch.nn.functional.grouped_mm, with offsets per expert; a per-expert torch.mm loop only as the fallback
    where grouped_mm cannot run: torch.compile with non-bf16 weights, torch <= 2.8 on CPU, old GPUs);
  - "batched_mm": each (token, expert) pair gathers its expert's weight matrix and runs one bmm (memory: K copies
    of a weight per token);
  - "eager": the modeling file's own forward, a Python loop over the experts that got tokens.
The dense reference is a SwiGLU MLP of intermediate size K x I: the FLOPs of the K experts a token runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def timed(step, warmup: int, repeats: int, device: str) -> float:
    """Median seconds of one forward+backward."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top_k", type=int, default=2)
    p.add_argument("--moe_intermediate", type=int, default=512)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--implementations", nargs="+", default=["eager", "grouped_mm", "batched_mm"],
                   help="experts implementations to time (batched_mm gathers one weight matrix per token and expert: "
                        "at V2-Lite's shape it asks for ~1 TiB)")
    p.add_argument("--record", action="store_true", help="append the result to --results")
    p.add_argument("--results", type=Path, default=REPO / "bench" / "results.jsonl")
    args = p.parse_args()

    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2MLP, DeepseekV2Moe

    dtype = getattr(torch, args.dtype)
    config = DeepseekV2Config(hidden_size=args.hidden, n_routed_experts=args.experts,
                              num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate,
                              n_shared_experts=1, topk_method="greedy")
    torch.manual_seed(0)
    block = DeepseekV2Moe(config).to(args.device, dtype)
    for param in (block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight):
        torch.nn.init.normal_(param, std=0.02)
    block.gate.weight.data = block.gate.weight.data.float()  # the router stays fp32, as transformers keeps it
    dense = DeepseekV2MLP(config, intermediate_size=args.top_k * args.moe_intermediate).to(args.device, dtype)
    x = torch.randn(args.tokens, args.hidden, device=args.device, dtype=dtype, requires_grad=True)

    def routed_step():
        _, weights, chosen = block.gate(x)
        block.experts(x, chosen, weights.to(dtype)).sum().backward()

    def dense_step():
        dense(x).sum().backward()

    results = {}
    for implementation in args.implementations:
        config._experts_implementation = implementation
        results[implementation] = timed(routed_step, args.warmup, args.repeats, args.device)
    results["dense"] = timed(dense_step, args.warmup, args.repeats, args.device)
    # Tokens per expert of this (random) routing: the load the loop and the grouped product see.
    with torch.no_grad():
        load = torch.bincount(block.gate(x)[2].flatten(), minlength=args.experts)
    active_flops = 6 * args.tokens * args.top_k * 3 * args.hidden * args.moe_intermediate  # fwd + bwd, 3 matmuls
    for name, seconds in results.items():
        print(f"{name:>11}: {seconds * 1e3:8.1f} ms  {active_flops / seconds / 1e9:7.1f} GFLOP/s  "
              f"{seconds / results['dense']:.2f}x dense")
    print(f"tokens per expert: min {int(load.min())}, max {int(load.max())}")
    if args.record:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()
        import transformers

        gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        line = {"bench": "moe_layer", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "commit": commit, "gpu": gpu, "machine": f"{platform.processor() or platform.machine()}, "
                f"{os.cpu_count()} cores, {torch.get_num_threads()} threads",
                "torch": torch.__version__, "transformers": transformers.__version__, "dtype": args.dtype,
                "hidden": args.hidden, "experts": args.experts, "top_k": args.top_k,
                "moe_intermediate": args.moe_intermediate, "tokens": args.tokens,
                "ms": {k: round(v * 1e3, 2) for k, v in results.items()},
                "vs_dense": {k: round(v / results["dense"], 2) for k, v in results.items()},
                "tokens_per_expert_min_max": [int(load.min()), int(load.max())]}
        with open(args.results, "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
