"""The options that follow from other options or from the machine, settled once, before the checks.

A run's options go: parsed (sft/options/arguments.py) -> the plan's options set where the user gave none
(`with_planned`, for `--plan auto`) -> the derived values below (`resolve_defaults`) -> checked
(sft/options/checks.py). These two steps are the only ones that write an option; from the checks on, every reader
sees final values and asks one question (`--qlora` has already set `lora`, so no reader asks `lora or qlora`).
That includes what the Trainer is handed: its arguments are these options, so what it must be given other than
as typed is decided here too (our checkpoint rotation keeps --save_total_limit, the Trainer's gets none; under
FSDP, FSDP's own activation checkpointing and sharded gradients under accumulation), and nothing rewrites them
once the Trainer is built. (The GPUs one process trains on, the Trainer's `n_gpu`, are at most one from the
start: a property of SFTTrainingArguments, sft/options/arguments.py.)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from sft.errors import ConfigError
from sft.machine import Machine, fp8_fast_accum_on, note
from sft.model.adapter_start import base_of, settings_of
from sft.options.checks import (NEW_RUN_DIR, PER_EPOCH_COUNTS, PICKED_NEW, PICKED_NEWEST, PICKED_NOTHING,
                               SEQUENCE_PARALLEL_ATTENTIONS, Options, chunked_loss_combinations,
                               compiled_layers_combinations, fp8_base_needs, fp8_combinations, kept_attention_needs,
                               loss_in_chunks_under_zero3, rows_padded_to, sequence_parallel_combinations,
                               varlen_attention_runs)
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


def adapter_trains_lora_on_its_base(o: Options, m: Machine) -> None:
    """--lora_from DIR trains that LoRA adapter on: it sets --lora, and, where not given, the adapter's own rank, alpha
    and dropout (a rank or alpha given is refused by the checks) and --model (the base it names)."""
    if not o.lora.lora_from:
        return
    o.lora.lora = True
    for option, value in settings_of(o.lora.lora_from).items():  # its rank, alpha, dropout: the adapter's own
        if option not in o.given:
            setattr(o.lora, option, value)
    base = base_of(o.lora.lora_from)
    if base and "model" not in o.given:
        o.model.model = base
        note(f"--lora_from {o.lora.lora_from}: training it on its base, {base} (give --model to name another copy)")


def qlora_trains_lora(o: Options, m: Machine) -> None:
    """--qlora trains a LoRA adapter on the 4-bit base: it sets --lora (a full fine-tune of 4-bit weights is not
    possible; they are frozen)."""
    if o.lora.qlora:
        o.lora.lora = True


def packed_rows_take_one_length(o: Options, m: Machine) -> None:
    """flex_attention and the compiled layers compile their kernels for each new row length: packed rows are padded
    to one (sft/options/checks.py packed_rows_length) unless told. After the fast paths settle --compile_layers."""
    o.data.pad_to_multiple_of = rows_padded_to(o)


def sequence_parallel_slices_rows(o: Options, m: Machine) -> None:
    """--sequence_parallel N: the Trainer is handed accelerate's ParallelismConfig for DeepSpeed's Ulysses (sft/
    parallel/sequence_parallel.py), and every row is padded to --max_length, rounded up to a multiple of N: each
    rank takes one equal slice, and DeepSpeed's dataloader adapter gathers the N ranks' rows with all_gather, which
    gloo refuses for rows of different lengths (seen on CPU ranks). One shape also compiles once."""
    n = o.training.sequence_parallel
    if n <= 1 or o.model.attn_implementation not in SEQUENCE_PARALLEL_ATTENTIONS:  # (sequence_parallel_combinations)
        return

    o.training.parallelism_config = parallelism_config(n, o.model.attn_implementation)
    d = o.data
    d.pad_to_multiple_of = math.lcm(d.pad_to_multiple_of or 1, d.max_length, n)


def parallelism_config(size: int, attention: str):
    """What the Trainer's accelerator is built with for --sequence_parallel: DeepSpeed's Ulysses over `size` ranks
    (accelerate's only sequence-parallel backend; its torch one is context parallelism, cp_size), rows of any length
    a multiple of `size`, around the run's own attention kernel, whole rows on every rank in evaluation."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation=attention,
                                              sp_disable_in_eval=True)
    return ParallelismConfig(sp_size=size, sp_backend="deepspeed", sp_handler=handler)


