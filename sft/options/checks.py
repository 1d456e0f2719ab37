"""Combinations that cannot work on this machine or under this launch: one named check per rule.

Each check takes the parsed options and the `Machine` (sft/machine.py) as plain data and raises ConfigError with
what to do instead; `CHECKS` lists them in the order they run. Settings that follow from the options (not checks)
are applied apart, by `apply_setup_defaults`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from sft.errors import ConfigError
from sft.speed.lowbit import LOW_BIT_OPTIMIZERS, SR_ADAMW, rounds_stochastically
from sft.machine import Machine


@dataclass
class Options:
    model: object      # ModelArguments
    data: object       # DataArguments
    lora: object       # LoraArguments
    training: object   # SFTTrainingArguments
    deepspeed: dict = field(default_factory=dict)  # the DeepSpeed JSON in effect ({} without DeepSpeed)

    @classmethod
    def of(cls, model_args, data_args, lora_args, training_args) -> Options:
        hf_config = getattr(training_args, "hf_deepspeed_config", None)
        return cls(model_args, data_args, lora_args, training_args, hf_config.config if hf_config else {})

    def zero(self) -> dict:
        zero = self.deepspeed.get("zero_optimization")
        return zero if isinstance(zero, dict) else {}

    def fsdp(self, m: Machine) -> bool:
        return bool(self.training.fsdp) or m.launch.fsdp

    def zero_stage(self, m: Machine) -> str | None:
        stage = self.zero().get("stage", m.launch.zero_stage)
        return None if stage is None else str(stage)

    def offload(self, m: Machine) -> list[str]:
        """What DeepSpeed offloads to host memory, from its JSON or the accelerate config."""
        found = {k.removeprefix("offload_") for k in ("offload_optimizer", "offload_param")
                 if str((self.zero().get(k) or {}).get("device", "none")).lower() in ("cpu", "nvme")}
        return sorted(found | set(m.launch.offload))


def our_option_values(o: Options, m: Machine) -> None:
    t = o.training
    if t.verify_saves not in ("auto", "all", "final", "no"):
        raise ConfigError(f"--verify_saves {t.verify_saves!r}: use auto, all, final or no.")
    if t.nan_policy not in ("stop", "skip"):
        raise ConfigError(f"--nan_policy {t.nan_policy!r}: use stop or skip.")
    if t.loss_spike_factor < 0 or 0 < t.loss_spike_factor <= 1:
        raise ConfigError(f"--loss_spike_factor {t.loss_spike_factor}: give a factor above 1, or 0 to turn spike "
                          f"warnings off.")


def partial_checkpointing(o: Options, m: Machine) -> None:
    skip = o.training.activation_checkpointing_skip_layers
    if skip < 0:
        raise ConfigError(f"--activation_checkpointing_skip_layers {skip}: give a number of layers (0 or more).")
    if skip and not o.training.activation_checkpointing:
        raise ConfigError(f"--activation_checkpointing_skip_layers {skip} needs --activation_checkpointing true "
                          f"(it leaves some layers out of the checkpointing).")
    if skip and o.fsdp(m) and not o.lora.lora:
        raise ConfigError("--activation_checkpointing_skip_layers: a full fine-tune under FSDP uses FSDP's own "
                          "activation checkpointing of every layer; drop the option.")


def precision_the_hardware_has(o: Options, m: Machine) -> None:
    """(--bf16 without bf16 hardware is refused by TrainingArguments itself while parsing.)"""
    if o.training.fp16 and not m.cuda:
        raise ConfigError("--fp16 needs a GPU (fp16 autocast with a loss scaler); on this machine drop --fp16 and "
                          "train in fp32.")
    if o.model.dtype == "bfloat16" and m.cuda and not m.bf16:
        raise ConfigError("--dtype bfloat16: this GPU has no bf16; use --dtype float16 with --lora, or float32.")


def full_fine_tune_keeps_small_updates(o: Options, m: Machine) -> None:
    """Full fine-tuning keeps fp32 master weights (--dtype auto) OR trains bf16 weights with an optimizer that
    rounds its update stochastically (ours, `--optim adamw_bf16_sr`: sft/speed/sr_adamw.py; or torchao's 8/4-bit AdamW
    with bf16_stochastic_round=True where memory needs low-bit states): plain bf16 AdamW
    loses every update smaller than bf16's spacing. The bf16 plan is how a 7B full fine-tune fits 24 GB cards
    without offload (FSDP: ~6 bytes per parameter over the GPUs; bench/RESULTS.md)."""
    t = o.training
    if o.lora.lora or o.model.dtype in ("auto", "float32"):
        return
    recipe = (f"--dtype bfloat16 --optim {SR_ADAMW} (or, where memory needs it, --optim adamw_torch_8bit "
              f"--optim_args bf16_stochastic_round=True)")
    if o.model.dtype == "float16":
        raise ConfigError("--dtype float16 without --lora: full fine-tuning needs fp32 master weights (--dtype "
                          f"auto with --fp16) or bf16 weights with stochastic rounding: {recipe}.")
    optim = getattr(t.optim, "value", t.optim)
    if not rounds_stochastically(optim, t.optim_args):
        raise ConfigError(f"--dtype bfloat16 without --lora with --optim {optim} "
                          f"{('--optim_args ' + t.optim_args) if t.optim_args else ''}: plain bf16 AdamW silently "
                          f"drops small updates. Use {recipe}, or --dtype auto (fp32 master weights).")
    if optim in LOW_BIT_OPTIMIZERS and not m.has("torchao"):
        raise ConfigError(f"--optim {optim} needs torchao: pip install torchao.")
    if t.bf16 and o.fsdp(m):
        raise ConfigError("--bf16 with --dtype bfloat16 under FSDP: accelerate would upcast the weights to fp32 "
                          "master weights (twice the memory). The weights are already bf16: drop --bf16.")


def qlora(o: Options) -> bool:
    return o.lora.qlora


def qlora_implies_lora(o: Options) -> None:
    """--qlora trains a LoRA adapter on the 4-bit base: it sets --lora (a full fine-tune of 4-bit weights is not
    possible; they are frozen). Applied before the checks, which read --lora."""
    if qlora(o):
        o.lora.lora = True


def qlora_needs(o: Options, m: Machine) -> None:
    """--qlora: bitsandbytes' 4-bit kernels on a CUDA GPU, under DDP or FSDP (one GPU: no launcher needed)."""
    if not qlora(o):
        return
    if not m.cuda:
        raise ConfigError("--qlora needs a CUDA GPU (bitsandbytes' 4-bit kernels) and this machine has none. Use "
                          "--lora here (the same adapter on the unquantized base).")
    if not m.has("bitsandbytes"):
        raise ConfigError('--qlora needs the bitsandbytes package, which is not installed: pip install -e ".[qlora]"')
    if o.model.tp_size > 1:
        raise ConfigError(f"--qlora with --tp_size {o.model.tp_size}: 4-bit weights cannot be split by tensor "
                          f"parallelism. Drop --tp_size: a 4-bit 7B base fits each 24 GB card "
                          f"(accelerate_configs/ddp.yaml).")
    stage = o.zero_stage(m)
    if stage is not None and stage != "3":  # ZeRO-3: quantized_base_not_under_zero3
        raise ConfigError(f"--qlora with DeepSpeed ZeRO-{stage}: not supported (DeepSpeed's engine is not set up "
                          f"for 4-bit weights), and it would save nothing over DDP: ZeRO-{stage} shards the "
                          f"optimizer state, which under LoRA is the adapter's few MB. Use "
                          f"accelerate_configs/ddp.yaml.")


