"""Tool calls render byte for byte as DeepSeek-V3's, R1-Distill's and DeepSeek-R1's own chat templates write them
(rendered by transformers' own Jinja renderer, tokenized by a copy of the real tokenizer), with only the assistant's
calls and answers trained.

`apply_chat_template` itself cannot render those templates' tool calls in transformers 5: it drops every None value
from the messages (transformers.utils.chat_template_utils._normalize_chat_messages), and the templates write calls
only where `message['content'] is none`. So the official text comes from `render_jinja_template`, the function
apply_chat_template calls after that step (test_apply_chat_template_cannot_render_official_tool_calls pins it).

The chat template that training saves (chat_template_for_saving) renders OpenAI-form conversations through
apply_chat_template itself, `tools=` included, exactly as training rendered them after sft/data/formats.py read them."""

from __future__ import annotations

import json

import pytest

from conftest import DEEPSEEK_TOKENIZER, needs_shared
from sft.data.formats import DataError, messages_conversation
from sft.data.chat_templates import chat_template_for_saving, get_template
from sft.data.tokenization import IGNORE, tokenize_examples, tokenize_one
from sft.data.tool_calls import TOOLS_ROLE, tool_definitions, tools_section
from test_formats import OPENAI_TOOLS, WEATHER
from test_reasoning import R1, runs
from test_templates import DEEPSEEK_V3, R1_DISTILL, trained_runs

pytestmark = needs_shared

# Cities in CJK: decoding the deepseek-coder vocabulary's added tokens for some Latin letters (ü: id 32009) gives
# U+FFFD, which would blur the decoded-text checks below.
SPECIAL = ["<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
           "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
           "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]  # single tokens in the V3/R1 vocabularies
EOS = "<｜end▁of▁sentence｜>"


def call(name: str, arguments: str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def conversation(record: dict) -> list[dict]:
    return messages_conversation(record, "test")["messages"]


# One call, then the answer (glaive's usual shape), with tool definitions and a system prompt.
SINGLE = conversation({"system": "Be brief.", "tools": OPENAI_TOOLS["tools"], "messages": [
    {"role": "user", "content": "Weather in 東京?"},
    {"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"city": "東京"}')]},
    {"role": "tool", "content": "21°C"}, {"role": "assistant", "content": "21°C in 東京."}]})
# Two parallel calls, an answer, a follow-up question with a call of its own, a call straight after results
# (three calls in one turn), and the answer: every branch of the official template's state.
ROUNDS = conversation({"tools": OPENAI_TOOLS["tools"], "messages": [
    {"role": "user", "content": "東京 and Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", '{"city": "東京"}'),
                                                        call("get_weather", '{"city": "Oslo"}')]},
    {"role": "tool", "content": "21°C"}, {"role": "tool", "content": "3°C"},
    {"role": "assistant", "content": "東京 21°C, Oslo 3°C."}, {"role": "user", "content": "And Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"city": "Rome"}')]},
    {"role": "tool", "content": "25°C"},
    {"role": "assistant", "content": None, "tool_calls": [call("f", "{}"), call("g", "{}"), call("h", "{}")]},
    {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "Rome 25°C."}]})


def official(messages: list[dict]) -> list[dict]:
    """What DeepSeek's template is given: calls without text as text None (text beside calls as given, which only
    R1's template writes); since it writes no `tools`, our tools section as part of the (last) system prompt, where
    we put it."""
    out = [{**m, "content": m["content"] or None} if m.get("tool_calls") else dict(m)
           for m in messages if m["role"] != TOOLS_ROLE]
    section = tools_section(tool_definitions(messages))
    systems = [m for m in out if m["role"] == "system"]
    if systems and section:
        systems[-1]["content"] += "\n\n" + section
    elif section:
        out.insert(0, {"role": "system", "content": section})
    return out


def official_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False, text: bool = False):
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[official(messages)], chat_template=tokenizer.chat_template,
                                        add_generation_prompt=add_generation_prompt, **tokenizer.special_tokens_map)
    return rendered[0] if text else tokenizer(rendered[0], add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def tokenizers():
    from transformers import AutoTokenizer

    out = {}
    for name, template in (("deepseek_v3", DEEPSEEK_V3), ("r1_distill", R1_DISTILL), ("r1", R1)):
        tok = AutoTokenizer.from_pretrained(DEEPSEEK_TOKENIZER)
        tok.add_special_tokens({"additional_special_tokens": SPECIAL})
        tok.eos_token = EOS
        tok.chat_template = template
        out[name] = tok
    return out


@pytest.mark.parametrize("name", ["deepseek_v3", "r1_distill"])
@pytest.mark.parametrize("messages", [SINGLE, ROUNDS], ids=["single", "rounds"])
def test_tool_conversations_equal_the_official_template(tokenizers, name, messages):
    tokenizer = tokenizers[name]
    template = get_template(name, tokenizer)
    row = tokenize_one(messages, tokenizer=tokenizer, template=template, max_length=4096)
    assert row["input_ids"] == official_ids(tokenizer, messages)
    for n in range(1, len(messages)):  # the generation prompt after a question and after tool results
        if messages[n - 1]["role"] in ("user", "tool"):
            assert template.text(messages[:n], add_generation_prompt=True) == official_ids(
                tokenizer, messages[:n], add_generation_prompt=True, text=True)
    # Untrained: the system prompt with the tools, the questions and every tool result.
    untrained = tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label == IGNORE])
    assert tools_section(tool_definitions(messages)) in untrained
    assert all(m["content"] in untrained for m in messages if m["role"] in ("user", "tool"))


