"""Tool conversations in the newer releases' own layouts, byte for byte against their official templates (quoted in
test_thinking_templates.py), rendered by transformers' own Jinja renderer and tokenized by the real tokenizer:

- R1-0528: every call turn writes its text (reasoning deleted in later turns) and opens its own
  `<｜tool▁calls▁begin｜>` (calls "\\n"-separated, ended once); its results open their own
  `<｜tool▁outputs▁begin｜>` and are closed by `<｜tool▁outputs▁end｜>` before the next reply (or at the end).
- V3.1: `<｜Assistant｜></think>` before a call turn after a question (it calls without thinking), the turn's text as
  given, calls without type or ```json fences and no separator, bare `<｜tool▁output▁begin｜>` results, and no
  generation prompt after results: the model writes on right after them.

Every call turn and answer is trained exactly once, after the tokens the official template gives the model for it;
the saved template renders what training rendered."""

from __future__ import annotations

import pytest

from conftest import needs_shared
from sft.data.chat_templates import chat_template_for_saving, get_template
from sft.data.thinking_templates import answer_only
from sft.data.tokenization import IGNORE, tokenize_examples
from sft.data.tool_calls import TOOLS_ROLE, tool_definitions, tools_section
from sft.data.v31_tools import v31_tools_section
from test_formats import OPENAI_TOOLS
from test_reasoning import runs, tokenizer_with
from test_templates import trained_runs
from test_thinking_templates import R1_0528, V3_1
from test_tool_calls import (REASONING, ROUNDS, SINGLE, SPECIAL, USER_CONVERSATIONS, as_trained, call, conversation,
                             official, with_text)

pytestmark = needs_shared
EOS = "<｜end▁of▁sentence｜>"
NAMES = ["r1_0528", "deepseek_v31"]


@pytest.fixture(scope="module")
def tokenizers():
    """Each release's official template on the real tokenizer, with the tool markers as single tokens."""
    out = {}
    for name, jinja in (("r1_0528", R1_0528), ("deepseek_v31", V3_1)):
        tokenizer = tokenizer_with(jinja)
        tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
        out[name] = tokenizer
    return out


@pytest.fixture(scope="module")
def saving_tokenizer():
    """The real tokenizer with the special tokens; each test stores the built-in's Jinja on it, as training does."""
    tokenizer = tokenizer_with(None)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    return tokenizer


def official_v31(messages: list[dict]) -> list[dict]:
    """What V3.1's template is given: as official() does, but with the tool description of V3.1's model card after
    the system prompt and a blank line (the card's `{system prompt}\\n\\n{tool_description}`, system prompt or not)."""
    out = official([m for m in messages if m["role"] != TOOLS_ROLE])
    section = v31_tools_section(tool_definitions(messages))
    systems = [m for m in out if m["role"] == "system"]
    if systems and section:
        systems[-1]["content"] += "\n\n" + section
    elif section:
        out.insert(0, {"role": "system", "content": "\n\n" + section})
    return out


def section_of(name: str, messages: list[dict]) -> str:
    """The text that shows the conversation's tools under the template `name`."""
    return (v31_tools_section if name == "deepseek_v31" else tools_section)(tool_definitions(messages))


