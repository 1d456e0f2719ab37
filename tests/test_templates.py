"""Templates are byte-exact: our token ids equal `apply_chat_template` of the official chat templates, rendered
through the real DeepSeek tokenizer; the trained tokens are exactly each reply and its end-of-turn token."""

from __future__ import annotations

import pytest

from conftest import DEEPSEEK_TOKENIZER, needs_shared
from sft.data.formats import DataError
from sft.data.chat_templates import get_template, matching_builtin
from sft.data.tokenization import IGNORE, tokenize_one

pytestmark = needs_shared

# deepseek-ai/deepseek-llm-7b-chat, tokenizer_config.json "chat_template" (the same string is the test fixture
# "deepseek-ai/deepseek-llm-7b-chat" of huggingface.js packages/jinja and is shipped by DeepSeek-V2/V2-Lite chat).
DEEPSEEK_LLM_CHAT = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'User: ' + message['content'] + '\\n\\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}"
    "{{ message['content'] + '\\n\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ 'Assistant:' }}{% endif %}")

# deepseek-ai/DeepSeek-V3 (V3-0324 revision), tokenizer_config.json "chat_template", as served in Together's model
# catalogue for "deepseek-ai/DeepSeek-V3" (link https://huggingface.co/deepseek-ai/DeepSeek-V3).
DEEPSEEK_V3 = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}"
    "{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}{%- endif %}"
    "{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}"
    "{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}"
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + "
    "'<｜tool▁call▁end｜>'}}{%- set ns.is_first = true -%}{%- else %}{{'\\n' + '<｜tool▁call▁begin｜>' + "
    "tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + "
    "tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}"
    "{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}"
    "{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"
    "{%- set ns.is_output_first = false %}{%- else %}{{'\\n<｜tool▁output▁begin｜>' + message['content'] + "
    "'<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}"
    "{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}")

# deepseek-ai/DeepSeek-R1-Distill-Qwen-* / -Llama-* (the revision whose generation prompt opens `<think>\n`),
# tokenizer_config.json "chat_template", as quoted verbatim (for DeepSeek-R1) in gorilla's BFCL handler
# `deepseek_reasoning.py`; the distills keep only the last system message.
R1_DISTILL = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}"
    "{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}"
    "{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}"
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + "
    "'<｜tool▁call▁end｜>'}}{%- set ns.is_first = true -%}{%- else %}{{'\\n' + '<｜tool▁call▁begin｜>' + "
    "tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + "
    "tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}"
    "{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}"
    "{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"
    "{%- set ns.is_output_first = false %}{%- else %}{{'\\n<｜tool▁output▁begin｜>' + message['content'] + "
    "'<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}"
    "{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "Write a function that adds two numbers."},
     {"role": "assistant", "content": "def add(a, b):\n    return a + b"}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": " 4 \n"}],
    [{"role": "user", "content": "Traduis: chat", "input": "le chat noir"},  # an Alpaca record with input
     {"role": "assistant", "content": "the black cat 🐈‍⬛ 黑猫"}],
    [{"role": "user", "content": "\n  leading and trailing whitespace  \n"},
     {"role": "assistant", "content": "\n\nok\n\n"}],
]


def official(messages: list[dict]) -> list[dict]:
    """What a user hands to apply_chat_template: an Alpaca input joins its instruction (as our templates do)."""
    from sft.data.templates import user_text

    return [{"role": m["role"], "content": user_text(m) if m["role"] == "user" else m["content"]} for m in messages]


@pytest.fixture(scope="module")
def tokenizers():
    """The real DeepSeek tokenizer as shipped (deepseek-coder-6.7b-instruct), and copies carrying the official
    templates of the other families (with their special tokens added, so they are single tokens as there)."""
    from transformers import AutoTokenizer

    coder = AutoTokenizer.from_pretrained(DEEPSEEK_TOKENIZER)
    out = {"deepseek_coder": coder}
    for name, template in (("deepseek", DEEPSEEK_LLM_CHAT), ("deepseek_v3", DEEPSEEK_V3), ("r1_distill", R1_DISTILL)):
        tok = AutoTokenizer.from_pretrained(DEEPSEEK_TOKENIZER)
        tok.add_special_tokens({"additional_special_tokens": ["<｜User｜>", "<｜Assistant｜>"]})
        tok.eos_token = "<｜end▁of▁sentence｜>"  # the eos of deepseek-llm, V3 and the R1 distills
        tok.chat_template = template
        out[name] = tok
    return out


def trained_runs(row: dict, tokenizer) -> list[str]:
    runs, current = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != IGNORE:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


END = {"deepseek": "<｜end▁of▁sentence｜>", "deepseek_coder": "\n<|EOT|>", "deepseek_v3": "<｜end▁of▁sentence｜>",
       "r1_distill": "<｜end▁of▁sentence｜>"}


