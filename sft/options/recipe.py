"""A recipe YAML (`--config recipe.yaml`) as command-line options: its keys become options, so that a recipe and the
command line are parsed and validated the same way (sft/options/arguments.py), and the planner reads a bench row's recipe as
its training did (sft/plan/planner.py)."""

from __future__ import annotations

from pathlib import Path

from sft.errors import ConfigError


def recipe_to_argv(recipe: dict, path: str) -> list[str]:
    """A YAML recipe's keys become command-line options, so both are parsed (and validated) the same way."""
    argv = []
    for key, value in recipe.items():
        if not isinstance(key, str):
            raise ConfigError(f"{path}: option names must be strings, got {key!r}.")
        if key == "config":
            raise ConfigError(f"{path}: a recipe cannot name another --config.")
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        argv.append(f"--{key}")
        for v in values:
            argv.append(str(v).lower() if isinstance(v, bool) else _json_if_dict(v))
    return argv


def _json_if_dict(value) -> str:
    import json

    return json.dumps(value) if isinstance(value, dict) else str(value)


def load_recipe(path: str) -> list[str]:
    """A recipe file's options; a path that is no file but names a shipped recipe (`deepseek-llm-7b-lora.yaml`, or
    the checkout's `recipes/deepseek-llm-7b-lora.yaml` typed elsewhere) is that recipe, from any directory, a wheel
    install included. A file of the user's own wins."""
    import yaml

    from sft.configs import shipped_recipe, shipped_recipe_names

    shipped = None if Path(path).expanduser().exists() else shipped_recipe(path)
    try:
        text = (shipped or Path(path).expanduser()).read_text()
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file; give a recipe file or a shipped recipe's name "
                          f"({', '.join(shipped_recipe_names())}).") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read the file ({e.strerror}).") from None
    try:
        recipe = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise ConfigError(f"{where}: invalid YAML ({getattr(e, 'problem', e)}).") from None
    if not isinstance(recipe, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of option: value, got {type(recipe).__name__}.")
    return recipe_to_argv(recipe, path)
