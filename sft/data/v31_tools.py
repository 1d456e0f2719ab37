"""DeepSeek-V3.1's tool description, in the format its model card gives for tool calls.

V3.1's own chat template does not write `tools`, but its model card (https://huggingface.co/deepseek-ai/DeepSeek-V3.1,
README.md, section "ToolCall", after its revision "Fix tool call description") gives the prompt of a tool
conversation: `<｜begin▁of▁sentence｜>{system prompt}\\n\\n{tool_description}<｜User｜>{query}<｜Assistant｜></think>`,
where the tool_description is the card's text, byte for byte: V31_TOOLS_HEAD, a V31_TOOL block per tool, then
V31_TOOLS_TAIL (tests/test_v31_tools.py quotes the card and says where its text is stored).

Each tool writes its own `### ` block (up to the blank line before `IMPORTANT:`); `{additional_tool_calls}` is text
of the card, written as it stands; the parameters are `json.dumps(parameters)`: Python's defaults, so non-ASCII
text is \\u-escaped (`tojson(ensure_ascii=True)` in Jinja). The system prompt (empty or not) is followed by the blank
line and the description, as the card's format says. A definition without a description or parameters (or with
null ones) writes an empty description and `{}` (what OpenAI's API takes a function without them for); one without a
name is refused.
"""

from __future__ import annotations

import json
from typing import Any

from sft.data.tool_calls import TOOLS_NS_JINJA, tool_definitions
from sft.errors import DataError

V31_TOOLS_HEAD = "## Tools\nYou have access to the following tools:\n\n"
V31_TOOL = "### {name}\nDescription: {description}\n\nParameters: {parameters}\n\n"
V31_TOOLS_TAIL = (
    "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
    "tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>{additional_tool_calls}<｜tool▁calls▁end｜>\n\n"
    "Where:\n- `tool_call_name` must be an exact match to one of the available tools\n- `tool_call_arguments` must be "
    "valid JSON that strictly follows the tool's Parameters Schema\n- For multiple tool calls, chain them directly "
    "without separators or spaces")
SYSTEM_TOOLS_SEP = "\n\n"  # between the system prompt and the tool description


def v31_tool(function: dict[str, Any]) -> str:
    """One function's block (a definition's `function`, OpenAI form)."""
    if not isinstance(function.get("name"), str):
        raise DataError(f"a tool definition without a name: {json.dumps(function, ensure_ascii=False)[:200]}. "
                        "DeepSeek-V3.1's tool description writes each tool's name; add it to the record")
    return V31_TOOL.format(name=function["name"], description=function.get("description") or "",
                           parameters=json.dumps(function.get("parameters") or {}))


def v31_tools_section(tools: list[dict[str, Any]]) -> str:
    """The model card's tool_description for these definitions (OpenAI form), "" without any."""
    if not tools:
        return ""
    return V31_TOOLS_HEAD + "".join(v31_tool(t["function"]) for t in tools) + V31_TOOLS_TAIL


def v31_with_tools(system: str, messages: list[dict[str, Any]]) -> str:
    """The system prompt, then (with tools) a blank line and the tool description, as the model card writes them."""
    section = v31_tools_section(tool_definitions(messages))
    return system + SYSTEM_TOOLS_SEP + section if section else system


# The same in Jinja, for the saved chat template: `tools` as apply_chat_template hands them over (a bare function
# wrapped as sft/data/formats.py wraps it), the description built into ns.section.
_FUNCTION = "(tool['function'] if tool['function'] is mapping else tool)"
V31_TOOLS_STATE_JINJA = (
    TOOLS_NS_JINJA + "{% if tools %}{% set ns.section = " + repr(V31_TOOLS_HEAD) + " %}{% for tool in tools %}"
    "{% set function = " + _FUNCTION + " %}{% set ns.section = ns.section + '### ' + function['name'] + "
    "'\\nDescription: ' + (function['description'] or '') + '\\n\\nParameters: ' + "
    "((function['parameters'] or {}) | tojson(ensure_ascii=True)) + '\\n\\n' %}{% endfor %}"
    "{% set ns.section = ns.section + " + repr(V31_TOOLS_TAIL) + " %}{% endif %}")


def v31_head_jinja(system_jinja: str) -> str:
    """v31_with_tools() in Jinja: the system prompt (`system_jinja`), then the blank line and the description."""
    return ("{{ " + system_jinja + " }}{% if ns.section %}{{ " + repr(SYSTEM_TOOLS_SEP)
            + " + ns.section }}{% endif %}")
