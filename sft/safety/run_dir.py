"""The layout of a run's output directory (--output_dir): every file and folder name in it, and the paths built
from them. The modules that write or read these files import the names from here, so that a name changes in one
place and a reader (resume, the tools, the tests) never disagrees with the writer. Stdlib only: imported by
modules of every folder.

    output/<model>/<method>/<YYYYmmdd-HHMMSS>/   the --output_dir of a run that names none (new_run_dir)
    output/<model>/<method>/latest              -> the newest of them whose training finished (point_latest)

    <output_dir>/
      .run.lock                  the process that holds the directory (sft/safety/run_lock.py)
      trained_on.json            what the run trains: model, method, data options, the prepared data's hash
                                 (sft/safety/trained_on.py; a resume onto other data is refused)
      trainer_log.jsonl          one line a training log (sft/report/telemetry.py)
      all_results.json, loss.png at the end of training (sft/report/telemetry.py)
      moe_load.jsonl             per-expert token counts, with --moe_log_counts (sft/model/moe.py)
      runs/                      the Trainer's TensorBoard logs, unless TENSORBOARD_LOGGING_DIR is set
      quantized_base.json        beside a --qlora adapter: how its base was quantized (sft/model/loading.py)
      rope_scaling.json          beside a LoRA adapter of --rope_scaling: its base's RoPE (sft/model/rope_scaling.py)
      training_complete.json     written last, after the final save was verified (sft/safety/checkpoints.py)
      model / adapter files      the Trainer's save_model (MODEL_FILES, WEIGHT_FILES)
      checkpoint-N/
        checkpoint_complete.json written last: the checkpoint's files and sizes (sft/safety/checkpoints.py)
        trainer_state.json, scheduler.pt, rng_state_<rank>.pth   the Trainer's
        tp_state/, tp_state.json with --tp_size (sft/parallel/tensor_parallel.py)
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

LOCK_NAME = ".run.lock"
TRAINED_ON = "trained_on.json"
TRAINER_LOG = "trainer_log.jsonl"
ALL_RESULTS = "all_results.json"
LOSS_PLOT = "loss.png"
MOE_LOAD = "moe_load.jsonl"
TENSORBOARD_DIR = "runs"  # the Trainer's default logging_dir: <output_dir>/runs/<date>_<host>
QUANTIZED_BASE = "quantized_base.json"
ROPE_RECORD = "rope_scaling.json"
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


# ---- the run directories of runs that name no --output_dir ------------------------------------------------------
# As LLaMA-Factory's saves/<model>/<method>/<time>: each run its own directory, found again by its model and method.

RUNS_ROOT = "output"
LATEST = "latest"
STAMP_FORMAT = "%Y%m%d-%H%M%S"
STAMP_RE = re.compile(r"^\d{8}-\d{6}(-\d+)?$")  # a start time, and -2, -3... for runs started in the same second
METHODS = ("full", "lora", "qlora")


def method_name(lora: bool, qlora: bool) -> str:
    """What a run trains, as its directory names it: full (every weight), lora (an adapter), qlora (on 4 bits)."""
    return "qlora" if qlora else "lora" if lora else "full"


def model_name(model: str) -> str:
    """--model as a directory name: a hub id's name (deepseek-ai/deepseek-llm-7b-base -> deepseek-llm-7b-base), a
    local directory's last part."""
    name = Path(model.rstrip("/\\")).name or Path(model).expanduser().resolve().name
    if name in ("", ".", ".."):
        name = Path(model).expanduser().resolve().name
    return re.sub(r"[^A-Za-z0-9._+-]", "_", name) or "model"


def runs_folder(model: str, method: str, root: str | Path = RUNS_ROOT) -> Path:
    return Path(root) / model_name(model) / method


def new_run_dir(model: str, method: str, started: float, root: str | Path = RUNS_ROOT, unique: bool = True) -> Path:
    """output/<model>/<method>/<start time>. `started`: seconds since the epoch, the same in every process of a
    launch (sft/machine.py Launch.launcher_started), so that all ranks name one directory. `unique`: a run of a
    single process takes the next free name (-2, -3, ...) when one started in the same second; several processes
    cannot (one rank may have made the directory before another looks), and the run lock refuses the second run."""
    base = runs_folder(model, method, root) / time.strftime(STAMP_FORMAT, time.localtime(started))
    path, n = base, 1
    while unique and path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def runs_of(model: str, method: str, root: str | Path = RUNS_ROOT) -> list[Path]:
    """The run directories made for this model and method, oldest first (their names are their start times)."""
    folder = runs_folder(model, method, root)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and not p.is_symlink() and STAMP_RE.match(p.name)]
    return sorted(found, key=_stamp_order)


def _stamp_order(path: Path) -> tuple[str, int]:
    return path.name[:15], int(path.name[16:] or 1)  # 20261203-101010, then 20261203-101010-2, -3, ...


def holds_a_run(path: Path) -> bool:
    """A checkpoint-N directory or a saved model in it (complete or not: sft/safety/checkpoints.py decides)."""
    return any(checkpoint_step(p) is not None for p in path.iterdir() if p.is_dir()) or \
        any((path / name).exists() for name in MODEL_FILES)


def point_latest(run_dir: str | Path) -> None:
    """output/<model>/<method>/latest -> this run (a relative link, replaced atomically). Best effort: where links
    cannot be made, the run directory's own path is printed anyway."""
    run_dir = Path(run_dir)
    link = run_dir.parent / LATEST
    staging = run_dir.parent / f".{LATEST}.{os.getpid()}"
    try:
        staging.unlink(missing_ok=True)
        os.symlink(run_dir.name, staging, target_is_directory=True)
        os.replace(staging, link)
    except OSError:
        staging.unlink(missing_ok=True)


def read_json_object(path: Path) -> dict | None:
    """The JSON object in `path` (a run's or an adapter's config), or None where it is missing or not one."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
