"""What a run tells the user to do next trains what it says (issue 29, item 1):

- each run without --output_dir gets a directory of its own, output/<model>/<method>/<start time>, named alike by
  every process of a launch; --resume_from_checkpoint true without --output_dir resumes the newest run of that model
  and method, or says there is none;
- a resume onto other data (or another model, --max_length, --packing, ...) is refused before anything trains,
  naming what differs;
- a resume that trains longer follows the longer schedule from the checkpoint's step: no step at learning rate 0;
- every suggested command is the typed one (its launcher, its options) with the run's own method.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from sft.errors import ConfigError
from sft.machine import Launch, Machine
from sft.options.checks import PICKED_NEW, PICKED_NEWEST
from sft.options.command import as_typed, command_with, launcher_command
from sft.safety.checkpoints import is_complete, mark_complete, resolve_resume
from sft.safety.run_dir import FINAL_MARKER, LATEST, TRAINED_ON, runs_of
from sft.safety.trained_on import recorded

DATA = str(REPO / "data" / "alpaca_demo.json")
OASST = str(REPO / "data" / "oasst_demo.jsonl")
STARTED = time.mktime((2026, 12, 3, 10, 11, 12, 0, 0, -1))  # a launcher's start time, as sft/machine.py reads it


def options(argv: list[str], launch: Launch = Launch()):
    """The final options of `argv` on a CPU machine launched as `launch` (what every rank of a launch resolves)."""
    from sft.train import final_options

    return final_options(argv, Machine(launch=launch))[0]


def small_run(model: Path, cache: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--dataset", DATA, "--max_length", "64", "--per_device_train_batch_size", "4",
            "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true", "--dataset_cache_dir", str(cache),
            *extra]


def fake_checkpoint(root: Path, step: int, max_steps: int, model: str = "config.json") -> Path:
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / model).write_text("{}")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": max_steps}))
    mark_complete(path)
    return path


# ---- each run its own directory -------------------------------------------------------------------------------

def test_runs_without_output_dir_get_a_directory_each_that_every_rank_names_alike(tmp_path, monkeypatch):
    # was: every run without --output_dir went to output/run, so a second experiment collided with the first
    monkeypatch.chdir(tmp_path)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(STARTED))
    ranks = [Launch(world_size=2, local_world_size=2, rank=rank, local_rank=rank, launched=True,
                    launcher_started=STARTED) for rank in (0, 1)]
    first = options(["--model", "deepseek-ai/deepseek-llm-7b-base", "--dataset", DATA], ranks[0]).training
    assert first.output_dir == f"output/deepseek-llm-7b-base/full/{stamp}" and first.output_dir_picked == PICKED_NEW
    Path(first.output_dir).mkdir(parents=True)  # rank 0 took it before rank 1 resolved its options: the same name
    assert options(["--model", "deepseek-ai/deepseek-llm-7b-base", "--dataset", DATA], ranks[1]).training.output_dir \
        == first.output_dir
    lora = options(["--model", "deepseek-ai/deepseek-llm-7b-base", "--dataset", DATA, "--lora"], ranks[0]).training
    assert lora.output_dir == f"output/deepseek-llm-7b-base/lora/{stamp}"
    # one process: a run started in the same second takes the next name
    one = Launch(launched=True, launcher_started=STARTED)
    assert options(["--model", "deepseek-ai/deepseek-llm-7b-base", "--dataset", DATA], one).training.output_dir \
        == f"output/deepseek-llm-7b-base/full/{stamp}-2"
    # the demo too, and a directory the user names stays theirs
    assert options([], one).training.output_dir == f"output/tiny-deepseek/full/{stamp}"
    assert options(["--output_dir", "mine"], one).training.output_dir == "mine"
    # processes on two machines have two launchers: they cannot agree on a time
    with pytest.raises(ConfigError, match=r"--output_dir is missing: 4 processes on several machines"):
        options(["--dataset", DATA], Launch(world_size=4, local_world_size=2, launched=True, launcher_started=STARTED))


def test_resume_true_without_output_dir_resumes_the_newest_run_of_its_model_and_method(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "output" / "tiny" / "full"
    fake_checkpoint(runs / "20261201-090000", 2, 4)
    newest = fake_checkpoint(runs / "20261202-090000", 4, 8)
    (runs / "20261203-090000").mkdir()  # a run that stopped before writing anything: not one to resume
    fake_checkpoint(tmp_path / "output" / "tiny" / "lora" / "20261204-090000", 2, 4, "adapter_config.json")
    argv = ["--model", "models/tiny", "--dataset", DATA, "--resume_from_checkpoint", "true"]
    training = options(argv).training
    assert training.output_dir == str(Path("output/tiny/full/20261202-090000"))
    assert training.output_dir_picked == PICKED_NEWEST
    assert resolve_resume(training, argv) == str(Path(training.output_dir) / newest.name)
    assert "newest run of this model and method in output/tiny/full" in capsys.readouterr().out
    # none of this model and method: one line that says so and how to start one
    other = ["--model", "other", "--dataset", DATA, "--resume_from_checkpoint", "true"]
    with pytest.raises(ConfigError, match=r"resumes the newest run of this model and method; output/other/full holds "
                                          r"no run\. Give the --output_dir of the run to resume, or start a new one: "
                                          r"`python -m sft\.train --model other --dataset \S+`"):
        resolve_resume(options(other).training, other)
    from sft.train import main

    assert main(other) == 2 and "output/other/full holds no run" in capsys.readouterr().err
    assert not (tmp_path / "output" / "other").exists()  # the folders its lock made are gone with it


@pytest.mark.slow
def test_two_runs_without_output_dir_train_apart_and_resume_finds_the_newest(tmp_path, tiny_llama, monkeypatch, capsys):
    from sft.train import main

    monkeypatch.chdir(tmp_path)
    args = small_run(tiny_llama, tmp_path / "cache", "--max_steps", "2", "--save_steps", "2")
    said = []
    for _ in range(2):
        assert main(args) == 0
        said.append(capsys.readouterr().out)
    runs = runs_of(str(tiny_llama), "full")
    assert len(runs) == 2 and all(is_complete(run, FINAL_MARKER) for run in runs)
    for run, out in zip(runs, said):  # where, said at the start and at the end
        assert f"Output directory: {run.resolve()} (this run's own" in out and f"tokenizer: {run.resolve()}" in out
    assert (runs[1].parent / LATEST).resolve() == runs[1].resolve()
    assert main([*args[:-4], "--max_steps", "4", "--save_steps", "2", "--resume_from_checkpoint", "true"]) == 0
    assert f"Resuming from {runs[1] / 'checkpoint-2'} (the newest complete checkpoint of the newest run" in \
        capsys.readouterr().out
    assert (runs[1] / "checkpoint-4").is_dir() and not (runs[0] / "checkpoint-4").exists()


@pytest.mark.slow
def test_two_ranks_without_output_dir_train_into_one_directory(tmp_path, tiny_llama):
    """Each rank resolves its options alone: the launcher's start time gives them one name (DDP on CPU, gloo: two
    real ranks, which `--cpu --num_processes 2` would not start: see STACK-NOTES); the model they saved loads with
    plain transformers."""
    from transformers import AutoModelForCausalLM

    from conftest import run_train

    accelerate = [str(Path(sys.executable).with_name("accelerate")), "launch", "--multi_gpu", "--num_processes", "2",
                  "--main_process_port", "29631"]
    result = run_train([*small_run(tiny_llama, tmp_path / "cache", "--max_steps", "2", "--save_steps", "2"),
                        "--use_cpu", "true"], launcher=accelerate, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Training on 2 process(es)" in result.stdout
    runs = runs_of(str(tiny_llama), "full", tmp_path / "output")
    assert len(runs) == 1 and is_complete(runs[0], FINAL_MARKER) and is_complete(runs[0] / "checkpoint-2")
    assert sorted(p.name for p in (runs[0] / "checkpoint-2").glob("rng_state_*.pth")) == \
        ["rng_state_0.pth", "rng_state_1.pth"]  # both ranks wrote into the one directory
    AutoModelForCausalLM.from_pretrained(runs[0])


# ---- a resume onto other data is refused -------------------------------------------------------------------------

@pytest.mark.slow
def test_a_resume_onto_other_data_is_refused_before_training_and_the_advice_resumes(tmp_path, tiny_llama, capsys):
    # was: `--dataset <the OASST file> --resume_from_checkpoint true --max_steps 8` went on training the Alpaca run on
    # OASST data, exit 0, no warning
    from sft.train import main

    data = tmp_path / "alpaca.json"
    data.write_text(Path(DATA).read_text())
    out = tmp_path / "out"
    base = small_run(tiny_llama, tmp_path / "cache", "--output_dir", str(out), "--save_steps", "2")
    base[base.index(DATA)] = str(data)
    assert main([*base, "--max_steps", "2"]) == 0
    saved = recorded(out)
    assert saved["dataset"] == [str(data)] and saved["method"] == "full" and saved["data_hash"]
    capsys.readouterr()

    oasst = [OASST if word == str(data) else word for word in base]
    assert main([*oasst, "--max_steps", "4", "--resume_from_checkpoint", "true"]) == 2
    captured = capsys.readouterr()
    error = captured.err.strip()
    assert error.startswith(f"error: --resume_from_checkpoint {out / 'checkpoint-2'}: the run in {out} trained with "
                            f"--dataset {data} (this run: {Path(OASST).resolve()}). A checkpoint") and "\n" not in error
    assert "Loading model" not in captured.out and not (out / "checkpoint-4").exists()
    # the advice: the same command on the run's own data, which resumes and trains on
    advice = shlex.split(error.split("Resume it as it was trained: `")[1].split("`")[0])
    assert advice[:3] == ["python", "-m", "sft.train"] and advice[advice.index("--dataset") + 1] == str(data)
    assert main(advice[3:]) == 0 and is_complete(out / "checkpoint-4")

    # the same file, other contents: the prepared data's hash says so
    records = json.loads(data.read_text())
    data.write_text(json.dumps(records[:-1]))
    assert main([*base, "--max_steps", "6", "--resume_from_checkpoint", "true"]) == 2
    assert "trained with the prepared training data, hash" in capsys.readouterr().err
    assert not (out / "checkpoint-6").exists()


# ---- a longer resume follows the longer schedule -------------------------------------------------------------------

def test_a_resumed_schedule_is_this_runs_schedule_from_the_checkpoints_step():
    from transformers import get_scheduler

    from sft.trainer import ScheduleOfThisRun

    def schedule(steps: int):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        made = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=0, num_training_steps=steps)
        return optimizer, ScheduleOfThisRun(optimizer, made.lr_lambdas)

    def walk(optimizer, scheduler, steps: int) -> list[float]:
        rates = []
        for _ in range(steps):  # the Trainer's order: optimizer step, the rate it used, then the scheduler's step
            optimizer.step()
            rates.append(scheduler.get_last_lr()[0])
            scheduler.step()
        return rates

    optimizer, four = schedule(4)
    walk(optimizer, four, 4)
    state = four.state_dict()
    optimizer, eight = schedule(8)
    eight.load_state_dict(state)  # as a resume loads scheduler.pt: 4 of 4 steps done, rate 0
    assert walk(optimizer, eight, 4) == pytest.approx(walk(*schedule(8), 8)[4:])  # 5e-4, 3.75e-4, 2.5e-4, 1.25e-4
    optimizer, again = schedule(4)  # the same length: the rate the checkpoint had
    partway = schedule(4)
    walk(*partway, 2)
    again.load_state_dict(partway[1].state_dict())
    assert again.get_last_lr() == partway[1].get_last_lr() and optimizer.param_groups[0]["lr"] == 5e-4


@pytest.mark.slow
def test_raising_max_steps_and_resuming_never_trains_a_step_at_rate_zero(tmp_path, tiny_llama):
    # was: after a 4 -> 8 step resume, checkpoint-5 was bit-identical to checkpoint-4, and the rates logged for steps
    # 5-8 were 0, 1.875e-05, 1.25e-05, 6.25e-06
    from safetensors.torch import load_file
    from transformers import get_scheduler

    from sft.train import main

    out = tmp_path / "out"
    args = small_run(tiny_llama, tmp_path / "cache", "--output_dir", str(out), "--save_steps", "1",
                     "--learning_rate", "5e-5")
    assert main([*args, "--max_steps", "4"]) == 0
    assert main([*args, "--max_steps", "8", "--resume_from_checkpoint", "true"]) == 0
    four, five = (load_file(out / f"checkpoint-{step}" / "model.safetensors") for step in (4, 5))
    assert any(not torch.equal(four[name], five[name]) for name in four), "step 5 trained at learning rate 0"
    logged = {line["step"]: line["learning_rate"] for line in map(json.loads, (out / "trainer_log.jsonl").open())
              if "learning_rate" in line}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=5e-5)
    eight = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=0, num_training_steps=8)
    expected = [5e-5 * eight.lr_lambdas[0](step - 1) for step in range(5, 9)]  # step N trains at the rate after N-1
    assert [logged[step] for step in range(5, 9)] == pytest.approx(expected)  # 2.5e-05, 1.875e-05, 1.25e-05, 6.25e-06


# ---- every suggested command runs as typed ------------------------------------------------------------------------

def test_a_suggestion_for_a_full_run_never_adds_lora(tmp_path):
    # was: the collision message's "to continue it" repeated this command's --lora onto a full fine-tune's
    # checkpoint, which the next error refused
    run = tmp_path / "run"
    fake_checkpoint(run, 2, 4)
    argv = ["--model", "m", "--dataset", OASST, "--lora", "--output_dir", str(run)]
    training = options(argv).training
    saved = {"model": "m", "method": "full", "dataset": [DATA], "dataset_dir": None, "dataset_format": None,
             "template": "auto", "max_length": 2048, "packing": False, "data_hash": "abc"}
    (run / TRAINED_ON).write_text(json.dumps(saved))
    with pytest.raises(ConfigError) as refused:
        resolve_resume(training, argv, "lora", {**saved, "method": "lora", "dataset": [OASST], "data_hash": None})
    again = shlex.split(str(refused.value).split("To continue it: `")[1].split("`")[0])
    assert again == ["python", "-m", "sft.train", "--model", "m", "--dataset", DATA, "--lora", "false", "--output_dir",
                     str(run), "--resume_from_checkpoint", "true"]
    assert command_with(argv, method="lora", this_method="qlora") == command_with(argv, qlora="false", lora="true")


def test_the_launcher_is_repeated_as_typed(tmp_path, monkeypatch):
    """A launcher's command line, read as sft/options/command.py reads its parent's: a console script run by its #!
    line is named as typed (by its name where the shell finds it by that name, else by its path)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "deepseek-sft"
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(120)\n")
    script.chmod(0o755)
    words = ["train", "--config_file", "ddp.yaml", "--dataset", "my data.jsonl"]
    launcher = subprocess.Popen([str(script), *words])
    try:
        # the kernel sets the command line at the exec, which a loaded machine was seen to finish after Popen
        # returned (CI: None at the first read): wait for it (a guard, not a timing)
        deadline = time.monotonic() + 60
        while launcher_command(launcher.pid) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert launcher_command(launcher.pid) == [str(script), *words]  # not on PATH: its path
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        assert launcher_command(launcher.pid) == ["deepseek-sft", *words]
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher_command(os.getpid()) is None  # pytest: no launcher of training