def quantized_base_not_under_zero3(o: Options, m: Machine) -> None:
    if o.zero_stage(m) != "3":
        return
    if qlora(o):
        raise ConfigError("--qlora with DeepSpeed ZeRO-3: our ZeRO-3 path partitions the weights as the model is "
                          "created, and 4-bit weights cannot be partitioned that way. Use DDP "
                          "(accelerate_configs/ddp.yaml: a 4-bit 7B base fits each 24 GB card).")
    quantized = [k for k in ("load_in_4bit", "load_in_8bit") if getattr(o.model, k, False)]
    if quantized:
        raise ConfigError(f"--{quantized[0]} with DeepSpeed ZeRO-3: quantized base weights cannot be partitioned. "
                          f"Use DDP (accelerate_configs/ddp.yaml) or ZeRO-2 (accelerate_configs/zero2.yaml).")


def sharding_needs_gpus(o: Options, m: Machine) -> None:
    """Sharding and offload exist to save GPU memory; without GPUs they are silently ignored or pointless."""
    if m.cuda:
        return
    if o.fsdp(m):
        raise ConfigError("FSDP needs GPUs: on a machine without them accelerate silently runs plain DDP instead. "
                          "Drop --fsdp / the FSDP accelerate config, or run on GPUs.")
    if o.offload(m):
        raise ConfigError(f"DeepSpeed {' and '.join(o.offload(m))} offload moves GPU state to host memory, and this "
                          f"machine has no GPU. Remove the offload section (ZeRO itself runs on CPU), or run on GPUs.")