def official_text(tokenizer, messages: list[dict], add_generation_prompt: bool = False, **kwargs) -> str:
    """The official template's text (render_jinja_template: apply_chat_template drops None contents), with calls'
    missing text as "" (R1-0528's template tests `'</think>' in content` on every reply, which fails on None) and
    the tools in the system prompt, where we put them (V3.1: its model card's tool description)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    shown = official_v31(messages) if tokenizer.chat_template == V3_1 else official(messages)
    given = [{**m, "content": m["content"] or ""} for m in shown]
    rendered, _ = render_jinja_template(conversations=[given], chat_template=tokenizer.chat_template,
                                        add_generation_prompt=add_generation_prompt, **kwargs,
                                        **tokenizer.special_tokens_map)
    return rendered[0]


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def before(messages: list[dict], k: int) -> str | None:
    """The role of the last question, reply or tool result before message k."""
    return next((m["role"] for m in reversed(messages[:k]) if m["role"] in ("user", "assistant", "tool")), None)


def expected_r1_0528(tokenizer, messages: list[dict]) -> list[tuple[list[int], str]]:
    """Each turn after the official generation prompt for it (`<｜Assistant｜>` with the question, or
    `<｜tool▁outputs▁end｜>`), its target all the model writes: its text as given, reasoning too, then what the
    official template writes after the text (the calls block, or EOS)."""
    out = []
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            context = official_text(tokenizer, messages[:k], add_generation_prompt=True)
            written = official_text(tokenizer, messages[:k] + [{**m, "content": ""}])
            assert written.startswith(context)
            out.append((ids(tokenizer, context), m["content"] + written[len(context):]))
    return out


def expected_v31(tokenizer, messages: list[dict]) -> list[tuple[list[int], str]]:
    """A call turn: the official text after the generation prompt (not thinking: `<｜Assistant｜></think>` after a
    question, nothing after results); an answer after results: as given; any other answer as
    test_thinking_templates says (thinking: after `<think>`, its reasoning and answer; else the answer alone)."""
    out = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        thinks = not m.get("tool_calls") and before(messages, k) == "user" and m.get("thinking", "</think>" in
                                                                                     m["content"])
        context = official_text(tokenizer, messages[:k], add_generation_prompt=True, thinking=thinks)
        if m.get("tool_calls"):
            target = official_text(tokenizer, messages[: k + 1])[len(context):]
        elif before(messages, k) == "tool":
            target = m["content"] + EOS
        else:
            target = (m["content"].removeprefix("<think>") if thinks else answer_only(m["content"])) + EOS
        out.append((ids(tokenizer, context), target))
    return out


EXPECTED = {"r1_0528": expected_r1_0528, "deepseek_v31": expected_v31}

# Thinking switched on and off for a whole V3.1 conversation with calls: a thinking reply to a question, calls after a
# question (written not thinking whatever the flag), an answer right after results (as given), a second round.
V31_THINKING = {
    flag: conversation({"thinking": flag, "tools": OPENAI_TOOLS["tools"], "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>Greet.</think>Hello!"},
        {"role": "user", "content": "Weather in 東京?"},
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"city": "東京"}')]},
        {"role": "tool", "content": "21°C"}, {"role": "assistant", "content": "21°C in 東京."},
        {"role": "user", "content": "And Oslo, then Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call("get_weather", '{"city": "Oslo"}')]},
        {"role": "tool", "content": "3°C"},
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"city": "Rome"}')]},
        {"role": "tool", "content": "25°C"},
        {"role": "assistant", "content": "<think>Compare.</think>Rome is warmer." if flag else "Rome is warmer."}]})
    for flag in (True, False)}

CONVERSATIONS = {
    "single": SINGLE,
    "rounds": ROUNDS,  # parallel calls, a second round, a call right after results
    "reasoning_in_answers": REASONING["mixed"],
    "ends_reasoning": REASONING["ends_reasoning"],
    # Text beside calls: R1-0528 writes it before each turn's calls (reasoning deleted in later turns), V3.1 as given.
    "text_beside_calls": with_text(ROUNDS, {2: "Both.", 9: "Three more."}),
    "v31_thinking": V31_THINKING[True],
    "v31_not_thinking": V31_THINKING[False],
}
R1_0528_ONLY = {"reasoning_beside_calls": with_text(ROUNDS, {2: "<think>\nLook both up.\n</think>\n\n",
                                                             7: "<think>Rome.</think>"})}


def cases(name: str) -> list[tuple[str, str]]:
    return [(name, key) for key in [*CONVERSATIONS, *(R1_0528_ONLY if name == "r1_0528" else ())]]


@pytest.mark.parametrize("name, key", cases("r1_0528") + cases("deepseek_v31"))
def test_tool_turns_train_once_after_the_official_context(tokenizers, name, key):
    """Every call turn and answer trained exactly once, after exactly the official context for it; the last
    example the official conversation token for token where the official template writes its last turn as the model
    did; the prompts after every question and every result as the official ones; the system prompt with the tools,
    questions and results untrained."""
    tokenizer, messages = tokenizers[name], {**CONVERSATIONS, **R1_0528_ONLY}[key]
    template = get_template(name, tokenizer)
    rows = tokenize_examples(messages, tokenizer=tokenizer, template=template, max_length=4096)
    seen = [(row["input_ids"][:s], tokenizer.decode(row["input_ids"][s:e])) for row in rows for s, e in runs(row)]
    assert seen == EXPECTED[name](tokenizer, messages)
    hidden = [k for k, m in enumerate(messages) if m["role"] == "assistant" and template.hides(m, before(messages, k)
                                                                                                == "tool")]
    assert len(rows) == len([k for k in hidden if k < len(messages) - 1]) + 1
    if max(k for k, m in enumerate(messages) if m["role"] == "assistant") not in hidden:  # written as the model did
        assert rows[-1]["input_ids"] == ids(tokenizer, official_text(tokenizer, messages))
    for n in range(1, len(messages)):
        if messages[n - 1]["role"] in ("user", "tool"):
            for thinking in ((False, True) if name == "deepseek_v31" else (False,)):
                assert template.text(messages[:n], True, **({"thinking": True} if thinking else {})) == \
                    official_text(tokenizer, messages[:n], add_generation_prompt=True, thinking=thinking)
    untrained = tokenizer.decode([t for t, label in zip(rows[-1]["input_ids"], rows[-1]["labels"]) if label == IGNORE])
    assert section_of(name, messages) in untrained
    assert all(m["content"] in untrained for m in messages if m["role"] in ("user", "tool"))


def v3_call(name: str, city: str | None = None) -> str:
    """A call as R1-0528 (and V3) writes it: its type, the name, the arguments in a ```json fence."""
    arguments = f'{{"city": "{city}"}}' if city else "{}"
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```<｜tool▁call▁end｜>"


def v31_call(name: str, city: str | None = None) -> str:
    """A call as V3.1 writes it: the name and the arguments, nothing else."""
    arguments = f'{{"city": "{city}"}}' if city else "{}"
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>"