def test_official_templates_drop_the_tools_argument(tokenizers):
    """Why the definitions go into the system prompt: apply_chat_template(tools=...) writes nothing of them."""
    plain = [{"role": "user", "content": "Weather in 東京?"}, {"role": "assistant", "content": "Sunny."}]
    for tokenizer in tokenizers.values():
        assert tokenizer.apply_chat_template(plain, tools=OPENAI_TOOLS["tools"], tokenize=False) == \
            tokenizer.apply_chat_template(plain, tokenize=False)


def test_apply_chat_template_cannot_render_official_tool_calls(tokenizers):
    from jinja2.exceptions import UndefinedError

    with pytest.raises(UndefinedError, match="no attribute 'content'"):
        tokenizers["deepseek_v3"].apply_chat_template(official(SINGLE), tokenize=False)


def test_trained_tokens_are_the_calls_and_answers_as_the_template_writes_them(tokenizers):
    tokenizer = tokenizers["deepseek_v3"]
    runs = lambda messages: trained_runs(tokenize_one(messages, tokenizer=tokenizer, max_length=4096,  # noqa: E731
                                                      template=get_template("deepseek_v3", tokenizer)), tokenizer)
    weather = "function<｜tool▁sep｜>get_weather\n```json\n{{\"city\": \"{}\"}}\n```<｜tool▁call▁end｜>"
    # The first call of a conversation opens the block; with a single call, the template writes no end marker.
    assert runs(SINGLE) == ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>" + weather.format("東京"),
                            "21°C in 東京." + EOS]
    # Every later call is "\n" + call + `<｜tool▁calls▁end｜><｜end▁of▁sentence｜>`, even in a later turn.
    later = "\n<｜tool▁call▁begin｜>{}<｜tool▁calls▁end｜>" + EOS
    plain = "function<｜tool▁sep｜>{}\n```json\n{{}}\n```<｜tool▁call▁end｜>"
    assert runs(ROUNDS) == [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>" + weather.format("東京") + later.format(weather.format("Oslo")),
        "東京 21°C, Oslo 3°C." + EOS, later.format(weather.format("Rome")),
        "".join(later.format(plain.format(f)) for f in "fgh"), "Rome 25°C." + EOS]


# ------------------------------------------------------------------------------------- reasoning with tool calls

