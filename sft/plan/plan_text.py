"""A plan in words: the command that runs it (command), the planner's table of plans (plan_table), what their
commands run with (kernels_text, fast_paths_said, fast_paths_text) and the lines under a plan's command
(plan_summary). Above sft/plan/plans.py, whose Plans it says; below the command line (sft/plan/planner.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sft.names import hub_id
from sft.parallel.strategies import PRECISION_OPTIONS, REPO, STRATEGIES
from sft.plan import resident, sequence_parallel
from sft.plan.long_rows import is_long
from sft.plan.kernels import kernels
from sft.plan.plans import Box, Plan, shown_gib
from sft.plan.shapes import Shape
from sft.plan.workload import strategy_label


def command(plan: Plan, model: str, box: Box) -> str:
    w, s = plan.w, STRATEGIES[plan.w.strategy]
    processes = "" if s.name == "single_gpu" or w.world == 3 else f" --num_processes {w.world}"
    split = w.sequence_parallel > 1  # one conversation per row under sdpa: no --packing
    if (REPO / s.accelerate_config).is_file():  # a checkout: the README's command, from its root
        launch = f"accelerate launch -q --config_file {s.accelerate_config}{processes} sft/train.py"
    else:  # an install without the repository: the shipped config by name, from any directory
        launch = f"deepseek-sft train --config_file {Path(s.accelerate_config).name}{processes}"
    opts = [f"--model {hub_id(model)}", "--dataset data.jsonl", *["--packing"] * (not split),
            f"--max_length {w.seq_len}", f"--per_device_train_batch_size {w.micro_batch}"]
    if w.grad_accum > 1:
        opts += [f"--gradient_accumulation_steps {w.grad_accum}"]
    if w.setup.method in ("lora", "qlora"):
        opts += ["--lora", "--lora_dropout 0", "--bf16"]
        if w.setup.method == "qlora":
            opts += ["--qlora"]
    elif w.setup.precision == "fp32_master":
        opts += ["--bf16"]
    else:
        opts += [f"--{k} {v}" for k, v in PRECISION_OPTIONS[w.setup.precision].items()]
    opts += [f"--{k}" if v is True else f"--{k} {v}"
             for k, v in kernels(plan.w.strategy, plan.shape, w.sequence_parallel, is_long(w.seq_len)).items()
             if v is not False]
    if s.name == "tp":
        opts += [f"--tp_size {w.world}"]
    if w.resident:  # its option, the checkpointing the run requires for it, the chunked loss where auto does not
        opts += resident.flags(plan.chunked_loss_asked)
    else:
        opts += ["--activation_checkpointing"] * w.checkpointing + ["--chunked_loss"] * plan.chunked_loss_asked
    opts += w.levers.flags()  # long rows: what they need to leave the card its margin
    opts += sequence_parallel.flags(w.sequence_parallel) if split else []
    opts += plan.asked.flags()  # auto, the default, settles as planned on the box: no option needed for it
    return f"{launch} " + " ".join(opts)


def kernels_text(shape: "Shape", strategies: list[str], sequence_parallel_sizes: list[int] | None = None,
                 long_rows: bool = False) -> str:
    """What the plans of these strategies run, as their commands pass it (kernels): one description where they
    agree, else the first strategy's and each other's; an SP plan (its size beside its strategy, > 1) as
    plan_table names it (zero3+sp2)."""
    def text(k: dict) -> str:
        return k["attn_implementation"] + (" + Liger" if k["use_liger_kernel"] else ", no Liger")

    sizes = sequence_parallel_sizes or [1] * len(strategies)
    seen = {strategy_label(s, n): text(kernels(s, shape, n, long_rows)) for s, n in zip(strategies, sizes)}
    first = next(iter(seen.values()), "")
    others = sorted({f"{s}: {t}" for s, t in seen.items() if t != first})
    return first + (f" ({'; '.join(others)})" if others else "")


def plan_table(plans: list[Plan], limit: int | None = None) -> str:
    """One line a plan; a `long rows` column (its levers: tile, offload) where the rows are long. A resident plan's
    precision is `resident` (the experts in e4m3: sft/plan/resident.py)."""
    long = any(is_long(p.w.seq_len) for p in plans)
    levers = f" {'long rows':<12}" if long else ""
    head = f"{'strategy':<14} {'precision':<11} {'ckpt':<4} {'mb':>2} {'fast paths':<12}{levers} " \
           f"{'GPU GiB/card':>12} {'host GiB':>8} {'est. tok/s':>10}  fits?"
    lines = [head, "-" * len(head)]
    for p in plans[:limit]:
        w = p.w
        prec = "resident" if w.resident else "-" if w.setup.method != "full" else w.setup.precision
        said = f" {w.levers.label or '-':<12}" if long else ""
        lines.append(f"{strategy_label(w.strategy, w.sequence_parallel):<14} {prec:<11} {'yes' if w.checkpointing else 'no':<4} {w.micro_batch:>2} "
                     f"{w.fast or '-':<12}{said} {shown_gib(p):>12.1f} {p.prediction.host_gib:>8.0f} "
                     f"{p.tok_s:>10,.0f}  {p.mark()}")
    return "\n".join(lines)


def fast_paths_said(plan: Plan) -> str:
    """A plan's fast paths and why: "FP8 + compiled layers (defaults on this GPU)" where `auto` turned both on,
    else each on or off, with the run's own reason for one that `auto` left off (sft/options/resolve.py)."""
    f, asked = plan.fast, plan.asked
    if f.fp8 and f.compiled and asked == dataclasses.replace(asked, fp8="auto", compile_layers="auto"):
        return "FP8 + compiled layers (defaults on this GPU)"
    said = []
    for name, option, on, given in (("compiled layers", "compile_layers", f.compiled, asked.compile_layers),
                                    ("FP8", "fp8", f.fp8, asked.fp8)):
        if on:
            said.append(f"{name} on ({'the default' if given == 'auto' else f'--{option} {given}'})")
        else:  # auto left it off for the run's own reason, or the user said false
            reason = next((n.removeprefix(f"{name} off (")[:-1] for n in f.notes if n.startswith(f"{name} off (")),
                          f"--{option} {given}")
            said.append(f"{name} off ({reason})")
    return ", ".join(said)


