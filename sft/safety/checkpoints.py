"""Checkpoints that survive SIGKILL: completeness markers, resume resolution, no silent overwrite.

transformers 5.24 writes `checkpoint-N` in place (model, optimizer, scheduler, RNG states, trainer_state.json)
and then rotates old ones, all inside `Trainer._save_checkpoint`; a kill at any moment can leave a directory
that looks like a checkpoint but is half written, and its `get_last_checkpoint` takes the highest number
whatever its state. So:

- After the Trainer has written a checkpoint (its `on_save` event, every rank past a barrier), the main
  process fsyncs every file and writes `checkpoint_complete.json` last (atomically: temp file, fsync, rename),
  listing each file with its size. A checkpoint is complete only if that marker is there and every listed file
  still has its size, so a directory that was being written or being deleted is never taken for a complete one.
- We rotate (`--save_total_limit`, kept as `checkpoints_to_keep`) ourselves, after marking, instead of the
  Trainer (which rotates before `on_save`: with a limit of 1 a kill there would leave no complete checkpoint). A
  rotated checkpoint loses its marker before its files.
- `--resume_from_checkpoint true` resumes from the newest complete checkpoint in `--output_dir`; incomplete ones
  are deleted first, since the Trainer would write into them in place.
- A run into an output directory that holds a run stops with the exact command to resume or to overwrite. Every
  command a message suggests is the user's own, as typed (sft/options/command.py), with the run's own method and
  data options (sft/safety/trained_on.py).

Safe loading on resume (checked in transformers 5.24): the Trainer loads weights from safetensors and
`optimizer.pt`, `scheduler.pt`, `scaler.pt` and `rng_state*.pth` with `torch.load(weights_only=True)`; it never
loads the pickled `training_args.bin`, and neither do we. Exception: under DeepSpeed the Trainer hands resuming
to DeepSpeed 0.19.8, whose TorchCheckpointEngine.load unpickles with `weights_only=False` (its checkpoints hold
non-tensor objects): resume DeepSpeed runs only from checkpoints you wrote yourself.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

from sft.errors import ConfigError, NothingToDo, OutOfSpaceError
from sft.options.checks import PICKED_NEWEST, PICKED_NOTHING
from sft.options.command import command_with
from sft.options.resolve import resume_requested, resumes_newest
from sft.safety.run_dir import (ADAPTER_CONFIG, CHECKPOINT_MARKER, FINAL_MARKER, MODEL_FILES, TRAINER_STATE,
                                WEIGHT_FILES, checkpoint_dir, checkpoint_step, method_name, read_json_object,
                                runs_of)
from sft.safety.trained_on import as_option_values, recorded, run_method


# ---- completeness -------------------------------------------------------------------------------------------

def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != CHECKPOINT_MARKER)


def mark_complete(directory: Path, marker: str = CHECKPOINT_MARKER) -> None:
    """Flush every file of `directory` to disk, then write the marker listing them (the last write)."""
    directory = Path(directory)
    # The final marker lists the top-level files of the run (not the lock or other dot-files, which come and go).
    files = _files(directory) if marker == CHECKPOINT_MARKER else [p for p in directory.iterdir() if p.is_file()
                                                         and p.name != marker and not p.name.startswith(".")]
    for path in files:
        _fsync(path)
    manifest = {"files": {str(p.relative_to(directory)): p.stat().st_size for p in files}}
    tmp = directory / f".{marker}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / marker)
    _fsync(directory)
    _fsync(directory.parent)


def is_complete(directory: Path, marker: str = CHECKPOINT_MARKER) -> bool:
    try:
        manifest = json.loads((Path(directory) / marker).read_text())
        return all((Path(directory) / name).stat().st_size == size for name, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """checkpoint-N directories, oldest step first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if p.is_dir() and (step := checkpoint_step(p)) is not None]
    return [p for _, p in sorted(found)]


