"""`deepseek-sft plan` / `python -m sft.plan.planner`: which strategy, activation checkpointing and micro-batch to use on
this box, with the predicted GPU memory per card (as nvidia-smi shows it), host RAM and tokens/s of each plan,
the fastest plan that fits with MARGIN_GIB of the card to spare as an exact command (the model's hub id, the
kernels its first line names), and why the others do not fit. Host RAM is this machine's unless --host_ram says
another box's; where it cannot be read it is unknown, and each plan says what it needs. Each plan runs with the
fast paths (--fp8, --compile_layers) its run gets on the box's GPU (--gpu; sft/plan/fast_paths.py asks the run's
own rule), and is predicted with them.

    python -m sft.plan.planner --model deepseek-llm-7b --gpus 3 --gpu_mem 24 --lora --max_length 2048
    python -m sft.plan.planner --model deepseek-llm-7b --lora --gpu "RTX 3090"   # no FP8 (compute capability 8.6)
    python -m sft.plan.planner --model ./my-model-dir --gpus 2 --gpu_mem 24 --host_ram 128
    python -m sft.plan.planner --check     # predicted against every measured row of bench/results.jsonl
    python -m sft.plan.planner --write_snapshot  # after new bench rows: refit sft/plan/fitted.json, which plans read

This module is the top of the planner: its command line, and `sft/train.py --plan auto` (planned_options). Below it,
from the top down: the plans' text (plan_text.py), the plans and their ranking (plans.py), the speed and memory
models (speed.py, memory.py), what they read (the snapshot, snapshot.py; the bench rows, rows.py; the fit of the one
from the other, refit.py; --check, bench_check.py), the sub-plans (long_rows.py, resident.py, expert_parallel.py,
sequence_parallel.py), and the Workload and Shape everything counts in (workload.py, shapes.py).
"""

from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

from sft.machine import GPU_KINDS, gpu_kind, host_ram_gib as this_host_ram
from sft.parallel.strategies import PRECISION_OPTIONS, STRATEGIES
from sft.plan.bench_check import check_rows, check_summary, check_table
from sft.plan.fast_paths import Asked, loss_in_chunks_allowed
from sft.plan.long_rows import is_long
from sft.plan.plan_text import command, fast_paths_text, kernels_text, plan_summary, plan_table
from sft.plan.kernels import VARLEN_MODULE, kernels
from sft.plan.plans import (AWAITED_CHECK, MARGIN_GIB, Box, Plan, awaiting_plan, best_plan, cards, closest_plan,
                            enumerate_plans, launched_strategy, ranked, shown_gib, split_plan, with_loss)
from sft.plan.refit import write_snapshot
from sft.plan.rows import RESULTS
from sft.plan.shapes import SHAPES, resolve_shape
from sft.plan.workload import Levers
from sft.report.console import ToolParser


Loss = tuple[bool | None, bool | None]  # (Liger's fused loss, the loss in chunks); None: as the plan has it


def users_loss(model_args, training_args, given: set[str] | frozenset[str]) -> Loss:
    """(--use_liger_kernel, --chunked_loss) as the user typed them, None where not typed (or `auto`): the plans are
    sized with them, and set neither (plans.with_loss)."""
    fused = bool(training_args.use_liger_kernel) if "use_liger_kernel" in given else None
    chunked = getattr(model_args, "chunked_loss", "auto") if "chunked_loss" in given else "auto"
    return fused, None if chunked == "auto" else chunked == "true"


def loss_here(plan: Plan, typed: Loss, liger_installed: bool) -> Loss:
    """The loss `plan` runs with on this machine: as typed (users_loss), and where it planned Liger's fused loss and
    Liger is not installed, the loss in torch chunks instead (sft/speed/chunked_loss.py: no whole logits either)
    where the run allows it, the whole logits where not."""
    fused, chunked = typed
    if fused is None and plan.w.fused_loss and not liger_installed:
        w = plan.w
        return False, chunked if chunked is not None else loss_in_chunks_allowed(w.strategy, w.world, w.setup.method)
    return fused, chunked