THINK = "<think>\n"
# Reasoning in answers right after tool results (the R1 templates show those as given in later turns) and in answers
# after a question (they show those without it): one example per answer of the second kind but the last turn.
REASONING = {
    # Only after tool results: no split, the whole conversation as the official template writes it.
    "after_results": conversation({"system": "Be brief.", "tools": OPENAI_TOOLS["tools"], "messages": [
        {"role": "user", "content": "Weather in 東京?"},
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"city": "東京"}')]},
        {"role": "tool", "content": "21°C"},
        {"role": "assistant", "content": "<think>\nMild.\n</think>\n\n21°C in 東京."},
        {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "Bye."}]}),
    # A reasoned answer, then calls (first of the conversation), a reasoned answer after results, a reasoned answer
    # to a question, a later call and a call straight after results, and a plain answer.
    "mixed": conversation({"tools": OPENAI_TOOLS["tools"], "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nGreet.\n</think>\n\nHello!"},
        {"role": "user", "content": "東京 and Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", '{"city": "東京"}'),
                                                            call("get_weather", '{"city": "Oslo"}')]},
        {"role": "tool", "content": "21°C"}, {"role": "tool", "content": "3°C"},
        {"role": "assistant", "content": "<think>\nBoth known.\n</think>\n\n東京 21°C, Oslo 3°C."},
        {"role": "user", "content": "Warmer?"},
        {"role": "assistant", "content": "<think>\n21 > 3.\n</think>\n\n東京."},
        {"role": "user", "content": "And Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"city": "Rome"}')]},
        {"role": "tool", "content": "25°C"},
        {"role": "assistant", "content": None, "tool_calls": [call("f", "{}")]},
        {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "Rome 25°C."}]}),
    # Reasoning without a think block opening the answer, and the conversation ending on a reasoned answer.
    "ends_reasoning": conversation({"system": "S", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "Plan</think>\n\nfirst"},
        {"role": "user", "content": "Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"city": "Rome"}')]},
        {"role": "tool", "content": "25°C"}, {"role": "user", "content": "So?"},
        {"role": "assistant", "content": "<think>\nWarm.\n</think>\n\nWarm."}]}),
}


def expected_turns(tokenizer, messages: list[dict]) -> list[tuple[list[int], str]]:
    """Each assistant turn's context (ids) and trained text, from the official Jinja rendered directly: an answer
    follows the generation prompt the template writes after the conversation up to it (`<think>\\n` there is
    context when the answer opens with it); a call follows the template's text up to it, as it writes calls (and
    `<think>\\n` there is context too where the text beside R1's first call opens with it)."""
    out = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if m.get("tool_calls"):
            plain, full = (official_ids(tokenizer, messages[:n], text=True) for n in (k, k + 1))
            context = plain + "<｜Assistant｜>" if full.startswith(plain + "<｜Assistant｜>") else \
                plain if full.startswith(plain) else plain.removesuffix("<｜tool▁outputs▁end｜>")
            if context.endswith("<｜Assistant｜>") and full[len(context):].startswith(THINK):
                context += THINK  # R1 writes the text beside a first call (its reasoning) where the prompt opens it
            target = full[len(context):]
        else:
            context = official_ids(tokenizer, messages[:k], add_generation_prompt=True, text=True)
            if not m["content"].startswith(THINK):
                context = context.removesuffix(THINK)
            target = m["content"].removeprefix(THINK) if context.endswith(THINK) else m["content"]
            target += EOS
        out.append((tokenizer(context, add_special_tokens=False)["input_ids"], target))
    return out


