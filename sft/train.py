"""Fine-tune a DeepSeek-family model on instruction data with the Hugging Face Trainer.

    accelerate launch sft/train.py                       # the embedded demo: tiny model, bundled data, ~1 min
    accelerate launch -q --config_file accelerate_configs/ddp.yaml sft/train.py \
        --model deepseek-ai/deepseek-llm-7b-base --dataset data.jsonl --lora
    python sft/train.py --config recipe.yaml             # one process; a recipe holds the same options

Reads top to bottom: parse and check everything (options, output directory, model, data, tokenizer, machine)
before any model loads; then model, Trainer, train, save (verified). Every failure a user can cause ends in one
`error:` line from the main process (`--debug`: with its traceback); Ctrl-C says where the run stopped and how to
resume it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # `python sft/train.py` from a checkout: make the `sft` package importable
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from sft.report.console import closing_lines, quiet_imports, quiet_libraries, tensorboard_dir  # noqa: E402
from sft.report.loggers import wandb_project  # noqa: E402
from sft.safety.interrupts import one_line_if_stopped_while_importing  # noqa: E402

quiet_imports()  # before transformers: importing it loads torchao, a Trainer loads deepspeed (sft/report/console.py)
imports_done = one_line_if_stopped_while_importing()  # Ctrl-C in the next seconds: one line, no traceback

import torch
from transformers import set_seed

from sft.report.callbacks import RunOverview, ThroughputCallback, flops_per_token, peak_flops
from sft.report.progress import FirstStepWait, LastStepLogged, what_compiles
from sft.safety.checkpoints import (ReachedEnd, check_resume_matches, checkpoint_callback, complete_run_check,
                             complete_run_message, newest_complete, out_of_space, resolve_resume, run_is_finished,
                             save_final)
from sft.options.command import command_with
from sft.safety.run_dir import method_name, point_latest
from sft.safety.trained_on import keep_record, this_run
from sft.speed.chunked_loss import chunked_causal_lm_loss, liger_causal_lm_loss
from sft.options.arguments import DEMO_PROMPT, TINY_MODEL, read_options, settle
from sft.options.checks import Options, all_problems
from sft.options.resolve import with_planned
from sft.data.dataset import prepare, read_datasets, training_data_hash
from sft.parallel.distributed import configure_nccl_env, exit_process, on_main_process, preflight, report_error
from sft.machine import is_first_process
from sft.errors import ConfigError, ModelNotFoundError, NothingToDo, UserFacingError
from sft.parallel.fsdp import consolidate_fsdp_saves, fsdp_callbacks, hand_over_to_fsdp
from sft.safety.early_stopping import early_stopping
from sft.parallel.expert_parallel import autoep_block, check_expert_parallel
from sft.safety.guards import LossSpikeLogger, LossWatchdog, NonFiniteGuard
from sft.safety.hub_push import check_hub_push, push_final
from sft.safety.interrupts import (SIGTERM_MARK, end_with_launcher, exit_code, ignore_further_interrupts,
                                   launcher_gone, leave_now, signal_name, stop_on_sigterm, tell_user)
from sft.speed.allocator import expandable_segments_unless_chosen
from sft.speed.gc_freeze import FreezeLongLivedObjects
from sft.speed.kept_attention import offload_prefetch
from sft.speed.packed_mask import builds_packed_mask, dense_mask_note
from sft.speed.varlen_attention import NAME as VARLEN
from sft.speed.lowbit import prepare_optimizer
from sft.model.families import check_family, positions_warning, refuse_unsupported
from sft.model.loading import (PartialCheckpointing, check_lora_targets, check_safetensors_weights, load_config,
                               load_model, load_tokenizer, record_quantized_base, resolve_model_path)
from sft.model.moe import MoeLoadLogger, install_moe
from sft.model.rope_scaling import rope_line, rope_overrides, scaled, write_rope_record
from sft.model.saved_modules import check_frozen_head
from sft.data.packing import Collator, longest_document
from sft.machine import Machine, machine
from sft.options.checks import PICKED_NEW
from sft.plan.planner import NOT_PLANNED, Planned, nothing_planned_line, planned_options, prediction_line
from sft.plan.this_run import predict_this_run, predicted_text
from sft.safety.private_names import PACKED_MASK, expect
from sft.safety.run_lock import RunLock
from sft.report.telemetry import EvalPerplexity, GpuTelemetry, RunRecord, run_summary
from sft.data.chat_templates import chat_template_for_saving
from sft.parallel.tensor_parallel import TensorParallelTrainer, check_tensor_parallel
from sft.parallel.sequence_parallel import check_model as check_sequence_parallel
from sft.trainer import SFTTrainer
from sft.safety.verify import make_verifier

imports_done()


@dataclass
class Seams:
    """What main()'s caller changed (see main)."""

    callbacks: list
    model_factory: Callable | None = None
    save: bool = True
    on_trainer: Callable | None = None


