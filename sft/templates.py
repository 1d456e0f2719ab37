"""Templates: a conversation -> text segments, each marked "train on it" or not.

Each template writes exactly the bytes of the model family's published chat template, so that the ids we train
on are those the model sees at inference. Segments carry the mask: tokenizing the joined text with offsets gives
ids and labels in one pass (sft/tokenization.py), with no search for where the answer starts.

The trained part of an assistant turn is what the model must generate after the template's generation prompt,
up to and including the end-of-turn token: for DeepSeek v1, whose generation prompt is `Assistant:` with no
space, the space before the reply is part of the target.

Each built-in also carries `chat_template`, Jinja that renders the same text as `text()`, and training stores it
on the tokenizer it saves (chat_template_for_saving), so that `apply_chat_template` on a trained model (and
`python -m sft.chat`) writes prompts byte for byte as training did. A user turn's optional `input` (Alpaca data)
is rendered there as in training; a plain {"role", "content"} message simply has none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sft.errors import DataError

Segment = tuple[str, bool]  # (text, trained)
Messages = list[dict[str, Any]]

CODER_SYSTEM = ("You are an AI programming assistant, utilizing the Deepseek Coder model, developed by Deepseek "
                "Company, and you only answer questions related to computer science. For politically sensitive "
                "questions, security and privacy issues, and other non-computer science questions, you will "
                "refuse to answer\n")
ALPACA_HEAD = ("Below is an instruction that describes a task{}. Write a response that appropriately completes "
               "the request.\n\n")
CODER_EOT = "<|EOT|>"
V3_EOS = "<｜end▁of▁sentence｜>"  # written literally by the V3 and R1 templates, whatever the tokenizer's eos_token
TEMPLATE_NAMES = ("auto", "model", "deepseek", "deepseek_coder", "deepseek_v3", "r1_distill", "r1_distill_no_reasoning",
                  "alpaca")


# The Jinja of user_text: a user turn's content, and its `input` after a blank line when there is one.
USER_JINJA = "message['content'] + ('\\n\\n' + message['input'] if message['input'] else '')"
SYSTEMS_JINJA = "messages | selectattr('role', 'equalto', 'system') | map(attribute='content')"


def user_text(message: dict) -> str:
    """A user turn's text; an Alpaca input, kept apart for the Alpaca template, joins its instruction."""
    extra = message.get("input") or ""
    return f"{message['content']}\n\n{extra}" if extra else message["content"]


class Template:
    """Render a conversation as segments; `add_generation_prompt` ends it where the model should answer."""

    name = "base"
    # Jinja rendering exactly `text()` (HF chat-template variables: messages, bos_token, eos_token,
    # add_generation_prompt); None for the model's own template.
    chat_template: str | None = None

    def __init__(self, bos: str, eos: str):
        self.bos, self.eos = bos or "", eos or ""

    def render(self, messages: Messages, add_generation_prompt: bool = False) -> list[Segment]:
        raise NotImplementedError

    def text(self, messages: Messages, add_generation_prompt: bool = False) -> str:
        return "".join(text for text, _ in self.render(messages, add_generation_prompt))


class DeepSeekV1(Template):
    """deepseek-llm chat (also V2 chat): `User: {u}\\n\\nAssistant: {a}<eos>`, system text first + `\\n\\n`."""

    name = "deepseek"
    chat_template = (
        "{{ bos_token }}{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
        "{% elif message['role'] == 'user' %}{{ 'User: ' + " + USER_JINJA + " + '\\n\\n' }}"
        "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")

    def render(self, messages, add_generation_prompt=False):
        out: list[Segment] = [(self.bos, False)]
        for m in messages:
            if m["role"] == "system":
                out.append((m["content"] + "\n\n", False))
            elif m["role"] == "user":
                out.append((f"User: {user_text(m)}\n\n", False))
            else:
                out += [("Assistant:", False), (f" {m['content']}{self.eos}", True)]
        if add_generation_prompt:
            out.append(("Assistant:", False))
        return out