def newest_complete(output_dir: str | Path, up_to_step: int | None = None) -> Path | None:
    """The newest complete checkpoint (of step `up_to_step` or earlier, where given)."""
    complete = [p for p in checkpoint_dirs(output_dir) if is_complete(p)
                and (up_to_step is None or checkpoint_step(p) <= up_to_step)]
    return complete[-1] if complete else None


def remove_checkpoint(path: Path) -> None:
    """Marker first, so that a kill during the deletion leaves a directory no one takes for complete."""
    try:
        (path / CHECKPOINT_MARKER).unlink()
        _fsync(path)
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def rotate(output_dir: str | Path, limit: int | None, keep: str | None = None) -> None:
    """Keep the `limit` most recently completed checkpoints (and `keep`, the best one)."""
    if not limit or limit <= 0:
        return
    complete = [p for p in checkpoint_dirs(output_dir) if is_complete(p)]
    complete.sort(key=lambda p: (p / CHECKPOINT_MARKER).stat().st_mtime_ns)
    protected = set(complete[-limit:]) | ({Path(keep)} if keep else set())
    for path in complete:
        if path not in protected:
            remove_checkpoint(path)


# ---- re-running into an output directory -------------------------------------------------------------------

def holds_run(output_dir: str | Path) -> str | None:
    """What a previous run left in `output_dir` that a new run would overwrite, in words; None if nothing."""
    root = Path(output_dir)
    complete = [p for p in checkpoint_dirs(root) if is_complete(p)]
    model = [name for name in MODEL_FILES if (root / name).exists()]
    if not complete and not model:
        return None  # empty, logs only, or checkpoints of a run killed before its first complete one
    parts = []
    if complete:
        parts.append(f"{len(complete)} complete checkpoint(s), the newest {complete[-1].name}")
    if model:
        parts.append("a saved model" + (" (training finished)" if (root / FINAL_MARKER).exists() else ""))
    return " and ".join(parts)


