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
after `</think>`, which is all later turns see of it).

Tool conversations take each release's own layout, byte for byte (sft/data/tool_calls.py R1_0528_CALLS, V31_CALLS:
both open every turn's calls afresh, unlike V3's and R1's render_v3), with the tools in the system prompt (neither
official template writes `tools`): R1-0528 with our tools section (with_tools), V3.1 with the tool description its
model card gives, after the system prompt and a blank line (sft/data/v31_tools.py):
- R1-0528: a call turn is its text (reasoning deleted in later turns, as for answers), `<｜tool▁calls▁begin｜>`, its
  calls in V3's form ("\\n" between them) and `<｜tool▁calls▁end｜><｜end▁of▁sentence｜>`; the results after it open
  `<｜tool▁outputs▁begin｜>` ("\\n" between them) and `<｜tool▁outputs▁end｜>` closes them before the next reply, call
  or answer (answers after results lose their reasoning too), and ends a conversation that ends with them: that is the
  generation prompt after results.
- V3.1: `<｜Assistant｜></think>` before a call turn after a question (V3.1 calls tools without thinking, whatever a
  turn's flag says: the summary counts such turns; reasoning beside calls is refused), the turn's text as given, and
  `<｜tool▁calls▁begin｜>` + every `<｜tool▁call▁begin｜>name<｜tool▁sep｜>arguments<｜tool▁call▁end｜>` (no type, no
  ```json fence, no separator) + `<｜tool▁calls▁end｜><｜end▁of▁sentence｜>`; each result is bare
  `<｜tool▁output▁begin｜>...<｜tool▁output▁end｜>`, and what follows results (a call or an answer, written as given,
  reasoning included, in later turns too) comes right after them: no generation prompt after results.
Every call turn and answer is trained once, after the tokens the official template gives the model for it.
"""

from __future__ import annotations

from sft.data.templates import (CONTENT_JINJA, PRELUDE_JINJA, SYSTEMS_JINJA, THINK_END, USER_JINJA, V3_EOS, Messages,
                                R1, Segment, Template, shown_answer, user_text)
from sft.data.tool_calls import (ASSISTANT, OUTPUTS_END, R1_0528_CALLS, TOOLS_STATE_JINJA, TRAINED_BEFORE, V31_CALLS,
                                 head_jinja, result_jinja, result_text, turn_calls, turn_calls_jinja, with_tools)
from sft.data.v31_tools import V31_TOOLS_STATE_JINJA, v31_head_jinja, v31_with_tools
from sft.errors import DataError

THINK = "<think>"
THINKING_KEY = "thinking"  # on an assistant turn: whether it thinks (V3.1); None: whether it holds `</think>`


def head_of(tools_state_jinja: str, head: str) -> str:
    """What every saved template here starts with: the tools' state (with the text that shows them) and the system
    texts with that text (`head`: head_jinja or v31_head_jinja)."""
    return PRELUDE_JINJA + "{{ bos_token }}" + tools_state_jinja + "{% set ns.last_user = false %}" + head


SYSTEM_TEXTS_JINJA = SYSTEMS_JINJA + " | join('\\n\\n')"
HEAD_JINJA = head_of(TOOLS_STATE_JINJA, head_jinja(SYSTEM_TEXTS_JINJA))
V31_HEAD_JINJA = head_of(V31_TOOLS_STATE_JINJA, v31_head_jinja(SYSTEM_TEXTS_JINJA))
# What a reply does to the loop's state: it is no question, and results before it are closed.
REPLIED_JINJA = "{% set ns.last_user = false %}{% set ns.in_outputs = false %}"


class R1_0528(R1):
    """DeepSeek-R1-0528 and R1-0528-Qwen3-8B, as their own chat template writes them (see the module docstring).
    Every reply is trained whole after the `<｜Assistant｜>` of the question before it (or the
    `<｜tool▁outputs▁end｜>` of the results), its `<think>` too: no generation prompt forces it. Earlier replies and
    calls appear without their reasoning, so each such turn before the last ends an example of its own (R1.examples).
    Our Jinja keeps the reasoning of the conversation's last message, which the official template deletes: prompts
    render identically."""

    name = "r1_0528"
    generation_prompt = ""  # the user turn already ends with `<｜Assistant｜>`, results with `<｜tool▁outputs▁end｜>`
    tool_layout = R1_0528_CALLS
    chat_template = (
        HEAD_JINJA + "{% for message in messages %}" + CONTENT_JINJA + "{% if message['role'] == 'user' %}"
        "{{ '<｜User｜>' + " + USER_JINJA + " + '" + ASSISTANT + "' }}{% set ns.last_user = true %}"
        "{% set ns.in_outputs = false %}{% elif message['role'] == 'assistant' %}"
        "{% set content = content.split('</think>')[-1] if '</think>' in content and not loop.last else content %}"
        "{% if ns.in_outputs %}{{ '" + OUTPUTS_END + "' }}{% endif %}{{ content }}{% if message['tool_calls'] %}"
        + turn_calls_jinja(V3_EOS, R1_0528_CALLS) + "{% set ns.first_output = true %}{% else %}{{ '" + V3_EOS
        + "' }}{% endif %}" + REPLIED_JINJA + result_jinja(R1_0528_CALLS) + "{% set ns.last_user = false %}"
        "{% endif %}{% endfor %}{% if ns.in_outputs %}{{ '" + OUTPUTS_END + "' }}"
        "{% elif add_generation_prompt and not ns.last_user %}{{ '" + ASSISTANT + "' }}{% endif %}")

    user_end = ASSISTANT  # written after each question
    note = Template.note  # no generation prompt to differ from (R1's note is about its `<think>\n`)

    def render(self, messages, add_generation_prompt=False):
        out, last = self.turns(messages)
        if add_generation_prompt and last not in ("user", "tool"):
            out.append((ASSISTANT, False))
        return out

    def turns(self, messages: Messages) -> tuple[list[Segment], str | None]:
        """The conversation's segments, and the role of its last question, reply or tool result (the official
        template's state: `is_last_user`, `is_tool`), None without any."""
        out: list[Segment] = [(self.bos + self.head(messages), False)]
        last, first_output = None, True  # first_output: the next result opens a block (reset by every call turn)
        for i, m in enumerate(messages):
            if m["role"] == "user":
                out.append((f"<｜User｜>{user_text(m)}{self.user_end}", False))
            elif m["role"] == "assistant":
                out += self.turn_reply(m, after=last, last=i == len(messages) - 1)
                first_output = first_output or bool(m.get("tool_calls"))
            elif m["role"] == "tool":
                out.append((result_text(m["content"], first_output, self.tool_layout), False))
                first_output = False
            if m["role"] in ("user", "assistant", "tool"):
                last = m["role"]
        if last == "tool" and self.tool_layout.outputs_block:
            out.append((OUTPUTS_END, False))
        return out, last

    def head(self, messages: Messages) -> str:
        """The system texts with the tools after them."""
        return with_tools(self.system(messages), messages)

    def turn_reply(self, message: dict, after: str | None, last: bool) -> list[Segment]:
        """An answer or a call turn (`after`: the role before it; `last`: the conversation's last message)."""
        opening = OUTPUTS_END if after == "tool" else ""  # the results close before any reply
        hidden = not last and THINK_END in message["content"]  # context only: not what the model wrote
        content = shown_answer(message["content"]) if hidden else message["content"]
        text = turn_calls(message, content, self.tool_layout, V3_EOS) if message.get("tool_calls") else content + V3_EOS
        if hidden:
            return [(opening + text, False)]
        return [(opening, False), (text, not message.get(TRAINED_BEFORE))]

    def hides(self, message: dict, after_results: bool) -> bool:
        return THINK_END in message["content"]  # every reply and call turn loses its reasoning in later turns


def thinks(message: dict) -> bool:
    """Whether a V3.1 reply is written thinking: the record says so, else it holds `</think>`."""
    flag = message.get(THINKING_KEY)
    return THINK_END in message["content"] if flag is None else bool(flag)


def answer_only(content: str) -> str:
    """What V3.1's template shows of a reply that does not think (and of every earlier reply): the text after its
    first `</think>` (`content.split('</think>', 1)[1]`), the whole text without one."""
    return content.split(THINK_END, 1)[1] if THINK_END in content else content


# V3.1 calls tools only without thinking: its template writes `<｜Assistant｜></think>` before every call turn after a
# question and the turn's text as given, so reasoning beside calls would follow a closed `</think>`.
REASONING_BESIDE_CALLS = ("a tool-call turn with reasoning (`</think>`) beside its calls: DeepSeek-V3.1's template "
                          "writes `</think>` before every call turn (V3.1 calls tools without thinking), so the "
                          "reasoning cannot be written; drop it from the turn's text")
THINKING_CALLS = "tool calls marked thinking, written not thinking (V3.1's template writes `</think>` before calls)"


class DeepSeekV31(R1_0528):
    """DeepSeek-V3.1 as its own chat template writes it (see the module docstring). A thinking reply to a question
    that is not the conversation's last is shown otherwise in later turns, so it ends an example of its own
    (R1.examples); every reply and call turn is trained exactly once."""

    name = "deepseek_v31"
    generation_prompt = ASSISTANT + THINK_END  # the default, not thinking; `text(..., thinking=True)` opens `<think>`
    tool_layout = V31_CALLS
    chat_template = (
        "{% if thinking is not defined %}{% set thinking = enable_thinking if enable_thinking is defined else false %}"
        "{% endif %}" + V31_HEAD_JINJA + "{% for message in messages %}" + CONTENT_JINJA
        + "{% if message['role'] == 'user' %}{{ '<｜User｜>' + " + USER_JINJA + " }}{% set ns.last_user = true %}"
        "{% set ns.in_outputs = false %}{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
        "{% if '</think>' in content %}{{ raise_exception(" + repr(REASONING_BESIDE_CALLS) + ") }}{% endif %}"
        "{% if ns.last_user %}{{ '" + ASSISTANT + "</think>' }}{% endif %}{{ content }}"
        + turn_calls_jinja(V3_EOS, V31_CALLS) + REPLIED_JINJA + "{% elif message['role'] == 'assistant' %}"
        "{% set thinks = ('</think>' in content) if message['thinking'] is not defined or message['thinking'] is none "
        "else message['thinking'] %}{% set now = thinks and loop.last %}"
        "{% if ns.last_user %}{{ '" + ASSISTANT + "' + ('<think>' if now else '</think>') }}{% endif %}"
        "{% if ns.in_outputs %}{{ content }}"
        "{% elif now %}{{ content[7:] if content.startswith('<think>') else content }}"
        "{% elif '</think>' in content %}{{ content.split('</think>', 1)[1] }}{% else %}{{ content }}{% endif %}"
        "{{ '" + V3_EOS + "' }}" + REPLIED_JINJA + result_jinja(V31_CALLS) + "{% set ns.last_user = false %}"
        "{% endif %}{% endfor %}{% if add_generation_prompt and ns.last_user %}{{ '" + ASSISTANT + "' + ('<think>' "
        "if thinking else '</think>') }}{% endif %}")

    def text(self, messages, add_generation_prompt=False, thinking: bool = False):
        segments = self.render(messages, add_generation_prompt)
        if add_generation_prompt and thinking and segments[-1][0] == self.generation_prompt:
            segments[-1] = (ASSISTANT + THINK, False)
        return "".join(text for text, _ in segments)

    user_end = ""

    def head(self, messages):
        return v31_with_tools(self.system(messages), messages)  # the model card's tool description

    def render(self, messages, add_generation_prompt=False):
        out, last = self.turns(messages)
        if add_generation_prompt and last == "user":  # after results the model writes on, no prompt
            out.append((self.generation_prompt, False))
        return out

    def turn_reply(self, message: dict, after: str | None, last: bool) -> list[Segment]:
        content, trained = message["content"], not message.get(TRAINED_BEFORE)
        if message.get("tool_calls"):  # not thinking, whatever the flag says (note counts it)
            if THINK_END in content:
                raise DataError(REASONING_BESIDE_CALLS + ", or the record")
            return [(ASSISTANT + THINK_END if after == "user" else "", False),
                    (turn_calls(message, content, self.tool_layout, V3_EOS), trained)]
        if after == "tool":  # right after the results, as given: no opening, reasoning shown in later turns too
            return [(content + V3_EOS, trained)]
        return self.answer(message, after_user=after == "user", last=last)

    def answer(self, message: dict, after_user: bool, last: bool) -> list[Segment]:
        """A reply that is not right after tool results: thinking or not, as the module docstring says."""
        content, trained = message["content"], not message.get(TRAINED_BEFORE)
        if thinks(message) and last:  # what the model writes after `<think>`
            if THINK_END not in content:
                raise DataError("a reply marked thinking has no `</think>`: V3.1 writes its reasoning, `</think>`, "
                                "then the answer; add the reasoning or set the record's \"thinking\" to false")
            return [(ASSISTANT + THINK if after_user else "", False), (content.removeprefix(THINK) + V3_EOS, trained)]
        if thinks(message):  # an earlier thinking reply: context only, as later turns see it (its example trains it)
            return [((ASSISTANT + THINK_END if after_user else "") + answer_only(content) + V3_EOS, False)]
        return [(ASSISTANT + THINK_END if after_user else "", False), (answer_only(content) + V3_EOS, trained)]

    def hides(self, message: dict, after_results: bool) -> bool:
        return not message.get("tool_calls") and not after_results and thinks(message)

    def note(self, messages):
        return THINKING_CALLS if any(m.get("tool_calls") and m.get(THINKING_KEY) for m in messages) else None