class DeepSeekCoder(Template):
    """deepseek-coder instruct: default system prompt, `### Instruction:` / `### Response:`, `<|EOT|>`."""

    name = "deepseek_coder"
    chat_template = (
        "{{ bos_token }}{% if not (" + SYSTEMS_JINJA + " | list) %}{{ " + repr(CODER_SYSTEM) + " }}{% endif %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ message['content'] }}"
        "{% elif message['role'] == 'user' %}{{ '### Instruction:\\n' + " + USER_JINJA + " + '\\n' }}"
        "{% elif message['role'] == 'assistant' %}"
        "{{ '### Response:\\n' + message['content'] + '\\n" + CODER_EOT + "\\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}")

    def render(self, messages, add_generation_prompt=False):
        has_system = any(m["role"] == "system" for m in messages)
        out: list[Segment] = [(self.bos + ("" if has_system else CODER_SYSTEM), False)]
        for m in messages:
            if m["role"] == "system":
                out.append((m["content"], False))
            elif m["role"] == "user":
                out += [("### Instruction:\n", False), (f"{user_text(m)}\n", False)]
            else:
                out += [("### Response:\n", False), (f"{m['content']}\n{CODER_EOT}", True), ("\n", False)]
        if add_generation_prompt:
            out.append(("### Response:\n", False))
        return out


class DeepSeekV3(Template):
    """DeepSeek V2.5/V3: `<｜User｜>{u}<｜Assistant｜>{a}<｜end▁of▁sentence｜>`, system texts (joined by a blank
    line) right after BOS."""

    name = "deepseek_v3"
    generation_prompt = "<｜Assistant｜>"
    system_jinja = SYSTEMS_JINJA + " | join('\\n\\n')"  # system(), in Jinja

    def system(self, messages: Messages) -> str:
        return "\n\n".join(m["content"] for m in messages if m["role"] == "system")

    @property
    def chat_template(self) -> str:  # type: ignore[override]  (built from the two parts R1 changes)
        return ("{{ bos_token }}{{ " + self.system_jinja + " }}{% for message in messages %}"
                "{% if message['role'] == 'user' %}{{ '<｜User｜>' + " + USER_JINJA + " }}"
                "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + '"
                + V3_EOS + "' }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{ " + repr(self.generation_prompt) + " }}{% endif %}")

    def render(self, messages, add_generation_prompt=False):
        out: list[Segment] = [(self.bos + self.system(messages), False)]
        for m in messages:
            if m["role"] == "user":
                out.append((f"<｜User｜>{user_text(m)}", False))
            elif m["role"] == "assistant":
                out += [("<｜Assistant｜>", False), (m["content"] + V3_EOS, True)]
        if add_generation_prompt:
            out.append((self.generation_prompt, False))
        return out


class R1Distill(DeepSeekV3):
    """DeepSeek-R1 distills: the V3 layout, the last system text only, and a generation prompt that opens the
    reasoning (`<｜Assistant｜><think>\n`). The model's own template deletes `<think>...</think>` from assistant
    turns; we keep it in the targets (the reasoning is what is being distilled)."""

    name = "r1_distill"
    generation_prompt = "<｜Assistant｜><think>\n"
    system_jinja = "(" + SYSTEMS_JINJA + " | list | last) or ''"

    def system(self, messages: Messages) -> str:
        systems = [m["content"] for m in messages if m["role"] == "system"]
        return systems[-1] if systems else ""


def strip_reasoning(content: str) -> str:
    """An assistant reply without its `<think>...</think>` block, as DeepSeek-R1's own chat template writes earlier
    turns (the text after the last `</think>`), leading whitespace removed."""
    return content.split("</think>")[-1].lstrip() if "</think>" in content else content


class R1DistillWithoutReasoning(R1Distill):
    """R1-Distill for data trained without reasoning: every assistant turn's target is its answer alone
    (strip_reasoning), and the generation prompt is `<｜Assistant｜>` without `<think>\\n`, so the saved chat
    template prompts the trained model where its training targets began."""

    name = "r1_distill_no_reasoning"  # its own name: sft/dataset.py's cache key holds the template's name
    generation_prompt = "<｜Assistant｜>"

    @property
    def chat_template(self) -> str:  # type: ignore[override]
        return super().chat_template.replace(
            "'<｜Assistant｜>' + message['content']",
            "'<｜Assistant｜>' + (message['content'].split('</think>')[-1].lstrip() if '</think>' in "
            "message['content'] else message['content'])")

    def render(self, messages, add_generation_prompt=False):
        stripped = [{**m, "content": strip_reasoning(m["content"])} if m["role"] == "assistant" else m
                    for m in messages]
        return super().render(stripped, add_generation_prompt)


