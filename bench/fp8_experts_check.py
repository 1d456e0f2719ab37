"""The routed experts' grouped matmuls in FP8 (sft/speed/fp8_experts.py: `--fp8` beside `--quantize_experts fp8`)
against what runs without it, on one MoE layer of DeepSeek-V2-Lite's shape (64 experts of 2,048 -> 2 x 1,408 ->
2,048, 6 per token, 4 x 2,048 tokens, random weights and routing):

- the kernel: torch._scaled_grouped_mm's output and input gradient against the emulation the CPU tests run
  (emulated_fp8_grouped_mm: dequantized operands, fp32 sums), relative L2 error; PASS under 1%;
- FP8's rounding: both against the bf16 matmuls on the dequantized weights (what runs without --fp8);
- the time of the layer's forward and backward (the gate's activation between the matmuls included), median of
  CUDA-event timings: the dequantize-then-bf16 path against the FP8 path.

    python bench/fp8_experts_check.py --run_id R --results bench/results.jsonl   # one GPU (compute capability 9.0/10.0)
    python bench/fp8_experts_check.py --tiny                                      # CPU plumbing (the emulation)
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from kernel_measures import commit, median_ms, record, relative  # noqa: E402

V2_LITE = {"experts": 64, "hidden": 2048, "intermediate": 1408, "top_k": 6, "tokens": 4 * 2048}
TINY = {"experts": 4, "hidden": 64, "intermediate": 32, "top_k": 2, "tokens": 48}


def routing(tokens: int, top_k: int, experts: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k distinct experts at random, as (expert id per pair sorted, group ends)."""
    g = torch.Generator(device=device).manual_seed(0)
    choice = torch.rand(tokens, experts, generator=g, device=device).topk(top_k, dim=-1).indices
    expert_ids = torch.sort(choice.reshape(-1))[0]
    return expert_ids, torch.cumsum(torch.bincount(expert_ids, minlength=experts), 0).to(torch.int32)