@pytest.mark.parametrize("name", ["r1", "r1_distill"])
@pytest.mark.parametrize("key", list(REASONING))
def test_r1_tool_turns_train_once_after_the_official_context(tokenizers, name, key):
    """Every call and answer is trained exactly once, after the tokens the official template gives the model for
    that turn (earlier reasoning deleted except right after tool results); one example per answer whose reasoning
    later turns do not see, the last turn's aside. Each against its own official template."""
    tokenizer, messages = tokenizers[name], REASONING[key]
    rows = tokenize_examples(messages, tokenizer=tokenizer, template=get_template(name, tokenizer), max_length=4096)
    seen = [(row["input_ids"][:start], tokenizer.decode(row["input_ids"][start:end]))
            for row in rows for start, end in runs(row)]
    assert seen == expected_turns(tokenizer, messages)
    hidden = [k for k, m in enumerate(messages[:-1]) if m["role"] == "assistant" and "</think>" in m["content"]
              and messages[k - 1]["role"] != "tool"]
    assert len(rows) == len(hidden) + 1
    if not hidden:  # as before: one example, the official conversation token for token
        assert rows[0]["input_ids"] == official_ids(tokenizer, messages)


def with_text(messages: list[dict], texts: dict[int, str]) -> list[dict]:
    """Text beside calls, set by hand: the reader refuses it (sft/data/formats.py), but R1's own template writes it."""
    return [{**m, "content": texts[k]} if k in texts else m for k, m in enumerate(messages)]


# Where DeepSeek-R1's own template writes tool conversations otherwise than V3's and the distills': a turn's calls
# end once (a single call too), results follow each other without a newline, a later round opens no
# `<｜tool▁outputs▁begin｜>`, and the text beside the conversation's first call is written (a later call's dropped).
R1_TOOL_CONVERSATIONS = {
    "single_call": SINGLE,
    "calls_in_one_turn": conversation({"system": "Be brief.", "tools": OPENAI_TOOLS["tools"], "messages": [
        {"role": "user", "content": "東京, Oslo and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", f'{{"city": "{city}"}}')
                                                              for city in ("東京", "Oslo", "Rome")]},
        {"role": "tool", "content": "21°C"}, {"role": "tool", "content": "3°C"}, {"role": "tool", "content": "25°C"},
        {"role": "assistant", "content": "Rome."}]}),
    "rounds": ROUNDS,
    # Reasoning beside the first call (after the generation prompt's `<think>\n`), and beside a later one.
    "text_beside_calls": with_text(ROUNDS, {2: "<think>\nLook both up.\n</think>\n\n", 7: "<think>\nRome.\n</think>"}),
    "text_beside_calls_no_think": with_text(SINGLE, {3: "Checking. "}),
    "reasoning_in_answers": REASONING["mixed"],
}


@pytest.mark.parametrize("key", list(R1_TOOL_CONVERSATIONS))
def test_r1_tool_conversations_equal_the_official_r1_template(tokenizers, key):
    """`r1` writes DeepSeek-R1's own layout (not the distills'): the conversation token for token (its last
    example: earlier reasoning deleted as the official template deletes it), every generation prompt after a
    question or tool results, and each call and answer trained once after the official context for it."""
    tokenizer, messages = tokenizers["r1"], R1_TOOL_CONVERSATIONS[key]
    template = get_template("r1", tokenizer)
    rows = tokenize_examples(messages, tokenizer=tokenizer, template=template, max_length=4096)
    assert rows[-1]["input_ids"] == official_ids(tokenizer, messages)
    for n in range(1, len(messages)):
        if messages[n - 1]["role"] in ("user", "tool"):
            assert template.text(messages[:n], add_generation_prompt=True) == official_ids(
                tokenizer, messages[:n], add_generation_prompt=True, text=True)
    seen = [(row["input_ids"][:start], tokenizer.decode(row["input_ids"][start:end]))
            for row in rows for start, end in runs(row)]
    assert seen == expected_turns(tokenizer, messages)
    untrained = tokenizer.decode([t for t, label in zip(rows[-1]["input_ids"], rows[-1]["labels"]) if label == IGNORE])
    assert tools_section(tool_definitions(messages)) in untrained
    assert all(m["content"] in untrained for m in messages if m["role"] in ("user", "tool"))


