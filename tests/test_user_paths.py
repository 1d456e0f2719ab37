"""The paths around the happy one, as a new user walks them: what the user typed always wins, no run is lost or
mixed with another, a finished run stays finished, one run per output directory, and every failure is one
`error:` line (Ctrl-C: where it stopped and how to resume)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from sft.safety.checkpoints import checkpoint_dirs, is_complete, mark_complete, resolve_resume
from sft.options.arguments import parse_args
from sft.options.command import as_typed
from sft.errors import ConfigError, ModelNotFoundError, NothingToDo, RunLockedError
from sft.safety.run_dir import FINAL_MARKER, LOCK_NAME
from sft.safety.run_lock import RunLock

DATA = str(REPO / "data" / "alpaca_demo.json")


def small_run(model: Path, output_dir: Path, cache: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--dataset", DATA, "--max_length", "64", "--per_device_train_batch_size", "4",
            "--max_steps", "4", "--save_steps", "2", "--logging_steps", "1", "--report_to", "none",
            "--disable_tqdm", "true", "--dataset_cache_dir", str(cache), "--output_dir", str(output_dir), *extra]


def old_lora_run(root: Path) -> Path:
    """What a finished LoRA run leaves: a checkpoint, an adapter, the final marker."""
    checkpoint = root / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "adapter_model.safetensors").write_bytes(b"x" * 10)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 2, "max_steps": 2}))
    mark_complete(checkpoint)
    (root / "adapter_config.json").write_text("{}")
    (root / "adapter_model.safetensors").write_bytes(b"y")
    mark_complete(root, FINAL_MARKER)
    return root


# ---- 1. what the user typed wins over the demo's defaults -----------------------------------------------------

def test_demo_defaults_never_override_the_user(tmp_path):
    *_, demo = parse_args([])
    assert not demo.overwrite_output_dir and demo.save_strategy == "no"
    *_, saving = parse_args(["--save_steps", "4"])
    assert saving.save_strategy == "steps" and saving.save_steps == 4  # the demo's `save_strategy no` stepped back
    *_, resuming = parse_args(["--output_dir", str(tmp_path), "--resume_from_checkpoint", "true"])
    assert resuming.resume_from_checkpoint == "true" and not resuming.overwrite_output_dir
    *_, stepped = parse_args(["--max_steps", "3"])
    assert stepped.max_steps == 3


# ---- 2. starting over never mixes two runs ----------------------------------------------------------------------

def test_overwrite_moves_the_old_run_aside_whole(tmp_path, capsys):
    run = old_lora_run(tmp_path / "out")
    (run / LOCK_NAME).write_text("{}")  # the new run's own lock stays
    args = parse_args(["--model", "m", "--dataset", DATA, "--output_dir", str(run), "--overwrite_output_dir",
                       "true"])[3]
    assert resolve_resume(args, []) is None
    assert [p.name for p in run.iterdir()] == [LOCK_NAME]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("out.replaced-")]
    assert len(aside) == 1 and is_complete(aside[0], FINAL_MARKER) and (aside[0] / "adapter_config.json").exists()
    assert str(aside[0]) in capsys.readouterr().out


# ---- 3. a finished run stays finished ----------------------------------------------------------------------------

def test_resuming_a_finished_run_changes_nothing_and_says_how_to_train_longer(tmp_path):
    run = old_lora_run(tmp_path / "out")
    args = parse_args(["--model", "m", "--dataset", DATA, "--output_dir", str(run), "--max_steps", "2",
                       "--resume_from_checkpoint", "true"])[3]
    with pytest.raises(NothingToDo) as done:
        resolve_resume(args, ["--output_dir", str(run), "--max_steps", "2", "--resume_from_checkpoint", "true"])
    assert "nothing was changed" in str(done.value) and "--max_steps 4" in str(done.value)
    # the hint of a re-run into it says the same, for the LoRA run it is (this command has no --lora)
    fresh = parse_args(["--model", "m", "--dataset", DATA, "--output_dir", str(run), "--max_steps", "2"])[3]
    with pytest.raises(ConfigError, match=r"To train it longer: .*--max_steps 4 --resume_from_checkpoint true --lora "
                                          r"true`"):
        resolve_resume(fresh, ["--output_dir", str(run), "--max_steps", "2"])


@pytest.mark.slow
def test_finished_runs_resume_to_nothing_and_an_unfinished_final_save_is_completed(tmp_path, tiny_llama):
    from sft.train import main

    out, cache = tmp_path / "out", tmp_path / "cache"
    assert main(small_run(tiny_llama, out, cache)) == 0
    model = out / "model.safetensors"
    before = model.stat().st_mtime_ns
    assert main(small_run(tiny_llama, out, cache, "--resume_from_checkpoint", "true")) == 0
    assert model.stat().st_mtime_ns == before and not (out / "checkpoint-5").exists()
    # epochs: the length is known only once the Trainer counts the steps (the callback's path)
    epochs = ["--max_steps", "-1", "--num_train_epochs", "1", "--max_samples", "16"]
    out2 = tmp_path / "epochs"
    assert main(small_run(tiny_llama, out2, cache, *epochs)) == 0
    final = out2 / "model.safetensors"
    before = final.stat().st_mtime_ns
    assert main(small_run(tiny_llama, out2, cache, *epochs, "--resume_from_checkpoint", "true")) == 0
    assert final.stat().st_mtime_ns == before and len(checkpoint_dirs(out2)) == 2
    # a final save that was interrupted (no marker): resuming writes it from the last checkpoint, trains nothing
    (out / FINAL_MARKER).unlink()
    model.unlink()
    assert main(small_run(tiny_llama, out, cache, "--resume_from_checkpoint", "true")) == 0
    assert is_complete(out, FINAL_MARKER) and model.exists() and not (out / "checkpoint-5").exists()


def test_a_full_disk_stops_with_one_line_and_the_checkpoint_to_resume(tmp_path, tiny_llama, capsys, monkeypatch):
    # was: torch.save's "unexpected pos" (or safetensors' StorageFull) traceback, exit 1, nothing said of what was kept
    import errno

    from transformers import TrainerCallback

    from sft.safety.checkpoints import out_of_space
    from sft.train import main

    class DiskFillsAtStep3(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise OSError(errno.ENOSPC, "No space left on device")

    out, cache = tmp_path / "out", tmp_path / "cache"
    args = small_run(tiny_llama, out, cache)
    assert main(args, callbacks=[DiskFillsAtStep3()]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: no space left in {out} (") and "\n" not in err and "Traceback" not in err
    assert f"the newest complete checkpoint, {out / 'checkpoint-2'}, is intact" in err
    assert err.endswith("--resume_from_checkpoint true") and is_complete(out / "checkpoint-2")
    assert not (out / LOCK_NAME).exists()
    # torch.save says "unexpected pos" on a full disk: what is left there decides
    torn = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 5312 vs 5204")
    assert out_of_space(torn, out, args) is None
    monkeypatch.setattr("shutil.disk_usage", lambda path: type("Usage", (), {"free": 2**20})())
    assert "(1 MiB free)" in str(out_of_space(torn, out, args))


def test_resuming_with_other_lora_or_model_options_is_refused_before_loading(tmp_path, tiny_llama):
    # was: size-mismatch or optimizer-group tracebacks after the model loaded, and another --lora_alpha silently
    # went on training the old adapter at another scale
    from sft.safety.checkpoints import check_resume_matches
    from sft.model.loading import planned_lora_config

    def check(checkpoint, *extra):
        argv = ["--model", str(tiny_llama), "--dataset", DATA, "--output_dir", str(tmp_path), *extra]
        model_args, _, lora_args, _ = parse_args(argv)
        check_resume_matches(str(checkpoint), model_args, lora_args, argv)

    lora = tmp_path / "checkpoint-2"
    lora.mkdir()
    planned_lora_config(*parse_args(["--model", str(tiny_llama), "--dataset", DATA, "--lora"])[0:3:2]).save_pretrained(lora)
    check(lora, "--lora")
    check(lora, "--lora", "--lora_target_modules", "all-linear", "--lora_dropout", "0")  # the same adapter
    with pytest.raises(ConfigError, match=r"holds a LoRA adapter, and this run trains every weight.*--lora true`"):
        check(lora)
    with pytest.raises(ConfigError, match=r"trained with --lora_r 16 \(this run: 4\).*--lora_r 16`"):
        check(lora, "--lora", "--lora_r", "4")
    with pytest.raises(ConfigError, match=r"--lora_alpha 32 \(this run: 64\)"):
        check(lora, "--lora", "--lora_alpha", "64")
    with pytest.raises(ConfigError, match=r"\(this run: q_proj, v_proj\).*--lora_target_modules down_proj gate_proj"):
        check(lora, "--lora", "--lora_target_modules", "q_proj", "v_proj")
    full = tmp_path / "checkpoint-4"
    full.mkdir()
    (full / "config.json").write_text((tiny_llama / "config.json").read_text())
    check(full)
    with pytest.raises(ConfigError, match=r"holds a full fine-tune.*--lora false`"):
        check(full, "--lora")
    (full / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    with pytest.raises(ConfigError, match=r"trained from another model: its model_type qwen2"):
        check(full)


# ---- 4. one run per output directory ---------------------------------------------------------------------------

def test_lock_refuses_a_second_run_and_takes_over_a_stale_one(tmp_path, capsys):
    first = RunLock(tmp_path, "python sft/train.py --first")
    assert first.acquire() is None
    with pytest.raises(RunLockedError, match=rf"in use by another run \(pid {os.getpid()}.*--first"):
        RunLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "since": "x"}))
    second = RunLock(tmp_path)
    assert "no longer running" in second.acquire()
    second.release()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "other-host", "since": "x"}))
    with pytest.raises(RunLockedError, match=f"delete {tmp_path / LOCK_NAME}"):
        RunLock(tmp_path).acquire()


def test_a_lock_held_by_a_rank_of_the_same_launch_is_not_another_run(tmp_path):
    """Was (DDP on a CPU machine without --use_cpu): "in use by another run (pid N) ... kill N", N the run's own
    second rank. Ranks of one launch share their launcher (our parent): the lock says which rank holds it and why
    two ranks took it, not to kill it."""
    from sft.machine import Launch

    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a rank beside this one
    try:
        RunLock(tmp_path, "python sft/train.py", launch=Launch(launched=True, rank=1))._create()  # as it writes it
        held = json.loads((tmp_path / LOCK_NAME).read_text())
        assert held["launcher"] == os.getppid() and held["rank"] == 1
        (tmp_path / LOCK_NAME).write_text(json.dumps({**held, "pid": sibling.pid, "start": None}))
        with pytest.raises(RunLockedError) as same_launch:
            RunLock(tmp_path, launch=Launch(launched=True)).acquire()
        message = str(same_launch.value)
        assert message.startswith(f"--output_dir {tmp_path} is held by rank 1 of this same launch (pid "
                                  f"{sibling.pid}), not by another run") and "--use_cpu true" in message
        assert "kill" not in message
        with pytest.raises(RunLockedError, match=rf"in use by another run \(pid {sibling.pid}"):
            RunLock(tmp_path).acquire()  # a process started by hand (no launcher): another run
    finally:
        sibling.kill()
        sibling.wait()


def test_an_output_directory_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys):
    # was: FileExistsError / OSError(EROFS) tracebacks from the lock's mkdir
    from sft.train import main

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    base = ["--model", "m", "--dataset", DATA, "--report_to", "none"]
    assert main([*base, "--output_dir", str(a_file / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --output_dir {a_file / 'run'}: cannot write there ({a_file} is a file, not a directory); "
                   f"nothing was trained. Give an --output_dir you can write to.")
    assert a_file.read_text() == "mine"

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system", str(tmp_path / "ro" / LOCK_NAME))

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ConfigError, match=r"cannot write there \(Read-only file system: .*\.run\.lock\)"):
        RunLock(tmp_path / "ro").acquire()


def wait_for(condition, timeout: float, every: float = 0.2) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(every)
    return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return not Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


@pytest.mark.slow
def test_killing_the_launcher_ends_the_worker_and_frees_the_directory(tmp_path, tiny_llama):
    """kill -9 of `accelerate launch` only: its worker stops (and says so where the user sees it), the lock goes
    with it."""
    out = tmp_path / "out"
    args = small_run(tiny_llama, out, tmp_path / "cache", "--max_steps", "10000", "--save_steps", "5")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    launcher = subprocess.Popen([str(Path(sys.executable).with_name("accelerate")), "launch", "--num_processes", "1",
                                 str(REPO / "sft" / "train.py"), *args], env=env, stdout=open(tmp_path / "stdout", "w"),
                                stderr=open(tmp_path / "stderr", "w"), start_new_session=True)
    assert wait_for(lambda: (out / LOCK_NAME).exists() and any(checkpoint_dirs(out)), 600), \
        (tmp_path / "stderr").read_text()[-2000:]
    lock = json.loads((out / LOCK_NAME).read_text())
    worker = lock["pid"]
    # the command as typed: accelerate's launcher and its options, not `python sft/train.py` (was)
    accelerate = as_typed(str(Path(sys.executable).with_name("accelerate")))  # its name where PATH finds it there
    assert lock["command"].startswith(f"{accelerate} launch --num_processes 1 "), lock
    # a second run into the same directory is refused while the first one trains
    second = subprocess.run([sys.executable, str(REPO / "sft" / "train.py"), *args], env=env, capture_output=True,
                            text=True, timeout=600)
    assert second.returncode == 2 and f"in use by another run (pid {worker}" in second.stderr
    launcher.kill()
    launcher.wait()
    assert wait_for(lambda: not alive(worker), 600), "the worker outlived its launcher"
    assert not (out / LOCK_NAME).exists()
    # accelerate <= 1.15 passes the worker's stderr on as it is; 1.16 tees it through a pipe that dies with the
    # launcher (its reader thread can take the line and die before passing it on), and the worker then says it on the
    # stdout it inherited too: either way it reaches the user's terminal. (Flaky before the worker waited for its
    # dying launcher to be gone: about one run in two, after an in-process run in the same test process.)
    said = (tmp_path / "stderr").read_text() + (tmp_path / "stdout").read_text()
    assert "stopped (SIGTERM) at step" in said, said[-2000:]


# ---- 5. one error line, never a traceback ---------------------------------------------------------------------

def test_missing_model_directory_and_unreachable_hub_fail_in_seconds(tmp_path, monkeypatch, capsys):
    from sft.train import main

    base = ["--dataset", DATA, "--output_dir", str(tmp_path / "out"), "--report_to", "none"]
    assert main(["--model", str(tmp_path / "no-such-model"), *base]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["--model", str(tmp_path / "empty"), *base]) == 2
    assert "holds no config.json" in capsys.readouterr().err
    (tmp_path / "empty" / "config.json").write_text("{}")  # a config, no weights
    assert main(["--model", str(tmp_path / "empty"), *base]) == 2
    assert "holds a config.json but no weights" in capsys.readouterr().err
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"")  # pickled weights only: refused, with the conversion
    assert main(["--model", str(tmp_path / "empty"), *base]) == 2
    said = capsys.readouterr().err
    assert "pickled PyTorch files (pytorch_model.bin)" in said and ".save_pretrained(" in said
    assert main(["--model", "deepseek-ai/not-cached-here", *base]) == 2  # the tests run with HF_HUB_OFFLINE=1
    assert "HF_HUB_OFFLINE=1" in capsys.readouterr().err
    from sft.model.loading import resolve_model_path

    resolve_model_path.cache_clear()
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "https://127.0.0.1:9")  # nothing listens there
    connect, timeouts = socket.create_connection, []

    def connection_test(address, timeout=None, *args, **kwargs):
        timeouts.append(timeout)
        return connect(address, timeout, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", connection_test)
    with pytest.raises(ModelNotFoundError, match="cannot be reached"):
        resolve_model_path("deepseek-ai/not-cached-here")
    # "in seconds" by construction, not by a stopwatch: one bounded connection test decides, no hub call retries
    assert timeouts and all(t is not None and t <= 3 for t in timeouts), timeouts


def test_lora_targets_that_match_nothing_list_the_names(tiny_llama):
    from sft.model.loading import check_lora_targets

    model_args, _, lora_args, _ = parse_args(["--model", str(tiny_llama), "--dataset", DATA, "--lora",
                                              "--lora_target_modules", "query", "value"])
    with pytest.raises(ConfigError, match=r"no module of llama.*q_proj.*v_proj"):
        check_lora_targets(model_args, lora_args)


@pytest.mark.slow
def test_ctrl_c_says_where_it_stopped_and_how_to_resume(tmp_path, tiny_llama):
    out = tmp_path / "out"
    args = small_run(tiny_llama, out, tmp_path / "cache", "--max_steps", "10000", "--save_steps", "3")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # Ctrl-C as a terminal's foreground run has it, however the tests were started (a background job of a shell
    # without job control starts with SIGINT ignored, and so would this run)
    proc = subprocess.Popen([sys.executable, str(REPO / "sft" / "train.py"), *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "stderr", "w"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert wait_for(lambda: any(is_complete(p) for p in checkpoint_dirs(out)), 600)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=600) == 130
    finally:  # a failed wait (SIGINT ignored, as in a shell's background job) must not leave a 10000-step run behind
        if proc.poll() is None:
            proc.kill()
    err = (tmp_path / "stderr").read_text()
    assert "Traceback" not in err
    line = next(x for x in err.splitlines() if "stopped (Ctrl-C) at step" in x)
    assert "newest complete checkpoint: " in line and "--resume_from_checkpoint true" in line
    assert not (out / LOCK_NAME).exists()


def test_ctrl_c_while_the_libraries_load_is_one_line():
    """The first seconds of a run import torch and transformers, before main() can catch Ctrl-C: was the importer's
    traceback, dozens of lines deep in transformers."""
    proc = subprocess.Popen([sys.executable, str(REPO / "sft" / "train.py")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(1.0)  # the imports take seconds: torch alone more than one
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGINT  # Python's own exit on Ctrl-C: a shell reads 130
    assert err.splitlines() == ["error: stopped (Ctrl-C) while loading the libraries, before anything was read or "
                                "written; run the command again to train."]


def test_the_launchers_sigterm_after_a_ctrl_c_is_the_users_ctrl_c(monkeypatch):
    """A terminal's Ctrl-C reaches `accelerate launch` (or `deepseek-sft train`) and its worker, and the launcher then
    stops the worker with SIGTERM within milliseconds: was reported "stopped (SIGTERM)". A SIGTERM alone stays one."""
    import sft.safety.interrupts as interrupts

    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(interrupts, "_ctrl_c_at", None)

    def stop_by(*signals) -> KeyboardInterrupt:
        """The interrupt the run sees last: each signal arrives while the one before it is being handled."""
        try:
            os.kill(os.getpid(), signals[0])
            time.sleep(5)
        except KeyboardInterrupt as interrupt:
            return stop_by(*signals[1:]) if signals[1:] else interrupt
        raise AssertionError(f"{signals[0]} raised nothing")

    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's, even where the tests' shell ignores it
        interrupts.stop_on_sigterm()
        alone = stop_by(signal.SIGTERM)
        assert interrupts.signal_name(alone) == "SIGTERM" and interrupts.exit_code(alone) == 143
        after_ctrl_c = stop_by(signal.SIGINT, signal.SIGTERM)
        assert interrupts.signal_name(after_ctrl_c) == "Ctrl-C" and interrupts.exit_code(after_ctrl_c) == 130
    finally:
        signal.signal(signal.SIGINT, saved[0])
        signal.signal(signal.SIGTERM, saved[1])


# ---- 6. names users bring from other trainers; one-line errors; one-screen help ------------------------------

def test_other_trainers_names_map_to_ours(tmp_path, capsys):
    recipe = tmp_path / "llamafactory.yaml"
    recipe.write_text(f"model_name_or_path: m\ndataset: {DATA}\nfinetuning_type: lora\nlora_rank: 8\n"
                      "lora_target: q_proj,v_proj\ncutoff_len: 512\ntemplate: deepseekcoder\n")
    model_args, data_args, lora_args, _ = parse_args(["--config", str(recipe)])
    assert model_args.model == "m" and lora_args.lora and lora_args.lora_r == 8
    assert lora_args.lora_target_modules == ["q_proj", "v_proj"] and data_args.max_length == 512
    assert data_args.template == "deepseek_coder"
    notes = capsys.readouterr().err
    assert "note: --cutoff_len is LLaMA-Factory's name for --max_length" in notes
    _, data_args, _, training_args = parse_args(["--model", "m", "--dataset", DATA, "--sequence_len", "256",
                                                 "--micro_batch_size", "2", "--num_epochs", "2"])
    assert (data_args.max_length, training_args.per_device_train_batch_size) == (256, 2)
    assert training_args.num_train_epochs == 2


def test_the_planners_model_names_train_their_hub_ids(tmp_path, monkeypatch, capsys):
    """--model as `deepseek-sft plan` takes it, in either spelling (sft/names.py), from the command line, a recipe or
    another trainer's option name, loads the hub id the planner's command names, with a note; a local directory of
    that name wins, and a hub id or any other name stays as typed (was: passed to from_pretrained as typed)."""
    from sft.names import hub_id

    monkeypatch.chdir(tmp_path)
    r1 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
    recipe = tmp_path / "r1.yaml"
    recipe.write_text(f"model: r1-distill-qwen-7b\ndataset: {DATA}\n")
    for argv in (["--model", "r1-distill-qwen-7b"], ["--model", "deepseek-r1-distill-qwen-7b"],
                 ["--model_name_or_path", "DeepSeek-R1-Distill-Qwen-7B"], ["--config", str(recipe)]):
        model_args, *_ = parse_args([*argv, "--dataset", DATA], data_only=True)
        assert model_args.model == r1, argv
        assert f"is short for {r1} (the name `deepseek-sft plan` takes): using --model {r1}" in capsys.readouterr().err
    model_args, *_ = parse_args(["--model", "r1-0528-qwen3-8b", "--dataset", DATA], data_only=True)
    assert model_args.model == "deepseek-ai/DeepSeek-R1-0528-Qwen3-8B" == hub_id("r1-0528-qwen3-8b")  # the plan's
    capsys.readouterr()
    (tmp_path / "r1-distill-qwen-7b").mkdir()
    for typed in ("r1-distill-qwen-7b", r1, "m"):
        model_args, *_ = parse_args(["--model", typed, "--dataset", DATA], data_only=True)
        assert model_args.model == typed
    assert "is short for" not in capsys.readouterr().err


def test_bad_values_and_unknown_names_are_one_line():
    with pytest.raises(ConfigError) as bad:
        parse_args(["--max_steps", "ten"])
    assert "invalid int value: 'ten'" in str(bad.value) and "\n" not in str(bad.value)
    with pytest.raises(ConfigError, match=r"--lora_rnk \(did you mean --lora_r\?\)"):
        parse_args(["--lora_rnk", "8"])
    with pytest.raises(ConfigError, match=r"--lora_rank_typo \(did you mean --lora_r\?\)"):
        parse_args(["--lora_rank_typo", "8"])  # was: did you mean --local_rank?


def test_evaluation_without_held_out_data_is_refused_before_loading():
    # was: the Trainer's ValueError traceback after the model had loaded
    base = ["--model", "m", "--dataset", DATA, "--output_dir", "/nonexistent/out"]
    with pytest.raises(ConfigError, match="--eval_strategy steps needs held-out data.*--eval_split 0.05"):
        parse_args([*base, "--eval_strategy", "steps"])
    with pytest.raises(ConfigError, match="--eval_strategy epoch needs held-out data"):
        parse_args(["--eval_split", "0"])  # the demo evaluates every epoch
    parse_args([*base, "--eval_strategy", "steps", "--eval_split", "0.1"])
    parse_args([*base, "--eval_strategy", "steps", "--eval_dataset", DATA])


def test_help_is_one_screen_and_help_all_lists_everything(train_help):
    def help_text(*flags):
        result = subprocess.run([sys.executable, str(REPO / "sft" / "train.py"), *flags], capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert train_help.returncode == 0, train_help.stderr
    short = train_help.stdout  # python sft/train.py --help (the session's one run)
    assert len(short.splitlines()) <= 70 and max(map(len, short.splitlines())) <= 120
    for option in ("--model", "--lora_r", "--dataset", "--max_length", "--learning_rate", "--output_dir",
                   "--resume_from_checkpoint"):
        assert f"  {option} " in short
    assert "`true`" in next(line for line in short.splitlines() if "--resume_from_checkpoint" in line)
    assert len(help_text("--help", "all").splitlines()) > 300


@pytest.mark.slow
def test_deepseek_sft_train_exits_with_our_code_and_nothing_more(tmp_path):
    """`accelerate launch` adds its launcher's traceback after our error line; `deepseek-sft train` does not. (Run in
    its own directory into its own --output_dir: in the repository with the default one, a user's run there
    answered first.)"""
    result = subprocess.run([str(Path(sys.executable).with_name("deepseek-sft")), "train", "--num_processes", "1",
                             "--model", str(tmp_path / "missing"), "--dataset", DATA], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=tmp_path)  # its output/ there
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"error: --model {tmp_path / 'missing'}: no such directory ({tmp_path / 'missing'}). Give a "
                     f"local model directory or a hub id such as deepseek-ai/deepseek-llm-7b-base."], result.stderr


@pytest.mark.slow
def test_accelerate_launch_after_a_failure_is_what_the_docs_say(tmp_path):
    """accelerate 1.16's launcher, as docs/reliability.md describes it: with -q (the README's commands) it adds
    nothing to our one line but exits 1, not our 2; without -q our line comes back as `RuntimeError: error: ...`
    inside its traceback. A release that changes this fails here, not in a user's terminal."""
    launch = [str(Path(sys.executable).with_name("accelerate")), "launch", "--num_processes", "1", "--num_machines",
              "1", "--mixed_precision", "no", "--dynamo_backend", "no"]  # (else a warning about each default)
    train = [str(REPO / "sft" / "train.py"), "--lora", "--lora_r", "0", "--output_dir", str(tmp_path / "out")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    line = "error: --lora_r 0: the rank must be positive."
    quiet = subprocess.run([*launch[:2], "-q", *launch[2:], *train], cwd=tmp_path, capture_output=True, text=True,
                           timeout=600, env=env)
    assert quiet.returncode == 1 and quiet.stderr.splitlines() == [line], quiet.stderr
    loud = subprocess.run([*launch, *train], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert loud.returncode == 1 and loud.stderr.startswith(line + "\n"), loud.stderr
    assert f"RuntimeError: {line}" in loud.stderr and "Traceback (most recent call last)" in loud.stderr


def test_deepseek_sft_train_launch_errors_are_one_line(capsys, tmp_path, monkeypatch):
    # was: accelerate's 60-line usage block for a bad launch option, a FileNotFoundError traceback for a missing
    # --config_file (now a shipped config's name works from anywhere: tests/test_package.py)
    from sft.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config_file", "my_configs/ddp.yaml", "--model", "m"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --config_file my_configs/ddp.yaml: no such file; give a file or a shipped "
                          "config's name (autoep.yaml, ddp.yaml, ") and err.count("\n") == 1
    assert main(["train", "--config_file=nope.yaml"]) == 2
    assert "a shipped config's name" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:
        main(["train", "--num_processes", "two", "--model", "m"])
    err = capsys.readouterr().err
    assert bad.value.code == 2 and err.startswith("error: argument --num_processes") and err.count("\n") == 1
