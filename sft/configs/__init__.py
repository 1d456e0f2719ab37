"""The files the package ships (package data), found the same way from a checkout and from a wheel install.

    sft/configs/accelerate_configs/*.yaml   the strategies' accelerate configs
    sft/configs/ds_configs/*.json           the DeepSpeed configs they name
    sft/configs/recipes/*.yaml              the recipes for the box (`--config`)
    sft/data/demo/*.json(l)                 the demo's default dataset

This folder mirrors the repository root: `accelerate_configs/`, `ds_configs/` and `recipes/` there are links to
the folders here (one copy in git), so the DeepSpeed yamls' relative `deepspeed_config_file: ds_configs/zero3.json`
resolves from the checkout root as accelerate reads it (from the current directory), and from this folder
otherwise; and `--config recipes/deepseek-llm-7b-lora.yaml` reads the same file in a checkout and, typed anywhere
else, the shipped one.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from sft.names import spellings

CONFIGS = Path(__file__).resolve().parent
ACCELERATE_CONFIGS = CONFIGS / "accelerate_configs"
RECIPES = CONFIGS / "recipes"
DEMO_DATA = CONFIGS.parent / "data" / "demo"


def shipped_names() -> list[str]:
    return sorted(p.name for p in ACCELERATE_CONFIGS.glob("*.yaml"))


def shipped_config(name: str) -> Path | None:
    """The shipped accelerate config a user means by `zero3.yaml`, `zero3` or `accelerate_configs/zero3.yaml` (the
    checkout's path, typed elsewhere), else None. Any other path is the user's own file."""
    return _shipped(name, ACCELERATE_CONFIGS)


def shipped_recipe(name: str) -> Path | None:
    """The shipped recipe a user means by `deepseek-llm-7b-lora.yaml`, `deepseek-llm-7b-lora` or
    `recipes/deepseek-llm-7b-lora.yaml` (the checkout's path, typed elsewhere), else None. The model's `deepseek-`
    prefix is optional (sft/names.py): `deepseek-r1-distill-qwen-7b-lora` is `r1-distill-qwen-7b-lora.yaml`."""
    path = Path(name)
    return next((found for spelling in spellings(path.name)
                 if (found := _shipped(str(path.with_name(spelling)), RECIPES))), None)


def shipped_recipe_names() -> list[str]:
    return sorted(p.name for p in RECIPES.glob("*.yaml"))


def _shipped(name: str, folder: Path) -> Path | None:
    """`name` as a file of `folder`: its bare name, without .yaml, or under the folder's name in the checkout."""
    path = Path(name)
    if str(path.parent) not in (".", folder.name):
        return None
    found = folder / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    return found if found.is_file() else None


def deepspeed_file(config: Path) -> tuple[Path | None, str | None]:
    """(the DeepSpeed json an accelerate config names, to pass to the launch explicitly; an error), both None when
    the config names none or accelerate finds it as is. A relative path is read from the current directory, as
    accelerate does; one that is not there but is a shipped name (`ds_configs/zero3.json`) is the shipped file."""
    try:
        data = yaml.safe_load(config.read_text()) or {}
    except yaml.YAMLError as e:
        return None, f"--config_file {config}: not a YAML file ({getattr(e, 'problem', None) or e}); fix or replace it."
    named = ((data.get("deepspeed_config") or {}) if isinstance(data, dict) else {}).get("deepspeed_config_file")
    if not named or Path(named).expanduser().is_file():
        return None, None
    shipped = CONFIGS / named
    if not Path(named).is_absolute() and shipped.is_file():
        return shipped, None
    return None, (f"--config_file {config}: its deepspeed_config_file {named} is not found (a relative path is read "
                  f"from the current directory); give its absolute path in the config.")
