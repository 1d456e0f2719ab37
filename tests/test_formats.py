"""Readers: every input kind and format, the real shared samples, and bad data named by file and line."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from conftest import OASST_SAMPLE, needs_shared
from sft.options.arguments import DataArguments
from sft.data.dataset import read_datasets
from sft.data.formats import DataError, ReadOptions, read_conversations


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def read(path, fmt=None, **options):
    return read_conversations(str(path), fmt, ReadOptions(**options))


ALPACA = [
    {"instruction": "Add 2 and 3.", "input": "", "output": "5"},
    {"instruction": "Translate to French.", "input": "cat", "output": "chat", "extra": 1},
    {"instruction": "Nenne die Hauptstadt.", "input": "Frankreich", "output": "Paris ist die Hauptstadt. 巴黎"},
]


# ------------------------------------------------------------------------------------------------ inputs


def test_json_list_jsonl_single_object_parquet_csv_read_the_same(tmp_path):
    import pandas as pd

    (tmp_path / "list.json").write_text(json.dumps(ALPACA, indent=4, ensure_ascii=False))
    write_jsonl(tmp_path / "lines.jsonl", ALPACA)
    write_jsonl(tmp_path / "lines.json", ALPACA)  # JSON Lines under a .json name
    pd.DataFrame(ALPACA).to_parquet(tmp_path / "table.parquet")
    pd.DataFrame(ALPACA).to_csv(tmp_path / "table.csv", index=False)
    results = {name: read(tmp_path / name)[0] for name in
               ("list.json", "lines.jsonl", "lines.json", "table.parquet", "table.csv")}
    expected = [c["messages"] for c in results["list.json"]]
    assert len(expected) == 3
    for name, conversations in results.items():
        assert [c["messages"] for c in conversations] == expected, name
    # Each conversation knows where it came from: the line of its record in a JSON list.
    assert [c["source"].rsplit(":", 1)[1] for c in results["list.json"]] == ["2", "7", "13"]
    assert results["lines.jsonl"][2]["source"].endswith("lines.jsonl:3")
    assert results["table.parquet"][0]["source"].endswith("table.parquet:row 1")
    (tmp_path / "one.json").write_text(json.dumps(ALPACA[0], indent=2))
    assert [c["messages"] for c in read(tmp_path / "one.json")[0]] == expected[:1]


def test_hub_names_go_through_datasets_load_dataset(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        if name == "missing/dataset":
            raise FileNotFoundError("Dataset 'missing/dataset' doesn't exist on the Hub")
        return datasets.Dataset.from_list(ALPACA)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    conversations, stats = read("tatsu-lab/alpaca:train[:3]")
    assert calls == [("tatsu-lab/alpaca", "train[:3]")] and stats.kept == 3
    assert conversations[0]["source"] == "tatsu-lab/alpaca:train[:3]:row 1"
    with pytest.raises(DataError, match="missing/dataset: cannot load from the hub"):
        read("missing/dataset")


def test_several_datasets_mixed_with_eval_split_and_max_samples(tmp_path):
    alpaca = write_jsonl(tmp_path / "a.jsonl", ALPACA * 10)
    chat = write_jsonl(tmp_path / "c.jsonl", [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(20)])
    args = DataArguments(dataset=[str(alpaca), str(chat)], max_samples=8, eval_split=0.25)
    data = read_datasets(args, seed=0)
    assert len(data.train) + len(data.eval) == 16 and len(data.eval) == 4
    sources = Counter(Path(c["source"].rsplit(":", 1)[0]).name for c in data.train + data.eval)
    assert sources == {"a.jsonl": 8, "c.jsonl": 8}
    assert data.stats.read == 50 and data.stats.kept == 16 and data.stats.capped == 34  # kept: what trains
    again = read_datasets(args, seed=0)
    assert again.eval == data.eval  # the split is deterministic for a seed
    separate = read_datasets(DataArguments(dataset=[str(alpaca)], eval_dataset=[str(chat)]), seed=0)
    assert len(separate.train) == 30 and len(separate.eval) == 20


# ------------------------------------------------------------------------------------------------ alpaca


@pytest.mark.parametrize("placeholder", ["", "  ", "No input", "Noinput", "<noinput>", "< noinput >", "<No Input>",
                                         "N/A", "None", "no input."])
def test_alpaca_input_placeholders_mean_no_input(tmp_path, placeholder):
    path = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Name a color.", "input": placeholder,
                                               "output": "Blue."}])
    (conversation,), _ = read(path)
    assert conversation["messages"] == [{"role": "user", "content": "Name a color.", "input": ""},
                                        {"role": "assistant", "content": "Blue."}]


def test_alpaca_skips_empty_outputs_and_keeps_non_english_and_extra_keys(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ALPACA + [{"instruction": "x", "input": "", "output": "  "},
                                                       {"instruction": "", "input": "", "output": "y"}])
    conversations, stats = read(path)
    assert stats.read == 5 and stats.kept == 3
    assert stats.skipped == {"empty output": 1, "empty instruction": 1}
    assert conversations[2]["messages"][1]["content"] == "Paris ist die Hauptstadt. 巴黎"
    assert conversations[1]["messages"][0] == {"role": "user", "content": "Translate to French.", "input": "cat"}


def test_alpaca_system_and_history(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "And 3+3?", "input": "", "output": "6",
                                               "system": "Be brief.", "history": [["2+2?", "4"]]}])
    (conversation,), _ = read(path)
    assert [(m["role"], m["content"]) for m in conversation["messages"]] == [
        ("system", "Be brief."), ("user", "2+2?"), ("assistant", "4"), ("user", "And 3+3?"), ("assistant", "6")]


@needs_shared
def test_real_alpaca_sample_reads_in_full():
    from conftest import ALPACA_SAMPLE

    conversations, stats = read(ALPACA_SAMPLE)
    assert stats.read == 2000 and stats.kept == 2000 and not stats.skipped
    records = json.loads(ALPACA_SAMPLE.read_text())
    placeholders = [r for r in records if r["input"].strip().lower() in ("no input", "noinput", "<no input>")]
    assert placeholders  # the real data has them ...
    by_source = {int(c["source"].rsplit(":", 1)[1]): c for c in conversations}
    assert all(c["messages"][-2]["input"] == "" for c in conversations
               if c["messages"][-2]["content"] in {r["instruction"] for r in placeholders})  # ... and they go
    assert len(by_source) == 2000


# ------------------------------------------------------------------------------------------------ messages


def test_openai_messages_and_sharegpt_conversations_with_system_prompts(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [
        {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
                      {"role": "user", "content": "Bye"}]},
        {"system": "Sys.", "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"},
                                             {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]},
        {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "only a question"}]},
    ])
    conversations, stats = read(path)
    assert conversations[0]["messages"] == [{"role": "system", "content": "You are terse."},
                                            {"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": "Hello"}]  # trailing user turn dropped
    assert [m["role"] for m in conversations[1]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert conversations[1]["messages"][0]["content"] == "Sys."
    assert stats.skipped == {"no assistant reply": 1}


# The same two-round tool conversation in OpenAI form and in LLaMA-Factory's ShareGPT (glaive) form.
WEATHER = {"name": "get_weather", "description": "Weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
OPENAI_TOOLS = {
    "tools": [{"type": "function", "function": WEATHER}],
    "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Zürich and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21°C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "3°C"},
        {"role": "assistant", "content": "Zürich 21°C, Oslo 3°C."}]}
SHAREGPT_TOOLS = {
    "system": "Be brief.", "tools": json.dumps([WEATHER]),
    "conversations": [
        {"from": "human", "value": "Weather in Zürich and Oslo?"},
        {"from": "function_call", "value": json.dumps([{"name": "get_weather", "arguments": {"city": "Zürich"}},
                                                       {"name": "get_weather", "arguments": '{"city":"Oslo"}'}])},
        {"from": "observation", "value": "21°C"}, {"from": "observation", "value": "3°C"},
        {"from": "gpt", "value": "Zürich 21°C, Oslo 3°C."}]}


def test_openai_and_sharegpt_tool_calls_read_to_the_same_conversation(tmp_path):
    (openai,), _ = read(write_jsonl(tmp_path / "openai.jsonl", [OPENAI_TOOLS]))
    (sharegpt,), _ = read(write_jsonl(tmp_path / "sharegpt.jsonl", [SHAREGPT_TOOLS]))
    assert openai["messages"] == sharegpt["messages"]
    messages = openai["messages"]
    assert [m["role"] for m in messages] == ["tools", "system", "user", "assistant", "tool", "tool", "assistant"]
    # glaive's bare function definitions are wrapped into OpenAI's form; the definitions keep their key order.
    assert json.loads(messages[0]["content"]) == [{"type": "function", "function": WEATHER}]
    # Arguments given as an object: json.dumps with its default separators; given as text: kept as written.
    assert [c["function"]["arguments"] for c in messages[3]["tool_calls"]] == ['{"city": "Zürich"}', '{"city":"Oslo"}']
    assert messages[3]["content"] == "" and messages[3]["tool_calls"][0]["type"] == "function"


def test_sharegpt_single_call_and_conversation_without_tools_field(tmp_path):
    record = {"conversations": [{"from": "human", "value": "Time?"},
                                {"from": "function_call", "value": '{"name": "now", "arguments": {}}'},
                                {"from": "observation", "value": "12:00"}, {"from": "gpt", "value": "Noon."}],
              "tools": ""}
    (conversation,), _ = read(write_jsonl(tmp_path / "one.jsonl", [record]))
    assert conversation["messages"][1]["tool_calls"] == [{"type": "function",
                                                          "function": {"name": "now", "arguments": "{}"}}]
    assert conversation["messages"][0]["role"] == "user"  # no definitions: no tools message


def test_text_beside_openai_calls_is_kept_for_the_template(tmp_path):
    """R1 reasons before it calls: the reader keeps that text as the turn's content (R1's template writes it; V3's
    and the distills' refuse it when the conversation is rendered, tests/test_tool_calls.py)."""
    record = {"messages": [{"role": "user", "content": "q"},
                           {"role": "assistant", "content": "<think>\nLook it up.\n</think>\n\n",
                            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                           {"role": "tool", "content": "1"}, {"role": "assistant", "content": "One."}]}
    (conversation,), _ = read(write_jsonl(tmp_path / "m.jsonl", [record]))
    assert conversation["messages"][1]["content"] == "<think>\nLook it up.\n</think>\n\n"
    assert conversation["messages"][1]["tool_calls"][0]["function"]["name"] == "f"


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                                      "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]},
     r"m.jsonl:1: messages\[1\].tool_calls\[0\]: a tool call needs a non-empty string 'name'"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "get_weather(Oslo)"}]},
     r"m.jsonl:1: conversations\[1\]: a function_call value must be JSON"),
    ({"tools": "[{name: 1}]", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
     r"m.jsonl:1: field 'tools' is not valid JSON"),
    ({"tools": [{"description": "no name"}], "messages": [{"role": "user", "content": "q"},
                                                          {"role": "assistant", "content": "a"}]},
     r"m.jsonl:1: field 'tools' must be a list of function definitions"),
])
def test_bad_tool_records_are_named_and_skippable(tmp_path, record, message):
    path = write_jsonl(tmp_path / "m.jsonl", [record])
    with pytest.raises(DataError, match=message):
        read(path)
    assert read(path, skip_bad=True)[1].skipped == {"invalid record": 1}


