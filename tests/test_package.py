"""What a wheel install carries and finds: the accelerate and DeepSpeed configs, the recipes, the demo data and the
planner's fitted numbers as package data (one copy in git; the repository's accelerate_configs/, ds_configs/,
recipes/ and data/*.json(l) link to them), a shipped config or recipe by its bare name from any directory, and a
snapshot that stays equal to what the planner fits from bench/results.jsonl."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO
from sft import cli
from sft.configs import ACCELERATE_CONFIGS, CONFIGS, DEMO_DATA, RECIPES, shipped_names, shipped_recipe_names
from sft.errors import ConfigError
from sft.options.arguments import DEMO, read_options
from sft.parallel.strategies import STRATEGIES
from sft.plan import planner, rows, speed
from sft.plan.planner import main
from sft.plan.plans import Box, best_plan, enumerate_plans
from sft.plan.refit import fitted_numbers
from sft.plan.rows import RESULTS
from sft.plan.shapes import SHAPES, resolve_shape
from sft.plan.snapshot import FITTED, SNAPSHOT_COMMAND
from sft.plan.speed import routed_expert_cost

LINKS = {"accelerate_configs": "sft/configs/accelerate_configs", "ds_configs": "sft/configs/ds_configs",
         "recipes": "sft/configs/recipes", "data/alpaca_demo.json": "sft/data/demo/alpaca_demo.json",
         "data/oasst_demo.jsonl": "sft/data/demo/oasst_demo.jsonl"}
SHIPPED = [f"sft/configs/accelerate_configs/{n}" for n in shipped_names()] + \
    [f"sft/configs/ds_configs/{p.name}" for p in (CONFIGS / "ds_configs").glob("*.json")] + \
    [f"sft/configs/recipes/{n}" for n in shipped_recipe_names()] + \
    ["sft/data/demo/alpaca_demo.json", "sft/data/demo/oasst_demo.jsonl", "sft/plan/fitted.json"]
PLAN = ["plan", "--model", "deepseek-llm-7b", "--gpus", "3", "--gpu_mem", "24", "--lora"]


def test_the_snapshot_is_what_the_planner_fits_from_the_bench_rows_today():
    snapshot = json.loads(FITTED.read_text())
    fitted = json.loads(json.dumps(fitted_numbers()))
    assert snapshot == fitted, (f"sft/plan/fitted.json is not what the planner fits from bench/results.jsonl: run "
                                f"`{SNAPSHOT_COMMAND}` and commit sft/plan/fitted.json")


def test_a_new_bench_row_changes_the_fit(tmp_path):
    """The check above can fail: one more measured row moves the numbers the plans read."""
    rows = [json.loads(x) for x in RESULTS.read_text().splitlines() if x.strip()]
    ddp = next(r for r in rows if r.get("name") == "lora-ddp")
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in [*rows, {**ddp, "name": "new", "mfu": 0.9}]))
    assert fitted_numbers(results) != fitted_numbers()


def test_plans_read_the_snapshot_not_the_bench_rows(monkeypatch):
    def no_rows(*_):
        raise AssertionError("a plan read bench/results.jsonl")

    shape = resolve_shape("deepseek-llm-7b")
    before = best_plan(enumerate_plans(shape, Box(3, 24), "lora", 2048))
    for module in (rows, speed):  # the rows module, and the speed model that reads rows from it
        monkeypatch.setattr(module, "bench_rows", no_rows)
        monkeypatch.setattr(module, "measured_rows", no_rows)
    after = best_plan(enumerate_plans(shape, Box(3, 24), "lora", 2048))
    assert (after.w, after.tok_s, after.tok_s_source) == (before.w, before.tok_s, before.tok_s_source)
    assert after.w.strategy == "ddp"
    moe = SHAPES["deepseek-v2-lite"]
    assert routed_expert_cost(moe)[0] > 1  # its bench/moe_layer.py row, from the snapshot


def test_the_repository_paths_are_links_to_the_shipped_files():
    staged = subprocess.run(["git", "ls-files", "-s", *LINKS], cwd=REPO, capture_output=True, text=True).stdout
    modes = {line.split("\t")[1]: line.split()[0] for line in staged.splitlines()}
    assert modes == {path: "120000" for path in LINKS}, "git must store them as symbolic links"
    for path, target in LINKS.items():
        assert (REPO / path).resolve() == (REPO / target).resolve(), path
    for s in STRATEGIES.values():  # the table names the paths users type; they are the shipped files
        assert s.accelerate_path.is_file() and s.accelerate_path.is_relative_to(CONFIGS), s.name
        assert (REPO / s.accelerate_config).resolve() == s.accelerate_path.resolve()
    assert all(Path(d).is_file() and Path(d).is_relative_to(DEMO_DATA) for d in DEMO["dataset"])


def test_a_shipped_config_by_its_bare_name_from_any_directory(tmp_path, monkeypatch):
    """`--config_file zero3.yaml` (or `zero3`, or the checkout's path typed elsewhere) is the shipped config, and its
    DeepSpeed json reaches accelerate as an absolute path, since accelerate reads `ds_configs/zero3.json` from the
    current directory."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    monkeypatch.chdir(tmp_path)
    for given in ("zero3.yaml", "zero3", "accelerate_configs/zero3.yaml"):
        launch, error = cli.resolve_config(["--config_file", given, "--num_processes", "2"])
        assert error is None and launch[:2] == ["--config_file", str(ACCELERATE_CONFIGS / "zero3.yaml")], given
        args, _, _ = _validate_launch_command(launch_command_parser().parse_args([*launch, cli.TRAIN_SCRIPT]))
        assert args.use_deepspeed and args.num_processes == 2
        assert args.deepspeed_config_file == str(CONFIGS / "ds_configs" / "zero3.json")
    launch, error = cli.resolve_config(["--config_file=ddp.yaml"])
    assert error is None and launch == ["--config_file", str(ACCELERATE_CONFIGS / "ddp.yaml")]
    mine = tmp_path / "zero3.yaml"  # a file of the user's own wins over the shipped name
    mine.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: /nowhere/ds.json\n")
    assert cli.resolve_config(["--config_file", "zero3.yaml"]) == (
        ["--config_file", "zero3.yaml"], "--config_file zero3.yaml: its deepspeed_config_file /nowhere/ds.json is not "
        "found (a relative path is read from the current directory); give its absolute path in the config.")


def test_a_shipped_recipe_by_its_name_from_any_directory(tmp_path, monkeypatch):
    """`--config deepseek-llm-7b-lora.yaml` (or without .yaml, or the checkout's recipes/ path typed elsewhere) is
    the shipped recipe; a file of the user's own of that name wins, and a name that is neither is one error line."""
    monkeypatch.chdir(tmp_path)
    data = ["--dataset", str(DEMO_DATA / "alpaca_demo.json")]
    assert len(shipped_recipe_names()) >= 5 and (RECIPES / "deepseek-llm-7b-lora.yaml").is_file()
    for given in ("deepseek-llm-7b-lora.yaml", "deepseek-llm-7b-lora", "recipes/deepseek-llm-7b-lora.yaml"):
        options = read_options(["--config", given, *data, "--bf16", "false"])  # (no bf16 on this CPU)
        assert options.model.model == "deepseek-ai/deepseek-llm-7b-base" and options.lora.lora_r == 16, given
    (tmp_path / "deepseek-llm-7b-lora.yaml").write_text("model: my/model\n")
    assert read_options(["--config", "deepseek-llm-7b-lora.yaml", *data]).model.model == "my/model"
    with pytest.raises(ConfigError) as missing:
        read_options(["--config", "deepseek-llm-70b-lora.yaml", *data])
    assert str(missing.value) == (f"--config deepseek-llm-70b-lora.yaml: no such file; give a recipe file or a "
                                  f"shipped recipe's name ({', '.join(shipped_recipe_names())}).")


def test_from_the_checkout_root_accelerate_reads_the_relative_deepspeed_path_as_before(monkeypatch):
    """`accelerate launch --config_file accelerate_configs/zero3.yaml sft/train.py` there: the links resolve."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    monkeypatch.chdir(REPO)
    launch, error = cli.resolve_config(["--config_file", "accelerate_configs/zero3.yaml"])
    assert error is None and launch == ["--config_file", "accelerate_configs/zero3.yaml"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args([*launch, "sft/train.py"]))
    assert args.deepspeed_config_file == "ds_configs/zero3.json" and Path(args.deepspeed_config_file).is_file()


def test_an_unknown_config_is_one_error_line_naming_the_shipped_ones(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--config_file", "zero4.yaml", "--model", "m"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --config_file zero4.yaml: no such file; give a file or a shipped config's name "
                   f"({', '.join(shipped_names())}, in {ACCELERATE_CONFIGS}).\n")


def test_check_and_write_snapshot_need_the_bench_rows(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(planner, "RESULTS", tmp_path / "results.jsonl")  # as in a wheel install
    for flag in ("--check", "--write_snapshot"):
        assert main([flag]) == 2
        assert capsys.readouterr().err == (f"error: {flag} reads bench/results.jsonl, which only a clone of the "
                                           f"repository has: run it there.\n")


def source_tree(target: Path) -> Path:
    """This working tree's files as git sees them (tracked and new, less ignored ones), links kept as links: a
    build there leaves nothing in the checkout."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    for name in filter(None, listed.split("\0")):
        source, copy = REPO / name, target / name
        if source.is_symlink() or source.is_file():
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy, follow_symlinks=False)
    return target


