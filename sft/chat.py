"""Chat with a fine-tuned model (or adapter) to check the result, using the same template as training.

    python -m sft.chat output/demo                           # interactive; an empty line or Ctrl-D quits
    python -m sft.chat output/demo --prompt "What is the capital of Japan?"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def load(path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    if (path / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return model.to(device).eval(), AutoTokenizer.from_pretrained(path)


def reply(model, tokenizer, template, messages: list[dict], max_new_tokens: int, temperature: float) -> str:
    import torch

    text = template.text(messages, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids.to(model.device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=temperature > 0, temperature=temperature or None,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def main(argv: list[str] | None = None) -> int:
    from sft.templates import TEMPLATE_NAMES

    parser = argparse.ArgumentParser(prog="python -m sft.chat", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a trained output directory (model or LoRA adapter)")
    parser.add_argument("--prompt", help="ask one question, print the answer and exit")
    parser.add_argument("--system", help="a system prompt")
    parser.add_argument("--template", default="auto", choices=TEMPLATE_NAMES, help="as in training")
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    args = parser.parse_args(argv)
    path = Path(args.model)
    if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        print(f"error: {path} holds no model (config.json) or adapter (adapter_config.json).", file=sys.stderr)
        return 2

    from sft.templates import get_template

    model, tokenizer = load(path)
    template = get_template(args.template, tokenizer)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    questions = [args.prompt] if args.prompt else iter(lambda: input("you> "), "")
    try:
        for question in questions:
            messages.append({"role": "user", "content": question})
            answer = reply(model, tokenizer, template, messages, args.max_new_tokens, args.temperature)
            messages.append({"role": "assistant", "content": answer})
            print(answer if args.prompt else f"model> {answer}", flush=True)
    except (EOFError, KeyboardInterrupt):
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
