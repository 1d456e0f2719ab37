"""The planner's prediction for the run as configured, not a plan it chose: the first screen of an MoE or
quantized-base run says its predicted peak, and the end of the run the measured one beside it (issue 26 item 5).

It is the plan of `enumerate_plans` that matches the run: its launch's strategy, method, micro-batch,
activation checkpointing, long-row options (--mlp_tile_tokens, --offload_activations) and --quantize_experts (a resident
plan: sft/plan/resident.py), on this machine's GPUs. None where the planner does not model the run (no GPU, a model
whose shape it cannot read): the first screen then says why instead of a number.
"""

from __future__ import annotations

import dataclasses

from sft.machine import gpu_kind
from sft.plan.fast_paths import Asked
from sft.plan.plans import Box, Plan, cards, enumerate_plans, judged_plan, launched_strategy
from sft.plan.shapes import resolve_shape
from sft.plan.workload import Levers

def why_no_prediction(model_args, machine) -> str | None:
    """Why the planner predicts nothing for this run, or None."""
    if not machine.cuda:
        return "no GPU here (the planner predicts GPU memory)"
    return None


def predict_this_run(model_args, lora_args, data_args, training_args, machine) -> Plan | None:
    """The planner's plan equal to this run's configuration on `machine` (sft.machine.Machine), or None."""
    if why_no_prediction(model_args, machine) or getattr(lora_args, "lora_modules_to_save", None):
        return None  # (the planner counts no module trained whole beside the adapter)
    try:  # a prediction never stops a run: a model the planner cannot read, or a plan it cannot make, gives none
        return _matching_plan(resolve_shape(model_args.model), model_args, lora_args, data_args, training_args,
                              machine)
    except Exception:  # noqa: BLE001
        return None


def _matching_plan(shape, model_args, lora_args, data_args, training_args, machine) -> Plan | None:
    gpus, mem = cards(machine)
    kind = gpu_kind(machine.gpu_names[0])
    box = Box(gpus, mem, machine.host_ram_gib or None, kind[1].peak_flops if kind else 165e12,
              machine.gpu_names[0], machine)
    method = "qlora" if lora_args.qlora else "lora" if lora_args.lora else "full"
    asked = Asked(getattr(model_args, "fp8", "auto"), getattr(model_args, "compile_layers", "auto"),
                  bool(getattr(training_args, "torch_compile", False)))
    levers = Levers(getattr(model_args, "mlp_tile_tokens", 0) or 0,  # the run's own, never the planner's choice
                    bool(getattr(training_args, "offload_activations", False)))
    plans = enumerate_plans(shape, box, method, data_args.max_length, (training_args.per_device_train_batch_size,),
                            lora_args.lora_r, training_args.gradient_accumulation_steps or 1, asked, levers)
    strategy = launched_strategy(machine) or "single_gpu"
    checkpointing = bool(training_args.activation_checkpointing)
    experts = getattr(model_args, "quantize_experts", "none") == "fp8"
    found = next((p for p in plans if p.w.strategy == strategy and p.w.checkpointing == checkpointing
                  and p.w.resident == experts), None)
    if found is None:
        return None
    fused = bool(getattr(training_args, "use_liger_kernel", False))
    own = {  # the run's own options where the plans have other values: without Liger's loss (SFTTrainer computes it
        # from the hidden states for any model, MLA's too) or the loss in chunks the run holds the whole logits, and
        # no plan keeps attention outputs
        "fused_loss": fused, "chunked_loss": bool(getattr(model_args, "chunked_loss_on", False)) and not fused,
        "keep_attention": bool(getattr(training_args, "activation_checkpointing_keep_attention", False))}
    if all(getattr(found.w, name) == value for name, value in own.items()):
        return found
    return judged_plan(shape, box, dataclasses.replace(found.w, **own), found.fast, asked)


def predicted_text(plan: Plan | None, model_args, machine) -> str:
    """The first screen's `memory` line."""
    if plan is None:
        return f"no prediction: {why_no_prediction(model_args, machine) or 'the planner has no plan like this run'}"
    p = plan.prediction
    return (f"predicted peak {p.smi_gib:.1f} GiB per GPU by nvidia-smi's count ({p.reserved_gib:.1f} GiB reserved "
            f"by PyTorch); the measured peak is said at the end")
