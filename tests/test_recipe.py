"""`--config recipe.yaml` holds the same options as the command line, which wins over it; no arguments = demo."""

from __future__ import annotations

from pathlib import Path

import pytest

from sft.options.arguments import DEMO, TINY_MODEL, ConfigError, parse_args


def test_recipe_equals_command_line(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: some/model\ndataset: [a.json, b.jsonl]\ndataset_format: alpaca\nlora: true\n"
                      "lora_r: 8\nlearning_rate: 2.0e-4\noutput_dir: out\nmax_steps: 7\npacking: false\n")
    from_recipe = parse_args(["--config", str(recipe)])
    from_cli = parse_args(["--model", "some/model", "--dataset", "a.json", "b.jsonl", "--dataset_format", "alpaca",
                           "--lora", "--lora_r", "8", "--learning_rate", "2e-4", "--output_dir", "out",
                           "--max_steps", "7"])
    for a, b in zip(from_recipe, from_cli):
        assert a == b


def test_command_line_wins_over_recipe(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: some/model\ndataset: a.json\nmax_steps: 7\nlora: true\n")
    model_args, data_args, lora_args, training_args = parse_args(
        ["--config", str(recipe), "--max_steps", "3", "--lora", "false"])
    assert training_args.max_steps == 3 and lora_args.lora is False and data_args.dataset == ["a.json"]


def test_no_arguments_is_the_demo():
    model_args, data_args, _, training_args = parse_args([])
    assert model_args.model == TINY_MODEL
    assert data_args.dataset == DEMO["dataset"]
    assert Path(training_args.output_dir).parent == Path("output", TINY_MODEL, "full")  # a new directory, as any run
    # demo defaults give way to what the user sets
    assert parse_args(["--num_train_epochs", "1"])[3].num_train_epochs == 1


def test_bad_recipe_names_file_and_line(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model: x\ndataset: [a.json\nlora: true\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+: invalid YAML"):
        parse_args(["--config", str(recipe)])
    with pytest.raises(ConfigError, match="missing.yaml: no such file; give a recipe file or a shipped recipe's"):
        parse_args(["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(ConfigError, match="cannot read the file"):
        parse_args(["--config", str(tmp_path)])  # a directory


def test_unknown_option_in_recipe_is_an_error(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: x\ndataset: a.json\nlearning_rat: 1e-4\n")
    with pytest.raises(ConfigError, match="--learning_rat .did you mean --learning_rate"):
        parse_args(["--config", str(recipe)])


def test_a_bad_recipe_line_names_the_recipe(tmp_path):
    # was: the same words as a command-line error, so the user looked for --lora_rnk on the command line; and a list
    # given to a one-value option said "unknown option(s): 2"
    def refused(text: str, *extra: str) -> str:
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(f"model: x\ndataset: a.json\n{text}\n")
        with pytest.raises(ConfigError) as e:
            parse_args(["--config", str(recipe), *extra])
        return str(e.value)

    recipe = str(tmp_path / "recipe.yaml")
    assert refused("lora_rnk: 8").startswith(f"{recipe}: unknown option(s): --lora_rnk (did you mean --lora_r?)")
    assert refused("lora: maybe").startswith(f"{recipe}: argument --lora: Truthy value expected")
    assert refused("max_steps: [1, 2]").startswith(f"{recipe}: unexpected value(s) 2: an option takes one value")
    assert refused("cutoff_len: 64", "--lora_rnk", "8").startswith("unknown option(s): --lora_rnk")  # the command line's
    assert refused("lora_r: 8", "--max_steps", "3", "4").startswith("unexpected value(s) 4")


def test_lora_target_modules_as_one_comma_separated_string(tmp_path):
    """`lora_target_modules: q_proj, v_proj` (a YAML string, as LLaMA-Factory writes its targets) and
    `--lora_target_modules q_proj,v_proj` are two module names, not one; `all` is every linear layer."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: some/model\ndataset: a.json\nlora: true\nlora_target_modules: q_proj, v_proj\n")
    assert parse_args(["--config", str(recipe)])[2].lora_target_modules == ["q_proj", "v_proj"]
    lora_args = parse_args(["--model", "m", "--dataset", "a.json", "--lora", "--lora_target_modules", "q_proj,v_proj",
                            "o_proj"])[2]
    assert lora_args.lora_target_modules == ["q_proj", "v_proj", "o_proj"]
    assert parse_args(["--model", "m", "--dataset", "a.json", "--lora", "--lora_target_modules", "all"])[2].lora_target_modules \
        == ["all-linear"]
