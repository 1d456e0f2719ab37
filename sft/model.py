"""Model: load the tokenizer and the causal LM (hub id or local directory), and attach LoRA.

Precision policy (correctness before speed): full fine-tuning keeps fp32 master weights and trains under the
Trainer's bf16/fp16 autocast, never plain bf16 AdamW; under LoRA the frozen base may be bf16 while the adapter
weights stay fp32 (peft's default).
"""

from __future__ import annotations

import os
import types

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from sft.config import TINY_MODEL, LoraArguments, ModelArguments
from sft.families import family_of


def resolve_model_path(name: str) -> str:
    if name == TINY_MODEL:
        from sft.tiny import ensure_tiny_model

        return str(ensure_tiny_model())
    return name


def load_config(model_args: ModelArguments):
    """The model's config alone (no weights read): for the checks made before the model loads."""
    return AutoConfig.from_pretrained(resolve_model_path(model_args.model),
                                      trust_remote_code=model_args.trust_remote_code)


def load_tokenizer(model_args: ModelArguments):
    source = resolve_model_path(model_args.tokenizer or model_args.model)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=model_args.trust_remote_code)
    if tokenizer.pad_token is None:
        # Padding is masked out of attention and labels, so any id works; EOS is the usual choice.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def weights_dtype(model_args: ModelArguments, lora: bool) -> torch.dtype:
    if model_args.dtype != "auto":
        return getattr(torch, model_args.dtype)
    if lora and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16  # frozen base weights: bf16 loses nothing that training could have kept
    return torch.float32


def load_model(model_args: ModelArguments, lora_args: LoraArguments, gradient_checkpointing: bool = False):
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(model_args.model),
        dtype=weights_dtype(model_args, lora_args.lora),
        attn_implementation=model_args.attn_implementation,
        trust_remote_code=model_args.trust_remote_code,
        use_safetensors=True,  # never unpickle weights: a .bin checkpoint can run code when loaded
        **tensor_parallel(model_args),
    )
    report_zero3_partitioning(model)
    model.config.use_cache = False  # a KV cache would let packed documents attend to each other
    if lora_args.lora:
        model = attach_lora(model, lora_args, gradient_checkpointing)
    return model


def tensor_parallel(model_args: ModelArguments) -> dict:
    """from_pretrained's arguments for --tp_size > 1: the model's own tp_plan, sharded as it loads. The Trainer
    then sees `model.tp_size` and sets accelerate's ParallelismConfig itself."""
    if model_args.tp_size <= 1:
        return {}
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_size=model_args.tp_size)}


def report_zero3_partitioning(model) -> None:
    from sft.distributed import is_first_process, zero3_partition_report

    report = zero3_partition_report(model)
    if report and is_first_process():
        print(report, flush=True)


def lora_targets(model, lora_args: LoraArguments) -> tuple[list[str] | str, list[str]]:
    """(target_modules, target_parameters): the user's, else the family's (sft/families.py), else peft's
    "all-linear" (every linear layer but the LM head)."""
    if lora_args.lora_target_modules:
        return lora_args.lora_target_modules, []
    family = family_of(model.config.model_type)
    return (family.lora_modules, family.lora_parameters) if family else ("all-linear", [])


def attach_lora(model, lora_args: LoraArguments, gradient_checkpointing: bool):
    from peft import LoraConfig, get_peft_model

    modules, parameters = lora_targets(model, lora_args)
    dropout = lora_args.lora_dropout
    if parameters and dropout:
        print(f"LoRA: lora_dropout {dropout} -> 0: peft's LoRA on fused expert weights cannot apply dropout.")
        dropout = 0.0
    config = LoraConfig(r=lora_args.lora_r, lora_alpha=lora_args.lora_alpha, lora_dropout=dropout,
                        target_modules=modules, target_parameters=parameters or None, task_type="CAUSAL_LM")
    if gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    model = get_peft_model(model, config)
    if os.environ.get("SFT_PEFT_INPUT_CAST") != "1":  # "1": peft's own casts (bench/lora_variants.sh compares)
        skip_input_casts_under_autocast(model)
    return model


def _cast_unless_autocast(self, x, dtype: torch.dtype):
    if x is None or x.dtype == dtype or torch.is_autocast_enabled(x.device.type):
        return x
    return x.to(dtype=dtype)


def skip_input_casts_under_autocast(model) -> None:
    """peft casts each adapted layer's input to the adapter's dtype (fp32) before the LoRA matmuls. Under the
    Trainer's bf16/fp16 autocast those matmuls run in half precision anyway, so the cast writes an fp32 copy of
    the activations that autocast at once casts back: an exact round trip that costs memory traffic at 7 layers
    per block, in forward, recomputation and backward. Under autocast the input now goes to the LoRA matmuls as
    it is (the same values, the same loss and gradients bit for bit: tests/test_lora_casts.py); without
    autocast peft's cast stays."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            module._cast_input_dtype = types.MethodType(_cast_unless_autocast, module)


class PartialCheckpointing(TrainerCallback):
    """`--activation_checkpointing_skip_layers K`: the last K decoder layers keep their activations instead of
    recomputing them in backward. The Trainer switches checkpointing on for every layer at the start of train();
    this runs right after (on_train_begin) and switches it off again for those layers."""

    def __init__(self, skip_layers: int):
        self.skip_layers = skip_layers
        self.unchecked: list[str] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from transformers.modeling_layers import GradientCheckpointingLayer

        self.unchecked = []  # the Trainer switched every layer back on (again, if train() is called twice)
        layers = [(name, m) for name, m in model.named_modules()
                  if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
        for name, layer in layers[len(layers) - min(self.skip_layers, len(layers)):]:
            layer.gradient_checkpointing = False
            self.unchecked.append(name)
        if args.process_index == 0:
            print(f"Activation checkpointing: {len(layers) - len(self.unchecked)} of {len(layers)} layers "
                  f"checkpointed, the last {len(self.unchecked)} keep their activations", flush=True)
