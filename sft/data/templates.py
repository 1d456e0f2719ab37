"""Templates: a conversation -> text segments, each marked "train on it" or not.

Each template writes exactly the bytes of the model family's published chat template, so that the ids we train
on are those the model sees at inference. Segments carry the mask: tokenizing the joined text with offsets gives
ids and labels in one pass (sft/data/tokenization.py), with no search for where the answer starts.

The trained part of an assistant turn is what the model must generate after the template's generation prompt,
up to and including the end-of-turn token: for DeepSeek v1, whose generation prompt is `Assistant:` with no
space, the space before the reply is part of the target.

Each built-in also carries `chat_template`, Jinja that renders the same text as `text()`, and training stores it
on the tokenizer it saves (chat_template_for_saving), so that `apply_chat_template` on a trained model (and
`python -m sft.tools.chat`) writes prompts byte for byte as training did. A user turn's optional `input` (Alpaca data)
is rendered there as in training; a plain {"role", "content"} message simply has none. The templates with a
tool-call format (V3, the R1 family, R1-0528 and V3.1) also render OpenAI-form tool conversations there as training
renders them after sft/data/formats.py read them: `tools=` in the system prompt, assistant `tool_calls`, `tool`
results. Every saved template reads messages as that reader does (PRELUDE_JINJA): a `developer` message is a system
text, and content given as a list of text parts is their texts joined.
"""

from __future__ import annotations

from typing import Any

from sft.errors import DataError
from sft.data.tool_calls import (ASSISTANT, LATER_CALL_TEXT, OUTPUTS_END, R1_CALLS, TOOLS_ROLE, TOOLS_STATE_JINJA,
                             TRAINED_BEFORE, V3_CALLS, CallLayout, after_outputs, calls_jinja, end_jinja, has_tools,
                             head_jinja, later_call_text, refuse_tools, render_v3, result_jinja, split_opening,
                             tool_definitions, with_tools)

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
TEMPLATE_NAMES = ("auto", "model", "deepseek", "deepseek_coder", "deepseek_v3", "r1", "r1_distill",
                  "r1_distill_no_reasoning", "alpaca", "r1_0528", "deepseek_v31")
BUILTIN_NAMES = TEMPLATE_NAMES[2:]  # the built-in templates (sft/data/chat_templates.py), not auto or model
THINK_END = "</think>"


# What every saved template does first: read messages as sft/data/formats.py's OpenAI reader reads them. A message's
# text (`message_text`) is its content, or its list of {"type": "text", "text"} parts joined, or nothing for an
# assistant turn with tool_calls (transformers drops a None content); any other content is refused, as the reader
# refuses it. OpenAI's `developer` role is a system text (`systems.texts`: every system text, in order).
PRELUDE_JINJA = (
    "{% macro message_text(message) %}{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is sequence and message['content'] is not mapping %}"
    "{% for part in message['content'] %}{% if part is mapping and part['type'] == 'text' and part['text'] is string %}"
    "{{ part['text'] }}{% else %}{{ raise_exception('a message content list may hold only {\"type\": \"text\", "
    "\"text\": ...} parts, as in training data') }}{% endif %}{% endfor %}"
    "{% elif not ((message['content'] is not defined or message['content'] is none) and message['role'] == "
    "'assistant' and message['tool_calls']) %}{{ raise_exception('a message content must be a string or a list of "
    "text parts, as in training data') }}{% endif %}{% endmacro %}"
    "{% set systems = namespace(texts=[]) %}{% for message in messages %}"
    "{% if message['role'] in ['system', 'developer'] %}{% set systems.texts = systems.texts + "
    "[message_text(message)] %}{% endif %}{% endfor %}")
