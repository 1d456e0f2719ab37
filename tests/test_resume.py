"""Resume after SIGKILL at any moment ends with the same weights as an uninterrupted run; half-written checkpoints
are never taken for complete ones; a run is never overwritten silently."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO
from sft.safety.checkpoints import (checkpoint_callback, checkpoint_dirs, command_with, is_complete, mark_complete,
                             newest_complete, resolve_resume, rotate)
from sft.safety.run_dir import CHECKPOINT_MARKER
from sft.options.arguments import ConfigError


def fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x" * (100 + step))
    (path / "trainer_state.json").write_text("{}")
    if complete:
        mark_complete(path)
    return path


def args_for(output_dir: Path, resume=None, overwrite=False):
    return SimpleNamespace(output_dir=str(output_dir), resume_from_checkpoint=resume, overwrite_output_dir=overwrite,
                           should_save=True)


# ---- fast: the rules, on hand-made directories ---------------------------------------------------------------

def test_marker_lists_files_and_detects_truncation_and_partial_deletion(tmp_path):
    path = fake_checkpoint(tmp_path, 2)
    assert is_complete(path)
    with open(path / "model.safetensors", "ab") as f:  # a file that changed size after marking
        f.write(b"more")
    assert not is_complete(path)
    path = fake_checkpoint(tmp_path, 4)
    (path / "trainer_state.json").unlink()  # a deletion (rotation) killed halfway
    assert not is_complete(path)
    assert not is_complete(fake_checkpoint(tmp_path, 6, complete=False))
    assert newest_complete(tmp_path) is None


def test_newest_complete_skips_half_written(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 10)
    fake_checkpoint(tmp_path, 12, complete=False)
    assert newest_complete(tmp_path).name == "checkpoint-10"
    assert resolve_resume(args_for(tmp_path, "true")) == str(tmp_path / "checkpoint-10")
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["checkpoint-2", "checkpoint-10"]  # 12 was removed


def test_resume_true_without_checkpoint_starts_fresh(tmp_path):
    fake_checkpoint(tmp_path, 2, complete=False)  # killed while writing its first checkpoint
    assert resolve_resume(args_for(tmp_path, "true")) is None
    assert checkpoint_dirs(tmp_path) == []
    assert resolve_resume(args_for(tmp_path / "new", "true")) is None


def test_rerun_into_a_run_stops_with_the_commands(tmp_path):
    fake_checkpoint(tmp_path, 4)
    argv = ["--model", "m", "--output_dir", str(tmp_path)]
    with pytest.raises(ConfigError) as e:
        resolve_resume(args_for(tmp_path), argv)
    message = str(e.value)
    assert command_with(argv, resume_from_checkpoint="true") in message
    assert command_with(argv, overwrite_output_dir="true") in message
    assert is_complete(tmp_path / "checkpoint-4")  # nothing changed
    # a finished model without checkpoints: resuming is impossible, overwriting is offered
    done = tmp_path / "done"
    done.mkdir()
    (done / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError, match="overwrite_output_dir"):
        resolve_resume(args_for(done, "true"), argv)
    assert resolve_resume(args_for(tmp_path, overwrite=True), argv) is None
    assert checkpoint_dirs(tmp_path) == []


def test_resume_from_what_is_no_checkpoint_says_what_it_is(tmp_path):
    # was: "this checkpoint has no checkpoint_complete.json ... half-written by an interrupted run" for a run's
    # output directory given instead of its checkpoint, and for a directory that never was a checkpoint
    run = tmp_path / "run"
    fake_checkpoint(run, 4)
    argv = ["--model", "m", "--output_dir", str(run)]
    with pytest.raises(ConfigError, match=r"is a run's output directory, not a checkpoint.*checkpoint-4`"):
        resolve_resume(args_for(run, str(run)), argv)
    (tmp_path / "notes").mkdir()
    with pytest.raises(ConfigError, match=r"is not a checkpoint \(no trainer_state.json\)"):
        resolve_resume(args_for(run, str(tmp_path / "notes")), argv)
    alone = fake_checkpoint(tmp_path / "other", 2, complete=False)
    with pytest.raises(ConfigError, match="half-written.*start the run over, without --resume_from_checkpoint"):
        resolve_resume(args_for(run, str(alone)), argv)
    assert is_complete(run / "checkpoint-4")


def test_command_replaces_earlier_values():
    argv = ["--model", "m", "--resume_from_checkpoint", "out/checkpoint-2", "--lora"]
    assert command_with(argv, resume_from_checkpoint="true") == \
        "python -m sft.train --model m --resume_from_checkpoint true --lora"  # in its place


def test_explicit_half_written_checkpoint_is_refused(tmp_path):
    good = fake_checkpoint(tmp_path, 2)
    assert resolve_resume(args_for(tmp_path, str(good))) == str(good)
    bad = fake_checkpoint(tmp_path, 4, complete=False)
    with pytest.raises(ConfigError, match="half-written.*checkpoint-2"):
        resolve_resume(args_for(tmp_path, str(bad)))
    with pytest.raises(ConfigError, match="no such directory"):
        resolve_resume(args_for(tmp_path, str(tmp_path / "checkpoint-99")))


def test_rotation_keeps_newest_complete_and_best(tmp_path):
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
        time.sleep(0.01)  # distinct completion times
    fake_checkpoint(tmp_path, 10, complete=False)
    rotate(tmp_path, 2, keep=str(tmp_path / "checkpoint-2"))
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["checkpoint-2", "checkpoint-6", "checkpoint-8",
                                                          "checkpoint-10"]


def test_save_total_limit_is_ours_and_the_trainer_gets_none(tmp_path):
    """The Trainer rotates before any callback can mark the new checkpoint complete: the options hand it no limit
    (decided with the other derived options, not rewritten when the Trainer is built), and our rotation keeps it."""
    from sft.options.arguments import parse_args

    common = ["--model", "m", "--dataset", str(REPO / "data" / "alpaca_demo.json"), "--output_dir", str(tmp_path)]
    training_args = parse_args([*common, "--save_total_limit", "2"])[3]
    assert (training_args.save_total_limit, training_args.checkpoints_to_keep) == (None, 2)
    unlimited = parse_args(common)[3]
    assert (unlimited.save_total_limit, unlimited.checkpoints_to_keep) == (None, None)
    with pytest.raises(ConfigError) as typed:  # a value the options resolve to, not an option to type or suggest
        parse_args([*common, "--checkpoints_to_keep", "2"])
    assert "unknown option(s): --checkpoints_to_keep" in str(typed.value) and "did you mean" not in str(typed.value)
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step)
        time.sleep(0.01)  # distinct completion times
    checkpoint_callback().on_save(training_args, SimpleNamespace(global_step=6, best_model_checkpoint=None), None)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["checkpoint-4", "checkpoint-6"]


def test_old_checkpoint_is_unmarked_before_being_rewritten(tmp_path):
    """Resumed from checkpoint-4 of a run that reached checkpoint-6: step 6 is written again, in place."""
    fake_checkpoint(tmp_path, 4)
    old = fake_checkpoint(tmp_path, 6)
    args = SimpleNamespace(output_dir=str(tmp_path), should_save=True, save_strategy="steps", checkpoints_to_keep=None)
    callback = checkpoint_callback()
    control = SimpleNamespace(should_save=False, should_evaluate=False)
    callback.on_step_end(args, SimpleNamespace(global_step=6), control)
    assert is_complete(old)  # no save at this step: left alone
    control.should_save = True
    callback.on_step_end(args, SimpleNamespace(global_step=6), control)
    assert not is_complete(old) and (old / "model.safetensors").exists()


# ---- slow: real runs killed with SIGKILL ---------------------------------------------------------------------

def train_args(model: Path, output_dir: Path, cache: Path) -> list[str]:
    return ["--model", str(model), "--dataset", str(REPO / "data" / "alpaca_demo.json"), "--max_length", "64",
            "--per_device_train_batch_size", "2", "--max_steps", "10", "--save_strategy", "steps", "--save_steps", "2",
            "--save_total_limit", "2", "--learning_rate", "1e-3", "--logging_steps", "1", "--report_to", "none",
            "--disable_tqdm", "true", "--seed", "0", "--dataset_cache_dir", str(cache), "--output_dir", str(output_dir)]


# Kill the run from inside the checkpoint write: after the model and optimizer files, before the RNG states,
# trainer_state.json and our marker.
KILL_INSIDE_SAVE = """
import os, signal, sys
from transformers import Trainer
original = Trainer._save_rng_state
def save_rng_state(self, output_dir):
    if self.state.global_step == int(os.environ["KILL_AT_STEP"]):
        os.kill(os.getpid(), signal.SIGKILL)
    original(self, output_dir)