# ------------------------------------------------------------------------------------------------ oasst


def oasst(mid, parent, role, text="t", **extra):
    return {"message_id": mid, "parent_id": parent, "role": role, "text": text or mid, "lang": "en", "rank": None,
            "deleted": False, "review_result": True, "message_tree_id": "r", **extra}


def expected_oasst_all_threads(records: list[dict]) -> int:
    """Independent count of --oasst_threads all: drop deleted/failed-review messages with their subtrees; every
    leaf is a thread; a thread ending in an unanswered prompt is cut back to its reply and counted once, and only
    if no longer thread continues that reply."""
    by_id = {r["message_id"]: r for r in records}

    def alive(r):
        while r is not None:
            if r["deleted"] or r["review_result"] is False:
                return False
            r = by_id.get(r["parent_id"])
        return True

    kept = {k: r for k, r in by_id.items() if alive(r)}
    children: dict = {}
    for r in kept.values():
        children.setdefault(r["parent_id"], []).append(r)

    def reaches_reply_leaf(r):
        kids = children.get(r["message_id"], [])
        return any(reaches_reply_leaf(k) for k in kids) if kids else r["role"] == "assistant"

    leaves = [r for r in kept.values() if r["message_id"] not in children]
    reply_leaves = sum(r["role"] == "assistant" for r in leaves)
    cut_back = {r["parent_id"] for r in leaves if r["role"] == "prompter" and r["parent_id"]
                and not reaches_reply_leaf(by_id[r["parent_id"]])}
    return reply_leaves + len(cut_back)


