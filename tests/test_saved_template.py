"""A trained model carries the template it was trained with: the Jinja that training stores on the tokenizer it
saves renders, after save_pretrained and a reload, exactly the text and the token ids that training used, for every
built-in template, with the real DeepSeek tokenizer and the embedded tiny one; `--template auto` (what
`python -m sft.tools.chat` uses) finds that built-in again. It reads OpenAI-form messages as training's reader
(sft/data/formats.py) does: `developer` is a system text, a list of text parts is its texts joined, other content refused."""

from __future__ import annotations

import pytest

from conftest import DEEPSEEK_TOKENIZER, SHARED
from sft.errors import DataError
from sft.data.formats import messages_conversation
from sft.data.chat_templates import BUILTIN, chat_template_for_saving, get_template
from sft.data.templates import ALL_REASONING
from sft.data.tokenization import tokenize_one

CONVERSATIONS = [
    [{"role": "user", "content": "Capital of Japan?"}, {"role": "assistant", "content": "Tokyo."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
     {"role": "assistant", "content": " 6 \n"}],
    [{"role": "system", "content": "First."}, {"role": "system", "content": "Second."},  # V3 joins, R1 keeps the last
     {"role": "user", "content": "Traduis: chat", "input": "le chat noir"},  # an Alpaca record with its input
     {"role": "assistant", "content": "the black cat 🐈‍⬛ 黑猫 <think>x</think>"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "\n  spaces  \n"},
     {"role": "assistant", "content": "\n\nok\n\n"}],
]
SOURCES = ["deepseek", "tiny"]


def tokenizer_from(source: str):
    from transformers import AutoTokenizer

    from sft.model.tiny import ensure_tiny_model

    if source == "deepseek" and not SHARED.is_dir():
        pytest.skip("../shared (the real DeepSeek tokenizer) is absent in this checkout; CI has it")
    return AutoTokenizer.from_pretrained(DEEPSEEK_TOKENIZER if source == "deepseek" else ensure_tiny_model())


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("name", list(BUILTIN))
def test_saved_tokenizer_renders_and_tokenizes_as_training(tmp_path, source, name):
    from transformers import AutoTokenizer

    tokenizer = tokenizer_from(source)
    template = get_template(name, tokenizer)  # as training renders (prepare() runs before the template is stored)
    jinja = chat_template_for_saving(name, tokenizer)
    assert jinja
    tokenizer.chat_template = jinja
    tokenizer.save_pretrained(tmp_path)
    saved = AutoTokenizer.from_pretrained(tmp_path)
    for messages in CONVERSATIONS:
        assert saved.apply_chat_template(messages, tokenize=False) == template.text(messages)
        trained = tokenize_one(messages, tokenizer=tokenizer, template=template, max_length=10**6)
        if trained["length"]:  # r1_distill_no_reasoning trains nothing of a reply that is all reasoning
            assert saved.apply_chat_template(messages, tokenize=True)["input_ids"] == trained["input_ids"]
        else:
            assert name == "r1_distill_no_reasoning" and trained["status"] == ALL_REASONING  # not a length cut
        for n, message in enumerate(messages, 1):  # every prompt at which the model answers
            if message["role"] == "user":
                assert saved.apply_chat_template(messages[:n], tokenize=False, add_generation_prompt=True) == \
                    template.text(messages[:n], add_generation_prompt=True)
    # `--template auto` on the saved model (sft.tools.chat's default) renders with the same built-in.
    assert get_template("auto", saved).name == name


@pytest.mark.parametrize("source", SOURCES)
def test_the_model_own_template_is_kept(source):
    tokenizer = tokenizer_from(source)
    assert chat_template_for_saving("model", tokenizer) is None
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert chat_template_for_saving("auto", tokenizer) is None  # auto -> the model's own: nothing to store
    tokenizer.chat_template = None
    assert chat_template_for_saving("auto", tokenizer) == BUILTIN["deepseek"]("", "").chat_template  # none: v1


def text_parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


# OpenAI-form messages as clients send them: a `developer` text (the reader's system), content as text parts.
OPENAI_FORMS = [
    [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": text_parts("2+", "2?")},
     {"role": "assistant", "content": text_parts("4")}],
    # system and developer texts mixed (V3 and R1 join them, the distills keep the last), empty part lists
    [{"role": "system", "content": text_parts("First.")}, {"role": "user", "content": "Hi"},
     {"role": "developer", "content": text_parts("Sec", "ond.")}, {"role": "assistant", "content": "Hello"},
     {"role": "user", "content": []}, {"role": "assistant", "content": text_parts("<think>\nx\n</think>\n\n?")}],
]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("name", list(BUILTIN))
def test_saved_template_reads_developer_and_text_parts_as_training(source, name):
    tokenizer = tokenizer_from(source)
    template = get_template(name, tokenizer)
    tokenizer.chat_template = chat_template_for_saving(name, tokenizer)
    for messages in OPENAI_FORMS:
        read = messages_conversation({"messages": messages}, "test")["messages"]
        assert len(read) == len(messages) and any(m["role"] == "system" for m in read)
        assert tokenizer.apply_chat_template(messages, tokenize=False) == template.text(read)
        for n, message in enumerate(messages, 1):
            if message["role"] == "user":
                assert tokenizer.apply_chat_template(messages[:n], tokenize=False, add_generation_prompt=True) == \
                    template.text(read[:n], add_generation_prompt=True)


@pytest.mark.parametrize("content", [[{"type": "image_url", "image_url": {"url": "x.png"}}],
                                     text_parts("a") + ["b"], {"type": "text", "text": "a"}, 7])
@pytest.mark.parametrize("name", list(BUILTIN))
def test_saved_template_refuses_content_the_reader_refuses(name, content):
    from jinja2.exceptions import TemplateError

    tokenizer = tokenizer_from("tiny")
    tokenizer.chat_template = chat_template_for_saving(name, tokenizer)
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(DataError, match="must be a string"):
        messages_conversation({"messages": messages}, "test")
    with pytest.raises(TemplateError, match="content"):
        tokenizer.apply_chat_template(messages, tokenize=False)
