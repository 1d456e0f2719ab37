"""FSDP (through accelerate's FSDP2 plugin): the settings it needs before the Trainer exists, the embedding's
backward without an all-gather, and one consolidated safetensors model at the end."""

from __future__ import annotations

import os

from sft.machine import Launch, is_first_process, launch as this_launch


def fsdp_launched(launch: Launch | None = None) -> bool:
    """Whether the accelerate config in effect is FSDP's (ACCELERATE_USE_FSDP, read once: sft/machine.py)."""
    return (launch or this_launch()).fsdp


def hand_over_to_fsdp(training_args, launch: Launch | None = None, qlora: bool = False) -> None:
    """Before the model loads and the Trainer (and its FSDP plugin) exists: give accelerate's plugin FSDP's own
    activation checkpointing, which it reads from the environment only, and say what FSDP changes. The options
    themselves were settled in sft/options/resolve.py (fsdp_checkpoints_activations,
    fsdp_reduce_scatters_each_micro_batch); nothing here writes one. Under --qlora every rank loads the base
    itself, one weight at a time, quantized as it is read (sft/model/nf4_loading.py; no RAM-efficient loading: it
    would load the weights on rank 0 only and broadcast whole bf16 tensors into the sharded model, where the base is
    NF4 bytes by then)."""
    if not fsdp_launched(launch):
        return
    notes = []
    if qlora:  # read by transformers' from_pretrained and accelerate's plugin, from the environment only
        os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    if training_args.fsdp_activation_checkpointing:
        os.environ["FSDP_ACTIVATION_CHECKPOINTING"] = "true"  # written for accelerate's FSDP plugin, which reads it
        notes.append("--activation_checkpointing applied as FSDP's activation checkpointing")
    elif training_args.activation_checkpointing:
        notes.append("--activation_checkpointing applied as transformers' own (LoRA: FSDP's wrappers would hide "
                     "the adapter from checkpoint saves)")
    kwargs = training_args.accelerator_config.gradient_accumulation_kwargs or {}
    if training_args.gradient_accumulation_steps > 1 and kwargs.get("sync_each_batch"):
        notes.append("gradients reduce-scattered after every micro-batch (sync_each_batch: sharded, not "
                     "full, gradients between micro-batches)")
    if notes and is_first_process():
        print("FSDP: " + "; ".join(notes), flush=True)


def fsdp_callbacks(launch: Launch | None = None, qlora: bool = False) -> list:
    """Trainer callbacks of FSDP runs (none otherwise): the embedding's backward without an all-gather; under
    --qlora, the 4-bit base checked to move as bytes before the first step."""
    if not fsdp_launched(launch):
        return []
    from transformers import TrainerCallback

    class FourBitWeightsGatheredAsBytes(TrainerCallback):
        def on_init_end(self, args, state, control, **kwargs):  # the Accelerator exists, the model is not wrapped
            from accelerate.state import AcceleratorState

            plugin = AcceleratorState().fsdp_plugin
            plugin.mixed_precision_policy = qlora_policy()
            plugin.cpu_ram_efficient_loading = False  # its broadcast of whole tensors cannot fill NF4 shards

        def on_train_begin(self, args, state, control, model=None, **kwargs):  # wrapped, nothing gathered yet
            problem = fsdp_qlora_problem(model)
            if problem:
                raise RuntimeError(f"FSDP + QLoRA: {problem}")
            if is_first_process():
                print(f"FSDP + QLoRA: a packed 4-bit weight round-tripped FSDP2's copy and all-gather bit for bit "
                      f"on the run's {sharding_mesh(model).size()} ranks", flush=True)

    class EmbeddingBackwardWithoutAllGather(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if skip_embedding_unshard_in_backward(model) and is_first_process():
                print("FSDP: the input embedding's backward runs without gathering its weight", flush=True)

    return [EmbeddingBackwardWithoutAllGather(), *([FourBitWeightsGatheredAsBytes()] if qlora else [])]


def qlora_policy():
    """FSDP2's mixed precision under --qlora: no cast in the all-gather (param_dtype None), gradients reduced in
    fp32, the compute in bf16 all the same (accelerate's autocast). The NF4 base's all-gather moves its own inner
    tensors whatever the policy says (FSDP2's extension hooks); no cast keeps the fp32 adapter exact."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)


def sharding_mesh(model):
    """The device mesh the model's parameters are sharded on (DTensor's public device_mesh)."""
    from torch.distributed.tensor import DTensor

    return next(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))


def fsdp_qlora_problem(model) -> str | None:
    """What stops FSDP + QLoRA, checked once the model is sharded and before the first step: a bitsandbytes 4-bit
    layer (its bytes held in floats), a base linear layer left unquantized, or packed bytes that do not survive
    FSDP2's copy and all-gather on this run's ranks and devices (gathered_bytes_problem)."""
    import torch

    from sft.model.nf4_base import NF4Linear

    floats = float_gathered_4bit_units(model)
    if floats or any(type(m).__name__ == "Linear4bit" for m in model.modules()):
        return (f"bitsandbytes 4-bit layers under FSDP (their packed bytes are held in floats, which CUDA's copies "
                f"rewrite); the base must be torchao's NF4 (sft/model/nf4_base.py){': ' + ', '.join(floats[:3]) if floats else ''}")
    if not any(isinstance(m, NF4Linear) for m in model.modules()):
        return "no NF4 base layer found: the base was not quantized for FSDP"
    mesh = sharding_mesh(model)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else \
        torch.device(mesh.device_type)
    return gathered_bytes_problem(mesh, device)


def gathered_bytes_problem(mesh, device) -> str | None:
    """Round-trip a packed weight through FSDP2 on `mesh`: every byte value in the packed data and the scales,
    every bf16 bit pattern (NaNs included) in the factors, sharded, then all-gathered (FSDP2's copy-in, the
    collective, its copy-out); -> what changed, or None when every bit came back. One collective: every rank calls
    it. A probe module of its own, so the model's weights are never touched."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from sft.model.nf4_base import ROW, NF4Linear

    shards = mesh.size()
    if shards < 2:
        return (f"{shards} process: FSDP2 runs no all-gather on one rank (a path of its own, not checked with NF4 "
                f"weights); FSDP + QLoRA needs two or more (one GPU: run --qlora without FSDP)")
    generator = torch.Generator().manual_seed(0)  # the same probe on every rank
    linear = nn.Linear(ROW // 64, 64 * 2 * shards, bias=False, device="meta")  # two stored rows per shard
    linear.weight = nn.Parameter(torch.randn(linear.weight.shape, generator=generator, dtype=torch.bfloat16)
                                 .to(device), requires_grad=False)
    layer = NF4Linear(linear, shards)
    weight = layer.weight
    weight.quantized_data.copy_(torch.arange(weight.quantized_data.numel()) % 256)
    weight.quantized_scalers.copy_((torch.arange(weight.quantized_scalers.numel()) % 256 - 128).to(torch.int8))
    factors = weight.quantization_factor.view(torch.int16)
    factors.copy_(torch.arange(-2**15, -2**15 + factors.numel(), dtype=torch.int32).to(torch.int16) * 7)
    expected = {name: getattr(weight, name).clone().view(torch.uint8)
                for name in ("quantized_data", "quantized_scalers", "quantization_factor")}
    probe = nn.Sequential(layer)
    fully_shard(probe, mesh=mesh, mp_policy=qlora_policy())
    probe.unshard()
    gathered = probe[0].weight
    changed = {name: int((getattr(gathered, name).view(torch.uint8) != want).sum())
               for name, want in expected.items()}
    probe.reshard()
    if not any(changed.values()):
        return None
    return ("packed 4-bit bytes changed in FSDP2's all-gather (" + ", ".join(f"{n}: {c} of "
            f"{expected[n].numel()} bytes" for n, c in changed.items()) + "): the base would not be the one loaded")


def float_gathered_4bit_units(model) -> list[str]:
    """The FSDP units that hold bitsandbytes 4-bit weights and would all-gather them as floats: all their
    parameters gathered in one dtype (the mixed precision policy's param_dtype, else each parameter's own)."""
    from torch.distributed.fsdp import FSDPModule

    from sft.safety.private_names import FSDP_STATE, expect

    expect(FSDP_STATE)
    unsafe = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        for group in getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]:
            if group is None or not any(type(p._module_info.module).__name__ == "Linear4bit"
                                        for p in group.fsdp_params):
                continue
            dtypes = {group.mp_policy.param_dtype or p.sharded_param.dtype for p in group.fsdp_params}
            if len(dtypes) == 1:
                unsafe.append(name or "the root")
    return unsafe


