"""Hostile input (issue 5.7): whatever bytes a data file holds, a reader either returns conversations (with bad
records counted as skips under --skip_bad_records) or raises DataError naming the file, and the line where there
is one. Never any other exception."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sft.data.formats import DataError, ReadOptions, read_conversations

# Modest by default (the whole file runs in seconds); FUZZ_EXAMPLES=2000 for a deeper search.
SETTINGS = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 60)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)
KEYS = ["instruction", "input", "output", "system", "history", "messages", "conversations", "role", "content",
        "from", "value", "message_id", "parent_id", "text", "rank", "deleted", "review_result", "lang", "prompt",
        "replies", "message_tree_id", "extra"]
# Records shaped like the real formats, with any key missing, added or of the wrong type.
record_like = st.dictionaries(st.sampled_from(KEYS), json_values | st.text(max_size=30), max_size=8)
turn = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "assistant", "system", "tool", 3]),
                                           "content": json_values, "from": st.sampled_from(["human", "gpt", "x"]),
                                           "value": st.text(max_size=10)})
chat_like = st.fixed_dictionaries({"messages": st.lists(turn, max_size=4) | json_values})
line = (record_like.map(json.dumps) | chat_like.map(json.dumps) | json_values.map(json.dumps)
        | st.text(max_size=40) | st.just('{"instruction": "a", "output": "b"}'))


def check(path: Path, data: bytes, fmt: str | None, skip_bad: bool) -> None:
    path.write_bytes(data)
    try:
        conversations, stats = read_conversations(str(path), fmt, ReadOptions(skip_bad=skip_bad,
                                                                               oasst_threads="all"))
    except DataError as e:
        message = str(e)
        assert message.startswith(str(path)) or message.startswith("--dataset_format"), message
        assert "\n" not in message
        match = re.match(re.escape(str(path)) + r":(\d+)", message)
        if match:  # a line number, when given, is a line of the file
            assert 1 <= int(match.group(1)) <= data.count(b"\n") + 1, message
        return
    assert stats.kept == len(conversations)
    for conversation in conversations:
        assert conversation["source"].startswith(str(path))
        roles = [m["role"] for m in conversation["messages"]]
        assert roles[-1] == "assistant" and set(roles) <= {"system", "user", "assistant"}
        assert all(isinstance(m["content"], str) for m in conversation["messages"])


@SETTINGS
@given(lines=st.lists(line, max_size=8), fmt=st.sampled_from([None, "alpaca", "messages", "oasst"]),
       skip_bad=st.booleans(), suffix=st.sampled_from([".jsonl", ".json"]))
def test_jsonl_lines_of_anything(lines, fmt, skip_bad, suffix):
    with tempfile.TemporaryDirectory() as tmp:
        check(Path(tmp) / f"data{suffix}", "\n".join(lines).encode(), fmt, skip_bad)


@SETTINGS
@given(records=st.lists(record_like | chat_like | json_values, max_size=6),
       fmt=st.sampled_from([None, "alpaca", "messages", "oasst"]), skip_bad=st.booleans(), indent=st.sampled_from([None, 2]))
def test_json_lists_of_anything(records, fmt, skip_bad, indent):
    with tempfile.TemporaryDirectory() as tmp:
        check(Path(tmp) / "data.json", json.dumps(records, indent=indent).encode(), fmt, skip_bad)


@SETTINGS
@given(data=st.binary(max_size=200), suffix=st.sampled_from([".json", ".jsonl", ".csv", ".parquet"]),
       skip_bad=st.booleans())
def test_arbitrary_bytes_including_non_utf8(data, suffix, skip_bad):
    with tempfile.TemporaryDirectory() as tmp:
        check(Path(tmp) / f"data{suffix}", data, None, skip_bad)


@SETTINGS
@given(valid=st.lists(st.just(b'{"instruction": "a", "output": "b"}'), min_size=1, max_size=3),
       junk=st.binary(min_size=1, max_size=10).filter(lambda b: b"\n" not in b), position=st.integers(0, 3),
       skip_bad=st.booleans())
def test_one_corrupt_line_is_named_or_counted(valid, junk, position, skip_bad):
    lines = list(valid)
    lines.insert(min(position, len(lines)), b'{"instruction": "' + junk + b'", "output": "b"')
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        check(path, b"\n".join(lines), "alpaca", skip_bad)


@SETTINGS
@given(nodes=st.lists(st.tuples(st.integers(0, 8), st.one_of(st.none(), st.integers(0, 8)),
                                st.sampled_from(["prompter", "assistant"]), st.booleans(),
                                st.one_of(st.none(), st.integers(0, 3))), max_size=14),
       mode=st.sampled_from(["best", "all"]), nested=st.booleans())
def test_oasst_graphs_with_cycles_duplicates_and_missing_parents(nodes, mode, nested):
    records = [{"message_id": f"m{i}", "parent_id": None if p is None else f"m{p}", "role": role, "text": f"t{i}",
                "deleted": deleted, "rank": rank, "lang": "en", "review_result": True}
               for i, p, role, deleted, rank in nodes]
    if nested:  # the tree export: each record a prompt with replies (from the records, as far as they nest)
        records = [{"message_tree_id": r["message_id"], "prompt": {**r, "replies": records[:2]}} for r in records]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "oasst.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        try:
            conversations, stats = read_conversations(str(path), "oasst", ReadOptions(oasst_threads=mode))
        except DataError as e:
            assert str(e).startswith(str(path)) and not records, e
            return
        if not nested:
            assert stats.read == len(records)
            assert len(conversations) <= sum(1 for r in records if r["role"] == "assistant")
        for conversation in conversations:
            assert conversation["messages"][-1]["role"] == "assistant"
        texts = [tuple(m["content"] for m in c["messages"]) for c in conversations]
        assert len(texts) == len(set(texts)) or nested  # no thread twice (nested copies may repeat subtrees)


def test_empty_whitespace_huge_and_deeply_nested_files(tmp_path):
    for content in (b"", b"   \n\n", b"[]", b"[\n]", b"{}", b"null"):
        for suffix in (".json", ".jsonl"):
            check(tmp_path / f"e{suffix}", content, None, False)
    huge = "x" * 5_000_000
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps({"instruction": "Repeat.", "input": huge, "output": huge}) + "\n")
    (conversation,), _ = read_conversations(str(path), None, ReadOptions())
    assert conversation["messages"][-1]["content"] == huge
    csv_path = tmp_path / "huge.csv"
    csv_path.write_text(f"instruction,input,output\nRepeat.,,{huge}\n")
    assert read_conversations(str(csv_path), None, ReadOptions())[0][0]["messages"][-1]["content"] == huge
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    check(deep, deep.read_bytes(), None, False)
    check(deep, deep.read_bytes(), None, True)
    deep_list = tmp_path / "deep.json"
    deep_list.write_text("[" + "[" * 100_000 + "]" * 100_000 + "]")
    check(deep_list, deep_list.read_bytes(), None, False)


def test_lone_surrogates_are_named_not_passed_on(tmp_path):
    """JSON can spell an unpaired UTF-16 surrogate; Python reads it into a str that no tokenizer can encode."""
    for record, field in (({"instruction": "a", "output": "b\\ud800"}, "output"),
                          ({"messages": [{"role": "user", "content": "q"},
                                         {"role": "assistant", "content": [{"type": "text", "text": "\\udfff"}]}]},
                           "content"),
                          ({"message_id": "m", "parent_id": None, "role": "prompter", "text": "\\ud83d"}, "text")):
        path = tmp_path / "s.jsonl"
        path.write_text(json.dumps(record).replace("\\\\u", "\\u") + "\n")  # the JSON escape \ud800
        try:
            read_conversations(str(path), None, ReadOptions())
        except DataError as e:
            assert str(e).startswith(f"{path}:1") and f"'{field}' holds an unpaired surrogate" in str(e), e
        else:
            raise AssertionError(f"a lone surrogate in '{field}' was accepted")
        assert read_conversations(str(path), None, ReadOptions(skip_bad=True))[1].skipped == {"invalid record": 1}
