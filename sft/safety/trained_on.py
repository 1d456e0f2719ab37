"""What a run trains, kept with it: `<output_dir>/trained_on.json` holds its model, method, data options and the
hash of its prepared training data, written when the run starts (before its first step).

The Trainer resumes any checkpoint onto whatever data it is given, so a resume with another --dataset (or
--max_length, --packing, --template, or a data file whose contents changed) would go on training the old run on
new data without a word. A resume whose record differs from this run's is refused before any model loads, naming
what differs, and the messages that suggest a command for a run in a directory (resume it, train it longer) give
that run's own options, not the ones just typed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sft.errors import ConfigError
from sft.options.command import command_with
from sft.safety.run_dir import ADAPTER_CONFIG, QUANTIZED_BASE, TRAINED_ON, method_name

# The options of the record, as a command line names them (data_hash and method have no option of their own):
# the model, its data and what a checkpoint's state depends on (--rope_scaling's positions, LoRA+'s groups, the
# modules trained whole beside the adapter).
OPTIONS = ("model", "dataset", "dataset_dir", "dataset_format", "template", "max_length", "packing", "rope_scaling",
           "loraplus_lr_ratio", "lora_modules_to_save")


def _where(value: str | None) -> str | None:
    """A local path as an absolute one (the same file from another directory is the same data); a hub name as is."""
    if value is None:
        return None
    path = Path(value).expanduser()
    return str(path.resolve()) if path.exists() else value


def this_run(model_args, data_args, lora_args, data_hash: str | None = None) -> dict:
    """This run's record (`data_hash`: sft/data/dataset.py training_data_hash; None before the data is prepared)."""
    return {"model": _where(model_args.model), "method": method_name(lora_args.lora, lora_args.qlora),
            "dataset": [_where(spec) for spec in data_args.dataset or []], "dataset_dir": _where(data_args.dataset_dir),
            "dataset_format": data_args.dataset_format, "template": data_args.template,
            "max_length": data_args.max_length, "packing": bool(data_args.packing),
            "rope_scaling": getattr(model_args, "rope_scaling", None),  # the positions the model trains at
            # LoRA+: the optimizer's groups, which a checkpoint's optimizer state must match (None: off)
            "loraplus_lr_ratio": getattr(lora_args, "loraplus_lr_ratio", 0.0) or None,
            # the adapter's modules trained whole: the checkpoint's weights and optimizer state hold them (None: none)
            "lora_modules_to_save": getattr(lora_args, "lora_modules_to_save", None) or None,
            "data_hash": data_hash}


def recorded(run_dir: str | Path) -> dict | None:
    """The record a run left in its directory; None for a run from before records (or an unreadable one)."""
    try:
        value = json.loads((Path(run_dir) / TRAINED_ON).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def record(output_dir: str | Path, trained: dict) -> None:
    """Write the record (a temporary file, then a rename: a reader never sees half of one)."""
    path = Path(output_dir) / TRAINED_ON
    staging = path.with_name(f".{TRAINED_ON}.{os.getpid()}")
    staging.write_text(json.dumps(trained, indent=1) + "\n")
    os.replace(staging, path)


def run_method(run_dir: str | Path, checkpoint: str | Path | None = None) -> str | None:
    """What the run in `run_dir` trains: its record's method, else what its checkpoint or final save holds (an
    adapter: lora, qlora beside its quantized base's record; a model: full); None when nothing says."""
    saved = recorded(run_dir)
    if saved and saved.get("method"):
        return saved["method"]
    for where in (Path(checkpoint),) if checkpoint else ():
        if (where / ADAPTER_CONFIG).exists():
            return "lora"
        if (where / "config.json").exists():
            return "full"
    root = Path(run_dir)
    if (root / ADAPTER_CONFIG).exists():
        return "qlora" if (root / QUANTIZED_BASE).exists() else "lora"
    return "full" if (root / "config.json").exists() else None


def differences(saved: dict, ours: dict) -> dict[str, tuple]:
    """{what: (the run's, this run's)} for every option that differs; where none does, the prepared data when both
    records know its hash (the same options on files whose contents changed, or another tokenizer)."""
    differ = {name: (saved.get(name), ours.get(name)) for name in OPTIONS if saved.get(name) != ours.get(name)}
    if not differ and saved.get("data_hash") and ours.get("data_hash") and saved["data_hash"] != ours["data_hash"]:
        differ["data_hash"] = (saved["data_hash"], ours["data_hash"])
    return differ


def as_option_values(saved: dict, ours: dict) -> dict[str, str | list[str] | None]:
    """The options that make this command train the saved run's model and data ({} when they already do)."""
    values: dict[str, str | list[str] | None] = {}
    for name, (theirs, _) in differences(saved, ours).items():
        if name == "data_hash":
            continue
        values[name] = (theirs if isinstance(theirs, (list, type(None))) else
                        str(theirs).lower() if isinstance(theirs, bool) else str(theirs))
    return values


def _described(name: str, value) -> str:
    if name == "data_hash":
        return f"hash {value}"
    if isinstance(value, list):
        return " ".join(value) or "none"
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def check_same_training(checkpoint: str, saved: dict, ours: dict, argv: list[str] | None, output_dir: str) -> None:
    """Refuse to resume `checkpoint`, whose run trained `saved`, with this run's `ours` where they differ."""
    differ = differences(saved, ours)
    if not differ:
        return
    words = [f"--{name} {_described(name, theirs)} (this run: {_described(name, mine)})" if name != "data_hash" else
             f"the prepared training data, {_described(name, theirs)} (this run: {_described(name, mine)})"
             for name, (theirs, mine) in differ.items()]
    method = saved.get("method")
    fix = as_option_values(saved, ours)
    if fix:
        again = ("Resume it as it was trained: `" + command_with(argv, method=method, this_method=ours["method"],
                                                                 output_dir=output_dir, **fix) + "`")
    else:  # the same options, other data: the files' contents, the tokenizer, --overlong, --train_on_prompt, ...
        again = ("The data files' contents, the tokenizer or another data option (--overlong, --train_on_prompt, "
                 "--eval_split, --max_samples) changed since it started: resume with the data it trained on")
    fresh = command_with(argv, resume_from_checkpoint=None, output_dir=None)
    raise ConfigError(f"--resume_from_checkpoint {checkpoint}: the run in {output_dir} trained with "
                      f"{'; '.join(words)}. A checkpoint resumes only onto the model, data and options it was "
                      f"trained with, so nothing was trained. "
                      f"{again}, or train this data as a new run (its own directory): `{fresh}`.")


def keep_record(resume: str | None, output_dir: str, ours: dict, argv: list[str] | None) -> None:
    """Main process, before the model loads: a resumed run must be the run it resumes (else ConfigError); a run
    with no record yet (new, or older than records) gets this one's."""
    if resume is not None:
        saved = recorded(Path(resume).parent)
        if saved is not None:
            check_same_training(resume, saved, ours, argv, output_dir)
    if resume is None or recorded(output_dir) is None:
        record(output_dir, ours)
