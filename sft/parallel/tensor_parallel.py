"""Tensor-parallel runs that resume.

With `--tp_size N` transformers shards the model with its tp_plan as it loads (DTensor parameters), and its
Trainer (5.x) then checkpoints the consolidated weights only: it refuses optimizer state for such a model (unless
`save_only_model`), and its resume path copies a full state dict into the DTensor parameters, which fails
("mixed torch.Tensor and DTensor"). TensorParallelTrainer completes each checkpoint and loads it back:

- `tp_state/`: the trainable weights and the optimizer state, written with torch.distributed.checkpoint (DCP),
  every rank its own shards, so no rank ever holds the full state, and read back into the same sharding. The
  weights come from here rather than from the checkpoint's safetensors, which stay what other tools load: those
  are consolidated (and for some models renamed on save), the DCP copy is exactly what trained.
- `scheduler.pt` and each rank's `rng_state_<rank>.pth`, in the Trainer's own formats and loaded by it.
- `tp_state.json`: the tensor-parallel size, checked before any model loads (`check_resumable`).

trainer_state.json (step, skipped batches, logs) is the Trainer's, as for every other strategy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from sft.errors import ConfigError
from sft.machine import is_first_process
from sft.safety.private_names import GET_OUTPUT_DIR, LOAD_FROM_CHECKPOINT, LOAD_OPTIMIZER, SAVE_RNG_STATE
from sft.safety.run_dir import SCHEDULER_FILE, TP_STATE_DIR, TP_STATE_INFO, checkpoint_dir
from sft.trainer import SFTTrainer


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True)  # frozen weights never change: --model has them


def _weights(model) -> dict:
    """The trainable weights as DTensor shards keyed by parameter name: what DCP saves and loads into in place."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options())


def _optimizer_state(model, optimizer) -> dict:
    """The optimizer's state, likewise; one that has not stepped yet gets its states created (zeros) to load into."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options())


def save_training_state(model, optimizer, tp_size: int, checkpoint: str | Path) -> None:
    """Every rank: write the sharded weights and optimizer state under checkpoint/tp_state (collective)."""
    import torch.distributed.checkpoint as dcp

    checkpoint = Path(checkpoint)
    state = {"model": _weights(model), "optimizer": _optimizer_state(model, optimizer)}
    dcp.save(state, checkpoint_id=str(checkpoint / TP_STATE_DIR))
    if is_first_process():
        (checkpoint / TP_STATE_INFO).write_text(json.dumps({"tp_size": tp_size}) + "\n")


def load_weights(model, checkpoint: str | Path) -> None:
    """Every rank: the trainable weights from checkpoint/tp_state, into the model's own sharding (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    state = {"model": _weights(model)}
    dcp.load(state, checkpoint_id=str(Path(checkpoint) / TP_STATE_DIR))
    set_model_state_dict(model, state["model"], options=_options())


def load_optimizer(model, optimizer, checkpoint: str | Path) -> None:
    """Every rank: the optimizer state from checkpoint/tp_state (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state = {"optimizer": _optimizer_state(model, optimizer)}
    dcp.load(state, checkpoint_id=str(Path(checkpoint) / TP_STATE_DIR))
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=_options())


def saved_tp_size(checkpoint: str | Path) -> int | None:
    """The TP size a checkpoint's training state was written with; None if it holds none (not a TP run's)."""
    info = Path(checkpoint) / TP_STATE_INFO
    if not info.is_file() or not (Path(checkpoint) / TP_STATE_DIR).is_dir():
        return None
    return int(json.loads(info.read_text())["tp_size"])


def check_resumable(checkpoint: str | None, tp_size: int) -> None:
    """Before any model loads: a TP checkpoint resumes only under the same --tp_size, and a TP run only from one."""
    if checkpoint is None:
        return
    saved = saved_tp_size(checkpoint)
    if saved == tp_size or (saved is None and tp_size <= 1):
        return
    if saved is None:
        raise ConfigError(f"--resume_from_checkpoint {checkpoint} with --tp_size {tp_size}: that checkpoint holds no "
                          f"tensor-parallel training state ({TP_STATE_DIR}/): it was written by another strategy or "
                          f"by an older version that saved the weights only. Resume it with the strategy that wrote "
                          f"it, or start a new run from its weights (--model {checkpoint}).")
    raise ConfigError(f"--resume_from_checkpoint {checkpoint}: it was written by a tensor-parallel run with "
                      f"--tp_size {saved}; resume it with --tp_size {saved} (and as many processes), not "
                      f"{tp_size}. Or start a new run from its weights (--model {checkpoint}).")


def check_tensor_parallel(model_args, world_size: int, resume: str | None) -> None:
    """Before any model loads: what --tp_size needs of the model and the launch, and of the checkpoint resumed.
    transformers itself finds none of this out before the first forward (an opaque shape error there)."""
    check_resumable(resume, model_args.tp_size)
    tp = model_args.tp_size
    if tp <= 1:
        return
    from sft.model.loading import load_config

    config = load_config(model_args)
    if not getattr(config, "base_model_tp_plan", None):
        raise ConfigError(f"--tp_size {tp}: transformers has no tensor-parallel plan for {config.model_type} "
                          f"models ({model_args.model}). Use FSDP or ZeRO-3 (accelerate_configs/fsdp.yaml, "
                          f"zero3.yaml).")
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if heads and heads % tp:
            raise ConfigError(f"--tp_size {tp}: the model's {name} ({heads}) must divide by it, since each GPU "
                              f"takes whole heads. Use a --tp_size that divides {heads} (2 on the 3-GPU box).")
    if world_size != tp:
        raise ConfigError(f"--tp_size {tp} with {world_size} processes: launch exactly {tp} (accelerate launch "
                          f"--config_file accelerate_configs/tp.yaml --num_processes {tp}); tensor parallelism "
                          f"combined with data parallelism over more GPUs is not supported here.")


class TensorParallelTrainer(SFTTrainer):
    """The Trainer, for a model loaded with `--tp_size`: checkpoints that hold what resuming needs, and resuming
    from them. The Trainer still writes the weights (consolidated safetensors), trainer_state.json and the rotation;
    `save_only_model` stays set, as it requires for such a model, so its own optimizer saving never runs."""

    overridden = (*SFTTrainer.overridden, LOAD_FROM_CHECKPOINT, LOAD_OPTIMIZER, GET_OUTPUT_DIR,
                  SAVE_RNG_STATE)

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        # the directory super() just wrote, named as it names it
        checkpoint = str(checkpoint_dir(self._get_output_dir(trial=trial), self.state.global_step))
        save_training_state(self.model, self._torch_optimizer(), self.model.tp_size, checkpoint)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(checkpoint, SCHEDULER_FILE))
        self._save_rng_state(checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        load_weights(model or self.model, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        load_optimizer(self.model, self._torch_optimizer(), checkpoint)
        self.lr_scheduler.load_state_dict(
            torch.load(os.path.join(checkpoint, SCHEDULER_FILE), map_location="cpu", weights_only=True))

    def _torch_optimizer(self):
        return getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper holds the torch one
