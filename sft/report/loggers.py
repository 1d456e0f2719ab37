"""Where the loggers --report_to names file a run. The Trainer's Weights & Biases logger takes its project from the
environment alone (WANDB_PROJECT; transformers 5's `--project` names Trackio's), so a `--project` of the command line
or recipe (Axolotl's `wandb_project`, sft/options/argv.py) is handed to it there, before the Trainer starts it."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DEFAULT_PROJECT = "huggingface"  # TrainingArguments.project's default, and the Trainer's for wandb


def wandb_project(report_to: list[str], project: str,
                  environ: MutableMapping[str, str] = os.environ) -> str | None:
    """WANDB_PROJECT set to `project` where wandb reports and a project was named (the option wins over the
    environment, as the more specific: Axolotl does the same); -> the project set, or None."""
    if project == DEFAULT_PROJECT or not {"wandb", "all"} & set(report_to):
        return None
    environ["WANDB_PROJECT"] = project
    return project