def test_r1_calls_and_results_are_written_as_the_official_r1_template_writes_them(tokenizers):
    """The trained runs show R1's layout itself: every turn's calls end once with `<｜tool▁calls▁end｜>` + EOS, a
    later turn's calls open with "\\n" alone, and the reasoning beside the first call is trained (after `<think>\\n`),
    that beside a later call is not written at all."""
    tokenizer = tokenizers["r1"]
    rows = tokenize_examples(R1_TOOL_CONVERSATIONS["text_beside_calls"], tokenizer=tokenizer, max_length=4096,
                             template=get_template("r1", tokenizer))
    weather = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{{\"city\": \"{}\"}}\n```<｜tool▁call▁end｜>"
    plain = "\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{{}}\n```<｜tool▁call▁end｜>"
    end = "<｜tool▁calls▁end｜>" + EOS
    assert len(rows) == 1 and trained_runs(rows[0], tokenizer) == [
        "Look both up.\n</think>\n\n<｜tool▁calls▁begin｜>" + weather.format("東京") + "\n" + weather.format("Oslo")
        + end, "東京 21°C, Oslo 3°C." + EOS, "\n" + weather.format("Rome") + end,
        "".join(plain.format(f) for f in "fgh") + end, "Rome 25°C." + EOS]
    assert "Rome.\n</think>" not in tokenizer.decode(rows[0]["input_ids"])
    assert "<｜tool▁output▁end｜><｜tool▁output▁begin｜>" in tokenizer.decode(rows[0]["input_ids"])


def test_r1_answer_after_results_keeps_its_reasoning_in_later_turns(tokenizers):
    """The official template writes an answer right after tool results as given: a prompt after it shows the
    reasoning, which the model wrote itself (no generation prompt after results), so `<think>` is trained."""
    tokenizer = tokenizers["r1_distill"]
    template = get_template("r1_distill", tokenizer)
    messages = REASONING["after_results"]
    n = next(k for k, m in enumerate(messages) if m["content"] == "Thanks.") + 1
    prompt = template.text(messages[:n], add_generation_prompt=True)
    assert prompt == official_ids(tokenizer, messages[:n], add_generation_prompt=True, text=True)
    assert "<｜tool▁outputs▁end｜><think>\nMild.\n</think>" in prompt
    runs_ = trained_runs(tokenize_examples(messages, tokenizer=tokenizer, template=template, max_length=4096)[0],
                         tokenizer)
    assert runs_[1] == messages[n - 2]["content"] + EOS and runs_[2] == "Bye." + EOS


def test_r1_without_reasoning_still_trains_answers_only_with_tools(tokenizers):
    tokenizer = tokenizers["r1_distill"]
    messages = REASONING["mixed"]
    rows = tokenize_examples(messages, tokenizer=tokenizer, max_length=4096,
                             template=get_template("r1_distill_no_reasoning", tokenizer))
    answers = [trained for trained in trained_runs(rows[0], tokenizer) if trained.endswith(EOS)
               and "<｜tool▁call" not in trained]
    assert len(rows) == 1 and answers == ["Hello!" + EOS, "東京 21°C, Oslo 3°C." + EOS, "東京." + EOS,
                                          "Rome 25°C." + EOS]


def test_model_template_gets_the_calls_and_tools_and_trains_the_same(tokenizers):
    """--template model hands calls and tool definitions to the tokenizer's own template. The official one, made to
    test for missing text instead of None (see the module docstring), trains a round of calls as our built-in does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEEPSEEK_TOKENIZER)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.eos_token = EOS
    tokenizer.chat_template = DEEPSEEK_V3.replace("message['content'] is none", "message['content'] is not defined") \
        .replace("message['content'] is not none", "message['content'] is defined")
    without_tools = [m for m in SINGLE if m["role"] != TOOLS_ROLE]  # the official template would drop them
    ours = tokenize_one(without_tools, tokenizer=tokenizer, template=get_template("deepseek_v3", tokenizer),
                        max_length=4096)
    model = tokenize_one(SINGLE, tokenizer=tokenizer, template=get_template("model", tokenizer), max_length=4096)
    assert (model["input_ids"], model["labels"]) == (ours["input_ids"], ours["labels"])


@pytest.mark.parametrize("name", ["deepseek", "deepseek_coder", "alpaca"])
def test_templates_without_a_tool_format_refuse_tool_conversations(tokenizers, name):
    with pytest.raises(DataError, match=f"--template {name} has no tool-call format; .* --template deepseek_v3, "
                                        "r1, r1_distill, r1_distill_no_reasoning"):
        tokenize_one(SINGLE, tokenizer=tokenizers["deepseek_v3"], template=get_template(name, tokenizers["deepseek_v3"]),
                     max_length=4096)


def test_tool_conversations_go_through_the_arrow_dataset_with_plain_ones(tokenizers, tmp_path):
    """The tokenizing step moves messages through an Arrow table (missing keys come back as None)."""
    from sft.options.arguments import DataArguments
    from sft.data.dataset import tokenize

    tokenizer = tokenizers["deepseek_v3"]
    template = get_template("deepseek_v3", tokenizer)
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    conversations = [{"messages": m, "source": "test"} for m in (plain, SINGLE, ROUNDS)]
    rows = tokenize(conversations, DataArguments(dataset=["x"], max_length=4096, num_proc=1), tokenizer, template)
    for row, c in zip(rows, conversations):
        one = tokenize_one(c["messages"], tokenizer=tokenizer, template=template, max_length=4096)
        assert (row["input_ids"], row["labels"]) == (one["input_ids"], one["labels"])
    assert json.loads(SINGLE[0]["content"])[0]["function"]["name"] == "get_weather"


# --------------------------------------------------------------------------------- the chat template training saves

TOOL_BUILTINS = ["deepseek_v3", "r1", "r1_distill", "r1_distill_no_reasoning"]


def openai_call(name: str, arguments: str | dict, n: int) -> dict:
    return {"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": arguments}}


# OpenAI-form conversations as a user sends them to apply_chat_template: calls with content None (transformers drops
# the key), call ids, arguments as JSON text or as an object, reasoning in an earlier answer (the R1 family).
USER_CONVERSATIONS = {
    "single_call": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in 東京?"},
        {"role": "assistant", "content": None, "tool_calls": [openai_call("get_weather", '{"city": "東京"}', 1)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21°C"},
        {"role": "assistant", "content": "21°C in 東京."}],
    "calls_in_one_turn": [
        {"role": "user", "content": "東京 and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [openai_call("get_weather", {"city": "東京"}, 1),
                                                              openai_call("get_weather", '{"city":"Oslo"}', 2)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21°C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "3°C"},
        {"role": "assistant", "content": "<think>\nBoth known.\n</think>\n\n東京 21°C, Oslo 3°C."}],
    # Calls in two turns, a call straight after results, and the conversation ending on tool results.
    "calls_in_two_turns": [
        {"role": "system", "content": "First."}, {"role": "system", "content": "Second."},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [openai_call("get_weather", '{"city": "Rome"}', 1)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "25°C"},
        {"role": "assistant", "content": "<think>\nWarm.\n</think>\n\nRome 25°C."},
        {"role": "user", "content": "And Oslo, then Bergen?"},
        {"role": "assistant", "content": None, "tool_calls": [openai_call("get_weather", {"city": "Oslo"}, 2)]},
        {"role": "tool", "tool_call_id": "call_2", "content": "3°C"},
        {"role": "assistant", "content": None, "tool_calls": [openai_call("get_weather", {}, 3),
                                                              openai_call("get_weather", '{"city": "Bergen"}', 4)]},
        {"role": "tool", "tool_call_id": "call_3", "content": "?"},
        {"role": "tool", "tool_call_id": "call_4", "content": "5°C"}],
    # A reasoned answer to a question before calls, and one right after results: the R1 templates show the first
    # without its reasoning in later prompts, the second as given.
    "reasoning_and_calls": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nGreet.\n</think>\n\nHello!"},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [openai_call("get_weather", {"city": "Rome"}, 1)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "25°C"},
        {"role": "assistant", "content": "<think>\nWarm.\n</think>\n\nRome 25°C."},
        {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "Bye."}],
    # As OpenAI clients also send them: a `developer` text (a system text), content as a list of text parts (none
    # beside the calls), read as sft/data/formats.py reads them.
    "developer_and_text_parts": [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Rome?"}]},
        {"role": "assistant", "content": [], "tool_calls": [openai_call("get_weather", {"city": "Rome"}, 1)]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "25°C"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "<think>\nWarm.\n</think>\n\nRome 25°C."}]},
        {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "Bye."}],
    # Tool definitions and no call: still the tool layout, as in training (earlier reasoning deleted for R1).
    "no_call": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nGreet.\n</think>\n\nHello!"},
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Which city?"}],
}


def as_trained(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation as training renders it: read by sft/data/formats.py's OpenAI reader. The reader drops trailing
    turns without a reply (a training record ends with one), so a stand-in reply is read along and removed."""
    record = {"tools": tools, "messages": messages + [{"role": "assistant", "content": "stand-in"}]}
    return messages_conversation(record, "test")["messages"][:-1]


@pytest.fixture(scope="module")
def saving_tokenizer():
    """The real tokenizer with the V3/R1 special tokens; each test stores the built-in's Jinja on it, as training
    does before saving."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEEPSEEK_TOKENIZER)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.eos_token = EOS
    return tokenizer


@pytest.mark.parametrize("name", TOOL_BUILTINS)
@pytest.mark.parametrize("with_definitions", [True, False], ids=["tools", "no_tools"])
@pytest.mark.parametrize("key", list(USER_CONVERSATIONS))
def test_saved_template_renders_tool_conversations_as_training(saving_tokenizer, name, with_definitions, key):
    tokenizer = saving_tokenizer
    template = get_template(name, tokenizer)
    tokenizer.chat_template = chat_template_for_saving(name, tokenizer)
    messages, tools = USER_CONVERSATIONS[key], OPENAI_TOOLS["tools"] if with_definitions else None
    for n in range(1, len(messages) + 1):  # every prefix: after a question, a call, results, an answer
        trained = as_trained(messages[:n], tools)
        for prompt in (False, True):
            assert tokenizer.apply_chat_template(messages[:n], tools=tools, tokenize=False,
                                                 add_generation_prompt=prompt) == template.text(trained, prompt)
    # The ids too: those of the example that ends the conversation (R1 makes one per reasoning turn without tools).
    row = tokenize_examples(as_trained(messages, tools), tokenizer=tokenizer, template=template, max_length=4096)[-1]
    assert tokenizer.apply_chat_template(messages, tools=tools)["input_ids"] == row["input_ids"]


@pytest.mark.parametrize("name", ["r1", "r1_distill"])
@pytest.mark.parametrize("key", list(USER_CONVERSATIONS))
def test_saved_r1_template_prompts_tool_conversations_as_the_official_one(tokenizers, saving_tokenizer, name, key):
    """At inference the saved Jinja writes every prompt (after a question or tool results) as its own official one
    does (R1's layout for r1, the distills' for r1_distill), earlier reasoning deleted or kept where it does."""
    messages, tools = USER_CONVERSATIONS[key], OPENAI_TOOLS["tools"]
    saving_tokenizer.chat_template = chat_template_for_saving(name, saving_tokenizer)
    for n in range(1, len(messages) + 1):
        if messages[n - 1]["role"] in ("user", "tool"):
            assert saving_tokenizer.apply_chat_template(messages[:n], tools=tools, tokenize=False,
                                                        add_generation_prompt=True) == official_ids(
                tokenizers[name], as_trained(messages[:n], tools), add_generation_prompt=True, text=True)


@pytest.mark.parametrize("name, between", [("r1_distill", "\n"), ("r1", "")])
def test_saved_template_writes_tools_and_calls_as_the_training_layout(saving_tokenizer, name, between):
    """What the test above compares is the tool layout itself: the tools section, each call, the results block
    (R1 writes results back to back, the distills a newline between them)."""
    tokenizer = saving_tokenizer
    tokenizer.chat_template = chat_template_for_saving(name, tokenizer)
    text = tokenizer.apply_chat_template(USER_CONVERSATIONS["calls_in_one_turn"][:4], tools=OPENAI_TOOLS["tools"],
                                         tokenize=False, add_generation_prompt=True)
    assert text == (tokenizer.bos_token + tools_section(OPENAI_TOOLS["tools"]) + "<｜User｜>東京 and Oslo?"
                    "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                    "```json\n{\"city\": \"東京\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                    "get_weather\n```json\n{\"city\":\"Oslo\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>" + EOS +
                    "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>21°C<｜tool▁output▁end｜>" + between +
                    "<｜tool▁output▁begin｜>3°C<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")


def test_saved_template_wraps_bare_functions_as_the_reader_does(saving_tokenizer):
    """glaive-style definitions ({"name", "parameters"}) given to `tools=`: wrapped into OpenAI's form, as training
    data's are (sft/data/formats.py)."""
    tokenizer = saving_tokenizer
    tokenizer.chat_template = chat_template_for_saving("deepseek_v3", tokenizer)
    messages = USER_CONVERSATIONS["single_call"]
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER], tokenize=False)
    assert text == get_template("deepseek_v3", tokenizer).text(as_trained(messages, [WEATHER]))
    assert tools_section(OPENAI_TOOLS["tools"]) in text


