"""Preparation end to end: summary, multi-process tokenization equal to one process, the cache reused by a second
run, and `python -m sft.data.dataset` auditing masks before any model is loaded."""

from __future__ import annotations

import json

import pytest

from conftest import ALPACA_SAMPLE, DEEPSEEK_TOKENIZER, OASST_SAMPLE, needs_shared
from sft.data import dataset as data_module
from sft.options.arguments import DataArguments
from sft.data.dataset import prepare, read_datasets

pytestmark = needs_shared


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEEPSEEK_TOKENIZER)


def args_for(tmp_path, **overrides) -> DataArguments:
    options = dict(dataset=[str(ALPACA_SAMPLE), str(OASST_SAMPLE)], max_length=512, packing=True,
                   dataset_cache_dir=str(tmp_path / "cache"), num_proc=1)
    return DataArguments(**(options | overrides))


def test_summary_counts_lengths_and_packing_efficiency(tmp_path, tokenizer):
    args = args_for(tmp_path, overlong="drop")
    train, evaluation, summary = prepare(args, tokenizer, read_datasets(args))
    lines = summary.splitlines()
    assert lines[0] == "Data: 3039 records read, 2094 conversations kept (template deepseek_coder)"
    assert lines[1:3] == [f"  {ALPACA_SAMPLE}: 2000 records read, 2000 conversations used",
                          f"  {OASST_SAMPLE}: 1039 records read, 94 conversations used"]
    assert "  skipped (deleted or failed review): 44" in lines
    dropped = next(int(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("  too long (dropped):"))
    assert dropped > 0
    assert any(line.startswith("  tokens per example: p50 ") for line in lines)
    kept_tokens = sum(sum(row) for row in train["seq_lengths"])
    assert f"{2094 - dropped} examples, {kept_tokens} tokens" in summary  # one example per conversation here
    efficiency = kept_tokens / (len(train) * 512)
    assert f"packing efficiency {efficiency:.1%}" in summary and efficiency > 0.9
    assert evaluation is None
    assert max(len(row) for row in train["input_ids"]) <= 512


def test_second_run_loads_the_cache_without_tokenizing(tmp_path, tokenizer, monkeypatch):
    args = args_for(tmp_path, eval_split=0.1)
    conversations = read_datasets(args, seed=3)
    first_train, first_eval, first_summary = prepare(args, tokenizer, conversations)
    assert len(list((tmp_path / "cache").iterdir())) == 1

    def no_tokenizing(*a, **k):
        raise AssertionError("the second run must load the cache, not tokenize")

    monkeypatch.setattr(data_module, "tokenize", no_tokenizing)
    train, evaluation, summary = prepare(args, tokenizer, read_datasets(args, seed=3))
    assert "prepared data loaded from the cache" in summary and summary.startswith(first_summary)
    assert train["input_ids"] == first_train["input_ids"] and evaluation["labels"] == first_eval["labels"]
    # Anything the data depends on makes a new entry: another seed moves the eval split.
    monkeypatch.undo()
    prepare(args, tokenizer, read_datasets(args, seed=4))
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_two_processes_give_the_same_rows_as_one(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(data_module, "PARALLEL_FROM", 1)
    args = args_for(tmp_path, packing=False, dataset=[str(ALPACA_SAMPLE)], max_samples=600)
    conversations = read_datasets(args)
    one, _, _ = prepare(args, tokenizer, conversations)
    two, _, _ = prepare(args_for(tmp_path / "2", packing=False, dataset=[str(ALPACA_SAMPLE)], max_samples=600,
                                 num_proc=2), tokenizer, conversations)
    assert one["input_ids"] == two["input_ids"] and one["labels"] == two["labels"]


def test_show_masks_standalone_prints_marked_examples_before_any_model(tmp_path, capsys):
    from sft.data.dataset import main

    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Capital of France?"},
                                             {"role": "assistant", "content": "Paris."}]}) + "\n")
    code = main(["--model", str(DEEPSEEK_TOKENIZER), "--dataset", str(data), "--dataset_cache_dir",
                 str(tmp_path / "cache"), "--output_dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0
    assert f"--- {data}:1: " in out and "### Response:\n[[Paris.\n<|EOT|>]]" in out
    assert "Data: 1 records read, 1 conversations kept (template deepseek_coder)" in out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": "oops"}\n')
    assert main(["--model", str(DEEPSEEK_TOKENIZER), "--dataset", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad}:1: field 'messages' must be a list")
