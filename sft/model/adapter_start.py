"""`--lora_from DIR`: a LoRA run that starts from a saved adapter instead of a new one, and trains it on (a second round
on new data; LLaMA-Factory's adapter_name_or_path, Axolotl's lora_model_dir).

The adapter's own config decides its shape (rank, alpha, targets, rsLoRA/DoRA, modules trained whole): a run that
also gives one of those options is refused, since peft would load the weights into the adapter's shape whatever the
command says. Its base is --model, or, where --model is not given, the base the adapter names. Read and checked
before any model loads (`adapter_config`, `check_adapter`); peft loads the weights onto the base (`load_adapter`).
"""

from __future__ import annotations

from pathlib import Path

from sft.errors import ConfigError
from sft.safety.run_dir import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_json_object

# the LoRA options that the adapter's config sets instead
SHAPE_OPTIONS = ("lora_r", "lora_alpha", "lora_target_modules", "use_rslora", "use_dora", "lora_modules_to_save",
                 "lora_experts")


def adapter_config(adapter: str) -> dict:
    """The saved adapter's adapter_config.json; one error line where `adapter` is not a saved LoRA adapter."""
    path = Path(adapter)
    config = read_json_object(path / ADAPTER_CONFIG)
    if config is None:
        found = ("no such directory" if not path.exists() else "a file, not a directory" if not path.is_dir() else
                 f"its {ADAPTER_CONFIG} is not readable JSON" if (path / ADAPTER_CONFIG).exists() else
                 f"it holds no {ADAPTER_CONFIG}")
        raise ConfigError(f"--lora_from {adapter}: {found}; give the --output_dir of a finished --lora run, or one of "
                          f"its checkpoint-N directories.")
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"--lora_from {adapter}: a {config.get('peft_type', 'non-peft')} adapter; --lora_from trains "
                          f"a LoRA adapter on.")
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(f"--lora_from {adapter}: {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS} (a save that did not "
                          f"finish); give a finished run's --output_dir or a complete checkpoint-N.")
    return config


def check_adapter(adapter: str, given: frozenset[str], experts_adapted: bool) -> None:
    """What a run from `adapter` cannot take: its shape given again (`given`: the options the user gave), routed
    experts adapted (`experts_adapted`: their split LoRA is built at a new adapter's creation only)."""
    adapter_config(adapter)
    again = [f"--{name}" for name in SHAPE_OPTIONS if name in given]
    if again:
        raise ConfigError(f"--lora_from {adapter} with {', '.join(again)}: the adapter's own config sets its rank, "
                          f"alpha and targets, which it keeps; leave {' and '.join(again)} out (or start a new "
                          f"adapter without --lora_from).")
    if experts_adapted:
        raise ConfigError(f"--lora_from {adapter}: it adapts the routed experts (--lora_experts), which a run can only "
                          f"start with a new adapter; merge it into the base (deepseek-sft merge) and train a new "
                          f"one on the merged model.")


def base_of(adapter: str) -> str | None:
    """The base model the adapter names (base_model_name_or_path), where it is readable."""
    config = read_json_object(Path(adapter) / ADAPTER_CONFIG) or {}
    return config.get("base_model_name_or_path") or None


def adapts_experts(adapter: str) -> bool:
    """Whether the adapter's LoRA reaches the routed experts' fused weights (a --lora_experts run's adapter)."""
    config = read_json_object(Path(adapter) / ADAPTER_CONFIG) or {}
    return any(".experts." in name or name.startswith("experts.") for name in config.get("target_parameters") or ())


def settings_of(adapter: str) -> dict:
    """The adapter's own LoRA settings under our options' names (lora_r, lora_alpha, lora_dropout, use_rslora,
    use_dora), those readable: what the run's options say where the user gave none (the planner, the first screen
    and the run's record read them)."""
    config = read_json_object(Path(adapter) / ADAPTER_CONFIG) or {}
    ours = {"r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout", "use_rslora": "use_rslora",
            "use_dora": "use_dora"}
    return {option: config[key] for key, option in ours.items() if isinstance(config.get(key), int | float)}


def load_adapter(model, adapter: str, dropout: float):
    """peft's PeftModel over `model` with the saved adapter's weights, trainable, its dropout `dropout`. -> (the
    model, the weights it adapts as parameters, the modules it trains whole)."""
    from peft import LoraConfig, PeftModel

    config = LoraConfig.from_pretrained(adapter)
    config.lora_dropout = dropout
    model = PeftModel.from_pretrained(model, adapter, config=config, is_trainable=True)
    print(f"LoRA: starting from the adapter in {adapter} (rank {config.r}, alpha {config.lora_alpha}).")
    return model, list(config.target_parameters or []), list(config.modules_to_save or [])