class Alpaca(Template):
    """The Stanford Alpaca prompt; the target follows `### Response:` directly, as in its train.py."""

    name = "alpaca"
    # `input` (kept apart by the Alpaca reader) becomes the `### Input:` section; plain messages get the no-input
    # prompt. add_generation_prompt changes nothing: a user turn already ends with `### Response:`.
    chat_template = (
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
        "{{ " + repr(ALPACA_HEAD) + ".format(', paired with an input that provides further context' "
        "if message['input'] else '') + '### Instruction:\\n' + message['content'] + '\\n\\n' }}"
        "{% if message['input'] %}{{ '### Input:\\n' + message['input'] + '\\n\\n' }}{% endif %}"
        "{{ '### Response:' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
        "{% endif %}{% endfor %}")

    def render(self, messages, add_generation_prompt=False):
        out: list[Segment] = [(self.bos, False)]
        for m in messages:
            if m["role"] == "user":
                context = m.get("input") or ""
                head = ALPACA_HEAD.format(", paired with an input that provides further context" if context else "")
                body = f"### Instruction:\n{m['content']}\n\n" + (f"### Input:\n{context}\n\n" if context else "")
                out.append((head + body + "### Response:", False))
            elif m["role"] == "assistant":
                out.append((m["content"] + self.eos, True))
            # Alpaca has no system turn: its fixed header plays that part.
        return out


class ModelChatTemplate(Template):
    """The tokenizer's own `chat_template`. Assistant spans are found by rendering growing prefixes: the text
    added by assistant turn i, after the generation prompt of the first i messages, is that turn's target."""

    name = "model"

    def __init__(self, tokenizer):
        super().__init__(tokenizer.bos_token, tokenizer.eos_token)
        self.tokenizer = tokenizer

    def _apply(self, messages: Messages, add_generation_prompt: bool) -> str:
        plain = [{"role": m["role"], "content": user_text(m) if m["role"] == "user" else m["content"]}
                 for m in messages]
        return self.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt)

    def render(self, messages, add_generation_prompt=False):
        full = self._apply(messages, add_generation_prompt)
        out: list[Segment] = []
        done = 0  # characters of `full` already emitted
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self._apply(messages[:i], add_generation_prompt=True)
            turn = self._apply(messages[: i + 1], add_generation_prompt=False)
            if not (full.startswith(prompt) and full.startswith(turn) and turn.startswith(prompt)
                    and len(prompt) >= done):
                raise DataError(
                    "the model's chat_template does not render conversations as growing prefixes (it rewrites "
                    "earlier turns), so the assistant tokens cannot be located; use --template with one of "
                    f"{', '.join(TEMPLATE_NAMES[2:])}")
            target = turn[len(prompt):]
            # The end-of-turn token is trained; anything the template writes after it (a newline) is not.
            cut = target.rfind(self.eos) + len(self.eos) if self.eos and self.eos in target else len(target)
            out += [(full[done:len(prompt)], False), (target[:cut], True)]
            done = len(prompt) + cut
        out.append((full[done:], False))
        return [s for s in out if s[0]]


BUILTIN: dict[str, Callable[[str, str], Template]] = {
    t.name: t for t in (DeepSeekV1, DeepSeekCoder, DeepSeekV3, R1Distill, R1DistillWithoutReasoning, Alpaca)
}


# Conversations on which a built-in template must render exactly as a model's own chat_template for `auto` to
# use it (it is much faster than rendering Jinja several times per conversation, and we know where its turns are).
PROBES = (
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
     {"role": "assistant", "content": "6"}],
)


def matching_builtin(tokenizer) -> str | None:
    """The built-in template whose Jinja the tokenizer carries (a model we saved), else the one that renders the
    probes exactly as the tokenizer's chat_template does, if any."""
    names = ("deepseek", "deepseek_coder", "deepseek_v3", "r1_distill", "r1_distill_no_reasoning", "alpaca")
    saved = next((n for n in names if BUILTIN[n](tokenizer.bos_token, tokenizer.eos_token).chat_template
                  == tokenizer.chat_template), None)
    if saved:
        return saved
    for name in names:
        template = BUILTIN[name](tokenizer.bos_token, tokenizer.eos_token)
        try:
            same = all(template.text(p) == tokenizer.apply_chat_template(p, tokenize=False) and
                       template.text(p[:-1], True) == tokenizer.apply_chat_template(
                           p[:-1], tokenize=False, add_generation_prompt=True) for p in PROBES)
        except Exception:  # a template that cannot render our probes is simply not this one
            same = False
        if same:
            return name
    return None


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
    it because the two render alike: only ours is sure to match training everywhere (the R1 template, say, deletes
    reasoning from earlier turns, which we train on).

    Call it after the data is prepared: the data cache key includes the tokenizer's chat_template."""
    return get_template(name, tokenizer).chat_template