def deepseek_sft(unpacked: Path, cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(unpacked), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "XDG_CACHE_HOME": str(cwd / "cache")}
    return subprocess.run([sys.executable, "-m", "sft.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_the_wheel_carries_its_files_and_plans_and_trains_from_any_directory(tmp_path):
    tree = source_tree(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", ".", "-w",
                    str(tmp_path / "dist")], cwd=tree, check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("deepseek_sft-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(SHIPPED) <= names, sorted(set(SHIPPED) - names)
    for name in SHIPPED:  # the files themselves, not links
        assert zipfile.ZipFile(wheel).read(name) == (REPO / name).read_bytes(), name
    unpacked, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    zipfile.ZipFile(wheel).extractall(unpacked)
    elsewhere.mkdir()

    from_wheel = deepseek_sft(unpacked, elsewhere, *PLAN)
    from_checkout = subprocess.run([sys.executable, "-m", "sft.cli", *PLAN], cwd=REPO, capture_output=True,
                                   text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert from_wheel.returncode == from_checkout.returncode == 0, from_wheel.stderr + from_checkout.stderr
    # the same plan; the command is the one that runs where each is: the checkout's README form, or the shipped name
    checkout_form = re.sub(r"accelerate launch -q --config_file accelerate_configs/(\S+)(.*?) sft/train\.py",
                           r"deepseek-sft train --config_file \1\2", from_checkout.stdout)
    assert from_wheel.stdout == checkout_form
    assert "Recommended: deepseek-sft train --config_file ddp.yaml --model deepseek-ai/deepseek-llm-7b-base" \
        in from_wheel.stdout

    # a real (tiny) run: the shipped ddp.yaml by name, the demo's shipped data and the tiny model built from it
    out = elsewhere / "out"
    run = deepseek_sft(unpacked, elsewhere, "train", "--config_file", "ddp.yaml", "--num_processes", "1", "--cpu",
                       "--max_steps", "1", "--output_dir", str(out), "--report_to", "none", "--disable_tqdm", "true",
                       timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (out / "model.safetensors").is_file() and str(unpacked / "sft" / "data" / "demo") in run.stdout + run.stderr

    # a shipped recipe by the checkout's path, typed where there is none: its data audited (no GPU needed for that)
    audit = deepseek_sft(unpacked, elsewhere, "data", "--config", "recipes/deepseek-llm-7b-lora.yaml", "--model",
                         "tiny-deepseek", "--dataset", str(unpacked / "sft" / "data" / "demo" / "alpaca_demo.json"),
                         "--max_length", "256", "--show_masks", "1")
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-3000:]
    assert "packed" in audit.stdout and "trained tokens between [[ and ]]" in audit.stdout, audit.stdout
