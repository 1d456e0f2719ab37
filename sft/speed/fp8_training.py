"""`--fp8 true` without `--lora`: a full fine-tune whose decoder layers' linear layers compute in FP8, through
torchao's float8 training (`torchao.float8.convert_to_float8_training`).

Every nn.Linear inside a decoder layer becomes torchao's Float8Linear: its three matmuls (forward x @ W^T, input
gradient grad_out @ W, weight gradient grad_out^T @ x) run in e4m3 with dynamic scales, one per tensor
(`--fp8_recipe tensorwise`, the default: the fastest, and the one FSDP2 can all-gather in FP8) or one per row
(`rowwise`: finer scales, slower). The weights stay bf16 (or fp32) parameters, so the optimizer, the checkpoints,
the saved model and FSDP2's sharding see the model they know; only the matmuls' inputs are rounded to FP8 on the
way in, and their outputs come back in bf16. The precision rule of a full fine-tune holds as without FP8: bf16
weights train with `--optim adamw_bf16_sr` (stochastic rounding), or the weights are fp32 masters.

Left in bf16: the embeddings, the lm_head (its logits feed the loss, where FP8's rounding costs most), the MoE
router (not an nn.Linear), and any layer with a dimension that is not a multiple of 16 (FP8 matmuls need it).

torchao's casts are plain PyTorch ops: eager, each is its own kernel (a read and a write of every activation), so
they are fast only compiled, which is why a full fine-tune in FP8 runs with `--compile_layers` (on by default on
GPUs; sft/options/resolve.py). Measured on one H200 against TRL's plain bf16 AdamW: bench/RESULTS.md.
"""

from __future__ import annotations

from torch import nn

from sft.machine import is_first_process

RECIPES = ("tensorwise", "rowwise")


def fp8_trainable(module: nn.Module) -> bool:
    """An nn.Linear whose matmuls can run in FP8 (_scaled_mm needs both dimensions to be multiples of 16)."""
    return type(module) is nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0


def layers_to_convert(model: nn.Module) -> set[str]:
    """The qualified names of the linear layers inside decoder layers: not the embeddings or the lm_head."""
    from sft.speed.regional_compile import decoder_layers

    inside = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
    return {name for name, m in model.named_modules() if id(m) in inside and fp8_trainable(m)}


def use_fp8_training(model: nn.Module, recipe: str = "tensorwise") -> int:
    """Convert the decoder layers' linear layers of `model` to torchao's Float8Linear in place; -> how many."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = layers_to_convert(model)
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn in names,
                               config=Float8LinearConfig.from_recipe_name(recipe))
    return len(names)


def apply_fp8_training(model: nn.Module, recipe: str) -> None:
    """The hook sft/model/loading.py calls for a full fine-tune under --fp8: convert, and say what was converted."""
    converted = use_fp8_training(model, recipe)
    if is_first_process():
        print(f"FP8: {converted} linear layers of the decoder train in e4m3 ({recipe} scales, torchao); the "
              f"weights stay {next(model.parameters()).dtype}".replace("torch.", ""), flush=True)
