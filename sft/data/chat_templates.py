"""The built-in chat templates by name, and which one a tokenizer's own template is (`--template auto`): the
registry over sft/data/templates.py's classes and the newer releases' of sft/data/thinking_templates.py (which
build on them, so the registry lives above both)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from sft.data.templates import (ASSISTANT, TEMPLATE_NAMES, Alpaca, DeepSeekCoder, DeepSeekV1, DeepSeekV3, Messages,
                                ModelChatTemplate, R1, R1Distill, R1DistillWithoutReasoning, Template)
from sft.data.thinking_templates import R1_0528, DeepSeekV31
from sft.errors import DataError


BUILTIN: dict[str, Callable[[str, str], Template]] = {
    t.name: t for t in (DeepSeekV1, DeepSeekCoder, DeepSeekV3, R1, R1Distill, R1DistillWithoutReasoning, Alpaca,
                        R1_0528, DeepSeekV31)
}

# The templates whose generation prompt can open a thinking reply (`text(..., thinking=True)`: V3.1's `<think>`).
THINKING_TEMPLATES = tuple(name for name, t in BUILTIN.items() if "thinking" in inspect.signature(t.text).parameters)


# Conversations on which a built-in template must render exactly as a model's own chat_template for `auto` to
# use it (it is much faster than rendering Jinja several times per conversation, and we know where its turns are).
PROBES = (
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
     {"role": "assistant", "content": "6"}],
    # Two system texts (R1 joins them, the distills keep the last) and an earlier turn's reasoning (the R1 family
    # deletes it, V3 keeps it).
    [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Answer in English."},
     {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
     {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"}],
    # Two questions in a row: R1-0528 and V3.1 write `<｜Assistant｜>` with each question, R1 and V3 only before a
    # reply (on the conversations above the revisions of R1 without `<think>\n` in the prompt and R1-0528 agree).
    [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Are you there?"},
     {"role": "assistant", "content": "Yes."}],
)


def matching_builtin(tokenizer) -> str | None:
    """The built-in template whose Jinja the tokenizer carries (a model we saved), else the one that renders the
    probes exactly as the tokenizer's chat_template does, if any; the R1 family's generation prompt may also be that
    of its earlier revisions (`<｜Assistant｜>`, before `<think>\n` was added to it), whose models are the same."""
    names = ("deepseek", "deepseek_coder", "deepseek_v3", "r1", "r1_distill", "r1_distill_no_reasoning", "alpaca",
             "r1_0528", "deepseek_v31")
    saved = next((n for n in names if BUILTIN[n](tokenizer.bos_token, tokenizer.eos_token).chat_template
                  == tokenizer.chat_template), None)
    if saved:
        return saved
    for name in names:
        template = BUILTIN[name](tokenizer.bos_token, tokenizer.eos_token)
        try:
            same = all(template.text(p) == tokenizer.apply_chat_template(p, tokenize=False) and
                       tokenizer.apply_chat_template(p[:-1], tokenize=False, add_generation_prompt=True)
                       in _prompts(template, p[:-1]) for p in PROBES)
        except Exception:  # a template that cannot render our probes is simply not this one
            same = False
        if same:
            return name
    return None


def _prompts(template: Template, messages: Messages) -> set[str]:
    """The template's generation prompt after `messages`, and those of its earlier revisions."""
    prompt = template.text(messages, True)
    if not (isinstance(template, R1) and template.generation_prompt.endswith("<think>\n")):
        return {prompt}
    return {prompt, prompt.removesuffix(template.generation_prompt) + ASSISTANT}


def get_template(name: str, tokenizer) -> Template:
    """`auto`: the model's own chat_template (through the built-in that renders it identically, when one does),
    else DeepSeek v1."""
    if name == "auto":
        if getattr(tokenizer, "chat_template", None):
            name = matching_builtin(tokenizer) or "model"
        else:
            name = "deepseek"
    if name == "model":
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("--template model: this tokenizer has no chat_template; choose --template "
                            f"from {', '.join(BUILTIN)}")
        return ModelChatTemplate(tokenizer)
    if name not in BUILTIN:
        raise DataError(f"--template {name!r} is unknown; choose one of {', '.join(TEMPLATE_NAMES)}")
    return BUILTIN[name](tokenizer.bos_token, tokenizer.eos_token)


def chat_template_for_saving(name: str, tokenizer) -> str | None:
    """The Jinja to store on the tokenizer that training saves, so that the saved model renders prompts as it was
    trained: the built-in's chat_template, or None when training used the model's own (`model`, or `auto` resolved
    to it), which the tokenizer already carries. A built-in replaces the model's template even where `auto` chose
    it because the two render alike: only ours is sure to match training everywhere (the official R1 template, say,
    deletes the reasoning of a conversation's last turn too, and an earlier R1 revision prompts without
    `<think>\n`, which training put in the prompt).

    Call it after the data is prepared: the data cache key includes the tokenizer's chat_template."""
    return get_template(name, tokenizer).chat_template