def attention_kernel_available(o: Options, m: Machine) -> None:
    attn = o.model.attn_implementation
    if attn.startswith("flash_attention"):
        package = "flash_attn_interface" if attn == "flash_attention_3" else "flash_attn"
        if not m.cuda or not m.has(package):
            raise ConfigError(f"--attn_implementation {attn} needs a GPU and the `{package}` package "
                              f"({'no GPU here' if not m.cuda else 'not installed'}). Use sdpa (it also separates "
                              f"packed documents).")
    if attn == "flex_attention" and not m.cuda:
        raise ConfigError("--attn_implementation flex_attention cannot train on CPU (no backward there); use sdpa.")


def liger_kernel_available(o: Options, m: Machine) -> None:
    """The Trainer imports Liger only inside train(), after the model has loaded (seen on an H200: an ImportError
    traceback a minute in); its kernels are Triton, GPU only."""
    if not o.training.use_liger_kernel:
        return
    if not m.has("liger_kernel"):
        raise ConfigError("--use_liger_kernel needs the liger-kernel package, which is not installed: "
                          "pip install 'deepseek-sft[lowbit]' (or liger-kernel), or drop --use_liger_kernel.")
    if not m.cuda:
        raise ConfigError("--use_liger_kernel needs a GPU (its kernels are Triton); drop it on CPU.")


def fp8_base_needs(o: Options, m: Machine) -> None:
    """--fp8: a GPU with FP8 matmuls (compute capability 8.9+) and a strategy that keeps the base whole."""
    if getattr(o.model, "fp8", False):
        from sft.speed.fp8 import fp8_base_needs as needs  # imports torch: only when asked

        needs(o, m)


def chunked_loss_combinations(o: Options, m: Machine) -> None:
    """--chunked_loss replaces the loss that Liger's fused loss also replaces; under TP the lm_head is sharded."""
    if not getattr(o.model, "chunked_loss", False):
        return
    if o.training.use_liger_kernel:
        raise ConfigError("--chunked_loss with --use_liger_kernel: Liger's fused loss already avoids whole logits; "
                          "keep one of the two.")
    if o.model.tp_size > 1:
        raise ConfigError("--chunked_loss with --tp_size: the lm_head's output is sharded across the TP ranks; "
                          "drop --chunked_loss.")


def compiled_layers_combinations(o: Options, m: Machine) -> None:
    """--compile_layers compiles the layers in place; DeepSpeed's hooks and TP's DTensors are not measured with it,
    and the Trainer's --torch_compile would compile the whole model around them."""
    if not getattr(o.model, "compile_layers", False):
        return
    if o.training.torch_compile:
        raise ConfigError("--compile_layers with --torch_compile: keep one (--compile_layers compiles each decoder "
                          "layer once; --torch_compile the whole model, loss included).")
    if o.zero_stage(m) is not None:
        raise ConfigError(f"--compile_layers with DeepSpeed ZeRO-{o.zero_stage(m)}: not supported (its parameter "
                          f"hooks are not tested with compiled layers). Drop --compile_layers, or use "
                          f"accelerate_configs/fsdp.yaml or ddp.yaml.")
    if o.model.tp_size > 1:
        raise ConfigError("--compile_layers with --tp_size: not supported (the layers' weights are DTensors). Drop "
                          "one of them.")


def processes_fit_gpus(o: Options, m: Machine) -> None:
    local = m.launch.processes_here(1)
    if m.cuda and local > m.gpus:
        raise ConfigError(f"{local} processes on this machine but {m.gpus} GPU(s): launch with "
                          f"`accelerate launch --num_processes {m.gpus}` (or `torchrun --nproc_per_node {m.gpus}`).")


def tensor_parallel_combinations(o: Options, m: Machine) -> None:
    """accelerate refuses TP on CPU; peft's LoRA layers and Liger's fused loss fail on the shards (seen)."""
    tp = o.model.tp_size
    if tp <= 1:
        return
    if not m.cuda:
        raise ConfigError(f"--tp_size {tp} needs GPUs: accelerate refuses tensor parallelism on CPU. Drop "
                          f"--tp_size (DDP over gloo trains on CPU), or run on GPUs.")
    if o.lora.lora:  # peft's LoRA layers wrap the sharded linears and fail at the first step (seen on CPU)
        raise ConfigError(f"--lora with --tp_size {tp}: peft's LoRA layers do not handle transformers' "
                          f"tensor-parallel shards. LoRA of a 7B model fits one 24 GB card: use "
                          f"accelerate_configs/ddp.yaml (a replica per GPU) without --tp_size.")
    if o.training.use_liger_kernel:  # seen on GPUs: its loss multiplies activations by the sharded lm_head
        raise ConfigError(f"--use_liger_kernel with --tp_size {tp}: Liger's fused loss cannot take the "
                          f"tensor-parallel lm_head (\"mixed torch.Tensor and DTensor\" at the first step). Drop one "
                          f"of them.")