def options_of(plan: Plan) -> dict:
    """The training options a plan sets (for `--plan auto`), by option name."""
    w = plan.w
    opts = {"per_device_train_batch_size": w.micro_batch, "activation_checkpointing": w.checkpointing,
            **kernels(plan.w.strategy, plan.shape, w.sequence_parallel, is_long(w.seq_len)),
            "use_liger_kernel": w.fused_loss}
    if w.sequence_parallel > 1:  # its loss is in chunks without asking; one conversation per row under sdpa
        opts.update(sequence_parallel=w.sequence_parallel, packing=False)
    if w.resident:
        opts.update(quantize_experts="fp8")
    if plan.chunked_loss_asked:  # (where --chunked_loss auto takes it, nothing to set)
        opts.update(chunked_loss="true")
    if is_long(w.seq_len):  # set either way: a long plan without a lever says so
        opts.update(mlp_tile_tokens=w.mlp_tile_tokens, offload_activations=w.offload_activations)
    for option in ("compile_layers", "fp8"):  # where the planner turned one off for memory (plans._with_levers)
        if getattr(plan.asked, option) == "false":
            opts[option] = "false"
    if w.setup.method in ("lora", "qlora"):
        opts["lora_dropout"] = 0.0
    else:
        opts.update(PRECISION_OPTIONS[w.setup.precision])
    return opts


class Planned(NamedTuple):
    """What `--plan auto` chose: the options it sets {name: value} (never one the user gave), and the plan they
    come from (None: nothing planned)."""

    options: dict
    plan: Plan | None


NOT_PLANNED = Planned({}, None)


def planned_options(model_args, lora_args, data_args, training_args, machine=None,
                    given: set[str] | frozenset[str] = frozenset()) -> Planned:
    """`sft/train.py --plan auto`: the strategy options the planner predicts fastest, leaving out every option the
    user gave (`given`: option names). Sets nothing itself: the caller applies them before the options are
    resolved and checked. `machine`: a sft.machine.Machine (this one when None)."""
    from sft.machine import machine as this_machine

    m = machine or this_machine()
    if not m.cuda or getattr(lora_args, "lora_modules_to_save", None):
        return NOT_PLANNED  # nothing to plan without GPUs, nor with memory it does not count (nothing_planned_line)
    gpus, mem = cards(m)
    kind = gpu_kind(m.gpu_names[0])
    shape = resolve_shape(model_args.model)
    # Options as given (not yet resolved): --qlora alone has not set --lora yet, and plans its own 4-bit memory;
    # --fp8/--compile_layers auto settle after the plan as they settle in it (fast_paths: this machine, the launch).
    method = "qlora" if lora_args.qlora else "lora" if lora_args.lora else "full"
    mbs = (training_args.per_device_train_batch_size,) if "per_device_train_batch_size" in given else (1, 2, 4, 8)
    accumulation = getattr(training_args, "gradient_accumulation_steps", 1) or 1  # its gradients live in between
    asked = Asked(getattr(model_args, "fp8", "auto"), getattr(model_args, "compile_layers", "auto"),
                  bool(getattr(training_args, "torch_compile", False)))
    box = Box(gpus, mem, m.host_ram_gib or None, kind[1].peak_flops if kind else 165e12, m.gpu_names[0], m)
    levers = None  # the user's long-row options win, and are what the plan predicts
    if given & {"mlp_tile_tokens", "offload_activations"}:
        levers = Levers(getattr(model_args, "mlp_tile_tokens", 0) or 0,
                        bool(getattr(training_args, "offload_activations", False)))
    plans = enumerate_plans(shape, box, method, data_args.max_length, mbs, lora_args.lora_r, accumulation, asked,
                            levers)
    strategy = launched_strategy(m)
    plans = [p for p in plans if strategy is None or p.w.strategy == strategy]  # the launch decides the strategy
    # ... and the processes: an SP plan of as many as were launched, of the size the user gave if any
    size = getattr(training_args, "sequence_parallel", 1) if "sequence_parallel" in given else None
    plans = [p for p in plans if (p.w.sequence_parallel == 1 or p.w.world == gpus)
             and size in (None, p.w.sequence_parallel)]
    # the experts in e4m3 change the model the adapter trains against: a resident plan only where the user asked
    # for it, and then only one (the run refuses --quantize_experts elsewhere)
    experts = getattr(model_args, "quantize_experts", "none") == "fp8"
    plans = [p for p in plans if p.w.resident == experts]
    typed = users_loss(model_args, training_args, given)
    plans = ranked([with_loss(p, box, *loss_here(p, typed, m.has("liger_kernel"))) for p in plans])
    chosen = best_plan(plans)
    if chosen is None:
        return NOT_PLANNED
    wanted = options_of(chosen)
    if wanted.get("attn_implementation") == "varlen" and not m.has(VARLEN_MODULE):
        wanted["attn_implementation"] = "sdpa"  # torch before 2.9: MLA's attention as before varlen
    if method == "full" and "dtype" in given:  # the user's precision wins: keep plans of that precision
        wanted = {k: v for k, v in wanted.items() if k not in ("dtype", "optim", "optim_args")}
    if chosen.w.strategy == "fsdp" and method == "full" and "dtype" in wanted:
        wanted["bf16"] = False  # the weights are bf16 (sft/checks: no --bf16 with --dtype bfloat16 under FSDP)
    groups = (model_args, lora_args, data_args, training_args)
    return Planned({name: value for name, value in wanted.items()
                    if name not in given and any(hasattr(group, name) for group in groups)}, chosen)