CONTENT_JINJA = "{% set content = message_text(message) %}"  # first in every messages loop
SYSTEM_JINJA = "message['role'] in ['system', 'developer']"  # a system text, in a messages loop
# The Jinja of user_text: a user turn's content, and its `input` after a blank line when there is one.
USER_JINJA = "content + ('\\n\\n' + message['input'] if message['input'] else '')"
SYSTEMS_JINJA = "systems.texts"


def user_text(message: dict) -> str:
    """A user turn's text; an Alpaca input, kept apart for the Alpaca template, joins its instruction."""
    extra = message.get("input") or ""
    return f"{message['content']}\n\n{extra}" if extra else message["content"]


class Template:
    """Render a conversation as segments; `add_generation_prompt` ends it where the model should answer."""

    name = "base"
    # Jinja rendering exactly `text()` (HF chat-template variables: messages, bos_token, eos_token,
    # add_generation_prompt, and tools for the templates with a tool-call format); None for the model's own template.
    chat_template: str | None = None

    def __init__(self, bos: str, eos: str):
        self.bos, self.eos = bos or "", eos or ""

    def render(self, messages: Messages, add_generation_prompt: bool = False) -> list[Segment]:
        raise NotImplementedError

    def text(self, messages: Messages, add_generation_prompt: bool = False) -> str:
        return "".join(text for text, _ in self.render(messages, add_generation_prompt))

    def examples(self, messages: Messages) -> list[list[Segment]]:
        """The token sequences a conversation trains as, each as segments: one, `render`, unless the template
        shows a turn in later turns' context otherwise than the model wrote it (R1's reasoning)."""
        return [self.render(messages)]

    def note(self, messages: Messages) -> str | None:
        """What the data summary should count about this conversation (as the status of its examples), if anything:
        where training differs from what the template's generation prompt would make of it."""
        return None


class DeepSeekV1(Template):
    """deepseek-llm chat (also V2 chat): `User: {u}\\n\\nAssistant: {a}<eos>`, system text first + `\\n\\n`."""

    name = "deepseek"
    chat_template = (
        PRELUDE_JINJA + "{{ bos_token }}{% for message in messages %}" + CONTENT_JINJA +
        "{% if " + SYSTEM_JINJA + " %}{{ content + '\\n\\n' }}"
        "{% elif message['role'] == 'user' %}{{ 'User: ' + " + USER_JINJA + " + '\\n\\n' }}"
        "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + content + eos_token }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")

    def render(self, messages, add_generation_prompt=False):
        refuse_tools(self.name, messages)
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
        PRELUDE_JINJA + "{{ bos_token }}{% if not (" + SYSTEMS_JINJA + " | list) %}{{ " + repr(CODER_SYSTEM)
        + " }}{% endif %}{% for message in messages %}" + CONTENT_JINJA + "{% if " + SYSTEM_JINJA + " %}{{ content }}"
        "{% elif message['role'] == 'user' %}{{ '### Instruction:\\n' + " + USER_JINJA + " + '\\n' }}"
        "{% elif message['role'] == 'assistant' %}"
        "{{ '### Response:\\n' + content + '\\n" + CODER_EOT + "\\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}")

    def render(self, messages, add_generation_prompt=False):
        refuse_tools(self.name, messages)
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

    reply_jinja = "content"  # an answer's text as shown after `<｜Assistant｜>`, in Jinja
    outputs_reply_jinja = "content"  # the same right after tool results (reply(after_outputs=True))
    tool_layout: CallLayout = V3_CALLS  # how the official template writes calls and results

    @property
    def chat_template(self) -> str:  # type: ignore[override]  (built from the parts R1 changes)
        # One loop for both layouts: without tools, `ns` stays as it starts and the tool branches never run, so a
        # conversation without tools renders as the plain layout does.
        return (PRELUDE_JINJA + "{{ bos_token }}" + TOOLS_STATE_JINJA + head_jinja(self.system_jinja)
                + "{% for message in messages %}" + CONTENT_JINJA + "{% if message['role'] == 'user' %}"
                "{% set ns.in_outputs = false %}{{ '<｜User｜>' + " + USER_JINJA + " }}"
                + calls_jinja(V3_EOS, self.tool_layout) + "{% elif message['role'] == 'assistant' %}"
                "{{ ('" + OUTPUTS_END + "' + " + self.outputs_reply_jinja + " if ns.in_outputs else '" + ASSISTANT
                + "' + " + self.reply_jinja + ") + '" + V3_EOS + "' }}{% set ns.in_outputs = false %}"
                + result_jinja(self.tool_layout) + "{% endif %}{% endfor %}" + end_jinja(self.generation_prompt))

    def render(self, messages, add_generation_prompt=False):
        if has_tools(messages):  # the official template's tool-call layout (sft/data/tool_calls.py)
            return render_v3(messages, head=self.bos + with_tools(self.system(messages), messages), eos=V3_EOS,
                             generation_prompt=self.generation_prompt, add_generation_prompt=add_generation_prompt,
                             user_text=user_text, reply=self.reply, layout=self.tool_layout)
        out: list[Segment] = [(self.bos + self.system(messages), False)]
        for i, m in enumerate(messages):
            if m["role"] == "user":
                out.append((f"<｜User｜>{user_text(m)}", False))
            elif m["role"] == "assistant":
                out += self.reply(m, last=i == len(messages) - 1)
        if add_generation_prompt:
            out.append((self.generation_prompt, False))
        return out

    def reply(self, message: dict, last: bool, after_outputs: bool = False) -> list[Segment]:
        """An answer (`last`: the conversation's last message; `after_outputs`: right after tool results, where the
        template writes `<｜tool▁outputs▁end｜>` instead of `<｜Assistant｜>`) as segments."""
        return [(OUTPUTS_END if after_outputs else ASSISTANT, False),
                (message["content"] + V3_EOS, not message.get(TRAINED_BEFORE))]


