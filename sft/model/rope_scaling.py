"""--rope_scaling linear|dynamic|yarn: rows longer than the positions a model was trained on (deepseek-llm-7b and
67b: 4,096), with RoPE stretched to cover them, as LLaMA-Factory's option of the same name does.

The factor is the smallest whole number that covers --max_length (LLaMA-Factory's rule: ceil(max_length /
max_position_embeddings)); the model's config gets transformers' own RoPE parameters for it (`rope_parameters`:
rope_type, factor, and for dynamic and yarn the original length) and max_position_embeddings times the factor, as the
model loads. A full fine-tune saves them in its config.json, so the saved model loads scaled with plain
transformers. A LoRA adapter's base is the unscaled model: the run writes ROPE_RECORD beside the adapter with the
config values to load the base with, which the save check, `deepseek-sft chat` and `deepseek-sft merge` apply (and a
user passes to from_pretrained: docs/speed.md, Long rows). A merged model carries them in its config.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from sft.errors import ConfigError
from sft.model.families import rope_of
from sft.safety.run_dir import ROPE_RECORD  # beside a LoRA adapter: the base's config values it was trained with

ROPE_SCALINGS = ("linear", "dynamic", "yarn")
ROPE_KEYS = ("rope_parameters", "max_position_embeddings")  # the config values rope_overrides sets


def rope_overrides(config, kind: str | None, max_length: int) -> dict:
    """from_pretrained's config values that scale `config`'s RoPE to cover `max_length` tokens: {} without
    --rope_scaling or where the model's positions already cover them."""
    if kind is None:
        return {}
    params = getattr(config, "rope_parameters", None)
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(params, dict) or not limit:
        raise ConfigError(f"--rope_scaling {kind}: this model's config has no RoPE parameters transformers can scale "
                          f"(model_type {getattr(config, 'model_type', '?')}); drop the option.")
    present = rope_of(config)  # deepseek-coder: linear x4 (16,384 positions); DeepSeek-V2/V3: yarn
    if present["rope_type"] != "default":
        raise ConfigError(f"--rope_scaling {kind}: the model's RoPE is already scaled ({present['rope_type']}, factor "
                          f"{present.get('factor')}, {limit:,} positions); drop --rope_scaling.")
    if max_length <= limit:
        return {}
    factor = float(math.ceil(max_length / limit))
    scaled = {**params, "rope_type": kind, "factor": factor}
    if kind in ("dynamic", "yarn"):
        scaled["original_max_position_embeddings"] = limit
    return {"rope_parameters": scaled, "max_position_embeddings": int(limit * factor)}


def scaled(config, overrides: dict):
    """`config` as the model will load with `overrides` (from_pretrained sets them the same way)."""
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def rope_line(kind: str | None, overrides: dict, limit: int | None, max_length: int) -> str | None:
    """The first screen's line about --rope_scaling, or None without it."""
    if kind is None:
        return None
    if not overrides:
        return (f"RoPE: not scaled (--rope_scaling {kind}): --max_length {max_length:,} is within the model's "
                f"{limit:,} positions.")
    factor, positions = overrides["rope_parameters"]["factor"], overrides["max_position_embeddings"]
    line = f"RoPE: {kind}, factor {factor:g}: {limit:,} -> {positions:,} positions (--rope_scaling)"
    if kind == "dynamic":  # transformers' dynamic NTK recomputes the frequencies for each batch's longest row
        line += ("; dynamic NTK changes the frequencies with each batch's longest row, so training and inference "
                 "agree only at the same lengths: linear or yarn suit fine-tuning better")
    return line


def write_rope_record(overrides: dict, output_dir: str) -> None:
    """Beside a LoRA adapter: the config values its base loads with (read by rope_record)."""
    (Path(output_dir) / ROPE_RECORD).write_text(json.dumps(overrides, indent=1) + "\n")


def rope_record(adapter_dir: str | Path) -> dict:
    """The config values the base of the adapter in `adapter_dir` (a run directory or one of its checkpoints)
    loads with, or {} for an adapter trained without --rope_scaling."""
    for where in (Path(adapter_dir), Path(adapter_dir).parent):
        if (where / ROPE_RECORD).is_file():
            return json.loads((where / ROPE_RECORD).read_text())
    return {}
