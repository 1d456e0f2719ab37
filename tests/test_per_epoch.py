"""Axolotl's --evals_per_epoch / --saves_per_epoch (sft/options/resolve.py per_epoch_counts_as_steps): the
Trainer's eval/save steps as a fraction of the run, so many times an epoch."""

from __future__ import annotations

import json

import pytest
from transformers.trainer_utils import IntervalStrategy


def test_counts_become_the_trainers_fraction_of_the_run():
    from sft.options.arguments import parse_args

    *_, training = parse_args(["--lora", "--evals_per_epoch", "4", "--saves_per_epoch", "1", "--num_train_epochs",
                               "2", "--eval_split", "0.1"], data_only=True)
    assert (training.eval_strategy, training.eval_steps) == (IntervalStrategy.STEPS, 1 / 8)
    assert training.save_strategy == IntervalStrategy.EPOCH  # once an epoch: the Trainer's own


@pytest.mark.parametrize("argv, message", [
    (["--evals_per_epoch", "2", "--eval_steps", "10"], "--evals_per_epoch 2 with --eval_steps: .* keep one"),
    (["--evals_per_epoch", "2", "--max_steps", "10"], "--evals_per_epoch 2 with --max_steps"),
    (["--saves_per_epoch", "2", "--save_strategy", "no"], "--saves_per_epoch 2 with --save_strategy"),
    (["--saves_per_epoch", "-1"], "give how many times an epoch"),
    (["--evals_per_epoch", "3", "--eval_split", "0"], "--evals_per_epoch 3 needs held-out data: .* or leave "
                                                      "--evals_per_epoch out"),
])
def test_a_count_beside_what_it_sets_is_refused_before_loading(argv, message):
    from sft.errors import ConfigError
    from sft.options.arguments import parse_args

    with pytest.raises(ConfigError, match=message):
        parse_args(["--lora", "--eval_split", "0.1", *argv], data_only=True)


def test_the_demo_evaluates_and_saves_so_many_times_an_epoch(tmp_path, monkeypatch, capsys):
    """The demo (the tiny model on data/), one epoch: two evaluations and two checkpoints, at half the epoch and its
    end (sft.train.main in this process, as test_early_stopping's run)."""
    from sft.train import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    output = tmp_path / "out"
    code = main(["--num_train_epochs", "1", "--evals_per_epoch", "2", "--saves_per_epoch", "2", "--max_samples",
                 "64", "--per_device_train_batch_size", "2", "--report_to", "none", "--output_dir", str(output),
                 "--dataset_cache_dir", str(tmp_path / "cache")])
    said = capsys.readouterr()
    assert code == 0, (said.out + said.err)[-3000:]
    logs = [json.loads(line) for line in (output / "trainer_log.jsonl").read_text().splitlines()]
    last = max(log["step"] for log in logs if "step" in log)
    evaluated = [log["step"] for log in logs if "eval_loss" in log]
    assert last >= 4 and evaluated == [-(-last // 2), last], (last, evaluated)
    kept = sorted(int(p.name.split("-")[1]) for p in output.glob("checkpoint-*"))
    assert kept == [-(-last // 2), last]
