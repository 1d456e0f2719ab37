"""Reasoning models trained as they are used: every assistant turn's context is what DeepSeek-R1's and the
R1-Distills' official templates show at inference (earlier turns' `<think>...</think>` deleted), each turn's own
reasoning is trained where that turn is the target, `<think>\\n` of the generation prompt is prompt, and `auto`
tells R1 from both Distill revisions. Checked through `apply_chat_template` of the official templates."""

from __future__ import annotations

import pytest

from conftest import DEEPSEEK_TOKENIZER, needs_shared
from test_templates import DEEPSEEK_V3, R1_DISTILL

pytestmark = needs_shared

# deepseek-ai/DeepSeek-R1, tokenizer_config.json "chat_template" (the revision whose generation prompt opens
# `<think>\n`), as quoted verbatim in gorilla's BFCL handler
# berkeley-function-call-leaderboard/bfcl_eval/model_handler/local_inference/deepseek_reasoning.py (commit 366e7db4).
# Unlike the distills it joins all system messages with a blank line (like V3), tests `'tool_calls' in message`,
# and writes later tool outputs without a newline.
R1 = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}"
    "{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}{%- endif %}"
    "{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- set ns.is_tool = false -%}"
    "{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}{%- if message['content'] is none %}"
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + "
    "'<｜tool▁call▁end｜>'}}{%- else %}{{'<｜Assistant｜>' + message['content'] + "
    "'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + "
    "'\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- endif %}{%- set ns.is_first = true -%}{%- else %}{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + "
    "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + "
    "'\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- endfor %}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' not in message %}{%- if ns.is_tool %}"
    "{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}"
    "{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"
    "{%- set ns.is_output_first = false %}{%- else %}{{'<｜tool▁output▁begin｜>' + message['content'] + "
    "'<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}"
    "{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")
# The R1-Distill revision before `<think>\n` was added to the generation prompt (and the first DeepSeek-R1
# revision, quoted in huggingface.js packages/jinja's tests, prompts the same way): the same Jinja otherwise.
R1_DISTILL_OLD = R1_DISTILL.replace("{{'<｜Assistant｜><think>\\n'}}", "{{'<｜Assistant｜>'}}")
EOS = "<｜end▁of▁sentence｜>"
THINK = "<think>\n"