def deepspeed_json_agrees(o: Options, m: Machine) -> None:
    mismatches = getattr(getattr(o.training, "hf_deepspeed_config", None), "mismatches", None) or []
    if mismatches:
        found = "; ".join(x.lstrip("- ") for x in mismatches)
        raise ConfigError(f"the DeepSpeed config {o.training.deepspeed} disagrees with the Trainer's options "
                          f"({found}). Set those DeepSpeed values to \"auto\" (filled from the Trainer's options) "
                          f"or give matching flags.")


def launcher_agrees(o: Options, m: Machine) -> None:
    """The accelerate config's precision, accumulation and DeepSpeed file must match the command line's."""
    t, launch = o.training, m.launch
    ours = "bf16" if t.bf16 else "fp16" if t.fp16 else None
    if ours and launch.mixed_precision not in ("no", ours):
        raise ConfigError(f"the accelerate config says mixed_precision: {launch.mixed_precision} but the command "
                          f"line says --{ours}: make them agree (or drop one; the other is then used).")
    accumulation = launch.gradient_accumulation_steps
    if accumulation and accumulation != t.gradient_accumulation_steps:
        raise ConfigError(f"the accelerate config says gradient_accumulation_steps: {accumulation} but the Trainer "
                          f"uses --gradient_accumulation_steps {t.gradient_accumulation_steps}: give the same value "
                          f"to both.")
    ds_file = launch.deepspeed_config_file
    if (ds_file and t.deepspeed and isinstance(t.deepspeed, str)
            and os.path.realpath(ds_file) != os.path.realpath(t.deepspeed)):
        raise ConfigError(f"two DeepSpeed configs: the accelerate config names {ds_file}, --deepspeed names "
                          f"{t.deepspeed}. Keep one.")


CHECKS: list[Callable[[Options, Machine], None]] = [
    our_option_values, partial_checkpointing, precision_the_hardware_has, full_fine_tune_keeps_small_updates,
    quantized_base_not_under_zero3, qlora_needs, sharding_needs_gpus, attention_kernel_available, processes_fit_gpus,
    tensor_parallel_combinations, compiled_layers_combinations, liger_kernel_available, fp8_base_needs,
    chunked_loss_combinations, deepspeed_json_agrees, launcher_agrees,
]


def run_checks(o: Options, m: Machine) -> None:
    qlora_implies_lora(o)  # options that imply others first: the checks read the result
    for check in CHECKS:
        check(o, m)


def apply_setup_defaults(o: Options, m: Machine) -> None:
    """Settings that follow from the options. Tensor parallel: transformers' Trainer (5.x) refuses checkpoints
    with optimizer state for a model sharded at load time, so `save_only_model` is set and
    sft/parallel/tensor_parallel.py saves the rest. LoRA: DDP does not search for unused parameters."""
    t = o.training
    if o.model.tp_size > 1 and getattr(t.save_strategy, "value", t.save_strategy) != "no":
        t.save_only_model = True
    if o.lora.lora and t.ddp_find_unused_parameters is None:
        # The Trainer turns DDP's find_unused_parameters on for any model that is not a PreTrainedModel, so for
        # every peft model: a walk of the autograd graph each step for nothing, since every adapter weight gets a
        # gradient every step (the bench's LoRA DDP rows have always run with it off). The user's value wins.
        t.ddp_find_unused_parameters = False
    if getattr(o.model, "compile_layers", False) and t.use_liger_kernel and t.liger_kernel_config is None:
        from sft.speed.regional_compile import LIGER_WITH_COMPILED_LAYERS  # dynamo cannot trace Liger's in-layer kernels

        t.liger_kernel_config = dict(LIGER_WITH_COMPILED_LAYERS)
    if liger_loss_on_labels_fits(o, m):  # the same fused loss, the labelled tokens only (sft/speed/chunked_loss.py)
        t.liger_kernel_config = {**(t.liger_kernel_config or {}), "fused_linear_cross_entropy": False}
        t.liger_loss_on_labels = True


def liger_loss_on_labels_fits(o: Options, m: Machine) -> bool:
    """Where Liger's own fused loss would run: not when your --liger_kernel_config turns it off, not with label
    smoothing (the Trainer then needs logits), and not under ZeRO-3, whose lm_head weight is whole only inside
    the lm_head's own forward: there Liger's own loss stays as it was."""
    t = o.training
    return (t.use_liger_kernel and (t.liger_kernel_config or {}).get("fused_linear_cross_entropy", True)
            and not t.label_smoothing_factor and o.zero_stage(m) != "3" and o.model.tp_size == 1)