def prediction_line(plan: Plan) -> str:
    """One line for the run's first screen."""
    p = plan.prediction
    return (f"  {'plan':<12} {plan.w.strategy}, checkpointing {'on' if plan.w.checkpointing else 'off'}, "
            f"micro-batch {plan.w.micro_batch}, {plan.fast.name}{', experts in e4m3' if plan.w.resident else ''}: predicted {shown_gib(plan):.1f} GiB per GPU "
            f"(nvidia-smi; {p.reserved_gib:.1f} GiB reserved by PyTorch), ~{plan.tok_s:,.0f} tok/s"
            + "".join(f"\n  {'':<12} {said}" for said in plan.fast.planned_off))


def nothing_planned_line(model: str, lora: bool, machine=None, trained_whole: bool = False) -> str:
    """`--plan auto` that set nothing: why, in one line for the run's first screen (`machine`: this one when None;
    `trained_whole`: modules trained whole beside the adapter, --lora_modules_to_save)."""
    from sft.machine import machine as this_machine

    m = machine or this_machine()
    if not m.cuda:
        return "Plan (--plan auto): nothing set: this machine has no CUDA GPU (the planner plans GPUs); the options " \
               "stay as given."
    if trained_whole:
        return ("Plan (--plan auto): nothing set: the planner counts a LoRA adapter's own weights, not the modules "
                "trained whole beside it (--lora_modules_to_save: their fp32 weights, gradients and AdamW states); "
                "the options stay as given.")
    gpus, mem = cards(m)
    return (f"Plan (--plan auto): nothing set: no plan fits {gpus} x {mem:.0f} GiB with {MARGIN_GIB:g} GiB to spare; "
            f"the options stay as given. "
            f"`python -m sft.plan.planner --model {model} --gpus {gpus} --gpu_mem {mem:.0f}{' --lora' if lora else ''}` says "
            f"why each does not fit.")


# ---------------------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = ToolParser(prog="deepseek-sft plan", description="Predict GPU memory, host RAM and speed of every "
                "strategy x checkpointing x micro-batch for a model on this box, and recommend the fastest "
                "plan that fits.", epilog="Offline for the built-in DeepSeek shapes: " + ", ".join(SHAPES) + ".")
    p.add_argument("--model", help="hub id, local directory (config.json) or family name")
    p.add_argument("--gpus", type=int, default=3, help="GPUs in the box (default 3)")
    others = ", ".join(name for name in GPU_KINDS if name != "RTX 4090")
    p.add_argument("--gpu", default="RTX 4090", metavar="NAME", help=f"the GPU (default RTX 4090; {others}): its "
                   "compute capability decides FP8")
    p.add_argument("--gpu_mem", type=float, metavar="GB", help="GB per GPU (default: the GPU's)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--lora", action="store_true", help="LoRA on a bf16 base (default: full fine-tune)")
    g.add_argument("--qlora", action="store_true", help="LoRA on a 4-bit NF4 base (bitsandbytes)")
    p.add_argument("--max_length", type=int, default=2048, metavar="N", help="tokens per row (default 2048; over 4096: long rows)")
    p.add_argument("--micro_batch", type=int, metavar="N", help="only this micro-batch (default: 1, 2, 4, 8)")
    p.add_argument("--host_ram", type=float, metavar="GIB", help="host RAM in GiB (default: this machine's)")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1, metavar="N",
                   help="micro-batches per step (default 1)")
    p.add_argument("--lora_r", type=int, default=16, metavar="R", help="LoRA rank (default 16)")
    p.add_argument("--peak_tflops", type=float, metavar="T", help="bf16 peak per GPU (default: the GPU's)")
    for name in ("fp8", "compile_layers"):
        p.add_argument(f"--{name}", choices=("auto", "true", "false"), default="auto", metavar="WHEN",
                       help="auto (default: where the run allows), true, false")
    p.add_argument("--all", action="store_true", help="list every plan, not the first 20")
    p.add_argument("--check", action="store_true", help="predicted vs measured for bench/results.jsonl rows")
    p.add_argument("--markdown", action="store_true", help="with --check: the markdown table of RESULTS.md")
    p.add_argument("--write_snapshot", action="store_true", help="after new bench rows: refit sft/plan/fitted.json")
    return p


