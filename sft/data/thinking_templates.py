"""The templates of the newer DeepSeek releases, whose generation prompt does not force `<think>\\n`.

- `r1_0528` (DeepSeek-R1-0528 and R1-0528-Qwen3-8B): every system text first (joined by a blank line), a user turn
  written with the `<｜Assistant｜>` that opens the reply (so the generation prompt adds nothing after a question),
  the reply as the model writes it, `<think>` included, and earlier replies without their reasoning.
- `deepseek_v31` (DeepSeek-V3.1): the same layout but `<｜Assistant｜>` opens a reply after a question with
  `</think>` (not thinking) or `<think>` (thinking, the `thinking=True` of apply_chat_template); earlier replies are
  always shown not thinking: `</think>` and the text after their first `</think>`.

Whether a V3.1 reply thinks is the record's `thinking` (true/false, sft/data/formats.py puts it on every assistant
turn as "thinking"), else whether the reply holds `</think>`. A thinking reply trains what the model writes after
`<think>`: its reasoning, `</think>` and the answer; a reply that does not think trains its answer alone (the text
after `</think>`, which is all later turns see of it). Tool conversations are refused with one clear error: these
releases' own tool layouts are not written yet.
"""

from __future__ import annotations

from sft.data.templates import (CONTENT_JINJA, PRELUDE_JINJA, SYSTEMS_JINJA, THINK_END, USER_JINJA, V3_EOS, Messages,
                                R1, Segment, Template, shown_answer, user_text)
from sft.data.tool_calls import ASSISTANT, TRAINED_BEFORE, has_tools
from sft.errors import DataError

THINK = "<think>"
THINKING_KEY = "thinking"  # on an assistant turn: whether it thinks (V3.1); None: whether it holds `</think>`
# The saved templates refuse what render refuses: tool calls and results.
NO_TOOLS_JINJA = ("{% if message['role'] == 'tool' or message['tool_calls'] %}{{ raise_exception('this template "
                  "writes no tool calls or results (their layout in this DeepSeek release is not implemented)') }}"
                  "{% endif %}")


def refuse_tool_layout(name: str, messages: Messages) -> None:
    if has_tools(messages):
        raise DataError(f"--template {name} does not write tool calls yet (this release's own tool-call layout is "
                        f"not implemented); train tool conversations with --template deepseek_v3, r1 or r1_distill, "
                        f"or drop those records")


class R1_0528(R1):
    """DeepSeek-R1-0528 and R1-0528-Qwen3-8B, as their own chat template writes them (see the module docstring).
    Every reply is trained whole after the `<｜Assistant｜>` of the question before it, its `<think>` too: no
    generation prompt forces it. Earlier replies appear without their reasoning, so each reply with reasoning before
    the last ends an example of its own (R1.examples). Our Jinja keeps the reasoning of the conversation's last
    message, which the official template deletes: prompts render identically."""

    name = "r1_0528"
    generation_prompt = ""  # the user turn already ends with `<｜Assistant｜>`
    chat_template = (
        PRELUDE_JINJA + "{{ bos_token }}{{ " + SYSTEMS_JINJA + " | join('\\n\\n') }}"
        "{% set ns = namespace(last_user=false) %}{% for message in messages %}" + CONTENT_JINJA + NO_TOOLS_JINJA
        + "{% if message['role'] == 'user' %}{{ '<｜User｜>' + " + USER_JINJA + " + '" + ASSISTANT + "' }}"
        "{% set ns.last_user = true %}{% elif message['role'] == 'assistant' %}"
        "{{ (content.split('</think>')[-1] if '</think>' in content and not loop.last else content) + '" + V3_EOS
        + "' }}{% set ns.last_user = false %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt and not ns.last_user %}{{ '" + ASSISTANT + "' }}{% endif %}")

    user_end = ASSISTANT  # written after each question
    note = Template.note  # no generation prompt to differ from (R1's note is about its `<think>\n`)

    def render(self, messages, add_generation_prompt=False):
        out, last_user = self.turns(messages)
        if add_generation_prompt and not last_user:
            out.append((ASSISTANT, False))
        return out

    def turns(self, messages: Messages) -> tuple[list[Segment], bool]:
        """The conversation's segments, and whether it ends with a question."""
        refuse_tool_layout(self.name, messages)
        out: list[Segment] = [(self.bos + self.system(messages), False)]
        last_user = False
        for i, m in enumerate(messages):
            if m["role"] == "user":
                out.append((f"<｜User｜>{user_text(m)}{self.user_end}", False))
            elif m["role"] == "assistant":
                out += self.turn_reply(m, after_user=last_user, last=i == len(messages) - 1)
            if m["role"] in ("user", "assistant"):
                last_user = m["role"] == "user"
        return out, last_user

    def turn_reply(self, message: dict, after_user: bool, last: bool) -> list[Segment]:
        if not last and THINK_END in message["content"]:  # context only: not what the model wrote
            return [(shown_answer(message["content"]) + V3_EOS, False)]
        return [(message["content"] + V3_EOS, not message.get(TRAINED_BEFORE))]


