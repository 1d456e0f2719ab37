"""Tool calls: conversations with `tools`, assistant `tool_calls` and `tool` results, in DeepSeek-V3/R1 form.

Internal form (written by sft/data/formats.py): an assistant turn that calls tools is
`{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name", "arguments"}}]}`
with `arguments` a JSON string; a result is `{"role": "tool", "content": ...}`; the tool definitions travel as the
conversation's first message, `{"role": "tools", "content": <JSON list, OpenAI form>}`, so that they move with the
messages through every step (the Arrow table, the data cache key, the tokenizing workers) and the template places
them.

Rendering (render_v3) writes byte for byte what DeepSeek-V3's, the R1 distills' and DeepSeek-R1's own chat
templates write, quirks included, because that is what the models see: only the conversation's first call opens
`<｜Assistant｜><｜tool▁calls▁begin｜>`; every later call (of that turn or of a later one) is written as
"\\n" + call; the results open `<｜tool▁outputs▁begin｜>` once per conversation (never again, even in a later
turn) and are closed by `<｜tool▁outputs▁end｜>` only before an answer (which has no `<｜Assistant｜>` in front) or
at the end. Where the families differ (CallLayout): V3 and the distills end every later call with
`<｜tool▁calls▁end｜><｜end▁of▁sentence｜>` (a turn with a single call carries no end marker), put "\\n" between
results, and drop the text beside calls; DeepSeek-R1 ends each turn's calls once with those markers, writes results
back to back, and writes the text beside the conversation's first call (its reasoning) after `<｜Assistant｜>`,
dropping that of later calls. The R1 templates write an answer right after
results as given, reasoning included, and every other answer without its reasoning (`split('</think>')[-1]`, no
whitespace stripped), as without tools: the caller's `reply` writes answers (sft/data/templates.py R1). Those
templates do not write `tools` at all (apply_chat_template drops them); we add them to the system prompt
(tools_section), as LLaMA-Factory does for templates without a tool slot, so that the model sees the functions it
learns to call. The chat template that
training saves writes the same layout from apply_chat_template's messages and `tools` (TOOLS_STATE_JINJA and after).

DeepSeek-R1-0528's and DeepSeek-V3.1's templates open every turn's calls afresh instead (CallLayout.per_turn: the
turn's text, its own `<｜tool▁calls▁begin｜>` block ended once, turn_calls); V3.1 also writes a call without its type
or ```json fence (V31_CALL) and its results bare. sft/data/thinking_templates.py renders those two. V3.1's model
card gives the text it reads its tools in, so V3.1 writes that one (sft/data/v31_tools.py) instead of tools_section.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sft.errors import DataError

TOOLS_ROLE = "tools"
# built-ins with a tool-call format
TOOL_TEMPLATES = ("deepseek_v3", "r1", "r1_distill", "r1_distill_no_reasoning", "r1_0528", "deepseek_v31")
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUTS_BEGIN, OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
# Marks an assistant turn whose target an earlier example of the same conversation already trained (R1.examples).
TRAINED_BEFORE = "_trained_before"
ASSISTANT = "<｜Assistant｜>"
TOOLS_HEADER = "## Tools\nYou have access to the following functions (JSON schemas, one per line):"
# One call as the templates write it ({type}, {name}, {arguments}: the call's): V3's and the R1 family's, V3.1's.
V3_CALL = CALL_BEGIN + "{type}" + SEP + "{name}\n```json\n{arguments}\n```" + CALL_END
V31_CALL = CALL_BEGIN + "{name}" + SEP + "{arguments}" + CALL_END


@dataclass(frozen=True)
class CallLayout:
    """What the official templates' tool layouts do differently: V3's and the distills' (V3_CALLS), R1's (R1_CALLS),
    and the per-turn layouts of R1-0528 (R1_0528_CALLS) and V3.1 (V31_CALLS), which thinking_templates.py renders."""

    result_sep: str  # written before every tool result of a block but the first
    end_per_turn: bool  # calls end once per turn (R1), else every call but the conversation's first ends (V3)
    writes_text: bool  # the text beside the conversation's first call follows `<｜Assistant｜>` (R1), else dropped
    call_format: str = V3_CALL  # one call's text
    call_sep: str = "\n"  # written before every call but the one that opens `<｜tool▁calls▁begin｜>`
    # Every turn's calls open `<｜tool▁calls▁begin｜>` after its text, and the results after them open a block of their
    # own (R1-0528, V3.1), instead of once per conversation (V3, R1: render_v3).
    per_turn: bool = False
    outputs_block: bool = True  # results between `<｜tool▁outputs▁begin｜>` and `<｜tool▁outputs▁end｜>`; V3.1: bare


V3_CALLS = CallLayout(result_sep="\n", end_per_turn=False, writes_text=False)
R1_CALLS = CallLayout(result_sep="", end_per_turn=True, writes_text=True)
R1_0528_CALLS = CallLayout(result_sep="\n", end_per_turn=True, writes_text=True, per_turn=True)
V31_CALLS = CallLayout(result_sep="", end_per_turn=True, writes_text=True, call_format=V31_CALL, call_sep="",
                       per_turn=True, outputs_block=False)


def has_tools(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] in ("tool", TOOLS_ROLE) or m.get("tool_calls") for m in messages)


def refuse_tools(template: str, messages: list[dict[str, Any]]) -> None:
    """For templates without a tool-call format: one clear error instead of rendering calls as plain turns."""
    if has_tools(messages):
        raise DataError(f"--template {template} has no tool-call format; conversations with tools, tool_calls or "
                        f"tool results train with --template {', '.join(TOOL_TEMPLATES)} (or drop those records); "
                        f"on deepseek-llm or deepseek-coder, whose own templates have none, the model learns "
                        f"deepseek_v3's layout from the data.")


def dump_arguments(arguments: Any) -> str:
    """Arguments given as an object -> the JSON text the template writes: json.dumps with its default separators
    (", " and ": ") and ensure_ascii=False, as LLaMA-Factory writes glaive's calls and transformers' `tojson` writes
    JSON. A string is taken as the model wrote it."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def tool_definitions(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation's tool definitions (OpenAI form), [] if it has none."""
    return next((json.loads(m["content"]) for m in messages if m["role"] == TOOLS_ROLE), [])


