"""Expert parallelism through DeepSpeed AutoEP (deepspeed.module_inject.auto_ep), for a DeepSeek-V2 LoRA.

accelerate_configs/autoep.yaml names ds_configs/autoep.json, whose `expert_parallel` block turns AutoEP on: when
the Trainer builds the DeepSpeed engine, the engine replaces each MoE block (`model.layers.N.mlp`) with an
`AutoEPMoELayer` that keeps 1/autoep_size of the routed experts (bf16, frozen under LoRA) and sends each token
to its experts' GPU and back (two all-to-alls per layer, forward and backward). The router's weight is copied
into the new layer; the shared experts are the same module, so their LoRA layers stay and train; attention and
the dense MLP are untouched. The saved adapter therefore names the same modules as without AutoEP and loads with
plain peft on the plain model (tests/test_expert_parallel.py).

What DeepSpeed 0.19.8's AutoEP needs, found by reading it and running it on 2 gloo ranks of a CPU:
- ZeRO stage 0. ZeRO-1/2's optimizer asserts that one of its parameter groups holds expert parameters ("The
  model has moe layers, but None of the param groups are marked as MoE"), and under LoRA the experts are frozen,
  so no group can; ZeRO-3 refuses frozen experts at its checkpoints. Under LoRA ZeRO-1/2 would shard only the
  adapter's optimizer state (a few MB) anyway.
- `moe_layer_pattern` matching the peft model's names (`base_model.model.model.layers.N.mlp`): the preset's
  `model\\.layers\\.\\d+\\.mlp` is matched whole (fullmatch), so ds_configs/autoep.json widens it.
- autoep_size dividing the processes and every MoE layer's routed experts (V2-Lite: 64, so 2 or 4 GPUs, not 3).
- The routed experts left alone by LoRA (no --lora_experts): the replacement copies their weights into its own
  grouped experts, and peft's wrapper around them would be lost.
It runs on CPU over gloo (torch's all_to_all_single with split sizes; AutoEP's permutation has a CPU path).

A whole-model forward needs every rank (the all-to-alls): the verified save runs the trained model's forward on all
ranks, as for ZeRO-3 (sft/safety/verify.py `is_sharded`); the MoE balance loss hooks follow the replaced routers
(sft/model/moe.py `RouterBalance.follow_expert_parallel`, which finds the replaced layers: `expert_parallel_layers`).
A DeepSpeed checkpoint writes each rank's frozen experts (DeepSpeed saves them whatever exclude_frozen_parameters
says): about 29 GB per checkpoint for V2-Lite.
"""

from __future__ import annotations

from sft.errors import ConfigError

# The model types AutoEP runs here: DeepSpeed has a preset for them and tests/test_expert_parallel.py trains them.
AUTOEP_MODEL_TYPES = ("deepseek_v2",)


def autoep_block(deepspeed_config: dict | None) -> dict | None:
    """The DeepSpeed config's `expert_parallel` block when it turns AutoEP on, else None."""
    block = (deepspeed_config or {}).get("expert_parallel")
    return block if isinstance(block, dict) and block.get("enabled") else None


def ep_size(block: dict) -> int:
    return int(block.get("autoep_size", 1))


def check_expert_parallel(config, deepspeed_config: dict | None, world_size: int) -> None:
    """Before any model loads: what AutoEP needs of the model (its config) and of the launch."""
    block = autoep_block(deepspeed_config)
    if block is None:
        return
    size = ep_size(block)
    if config.model_type not in AUTOEP_MODEL_TYPES:
        raise ConfigError(f"DeepSpeed AutoEP (expert_parallel in the DeepSpeed config) runs here on DeepSeek-V2 "
                          f"models (V2-Lite) only, not {config.model_type}: use accelerate_configs/ddp.yaml or "
                          f"zero3.yaml.")
    experts = int(getattr(config, "n_routed_experts", 0) or 0)
    if size < 2 or experts % size:
        raise ConfigError(f"DeepSpeed AutoEP with autoep_size {size}: it must be 2 or more and divide the model's "
                          f"{experts} routed experts (each GPU holds an equal share); set \"autoep_size\" in the "
                          f"DeepSpeed config to such a number.")
    if world_size % size:
        raise ConfigError(f"DeepSpeed AutoEP with autoep_size {size} on {world_size} processes: the processes "
                          f"must be a multiple of it; launch with --num_processes {size} (V2-Lite's 64 experts "
                          f"split over 2 or 4 GPUs, not 3).")