def fast_paths_text(plans: list[Plan]) -> str:
    """What the plans' commands run with, by strategy, as kernels_text says their kernels: the first plan's
    strategies with why any path is off (fast_paths_said), then the others' where they differ."""
    groups: dict[str, list[Plan]] = {}
    for p in plans:
        same = groups.setdefault(p.fast.label, [])
        if p.w.strategy not in [q.w.strategy for q in same]:
            same.append(p)
    said = [f"{', '.join(q.w.strategy for q in same)}: "
            + (fast_paths_said(same[0]) if i == 0 else same[0].fast.name)
            + (" (refused: the run stops)" if same[0].fast.refused else "") for i, same in enumerate(groups.values())]
    return "; ".join(said)


def plan_summary(plan: Plan, box: Box, ram: float | None) -> str:
    """The lines under a plan's command: its fast paths, and its predicted memory, host RAM and speed."""
    needs = f"host RAM: unknown, needs {plan.prediction.host_gib:.0f} GiB" if ram is None else \
        f"{plan.prediction.host_gib:.0f} of {ram:.0f} GiB host RAM"
    return (f"  {fast_paths_said(plan)}\n"
            f"  predicted {shown_gib(plan):.1f} GiB per GPU (nvidia-smi), {needs}; ~{plan.tok_s:,.0f} tok/s, an "
            f"estimate: {plan.tok_s_source}, scaled to {box.peak_flops / 1e12:g} TFLOP/s per GPU")