def skip_embedding_unshard_in_backward(model) -> bool:
    """Tell FSDP2 not to all-gather the input embedding again for backward; -> whether it was set.

    accelerate 1.15 shards the input embedding as its own unit (fsdp2_prepare_model), which FSDP2 gathers in
    forward and, like every unit, again in backward, although an embedding's backward needs only the token ids
    and the incoming gradient, not the weight. For deepseek-llm-7b that is a 0.78 GiB all-gather per step, and
    0.78 GiB held (prefetched) during the first decoder layer's backward, near the peak. torch's
    FSDPModule.set_unshard_in_backward(False) exists for exactly this. Only when the unit holds nothing but
    nn.Embedding weights, alone (with tied input/output embeddings accelerate puts the embedding in one unit with
    lm_head, whose weight backward does need)."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    get = getattr(model, "get_input_embeddings", None)
    embed = get() if get is not None else None
    if not isinstance(embed, FSDPModule) or not hasattr(embed, "set_unshard_in_backward"):
        return False
    output = getattr(model, "get_output_embeddings", lambda: None)()
    if output is not None and any(p is q for p in embed.parameters() for q in output.parameters()):
        return False  # tied weights
    state = embed._get_fsdp_state()
    sharing = [m for m in model.modules() if isinstance(m, FSDPModule) and m._get_fsdp_state() is state]
    owners = [m for m in embed.modules() if any(True for _ in m.parameters(recurse=False))]
    if len(sharing) != 1 or not owners or not all(isinstance(m, torch.nn.Embedding) for m in owners):
        return False
    embed.set_unshard_in_backward(False)
    return True


def consolidate_fsdp_saves(trainer) -> None:
    """Checkpoints stay sharded (fast, no full copy on one rank, resumable); the final model is gathered into
    one consolidated safetensors model (or adapter) that plain transformers/peft loads. Under a sharded
    state-dict type, Trainer.save_model would write nothing at all. Call after training and evaluation."""
    if getattr(trainer, "is_fsdp_enabled", False):
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
        remove_checkpoint_wrappers(trainer.model)  # else a LoRA adapter is saved empty (see below)


def remove_checkpoint_wrappers(model) -> int:
    """Put each activation-checkpointed block back in its parent's place once training is over; -> how many.

    FSDP's activation checkpointing wraps every decoder layer in a CheckpointWrapper, which adds
    `_checkpoint_wrapped_module.` to module names. The state dict leaves it out, but peft finds a LoRA
    adapter's keys from the module names (it strips only FSDP1's prefix), matches nothing, and writes an
    EMPTY adapter: the trl #4416 failure, here under FSDP. Seen on 2 x H200, reproduced on CPU."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    removed = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, CheckpointWrapper):
                setattr(module, name, child._checkpoint_wrapped_module)
                removed += 1
    return removed
