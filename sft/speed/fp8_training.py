"""`--fp8 true` without `--lora`: a full fine-tune whose decoder layers' linear layers compute in FP8, through
torchao's float8 training (`torchao.float8.convert_to_float8_training`).

Every nn.Linear inside a decoder layer becomes torchao's Float8Linear: its three matmuls (forward x @ W^T, input
gradient grad_out @ W, weight gradient grad_out^T @ x) run in e4m3 with dynamic scales, one per tensor
(`--fp8_recipe tensorwise`, the default: the fastest, and the one whose weights FSDP2 can all-gather in FP8) or one
per row (`rowwise`: finer scales, slower). The weights stay bf16 (or fp32) parameters, so the optimizer, the
checkpoints, the saved model and FSDP2's sharding see the model they know; only the matmuls' inputs are rounded to
FP8 on the way in, and their outputs come back in bf16. The precision rule of a full fine-tune holds as without FP8:
bf16 weights train with `--optim adamw_bf16_sr` (stochastic rounding), or the weights are fp32 masters.

Under FSDP2 with tensorwise scales, the weights can be all-gathered in FP8 (torchao's
`enable_fsdp_float8_all_gather`): each rank casts its shard to e4m3 with the whole weight's scale and FSDP2 gathers
1 byte per value instead of 2, the cast the forward needed anyway, done before the gather. The scales of every
weight are computed after each optimizer step in one all-reduce (`precompute_float8_dynamic_scale_for_fsdp`, from
SFTTrainer's `Float8ScalesAfterStep` callback) instead of one per weight at its gather. The matmuls see the same FP8
weights as unsharded (tests/test_fp8_training.py, 2 CPU ranks). Rowwise scales are gathered in bf16 and cast after.
It is on only where every rank loads the weights itself (`fsdp_cpu_ram_efficient_loading: false`): with it true
(accelerate_configs/fsdp.yaml), accelerate loads them on rank 0 and assigns the other ranks plain tensors built for
the broadcast, so rank 0 would gather FP8 bytes and the others bf16 (on 2 gloo ranks: the first forward's all-gather
hangs); there the weights are gathered in bf16, and the first screen says so.

Left in bf16: the embeddings, the lm_head (its logits feed the loss, where FP8's rounding costs most), the MoE
router (not an nn.Linear), and any layer with a dimension that is not a multiple of 16 (FP8 matmuls need it).

torchao's casts are plain PyTorch ops: eager, each is its own kernel (a read and a write of every activation), so
they are fast only compiled, which is why a full fine-tune in FP8 runs with `--compile_layers` (on by default on
GPUs; sft/options/resolve.py). Measured on one H200 against TRL's plain bf16 AdamW: bench/RESULTS.md; the FP8
all-gather is not measured on GPUs yet.
"""

from __future__ import annotations

import dataclasses
import sys

from torch import nn
from transformers import TrainerCallback

from sft.machine import is_first_process, launch

RECIPES = ("tensorwise", "rowwise")


def fp8_trainable(module: nn.Module) -> bool:
    """An nn.Linear whose matmuls can run in FP8 (_scaled_mm needs both dimensions to be multiples of 16)."""
    return type(module) is nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0


def layers_to_convert(model: nn.Module) -> set[str]:
    """The qualified names of the linear layers inside decoder layers: not the embeddings or the lm_head."""
    from sft.speed.regional_compile import decoder_layers

    inside = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
    return {name for name, m in model.named_modules() if id(m) in inside and fp8_trainable(m)}


def use_fp8_training(model: nn.Module, recipe: str = "tensorwise", fsdp_all_gather: bool = False) -> int:
    """Convert the decoder layers' linear layers of `model` to torchao's Float8Linear in place; -> how many.
    `fsdp_all_gather` (tensorwise only): their weights become torchao's FP8-gathering weights, for FSDP2 to shard
    next; then `refresh_fp8_scales` must follow every optimizer step (Float8ScalesAfterStep)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if fsdp_all_gather and recipe != "tensorwise":
        raise ValueError(f"FP8 all-gather needs tensorwise scales, not {recipe}")
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    names = layers_to_convert(model)
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn in names, config=config)
    return len(names)


def apply_fp8_training(model: nn.Module, recipe: str) -> None:
    """The hook sft/model/loading.py calls for a full fine-tune under --fp8: convert (FSDP2 with tensorwise scales:
    gathered in FP8 where the weights are loaded on every rank), and say what was converted."""
    tensorwise_fsdp = recipe == "tensorwise" and launch().fsdp
    all_gather = tensorwise_fsdp and not launch().fsdp_ram_efficient_loading
    converted = use_fp8_training(model, recipe, fsdp_all_gather=all_gather)
    if is_first_process():
        gathered = "; FSDP2 all-gathers them in FP8" if all_gather else \
            "; FSDP2 gathers them in bf16 (fsdp_cpu_ram_efficient_loading: accelerate's broadcast from rank 0 " \
            "leaves the other ranks plain weights; false in the accelerate config gathers them in FP8)" \
            if tensorwise_fsdp else ""
        print(f"FP8: {converted} linear layers of the decoder train in e4m3 ({recipe} scales, torchao); the "
              f"weights stay {next(model.parameters()).dtype}{gathered}".replace("torch.", ""), flush=True)


def gathers_in_fp8(model: nn.Module) -> bool:
    """Whether `model` has Float8Linear layers whose weights FSDP2 is to all-gather in FP8."""
    if "torchao.float8.float8_linear" not in sys.modules:  # nothing converted (and torchao's import is not free)
        return False
    from torchao.float8.float8_linear import Float8Linear

    return any(isinstance(m, Float8Linear) and m.config.enable_fsdp_float8_all_gather for m in model.modules())


def refresh_fp8_scales(model: nn.Module) -> None:
    """The FP8 scales of every sharded weight from its new values, in one all-reduce (torchao). Once computed, a
    weight's scale is kept until the next call: it must follow every optimizer step, or the next all-gather casts
    the new weights with the old scales."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


class Float8ScalesAfterStep(TrainerCallback):
    """FSDP2 with FP8 all-gather: the weights' scales right after each optimizer step (SFTTrainer adds it)."""

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        refresh_fp8_scales(model)