Trainer._save_rng_state = save_rng_state
from sft.train import main
sys.exit(main(sys.argv[1:]))
"""

ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def launch(args: list[str], code: str | None = None, env: dict | None = None) -> subprocess.Popen:
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, str(REPO / "sft" / "train.py"), *args]
    return subprocess.Popen(command, cwd=REPO, env={**ENV, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def kill_at_random_moment(args: list[str], output_dir: Path, rng: random.Random) -> str:
    """Start a resuming run; once it writes a new checkpoint, SIGKILL it after a random delay."""
    before = {p.name: p.stat().st_mtime_ns for p in checkpoint_dirs(output_dir)}
    proc = launch(args)
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline:
        now = {p.name: p.stat().st_mtime_ns for p in checkpoint_dirs(output_dir)}
        if any(before.get(name) != mtime for name, mtime in now.items()):
            break
        time.sleep(0.01)
    time.sleep(rng.uniform(0, 1.2))
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate()
    return f"[exit {proc.returncode}]\n{out}"


def assert_same_weights(reference: Path, resumed: Path, file: str, note: str = "") -> None:
    from safetensors.torch import load_file

    expected, got = load_file(reference / file), load_file(resumed / file)
    assert expected.keys() == got.keys()
    different = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not different, f"{note}weights differ from the uninterrupted run in {different}"


def kill_inside_save(args: list[str], output_dir: Path, step: int) -> None:
    proc = launch(args, KILL_INSIDE_SAVE, {"KILL_AT_STEP": str(step)})
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL, out
    half = output_dir / f"checkpoint-{step}"
    assert any(half.glob("*.safetensors")) and not is_complete(half)  # half-written...
    assert newest_complete(output_dir).name == f"checkpoint-{step - 2}"  # ...and not taken for complete


@pytest.mark.slow
def test_lora_sigkill_at_random_moments_then_resume_is_bit_identical(tmp_path, tiny_llama):
    """LoRA with dropout: exactness needs the RNG streams restored too (and untouched by save verification)."""
    from sft.train import main

    seed = int(os.environ.get("RESUME_TEST_SEED", time.time_ns() % 10**6))
    rng = random.Random(seed)
    cache = tmp_path / "cache"
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    lora = ["--lora", "--lora_dropout", "0.1", "--learning_rate", "1e-2"]
    assert main(train_args(tiny_llama, reference, cache) + lora) == 0  # uninterrupted

    args = train_args(tiny_llama, killed, cache) + lora + ["--resume_from_checkpoint", "true"]
    logs = [kill_at_random_moment(args, killed, rng) for _ in range(2)]  # (the full fine-tune test kills in a save)
    final = launch(args)
    out, _ = final.communicate(timeout=600)
    assert final.returncode == 0, f"seed {seed}\n" + "\n=====\n".join(logs + [out])
    assert any(log.startswith(f"[exit {-signal.SIGKILL}]") for log in logs), "no run was actually killed"
    assert is_complete(killed, "training_complete.json")
    assert_same_weights(reference, killed, "adapter_model.safetensors", f"seed {seed}: ")
    assert all(is_complete(p) for p in checkpoint_dirs(killed)), f"seed {seed}"
    assert len(checkpoint_dirs(killed)) <= 2  # --save_total_limit, applied by our rotation
    assert not list(killed.rglob(f".{CHECKPOINT_MARKER}.tmp"))


@pytest.mark.slow
def test_full_fine_tune_killed_inside_a_save_resumes_bit_identical(tmp_path, tiny_llama):
    from sft.train import main

    cache = tmp_path / "cache"
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    assert main(train_args(tiny_llama, reference, cache)) == 0
    args = train_args(tiny_llama, killed, cache) + ["--resume_from_checkpoint", "true"]
    kill_inside_save(args, killed, 8)
    final = launch(args)
    out, _ = final.communicate(timeout=600)
    assert final.returncode == 0, out
    assert "Removing" in out and "checkpoint-8" in out  # the half-written one was cleared before training
    assert_same_weights(reference, killed, "model.safetensors")