@pytest.mark.parametrize("name", ["deepseek_v3", "r1_distill"])
def test_text_beside_calls_stops_the_templates_that_drop_the_calls(saving_tokenizer, name):
    """DeepSeek-V3's and the distills' templates write a turn with text as an answer and drop its calls: training
    stops on such a record (naming it and what to do), and the saved template refuses it too."""
    from jinja2.exceptions import TemplateError

    tokenizer = saving_tokenizer
    tokenizer.chat_template = chat_template_for_saving(name, tokenizer)
    messages = [{"role": "user", "content": "Rome?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [openai_call("get_weather", {}, 1)]},
                {"role": "tool", "content": "25°C"}, {"role": "assistant", "content": "25°C."}]
    with pytest.raises(DataError, match=r"both text and tool_calls.*--template r1"):
        tokenize_examples(as_trained(messages, None), tokenizer=tokenizer, max_length=4096,
                          template=get_template(name, tokenizer))
    with pytest.raises(TemplateError, match="both text and tool_calls"):
        tokenizer.apply_chat_template(messages, tokenize=False)


def test_r1_data_that_reasons_before_calling_trains_as_the_official_template_writes_it(tokenizers):
    """Read from an OpenAI record (the reader keeps text beside calls), R1's reasoning before its first call is
    trained, token for token the official template's conversation; a later call's text, which R1's template drops,
    is counted in the data summary (R1.note)."""
    tokenizer = tokenizers["r1"]
    messages = conversation({"tools": OPENAI_TOOLS["tools"], "messages": [
        {"role": "user", "content": "Weather in 東京?"},
        {"role": "assistant", "content": "<think>\nLook it up.\n</think>\n\n",
         "tool_calls": [call("get_weather", '{"city": "東京"}')]},
        {"role": "tool", "content": "21°C"}, {"role": "assistant", "content": "21°C in 東京."}]})
    rows = tokenize_examples(messages, tokenizer=tokenizer, max_length=4096, template=get_template("r1", tokenizer))
    assert len(rows) == 1 and rows[0]["input_ids"] == official_ids(tokenizer, messages)
    assert trained_runs(rows[0], tokenizer)[0].startswith("Look it up.\n</think>\n\n<｜tool▁calls▁begin｜>")
    template = get_template("r1", tokenizer)
    assert template.note(messages) is None
    assert "text beside a later tool call" in template.note(R1_TOOL_CONVERSATIONS["text_beside_calls"])