def shown_answer(content: str) -> str:
    """An assistant reply as DeepSeek-R1's and the distills' own templates write it in later turns' context: the
    text after the last `</think>` (`content.split('</think>')[-1]`), whitespace kept."""
    return content.split(THINK_END)[-1]


class R1(DeepSeekV3):
    """DeepSeek-R1 (model_type deepseek_v3), as its own chat template writes it: the V3 layout (system texts joined
    by a blank line), a generation prompt that opens the reasoning (`<｜Assistant｜><think>\n`), and every assistant
    answer but the conversation's last without its reasoning (shown_answer), as the model sees earlier turns at
    inference, except an answer right after tool results, which the template writes as given. So a turn's context
    is what the model is given when it writes that turn: a reply that opens with `<think>\n` after the generation
    prompt has it in the prompt, and each turn's reasoning is trained in an example that ends with it (`examples`).
    Our Jinja keeps the reasoning of a conversation's last message, which the official template deletes too:
    prompts (ending with a user turn or tool results) render identically. Tool conversations take R1's own layout
    (sft/data/tool_calls.py R1_CALLS), not the distills'."""

    name = "r1"
    generation_prompt = ASSISTANT + "<think>\n"
    reply_jinja = "(content.split('</think>')[-1] if '</think>' in content and not loop.last else content)"
    tool_layout = R1_CALLS

    def reply(self, message, last, after_outputs=False):
        content = message["content"]
        if after_outputs:  # no generation prompt there: the model writes `<think>` itself, and later turns see it
            return super().reply(message, last, after_outputs)
        if not last and THINK_END in content:  # context only: not what the model wrote
            return [(ASSISTANT + shown_answer(content) + V3_EOS, False)]
        prompt, rest = split_opening(self.generation_prompt, content)  # `<think>\n` is prompt where it opens it
        return [(prompt, False), (rest + V3_EOS, not message.get(TRAINED_BEFORE))]

    def note(self, messages):
        """A reply (after a question) that does not open with `<think>\n` is trained after `<｜Assistant｜>` alone,
        while the saved template's generation prompt ends `<think>\n`; under R1's tool layout, text beside a later
        call is not written (as R1's own template drops it): the summary counts those conversations."""
        opens = self.generation_prompt.removeprefix(ASSISTANT)
        notes = [LATER_CALL_TEXT] if self.tool_layout.writes_text and later_call_text(messages) else []
        if opens and any(m["role"] == "assistant" and not m.get("tool_calls") and not after and m["content"].strip()
                         and not m["content"].startswith(opens)
                         for m, after in zip(messages, after_outputs(messages))):
            notes.append(f"replies not opening with {opens!r}, trained after {ASSISTANT} alone (prompts from the "
                         f"saved template end {opens!r})")
        return "; ".join(notes) or None

    def hides(self, message: dict, after_results: bool) -> bool:
        """Whether later turns show this assistant turn otherwise than the model wrote it (its reasoning deleted)."""
        return not message.get("tool_calls") and not after_results and THINK_END in message["content"]

    def examples(self, messages):
        """One example per answer whose reasoning later turns do not see (with reasoning, not right after tool
        results), ending with it (earlier turns as the official template shows them), and one more for the turns
        after the last of those. A turn without such reasoning (a call, an answer after tool results) is trained
        once, in the first example that holds it; each example has exactly its own turns trained, so every token of
        a reply counts once in the loss. Without such an answer before the last assistant turn: one example,
        `render`."""
        ends = [i for i, (m, after) in enumerate(zip(messages, after_outputs(messages)))
                if m["role"] == "assistant" and self.hides(m, after)]
        last_reply = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        if not ends or ends[-1] < last_reply:
            ends.append(len(messages) - 1)
        out, done = [], 0  # messages[:done] are in earlier examples
        for end in ends:
            part = [{**m, TRAINED_BEFORE: True} if i < done and m["role"] == "assistant" else m
                    for i, m in enumerate(messages[: end + 1])]
            out.append(self.render(part))
            done = end + 1
        return out


