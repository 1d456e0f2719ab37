"""Masks and lengths: assistant tokens + end of turn only (or everything with --train_on_prompt), every reply of
a multi-turn conversation, truncation at a turn boundary or dropping, and the fast byte-length path equal to the
tokenizer's own offsets on real data; ids cut where the tokenizer always cuts (newlines, before a space + letter)
equal the tokenizer's own on generated text built to hit those cuts."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ALPACA_SAMPLE, DEEPSEEK_TOKENIZER, OASST_SAMPLE, needs_shared
from sft.data import tokenization
from sft.data.formats import ReadOptions, read_conversations
from sft.data.chat_templates import get_template
from sft.data.tokenization import IGNORE, render_mask, tokenize_batch, tokenize_one

pytestmark = needs_shared

TURNS = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "First question?"}, {"role": "assistant", "content": "First answer."},
         {"role": "user", "content": "Second question?"}, {"role": "assistant", "content": "Second answer."},
         {"role": "user", "content": "Third question?"}, {"role": "assistant", "content": "Third answer " * 100}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEEPSEEK_TOKENIZER)


def runs(row, tokenizer):
    out, current = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != IGNORE:
            assert label == token
            current.append(token)
        elif current:
            out.append(tokenizer.decode(current))
            current = []
    return out + ([tokenizer.decode(current)] if current else [])


def test_every_assistant_turn_and_its_eot_is_trained_nothing_else(tokenizer):
    row = tokenize_one(TURNS, tokenizer=tokenizer, template=get_template("deepseek_coder", tokenizer),
                       max_length=4096)
    assert row["status"] == "ok" and row["labels"][0] == IGNORE
    assert runs(row, tokenizer) == [m["content"] + "\n<|EOT|>" for m in TURNS if m["role"] == "assistant"]


def test_train_on_prompt_trains_every_token_but_the_first(tokenizer):
    row = tokenize_one(TURNS, tokenizer=tokenizer, template=get_template("deepseek", tokenizer), max_length=4096,
                       train_on_prompt=True)
    assert row["labels"][0] == IGNORE and row["labels"][1:] == row["input_ids"][1:]


def test_mask_history_trains_the_last_reply_alone(tokenizer):
    template = get_template("deepseek_coder", tokenizer)
    full = tokenize_one(TURNS, tokenizer=tokenizer, template=template, max_length=4096)
    row = tokenize_one(TURNS, tokenizer=tokenizer, template=template, max_length=4096, mask_history=True)
    assert row["input_ids"] == full["input_ids"]  # the same text: the earlier replies are context
    assert runs(row, tokenizer) == [TURNS[-1]["content"] + "\n<|EOT|>"]
    # a conversation whose last reply does not fit trains nothing of its earlier ones: dropped, not truncated
    short = tokenize_one(TURNS, tokenizer=tokenizer, template=template, max_length=150, mask_history=True)
    assert short["length"] == 0 and short["status"] != "ok"


def test_mask_history_keeps_the_tool_results_before_the_last_reply_as_prompt():
    from sft.data.tokenization import last_reply_only

    segments = [("<bos>User: q", False), ("Assistant: a1", True), ("<eos>", True), ("User: q2 Assistant:", False),
                ("call", True), ("tool result", False), ("<think>r</think>", True), ("answer", True),
                ("<eos>", True)]
    assert [trained for _, trained in last_reply_only(segments)] == [False] * 6 + [True] * 3
    assert last_reply_only([("prompt", False)]) == [("prompt", False)]  # nothing trained stays so


def test_overlong_truncates_after_the_last_reply_that_fits_or_drops(tokenizer):
    template = get_template("deepseek_coder", tokenizer)
    full = tokenize_one(TURNS, tokenizer=tokenizer, template=template, max_length=4096)
    assert full["length"] > 150
    row = tokenize_one(TURNS, tokenizer=tokenizer, template=template, max_length=150)
    assert row["status"] == "truncated at a turn boundary" and row["length"] <= 150
    assert runs(row, tokenizer) == ["First answer.\n<|EOT|>", "Second answer.\n<|EOT|>"]
    assert row["input_ids"] == full["input_ids"][: row["length"]]
    assert tokenizer.decode(row["input_ids"]).endswith("Second answer.\n<|EOT|>")
    dropped = tokenize_one(TURNS, tokenizer=tokenizer, template=template, max_length=150, overlong="drop")
    assert dropped["status"] == "too long (dropped)" and dropped["length"] == 0
    first_too_long = [{"role": "user", "content": "q " * 300}, {"role": "assistant", "content": "a"}]
    assert tokenize_one(first_too_long, tokenizer=tokenizer, template=template, max_length=150)["status"] == \
        "too long (dropped)"


def test_fast_path_equals_the_tokenizers_own_ids_and_offsets_on_real_data(tokenizer, monkeypatch):
    assert tokenization.splits_after_newline(tokenizer)  # the coder template's opening is encoded once
    conversations = read_conversations(str(ALPACA_SAMPLE), None, ReadOptions())[0][:300]
    conversations += read_conversations(str(OASST_SAMPLE), None, ReadOptions(oasst_threads="all"))[0][:200]
    batch = {"messages": [c["messages"] for c in conversations]}
    for name, max_length in (("deepseek_coder", 1024), ("deepseek", 1024), ("alpaca", 1024),
                             ("deepseek_coder", 120)):  # the last truncates and drops many
        template = get_template(name, tokenizer)
        fast = tokenize_batch(batch, tokenizer=tokenizer, template=template, max_length=max_length).to_pydict()
        monkeypatch.setattr(tokenization, "byte_lengths", lambda tok: None)  # the plain path: full text, offsets
        slow = tokenize_batch(batch, tokenizer=tokenizer, template=template, max_length=max_length).to_pydict()
        monkeypatch.undo()
        assert fast == slow, name
        if max_length == 120:
            assert {"ok", "truncated at a turn boundary", "too long (dropped)"} <= set(fast["status"])
            continue
        # ids are the tokenizer's own encoding of the whole text (the reused opening changes nothing)
        whole = tokenizer([template.text(m) for m in batch["messages"]], add_special_tokens=False)["input_ids"]
        assert all(ids == full for ids, full, status in zip(fast["input_ids"], whole, fast["status"])
                   if status == "ok")


def test_render_mask_marks_trained_tokens(tokenizer):
    row = tokenize_one(TURNS[:3], tokenizer=tokenizer, template=get_template("deepseek", tokenizer),
                       max_length=4096)
    shown = render_mask(row["input_ids"], row["labels"], tokenizer)
    assert shown == ("<｜begin▁of▁sentence｜>Be brief.\n\nUser: First question?\n\nAssistant:"
                     "[[ First answer.<|EOT|>]]")


# Text made of what sits around the cuts: spaces and other whitespace before letters, newlines and carriage
# returns, letters with and without accents, added tokens (`õ` is one), digits, punctuation, symbols, CJK, emoji.
PARTS = [" ", "  ", "\t", "\u00a0", "\u3000", "\n", "\r", "\r\n", "\n\n", "a", "Z", "word", " the", "é", "ÿ", "õ",
         "<|EOT|>", "<｜end▁of▁sentence｜>", "7", "2019", ".", ",", ";", ":", "!", "?", ")", "'s", "'", '"',
         "-", "/", "...", "U.S.", "(", "=", "$", "|", "中文", "가", "😀", "Ġ", "_"]
texts = st.lists(st.sampled_from(PARTS), max_size=40).map("".join)


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 80)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(texts, texts), min_size=1, max_size=6), st.sampled_from([1, 3, 1000]))
def test_ids_cut_at_words_and_newlines_equal_the_tokenizers_own(tokenizer, monkeypatch, pairs, chunk):
    assert tokenization.splits_at_words(tokenizer)
    monkeypatch.setattr(tokenization, "_CHUNK", chunk)  # pieces per tokenizer input: one, a few, all
    template = get_template("deepseek_coder", tokenizer)
    conversations = [[{"role": "user", "content": u}, {"role": "assistant", "content": a}] for u, a in pairs]
    rows = tokenize_batch({"messages": conversations}, tokenizer=tokenizer, template=template, max_length=10**6,
                          train_on_prompt=True).to_pydict()
    for conversation, ids, status in zip(conversations, rows["input_ids"], rows["status"]):
        assert status == "ok"
        assert ids == tokenizer(template.text(conversation), add_special_tokens=False)["input_ids"]


def test_tokenizers_that_do_not_always_cut_there_are_tokenized_whole(tokenizer):
    from transformers import AutoTokenizer

    dotted = AutoTokenizer.from_pretrained(DEEPSEEK_TOKENIZER)
    dotted.add_tokens(["e.g"])  # an added token across a letter + punctuation: no cuts at words
    assert tokenization.splits_after_newline(dotted) and not tokenization.splits_at_words(dotted)
    spaced = AutoTokenizer.from_pretrained(DEEPSEEK_TOKENIZER)
    spaced.add_tokens(["hello world"])  # an added token across a space + letter: no cuts at words
    assert tokenization.splits_after_newline(spaced) and not tokenization.splits_at_words(spaced)
    conversation = [{"role": "user", "content": "say hello world twice: hello world"},
                    {"role": "assistant", "content": "hello world hello world"}]
    template = get_template("deepseek_coder", spaced)
    row = tokenize_one(conversation, tokenizer=spaced, template=template, max_length=4096)
    assert row["input_ids"] == spaced(template.text(conversation), add_special_tokens=False)["input_ids"]
    assert row["input_ids"].count(spaced.convert_tokens_to_ids("hello world")) == 4
