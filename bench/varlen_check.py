"""`--attn_implementation varlen` (sft/speed/varlen_attention.py) against sdpa with the packed rows' mask, on one GPU:
the attention of one layer over packed rows, forward and backward, in bf16.

Shapes: DeepSeek-V2-Lite's MLA (16 heads, query/key 192, value 128, yarn's scale) and R1-Distill-Qwen-7B's grouped
heads (28 query, 4 key/value heads of 128), each over 4 rows of 2,048 tokens packed with documents of the bench
data's length spread (Alpaca conversations: 20 to 600 tokens, most near 135).

- correctness: the output and the query/key/value gradients of each path against an fp32 reference of the same
  masked attention; PASS where varlen's relative error is at most twice sdpa's (both are bf16 kernels) and under 1%;
- time: median of CUDA-event timings of forward + backward.

    python bench/varlen_check.py --run_id R --results bench/results.jsonl   # one GPU (compute capability 8.0+)
    python bench/varlen_check.py --tiny                                      # CPU plumbing (sdpa stands in)
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from kernel_measures import commit, median_ms, record, relative  # noqa: E402

SHAPES = {  # heads, key/value heads, query/key size, value size, scale
    "deepseek-v2-lite-mla": (16, 16, 192, 128, 0.1147),  # 192 ** -0.5 times yarn's mscale squared (1.589)
    "r1-distill-qwen-7b-gqa": (28, 4, 128, 128, 128 ** -0.5),
}
ROWS, LENGTH = 4, 2048


def packed_documents(rows: int, length: int, seed: int = 0) -> list[list[int]]:
    """Each row's document lengths (the last one takes the row's rest, as the collator's padding does): at 2,048
    tokens 20 to 600, most near 135; scaled down for shorter rows (--tiny)."""
    rng = random.Random(seed)
    share = length / 2048
    packed = []
    for _ in range(rows):
        lengths, left = [], length
        while left > 0:
            n = min(left, max(2, int(20 * share), min(int(600 * share), int(rng.lognormvariate(4.9, 0.7) * share))))
            lengths.append(n)
            left -= n
        packed.append(lengths)
    return packed


def main(argv: list[str] | None = None) -> int:
    from sft.speed.packed_mask import packed_causal_mask
    from sft.speed.varlen_attention import varlen_attention_forward

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU plumbing: 2 rows of 64 tokens, sdpa stands in")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--run_id", default=dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%MZ-varlen"))
    p.add_argument("--results", type=Path)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    rows, length = (2, 64) if args.tiny else (ROWS, LENGTH)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    docs = packed_documents(rows, length)
    cu = torch.tensor([0, *torch.tensor([n for row in docs for n in row]).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in docs]).to(device)
    results, passed = {}, True
    for name, (heads, kv_heads, size, value_size, scale) in SHAPES.items():
        module = torch.nn.Module()
        module.num_key_value_groups = heads // kv_heads
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(rows, h, length, d, generator=g, device=device)
                   for h, d in ((heads, size), (kv_heads, size), (kv_heads, value_size)))
        grad_out = torch.randn(rows, length, heads, value_size, generator=g, device=device)
        config = type("Config", (), {"_attn_implementation": "sdpa", "layer_types": None, "sliding_window": None})()
        mask = packed_causal_mask(config, ids, torch.float32)

        def sdpa(q, k, v):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads)
            return out.transpose(1, 2)

        def varlen(q, k, v):
            return varlen_attention_forward(module, q, k, v, None, scaling=scale, cu_seq_lens_q=cu,
                                            max_length_q=length)[0]

        def run(attend, dtype):
            leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
            out = attend(*leaves)
            out.backward(grad_out.to(dtype))
            return [out.detach(), *(t.grad for t in leaves)]

        reference = run(sdpa, torch.float32)
        errors = {path: {part: round(relative(got, want), 6) for part, got, want in
                         zip(("out", "dq", "dk", "dv"), run(attend, dtype), reference)}
                  for path, attend in (("sdpa", sdpa), ("varlen", varlen))}
        ok = all(errors["varlen"][part] <= max(2 * errors["sdpa"][part], 1e-6) and errors["varlen"][part] < 0.01
                 for part in errors["varlen"])
        passed &= ok
        results[name] = {"errors_vs_fp32": errors, "pass": ok}
        if device == "cuda":
            for path, attend in (("sdpa", sdpa), ("varlen", varlen)):
                run(attend, dtype)  # warm-up
                results[name][f"{path}_fwd_bwd_ms"] = round(median_ms(lambda: run(attend, dtype), args.repeats), 3)
            results[name]["speedup"] = round(results[name]["sdpa_fwd_bwd_ms"] / results[name]["varlen_fwd_bwd_ms"], 3)
    row = {"run_id": args.run_id, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit(), "bench": "varlen_check", "gpu": torch.cuda.get_device_name() if device == "cuda"
           else "cpu", "torch": torch.__version__, "rows": rows, "length": length,
           "documents": sum(len(r) for r in docs), "shapes": results, "pass": passed}
    record(row, f"{'PASS' if passed else 'FAIL'} varlen-check: " + "; ".join(
        f"{name}: varlen vs fp32 {r['errors_vs_fp32']['varlen']}, sdpa vs fp32 {r['errors_vs_fp32']['sdpa']}"
        + (f", {r['sdpa_fwd_bwd_ms']} ms sdpa against {r['varlen_fwd_bwd_ms']} ms varlen" if "speedup" in r else "")
        for name, r in results.items()), args.results)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
