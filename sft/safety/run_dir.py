"""The layout of a run's output directory (--output_dir): every file and folder name in it, and the paths built
from them. The modules that write or read these files import the names from here, so that a name changes in one
place and a reader (resume, the tools, the tests) never disagrees with the writer. Stdlib only: imported by
modules of every folder.

    <output_dir>/
      .run.lock                  the process that holds the directory (sft/safety/run_lock.py)
      trainer_log.jsonl          one line a training log (sft/report/telemetry.py)
      all_results.json, loss.png at the end of training (sft/report/telemetry.py)
      moe_load.jsonl             per-expert token counts, with --moe_log_counts (sft/model/moe.py)
      runs/                      the Trainer's TensorBoard logs, unless TENSORBOARD_LOGGING_DIR is set
      quantized_base.json        beside a --qlora adapter: how its base was quantized (sft/model/loading.py)
      training_complete.json     written last, after the final save was verified (sft/safety/checkpoints.py)
      model / adapter files      the Trainer's save_model (MODEL_FILES, WEIGHT_FILES)
      checkpoint-N/
        checkpoint_complete.json written last: the checkpoint's files and sizes (sft/safety/checkpoints.py)
        trainer_state.json, scheduler.pt, rng_state_<rank>.pth   the Trainer's
        tp_state/, tp_state.json with --tp_size (sft/parallel/tensor_parallel.py)
"""

from __future__ import annotations

import re
from pathlib import Path

LOCK_NAME = ".run.lock"
TRAINER_LOG = "trainer_log.jsonl"
ALL_RESULTS = "all_results.json"
LOSS_PLOT = "loss.png"
MOE_LOAD = "moe_load.jsonl"
TENSORBOARD_DIR = "runs"  # the Trainer's default logging_dir: <output_dir>/runs/<date>_<host>
QUANTIZED_BASE = "quantized_base.json"
FINAL_MARKER = "training_complete.json"
CHECKPOINT_MARKER = "checkpoint_complete.json"

# Named by transformers and peft; listed here since resume and the tools look for them.
CHECKPOINT_PREFIX = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR
CHECKPOINT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")
TRAINER_STATE = "trainer_state.json"
SCHEDULER_FILE = "scheduler.pt"  # the Trainer's name, so that a checkpoint reads the same whatever wrote it
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# What a finished run leaves at the top of --output_dir (the model or adapter, written by save_model).
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", ADAPTER_WEIGHTS,
               "pytorch_model.bin", "adapter_model.bin", FINAL_MARKER)
# Weights a final save writes (sharded or not); a new final save first removes any left by an interrupted one.
WEIGHT_FILES = ("model*.safetensors", "*.safetensors.index.json", "adapter_model.*", ADAPTER_CONFIG)

# Tensor parallelism's own training state, inside checkpoint-N.
TP_STATE_DIR = "tp_state"
TP_STATE_INFO = "tp_state.json"


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """checkpoint-N, as the Trainer names the checkpoint of step N."""
    return Path(output_dir) / f"{CHECKPOINT_PREFIX}-{step}"


def checkpoint_step(path: str | Path) -> int | None:
    """N for a checkpoint-N directory; None for any other name."""
    match = CHECKPOINT_RE.match(Path(path).name)
    return int(match.group(1)) if match else None