def fp8_training_pads_rows_to_16(o: Options, m: Machine) -> None:
    """A full fine-tune in FP8: the weight gradient's matmul (grad_out^T @ x) sums over the batch's tokens, and
    torch's FP8 matmul needs its inner dimension in multiples of 16, so every batch's rows are padded to one
    (unless padded already; after packed_rows_take_one_length, whose --max_length under flex_attention the checks
    hold to a multiple of 16)."""
    if o.model.fp8_on and not o.lora.lora and o.data.pad_to_multiple_of is None:
        o.data.pad_to_multiple_of = 16


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


def nan_filter_only_where_steps_are_skipped(o: Options, m: Machine) -> None:
    """transformers' --logging_nan_inf_filter tests each micro-batch's loss on the host (`torch.isnan(loss)` in an
    `if`): the host waits there for the micro-batch's backward to end, and the GPU then idles while the host issues
    the optimizer step and the next forward. Under --nan_policy stop (the default) the guard ends the run at such a
    loss before it reaches the weights or a log, so the filter has nothing to do; under skip it keeps the skipped
    step's NaN out of the logged mean, as transformers does. The user's value wins."""
    t = o.training
    if t.logging_nan_inf_filter is None:
        t.logging_nan_inf_filter = t.nan_policy == "skip"


def batches_copied_without_wait(o: Options, m: Machine) -> None:
    """On a GPU each batch goes to it from pinned host memory with a non-blocking copy (accelerate's `non_blocking`,
    a public option of the Trainer's --accelerator_config): a blocking copy makes the host wait for all the GPU's
    queued work (the previous step's backward and optimizer step) before it can issue the next forward, and the
    GPU then idles until the host catches up. Only with --dataloader_pin_memory (the default), as accelerate
    advises: from pageable memory the copy waits anyway."""
    t = o.training
    if m.cuda and t.dataloader_pin_memory:
        t.accelerator_config.non_blocking = True


def fast_paths_where_supported(o: Options, m: Machine) -> None:
    """--compile_layers auto and --fp8 auto (the defaults): on a GPU, each is on wherever the run's own checks for
    it pass (the checks a user who typed `true` would meet), else off, with the check's reason on the first
    screen; on CPU both are off (no FP8 matmuls; a compile there costs more than it saves). Measured on one H200
    (bench/RESULTS.md): LoRA with both at 1.76x TRL's best, against 1.13x without (runs 20261202T0655Z-G,
    20261201T2145Z-compile); the full fine-tune in FP8 at 1.40x (run 20261203T1450Z-fp8full). Beside
    --quantize_experts the compiled layers ran V2-Lite's resident plan at 1.49x its eager twin in less memory (runs
    20261205T0515Z-next, 0235Z-next) and train to the eager losses and gradients on CPU, but their GPU loss check
    (bench/fp8_check.py --candidate quantize-experts-compile) has not run: until it passes, auto leaves them off
    there (on GPUs a traced path has trained wrongly while CPU compiles were exact: sft/speed/fp8.py). The user's
    true/false wins."""
    md, notes = o.model, []
    if md.compile_layers == "auto":
        why = "no GPU" if not m.cuda else _refusal(compiled_layers_combinations, o, m, "compile_layers") or (
            "beside --quantize_experts: 1.49x, its GPU loss check not run yet; --compile_layers true to try" if getattr(
                md, "quantize_experts", "none") != "none" else None) or (
            "not yet run on FSDP's 4-bit base; --compile_layers true to try" if o.lora.qlora and o.fsdp(m) else None)
        md.compile_layers = "false" if why else "true"
        if m.cuda:
            notes.append(f"compiled layers off ({why})" if why else
                         "compiled layers on (--compile_layers false turns them off)" + shared_adapters_note(o, m))
    if md.fp8 == "auto":
        why = "no GPU" if not m.cuda else m.fp8_problem() or _refusal(fp8_combinations, o, m, "fp8") or _refusal(
            fp8_base_needs, o, m, "fp8") or full_fp8_unmeasured(o) or resident_fp8_unmeasured(o)
        md.fp8 = "false" if why else "true"
        if m.cuda:
            notes.append(f"FP8 off ({why})" if why else "FP8 on (compute capability "
                         f"{'.'.join(map(str, min(m.gpu_capabilities)))}; --fp8 false turns it off)"
                         + fast_accum_note(o, m))
    md.speed_choices = tuple(notes)


def fast_accum_note(o: Options, m: Machine) -> str:
    """What the first screen says of the FP8 base's forward accumulation (LoRA's --fp8, sft/speed/fp8.py)."""
    if not o.lora.lora or not m.gpu_capabilities:
        return ""
    if fp8_fast_accum_on(m.launch.fp8_fast_accum, min(m.gpu_capabilities)):
        return ", its forward matmuls accumulating fast (SFT_FP8_FAST_ACCUM=0 keeps cuBLAS's fp32 promotion)"
    return ""