def tools_section(tools: list[dict[str, Any]]) -> str:
    """The system-prompt text that shows the tools: a header, then each definition as one line of JSON (json.dumps
    with ensure_ascii=False, equal to `tool | tojson` in a chat template)."""
    return "\n".join([TOOLS_HEADER] + [json.dumps(t, ensure_ascii=False) for t in tools]) if tools else ""


def with_tools(system: str, messages: list[dict[str, Any]]) -> str:
    """The system prompt with the tools section after it (a blank line between, as DeepSeek joins system texts)."""
    return "\n\n".join(part for part in (system, tools_section(tool_definitions(messages))) if part)


def call_text(call: dict[str, Any], layout: CallLayout = V3_CALLS) -> str:
    function = call["function"]
    return layout.call_format.format(type=call["type"], name=function["name"], arguments=function["arguments"])


def result_text(content: str, first: bool, layout: CallLayout) -> str:
    """A tool result (`first`: the first of its block, which opens `<｜tool▁outputs▁begin｜>` in a layout with one)."""
    opening = (OUTPUTS_BEGIN if layout.outputs_block else "") if first else layout.result_sep
    return opening + OUTPUT_BEGIN + content + OUTPUT_END


def turn_calls(message: dict[str, Any], text: str, layout: CallLayout, eos: str) -> str:
    """A turn's calls in a per-turn layout (R1-0528, V3.1): its text, then its own calls block, ended once."""
    calls = layout.call_sep.join(call_text(call, layout) for call in message["tool_calls"])
    return text + CALLS_BEGIN + calls + CALLS_END + eos


def after_outputs(messages: list[dict[str, Any]]) -> list[bool]:
    """For each message, whether tool results come right before it (the template's `ns.is_tool`: set by a result,
    cleared by a question, a call or an answer; system texts and the tool definitions leave it as it is). An answer
    there follows `<｜tool▁outputs▁end｜>` and is written as given, reasoning included."""
    out, state = [], False
    for m in messages:
        out.append(state)
        if m["role"] in ("user", "assistant", "tool"):
            state = m["role"] == "tool"
    return out


def split_opening(generation_prompt: str, text: str) -> tuple[str, str]:
    """A turn's text -> (what is written in front of it, the model's part): the generation prompt's part of the text
    (R1's `<think>\\n`) is prompt where the text opens with it; else the turn follows `<｜Assistant｜>` alone."""
    opens = generation_prompt.removeprefix(ASSISTANT)
    return (generation_prompt, text[len(opens):]) if opens and text.startswith(opens) else (ASSISTANT, text)


