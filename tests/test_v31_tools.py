"""`--template deepseek_v31` writes a conversation's tools as DeepSeek-V3.1's model card says V3.1 reads them, byte
for byte, in training and in the chat template that training saves; the other templates keep our tools section."""

from __future__ import annotations

import json

import pytest

from sft.data.chat_templates import chat_template_for_saving, get_template
from sft.data.formats import messages_conversation
from sft.data.tokenization import tokenize_examples
from sft.data.tool_calls import tools_section
from sft.errors import DataError

# Quoted from DeepSeek-V3.1's model card: https://huggingface.co/deepseek-ai/DeepSeek-V3.1, README.md, section
# "ToolCall", as revised by its commit "Fix tool call description" (the first revision wrote
# `{system prompt}{tool_description}` and `{{additional_tool_calls}}`). Stored copies of the revised text: the
# repository yuy4o/llm, get_model_template/gen_template.py (quoting the same card of
# https://huggingface.co/deepseek-ai/DeepSeek-V3.1-Base); of the first: akash-network/awesome-akash,
# DeepSeek-V3.1/README.md.
CARD_FORMAT = r"<｜begin▁of▁sentence｜>{system prompt}\n\n{tool_description}<｜User｜>{query}<｜Assistant｜></think>"
CARD_TOOL_DESCRIPTION = """## Tools
You have access to the following tools:

### {tool_name1}
Description: {description}

Parameters: {json.dumps(parameters)}

IMPORTANT: ALWAYS adhere to this exact format for tool use:
<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>{additional_tool_calls}<｜tool▁calls▁end｜>

Where:
- `tool_call_name` must be an exact match to one of the available tools
- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema
- For multiple tool calls, chain them directly without separators or spaces"""

WEATHER = {"name": "get_weather", "description": "Weather in a city, now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. 東京"}},
                          "required": ["city"]}}
CLOCK = {"name": "clock", "description": "Die Uhrzeit — jetzt", "parameters": {"type": "object", "properties": {}}}
# As clients send them: OpenAI form, and a bare (glaive) function, which the reader and the saved template wrap.
TOOLS = [{"type": "function", "function": WEATHER}, CLOCK]


def card_description(*functions: dict) -> str:
    """The card's tool_description for these functions: its `### {tool_name1}` block (up to the blank line before
    `IMPORTANT:`) once per tool, the placeholders filled in as the card says."""
    head, rest = CARD_TOOL_DESCRIPTION.split("### {tool_name1}")
    block, tail = ("### {tool_name1}" + rest).split("IMPORTANT:")
    blocks = "".join(block.replace("{tool_name1}", f["name"]).replace("{description}", f["description"])
                     .replace("{json.dumps(parameters)}", json.dumps(f["parameters"])) for f in functions)
    return head + blocks + "IMPORTANT:" + tail


def card_prompt(system: str, tool_description: str, query: str) -> str:
    return (CARD_FORMAT.replace(r"\n", "\n").replace("{system prompt}", system)
            .replace("{tool_description}", tool_description).replace("{query}", query))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from sft.model.tiny import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model())


def read(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation as training renders it (sft/data/formats.py's OpenAI reader; a stand-in reply is read along
    where it ends with a question, since the reader drops trailing turns without a reply)."""
    record = {"tools": tools, "messages": messages + [{"role": "assistant", "content": "stand-in"}]}
    return messages_conversation(record, "test")["messages"][:-1]


def test_one_tool_is_the_model_card_text_byte_for_byte(tokenizer):
    template = get_template("deepseek_v31", tokenizer)
    messages = [{"role": "system", "content": "You are a helpful assistant"}, {"role": "user", "content": "Oslo?"}]
    prompt = template.text(read(messages, [TOOLS[0]]), add_generation_prompt=True)
    filled = (CARD_TOOL_DESCRIPTION.replace("{tool_name1}", "get_weather")
              .replace("{description}", "Weather in a city, now")
              .replace("{json.dumps(parameters)}", json.dumps(WEATHER["parameters"])))
    assert prompt == card_prompt("You are a helpful assistant", filled, "Oslo?")
    assert prompt.startswith(tokenizer.bos_token + "You are a helpful assistant\n\n## Tools\n")
    assert "\\u6771\\u4eac" in prompt  # json.dumps: non-ASCII escaped, as the card's json.dumps(parameters) writes it


@pytest.mark.parametrize("system", ["Be brief.", ""], ids=["system", "no_system"])
def test_train_render_and_saved_template_write_the_card_layout(tokenizer, system):
    """Two tools (one a bare function), with and without a system prompt: the card's layout (the system prompt, even
    empty, then a blank line and the description), in the training render, in the ids trained, and in the saved
    template given `tools=`, at every prompt."""
    template, own = get_template("deepseek_v31", tokenizer), tokenizer.chat_template
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "Time in 東京?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "clock", "arguments": "{}"}}]},
        {"role": "tool", "content": "09:00"}, {"role": "assistant", "content": "It is 09:00."}]
    expected = card_prompt(system, card_description(WEATHER, CLOCK), "Time in 東京?")
    assert template.text(read(messages[: len(messages) - 3], TOOLS), True) == expected
    tokenizer.chat_template = chat_template_for_saving("deepseek_v31", tokenizer)
    try:
        for n in range(1, len(messages) + 1):
            for prompt in (False, True):
                assert tokenizer.apply_chat_template(messages[:n], tools=TOOLS, tokenize=False,
                                                     add_generation_prompt=prompt) == \
                    template.text(read(messages[:n], TOOLS), prompt)
        row = tokenize_examples(read(messages, TOOLS), tokenizer=tokenizer, template=template, max_length=4096)[-1]
        assert tokenizer.apply_chat_template(messages, tools=TOOLS)["input_ids"] == row["input_ids"]
        assert tokenizer.decode(row["input_ids"]).startswith(expected.removesuffix("<｜Assistant｜></think>"))
    finally:
        tokenizer.chat_template = own


@pytest.mark.parametrize("name", ["deepseek_v3", "r1", "r1_0528"])
def test_other_templates_keep_the_tools_section(tokenizer, name):
    messages = read([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"}], TOOLS)
    text = get_template(name, tokenizer).text(messages, True)
    assert ("Be brief.\n\n" + tools_section([TOOLS[0], {"type": "function", "function": CLOCK}])) in text
    assert "You have access to the following tools:" not in text


def test_a_tool_without_a_name_is_refused(tokenizer):
    messages = read([{"role": "user", "content": "Oslo?"}], [{"type": "function", "function": {"parameters": {}}}])
    with pytest.raises(DataError, match="tool definition without a name"):
        get_template("deepseek_v31", tokenizer).text(messages, True)
