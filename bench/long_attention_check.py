"""Long rows' attention on one GPU: which of sdpa's kernels sdpa picks for one causal conversation of 32,768 tokens,
and how fast each kernel it has runs it, forward and backward in bf16 (issue 27 item 1: at 32k attention is about
half of the LoRA step).

Shapes: R1-Distill-Qwen-7B's grouped heads (28 query, 4 key/value heads of 128) and deepseek-llm-7b's (32 heads of
128, no grouping), one row. Each kernel runs the grouped shape twice: with `enable_gqa` (what transformers passes
when there is no mask) and with the key/value heads repeated (what it does otherwise); a kernel that cannot take
the inputs is reported as such, not timed. torch's varlen FlashAttention (`--attn_implementation varlen`) over the
row as one document is timed beside them.

- correctness: each kernel's output and query/key/value gradients at 4,096 tokens against fp32 math; PASS where
  every kernel that ran is within 1%;
- time: median of CUDA-event timings of forward + backward at 32,768 tokens; `default`: what sdpa picks, named by
  the kernels the profiler saw.

    python bench/long_attention_check.py --run_id R --results bench/results.jsonl   # one GPU (compute capability 8.0+)
    python bench/long_attention_check.py --tiny                                      # CPU plumbing (math stands in)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from kernel_measures import commit, median_ms, record, relative  # noqa: E402

SHAPES = {"r1-distill-qwen-7b": (28, 4, 128), "deepseek-llm-7b": (32, 32, 128)}  # heads, key/value heads, size
KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION}
# the profiler's kernel names, to say which kernel the default picked
KERNEL_MARKS = {"cudnn": ("cudnn", "sdpa_flash", "fmha_cutlass"), "flash": ("flash_fwd", "flash_bwd"),
                "efficient": ("fmha_cutlassF", "fmha_cutlassB", "mem_efficient")}


def attend(q, k, v, grouped: bool):
    """sdpa over [1, heads, tokens, d] inputs, causal; the key/value heads shared (`grouped`) or repeated."""
    if not grouped and k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped and k.shape[1] != q.shape[1])


def varlen_attend(q, k, v, grouped: bool):
    from sft.speed.varlen_attention import varlen_attention_forward

    module = torch.nn.Module()
    return varlen_attention_forward(module, q, k, v, None)[0].transpose(1, 2)


def fwd_bwd(fn, q, k, v, grad, backend, grouped: bool) -> list[torch.Tensor]:
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        out = fn(*leaves, grouped)
    out.backward(grad)
    return [out.detach(), *(t.grad for t in leaves)]


def inputs(heads: int, kv_heads: int, size: int, tokens: int, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, h, tokens, size, generator=g, device=device, dtype=dtype)
               for h in (heads, kv_heads, kv_heads))
    return q, k, v, torch.randn(1, heads, tokens, size, generator=g, device=device, dtype=dtype)


def picked(fn) -> str:
    """The kernel sdpa's default choice ran, by the names of the CUDA kernels the profiler saw."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events()).lower()
    return next((name for name, marks in KERNEL_MARKS.items() if any(m.lower() in names for m in marks)), "other")


def variants(kv_heads: int, heads: int, cuda: bool):
    """(name, attention function, sdpa backend or None for sdpa's own choice, grouped)."""
    groups = (True, False) if kv_heads != heads else (True,)
    out = [(f"default{'' if g else '-repeat'}", attend, None, g) for g in groups]
    if cuda:
        out += [(f"{name}{'' if g else '-repeat'}", attend, backend, g) for name, backend in KERNELS.items()
                for g in groups]
        out += [("varlen", varlen_attend, None, True)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU plumbing: 64 tokens, math stands in")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--check_tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--run_id", default=dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%MZ-attention"))
    p.add_argument("--results", type=Path)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    tokens, check_tokens = (args.tokens, args.check_tokens) if cuda else (64, 64)
    results, passed = {}, True
    for name, (heads, kv_heads, size) in SHAPES.items():
        shape = results[name] = {"errors_vs_fp32": {}, "fwd_bwd_ms": {}, "refused": {}}
        q, k, v, grad = inputs(heads, kv_heads, size, check_tokens, torch.float32, device)
        with sdpa_kernel(SDPBackend.MATH):
            reference = fwd_bwd(attend, q, k, v, grad, None, False)
        for label, fn, backend, grouped in variants(kv_heads, heads, cuda):
            try:
                got = fwd_bwd(fn, *(t.to(dtype) for t in (q, k, v, grad)), backend, grouped)
            except RuntimeError as refused:  # this kernel cannot take these inputs here
                shape["refused"][label] = str(refused).splitlines()[0][:200]
                continue
            errors = {part: round(relative(a, b), 6) for part, a, b in zip(("out", "dq", "dk", "dv"), got, reference)}
            shape["errors_vs_fp32"][label] = errors
            passed &= all(e < 0.01 for e in errors.values())
        if not cuda:
            continue
        q, k, v, grad = inputs(heads, kv_heads, size, tokens, dtype, device)
        for label, fn, backend, grouped in variants(kv_heads, heads, cuda):
            if label in shape["refused"]:
                continue
            run = lambda: fwd_bwd(fn, q, k, v, grad, backend, grouped)  # noqa: E731
            run()  # warm-up (cuDNN builds its graph at the first call of a shape)
            shape["fwd_bwd_ms"][label] = round(median_ms(run, args.repeats), 2)
            if backend is None and fn is attend:
                shape[f"{label}_picked"] = picked(run)
        fastest = min(shape["fwd_bwd_ms"], key=shape["fwd_bwd_ms"].get)
        shape["fastest"] = fastest
        shape["default_over_fastest"] = round(shape["fwd_bwd_ms"]["default"] / shape["fwd_bwd_ms"][fastest], 3)
    row = {"run_id": args.run_id, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit(), "bench": "long_attention_check",
           "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version() if cuda else None, "tokens": tokens,
           "check_tokens": check_tokens, "shapes": results, "pass": passed}
    record(row, f"{'PASS' if passed else 'FAIL'} long-attention-check: " + "; ".join(
        f"{name}: " + ", ".join(f"{label} {ms} ms" for label, ms in r["fwd_bwd_ms"].items())
        + (f" (default picks {r.get('default_picked')}; fastest {r['fastest']})" if "fastest" in r else "")
        + (f"; refused: {', '.join(r['refused'])}" if r["refused"] else "")
        for name, r in results.items()), args.results)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