def render_v3(messages: list[dict[str, Any]], *, head: str, generation_prompt: str, eos: str,
              add_generation_prompt: bool, user_text: Callable[[dict[str, Any]], str],
              reply: Callable[[dict[str, Any], bool, bool], list[tuple[str, bool]]],
              layout: CallLayout = V3_CALLS) -> list[tuple[str, bool]]:
    """A tool conversation as DeepSeek-V3/R1's template writes it (see the module docstring), as segments: every
    assistant turn's calls trained (unless marked TRAINED_BEFORE), with the end markers and the text the template
    writes, and every answer as `reply(message, last, after_outputs)` writes it (the template's own choice: R1
    shows an earlier answer's reasoning only right after tool results); prompts, tool results, the system prompt
    with the tools, and the `<｜Assistant｜>` (with the generation prompt's `<think>\\n`) in front of a turn not."""
    out: list[tuple[str, bool]] = [(head, False)]
    first_call, in_outputs, first_output = True, False, True  # the template's ns.is_first, is_tool, is_output_first
    for i, m in enumerate(messages):
        if m["role"] == "user":
            in_outputs = False
            out.append((f"<｜User｜>{user_text(m)}", False))
        elif m["role"] == "assistant" and m.get("tool_calls"):
            in_outputs = False
            out += calls_segments(m, first_call, layout, generation_prompt, eos)
            first_call = False
        elif m["role"] == "assistant":
            out += reply(m, i == len(messages) - 1, in_outputs)
            in_outputs = False
        elif m["role"] == "tool":
            out.append((result_text(m["content"], first_output, layout), False))
            in_outputs, first_output = True, False
    if in_outputs:
        out.append((OUTPUTS_END, False))
    elif add_generation_prompt:
        out.append((generation_prompt, False))
    return out


# DeepSeek-V3's and the distills' official templates write an assistant turn with text as an answer, without its
# calls: such data cannot be trained as the model is prompted, so it stops the run.
TEXT_DROPS_CALLS = ("an assistant turn with both text and tool_calls: DeepSeek-V3's and the R1 distills' templates "
                    "write only one of the two (they drop the calls). Move the text to its own turn, or train with "
                    "--template r1, whose template writes the text before a conversation's first call")
# DeepSeek-R1's writes the text beside the conversation's first call (its reasoning before calling) and drops that
# of later calls, as it drops earlier answers' reasoning: said in the data summary (R1.note).
LATER_CALL_TEXT = "text beside a later tool call, not written (R1's template writes the first call's only)"