@pytest.mark.parametrize("name", ["deepseek", "deepseek_coder", "deepseek_v3", "r1_distill"])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_builtin_ids_equal_official_apply_chat_template(tokenizers, name, index):
    tokenizer, messages = tokenizers[name], CONVERSATIONS[index]
    template = get_template(name, tokenizer)
    row = tokenize_one(messages, tokenizer=tokenizer, template=template, max_length=4096)
    expected = tokenizer.apply_chat_template(official(messages), tokenize=True)["input_ids"]
    assert row["input_ids"] == expected
    for n in range(1, len(messages) + 1):  # the generation prompt too, after every prefix that ends with a user
        if messages[n - 1]["role"] == "user":
            assert template.text(messages[:n], add_generation_prompt=True) == tokenizer.apply_chat_template(
                official(messages[:n]), tokenize=False, add_generation_prompt=True)
    # Trained: every reply and its end-of-turn token, nothing else (DeepSeek v1 trains the space after
    # "Assistant:", because its generation prompt ends at the colon).
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    lead = " " if name == "deepseek" else ""
    assert trained_runs(row, tokenizer) == [lead + r + END[name] for r in replies]
    assert matching_builtin(tokenizer) == name  # --template auto picks the fast built-in for this model


def test_deepseek_v1_generation_prompt_has_no_trailing_space(tokenizers):
    template = get_template("deepseek", tokenizers["deepseek"])
    assert template.text(CONVERSATIONS[0][:1], add_generation_prompt=True).endswith("\n\nAssistant:")
    assert template.text(CONVERSATIONS[0]).endswith("Assistant: def add(a, b):\n    return a + b<｜end▁of▁sentence｜>")


def test_r1_distill_keeps_the_reasoning_the_official_template_deletes(tokenizers):
    tokenizer = tokenizers["r1_distill"]
    reasoning, answer = "<think>\nThe user greets me.\n</think>", "\n\nHello!"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reasoning + answer}]
    row = tokenize_one(messages, tokenizer=tokenizer, template=get_template("r1_distill", tokenizer),
                       max_length=4096)
    ours = tokenizer.decode(row["input_ids"])
    assert ours.replace(reasoning, "") == tokenizer.apply_chat_template(messages, tokenize=False)
    # `<think>\n` is the generation prompt's, so it is prompt; the rest of the reasoning is trained.
    assert trained_runs(row, tokenizer) == [reasoning.removeprefix("<think>\n") + answer + "<｜end▁of▁sentence｜>"]
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<think>\n") and ours.startswith(prompt)


def test_model_chat_template_path_equals_apply_chat_template(tokenizers):
    tokenizer = tokenizers["deepseek_coder"]
    template = get_template("model", tokenizer)
    for messages in CONVERSATIONS:
        row = tokenize_one(messages, tokenizer=tokenizer, template=template, max_length=4096)
        assert row["input_ids"] == tokenizer.apply_chat_template(official(messages), tokenize=True)["input_ids"]
        builtin = tokenize_one(messages, tokenizer=tokenizer, template=get_template("deepseek_coder", tokenizer),
                               max_length=4096)
        assert row["labels"] == builtin["labels"]


def test_model_template_that_rewrites_history_is_refused_clearly(tokenizers):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEEPSEEK_TOKENIZER)
    # Every message but the last cut to one character: the user turn the model answers reads differently in its
    # prompt than in the conversation that holds the answer, so the turn's context is unclear.
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' }}{% if loop.last %}{{ m['content'] }}"
                               "{% else %}{{ m['content'][:1] }}{% endif %}{{ '\\n' }}{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    assert get_template("auto", tokenizer).name == "model"
    with pytest.raises(DataError, match="opening otherwise than its generation prompt"):
        get_template("model", tokenizer).render(CONVERSATIONS[1])


def test_alpaca_template_is_the_stanford_prompt(tokenizers):
    tokenizer = tokenizers["deepseek_coder"]
    template = get_template("alpaca", tokenizer)
    assert template.text(CONVERSATIONS[2]) == (
        "<｜begin▁of▁sentence｜>Below is an instruction that describes a task, paired with an input that provides "
        "further context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
        "Traduis: chat\n\n### Input:\nle chat noir\n\n### Response:the black cat 🐈‍⬛ 黑猫<|EOT|>")
    assert template.text(CONVERSATIONS[0][:1] + [CONVERSATIONS[0][1]]).startswith(
        "<｜begin▁of▁sentence｜>Below is an instruction that describes a task. Write a response")
    row = tokenize_one(CONVERSATIONS[2], tokenizer=tokenizer, template=template, max_length=4096)
    assert trained_runs(row, tokenizer) == ["the black cat 🐈‍⬛ 黑猫<|EOT|>"]


def test_unknown_template_and_missing_chat_template_are_data_errors(tokenizers):
    from transformers import AutoTokenizer

    with pytest.raises(DataError, match="--template 'chatml' is unknown"):
        get_template("chatml", tokenizers["deepseek_coder"])
    bare = AutoTokenizer.from_pretrained(DEEPSEEK_TOKENIZER)
    bare.chat_template = None
    assert get_template("auto", bare).name == "deepseek"
    with pytest.raises(DataError, match="has no chat_template"):
        get_template("model", bare)
