"""Long documents for the long-row benchmarks (issue 27 item 1): conversations of about `tokens` tokens each, made
of consecutive Alpaca records as the turns of one chat, so that a packed row holds ONE conversation and attention
runs over the whole row (packed short documents keep attention block-diagonal and cheap: not the workload of a
32k-token reasoning trace).

    python bench/long_docs.py --tokens 32768 --count 12 --out /tmp/long-32768.jsonl

Each conversation is cut after the turn that takes it past `tokens` (counted with the tokenizer on the turns'
text, without the template); sft/train.py's --overlong truncate then keeps the turns that fit in --max_length,
so each row holds 85-100% of its length in one document. The records are taken in order and reused, shuffled
by pass with a fixed seed, until `count` conversations exist.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def long_conversations(records: list[dict], tokenizer, tokens: int, count: int, seed: int = 0) -> list[dict]:
    """`count` {"messages": [...]} conversations of consecutive (instruction, output) turns, each just over
    `tokens` tokens of text."""
    rng = random.Random(seed)
    turns = [(r["instruction"] + ("\n\n" + r["input"] if r.get("input") else ""), r["output"]) for r in records]
    lengths = [len(tokenizer(q + a, add_special_tokens=False)["input_ids"]) + 8 for q, a in turns]  # + the template
    if sum(lengths) < tokens:
        raise ValueError(f"{len(records)} records hold {sum(lengths)} tokens, fewer than one {tokens}-token chat")
    order: list[int] = []
    conversations: list[dict] = []
    while len(conversations) < count:
        messages, total = [], 0
        while total < tokens:
            if not order:
                order = list(range(len(turns)))
                rng.shuffle(order)
            i = order.pop()
            messages += [{"role": "user", "content": turns[i][0]}, {"role": "assistant", "content": turns[i][1]}]
            total += lengths[i]
        conversations.append({"messages": messages})
    return conversations


def write_long_conversations(alpaca: Path, tokenizer_dir: Path, tokens: int, count: int, out: Path) -> Path:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    rows = long_conversations(json.loads(Path(alpaca).read_text()), tokenizer, tokens, count)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alpaca", default=str(Path(__file__).resolve().parents[2] / "shared" / "datasets" /
                                           "alpaca_sample.json"))
    p.add_argument("--tokenizer", default=str(Path(__file__).resolve().parents[2] / "shared" / "tokenizers" /
                                              "deepseek-coder-6.7b-instruct"))
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--count", type=int, default=12)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    path = write_long_conversations(Path(a.alpaca), Path(a.tokenizer), a.tokens, a.count, Path(a.out))
    print(f"{path}: {a.count} conversations of about {a.tokens} tokens")


if __name__ == "__main__":
    main()