def replace_run(output_dir: str | Path) -> str | None:
    """Make room for a new run, so that its files never mix with the old run's (an old adapter_config.json beside
    a new full model loads as neither): the old run is moved aside whole, next to it (a rename: no copy, nothing
    lost). -> what was done, in words, or None if it was empty."""
    from sft.safety.run_lock import LOCK_NAME

    root = Path(output_dir).resolve()
    entries = [p for p in root.iterdir() if p.name != LOCK_NAME] if root.is_dir() else []
    if not entries:
        return None
    aside = root.with_name(f"{root.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        aside.mkdir()
        for path in entries:
            os.rename(path, aside / path.name)
    except OSError as e:
        raise ConfigError(f"--overwrite_output_dir: cannot move the previous run in {root} aside to {aside} "
                          f"({e.strerror}). Move or delete it yourself, or give another --output_dir.") from None
    return f"Moved the previous run in {root} aside to {aside}; delete that when you no longer need it."


def trained_steps(checkpoint: Path) -> tuple[int, int] | None:
    """(global_step, max_steps) recorded in a checkpoint's trainer_state.json, None when unreadable."""
    try:
        state = json.loads((Path(checkpoint) / TRAINER_STATE).read_text())
        return int(state["global_step"]), int(state["max_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def longer_run_command(argv: list[str] | None, training_args, step: int, **as_run) -> str:
    """The command that resumes a finished run and trains it longer (twice as long). `as_run`: command_with's
    options that make it the run's own (its method, its data)."""
    longer = ({"max_steps": str(2 * max(step, 1))} if training_args.max_steps and training_args.max_steps > 0 else
              {"num_train_epochs": f"{2 * training_args.num_train_epochs:g}"})
    return command_with(argv, resume_from_checkpoint="true", output_dir=str(training_args.output_dir),
                        **{**as_run, **longer})


def complete_run_message(output_dir, step: int, argv: list[str] | None, training_args, **as_run) -> str:
    length = (f"--max_steps {training_args.max_steps}" if training_args.max_steps and training_args.max_steps > 0
              else f"--num_train_epochs {training_args.num_train_epochs:g}")
    return (f"the run in {output_dir} is complete: it reached step {step} ({length}); nothing was changed. To train "
            f"longer, raise --max_steps or --num_train_epochs and resume, e.g. "
            f"`{longer_run_command(argv, training_args, step, **as_run)}` (its learning rate then follows the "
            f"schedule of the new length from step {step} on).")


def as_the_run(output_dir: str | Path, checkpoint: Path | None, method: str, this_run: dict | None) -> dict:
    """command_with's options that turn this command into one for the run in `output_dir`: its method (never this
    command's --lora on a full fine-tune) and its model and data options where its record has them."""
    theirs = run_method(output_dir, checkpoint) or method
    saved = recorded(output_dir)
    data = as_option_values(saved, this_run) if saved and this_run else {}
    return {"method": theirs, "this_method": method, **data}


def resolve_resume(training_args, argv: list[str] | None = None, method: str = "full",
                   this_run: dict | None = None) -> str | None:
    """-> the checkpoint to resume from, or None to start fresh. Raises ConfigError when a run would be lost, and
    NothingToDo when the checkpoint already reached this run's --max_steps.

    Runs in the main process only (which holds the output directory's lock); train.py shares the answer.
    `method`: what this run trains (sft/safety/run_dir.py method_name); `this_run`: its record without the data's
    hash (sft/safety/trained_on.py this_run): the commands suggested for the run in the directory are that run's.
    """
    output_dir = Path(training_args.output_dir)
    value = resume_requested(training_args.resume_from_checkpoint)
    cleaning = training_args.should_save
    overwrite = getattr(training_args, "overwrite_output_dir", False)
    picked = getattr(training_args, "output_dir_picked", "")
    if value is not None and overwrite:
        raise ConfigError("--resume_from_checkpoint and --overwrite_output_dir contradict each other: give one.")
    if picked == PICKED_NOTHING:
        raise ConfigError(nothing_to_resume_message(output_dir, argv))

    def drop_incomplete():
        for path in checkpoint_dirs(output_dir):
            if cleaning and not is_complete(path):
                print(f"Removing {path}: an interrupted run left it incomplete.", flush=True)
                remove_checkpoint(path)

    if value is None:
        found = holds_run(output_dir)
        if found and not overwrite:
            newest = newest_complete(output_dir)
            steps = trained_steps(newest) if newest else None
            finished = (output_dir / FINAL_MARKER).exists() and steps and steps[0] >= steps[1]
            as_run = as_the_run(output_dir, newest, method, this_run)
            if finished:
                hint = f"To train it longer: `{longer_run_command(argv, training_args, steps[0], **as_run)}`. "
            elif newest:
                hint = f"To continue it: `{command_with(argv, resume_from_checkpoint='true', **as_run)}`. "
            else:
                hint = ""
            fresh = command_with(argv, overwrite_output_dir="true")
            raise ConfigError(f"--output_dir {output_dir} already holds a run ({found}); nothing was changed. "
                              f"{hint}To start over (the old run is moved aside): `{fresh}`. To train this as a new "
                              f"run in a directory of its own: `{command_with(argv, output_dir=None)}`.")
        if overwrite and cleaning:
            done = replace_run(output_dir)
            if done:
                print(done, flush=True)
        drop_incomplete()
        return None

    if resumes_newest(value):
        checkpoint = newest_complete(output_dir)
        if checkpoint is None:
            if any((output_dir / name).exists() for name in MODEL_FILES):
                raise ConfigError(f"--resume_from_checkpoint true: {output_dir} holds a saved model but no complete "
                                  f"checkpoint to resume from. To start over (the old run is moved aside): "
                                  f"{command_with(argv, resume_from_checkpoint='false', overwrite_output_dir='true')}")
            drop_incomplete()
            if cleaning:
                print(f"No complete checkpoint in {output_dir}: starting from the beginning.", flush=True)
            return None
    else:
        checkpoint = Path(value)
        if not checkpoint.is_dir():
            raise ConfigError(f"--resume_from_checkpoint {value}: no such directory. Give a checkpoint-N directory "
                              f"or `true` for the newest complete one in --output_dir.")
        inside = None if is_complete(checkpoint) else newest_complete(checkpoint)
        if inside:  # a run's output directory given for one of its checkpoints
            raise ConfigError(f"--resume_from_checkpoint {value} is a run's output directory, not a checkpoint. Its "
                              f"newest complete checkpoint: "
                              f"`{command_with(argv, resume_from_checkpoint=str(inside))}`.")
        if not is_complete(checkpoint) and checkpoint_step(checkpoint) is None \
                and not (checkpoint / TRAINER_STATE).exists():
            raise ConfigError(f"--resume_from_checkpoint {value} is not a checkpoint (no trainer_state.json): give "
                              f"a checkpoint-N directory that a run wrote, or `true` for the newest complete one in "
                              f"--output_dir.")
        if not is_complete(checkpoint):
            newest = newest_complete(checkpoint.parent)
            hint = (f" The newest complete one there is {newest}: "
                    f"{command_with(argv, resume_from_checkpoint=str(newest))}" if newest else
                    " No complete checkpoint is beside it: start the run over, without --resume_from_checkpoint.")
            raise ConfigError(f"--resume_from_checkpoint {value}: this checkpoint has no {CHECKPOINT_MARKER} (or its "
                              f"files changed since), so it was left half-written by an interrupted run.{hint}")
    steps = trained_steps(checkpoint)
    finished = (output_dir / FINAL_MARKER).exists()
    if finished and steps and training_args.max_steps and 0 < training_args.max_steps <= steps[0]:
        raise NothingToDo(complete_run_message(output_dir, steps[0], argv, training_args,
                                               **as_the_run(checkpoint.parent, checkpoint, method, this_run)))
    if checkpoint.resolve().parent == output_dir.resolve():
        drop_incomplete()
    if cleaning:
        which = (f" (the newest complete checkpoint of the newest run of this model and method in "
                 f"{output_dir.parent}; --output_dir picks another)" if picked == PICKED_NEWEST else
                 " (the newest complete checkpoint)" if resumes_newest(value) else "")
        print(f"Resuming from {checkpoint}{which}.", flush=True)
    return str(checkpoint)


def nothing_to_resume_message(new_run: Path, argv: list[str] | None) -> str:
    """--resume_from_checkpoint true without --output_dir, and no run of this model and method holds a checkpoint
    (`new_run`: the directory a new run would have had, which the lock may have made)."""
    folder = new_run.parent
    runs = [p for p in runs_of(folder.parent.name, folder.name, folder.parent.parent) if p.name != new_run.name]
    there = (f"; its run directories hold no checkpoint: {', '.join(p.name for p in runs)}" if runs else
             f"; {folder} holds no run")
    return (f"--resume_from_checkpoint true without --output_dir resumes the newest run of this model and method"
            f"{there}. Give the --output_dir of the run to resume, or start a new one: "
            f"`{command_with(argv, resume_from_checkpoint=None)}`.")


def check_resume_matches(checkpoint: str | None, model_args, lora_args, argv: list[str] | None,
                         output_dir: str | None = None) -> None:
    """A checkpoint resumes only into the training that wrote it: a LoRA adapter with --lora and the same rank,
    alpha and targets; a full fine-tune without --lora, from a model of the same shape. Checked before any model
    loads (the Trainer would fail after loading it, on sizes or optimizer groups, or, for another --lora_alpha,
    go on training the old weights at another scale)."""
    if checkpoint is None:
        return
    path = Path(checkpoint)
    adapter, config = read_json_object(path / ADAPTER_CONFIG), read_json_object(path / "config.json")
    if adapter is None and config is None:
        return  # a layout we do not read (e.g. DeepSpeed's or FSDP's shards alone): the Trainer checks it
    lora = lora_args.lora  # --qlora has set it (sft/options/resolve.py)
    this_method = method_name(lora, lora_args.qlora)
    start_over = "or train these options from the start in another --output_dir"
    same_run = {"output_dir": output_dir} if output_dir else {}
    if adapter is not None and not lora:
        theirs = run_method(path.parent, path) or "lora"
        raise ConfigError(f"--resume_from_checkpoint {path} holds a LoRA adapter, and this run trains every weight "
                          f"(no --lora). Resume it as it was trained: "
                          f"`{command_with(argv, method=theirs, this_method=this_method, **same_run)}`, {start_over}.")
    if adapter is None:
        if lora:
            raise ConfigError(f"--resume_from_checkpoint {path} holds a full fine-tune (every weight), and this run "
                              f"trains a LoRA adapter. Resume it as it was trained: "
                              f"`{command_with(argv, method='full', this_method=this_method, **same_run)}`, "
                              f"{start_over}.")
        from sft.model.loading import load_config

        ours = load_config(model_args).to_dict()
        shape = [f"{key} {config[key]} (--model {model_args.model}: {ours.get(key)})" for key in
                 ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size")
                 if key in config and config[key] != ours.get(key)]
        if shape:
            raise ConfigError(f"--resume_from_checkpoint {path} was trained from another model: its "
                              f"{', '.join(shape)}. Resume it with the --model it was trained from, {start_over}.")
        return
    from sft.model.loading import planned_lora_config

    try:
        planned = planned_lora_config(model_args, lora_args)
    except (KeyError, ValueError):  # a model type transformers cannot build weightless: rank and alpha only
        planned = None
    differ = {option: (adapter.get(key), getattr(planned, key, None) if planned else getattr(lora_args, option))
              for key, option in (("r", "lora_r"), ("lora_alpha", "lora_alpha"))}
    differ = {option: pair for option, pair in differ.items() if pair[0] != pair[1]}
    words = [f"--{option} {saved} (this run: {given})" for option, (saved, given) in differ.items()]
    targets = {}
    for key in ("target_modules", "target_parameters") if planned else ():
        saved, given = (_names(adapter.get(key), key), _names(getattr(planned, key, None), key))
        if saved != given:
            targets[key] = saved
            words.append(f"{key} {', '.join(sorted(saved)) or 'none'} (this run: {', '.join(sorted(given)) or 'none'})")
    if not words:
        return
    fix = (f"`{command_with(argv, **same_run, **{option: str(saved) for option, (saved, _) in differ.items()})}`"
           if not targets
           else "the same options, with " + " ".join(
               [f"--{option} {saved}" for option, (saved, _) in differ.items()]
               + [f"--lora_target_modules {' '.join(sorted(targets[key]))}" if key == "target_modules" else
                  "the --lora_experts (or --lora_target_modules) it had" for key in targets]))
    raise ConfigError(f"--resume_from_checkpoint {path} holds a LoRA adapter trained with {'; '.join(words)}. A "
                      f"checkpoint resumes only with the adapter it was trained with. Resume it as it was trained: "
                      f"{fix}, {start_over}.")


def _names(targets, key: str) -> set[str]:
    """peft's targets as a set; modules by their last name (peft writes all-linear's as full paths)."""
    names = [targets] if isinstance(targets, str) else targets or []
    return {name.rsplit(".", 1)[-1] if key == "target_modules" else name for name in names}


def out_of_space(error: BaseException, output_dir: str | Path, argv: list[str] | None) -> OutOfSpaceError | None:
    """A failure because the output directory's filesystem is full: ENOSPC/EDQUOT anywhere in the chain, or any
    failure while less than 64 MiB is left there (torch.save reports a full disk as "unexpected pos", safetensors
    as StorageFull). -> the error to report (what is kept, how to resume), else None."""
    seen, full = error, False
    while seen is not None and not full:
        full = isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT)
        seen = seen.__cause__ or seen.__context__
    try:
        free = shutil.disk_usage(output_dir).free
    except OSError:
        return None
    if not (full or free < 64 * 2**20):
        return None
    newest = newest_complete(output_dir)
    kept = (f"the newest complete checkpoint, {newest}, is intact" if newest else
            "no checkpoint was complete yet, so a resumed run starts from the beginning")
    return OutOfSpaceError(f"no space left in {output_dir} ({free / 2**20:.0f} MiB free): the run stopped while "
                           f"writing there ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). "
                           f"Nothing complete was lost: {kept}; a half-written checkpoint is ignored, and removed "
                           f"on resume. Free some space (or keep fewer checkpoints: --save_total_limit) and resume "
                           f"with: {command_with(argv, resume_from_checkpoint='true', output_dir=str(output_dir))}")


class ReachedEnd(Exception):
    """Raised by CompleteRunCheck: the resumed checkpoint is already at this run's last step."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


def run_is_finished(output_dir: str | Path) -> bool:
    return (Path(output_dir) / FINAL_MARKER).exists()


# ---- during training ----------------------------------------------------------------------------------------

def _barrier() -> None:
    from accelerate import PartialState

    PartialState().wait_for_everyone()


def complete_run_check():
    """The Trainer callback by which a resumed checkpoint that already reached this run's length (known exactly only
    once the Trainer has counted the steps of --num_train_epochs) ends train() before its first step, the
    checkpoint's weights loaded: the Trainer would train one step past the end. train.py then says there is nothing
    to do, or, when the final save was interrupted, writes the final model from those weights."""
    from transformers import TrainerCallback

    class CompleteRunCheck(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if state.global_step and state.global_step >= state.max_steps:
                raise ReachedEnd(state.global_step)

    return CompleteRunCheck()


def checkpoint_callback(verifier=None):
    """The Trainer callback that verifies, marks and rotates each checkpoint. It keeps `--save_total_limit`
    (args.checkpoints_to_keep); the Trainer, whose rotation runs before any callback can mark the new checkpoint
    complete, is handed none (sft/options/resolve.py our_rotation_keeps_checkpoints)."""
    from transformers import TrainerCallback

    class CompleteCheckpoints(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            """A run resumed from an older checkpoint rewrites later step numbers in place: unmark the old
            directory before the Trainer writes into it, or a kill mid-write would leave it marked complete."""
            save_ahead = control.should_save or (control.should_evaluate and args.save_strategy == "best")
            if args.should_save and save_ahead:
                stale = checkpoint_dir(args.output_dir, state.global_step) / CHECKPOINT_MARKER
                if stale.exists():
                    stale.unlink()
                    _fsync(stale.parent)

        on_epoch_end = on_step_end

        def on_save(self, args, state, control, model=None, **kwargs):
            path = checkpoint_dir(args.output_dir, state.global_step)
            _barrier()  # every rank has written its part (RNG states, ZeRO shards)
            if verifier is not None and verifier.checkpoints and verifier.verifiable(path):
                verifier.check(model, path)
            if args.should_save:
                mark_complete(path)
                rotate(args.output_dir, args.checkpoints_to_keep, state.best_model_checkpoint)
            _barrier()

    return CompleteCheckpoints()


def save_final(trainer, output_dir: str, verifier=None) -> None:
    """Save the model (or adapter) and tokenizer, verify the files by reloading them, then mark the run done."""
    root = Path(output_dir)
    if trainer.args.should_save:
        (root / FINAL_MARKER).unlink(missing_ok=True)  # first: until the new marker, the save counts as absent
        for stale in (p for pattern in WEIGHT_FILES for p in root.glob(pattern)):  # an earlier, interrupted save's
            stale.unlink()
    _barrier()
    trainer.save_model(output_dir)
    _barrier()
    if verifier is not None and verifier.final:
        verifier.check(trainer.model, root)
    if trainer.args.should_save:
        mark_complete(root, FINAL_MARKER)