def test_r1_0528_writes_each_turn_its_own_calls_and_results_blocks(tokenizers):
    tokenizer = tokenizers["r1_0528"]
    rows = tokenize_examples(R1_0528_ONLY["reasoning_beside_calls"], tokenizer=tokenizer, max_length=4096,
                             template=get_template("r1_0528", tokenizer))
    begin, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>" + EOS
    # Three examples: the call turns' reasoning is deleted in later turns, so each ends an example of its own.
    assert [trained_runs(row, tokenizer) for row in rows] == [
        ["<think>\nLook both up.\n</think>\n\n" + begin + v3_call("get_weather", "東京") + "\n"
         + v3_call("get_weather", "Oslo") + end],
        ["東京 21°C, Oslo 3°C." + EOS, "<think>Rome.</think>" + begin + v3_call("get_weather", "Rome") + end],
        [begin + "\n".join(v3_call(f) for f in "fgh") + end, "Rome 25°C." + EOS]]
    text = tokenizer.decode(rows[2]["input_ids"])
    assert "Look both up" not in text and "Rome.</think>" not in text
    assert text.count("<｜tool▁outputs▁begin｜>") == 3
    assert "<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>" in text
    assert "<｜tool▁output▁end｜><｜tool▁outputs▁end｜><｜tool▁calls▁begin｜>" in text  # results closed before calls


def test_v31_writes_its_own_call_layout(tokenizers):
    tokenizer = tokenizers["deepseek_v31"]
    rows = tokenize_examples(ROUNDS, tokenizer=tokenizer, max_length=4096,
                             template=get_template("deepseek_v31", tokenizer))
    begin, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>" + EOS
    assert len(rows) == 1 and trained_runs(rows[0], tokenizer) == [
        begin + v31_call("get_weather", "東京") + v31_call("get_weather", "Oslo") + end, "東京 21°C, Oslo 3°C." + EOS,
        begin + v31_call("get_weather", "Rome") + end, begin + "".join(v31_call(f) for f in "fgh") + end,
        "Rome 25°C." + EOS]
    text = tokenizer.decode(rows[0]["input_ids"])
    assert "<｜Assistant｜></think><｜tool▁calls▁begin｜>" in text and "outputs" not in text
    assert "<｜tool▁output▁end｜><｜tool▁output▁begin｜>" in text and "<｜tool▁output▁end｜><｜tool▁calls▁begin｜>" in text


def test_v31_refuses_reasoning_beside_calls_and_counts_thinking_calls(tokenizers):
    from jinja2.exceptions import TemplateError

    from sft.errors import DataError

    tokenizer = tokenizers["deepseek_v31"]
    template = get_template("deepseek_v31", tokenizer)
    messages = with_text(SINGLE, {3: "<think>Look it up.</think>"})
    with pytest.raises(DataError, match="reasoning .* beside its calls: DeepSeek-V3.1's template writes `</think>`"):
        tokenize_examples(messages, tokenizer=tokenizer, template=template, max_length=4096)
    saved = tokenizer_with(chat_template_for_saving("deepseek_v31", tokenizer))
    with pytest.raises(TemplateError, match="reasoning"):
        saved.apply_chat_template([m for m in messages if m["role"] != "tools"], tokenize=False)
    assert template.note(V31_THINKING[True]).startswith("tool calls marked thinking, written not thinking")
    assert template.note(V31_THINKING[False]) is None


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("with_definitions", [True, False], ids=["tools", "no_tools"])
@pytest.mark.parametrize("key", list(USER_CONVERSATIONS))
def test_saved_template_renders_tool_conversations_as_training(tokenizers, saving_tokenizer, name, with_definitions,
                                                                key):
    """apply_chat_template(messages, tools=...) on the saved template: every prefix, with and without a generation
    prompt, as training rendered it; the ids of the example that ends the conversation; and every prompt after a
    question or tool results as the official template's (V3.1: thinking on and off)."""
    tokenizer = saving_tokenizer
    tokenizer.chat_template = chat_template_for_saving(name, tokenizer)
    template = get_template(name, tokenizer)
    messages, tools = USER_CONVERSATIONS[key], OPENAI_TOOLS["tools"] if with_definitions else None
    modes = [{}, {"thinking": True}] if name == "deepseek_v31" else [{}]
    for n in range(1, len(messages) + 1):
        trained = as_trained(messages[:n], tools)
        for prompt in (False, True):
            for mode in modes:
                saved = tokenizer.apply_chat_template(messages[:n], tools=tools, tokenize=False,
                                                      add_generation_prompt=prompt, **mode)
                assert saved == template.text(trained, prompt, **mode)
                if prompt and messages[n - 1]["role"] in ("user", "tool"):
                    assert saved == official_text(tokenizers[name], trained, True, **mode)
    row = tokenize_examples(as_trained(messages, tools), tokenizer=tokenizer, template=template, max_length=4096)[-1]
    assert tokenizer.apply_chat_template(messages, tools=tools)["input_ids"] == row["input_ids"]