def thinks(message: dict) -> bool:
    """Whether a V3.1 reply is written thinking: the record says so, else it holds `</think>`."""
    flag = message.get(THINKING_KEY)
    return THINK_END in message["content"] if flag is None else bool(flag)


def answer_only(content: str) -> str:
    """What V3.1's template shows of a reply that does not think (and of every earlier reply): the text after its
    first `</think>` (`content.split('</think>', 1)[1]`), the whole text without one."""
    return content.split(THINK_END, 1)[1] if THINK_END in content else content


class DeepSeekV31(R1_0528):
    """DeepSeek-V3.1 as its own chat template writes it (see the module docstring). A thinking reply that is not the
    conversation's last is shown otherwise in later turns, so it ends an example of its own (R1.examples); every
    reply is trained exactly once."""

    name = "deepseek_v31"
    generation_prompt = ASSISTANT + THINK_END  # the default, not thinking; `text(..., thinking=True)` opens `<think>`
    chat_template = (
        "{% if thinking is not defined %}{% set thinking = enable_thinking if enable_thinking is defined else false %}"
        "{% endif %}" + PRELUDE_JINJA + "{{ bos_token }}{{ " + SYSTEMS_JINJA + " | join('\\n\\n') }}"
        "{% set ns = namespace(last_user=false) %}{% for message in messages %}" + CONTENT_JINJA + NO_TOOLS_JINJA
        + "{% if message['role'] == 'user' %}{{ '<｜User｜>' + " + USER_JINJA + " }}{% set ns.last_user = true %}"
        "{% elif message['role'] == 'assistant' %}"
        "{% set thinks = ('</think>' in content) if message['thinking'] is not defined or message['thinking'] is none "
        "else message['thinking'] %}{% set now = thinks and loop.last %}"
        "{% if ns.last_user %}{{ '" + ASSISTANT + "' + ('<think>' if now else '</think>') }}{% endif %}"
        "{% if now %}{{ content[7:] if content.startswith('<think>') else content }}"
        "{% elif '</think>' in content %}{{ content.split('</think>', 1)[1] }}{% else %}{{ content }}{% endif %}"
        "{{ '" + V3_EOS + "' }}{% set ns.last_user = false %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt and ns.last_user %}{{ '" + ASSISTANT + "' + ('<think>' if thinking else "
        "'</think>') }}{% endif %}")

    def text(self, messages, add_generation_prompt=False, thinking: bool = False):
        segments = self.render(messages, add_generation_prompt)
        if add_generation_prompt and thinking and segments[-1][0] == self.generation_prompt:
            segments[-1] = (ASSISTANT + THINK, False)
        return "".join(text for text, _ in segments)

    user_end = ""

    def render(self, messages, add_generation_prompt=False):
        out, last_user = self.turns(messages)
        if add_generation_prompt and last_user:
            out.append((self.generation_prompt, False))
        return out

    def turn_reply(self, message: dict, after_user: bool, last: bool) -> list[Segment]:
        content, trained = message["content"], not message.get(TRAINED_BEFORE)
        if thinks(message) and last:  # what the model writes after `<think>`
            if THINK_END not in content:
                raise DataError("a reply marked thinking has no `</think>`: V3.1 writes its reasoning, `</think>`, "
                                "then the answer; add the reasoning or set the record's \"thinking\" to false")
            return [(ASSISTANT + THINK if after_user else "", False), (content.removeprefix(THINK) + V3_EOS, trained)]
        if thinks(message):  # an earlier thinking reply: context only, as later turns see it (its own example trains it)
            return [((ASSISTANT + THINK_END if after_user else "") + answer_only(content) + V3_EOS, False)]
        return [(ASSISTANT + THINK_END if after_user else "", False), (answer_only(content) + V3_EOS, trained)]

    def hides(self, message: dict, after_results: bool) -> bool:
        return thinks(message)
