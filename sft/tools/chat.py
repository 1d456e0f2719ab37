"""Chat with a fine-tuned model (or adapter) to check the result, using the same template as training.

    python -m sft.tools.chat output/tiny-deepseek/full/latest      # interactive; an empty line or Ctrl-D quits
    python -m sft.tools.chat output/tiny-deepseek/full/latest --prompt "What is the capital of Japan?"

The saved tokenizer carries the chat template training used (sft/data/templates.py chat_template_for_saving), so the
default `--template auto` renders prompts as training did. An answer cut at --max_new_tokens (no end-of-sequence
token) is printed as it is, followed by a note on stderr. `--thinking` opens the reply with `<think>` where the
template has that switch (DeepSeek-V3.1's, whose prompt otherwise ends `</think>`): the answer printed is then the
reasoning, `</think>` and the answer, and later turns see the answer alone, as the template shows them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from sft.safety.run_dir import ADAPTER_CONFIG


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_model(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from sft.model.loading import NO_HUB_KERNELS

    dtype = torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    if (path / ADAPTER_CONFIG).is_file():
        from peft import AutoPeftModelForCausalLM

        from sft.model.rope_scaling import rope_record

        model = AutoPeftModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True, **NO_HUB_KERNELS,
                                                         **rope_record(path))  # its base's RoPE as trained
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True, **NO_HUB_KERNELS)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return model.to(device).eval()


def reply_frame(template, eos: str) -> tuple[str, str]:
    """What the template writes around a reply after its generation prompt, which is no part of the answer: the
    text before the reply (DeepSeek v1: " ") and the text between it and the EOS (deepseek-coder: "\\n" before
    <|EOT|>). ("", "") where a reply is not rendered as prompt + reply."""
    from sft.data.formats import DataError

    probe = [{"role": "user", "content": "?"}]
    try:
        prompt = template.text(probe, add_generation_prompt=True)
        full = template.text(probe + [{"role": "assistant", "content": "\0"}])
    except DataError:  # a model template that rewrites earlier turns: leave the answer as it is
        return "", ""
    if not full.startswith(prompt) or "\0" not in full[len(prompt):]:
        return "", ""
    before, after = full[len(prompt):].split("\0", 1)
    return before, after.split(eos, 1)[0] if eos and eos in after else ""


def reply(model, tokenizer, template, messages: list[dict], max_new_tokens: int,
          temperature: float, thinking: bool = False) -> tuple[str, bool]:
    """-> (answer, finished): finished when the model ended it with EOS, False when cut at max_new_tokens.
    `thinking`: the prompt opens the reply with `<think>` (only for a template with that switch, THINKING_TEMPLATES)."""
    import torch

    text = template.text(messages, add_generation_prompt=True, **({"thinking": True} if thinking else {}))
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids.to(model.device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=temperature > 0, temperature=temperature or None,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    new = out[0, ids.shape[1]:].tolist()
    finished = bool(new) and new[-1] == tokenizer.eos_token_id
    answer = tokenizer.decode(new[:-1] if finished else new, skip_special_tokens=True)
    # Only the template's own framing is removed, never the answer's whitespace (a cut answer keeps its end).
    before, after = reply_frame(template, tokenizer.eos_token)
    answer = answer.removeprefix(before)
    return (answer.removesuffix(after) if finished else answer), finished


def check_thinking_switch(template, asked: str) -> None:
    """--thinking needs a template that can open a reply with `<think>`; any other would ignore it in silence."""
    from sft.data.chat_templates import THINKING_TEMPLATES
    from sft.errors import ConfigError

    if template.name not in THINKING_TEMPLATES:
        which = f"{template.name} (--template auto)" if asked == "auto" else template.name
        raise ConfigError(f"--thinking: the chat template {which} has no thinking switch; templates with one: "
                          f"{', '.join(THINKING_TEMPLATES)}. Drop --thinking, or chat with a model trained with one.")


def main(argv: list[str] | None = None, prog: str = "python -m sft.tools.chat") -> int:
    from sft.data.chat_templates import THINKING_TEMPLATES
    from sft.data.templates import TEMPLATE_NAMES

    from sft.report.console import ToolParser

    parser = ToolParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a trained output directory (model or LoRA adapter)")
    parser.add_argument("--prompt", help="ask one question, print the answer and exit")
    parser.add_argument("--system", help="a system prompt")
    parser.add_argument("--template", default="auto", choices=TEMPLATE_NAMES,
                        help="auto: the saved tokenizer's chat template, which training set to its own")
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--thinking", action="store_true",
                        help="open each reply with <think> (templates with a thinking switch: "
                             f"{', '.join(THINKING_TEMPLATES)}); without it their prompt ends </think>")
    args = parser.parse_args(argv)
    path = Path(args.model)
    from sft.tools.trained_dirs import check_trained_dir
    from sft.errors import UserFacingError

    from sft.data.chat_templates import get_template

    try:
        check_trained_dir(path)
        tokenizer = load_tokenizer(path)
        template = get_template(args.template, tokenizer)
        if args.thinking:
            check_thinking_switch(template, args.template)
    except UserFacingError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code

    model = load_model(path)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    questions = [args.prompt] if args.prompt else iter(lambda: input("you> "), "")
    try:
        for question in questions:
            messages.append({"role": "user", "content": question})
            answer, finished = reply(model, tokenizer, template, messages, args.max_new_tokens, args.temperature,
                                     args.thinking)
            messages.append({"role": "assistant", "content": answer})
            print(answer if args.prompt else f"model> {answer}", flush=True)
            if not finished:  # else a cut answer would look finished
                print(f"[cut at --max_new_tokens {args.max_new_tokens}]", file=sys.stderr, flush=True)
    except (EOFError, KeyboardInterrupt):
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