class R1Distill(R1):
    """DeepSeek-R1 distills (R1-Distill-Qwen/Llama): R1's template, but only the last system text is written."""

    name = "r1_distill"
    system_jinja = "(" + SYSTEMS_JINJA + " | list | last) or ''"
    tool_layout = V3_CALLS  # the distills' template writes calls and results as V3's does

    def system(self, messages: Messages) -> str:
        systems = [m["content"] for m in messages if m["role"] == "system"]
        return systems[-1] if systems else ""


def strip_reasoning(content: str) -> str:
    """An assistant reply without its `<think>...</think>` block, as DeepSeek-R1's own chat template writes earlier
    turns (the text after the last `</think>`), leading whitespace removed."""
    return content.split("</think>")[-1].lstrip() if "</think>" in content else content


ALL_REASONING = "replies that are all reasoning, not trained (r1_distill_no_reasoning)"  # its examples' status


def all_reasoning(message: dict) -> bool:
    """An assistant reply whose answer is empty once its reasoning is removed (no calls)."""
    return (message["role"] == "assistant" and not message.get("tool_calls") and THINK_END in message["content"]
            and not strip_reasoning(message["content"]))


class R1DistillWithoutReasoning(R1Distill):
    """R1-Distill for data trained without reasoning: every assistant turn's target is its answer alone
    (strip_reasoning), and the generation prompt is `<｜Assistant｜>` without `<think>\\n`, so the saved chat
    template prompts the trained model where its training targets began."""

    name = "r1_distill_no_reasoning"  # its own name: sft/data/dataset.py's cache key holds the template's name
    generation_prompt = "<｜Assistant｜>"

    reply_jinja = "(content.split('</think>')[-1].lstrip() if '</think>' in content else content)"
    outputs_reply_jinja = reply_jinja  # render strips every answer's reasoning, after tool results too

    def render(self, messages, add_generation_prompt=False):
        # A reply that is all reasoning has no answer to train: it stays as context (as the template shows it), untrained.
        stripped = [{**m, "content": strip_reasoning(m["content"]),
                     **({TRAINED_BEFORE: True} if all_reasoning(m) else {})} if m["role"] == "assistant" else m
                    for m in messages]
        return super().render(stripped, add_generation_prompt)

    def note(self, messages):
        if any(all_reasoning(m) for m in messages):
            return ALL_REASONING
        return None

    examples = Template.examples  # no turn shows reasoning, in training or at inference: one sequence


