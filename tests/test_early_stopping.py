"""--early_stopping_patience (sft/safety/early_stopping.py): transformers' EarlyStoppingCallback on the eval loss, a
line that says why the run stopped, and --load_best_model_at_end's best checkpoint kept by our rotation."""

from __future__ import annotations

import json

import pytest



def test_a_run_whose_eval_loss_stops_improving_stops_and_keeps_its_best_checkpoint(tmp_path, monkeypatch, capsys):
    """At learning rate 0 the eval loss never improves after the first evaluation: with patience 2 the run stops at
    its third evaluation (step 3 of 20), says so, ends on the best (first) checkpoint's weights, and our rotation
    (--save_total_limit 1) keeps that checkpoint beside the last one. The run is sft.train.main in this process (as
    test_modules_to_save's run), not a new one: a Python start with torch and transformers is ~5 s of the ~8."""
    from sft.train import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    output = tmp_path / "out"
    code = main(["--lora", "--max_steps", "20", "--eval_strategy", "steps", "--eval_steps", "1",
                 "--early_stopping_steps", "2",  # LLaMA-Factory's name for --early_stopping_patience
                 "--learning_rate", "0", "--logging_steps", "1", "--report_to", "none",
                 "--load_best_model_at_end", "true", "--save_strategy", "steps", "--save_steps", "1",
                 "--save_total_limit", "1", "--max_samples", "48", "--max_length", "128",
                 "--output_dir", str(output),
                 "--dataset_cache_dir", str(tmp_path / "cache")])
    said = capsys.readouterr()
    assert code == 0, (said.out + said.err)[-3000:]
    assert "--early_stopping_steps is LLaMA-Factory's name for --early_stopping_patience" in said.err
    assert ("Stopped early at step 3: eval_loss has not improved for 2 evaluations (best "
            in said.out), said.out[-2000:]
    assert f"checkpoint {output / 'checkpoint-1'})" in said.out
    assert "checkpoints  every step (the last 1 and the best kept)" in said.out
    assert sorted(p.name for p in output.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-3"]
    steps = [json.loads(line)["step"] for line in (output / "trainer_log.jsonl").read_text().splitlines()
             if '"loss"' in line and '"step"' in line]
    assert max(steps) == 3


@pytest.mark.parametrize("argv, message", [
    (["--early_stopping_patience", "3", "--eval_strategy", "no"], "this run evaluates nothing: add --eval_strategy"),
    (["--early_stopping_patience", "-1"], "give a number of evaluations"),
    (["--early_stopping_patience", "2", "--early_stopping_threshold", "-0.1"], "a change >= 0"),
])
def test_early_stopping_without_evaluations_is_refused_before_loading(argv, message):
    from sft.errors import ConfigError
    from sft.options.arguments import parse_args

    with pytest.raises(ConfigError, match=message):
        parse_args(["--lora", *argv], data_only=True)


def test_the_eval_loss_is_watched_unless_a_metric_is_given():
    from sft.options.arguments import parse_args

    *_, training = parse_args(["--lora", "--early_stopping_patience", "2", "--eval_strategy", "steps",
                               "--eval_split", "0.1"], data_only=True)
    assert (training.metric_for_best_model, training.greater_is_better) == ("loss", False)
    *_, training = parse_args(["--lora", "--early_stopping_patience", "2", "--eval_strategy", "steps",
                               "--eval_split", "0.1", "--metric_for_best_model", "perplexity",
                               "--greater_is_better", "false"], data_only=True)
    assert training.metric_for_best_model == "perplexity"