def shared_adapters_note(o: Options, m: Machine) -> str:
    """What the first screen says of the compiled layers' shared down-projections (sft/speed/shared_input_adapters.py):
    only where a LoRA dropout keeps each adapter's input its own, and so the sharing off."""
    dropout = o.lora.lora_dropout
    if o.lora.lora and dropout > 0 and m.launch.shared_input_adapters:
        return (f"; under --lora_dropout {dropout:g} each adapter keeps its own down-projection matmul "
                "(0 lets q/k/v's and gate/up's share one: 1.03x a 7B LoRA step)")
    return ""


def full_fp8_unmeasured(o: Options) -> str | None:
    """A full fine-tune in FP8 is on by default only with the compiled layers (torchao's casts are separate
    kernels in eager code)."""
    if not o.lora.lora and not o.model.compile_layers_on:
        return "a full fine-tune in FP8 needs the compiled layers to be fast: --fp8 true to try it eager"
    return None


def resident_fp8_unmeasured(o: Options) -> str | None:
    """The resident plan's rows and loss checks ran with the MLA and shared-expert layers in bf16 (--fp8 false):
    FP8 beside the e4m3 experts is on by default only once it is measured so."""
    if getattr(o.model, "quantize_experts", "none") != "none":
        return "not yet measured beside --quantize_experts; --fp8 true to try"
    return None


def _refusal(check: Callable[[Options, Machine], None], o: Options, m: Machine, option: str, value: str = "true",
             before: str = "auto") -> str | None:
    """The reason `check` would refuse --OPTION VALUE on this run (None if it would pass): its message up to the
    first full stop, without the option's own name. The option is `before` again afterwards."""
    setattr(o.model, option, value)
    try:
        check(o, m)
    except ConfigError as e:
        return str(e).split(". ")[0].removeprefix(f"--{option} with ").removeprefix(f"--{option}: ")
    finally:
        setattr(o.model, option, before)
    return None


def packed_documents_attend_alone(o: Options, m: Machine) -> None:
    """Packed rows on a GPU, the attention not given: varlen, each packed document's attention alone
    (sft/speed/varlen_attention.py), instead of sdpa over the whole row behind the documents' mask, which loses
    sdpa's fused causal kernel. Measured on H100s: deepseek-llm-7b LoRA 1.21x sdpa's step (run
    20261206T1532Z-dense-default-2-h100), DeepSeek-V2-Lite's compiled step 1.20x and its 24 GiB resident plan 1.23x
    (runs 20261206T0640Z-varlen-h100, 0903Z-resident-varlen-h100), the same loss to four digits. A batch of
    one document per row runs sdpa's causal kernel still. Only where varlen's own checks pass (torch >= 2.9,
    compute capability 8.0+, bf16 or fp16 activations, not beside the kept attention or --sequence_parallel), and
    not under --tp_size (not measured there). The first screen says so; --attn_implementation sdpa keeps sdpa."""
    md = o.model
    if ("attn_implementation" in o.given or md.attn_implementation != "sdpa" or not m.cuda or not o.data.packing
            or md.tp_size > 1):
        return
    if any(_refusal(check, o, m, "attn_implementation", "varlen", "sdpa")
           for check in (varlen_attention_runs, kept_attention_needs, sequence_parallel_combinations)):
        return
    md.attn_implementation = "varlen"
    md.speed_choices += ("attention per packed document (varlen: 1.20-1.23x sdpa's step behind the packed rows' "
                         "mask; --attn_implementation sdpa keeps sdpa)",)


def loss_in_chunks_unless_liger(o: Options, m: Machine) -> None:
    """--chunked_loss auto (the default): on wherever Liger's fused loss is not (--use_liger_kernel, or an MLA
    model, which Liger has no loss for) and its checks pass: the loss from the hidden states a chunk of tokens at a
    time, never the whole [tokens x vocabulary] logits in fp32. Measured on H100s: deepseek-llm-7b LoRA at micro-batch
    4 x 2,048 1.034x the whole logits' speed in 9.6 GiB less (run 20261206T1532Z-dense-default-2-h100);
    DeepSeek-V2-Lite LoRA the same speed and 9.7 GiB lighter (run 20261206T0619Z-moe-h100). The first screen says
    when it is on. The user's true/false wins."""
    md = o.model
    if md.chunked_loss != "auto":
        return
    md.chunked_loss = "true" if chunked_loss_allowed(o, m) else "false"
    if md.chunked_loss_on:
        liger = "--use_liger_kernel fuses it instead, " if m.cuda else ""  # Liger's kernels are GPU-only
        md.speed_choices += (f"loss in chunks on (no [tokens x vocabulary] logits held whole; {liger}--chunked_loss "
                             f"false turns it off)",)