class Alpaca(Template):
    """The Stanford Alpaca prompt; the target follows `### Response:` directly, as in its train.py. A conversation's
    system text (its non-empty system texts joined by a blank line) takes the place of the fixed header in every turn,
    as in LLaMA-Factory's alpaca template (its default_system is that header; its format_system writes a system text
    as given, with nothing after it: the header's own blank line goes with the header); without one, the header."""

    name = "alpaca"
    # `input` (kept apart by the Alpaca reader) becomes the `### Input:` section; plain messages get the no-input
    # prompt. add_generation_prompt changes nothing: a user turn already ends with `### Response:`.
    chat_template = (
        PRELUDE_JINJA + "{{ bos_token }}{% set system = " + SYSTEMS_JINJA + " | select | join('\\n\\n') %}"
        "{% for message in messages %}" + CONTENT_JINJA + "{% if message['role'] == 'user' %}"
        "{{ system or " + repr(ALPACA_HEAD) + ".format(', paired with an input that provides further context' if "
        "message['input'] else '') }}{{ '### Instruction:\\n' + content + '\\n\\n' }}"
        "{% if message['input'] %}{{ '### Input:\\n' + message['input'] + '\\n\\n' }}{% endif %}"
        "{{ '### Response:' }}{% elif message['role'] == 'assistant' %}{{ content + eos_token }}"
        "{% endif %}{% endfor %}")

    def render(self, messages, add_generation_prompt=False):
        refuse_tools(self.name, messages)
        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system" and m["content"])
        out: list[Segment] = [(self.bos, False)]
        for m in messages:
            if m["role"] == "user":  # each turn is a whole Alpaca prompt: the header (or system text) opens it
                context = m.get("input") or ""
                head = system or ALPACA_HEAD.format(", paired with an input that provides further context"
                                                    if context else "")
                body = f"### Instruction:\n{m['content']}\n\n" + (f"### Input:\n{context}\n\n" if context else "")
                out.append((head + body + "### Response:", False))
            elif m["role"] == "assistant":
                out.append((m["content"] + self.eos, True))
        return out