class Run:
    """What the error and interrupt reports need to know of the run so far."""

    def __init__(self, argv: list[str]):
        self.argv = argv
        self.output_dir: str | None = None
        self.lock: RunLock | None = None
        self.trainer = None
        self.saved = False  # the final save is written and checked
        self.uploading_to: str | None = None  # --push_to_hub's repository, while the final upload runs


def main(argv: list[str] | None = None, callbacks: list | None = None, model_factory: Callable | None = None,
         save: bool = True, on_trainer: Callable | None = None) -> int:
    """Train; -> exit code (0: done, or nothing to do; 2: bad options, data or model; 1: training stopped;
    130/143: Ctrl-C/SIGTERM). The seams for callers other than the command line (bench/throughput.py, tests), so
    that none replaces this module's names: `callbacks`, extra Trainer callbacks; `model_factory`, called instead of
    AutoModelForCausalLM.from_pretrained with its arguments (e.g. random weights from the config); `save=False`:
    no final save (a benchmark times training only); `on_trainer`, called with the trainer once built (the bench's
    clock reads each rank's token count from it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv and not _debug_value_follows(argv)
    argv = [a for a in argv if a != "--debug"] if debug else argv
    run = Run(argv)
    end_with_launcher()  # a worker never outlives its launcher
    stop_on_sigterm()
    try:
        return train(run, Seams(list(callbacks or []), model_factory, save, on_trainer))
    except UserFacingError as e:
        if debug:
            raise
        report_error(e)  # once, from the first process; the other ranks leave after it
        return e.exit_code
    except Exception as failure:  # a full disk: one line with what is kept and how to resume (--debug: raised)
        if launcher_gone():  # its pipe broke under a write (BrokenPipeError) before its SIGTERM came: a stop too
            stop(run, KeyboardInterrupt(SIGTERM_MARK))
        full = out_of_space(failure, run.output_dir, run.argv) if run.output_dir and not debug else None
        if full is None:
            raise
        report_error(full)
        return full.exit_code
    except KeyboardInterrupt as interrupt:
        stop(run, interrupt)
    finally:
        if run.lock:
            run.lock.release()


def train(run: Run, seams: Seams) -> int:
    allocator = expandable_segments_unless_chosen(torch.cuda.is_available())  # before CUDA starts: machine() below
    quiet_libraries()  # noisy progress bars off; ranks other than 0 log errors only
    configure_nccl_env()  # consumer GPUs: before TrainingArguments starts the process group
    options, planned = final_options(run.argv)
    model_args, data_args, lora_args, training_args = options.groups()  # final: read from here on, never written
    wandb_project(training_args.report_to, training_args.project)  # --project: wandb reads it from the environment
    run.output_dir = training_args.output_dir
    method = method_name(lora_args.lora, lora_args.qlora)

    def take_output_dir() -> str | None:  # main process: lock the directory, then decide resume / fresh start
        run.lock = RunLock(training_args.output_dir, command_with(run.argv))  # the command as typed
        taken_over = run.lock.acquire()
        if taken_over:
            print(taken_over, flush=True)
        if training_args.output_dir_picked == PICKED_NEW:
            print(f"Output directory: {Path(training_args.output_dir).resolve()} (this run's own; --output_dir "
                  f"chooses one)", flush=True)
        return resolve_resume(training_args, run.argv, method, this_run(model_args, data_args, lora_args))

    resume = on_main_process(take_output_dir)  # a checkpoint, or None; never overwrites or mixes runs
    resolve_model_path(model_args.model)  # a missing directory or unreachable hub id: seconds, not a minute
    on_main_process(lambda: check_hub_push(training_args))  # --push_to_hub: token, network, the repository
    if seams.model_factory is None:  # pickled weights: how to convert them, before any data work (a factory
        check_safetensors_weights(model_args.model)  # builds its own weights)
    refuse_unsupported(load_config(model_args))  # DeepSeek-V3.2: one error, on every rank, before any data work
    # --rope_scaling: the config values the model loads with (a model already scaled is refused here)
    rope = rope_overrides(load_config(model_args), model_args.rope_scaling, data_args.max_length)
    check_tensor_parallel(model_args, training_args.world_size, resume)  # the model's heads; the checkpoint's TP
    if training_args.sequence_parallel > 1:  # heads that divide; no MLA
        check_sequence_parallel(load_config(model_args), training_args.sequence_parallel)
    check_lora_targets(model_args, lora_args)  # user-named targets exist in the model (weightless copy)
    if autoep_block(options.deepspeed):  # AutoEP: a model it has a preset for, experts that divide among the GPUs
        check_expert_parallel(load_config(model_args), options.deepspeed, training_args.world_size)
    # the checkpoint's LoRA or full model, its shape
    check_resume_matches(resume, model_args, lora_args, run.argv, training_args.output_dir)
    conversations = read_datasets(data_args, training_args.seed)  # bad data stops here, before any model
    tokenizer = load_tokenizer(model_args)
    data_hash = training_data_hash(data_args, tokenizer, conversations)
    # A resume onto another model or other data stops here, before tokenizing or any model; a new run records its own
    on_main_process(lambda: keep_record(resume, training_args.output_dir,
                                        this_run(model_args, data_args, lora_args, data_hash), run.argv))
    if rope and lora_args.lora:  # the adapter's base loads with the same RoPE (chat, merge, the save check)
        on_main_process(lambda: write_rope_record(rope, training_args.output_dir))
    if is_first_process():  # a template, EOS or RoPE scaling that this DeepSeek family does not use
        for warning in check_family(load_config(model_args), tokenizer, data_args.template,
                                    model_args.trust_remote_code):
            print(f"warning: {warning}", flush=True)
    train_data, eval_data, summary = prepare(data_args, tokenizer, conversations, training_args, data_hash)
    # Saves carry the template trained with (set after prepare(), whose cache key reads the tokenizer's own).
    tokenizer.chat_template = chat_template_for_saving(data_args.template, tokenizer) or tokenizer.chat_template
    preflight(model_args, lora_args, training_args)  # all-reduce check; host RAM of offload plans and CPU runs
    main_process = is_first_process()
    if main_process:
        print(summary, flush=True)
        if data_args.packing and (note := dense_mask_note(model_args.attn_implementation, data_args.max_length,
                                                          train_data)):
            print(note, flush=True)
        config = load_config(model_args)  # as saved; scaled below as the model will load
        if (line := rope_line(model_args.rope_scaling, rope, config.max_position_embeddings, data_args.max_length)):
            print(line, flush=True)
        if (warning := positions_warning(scaled(config, rope), longest_document(train_data), model_args.model)):
            print(f"warning: {warning}", flush=True)
        if planned.plan:
            print(f"Plan (--plan auto) set: {' '.join(f'--{k} {v}' for k, v in planned.options.items()) or 'nothing'}"
                  f"\n{prediction_line(planned.plan)}", flush=True)
        elif training_args.plan == "auto":
            print(nothing_planned_line(model_args.model, lora_args.lora,
                                       trained_whole=bool(lora_args.lora_modules_to_save)), flush=True)
        print(f"Loading model: {model_args.model}", flush=True)

    trainer_class = TensorParallelTrainer if model_args.tp_size > 1 else SFTTrainer  # TP: checkpoints that resume
    trainer_class.check_overrides()  # the library methods it overrides are what it was built on
    hand_over_to_fsdp(training_args, qlora=lora_args.qlora)  # FSDP's own activation checkpointing; --qlora: no
    # RAM-efficient loading (every rank quantizes its base)
    prepare_optimizer(training_args.optim)  # torchao's low-bit AdamW patched (checked first); ours is SFTTrainer's
    set_seed(training_args.seed)  # the LoRA init happens before the Trainer seeds: make it follow --seed too
    model = load_model(model_args, lora_args, training_args.activation_checkpointing, seams.model_factory, rope)
    # The training loss from the labelled tokens' hidden states (sft/speed/chunked_loss.py): Liger's fused kernel where
    # Liger's own would run (sft/options/resolve.py), torch chunks under --chunked_loss (refused beside Liger; on by
    # default wherever Liger's is not: resolve.py loss_in_chunks_unless_liger).
    # Under --sequence_parallel always one of them (sft/speed/sequence_parallel_loss.py). LoRA under ZeRO-3 on several
    # processes: the frozen lm_head gathered once for the loss (chunked_causal_lm_loss); a trained one is refused
    # there (sft/options/checks.py loss_in_chunks_under_zero3; here the lm_head tied to a trained embed_tokens).
    zero3_lora = lora_args.lora and options.zero_stage(machine()) == "3" and training_args.world_size > 1
    chunks = model_args.chunked_loss_on or training_args.sequence_parallel > 1
    if zero3_lora and chunks:
        check_frozen_head(model)
    labelled_token_loss = (liger_causal_lm_loss if training_args.liger_loss_on_labels
                           else partial(chunked_causal_lm_loss, zero3_frozen_head=zero3_lora) if chunks else None)
    use_cache = model.config.use_cache  # the base's, which a saved model keeps (restored once the Trainer exists)
    balance = install_moe(model, training_args.router_aux_loss_coef, pad_token_id=tokenizer.pad_token_id)  # MoE only
    verifier = make_verifier(training_args.verify_saves, model, resolve_model_path(model_args.model), lora_args.lora,
                             model_args.attn_implementation, model_args.trust_remote_code,
                             model_args.fp8_recipe if model_args.fp8_on and not lora_args.lora else None, rope)
    resume_command = command_with(run.argv, resume_from_checkpoint="true", output_dir=training_args.output_dir)
    skip = training_args.activation_checkpointing_skip_layers  # spare memory: fewer layers recomputed
    # NaN/inf loss or gradient: stop (or skip the step) before the weights take it
    guard = NonFiniteGuard(training_args.nan_policy, lambda: newest_complete(training_args.output_dir), resume_command)
    # the planner's peak for this run, which an MoE or quantized-base run's first screen and last lines say
    memory_plan = planned.plan or (predict_this_run(model_args, lora_args, data_args, training_args, machine())
                                   if main_process else None)
    speed = (*model_args.speed_choices, *([allocator] if allocator else []))  # the first screen's speed lines
    overview = RunOverview(model, train_data, model_args.model, speed,
                           predicted_text(memory_plan, model_args, machine()))
    callbacks = [
        overview,  # the first screen (rank 0)
        ThroughputCallback(flops_per_token(model, lora_args.lora), peak_flops()),  # real tok/s, MFU, memory
        LastStepLogged(),  # a run shorter than --logging_steps still logs its loss
        FirstStepWait(what_compiles(model_args.attn_implementation, model_args.compile_layers_on,
                                    training_args.torch_compile)),  # the first step's wait, said where it compiles
        FreezeLongLivedObjects(),  # after the first step: no full garbage collection walks the compiled graphs
        *seams.callbacks,
        checkpoint_callback(verifier),  # verified, complete-marked, rotated checkpoints
        complete_run_check(),  # a resumed run already at its last step trains no step past it
        guard,
        *([LossSpikeLogger(training_args.loss_spike_factor)] if training_args.loss_spike_factor > 0 else []),
        *([LossWatchdog(training_args.loss_watchdog_threshold, training_args.loss_watchdog_patience,
                        partial(newest_complete, training_args.output_dir),
                        lambda checkpoint: command_with(run.argv, resume_from_checkpoint=str(checkpoint),
                                                        output_dir=training_args.output_dir))]
          if training_args.loss_watchdog_threshold > 0 else []),  # a loss that broke down stops the run
        *early_stopping(training_args),  # --early_stopping_patience: stop when evaluations stop improving
        *([PartialCheckpointing(skip)] if skip else []),
        *([MoeLoadLogger(balance)] if balance else []),  # MoE: aux loss, tokens per expert, imbalance
        *fsdp_callbacks(qlora=lora_args.qlora),  # FSDP only: the embedding's backward without an all-gather;
        # --qlora: the 4-bit weights gathered byte for byte
        GpuTelemetry(),  # per-GPU util, memory (nvidia-smi's count), temperature, power: NVML on a thread, rank 0
        EvalPerplexity(),  # eval_perplexity = exp(eval_loss)
        RunRecord(),  # last: trainer_log.jsonl as it goes; loss.png and all_results.json at the end (rank 0)
    ]
    sequence_parallel = training_args.sequence_parallel > 1
    documents = builds_packed_mask(model.config) and not sequence_parallel
    if documents:  # transformers' mask function, checked now rather than at the first packed batch
        expect(PACKED_MASK)
    run.trainer = trainer = trainer_class(
        model=model,
        args=training_args,
        train_dataset=train_data,
        eval_dataset=eval_data,
        data_collator=Collator(tokenizer.pad_token_id, data_args.pad_to_multiple_of,
                               positions=sequence_parallel,  # DeepSpeed slices rows by them
                               # made on the host, so that the step does not wait for the GPU to learn them:
                               counts_tokens=True,  # the real tokens' count (tokens/s, MFU)
                               # the labelled tokens' places (the labelled-token loss; DeepSpeed's SP slices rows)
                               labelled_positions=labelled_token_loss is not None and not sequence_parallel,
                               # packed rows' documents, their mask built from them (sft/speed/packed_mask.py)
                               document_ids=documents,
                               # ... or their start offsets, the varlen kernel's (sft/speed/varlen_attention.py)
                               document_starts=model_args.attn_implementation == VARLEN and not sequence_parallel,
                               # the real tokens and their sequences (MoE: the balance loss and the expert load)
                               token_sequences=balance is not None and not sequence_parallel,
                               # each token's sequence length (NEFTune's noise scale, sft/model/neftune.py)
                               noise_lengths=bool(training_args.neftune_noise_alpha)),
        processing_class=tokenizer,
        callbacks=callbacks,
        labelled_token_loss=labelled_token_loss,  # None: the model's own loss
        # --offload_activations: one layer's saved tensors brought back ahead (more of them where it keeps attention)
        offload_prefetch=offload_prefetch(training_args.activation_checkpointing_keep_attention,
                                          model_args.compile_layers_on),
        loraplus_lr_ratio=lora_args.loraplus_lr_ratio,  # LoRA+: the B matrices' learning rate, times
        balance=balance,  # MoE: the routers' load-balancing loss joins the training loss
        guard=guard,  # the NaN check reads the step's gradient norm, not every gradient again
    )
    # The Trainer copies args.use_cache (False) onto the config it saves: give the model back the base's value (the
    # Collator turns the cache off in every training forward, where it would let packed documents attend to each other).
    model.config.use_cache = use_cache
    if seams.on_trainer is not None:
        seams.on_trainer(trainer)

    try:
        trainer.train(resume_from_checkpoint=resume)
    except ReachedEnd as end:
        if run_is_finished(training_args.output_dir):
            raise NothingToDo(complete_run_message(training_args.output_dir, end.step, run.argv,
                                                   training_args)) from None
        if main_process:
            print(f"The checkpoint already reached the last step ({end.step}); its final save had not finished: "
                  f"writing the final model from it.", flush=True)
    if eval_data is not None and training_args.eval_strategy == "no":
        trainer.evaluate()
    if seams.save:
        consolidate_fsdp_saves(trainer)  # FSDP: one consolidated safetensors model, not shards
        if main_process:
            record_quantized_base(model, training_args.output_dir)  # --qlora: the 4-bit base, for sft.tools.merge
        save_final(trainer, training_args.output_dir, verifier)  # model or adapter + tokenizer, reloaded, checked
        run.saved = True
        if main_process and training_args.output_dir_picked:  # output/<model>/<method>/latest: this finished run
            point_latest(training_args.output_dir)
        if main_process and training_args.push_to_hub:  # the checked folder, with a model card
            run.uploading_to = training_args.hub_model_id
            print(f"Uploaded to {push_final(trainer, training_args.output_dir, model_args.model)}", flush=True)
            run.uploading_to = None

    if main_process:
        if (planned.plan or overview.held) and torch.cuda.is_available():
            predicted = (f"predicted {memory_plan.prediction.reserved_gib:.1f} GiB reserved per GPU, "
                         if memory_plan else "")
            print(f"Memory: {predicted}measured {torch.cuda.max_memory_reserved() / 2**30:.1f} GiB reserved per GPU "
                  f"(the peak of this process's PyTorch allocator)", flush=True)
        summary = run_summary(training_args.output_dir)  # from all_results.json, after the final evaluation
        if summary:
            print(summary, flush=True)
        if seams.save:
            first_question = {"prompt": DEMO_PROMPT} if model_args.model == TINY_MODEL else {}  # one it learnt
            print(closing_lines(training_args.output_dir, lora_args.lora,
                                tensorboard_dir(training_args.output_dir, training_args.report_to), **first_question),
                  flush=True)
    return 0


def final_options(argv: list[str], m: Machine | None = None) -> tuple[Options, Planned]:
    """parse -> plan (--plan auto) -> resolve the derived values -> check, each step its own: the options as
    given, then the plan's where the user gave none (checked like the user's), then what follows from them and
    the machine. -> (the final options, what the plan set). `m`: this machine unless given (tests)."""
    options = read_options(argv)
    m = m or machine()
    try:
        planned = plan(options, m)
        return settle(with_planned(options, planned.options), m), planned
    except ConfigError as refused:
        raise with_model_problem(refused, options.model.model, m) from None


def with_model_problem(refused: ConfigError, model: str, m: Machine) -> UserFacingError:
    """A run its checks refuse also says whether its --model can be found (checked next otherwise, after the
    output directory): one try tells everything that stops it."""
    try:
        if model != TINY_MODEL:  # built here, never missing
            resolve_model_path(model)
    except ModelNotFoundError as missing:
        return all_problems([*getattr(refused, "problems", [refused]), missing], m)
    return refused


def plan(options: Options, m: Machine) -> Planned:
    """`--plan auto`: the planner's strategy options for this machine and model (sft/plan/planner.py)."""
    if options.training.plan != "auto":
        return NOT_PLANNED
    return planned_options(options.model, options.lora, options.data, options.training, m, options.given)