@needs_shared
def test_real_oasst_sample_best_and_all_threads():
    records = [json.loads(line) for line in OASST_SAMPLE.read_text().splitlines()]
    best, stats = read(OASST_SAMPLE)
    assert stats.read == 1039 and len(best) == 94  # one thread per tree
    assert stats.skipped == {"deleted or failed review": 44}
    everything, stats_all = read(OASST_SAMPLE, oasst_threads="all")
    # 521 leaves; the 44 deleted/failed-review messages are all leaves, 15 of their parents become leaves:
    # 492 leaves = 352 ending in a reply + 140 unanswered prompts; those cut back to 114 distinct replies that no
    # longer thread continues (the other 26 are repeats or parts of longer threads): 352 + 114 = 466.
    assert len(everything) == expected_oasst_all_threads(records) == 466
    assert stats_all.skipped["unanswered prompt (its thread is part of a longer one)"] == 26
    assert all(c["messages"][-1]["role"] == "assistant" for c in everything)
    assert len({json.dumps(c["messages"]) for c in everything}) == 466  # no duplicate threads
    # The best thread of a tree follows the rank-0 reply at every step.
    ranks = {(r["parent_id"], r["text"]): r["rank"] for r in records}
    first = best[0]["messages"]
    assert all(ranks[key] in (0, None) for key in ranks if key[1] in [m["content"] for m in first[1:]])