class ModelChatTemplate(Template):
    """The tokenizer's own `chat_template`. Assistant turn i's context is what the template gives the model when it
    writes that turn (the first i messages and the generation prompt), its target what follows in the conversation
    ending with it. Where the template shows the turn otherwise in later turns' context (R1 deletes reasoning from
    earlier turns), the turn ends a training example of its own (`examples`), as R1.examples does."""

    name = "model"
    REPLY = "\x00sft reply\x00"  # stands for a reply's text, to see what the template writes around it

    def __init__(self, tokenizer):
        super().__init__(tokenizer.bos_token, tokenizer.eos_token)
        self.tokenizer = tokenizer

    def _apply(self, messages: Messages, add_generation_prompt: bool) -> str:
        plain = [{"role": m["role"], "content": user_text(m) if m["role"] == "user" else m["content"]}
                 for m in messages if m["role"] != TOOLS_ROLE]
        for message, m in zip(plain, (m for m in messages if m["role"] != TOOLS_ROLE)):
            if m.get("tool_calls"):  # as OpenAI clients send them: no text is None
                message.update(tool_calls=m["tool_calls"], content=m["content"] or None)
        tools = tool_definitions(messages) or None
        try:
            if not plain:  # the prompt of a reply that opens the conversation, which apply_chat_template refuses
                from transformers.utils.chat_template_utils import render_jinja_template

                return render_jinja_template([plain], tools=tools, add_generation_prompt=add_generation_prompt,
                                             chat_template=self.tokenizer.get_chat_template(None, tools),
                                             **self.tokenizer.special_tokens_map)[0][0]
            return self.tokenizer.apply_chat_template(plain, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, tools=tools)
        except Exception as e:  # jinja2's TemplateError (raise_exception), or a variable the template lacks
            raise DataError(f"the model's chat_template fails on this conversation ({type(e).__name__}: "
                            f"{' '.join(str(e).split())}); fix the record or use --template with one of "
                            f"{', '.join(BUILTIN_NAMES)}") from None

    def text(self, messages, add_generation_prompt=False):
        return self._apply(messages, add_generation_prompt)

    def render(self, messages, add_generation_prompt=False):
        """With a generation prompt: the prompt, nothing trained. Without: the conversation as the model sees it
        at its last turn (the last of `examples`)."""
        if add_generation_prompt:
            return [(self._apply(messages, True), False)]
        return self.examples(messages)[-1]

    def _turn(self, messages: Messages, i: int) -> tuple[int, int, str]:
        """Assistant turn i -> (start, end, text): the text up to the end of the turn, its target text[start:end],
        which ends after the end-of-turn token (what the template writes after it, a newline say, is not)."""
        turn = self._apply(messages[: i + 1], False)
        prompt = self._apply(messages[:i], True)
        written = (messages[i]["content"] or "").strip()
        if not turn.startswith(prompt) or written not in turn[len(prompt):]:
            # The template writes the turn otherwise when it ends the conversation (R1 deletes its reasoning), or
            # its generation prompt opens what this reply does not (R1's `<think>\n`, a reply without reasoning):
            # the reply is then the template's frame around the text as given.
            framed = self._apply(messages[:i] + [{**messages[i], "content": self.REPLY}], False)
            if framed.count(self.REPLY) != 1:
                raise DataError("the model's chat_template does not write an assistant turn's text as given, so its "
                                "tokens cannot be located; use --template with one of " + ", ".join(BUILTIN_NAMES))
            before, after = framed.split(self.REPLY)
            turn = before + messages[i]["content"] + after
            if not turn.startswith(prompt):
                if not prompt.startswith(before):
                    raise DataError("the model's chat_template writes an assistant turn's opening otherwise than its "
                                    "generation prompt, so the turn's context is unclear; use --template with one "
                                    "of " + ", ".join(BUILTIN_NAMES))
                prompt = before
        target = turn[len(prompt):]
        cut = target.rfind(self.eos) + len(self.eos) if self.eos and self.eos in target else len(target)
        return len(prompt), len(prompt) + cut, turn

    def examples(self, messages):
        # A turn joins the current example when its text keeps every earlier member's, up to that member's end,
        # unchanged; else it starts the next one.
        groups: list[list[tuple[int, int, str]]] = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start, end, text = self._turn(messages, i)
            if groups and start >= groups[-1][-1][1] and all(text.startswith(t[:e]) for _, e, t in groups[-1]):
                groups[-1].append((start, end, text))
            else:
                groups.append([(start, end, text)])
        if not groups:
            return [[(self._apply(messages, False), False)]]
        full = self._apply(messages, False)  # the final example keeps what follows its last turn
        last = groups[-1]
        texts = [g[-1][2] for g in groups[:-1]] + [full if all(full.startswith(t[:e]) for _, e, t in last)
                                                   else last[-1][2]]
        out = []
        for group, text in zip(groups, texts):
            segments, done = [], 0
            for start, end, _ in group:
                segments += [(text[done:start], False), (text[start:end], True)]
                done = end
            segments.append((text[done:], False))
            out.append([s for s in segments if s[0]])
        return out