def stop(run: Run, interrupt: KeyboardInterrupt) -> None:
    """Ctrl-C / SIGTERM / a dead launcher: say where the run stopped, free the directory, leave at once."""
    ignore_further_interrupts()
    if is_first_process():
        what = signal_name(interrupt)
        tell_user(f"\n{stopped_message(run, what)}", sigterm=what == "SIGTERM")  # after tqdm's line
    if run.lock:
        run.lock.release()
    leave_now(exit_code(interrupt))  # other ranks may sit in a collective that will never complete


def stopped_message(run: Run, what: str) -> str:
    """Ctrl-C / SIGTERM: where the run stopped, what is safe on disk, and the exact command that resumes it."""
    if run.trainer is None or run.output_dir is None:
        where = f" Nothing was trained; {run.output_dir} holds no new checkpoint." if run.output_dir else ""
        return f"stopped ({what}) before training started.{where}"
    if run.saved:  # after the final save was checked: the upload, or the closing lines
        here = Path(run.output_dir).resolve()
        upload = (f"; it was not uploaded to {run.uploading_to}: `hf upload {run.uploading_to} {here}`"
                  if run.uploading_to else "")
        return f"stopped ({what}) after training finished; the result is saved and checked in {here}{upload}"
    step = run.trainer.state.global_step
    newest = newest_complete(run.output_dir)
    resume = command_with(run.argv, resume_from_checkpoint="true", output_dir=run.output_dir)
    if newest is None:
        return (f"stopped ({what}) at step {step}; no checkpoint was complete yet, so a new run starts from the "
                f"beginning: {resume}")
    return f"stopped ({what}) at step {step}; newest complete checkpoint: {newest}; resume with: {resume}"


def _debug_value_follows(argv: list[str]) -> bool:
    """transformers' own `--debug underflow_overflow` keeps its meaning; a bare `--debug` is ours."""
    i = argv.index("--debug")
    return i + 1 < len(argv) and not argv[i + 1].startswith("--")


def run() -> None:
    """The command: train, then exit with main's code (and a clean end of the process group)."""
    exit_process(main())


if __name__ == "__main__":
    run()
