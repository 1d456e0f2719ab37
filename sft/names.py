"""One model, two spellings: the hub names R1's distills `DeepSeek-R1-Distill-Qwen-7B`, so the planner's shapes
are `deepseek-r1-distill-qwen-7b`, while the recipes and the bench rows say `r1-distill-qwen-7b`. Every lookup of a
model or recipe by name (the planner's --model, training's --model, `--config <recipe name>`, the bench's --model)
takes either: the `deepseek-` prefix is optional.

The released models of each name (RELEASES) live here, not in the planner, so that training maps a short name to
its hub id without importing the planner (sft/options never does)."""

from __future__ import annotations

from collections.abc import Container
from pathlib import Path

PREFIX = "deepseek-"

# The released models of each of the planner's built-in shapes (sft/plan/shapes.py SHAPES, same keys), as hub ids
# (each one in sft/model/families.py VARIANTS; tests keep both so): the first is what a short name trains, the base
# model where there is one, as a recipe's fine-tune starts from; a released name typed in any case, with or
# without `deepseek-ai/`, trains that model.
RELEASES: dict[str, tuple[str, ...]] = {
    "deepseek-llm-7b": ("deepseek-ai/deepseek-llm-7b-base", "deepseek-ai/deepseek-llm-7b-chat"),
    "deepseek-llm-67b": ("deepseek-ai/deepseek-llm-67b-base", "deepseek-ai/deepseek-llm-67b-chat"),
    "deepseek-coder-6.7b": ("deepseek-ai/deepseek-coder-6.7b-base", "deepseek-ai/deepseek-coder-6.7b-instruct"),
    "deepseek-coder-1.3b": ("deepseek-ai/deepseek-coder-1.3b-base", "deepseek-ai/deepseek-coder-1.3b-instruct"),
    "deepseek-r1-distill-qwen-1.5b": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",),
    "deepseek-r1-distill-qwen-7b": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",),
    "deepseek-r1-distill-qwen-14b": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-14B",),
    "deepseek-r1-distill-llama-8b": ("deepseek-ai/DeepSeek-R1-Distill-Llama-8B",),
    "deepseek-r1-distill-llama-70b": ("deepseek-ai/DeepSeek-R1-Distill-Llama-70B",),
    "deepseek-r1-0528-qwen3-8b": ("deepseek-ai/DeepSeek-R1-0528-Qwen3-8B",),
    "deepseek-v2-lite": ("deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2-Lite-Chat"),
}


def spellings(name: str) -> tuple[str, str]:
    """`name` as given, then with the `deepseek-` prefix taken off (or put on when it has none)."""
    return (name, name[len(PREFIX):]) if name.lower().startswith(PREFIX) else (name, PREFIX + name)


def known_as(name: str, known: Container[str]) -> str | None:
    """The spelling of `name` (lower case) that `known` holds, or None."""
    return next((s for s in spellings(name.lower()) if s in known), None)


def hub_id(model: str) -> str:
    """What --model loads: a local directory or a hub id (`owner/name`) as given (a directory wins over a short
    name); a released name without its owner, in any case, as its hub id; a short name (either spelling) as its
    base model's hub id (RELEASES); anything else as given."""
    if "/" in model or Path(model).expanduser().is_dir():
        return model
    key = known_as(model, RELEASES) or model.lower()
    if key in RELEASES:
        return RELEASES[key][0]
    return next((hub for hubs in RELEASES.values() for hub in hubs if hub.rsplit("/", 1)[1].lower() == key), model)