# Held out from the probes `auto` uses: several turns, two system texts, reasoning in some turns and not others.
HELD_OUT = [
    [{"role": "system", "content": "You are careful."}, {"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "2+3?"},
     {"role": "assistant", "content": "<think>\nTwo plus three is five.\n</think>\n\n5"},
     {"role": "user", "content": "Times 4?"}, {"role": "assistant", "content": "20"},
     {"role": "user", "content": "Minus 1? Think."},
     {"role": "assistant", "content": "<think>\n20 - 1 = 19.\n</think>\n\n**19**"},
     {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You're welcome."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello!"},
     {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "<think>\nAny.\n</think>\n\nBlue"}],
    [{"role": "system", "content": "S1"}, {"role": "system", "content": "S2"}, {"role": "user", "content": "q"},
     {"role": "assistant", "content": "plain"}, {"role": "user", "content": "q2"},
     {"role": "assistant", "content": "also plain 中文"}],  # no reasoning: one example, as before
    [{"role": "user", "content": "Solve x+1=3."},
     {"role": "assistant", "content": "<think>\nx = 2\n</think>\n\nx = 2."}],  # reasoning last only: one example
]


def tokenizer_with(template: str | None):
    """The real DeepSeek tokenizer carrying an official template, with the V3/R1 special tokens as single tokens
    and `<think>`/`</think>` as added (not special) tokens, as in the R1 tokenizers."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEEPSEEK_TOKENIZER)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<｜User｜>", "<｜Assistant｜>"]})
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.eos_token = EOS
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def official():
    return {name: tokenizer_with(jinja) for name, jinja in
            (("r1", R1), ("r1_distill", R1_DISTILL), ("r1_distill_old", R1_DISTILL_OLD),
             ("deepseek_v3", DEEPSEEK_V3))}


def test_auto_tells_r1_from_both_distill_revisions(official):
    from sft.data.chat_templates import matching_builtin

    assert {name: matching_builtin(tok) for name, tok in official.items()} == {
        "r1": "r1", "r1_distill": "r1_distill", "r1_distill_old": "r1_distill", "deepseek_v3": "deepseek_v3"}


def runs(row: dict) -> list[tuple[int, int]]:
    """(start, end) of every run of trained tokens."""
    out, start = [], None
    for i, label in enumerate(row["labels"] + [-100]):
        if label != -100 and start is None:
            start = i
        elif label == -100 and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.mark.parametrize("name", ["r1", "r1_distill"])
@pytest.mark.parametrize("index", range(len(HELD_OUT)))
def test_each_reply_is_trained_once_after_the_context_the_official_template_gives_it(official, name, index):
    """Every assistant turn is trained exactly once, its `<think>\\n` not, and the tokens before it are exactly
    the official template's prompt for that turn (earlier reasoning deleted, every system text as it writes them)."""
    from sft.data.chat_templates import get_template
    from sft.data.tokenization import tokenize_examples

    tokenizer, messages = official[name], HELD_OUT[index]
    template = get_template(name, tokenizer)
    rows = tokenize_examples(messages, tokenizer=tokenizer, template=template, max_length=4096)
    seen = [(row["input_ids"][:start], tokenizer.decode(row["input_ids"][start:end]))
            for row in rows for start, end in runs(row)]
    expected = []
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            prompt = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
            assert prompt.endswith(THINK)
            if not m["content"].startswith(THINK):  # a reply without reasoning: `<think>\n` is not in its text
                prompt = prompt.removesuffix(THINK)
            expected.append((tokenizer(prompt, add_special_tokens=False)["input_ids"],
                             m["content"].removeprefix(THINK) + EOS))
    assert seen == expected
    # One example per reply with reasoning but the last assistant turn, plus the last example.
    earlier = [m for m in messages[:-1] if m["role"] == "assistant" and "</think>" in m["content"]]
    assert len(rows) == len(earlier) + 1
    if not any("</think>" in m["content"] for m in messages):  # as before: the official conversation, token for token
        assert rows[0]["input_ids"] == tokenizer.apply_chat_template(messages)["input_ids"]


@pytest.mark.parametrize("name", ["r1", "r1_distill"])
def test_model_template_trains_as_the_builtin_on_the_official_templates(official, name):
    """`--template model` with the official Jinja makes the same examples, ids and labels as the built-in."""
    from sft.data.chat_templates import get_template
    from sft.data.tokenization import tokenize_batch

    tokenizer = official[name]
    batch = {"messages": HELD_OUT}
    ours = tokenize_batch(batch, tokenizer=tokenizer, template=get_template(name, tokenizer), max_length=4096)
    model = tokenize_batch(batch, tokenizer=tokenizer, template=get_template("model", tokenizer), max_length=4096)
    assert model.drop_columns(["status"]).to_pydict() == ours.drop_columns(["status"]).to_pydict()
    # The built-in also says where training differs from the saved template's `<think>\n` prompt (replies without it)
    assert "replies not opening with '<think>\\n'" in " ".join(ours.column("status").to_pylist())


def test_older_distill_revision_trains_think_where_its_prompt_lacks_it(official):
    """The Distill revision whose generation prompt has no `<think>\\n`: through its own Jinja, the model writes
    `<think>` itself, so it is trained."""
    from sft.data.chat_templates import get_template
    from sft.data.tokenization import tokenize_examples

    tokenizer = official["r1_distill_old"]
    messages = HELD_OUT[1]
    rows = tokenize_examples(messages, tokenizer=tokenizer, template=get_template("model", tokenizer), max_length=4096)
    trained = [tokenizer.decode(row["input_ids"][s:e]) for row in rows for s, e in runs(row)]
    assert trained == [m["content"] + EOS for m in messages if m["role"] == "assistant"]


@pytest.mark.parametrize("index", range(len(HELD_OUT)))
def test_mask_history_trains_the_last_reply_once_in_the_official_context(official, index):
    """R1 makes an example per turn with reasoning before the last: under --mask_history only the last one, its
    last reply trained, after the official template's prompt for it."""
    from sft.data.chat_templates import get_template
    from sft.data.tokenization import tokenize_examples

    tokenizer, messages = official["r1"], HELD_OUT[index]
    rows = tokenize_examples(messages, tokenizer=tokenizer, template=get_template("r1", tokenizer), max_length=4096,
                             mask_history=True)
    assert len(rows) == 1 and len(runs(rows[0])) == 1
    (start, end), = runs(rows[0])
    last = messages[-1]["content"]
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    if not last.startswith(THINK):  # as the test above: a reply without reasoning after `<｜Assistant｜>`
        prompt = prompt.removesuffix(THINK)
    assert rows[0]["input_ids"][:start] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(rows[0]["input_ids"][start:end]) == last.removeprefix(THINK) + EOS


def test_saved_r1_template_prompts_as_the_official_one(official):
    """Our Jinja (stored on the trained model's tokenizer) writes every prompt as the official template does."""
    from sft.data.chat_templates import get_template

    for name in ("r1", "r1_distill"):
        template = get_template(name, official[name])
        ours = tokenizer_with(template.chat_template)
        for messages in HELD_OUT:
            for n, m in enumerate(messages, 1):
                if m["role"] == "user":
                    expected = official[name].apply_chat_template(messages[:n], tokenize=False,
                                                                  add_generation_prompt=True)
                    assert ours.apply_chat_template(messages[:n], tokenize=False, add_generation_prompt=True) == \
                        template.text(messages[:n], add_generation_prompt=True) == expected


def test_examples_pack_as_documents_and_keep_every_reply_once(official):
    """Packing the examples of reasoning conversations: each example is a document, no trained token lost or
    repeated (the loss weighs every reply token once, as it would one sequence)."""
    from sft.data.packing import pack_rows
    from sft.data.chat_templates import get_template
    from sft.data.tokenization import tokenize_batch

    tokenizer = official["r1"]
    rows = tokenize_batch({"messages": HELD_OUT}, tokenizer=tokenizer, template=get_template("r1", tokenizer),
                          max_length=4096).to_pydict()
    assert len(rows["input_ids"]) == 3 + 2 + 1 + 1
    packed = pack_rows(rows["input_ids"], rows["labels"], 4096).to_pydict()
    assert sorted(n for lengths in packed["seq_lengths"] for n in lengths) == sorted(rows["length"])
    trained = sum(label != -100 for labels in rows["labels"] for label in labels)
    assert sum(label != -100 for labels in packed["labels"] for label in labels) == trained
    replies = [m["content"].removeprefix(THINK) + EOS for c in HELD_OUT for m in c if m["role"] == "assistant"]
    assert trained == sum(len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in replies)


CONVERSATION_OPENING_WITH_REPLY = [{"role": "assistant", "content": "Welcome!"}, {"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Hello."}]


@pytest.mark.parametrize("name", ["r1_distill", "deepseek_v3"])
def test_model_template_trains_a_conversation_that_opens_with_a_reply(official, name):
    from sft.data.chat_templates import get_template
    from sft.data.tokenization import tokenize_one

    tokenizer = official[name]
    row = tokenize_one(CONVERSATION_OPENING_WITH_REPLY, tokenizer=tokenizer, template=get_template("model", tokenizer),
                       max_length=4096)
    assert row["input_ids"] == tokenizer.apply_chat_template(CONVERSATION_OPENING_WITH_REPLY)["input_ids"]
    assert [tokenizer.decode(row["input_ids"][s:e]) for s, e in runs(row)] == ["Welcome!" + EOS, "Hello." + EOS]


@pytest.mark.parametrize("jinja, bad, message", [
    # Llama 2 / Mistral style: roles must alternate from a user turn
    ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
     "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
     "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}",
     CONVERSATION_OPENING_WITH_REPLY,
     r"^data\.jsonl:7: the model's chat_template fails on this conversation \(TemplateError: Conversation roles "
     r"must alternate user/assistant/user/assistant/\.\.\.\); fix the record or use --template with one of "),
    # a template that does not write the reply as given (upper-cased)
    ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] | upper + '\\n' }}{% endfor %}"
     "{% if add_generation_prompt %}assistant: {% endif %}",
     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
     r"^data\.jsonl:7: the model's chat_template does not write an assistant turn's text as given"),
])
def test_model_template_failures_are_one_line_naming_the_record(jinja, bad, message):
    from sft.errors import DataError
    from sft.data.chat_templates import get_template
    from sft.data.tokenization import tokenize_batch

    tokenizer = tokenizer_with(jinja)
    good = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "42"}]  # fine with both templates
    batch = {"messages": [good, bad], "source": ["data.jsonl:6", "data.jsonl:7"]}
    with pytest.raises(DataError, match=message) as error:
        tokenize_batch(batch, tokenizer=tokenizer, template=get_template("model", tokenizer), max_length=4096)
    assert "\n" not in str(error.value)


def test_data_preparation_names_the_record_and_shows_every_example(official):
    """Through sft/data/dataset.py: a template's error names the record; --show_masks shows each example."""
    from sft.options.arguments import DataArguments
    from sft.data.dataset import show_masks, tokenize
    from sft.errors import DataError
    from sft.data.chat_templates import get_template

    args = DataArguments(max_length=4096, show_masks=1)
    tokenizer = official["r1"]
    shown = show_masks([{"messages": HELD_OUT[1], "source": "r1.jsonl:1"}], args, tokenizer,
                       get_template("r1", tokenizer))
    assert shown.count("--- r1.jsonl:1 (example ") == 2 and "(example 2 of 2)" in shown
    strict = tokenizer_with("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Start with a user turn') }}"
                            "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    conversations = [{"messages": HELD_OUT[1], "source": "r1.jsonl:1"},
                     {"messages": CONVERSATION_OPENING_WITH_REPLY, "source": "r1.jsonl:2"}]
    with pytest.raises(DataError, match=r"^r1\.jsonl:2: the model's chat_template fails on this conversation "
                                        r"\(TemplateError: Start with a user turn\)"):
        tokenize(conversations, args, strict, get_template("model", strict))