def nested_trees(records: list[dict]) -> list[dict]:
    """The OASST `*.trees.jsonl` export: one line per tree, each message with its `replies`."""
    nodes = {r["message_id"]: {k: v for k, v in r.items() if k != "parent_id"} | {"replies": []} for r in records}
    trees = []
    for r in records:
        if r["parent_id"] is None:
            trees.append({"message_tree_id": r["message_tree_id"], "tree_state": "ready_for_export",
                          "prompt": nodes[r["message_id"]]})
        else:
            nodes[r["parent_id"]]["replies"].append(nodes[r["message_id"]])
    return trees


@needs_shared
@pytest.mark.parametrize("mode", ["best", "all"])
def test_nested_tree_export_reads_like_the_flat_one(tmp_path, mode):
    records = [json.loads(line) for line in OASST_SAMPLE.read_text().splitlines()]
    path = write_jsonl(tmp_path / "oasst1_sample.trees.jsonl", nested_trees(records))
    assert len(path.read_text().splitlines()) == 94
    flat, flat_stats = read(OASST_SAMPLE, oasst_threads=mode)
    nested, nested_stats = read(path, oasst_threads=mode)
    assert [c["messages"] for c in nested] == [c["messages"] for c in flat]
    assert nested_stats.read == flat_stats.read == 1039 and nested_stats.skipped == flat_stats.skipped
    assert nested[0]["source"].endswith("oasst1_sample.trees.jsonl:1")