def chunked_loss_allowed(o: Options, m: Machine) -> bool:
    """Whether a typed --chunked_loss true passes its checks in this run (not beside --use_liger_kernel or under
    --tp_size, nor for a trained lm_head under ZeRO-3 on several processes): what --chunked_loss auto gives. The
    planner asks it of its plans (sft/plan/fast_paths.py loss_in_chunks_by_default, loss_in_chunks_allowed)."""
    return not any(_refusal(check, o, m, "chunked_loss")
                   for check in (chunked_loss_combinations, loss_in_chunks_under_zero3))


def compiled_layers_keep_liger_loss_only(o: Options, m: Machine) -> None:
    """Dynamo cannot trace Liger's in-layer kernels: under --compile_layers only its fused loss stays on (a
    --liger_kernel_config of yours wins)."""
    t = o.training
    if o.model.compile_layers_on and t.use_liger_kernel and t.liger_kernel_config is None:
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


def fsdp_checkpoints_activations(o: Options, m: Machine) -> None:
    """Under an accelerate FSDP config, a full fine-tune's --activation_checkpointing becomes FSDP's own
    (sft/parallel/fsdp.py hands it to accelerate's plugin), as transformers recommends: the Trainer refuses both at
    once (issue 30404). A LoRA run keeps transformers' own (per layer, non-reentrant): FSDP's wraps every layer in
    a CheckpointWrapper, and peft then finds no adapter weights in the state dict (remove_checkpoint_wrappers), so
    every checkpoint's adapter was empty and resuming silently restarted from the untrained adapter (seen on
    2 x H200). Under FSDP2 each layer is already gathered when its backward recomputes it: no extra all-gather."""
    t = o.training
    if m.launch.fsdp and t.activation_checkpointing and not o.lora.lora:
        t.fsdp_activation_checkpointing = True
        t.activation_checkpointing = t.gradient_checkpointing = False  # (the deprecated alias follows it)


def layer_checkpoints_get_their_contexts(o: Options, m: Machine) -> None:
    """What transformers' checkpoint of each layer is given (sft/speed/layer_checkpoint.py), through
    TrainingArguments.activation_checkpointing_kwargs, which the Trainer hands to torch's checkpoint:
    - --activation_checkpointing_keep_attention: the policy that saves sdpa's outputs (sft/speed/kept_attention.py);
      a reentrant checkpoint (`use_reentrant: true`) cannot be selective and is refused (sft/options/checks.py
      kept_attention_needs);
    - --mlp_tile_tokens on eager layers: the recompute marked, so that the tiles inside run once there, not twice
      (sft/speed/tiled_mlp.py). Not under a reentrant checkpoint of yours, nor where SFT_TILED_MLP_LAYER_RECOMPUTE=1
      (bench rows: what it saves).
    Keys you set in --activation_checkpointing_kwargs stay."""
    t = o.training
    yours = t.activation_checkpointing_kwargs or {}
    keep = t.activation_checkpointing_keep_attention
    tiled = bool(t.activation_checkpointing and o.model.mlp_tile_tokens and not o.model.compile_layers_on
                 and not yours.get("use_reentrant") and not m.launch.tiled_mlp_layer_recompute)
    if not (keep or tiled):
        return
    from sft.speed.layer_checkpoint import checkpoint_kwargs

    kwargs = {**checkpoint_kwargs(keep, tiled), **yours}
    t.activation_checkpointing_kwargs = t.gradient_checkpointing_kwargs = kwargs  # (the deprecated alias follows it)
    if keep:
        o.model.speed_choices += (f"attention outputs kept for the backward, not recomputed "
                                  f"({kept_attention_place(o.model.compile_layers_on, t.offload_activations, m.cuda)}; "
                                  f"--activation_checkpointing_keep_attention)",)


def kept_attention_place(compiled: bool, offloaded: bool, cuda: bool) -> str:
    """Where the kept attention outputs wait for the backward (sft/speed/kept_attention.py), for the first screen."""
    if compiled and offloaded:
        return "in host RAM with the checkpoints"
    where = f"on the {'GPU' if cuda else 'CPU'}"
    if offloaded:  # eager layers keep them in the checkpoint's cache, which the offload hooks never see
        where += " (eager layers keep them in their checkpoint: --compile_layers true sends them to host RAM)"
    return where


