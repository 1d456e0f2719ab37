"""The newer DeepSeek releases, byte-exact against their official chat templates: DeepSeek-R1-0528 (and
R1-0528-Qwen3-8B), whose generation prompt does not force `<think>\\n`, and DeepSeek-V3.1 with its `thinking` switch.
`--template auto` tells each from R1, the R1 distills and V3 by the tokenizer's own template; every reply is trained
exactly once, after the tokens the official template gives the model for it, and the trained tokens are exactly
what the model writes there."""

from __future__ import annotations

import pytest

from conftest import needs_shared
from test_reasoning import R1, R1_DISTILL_OLD, HELD_OUT, runs, tokenizer_with
from test_templates import DEEPSEEK_V3, R1_DISTILL

pytestmark = needs_shared

# deepseek-ai/DeepSeek-R1-0528-Qwen3-8B, tokenizer_config.json "chat_template", as quoted in xorbitsai/inference
# xinference/model/llm/models/deepseek-r1-0528-qwen3.json (commit 53a75cdde8f17acfbcb8b0a12219d925e0c2982e), its
# JSON `\n` escapes kept as Jinja's `\n` escapes (they render the same). DeepSeek-R1-0528's own template has the same
# layout (vllm-project/vllm examples/tool_chat_template_deepseekr1.jinja, commit 2ae850303adf, is it with a tools
# preamble added). The user turn writes `<｜Assistant｜>`; no `<think>\n` is forced; every reply loses its reasoning.
R1_0528 = (
    '{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = nam'
    "espace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true, is_last_user=f"
    "alse) %}{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}{% set ns.s"
    "ystem_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}{% set ns.sy"
    "stem_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}{{ bos_tok"
    "en }}{{ ns.system_prompt }}{%- for message in messages %}{% set content = message['content'] %}{%- if message["
    "'role'] == 'user' %}{%- set ns.is_tool = false -%}{%- set ns.is_first = false -%}{%- set ns.is_last_user = tru"
    "e -%}{{'<｜User｜>' + content + '<｜Assistant｜>'}}{%- endif %}{%- if message['role'] == 'assistant' %}{% if '</th"
    "ink>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}{% endif %}{%- if message['role"
    "'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] is not none %}{%- set ns.is_l"
    "ast_user = false -%}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{%- endif %}{%- set ns.is_first = false %}{%"
    "- set ns.is_tool = false -%}{%- set ns.is_output_first = true %}{%- for tool in message['tool_calls'] %}{%- if"
    " not ns.is_first %}{%- if content is none %}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜to"
    "ol▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' "
    "+ '<｜tool▁call▁end｜>'}}{%- else %}{{content + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜to"
    "ol▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' "
    "+ '<｜tool▁call▁end｜>'}}{%- endif %}{%- set ns.is_first = true -%}{%- else %}{{'\\n' + '<｜tool▁call▁begin｜>' + t"
    "ool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['argument"
    "s'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}"
    "{%- endif %}{%- if message['role'] == 'assistant' and (message['tool_calls'] is not defined or message['tool_c"
    "alls'] is none)%}{%- set ns.is_last_user = false -%}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + content + '"
    "<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{{content + '<｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_last_user = false -%}{%- set ns.is_tool = true -%"
    "}{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + content + '<｜tool▁output▁end｜>'"
    "}}{%- set ns.is_output_first = false %}{%- else %}{{'\\n<｜tool▁output▁begin｜>' + content + '<｜tool▁output▁end｜>"
    "'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_gen"
    "eration_prompt and not ns.is_last_user and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"
)