def test_oasst_language_filter_deleted_orphans_cycles_and_duplicates_are_counted(tmp_path):
    path = write_jsonl(tmp_path / "o.jsonl", [
        oasst("p1", None, "prompter", "Bonjour", lang="fr"), oasst("a1", "p1", "assistant", "Salut", lang="fr"),
        oasst("p2", None, "prompter", "Hi"), oasst("a2", "p2", "assistant", "Hello", rank=1),
        oasst("a3", "p2", "assistant", "Best hello", rank=0),
        oasst("a4", "p2", "assistant", "Deleted", deleted=True), oasst("p4", "a4", "prompter", "below deleted"),
        oasst("a5", "p2", "assistant", "Failed review", review_result=False),
        oasst("x1", "missing", "assistant", "orphan"),
        oasst("c1", "c2", "prompter", "cycle"), oasst("c2", "c1", "assistant", "cycle"),
        oasst("a2", "p2", "assistant", "duplicate id"),
    ])
    best, stats = read(path)
    assert [[m["content"] for m in c["messages"]] for c in best] == [["Bonjour", "Salut"], ["Hi", "Best hello"]]
    assert stats.read == 12
    assert stats.skipped == {"duplicate message_id": 1, "orphan message (parent missing)": 1,
                             "deleted or failed review": 2, "below a skipped message, or in a cycle": 3}
    english, stats = read(path, languages=("en",), oasst_threads="all")
    assert [[m["content"] for m in c["messages"]] for c in english] == [["Hi", "Best hello"], ["Hi", "Hello"]]
    assert stats.skipped["language filtered out"] == 2  # both French messages


# ------------------------------------------------------------------------------------------------ bad data


@pytest.mark.parametrize("content, message", [
    ('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": 5}\n',
     r"bad.jsonl:2: field 'output' must be a string, got int 5"),
    ('{"instruction": "a", "output": "b"}\n{"instruction": "a", "outp\n', r"bad.jsonl:2: invalid JSON"),
    ('{"instruction": "a", "output": "b"}\n["not", "an", "object"]\n', r"bad.jsonl:2: expected a JSON object"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]}\n',
     r"bad.jsonl:1: messages\[1\].role is 'robot'; expected one of"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]}\n',
     r"bad.jsonl:1: messages\[1\]: field 'content' must be a string, got missing"),
    ('{"message_id": "m", "parent_id": null, "role": "prompter", "text": ["x"]}\n',
     r"bad.jsonl:1: field 'text' must be a string, got list"),
    ('{"hello": 1}\n', r"bad.jsonl:1: cannot tell the dataset format from the record's keys \['hello'\]"),
    ("", r"bad.jsonl: the file is empty"),
    ('\n\n', r"bad.jsonl: the file is empty"),
])
def test_bad_records_name_file_line_field_and_expectation(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        read(path)


def test_bad_json_list_element_is_named_by_line_and_non_utf8_by_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "a", "output": "b",}\n]')
    with pytest.raises(DataError, match=r"bad.json:3: invalid JSON"):
        read(path)
    path.write_bytes(b'{"instruction": "a", "output": "b"}\n{"instruction": "caf\xe9", "output": "b"}\n')
    with pytest.raises(DataError, match=r"bad.json:2: not valid UTF-8"):
        read(path)


def test_skip_bad_records_counts_instead_of_stopping(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": 5}\n[1]\n'
                    '{"instruction": "c", "output": "d", "input": null}\n')
    conversations, stats = read(path, skip_bad=True)
    assert len(conversations) == 2 and stats.read == 4 and stats.skipped == {"invalid record": 2}


def test_train_entry_point_prints_one_line_exit_2_no_traceback(tmp_path, capsys):
    from sft.train import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": 5}\n')
    code = main(["--dataset", str(bad), "--output_dir", str(tmp_path / "out"), "--report_to", "none"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err.startswith(f"error: {bad}:2: field 'output' must be a string") and "--skip_bad_records" in err
    assert not (tmp_path / "out").exists()


def test_a_directory_given_as_dataset_names_its_data_files(tmp_path):
    # was: "<dir>: no such file", for a directory the user can see (e.g. a hub dataset downloaded as files)
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "train.jsonl", ALPACA)
    with pytest.raises(DataError, match=rf"a directory; --dataset takes data files, e.g. {tmp_path}/data/train.jsonl"):
        read(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"\(.json, .jsonl, .parquet or .csv\), and it holds none"):
        read(tmp_path / "empty")