def fsdp_reduce_scatters_each_micro_batch(o: Options, m: Machine) -> None:
    """Under FSDP with gradient accumulation, gradients are reduce-scattered after every micro-batch (accelerate's
    `sync_each_batch`): FSDP2's no-sync mode keeps UNSHARDED gradients between micro-batches on every rank
    (12.9 GiB in bf16 for 7B), which a 24 GB card cannot hold. An explicit
    `--accelerator_config '{"gradient_accumulation_kwargs": {"sync_each_batch": false}}'` is kept."""
    t = o.training
    config = t.accelerator_config
    kwargs = dict(config.gradient_accumulation_kwargs or {})
    if m.launch.fsdp and t.gradient_accumulation_steps > 1 and "sync_each_batch" not in kwargs:
        config.gradient_accumulation_kwargs = {**kwargs, "sync_each_batch": True}


def our_rotation_keeps_checkpoints(o: Options, m: Machine) -> None:
    """--save_total_limit is kept by our checkpoint callback (sft/safety/checkpoints.py), which deletes old
    checkpoints only after it has verified and marked the new one complete; the Trainer, whose own rotation runs
    before any callback could mark it, is handed none."""
    t = o.training
    if t.save_total_limit is not None:
        t.checkpoints_to_keep, t.save_total_limit = t.save_total_limit, None


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


def early_stopping_watches_eval_loss(o: Options, m: Machine) -> None:
    """--early_stopping_patience without --metric_for_best_model: the eval loss, lower is better (what the
    Trainer's load_best_model_at_end picks by default)."""
    t = o.training
    if t.early_stopping_patience and t.metric_for_best_model is None:
        t.metric_for_best_model, t.greater_is_better = "loss", False


def per_epoch_counts_as_steps(o: Options, m: Machine) -> None:
    """Axolotl's --evals_per_epoch / --saves_per_epoch N, as Axolotl hands them to the Trainer: its eval_steps /
    save_steps as a fraction of the run's steps (a value below 1 is one), 1/(N x epochs), which the Trainer makes
    ceil(steps of an epoch / N) steps once it knows them. N = 1 (or a run shorter than 1/N epoch): the Trainer's
    own once an epoch."""
    # Here, not at the top: the planner imports this module, and transformers' trainer_utils imports torch and peft
    # (~6 s of CPU that `deepseek-sft plan` needs nowhere else); a run has them loaded by now.
    from transformers.trainer_utils import IntervalStrategy

    t = o.training
    for count, strategy, steps in PER_EPOCH_COUNTS:
        per_epoch = getattr(t, count)
        if per_epoch <= 0:
            continue
        by_steps = per_epoch > 1 and per_epoch * t.num_train_epochs > 1
        setattr(t, strategy, IntervalStrategy.STEPS if by_steps else IntervalStrategy.EPOCH)
        if by_steps:
            setattr(t, steps, 1 / (per_epoch * t.num_train_epochs))


Derivation = Callable[[Options, Machine], None]
# In order: --lora first (the others read it, the run directory's name too; --lora_from sets it, and --model), the
# fast paths before Liger's kernel choice (which reads --compile_layers), Liger's kernel choice before its loss reads
# that choice; the chunked loss after the fast paths, whose first-screen notes it follows.
DERIVED: list[Derivation] = [
    adapter_trains_lora_on_its_base, qlora_trains_lora, output_dir_of_its_own, fast_paths_where_supported,
    loss_in_chunks_unless_liger, packed_documents_attend_alone, packed_rows_take_one_length,
    sequence_parallel_slices_rows, fp8_training_pads_rows_to_16, tensor_parallel_saves_model_only,
    lora_skips_unused_parameter_search, compiled_layers_keep_liger_loss_only, liger_loss_on_labels,
    fsdp_checkpoints_activations, layer_checkpoints_get_their_contexts, fsdp_reduce_scatters_each_micro_batch,
    our_rotation_keeps_checkpoints, nan_filter_only_where_steps_are_skipped, batches_copied_without_wait,
    per_epoch_counts_as_steps,
    early_stopping_watches_eval_loss,
]


def resolve_defaults(o: Options, m: Machine) -> Options:
    """Every derived value, once; -> the final options (checked next, then only read). Only the launch part of
    `m` enters (ZeRO-3 and FSDP from the accelerate config), so a data-only run resolves against a machine without
    GPUs."""
    for derive in DERIVED:
        derive(o, m)
    return o