# deepseek-ai/DeepSeek-V3.1, tokenizer_config.json "chat_template", as ggml-org/llama.cpp keeps it verbatim in
# models/templates/deepseek-ai-DeepSeek-V3.1.jinja (commit 0374c5b6e4c19370262d93e2c3f2a98c9af9fe1f).
V3_1 = (
    '{% if not add_generation_prompt is defined -%}\n'
    '  {%- set add_generation_prompt = false -%}\n'
    '{%- endif -%}\n'
    '{%- if not thinking is defined -%}\n'
    '  {%- if enable_thinking is defined -%}\n'
    '    {%- set thinking = enable_thinking -%}\n'
    '    {%- else -%}\n'
    '    {%- set thinking = false -%}\n'
    '  {%- endif -%}\n'
    '{%- endif -%}\n'
    "{%- set ns = namespace(is_first=false, is_tool=false, system_prompt='', is_first_sp=true, is_last_user=false) -%}\n"
    '{%- for message in messages -%}\n'
    "  {%- if message['role'] == 'system' -%}\n"
    '    {%- if ns.is_first_sp -%}\n'
    "      {%- set ns.system_prompt = ns.system_prompt + message['content'] -%}\n"
    '      {%- set ns.is_first_sp = false -%}\n'
    '      {%- else -%}\n'
    "      {%- set ns.system_prompt = ns.system_prompt + '\n"
    '\n'
    "' + message['content'] -%}\n"
    '    {%- endif -%}\n'
    '  {%- endif -%}\n'
    '{%- endfor -%}{{ bos_token }}{{ ns.system_prompt }}\n'
    '{%- for message in messages -%}\n'
    "  {%- if message['role'] == 'user' -%}\n"
    '    {%- set ns.is_tool = false -%}\n'
    '    {%- set ns.is_first = false -%}\n'
    "    {%- set ns.is_last_user = true -%}{{'<｜User｜>' + message['content']}}\n"
    '  {%- endif -%}\n'
    "  {%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] is not none -%}\n"
    "    {%- if ns.is_last_user -%}{{'<｜Assistant｜></think>'}}\n"
    '    {%- endif -%}\n'
    '    {%- set ns.is_last_user = false -%}\n'
    '    {%- set ns.is_first = false -%}\n'
    '    {%- set ns.is_tool = false -%}\n'
    "    {%- for tool in message['tool_calls'] -%}\n"
    '      {%- if not ns.is_first -%}\n'
    "        {%- if message['content'] is none -%}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}\n"
    "          {%- else -%}{{message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}\n"
    '        {%- endif -%}\n'
    '        {%- set ns.is_first = true -%}\n'
    "        {%- else -%}{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}\n"
    '      {%- endif -%}\n'
    "    {%- endfor -%}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}\n"
    '  {%- endif -%}\n'
    "  {%- if message['role'] == 'assistant' and (message['tool_calls'] is not defined or message['tool_calls'] is none) -%}\n"
    "    {%- if ns.is_last_user -%}{{'<｜Assistant｜>'}}\n"
    "      {%- if message['prefix'] is defined and message['prefix'] and thinking -%}{{'<think>'}}\n"
    "        {%- else -%}{{'</think>'}}\n"
    '      {%- endif -%}\n'
    '    {%- endif -%}\n'
    '    {%- set ns.is_last_user = false -%}\n'
    "    {%- if ns.is_tool -%}{{message['content'] + '<｜end▁of▁sentence｜>'}}\n"
    '      {%- set ns.is_tool = false -%}\n'
    '      {%- else -%}\n'
    "      {%- set content = message['content'] -%}\n"
    "      {%- if '</think>' in content -%}\n"
    "        {%- set content = content.split('</think>', 1)[1] -%}\n"
    "      {%- endif -%}{{content + '<｜end▁of▁sentence｜>'}}\n"
    '    {%- endif -%}\n'
    '  {%- endif -%}\n'
    "  {%- if message['role'] == 'tool' -%}\n"
    '    {%- set ns.is_last_user = false -%}\n'
    "    {%- set ns.is_tool = true -%}{{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}\n"
    '  {%- endif -%}\n'
    '{%- endfor -%}\n'
    "{%- if add_generation_prompt and ns.is_last_user and not ns.is_tool -%}{{'<｜Assistant｜>'}}\n"
    "  {%- if not thinking -%}{{'</think>'}}\n"
    "    {%- else -%}{{'<think>'}}\n"
    '  {%- endif -%}\n'
    '{%- endif %}'
)

EOS = "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def official():
    return {name: tokenizer_with(jinja) for name, jinja in
            (("r1", R1), ("r1_distill", R1_DISTILL), ("r1_distill_old", R1_DISTILL_OLD), ("deepseek_v3", DEEPSEEK_V3),
             ("r1_0528", R1_0528), ("deepseek_v31", V3_1))}


def test_auto_tells_the_newer_releases_from_r1_the_distills_and_v3(official):
    from sft.data.chat_templates import matching_builtin

    assert {name: matching_builtin(tok) for name, tok in official.items()} == {
        "r1": "r1", "r1_distill": "r1_distill", "r1_distill_old": "r1_distill", "deepseek_v3": "deepseek_v3",
        "r1_0528": "r1_0528", "deepseek_v31": "deepseek_v31"}