def main(argv: list[str] | None = None) -> int:
    from sft.errors import ConfigError

    args = parser().parse_args(argv)
    if (args.check or args.write_snapshot) and not RESULTS.is_file():  # a wheel ships the snapshot, not the rows
        print(f"error: --{'check' if args.check else 'write_snapshot'} reads bench/results.jsonl, which only a clone "
              f"of the repository has: run it there.", file=sys.stderr)
        return 2
    if args.write_snapshot:
        print(write_snapshot())
        return 0
    if args.check:
        results = check_rows()
        print(check_table(results) if args.markdown else check_summary(results))
        return 0
    if not args.model:
        print("error: --model is missing: a hub id, a local directory or a family name "
              f"({', '.join(SHAPES)}).", file=sys.stderr)
        return 2
    for name in ("gpus", "gpu_mem", "max_length", "micro_batch", "lora_r", "gradient_accumulation_steps", "host_ram"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            print(f"error: --{name} {value:g}: give a positive number.", file=sys.stderr)
            return 2
    try:
        shape = resolve_shape(args.model)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    found = gpu_kind(args.gpu)
    if found is None:
        print(f"error: --gpu {args.gpu}: not a GPU the planner knows; give one of {', '.join(GPU_KINDS)} (the one "
              f"of the same compute capability, with --gpu_mem and --peak_tflops).", file=sys.stderr)
        return 2
    gpu, kind = found
    method = "qlora" if args.qlora else "lora" if args.lora else "full"
    ram = args.host_ram if args.host_ram is not None else this_host_ram()
    mem = args.gpu_mem or kind.memory_gb
    box = Box(args.gpus, mem, ram, args.peak_tflops * 1e12 if args.peak_tflops else kind.peak_flops, gpu)
    mbs = (args.micro_batch,) if args.micro_batch else (1, 2, 4, 8)
    accumulation = args.gradient_accumulation_steps
    plans = enumerate_plans(shape, box, method, args.max_length, mbs, args.lora_r, accumulation,
                            Asked(args.fp8, args.compile_layers))
    shown = plans if args.all else plans[:20]
    host = "host RAM: unknown (give --host_ram)" if ram is None else \
        f"host RAM {ram:.0f} GiB ({'--host_ram' if args.host_ram is not None else 'this machine'})"
    print(f"{shape.name} ({shape.model_type}, {shape.params() / 1e9:.2f}B parameters; shape: {shape.checked}), "
          f"{method}, {args.gpus} x {gpu} {mem:g} GB ({box.card_gib:.2f} GiB by nvidia-smi; a plan keeps "
          f"{MARGIN_GIB:g} GiB of it free), {host}, rows of {args.max_length} tokens"
          f"{f' x {accumulation} micro-batches per step' if accumulation > 1 else ''}, "
          f"{kernels_text(shape, [p.w.strategy for p in shown], [p.w.sequence_parallel for p in shown], is_long(args.max_length))}; "
          f"{fast_paths_text(shown)}")
    print(plan_table(shown))
    best = best_plan(plans)
    waiting = awaiting_plan(plans) if best is None else None
    if waiting:  # it fits, and the run refuses it until its GPU check passes: its command, not as ready to run
        print(f"\nFits, but refused until {AWAITED_CHECK} passes (nothing else fits): "
              f"{command(waiting, args.model, box)}")
        print(f"  the run today: error: {waiting.awaits}")
        print(plan_summary(waiting, box, ram))
        return 1
    if best is None:
        closest = closest_plan(plans)
        print(f"\nNothing fits with {MARGIN_GIB:g} GiB of the card to spare. Closest: "
              + (f"{closest.w.strategy}, micro-batch {closest.w.micro_batch}: {closest.mark()}" if closest
                 else "no strategy applies"))
        more_ram = next((p for p in plans if p.host_short and STRATEGIES[p.w.strategy].recommended
                         and p.prediction.smi_gib <= box.card_gib - MARGIN_GIB), None)  # host RAM is all it lacks
        if more_ram:
            print(f"With more host RAM: {more_ram.w.strategy}, micro-batch {more_ram.w.micro_batch}: "
                  f"{more_ram.why_not}")
        return 1
    unmeasured = " (its speed is not measured, and no plan whose speed is measured fits)" * best.speed_unmeasured
    print(f"\nRecommended{unmeasured}: {command(best, args.model, box)}")
    print(plan_summary(best, box, ram))
    split = split_plan(plans)
    if split is not None and split is not best:  # the rows split over cards, beside the recommendation
        why = " (its speed is not measured, so it is not recommended while a measured plan fits)" \
            * split.speed_unmeasured
        print(f"\nEach row split over {split.w.sequence_parallel} cards instead{why}: "
              f"{command(split, args.model, box)}")
        print(plan_summary(split, box, ram))
    return 0


if __name__ == "__main__":
    sys.exit(main())
