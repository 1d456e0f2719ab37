"""Fine-tune a DeepSeek-family model on instruction data with the Hugging Face Trainer.

    accelerate launch sft/train.py                       # the embedded demo: tiny model, bundled data, ~1 min
    accelerate launch --config_file accelerate_configs/ddp.yaml sft/train.py \
        --model deepseek-ai/deepseek-llm-7b-base --dataset data.jsonl --lora
    python sft/train.py --config recipe.yaml             # one process; a recipe holds the same options

Reads top to bottom: parse and check everything (options, resume, data, tokenizer, machine) before any model
loads; then model, Trainer, train, save (verified).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python sft/train.py` from a checkout: make the `sft` package importable
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from transformers import Trainer, set_seed
from transformers.integrations import TensorBoardCallback

from sft.callbacks import ThroughputCallback, flops_per_token, peak_flops
from sft.checkpoints import resolve_resume, safety_callbacks, save_final
from sft.config import ConfigError, parse_args
from sft.dataset import prepare, read_datasets
from sft.distributed import (DistributedCheckError, configure_nccl_env, consolidate_fsdp_saves,
                             exit_process, fsdp_callbacks, fsdp_training_settings, preflight)
from sft.formats import DataError
from sft.guards import NonFiniteError
from sft.lowbit import prepare_optimizer
from sft.model import PartialCheckpointing, load_model, load_tokenizer
from sft.packing import Collator
from sft.tensor_parallel import TensorParallelTrainer, check_tensor_parallel
from sft.verify import SaveMismatchError


def main(argv: list[str] | None = None, callbacks: list | None = None) -> int:
    """Train; -> exit code (2: bad options or data, 1: training stopped). `callbacks`: extra Trainer callbacks."""
    try:
        configure_nccl_env()  # consumer GPUs: before TrainingArguments starts the process group
        model_args, data_args, lora_args, training_args = parse_args(argv)
        resume = resolve_resume(training_args, argv)  # a checkpoint, or None; never overwrites a run silently
        check_tensor_parallel(model_args, training_args.world_size, resume)  # the model's heads; the checkpoint's TP
        conversations = read_datasets(data_args, training_args.seed)  # bad data stops here, before any model
        tokenizer = load_tokenizer(model_args)
        train_data, eval_data, summary = prepare(data_args, tokenizer, conversations, training_args)
        preflight(model_args, lora_args, training_args)  # all-reduce check; host RAM of offload plans
    except (ConfigError, DataError, DistributedCheckError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    main_process = training_args.process_index == 0
    if main_process:
        print(summary, flush=True)
        print(f"Training on {training_args.world_size} process(es) "
              f"({training_args.parallel_mode.value}, device {training_args.device})", flush=True)

    fsdp_training_settings(training_args, lora_args.lora)  # activation checkpointing; sharded gradients
    prepare_optimizer(training_args.optim)  # torchao's low-bit AdamW under FSDP2: see sft/lowbit.py
    set_seed(training_args.seed)  # the LoRA init happens before the Trainer seeds: make it follow --seed too
    model = load_model(model_args, lora_args, training_args.activation_checkpointing)
    safety, verifier = safety_callbacks(model, model_args, lora_args, training_args, argv)  # checkpoints, guards
    skip = training_args.activation_checkpointing_skip_layers  # spare memory: fewer layers recomputed
    partial_checkpointing = [PartialCheckpointing(skip)] if skip else []
    trainer_class = TensorParallelTrainer if model_args.tp_size > 1 else Trainer  # TP: checkpoints that resume
    trainer = trainer_class(
        model=model,
        args=training_args,
        train_dataset=train_data,
        eval_dataset=eval_data,
        data_collator=Collator(tokenizer.pad_token_id, data_args.pad_to_multiple_of),
        processing_class=tokenizer,
        callbacks=[ThroughputCallback(flops_per_token(model, lora_args.lora), peak_flops()), *(callbacks or []),
                   *safety, *partial_checkpointing, *fsdp_callbacks()],
    )
    if trainer.pop_callback(TensorBoardCallback):  # after ours, so that it logs what ours adds
        trainer.add_callback(TensorBoardCallback)

    try:
        trainer.train(resume_from_checkpoint=resume)
        if eval_data is not None and training_args.eval_strategy == "no":
            trainer.evaluate()
        consolidate_fsdp_saves(trainer)  # FSDP: one consolidated safetensors model, not shards
        save_final(trainer, training_args.output_dir, verifier)  # model or adapter + tokenizer, reloaded, checked
    except (NonFiniteError, SaveMismatchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    if main_process:
        output = Path(training_args.output_dir).resolve()
        what = "LoRA adapter" if lora_args.lora else "model"
        print(f"\nSaved {what} and tokenizer: {output}")
        print(f"TensorBoard logs: {tensorboard_dir(training_args)}  (view: tensorboard --logdir {output})")
    return 0


def tensorboard_dir(training_args) -> str:
    return os.environ.get("TENSORBOARD_LOGGING_DIR") or str(Path(training_args.output_dir).resolve() / "runs")


def run() -> None:
    """The command: train, then exit with main's code (and a clean end of the process group)."""
    exit_process(main())


if __name__ == "__main__":
    run()