def later_call_text(messages: list[dict[str, Any]]) -> bool:
    """Whether a turn with tool_calls after the conversation's first has text beside them (R1's template drops it)."""
    calls = [m for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
    return any(m["content"].strip() for m in calls[1:])


def calls_segments(message: dict[str, Any], first_call: bool, layout: CallLayout, generation_prompt: str,
                   eos: str) -> list[tuple[str, bool]]:
    """An assistant turn with `tool_calls` as segments (`first_call`: the conversation's first call is in it)."""
    if message["content"].strip() and not layout.writes_text:
        raise DataError(TEXT_DROPS_CALLS + ".")
    trained = not message.get(TRAINED_BEFORE)
    calls = [call_text(call, layout) for call in message["tool_calls"]]
    out: list[tuple[str, bool]] = []
    if first_call:  # the only call written with an opening; R1 writes the text beside it there (say, its reasoning)
        prompt, text = split_opening(generation_prompt, message["content"] if layout.writes_text else "")
        out += [(prompt, False), (text + CALLS_BEGIN + calls.pop(0), trained)]
    ends = "" if layout.end_per_turn else CALLS_END + eos
    out += [(layout.call_sep + call + ends, trained) for call in calls]
    if layout.end_per_turn:
        out.append((CALLS_END + eos, trained))
    return out


# The same layout in Jinja, for the chat template that training saves on the tokenizer (sft/data/templates.py), so that
# `apply_chat_template(messages, tools=...)` on a trained model writes what render_v3 wrote. It reads OpenAI-form
# messages as apply_chat_template hands them over: the definitions as its `tools` argument (a bare function is
# wrapped as sft/data/formats.py wraps it), a call's arguments as JSON text or an object (dumped as dump_arguments does,
# `tojson` being json.dumps(ensure_ascii=False) there), and a call's content missing, since transformers drops every
# None value from a message before rendering; `content` is the message's text, set by the messages loop
# (sft/data/templates.py CONTENT_JINJA: list-of-parts content joined as the reader joins it). `ns` holds render_v3's
# state and the tools section.
TOOLS_NS_JINJA = "{% set ns = namespace(section='', first_call=true, in_outputs=false, first_output=true) %}"
TOOLS_STATE_JINJA = (
    TOOLS_NS_JINJA + "{% if tools %}{% set ns.section = " + repr(TOOLS_HEADER) + " %}{% for tool in tools %}"
    "{% set ns.section = ns.section + '\\n' + ((tool if tool['function'] is mapping else "
    "{'type': 'function', 'function': tool}) | tojson) %}{% endfor %}{% endif %}")


def head_jinja(system_jinja: str) -> str:
    """with_tools() in Jinja: the system prompt (`system_jinja`), then the tools section after a blank line."""
    return "{{ [" + system_jinja + ", ns.section] | select | join('\\n\\n') }}"


# The Jinja of a call's fields in call_format, for a `call` of the loop over message['tool_calls'].
CALL_FIELDS_JINJA = {"type": "(call['type'] if call['type'] is defined else 'function')",
                     "name": "call['function']['name']",
                     "arguments": "(arguments if arguments is string else arguments | tojson)"}
ARGUMENTS_JINJA = ("{% set arguments = call['function']['arguments'] if call['function']['arguments'] is defined "
                   "else {} %}")  # first in every loop over the calls


def jinja_string(text: str) -> str:
    return "'" + text.replace("\n", "\\n") + "'"


def call_jinja(layout: CallLayout) -> str:
    """One call's text in Jinja (call_text), from the layout's call_format."""
    parts = re.split(r"\{(\w+)\}", layout.call_format)  # text, field, text, ...
    return " + ".join(CALL_FIELDS_JINJA[part] if i % 2 else jinja_string(part) for i, part in enumerate(parts) if part)


def calls_jinja(eos: str, layout: CallLayout) -> str:
    """The Jinja of an assistant turn with `tool_calls` (an `{% elif %}` branch of the messages loop), as
    calls_segments writes it; R1's layout writes the text beside the conversation's first call and drops a later
    call's; the others refuse text beside calls, as training does."""
    call = call_jinja(layout)
    text = " + content" if layout.writes_text else ""
    ends = "" if layout.end_per_turn else " + '" + CALLS_END + eos + "'"
    return ("{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
            + ("" if layout.writes_text else "{% if content | trim %}{{ raise_exception('an assistant message "
               "with both text and tool_calls: this template writes only one of the two') }}{% endif %}")
            + "{% set ns.in_outputs = false %}{% for call in message['tool_calls'] %}" + ARGUMENTS_JINJA +
            "{% if ns.first_call %}{{ '" + ASSISTANT + "'" + text + " + '" + CALLS_BEGIN + "' + " + call + " }}"
            "{% set ns.first_call = false %}{% else %}{{ " + jinja_string(layout.call_sep) + " + " + call + ends
            + " }}{% endif %}{% endfor %}" + ("{{ '" + CALLS_END + eos + "' }}" if layout.end_per_turn else ""))


def turn_calls_jinja(eos: str, layout: CallLayout) -> str:
    """turn_calls in Jinja, after the turn's text: its calls block (a per-turn layout)."""
    return ("{{ '" + CALLS_BEGIN + "' }}{% for call in message['tool_calls'] %}" + ARGUMENTS_JINJA + "{{ ('' if "
            "loop.first else " + jinja_string(layout.call_sep) + ") + " + call_jinja(layout) + " }}{% endfor %}"
            "{{ '" + CALLS_END + eos + "' }}")


def result_jinja(layout: CallLayout) -> str:
    """A tool result (an `{% elif %}` branch of the messages loop), as render_v3 writes it."""
    opening = OUTPUTS_BEGIN if layout.outputs_block else ""
    return ("{% elif message['role'] == 'tool' %}{{ ('" + opening + "' if ns.first_output else "
            + repr(layout.result_sep) + ") + '" + OUTPUT_BEGIN + "' + content + '" + OUTPUT_END + "' }}"
            "{% set ns.in_outputs = true %}{% set ns.first_output = false %}")


def end_jinja(generation_prompt: str) -> str:
    """What ends the conversation, as render_v3 writes it."""
    return ("{% if ns.in_outputs %}{{ '" + OUTPUTS_END + "' }}{% elif add_generation_prompt %}{{ "
            + repr(generation_prompt) + " }}{% endif %}")
