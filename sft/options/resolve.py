"""The options that follow from other options or from the machine, settled once, before the checks.

A run's options go: parsed (sft/options/arguments.py) -> the plan's options set where the user gave none
(`with_planned`, for `--plan auto`) -> the derived values below (`resolve_defaults`) -> checked
(sft/options/checks.py). These two steps are the only ones that write an option; from the checks on, every reader
sees final values and asks one question (`--qlora` has already set `lora`, so no reader asks `lora or qlora`).
(Two hand-overs to the Trainer still write its arguments just before it is built: sft/parallel/fsdp.py moves
--activation_checkpointing to FSDP's own under an FSDP full fine-tune, sft/safety/checkpoints.py takes
--save_total_limit over from the Trainer's rotation.)
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sft.machine import Machine
from sft.options.checks import NEW_RUN_DIR, PICKED_NEW, PICKED_NEWEST, PICKED_NOTHING, Options
from sft.safety.run_dir import holds_a_run, method_name, new_run_dir, runs_of

# --resume_from_checkpoint values that mean the newest complete checkpoint of the run
RESUME_NEWEST = ("true", "1", "yes", "last", "latest")


def resume_requested(value) -> str | None:
    """--resume_from_checkpoint as given: None when it says no, else the checkpoint path or "true"."""
    return None if value in (None, "", "false", "False", "no", "0") else str(value)


def resumes_newest(value) -> bool:
    requested = resume_requested(value)
    return requested is not None and requested.lower() in RESUME_NEWEST


def with_planned(o: Options, planned: dict) -> Options:
    """The options `--plan auto` chose ({name: value}; the planner leaves out every option the user gave), set on
    the group that holds each one, before the derived values and the checks read them as if typed."""
    for name, value in planned.items():
        holder = [group for group in o.groups() if hasattr(group, name)][0]  # the planner sets only options
        setattr(holder, name, value)
    return o


def qlora_trains_lora(o: Options, m: Machine) -> None:
    """--qlora trains a LoRA adapter on the 4-bit base: it sets --lora (a full fine-tune of 4-bit weights is not
    possible; they are frozen)."""
    if o.lora.qlora:
        o.lora.lora = True


def flex_pads_packed_rows(o: Options, m: Machine) -> None:
    """flex_attention compiles its kernels for every new shape: packed rows are padded to --max_length unless told."""
    d = o.data
    if d.pad_to_multiple_of is None and d.packing and o.model.attn_implementation == "flex_attention":
        d.pad_to_multiple_of = d.max_length


def tensor_parallel_saves_model_only(o: Options, m: Machine) -> None:
    """transformers' Trainer (5.x) refuses checkpoints with optimizer state for a model sharded at load time:
    sft/parallel/tensor_parallel.py saves the rest."""
    t = o.training
    if o.model.tp_size > 1 and getattr(t.save_strategy, "value", t.save_strategy) != "no":
        t.save_only_model = True


def lora_skips_unused_parameter_search(o: Options, m: Machine) -> None:
    """The Trainer turns DDP's find_unused_parameters on for any model that is not a PreTrainedModel, so for every
    peft model: a walk of the autograd graph each step for nothing, since every adapter weight gets a gradient
    every step (the bench's LoRA DDP rows have always run with it off). The user's value wins."""
    if o.lora.lora and o.training.ddp_find_unused_parameters is None:
        o.training.ddp_find_unused_parameters = False


def compiled_layers_keep_liger_loss_only(o: Options, m: Machine) -> None:
    """Dynamo cannot trace Liger's in-layer kernels: under --compile_layers only its fused loss stays on (a
    --liger_kernel_config of yours wins)."""
    t = o.training
    if o.model.compile_layers and t.use_liger_kernel and t.liger_kernel_config is None:
        from sft.speed.regional_compile import LIGER_WITH_COMPILED_LAYERS

        t.liger_kernel_config = dict(LIGER_WITH_COMPILED_LAYERS)


def liger_loss_on_labels(o: Options, m: Machine) -> None:
    """The same fused loss, the labelled tokens only (sft/speed/chunked_loss.py liger_causal_lm_loss), instead of
    Liger's own, which projects every token."""
    if liger_loss_on_labels_fits(o, m):
        t = o.training
        t.liger_kernel_config = {**(t.liger_kernel_config or {}), "fused_linear_cross_entropy": False}
        t.liger_loss_on_labels = True


def liger_loss_on_labels_fits(o: Options, m: Machine) -> bool:
    """Where Liger's own fused loss would run: not when your --liger_kernel_config turns it off, not with label
    smoothing (the Trainer then needs logits), and not under ZeRO-3, whose lm_head weight is whole only inside
    the lm_head's own forward: there Liger's own loss stays as it was."""
    t = o.training
    return (t.use_liger_kernel and (t.liger_kernel_config or {}).get("fused_linear_cross_entropy", True)
            and not t.label_smoothing_factor and o.zero_stage(m) != "3" and o.model.tp_size == 1)


def output_dir_of_its_own(o: Options, m: Machine) -> None:
    """No --output_dir: a new directory for each run, output/<model>/<method>/<start time>, as LLaMA-Factory's
    saves/ (a second experiment never lands in the first one's directory). Every process of a launch names the
    same one: the start time is the launcher's (sft/machine.py Launch.launcher_started). With
    --resume_from_checkpoint true, the newest run of this model and method that holds one is resumed instead
    (sft/safety/checkpoints.py resolve_resume says which, or refuses when there is none)."""
    t = o.training
    if t.output_dir != NEW_RUN_DIR:
        return
    method = method_name(o.lora.lora, o.lora.qlora)
    t.output_dir_picked = PICKED_NEW
    if resumes_newest(t.resume_from_checkpoint):
        runs = [path for path in runs_of(o.model.model, method) if holds_a_run(path)]
        if runs:
            t.output_dir, t.output_dir_picked = str(runs[-1]), PICKED_NEWEST
            return
        t.output_dir_picked = PICKED_NOTHING
    started = m.launch.launcher_started if m.launch.launched and m.launch.launcher_started else time.time()
    t.output_dir = str(new_run_dir(o.model.model, method, started, unique=m.launch.world_size == 1))


Derivation = Callable[[Options, Machine], None]
# In order: --lora first (the others read it, the run directory's name too), Liger's kernel choice before its loss
# reads that choice.
DERIVED: list[Derivation] = [
    qlora_trains_lora, output_dir_of_its_own, flex_pads_packed_rows, tensor_parallel_saves_model_only,
    lora_skips_unused_parameter_search, compiled_layers_keep_liger_loss_only, liger_loss_on_labels,
]


def resolve_defaults(o: Options, m: Machine) -> Options:
    """Every derived value, once; -> the final options (checked next, then only read). Only the launch part of
    `m` enters (ZeRO-3 from the accelerate config), so a data-only run resolves against a machine without GPUs."""
    for derive in DERIVED:
        derive(o, m)
    return o
