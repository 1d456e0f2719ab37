"""One model, two spellings: the hub names R1's distills `DeepSeek-R1-Distill-Qwen-7B`, so the planner's shapes
are `deepseek-r1-distill-qwen-7b`, while the recipes and the bench rows say `r1-distill-qwen-7b`. Every lookup of a
model or recipe by name (the planner's --model, `--config <recipe name>`, the bench's --model) takes either: the
`deepseek-` prefix is optional."""

from __future__ import annotations

from collections.abc import Container

PREFIX = "deepseek-"


def spellings(name: str) -> tuple[str, str]:
    """`name` as given, then with the `deepseek-` prefix taken off (or put on when it has none)."""
    return (name, name[len(PREFIX):]) if name.lower().startswith(PREFIX) else (name, PREFIX + name)


def known_as(name: str, known: Container[str]) -> str | None:
    """The spelling of `name` (lower case) that `known` holds, or None."""
    return next((s for s in spellings(name.lower()) if s in known), None)
