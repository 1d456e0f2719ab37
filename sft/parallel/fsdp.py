"""FSDP (through accelerate's FSDP2 plugin): the settings it needs before the Trainer exists, the embedding's
backward without an all-gather, and one consolidated safetensors model at the end."""

from __future__ import annotations

import os

from sft.machine import Launch, is_first_process, launch as this_launch


def fsdp_launched(launch: Launch | None = None) -> bool:
    """Whether the accelerate config in effect is FSDP's (ACCELERATE_USE_FSDP, read once: sft/machine.py)."""
    return (launch or this_launch()).fsdp


def hand_over_to_fsdp(training_args, launch: Launch | None = None) -> None:
    """Before the Trainer (and its FSDP plugin) exists: give accelerate's plugin FSDP's own activation
    checkpointing, which it reads from the environment only, and say what FSDP changes. The options themselves
    were settled in sft/options/resolve.py (fsdp_checkpoints_activations, fsdp_reduce_scatters_each_micro_batch);
    nothing here writes one."""
    if not fsdp_launched(launch):
        return
    notes = []
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
    --qlora, the 4-bit weights all-gathered byte for byte."""
    if not fsdp_launched(launch):
        return []
    from transformers import TrainerCallback

    class FourBitWeightsGatheredAsBytes(TrainerCallback):
        def on_init_end(self, args, state, control, **kwargs):  # the Accelerator exists, the model is not wrapped
            from accelerate.state import AcceleratorState

            AcceleratorState().fsdp_plugin.mixed_precision_policy = qlora_policy()

        def on_train_begin(self, args, state, control, model=None, **kwargs):  # wrapped, nothing gathered yet
            unsafe = float_gathered_4bit_units(model)
            if unsafe:
                raise RuntimeError(f"FSDP + QLoRA: {len(unsafe)} FSDP units would all-gather 4-bit weights as "
                                   f"floats, which rewrites some of their bits on GPUs ({', '.join(unsafe[:3])})")
            if is_first_process():  # the fix is in; its run on two GPUs is not (bench/RESULTS.md)
                print("warning: FSDP + QLoRA gathers the 4-bit weights as bytes, a fix not yet checked on GPUs (its "
                      "last GPU run failed the verified save). Every checkpoint is verified, so a wrong adapter "
                      "stops the run at its first checkpoint; accelerate_configs/ddp.yaml is the checked path.",
                      flush=True)

    class EmbeddingBackwardWithoutAllGather(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if skip_embedding_unshard_in_backward(model) and is_first_process():
                print("FSDP: the input embedding's backward runs without gathering its weight", flush=True)

    return [EmbeddingBackwardWithoutAllGather(), *([FourBitWeightsGatheredAsBytes()] if qlora else [])]


def qlora_policy():
    """FSDP2's mixed precision under --qlora: no cast in the all-gather (param_dtype None), gradients reduced in
    fp32, the compute in bf16 all the same (bitsandbytes' compute dtype, and accelerate's autocast).

    bitsandbytes stores the packed 4-bit values in bf16 tensors for FSDP, and those bytes are not numbers: some
    pairs form NaN bit patterns. FSDP2 gathers a unit's parameters through one buffer; when they all share one
    dtype (accelerate's policy casts all to bf16) it copies them as floats with torch._foreach_copy_, which on
    CUDA writes every NaN as the one canonical NaN (pytorch issue 159333; CPU copies keep the bits). So the
    4-bit base that FSDP+QLoRA computed with was not the one loaded, and the trained adapter failed its
    verified save (bench/RESULTS.md, runs 0940Z-x2 and 1015Z-x2). When a unit's dtypes differ, FSDP2 copies raw
    bytes (uint8): without the cast, each decoder layer's unit holds the fp32 adapter beside the bf16-stored
    4-bit weights. bench/fsdp_qlora_bytes.py shows both on a GPU; float_gathered_4bit_units checks it."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)


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
