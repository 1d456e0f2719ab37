"""What `sft.tools.chat` and `sft.tools.merge` are given must be something a run saved: a model or a LoRA adapter (a finished
run's output directory or one of its checkpoints) whose base can be loaded. Checked before anything loads, so that a
wrong directory is one line that says what it is and what to give instead."""

from __future__ import annotations

from pathlib import Path

from sft.safety.checkpoints import newest_complete
from sft.errors import ConfigError, ModelNotFoundError
from sft.safety.run_dir import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_json_object


def check_trained_dir(path: Path, adapter_only: bool = False) -> None:
    """A saved model or LoRA adapter (`adapter_only`: an adapter) whose base loads; else a UserFacingError that says
    what `path` is and what to give instead."""
    adapter, config = read_json_object(path / ADAPTER_CONFIG), read_json_object(path / "config.json")
    if adapter is None and (adapter_only or config is None):
        files = (ADAPTER_CONFIG,) if adapter_only else (ADAPTER_CONFIG, "config.json")
        if not path.is_dir():
            found = "no such directory" if not path.exists() else "a file, not a directory"
        elif any((path / name).exists() for name in files):
            found = f"its {' or '.join(name for name in files if (path / name).exists())} is not readable JSON"
        elif adapter_only and config is not None:
            found = "a full model, not a LoRA adapter (it needs no merge)"
        else:
            found = f"it holds no {' or '.join(files)}"
        newest = newest_complete(path) if path.is_dir() else None
        hint = (f"it holds checkpoints of a run that did not finish: give the newest complete one, {newest}" if newest
                else f"give the --output_dir of a finished {'--lora ' if adapter_only else ''}run, or one of its "
                     f"checkpoint-N directories")
        raise ConfigError(f"{path}: {found}; {hint}.")
    if adapter is not None:
        if "peft_type" not in adapter:
            raise ConfigError(f"{path}/{ADAPTER_CONFIG} is not a peft adapter's config (no peft_type).")
        base, where = adapter.get("base_model_name_or_path"), path / ADAPTER_CONFIG
        if not base:
            raise ConfigError(f"{where} names no base model (base_model_name_or_path): set it to the base's "
                              f"directory or hub id.")
        from sft.model.loading import resolve_model_path  # here: it imports torch and peft (~6 s)

        try:
            resolve_model_path(str(base), "its base model")
        except ModelNotFoundError as e:
            raise ModelNotFoundError(f"{path} is a LoRA adapter whose base cannot be loaded ({str(e).split('. ')[0]}). "
                                     f"Make the base available there (put it back, or download it), or set "
                                     f"base_model_name_or_path in {where} to where it is now.") from None
    weights = ADAPTER_WEIGHTS if adapter is not None else "*.safetensors"
    if not any(path.glob(weights)):
        raise ConfigError(f"{path} holds a {'adapter_config' if adapter is not None else 'config'}.json but no "
                          f"weights ({weights}): a save that did not finish, or only a config. Give a finished "
                          f"run's --output_dir or a complete checkpoint-N.")