def trained(tokenizer, name: str, messages: list[dict]) -> list[tuple[list[int], str]]:
    """(context ids, trained text) of every run of trained tokens, over the conversation's examples."""
    from sft.data.chat_templates import get_template
    from sft.data.tokenization import tokenize_examples

    rows = tokenize_examples(messages, tokenizer=tokenizer, template=get_template(name, tokenizer), max_length=4096)
    return [(row["input_ids"][:s], tokenizer.decode(row["input_ids"][s:e])) for row in rows for s, e in runs(row)]


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("index", range(len(HELD_OUT)))
def test_r1_0528_trains_each_reply_whole_after_the_official_prompt(official, index):
    """Every reply, `<think>` included (no generation prompt forces it), is trained once, after exactly the official
    template's prompt for it (system texts first, earlier reasoning deleted)."""
    tokenizer, messages = official["r1_0528"], HELD_OUT[index]
    expected = [(ids(tokenizer, tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)),
                 m["content"] + EOS) for k, m in enumerate(messages) if m["role"] == "assistant"]
    assert trained(tokenizer, "r1_0528", messages) == expected
    if "</think>" not in messages[-1]["content"]:  # the official text of the whole conversation is our last example
        from sft.data.chat_templates import get_template

        assert get_template("r1_0528", tokenizer).text(messages) == tokenizer.apply_chat_template(messages, tokenize=False)


# V3.1 data: the record's `thinking` (or, without it, whether a reply holds `</think>`) says how each reply is written.
V31_RECORDS = {
    "thinking": {"thinking": True, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "<think>Add.</think>5"}, {"role": "user", "content": "Times 4?"},
        {"role": "assistant", "content": "Multiply.</think>\n\n20"}]},
    "not_thinking": {"thinking": False, "messages": [
        {"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "<think>Add.</think>5"},
        {"role": "user", "content": "Times 4?"}, {"role": "assistant", "content": "20"}]},
    "per_reply": {"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "<think>Add.</think>5"},
        {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "Bye."}]},
}


@pytest.mark.parametrize("key", list(V31_RECORDS))
def test_v31_trains_what_the_model_writes_in_each_mode(official, key):
    """A thinking reply: its reasoning, `</think>` and answer, after the official prompt with thinking=True
    (`<｜Assistant｜><think>`); any other reply: the answer alone after `<｜Assistant｜></think>`. Earlier thinking replies
    are shown as the official template shows them (`</think>` + answer), each trained in an example of its own."""
    from sft.data.formats import messages_conversation
    from sft.data.thinking_templates import answer_only

    tokenizer = official["deepseek_v31"]
    record = V31_RECORDS[key]
    messages = messages_conversation(record, "test")["messages"]
    expected = []
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            thinks = record.get("thinking", "</think>" in m["content"])
            prompt = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True,
                                                   thinking=thinks)
            assert prompt.endswith("<｜Assistant｜><think>" if thinks else "<｜Assistant｜></think>")
            target = m["content"].removeprefix("<think>") if thinks else answer_only(m["content"])
            expected.append((ids(tokenizer, prompt), target + EOS))
    assert trained(tokenizer, "deepseek_v31", messages) == expected


def test_v31_saved_template_switches_thinking_as_the_official_one(official):
    from sft.data.chat_templates import get_template

    template = get_template("deepseek_v31", official["deepseek_v31"])
    saved = tokenizer_with(template.chat_template)
    messages = V31_RECORDS["per_reply"]["messages"][:3]
    for thinking in (False, True):
        expected = official["deepseek_v31"].apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                                thinking=thinking)
        assert saved.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         thinking=thinking) == template.text(messages, True, thinking=thinking) == expected
    assert saved.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True) \
        .endswith("<think>")


def test_thinking_flag_errors_are_one_line(official):
    from sft.data.formats import messages_conversation
    from sft.data.chat_templates import get_template
    from sft.data.tokenization import tokenize_batch
    from sft.errors import DataError

    with pytest.raises(DataError, match=r"^r\.jsonl:3: field 'thinking' must be true or false, got 'yes'"):
        messages_conversation({"thinking": "yes", "messages": HELD_OUT[3]}, "r.jsonl:3")
    tokenizer = official["deepseek_v31"]
    plain = messages_conversation({"thinking": True, "messages": HELD_OUT[2]}, "r.jsonl:4")["messages"]
    with pytest.raises(DataError, match=r"^r\.jsonl:4: a reply marked thinking has no `</think>`"):
        tokenize_batch({"messages": [plain], "source": ["r.jsonl:4"]}, tokenizer=tokenizer, max_length=4096,
                       template=get_template("deepseek_v31", tokenizer))