def main(argv: list[str] | None = None) -> int:
    from sft.model.quantized_experts import dequantize, quantize_rows
    from sft.speed.fp8 import call_compiled, quantize, quantize_rows as quantize_tokens
    from sft.speed.fp8_experts import _compiled_quantize_scaled
    from sft.machine import machine
    from sft.speed.fp8_experts import emulated_fp8_grouped_mm, fp8_grouped_mm, grouped_linear, quantize_scaled_rows

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU plumbing: 4 experts, 48 tokens, the emulated kernel")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--run_id", default=dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%MZ-fp8experts"))
    p.add_argument("--results", type=Path)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if device == "cuda":
        why = machine().fp8_grouped_problem()
        if why:
            print(f"SKIP fp8-experts-check: {why}", flush=True)
            return 0
    shape = TINY if args.tiny else V2_LITE
    e, hidden, inter, top_k, tokens = (shape[k] for k in ("experts", "hidden", "intermediate", "top_k", "tokens"))
    g = torch.Generator(device=device).manual_seed(1)
    held = {}
    for name, size in (("gate_up", (e, 2 * inter, hidden)), ("down", (e, hidden, inter))):
        w = (torch.randn(size, generator=g, device=device) * 0.02).bfloat16()
        q, scale = quantize_rows(w)
        held[name] = (q, scale.squeeze(-1), scale)
    expert_ids, offsets = routing(tokens, top_k, e, device)
    x = torch.randn(expert_ids.numel(), hidden, generator=g, device=device).bfloat16()
    grad = torch.randn(expert_ids.numel(), hidden, generator=g, device=device).bfloat16()

    def gate(h: torch.Tensor) -> torch.Tensor:
        a, b = h.chunk(2, dim=-1)
        return F.silu(a) * b

    def fp8_layer(inp: torch.Tensor) -> torch.Tensor:
        h = gate(grouped_linear(inp, *held["gate_up"][:2], expert_ids, offsets))
        return grouped_linear(h, *held["down"][:2], expert_ids, offsets)

    def bf16_layer(inp: torch.Tensor) -> torch.Tensor:  # what runs without --fp8: dequantize, bf16 grouped matmuls
        up = dequantize(held["gate_up"][0], held["gate_up"][2], torch.bfloat16)
        h = gate(F.grouped_mm(inp, up.transpose(-2, -1), offs=offsets))
        down = dequantize(held["down"][0], held["down"][2], torch.bfloat16)
        return F.grouped_mm(h, down.transpose(-2, -1), offs=offsets)

    def forward_backward(layer):
        inp = x.clone().requires_grad_()
        out = layer(inp)
        out.backward(grad)
        return out.detach(), inp.grad

    # the kernel against its emulation, on the first matmul's forward and input gradient
    w_q, w_scale = held["gate_up"][:2]
    x_q, x_scale = quantize_tokens(x)
    kernel_out = fp8_grouped_mm(x_q, x_scale.view(-1), w_q, w_scale, offsets)
    want_out = emulated_fp8_grouped_mm(x_q, x_scale.view(-1), w_q, w_scale, offsets)
    up_grad = torch.randn_like(kernel_out)
    g_q, g_scale = quantize_scaled_rows(up_grad, w_scale, expert_ids)
    w_t = w_q.transpose(-2, -1).contiguous()
    ones = torch.ones(w_t.shape[:2], device=device)
    kernel_dx = fp8_grouped_mm(g_q, g_scale.view(-1), w_t, ones, offsets)
    want_dx = emulated_fp8_grouped_mm(g_q, g_scale.view(-1), w_t, ones, offsets)
    kernel_error = {"forward": relative(kernel_out, want_out), "input_grad": relative(kernel_dx, want_dx)}

    fp8_out, fp8_dx = forward_backward(fp8_layer)
    bf16_out, bf16_dx = forward_backward(bf16_layer) if device == "cuda" or args.tiny else (None, None)
    vs_bf16 = {"forward": relative(fp8_out, bf16_out), "input_grad": relative(fp8_dx, bf16_dx)}
    timing = {}
    if device == "cuda":
        for name, layer in (("bf16_dequantized", bf16_layer), ("fp8", fp8_layer)):
            for _ in range(3):
                forward_backward(layer)  # warm-up: the compiled quantize kernels, cuBLAS/CUTLASS plans
            timing[f"{name}_ms"] = round(median_ms(lambda: forward_backward(layer), args.repeats), 3)
        timing["speedup"] = round(timing["bf16_dequantized_ms"] / timing["fp8_ms"], 3)
        # where the FP8 layer's time goes: the first matmul's kernels alone, and what surrounds them
        up = dequantize(held["gate_up"][0], held["gate_up"][2], torch.bfloat16)
        parts = {
            "bf16_grouped_mm_up_fwd": lambda: F.grouped_mm(x, up.transpose(-2, -1), offs=offsets),
            "fp8_grouped_mm_up_fwd": lambda: fp8_grouped_mm(x_q, x_scale.view(-1), w_q, w_scale, offsets),
            "fp8_grouped_mm_up_fwd_fast_accum": lambda: fp8_grouped_mm(x_q, x_scale.view(-1), w_q, w_scale, offsets,
                                                                       True),
            "fp8_grouped_mm_up_input_grad": lambda: fp8_grouped_mm(g_q, g_scale.view(-1), w_t, ones, offsets),
            "dequantize_up": lambda: dequantize(held["gate_up"][0], held["gate_up"][2], torch.bfloat16),
            "transpose_up_e4m3": lambda: w_q.transpose(-2, -1).contiguous(),
            "quantize_scaled_grad_up": lambda: call_compiled(_compiled_quantize_scaled(), up_grad, w_scale, expert_ids),
            "quantize_tokens": lambda: quantize(x),
        }
        timing["parts_ms"] = {name: round(median_ms(fn, args.repeats), 3) for name, fn in parts.items()}
    passed = max(kernel_error.values()) < 0.01
    row = {"run_id": args.run_id, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit(), "bench": "fp8_experts_check", "shape": "tiny" if args.tiny else "deepseek-v2-lite",
           "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "pairs": int(expert_ids.numel()),
           "kernel_vs_emulation": {k: round(v, 6) for k, v in kernel_error.items()},
           "fp8_vs_bf16": {k: round(v, 6) for k, v in vs_bf16.items()}, **timing, "pass": passed,
           "weights": "random init, random routing (V2-Lite's shapes)"}
    record(row, f"{'PASS' if passed else 'FAIL'} fp8-experts-check: kernel vs emulation {kernel_error}, FP8 vs bf16 "
           f"{vs_bf16}{f', {timing}' if timing else ''}", args.results)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
