"""`--quantize_experts fp8` against bf16 (issue 26 item 1): how far the routed experts in e4m3 move the logits of
held-out rows, on DeepSeek-V2-Lite's shape (random weights: no hub here; the bench's shapes, bench/train_throughput.py).

One process: the bf16 model's logits on --rows held-out rows of the bench data (the last records of the file,
which the bench's training rows do not reach first), then the same model with its experts quantized in place
(sft/model/quantized_experts.py), the same rows. Per row: the relative L2 error of the logits, the mean KL
divergence per token (bf16 || fp8) and how often the top-1 token agrees. Also the experts' bytes before and after.

    python bench/quantized_experts_check.py --data_dir .benchdata --run_id R --results bench/results.jsonl   # GPU
    python bench/quantized_experts_check.py --tiny                                                           # CPU plumbing
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def held_out_rows(data: Path, tokenizer_dir: Path, rows: int, length: int, vocab: int) -> torch.Tensor:
    """`rows` rows of `length` token ids from the file's last records (their text concatenated)."""
    from transformers import AutoTokenizer

    records = json.loads(data.read_text())[::-1]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids: list[int] = []
    for r in records:
        ids += tokenizer(" ".join(str(r.get(k, "")) for k in ("instruction", "input", "output")))["input_ids"]
        if len(ids) >= rows * length:
            break
    return torch.tensor(ids[:rows * length]).clamp(max=vocab - 1).view(rows, length)


def logits_of(model, rows: torch.Tensor, device: str) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=r[None].to(device)).logits[0].float().cpu() for r in rows]


def main(argv: list[str] | None = None) -> int:
    from train_throughput import MODELS, git_commit, model_config
    from transformers import AutoModelForCausalLM

    from sft.model.quantized_experts import E4M3, fused_experts, quantize_experts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deepseek-v2-lite", choices=[k for k, v in MODELS.items()
                                                                   if v.get("model_type") == "deepseek_v2"])
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--data_dir", type=Path, default=REPO.parent / "shared" / "datasets")
    p.add_argument("--tokenizer", type=Path, help="default: DATA_DIR/tokenizer, else ../shared/tokenizers/...")
    p.add_argument("--tiny", action="store_true", help="CPU plumbing: a 4-expert model, 2 rows of 64 tokens")
    p.add_argument("--run_id", default=dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%MZ-qexperts"))
    p.add_argument("--results", type=Path)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    data = next(f for f in (args.data_dir / "alpaca_sample.json", REPO.parent / "shared" / "datasets" /
                            "alpaca_sample.json") if f.is_file())
    tokenizer = args.tokenizer or next(d for d in (args.data_dir / "tokenizer", REPO.parent / "shared" / "tokenizers" /
                                                   "deepseek-coder-6.7b-instruct") if (d / "tokenizer.json").is_file())
    if args.tiny:
        from transformers import AutoConfig

        shape = {**MODELS[args.model], "num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128,
                 "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "kv_lora_rank": 16,
                 "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "num_attention_heads": 4,
                 "num_key_value_heads": 4, "vocab_size": 32256}
        config = AutoConfig.for_model(shape.pop("model_type"), **shape)
        args.rows, args.seq_len = 2, 64
    else:
        config = model_config(args.model)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    rows = held_out_rows(data, tokenizer, args.rows, args.seq_len, config.vocab_size)
    experts = fused_experts(model)
    bf16_bytes = sum(p.numel() * p.element_size() for m in experts for p in m.parameters(recurse=False))
    want = logits_of(model, rows, device)
    quantize_experts(model)
    fp8_bytes = sum(p.numel() * p.element_size() for m in experts for p in m.parameters(recurse=False)
                    if p.dtype == E4M3)
    got = logits_of(model, rows, device)
    per_row = []
    for w, g in zip(want, got):
        kl = torch.nn.functional.kl_div(g.log_softmax(-1), w.log_softmax(-1), log_target=True,
                                        reduction="batchmean").item()
        per_row.append({"rel_l2": ((g - w).norm() / w.norm()).item(), "kl_per_token": kl,
                        "top1_agree": (g.argmax(-1) == w.argmax(-1)).float().mean().item()})
    summary = {k: sum(r[k] for r in per_row) / len(per_row) for k in per_row[0]}
    row = {"run_id": args.run_id, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "commit": git_commit(), "bench": "quantized_experts_check", "model": args.model + ("-tiny" * args.tiny),
           "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": args.rows,
           "seq_len": args.seq_len, "experts_gib_bf16": round(bf16_bytes / 2**30, 2),
           "experts_gib_fp8": round(fp8_bytes / 2**30, 2), **{k: round(v, 6) for k, v in summary.items()},
           "per_row": per_row, "weights": "random init (the bench's shape)"}
    print(json.dumps({k: v for k, v in row.items() if k != "per_row"}), flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