@pytest.mark.slow
def test_outside_the_repository_the_advice_is_the_typed_command(tmp_path):
    # was: `deepseek-sft train` and `python -m sft.train` were told to run `python sft/train.py ...`, which cannot run
    # outside the repository
    finished = tmp_path / "finished"
    fake_checkpoint(finished, 2, 2, "adapter_config.json")
    (finished / "adapter_config.json").write_text("{}")
    (finished / "adapter_model.safetensors").write_bytes(b"x")
    mark_complete(finished, FINAL_MARKER)
    args = ["--model", "m", "--dataset", DATA, "--output_dir", str(finished), "--max_steps", "2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cli = str(Path(sys.executable).with_name("deepseek-sft"))
    for typed in ([cli, "train", "--num_processes", "1"], [sys.executable, "-m", "sft.train"]):
        result = subprocess.run([*typed, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 2, result.stderr[-2000:]
        longer = result.stderr.split("To train it longer: `")[1].split("`")[0]
        # its launcher and options as typed, the run's method (a LoRA adapter), twice the steps
        program = [as_typed(typed[0]), *typed[1:]] if typed[0] == cli else typed  # a #! script: as the shell finds it
        assert longer == shlex.join([*program, "--model", "m", "--dataset", DATA, "--output_dir", str(finished),
                                     "--max_steps", "4", "--resume_from_checkpoint", "true", "--lora", "true"])
        # an option error points at the help of what was typed
        typo = subprocess.run([*typed, *args, "--learning_rat", "1"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)
        help_words = [*program[:2], "--help"] if typed[0] == cli else [*typed, "--help"]
        assert f"`{shlex.join(help_words)}` lists the options" in typo.stderr, typo.stderr[-2000:]
    assert is_complete(finished / "checkpoint-2")
