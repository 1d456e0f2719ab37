"""The plans: every strategy x precision x checkpointing x micro-batch for a model on a box (enumerate_plans), each
with the kernels, fast paths and long-row levers its run takes, predicted (sft/plan/memory.py, sft/plan/speed.py)
and judged (Plan: fits, roomy, ready, last_resort, mark), ranked best first (ranked); the one recommended
(best_plan), and the others the planner names (split_plan, awaiting_plan, closest_plan); the GPUs and strategy a
launch on this machine holds a plan to (cards, launched_strategy).

Above the sub-plans it composes (sft/plan/resident.py, expert_parallel.py, sequence_parallel.py, long_rows.py),
which know nothing of ranking: a sub-plan says whether it applies, what it holds and whether its speed is measured
(its UNMEASURED note), and this module decides what that means for a recommendation. Below the planner's command
line and `--plan auto` (sft/plan/planner.py), the plans' text (sft/plan/plan_text.py), sft/plan/box.py and
sft/plan/this_run.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from sft.machine import Machine
from sft.parallel.strategies import STRATEGIES, Setup
from sft.plan import expert_parallel, resident, sequence_parallel
from sft.plan.fast_paths import (Asked, FastPaths, described_machine, fast_paths, loss_in_chunks_by_default,
                                 refused_today)
from sft.plan.kernels import kernels
from sft.plan.long_rows import ladder
from sft.plan.memory import Prediction, predict
from sft.plan.shapes import Shape
from sft.plan.speed import tokens_per_second
from sft.plan.workload import Levers, Workload


# A plan is recommended only with this much of the card left free by nvidia-smi's count (the bench's target on 24 GB
# cards: nvidia-smi <= 23 GiB): below it, the allocator's cache and the prediction's own error meet the card's edge.
MARGIN_GIB = 1.0
# The memory model's worst error on the bench rows (7.3% of the allocator's peak, 7.3% of nvidia-smi's): plans whose
# predictions are closer than this cannot be told apart by their headroom.
HEADROOM = 0.075
# tok/s estimates this close are one speed: the estimate is one measured MFU per kind of plan, and one configuration
# measured again moves that much (full-sr16, 7 runs on the H200: MFU 65.0-68.8%).
SPEED_TIE = 0.05
# What a plan's speed source says when no bench row of its kind exists yet (Plan.speed_unmeasured)
UNMEASURED_SPEEDS = (expert_parallel.UNMEASURED, sequence_parallel.UNMEASURED)
# What lifts the run's refusal of --qlora under FSDP (sft/options/checks.py qlora_under_fsdp_awaits_its_gpu_run)
AWAITED_CHECK = "`python bench/qlora_check.py --fsdp two` on 2 GPUs"


@dataclass(frozen=True)
class Box:
    """The box a plan is for, as described on the command line (sft.machine.Machine is the one we run on)."""

    gpus: int = 3
    gpu_mem_gib: float = 24.0          # the card's memory as sold (24 GB cards show 23.99 GiB in nvidia-smi)
    host_ram_gib: float | None = None  # None: unknown (plans then say what they need, never assume it is there)
    peak_flops: float = 165e12         # RTX 4090 dense bf16 (sft/machine.py GPU_KINDS)
    gpu: str = "RTX 4090"              # a GPU_KINDS name: its compute capability decides FP8 (fast_paths)
    machine: Machine | None = None     # `--plan auto`: this machine itself (its GPUs, FP8 probe and packages)

    @property
    def card_gib(self) -> float:
        """What nvidia-smi counts as the card's total: a '24 GB' GeForce holds 24,564 MiB."""
        return self.gpu_mem_gib * 1023.5 / 1024 if self.gpu_mem_gib == 24 else self.gpu_mem_gib

    def described(self) -> Machine:
        """The box as the run's rules read a machine (sft/plan/fast_paths.py)."""
        return self.machine or described_machine(self.gpu, self.gpus, self.gpu_mem_gib)


@dataclass
class Plan:
    prediction: Prediction
    tok_s: float
    tok_s_source: str
    fits: bool                         # it could run: the card holds what it needs, and so does host RAM if known
    why_not: str
    shape: Shape
    machine_card: float = 24.0
    host_ram_gib: float | None = None  # the box's; None: unknown
    fast: FastPaths = FastPaths()      # what it runs with, and the run's words for why (w.fp8, w.compiled)
    asked: Asked = Asked()             # --fp8/--compile_layers as given: its command passes those not auto
    awaits: str | None = None          # the run refuses it until a GPU check passes (refused_today): its error

    @property
    def w(self) -> Workload:
        return self.prediction.workload

    @property
    def ready(self) -> bool:
        """It fits with its margin under a recommended strategy and the run takes it today: what is recommended."""
        return self.roomy and recommended(self) and not self.awaits

    @property
    def roomy(self) -> bool:
        """It fits with MARGIN_GIB of the card left free by nvidia-smi's count: the only plans recommended."""
        return self.fits and self.prediction.smi_gib <= self.machine_card - MARGIN_GIB

    @property
    def host_unknown(self) -> bool:
        return self.host_ram_gib is None

    @property
    def host_short(self) -> bool:
        """It needs more host RAM than the box is known to have."""
        return self.host_ram_gib is not None and self.prediction.host_gib > self.host_ram_gib

    @property
    def chunked_loss_asked(self) -> bool:
        """Its loss in chunks needs --chunked_loss in its command: the run's `auto` would not take it there
        (loss_in_chunks_by_default: it does wherever Liger's loss is not and its checks pass), and no --sequence_parallel, whose loss is
        in chunks anyway. A resident plan of an MoE model that is not MLA asks for it (its bench rows ran so)."""
        w = self.w
        return w.chunked_loss and w.sequence_parallel == 1 and not loss_in_chunks_by_default(
            w.strategy, w.world, w.setup.method, w.fused_loss)

    def mark(self) -> str:
        """The table's `fits?`: "yes" only for a plan with its margin on a box whose host RAM is known to hold it."""
        unknown = f"host RAM: unknown, needs {self.prediction.host_gib:.0f} GiB"
        if not self.fits:
            text = f"no: {self.why_not}"
        elif not self.roomy:
            text = f"tight: nvidia-smi {self.prediction.smi_gib:.1f} > {self.machine_card - MARGIN_GIB:.1f} " \
                   f"(the card less {MARGIN_GIB:g} GiB)" + (f"; {unknown}" if self.host_unknown else "")
        else:
            text = unknown if self.host_unknown else "yes"
        if self.awaits and self.fits:
            text += f" (refused until {AWAITED_CHECK} passes)"
        if self.speed_unmeasured and self.w.sequence_parallel > 1:
            return text + " (speed not measured" + (": recommended only where no measured plan fits)"
                                                    if self.last_resort else ")")
        if self.speed_unmeasured:
            return text + " (not recommended: speed not measured)"
        return text + ("" if STRATEGIES[self.w.strategy].recommended else " (not recommended)")

    @property
    def speed_unmeasured(self) -> bool:
        """Its tok/s is another kind's MFU: an AutoEP plan or an SP plan before its bench row
        (sft/plan/expert_parallel.py, sft/plan/sequence_parallel.py)."""
        return any(note in self.tok_s_source for note in UNMEASURED_SPEEDS)

    @property
    def last_resort(self) -> bool:
        """An SP plan that fits with its margin under a recommended strategy and that the run takes today: where its
        speed is not measured, it is recommended only where no measured plan is ready (best_plan); once rows split as
        it is measured it, it is also `ready`, ranked by its speed as any plan. AutoEP's plan never is (recommended):
        a V2-Lite LoRA always has a measured plan on the cards AutoEP needs."""
        return (self.roomy and self.w.sequence_parallel > 1 and STRATEGIES[self.w.strategy].recommended
                and not self.awaits)


def _speed_tiers(plans: list[Plan]) -> list[list[Plan]]:
    """`plans` fastest first, cut into tiers of one speed: each holds the plans within SPEED_TIE of its first."""
    tiers: list[list[Plan]] = []
    for p in sorted(plans, key=lambda p: -p.tok_s):
        if tiers and p.tok_s >= tiers[-1][0].tok_s * (1 - SPEED_TIE):
            tiers[-1].append(p)
        else:
            tiers.append([p])
    return tiers


def safe(plan: Plan) -> bool:
    """It keeps its margin even where the memory model is off by its worst error on the bench rows (HEADROOM)."""
    return plan.prediction.smi_gib * (1 + HEADROOM) <= plan.machine_card - MARGIN_GIB


def ranked(plans: list[Plan]) -> list[Plan]:
    """Best first: the plans that fit with their margin (recommended strategies first, then the SP plans whose speed
    is not measured: Plan.last_resort), then the tight ones, then those that do not fit. Within each, the fastest; among plans of one speed (SPEED_TIE) those with headroom
    enough for the memory model's worst error first (safe), then those with fewer long-row levers (a lever is taken
    where it is needed: its own cost is not measured apart), then the larger micro-batch (measured: micro-batch 4
    ran faster than 1 and 2 at the same MFU class), then the order of the strategy table (sft/parallel/strategies.py:
    simpler strategies, and bf16_sr, measured faster than torchao's 8-bit AdamW, first)."""
    def group(p: Plan) -> int:
        return 0 if p.ready else 1 if p.last_resort else 2 if p.roomy else 3 if p.fits else 4

    out: list[Plan] = []
    order = {id(p): i for i, p in enumerate(plans)}
    for g in range(5):
        for tier in _speed_tiers([p for p in plans if group(p) == g]):
            tier.sort(key=lambda p: order[id(p)])
            out += sorted(tier, key=lambda p: (not safe(p), len(p.w.levers.label.split("+")) if p.w.levers.label
                                               else 0, -p.w.micro_batch))  # stable: the table's order
    return out


def enumerate_plans(shape: Shape, box: Box, method: str = "lora", max_length: int = 2048,
                    micro_batches: tuple[int, ...] = (1, 2, 4, 8), lora_r: int = 16, grad_accum: int = 1,
                    asked: Asked = Asked(), levers: Levers | None = None) -> list[Plan]:
    """Every strategy x precision x checkpointing x micro-batch for `shape` on `box`, best first (ranked), each with
    the fast paths its run gets there for the --fp8/--compile_layers `asked` (fast_paths: the run's own rule), and
    for long rows the cheapest long-row levers that leave the card its margin (long_rows.ladder; all of them where
    none does), or `levers` where given. Beside them the resident plans (--quantize_experts fp8) and the SP plans
    (--sequence_parallel) where they apply (resident.offered, sequence_parallel.offered)."""
    plans = []
    for strategy in STRATEGIES.values():
        if method not in strategy.methods or box.gpus < strategy.min_gpus:
            continue
        world = strategy.gpus_for(box.gpus)
        if strategy.name == "tp" and shape.heads % world:
            continue
        precisions = ("fp32_master",) if method != "full" else strategy.precisions
        for precision in precisions:
            if precision != "fp32_master" and strategy.name not in ("single_gpu", "ddp", "fsdp"):
                continue
            for ckpt in (True, False):
                for mb in micro_batches:
                    fused = kernels(strategy.name, shape)["use_liger_kernel"]
                    # the loss in chunks where the run's --chunked_loss auto takes it (without Liger, where allowed)
                    w = Workload(strategy.name, Setup(method, precision), world, mb, max_length, ckpt,
                                 fused_loss=fused, lora_r=lora_r, grad_accum=grad_accum,
                                 chunked_loss=loss_in_chunks_by_default(strategy.name, world, method, fused))
                    if strategy.name == expert_parallel.STRATEGY and not expert_parallel.offered(shape, method):
                        continue
                    kinds = [w, _resident(w)] if resident.offered(shape, strategy.name, method, ckpt) else [w]
                    if sequence_parallel.offered(strategy.name, method, max_length):
                        kinds += [_split(w, n, box.gpus) for n in sequence_parallel.sizes(shape, box.gpus)]
                    for kind in kinds:
                        plans += _with_levers(shape, box, kind, asked, levers)
    return ranked(plans)


def _split(w: Workload, size: int, gpus: int) -> Workload:
    """`w` with each row split over `size` ranks (--sequence_parallel), on the processes that launch takes, with
    the kernels its run takes and its loss in chunks."""
    return dataclasses.replace(w, sequence_parallel=size, world=sequence_parallel.processes(gpus, size),
                               fused_loss=False, chunked_loss=True)


def _resident(w: Workload) -> Workload:
    """`w` with the experts in e4m3, its loss in chunks where there is no Liger (the whole logits are what its
    bench rows left out)."""
    return dataclasses.replace(w, resident=True, chunked_loss=not w.fused_loss)


def _with_levers(shape: Shape, box: Box, w: Workload, asked: Asked, levers: Levers | None) -> list[Plan]:
    """`w` with the fast paths its run gets on `box`, and the first long-row levers that leave the card its margin
    (all of them where none does); [] where no lever applies. Where `auto` turned the fast paths on and no lever
    then leaves the margin, the same without the compiled layers, then without FP8 too (`--compile_layers false`,
    `--fp8 false` in its command, and why in FastPaths.planned_off): at 32k tokens the compiled layers were measured
    taking more memory than eager ones (memory.CALIBRATION compiled_checkpoint_scale)."""
    tried = _levers_tried(shape, box, w, asked, levers)
    roomy = next((p for p in tried if p.roomy), None)
    why = ""
    for option in ("compile_layers", "fp8"):  # the compiled layers first: they cost more memory at long rows
        on = tried and (tried[0].fast.compiled if option == "compile_layers" else tried[0].fast.fp8)
        if roomy is not None or not on or getattr(asked, option) != "auto":
            continue
        why = why or (f"with them the plan needs {shown_gib(tried[-1]):.1f} GiB per GPU by nvidia-smi, more than the "
                      f"card less its {MARGIN_GIB:g} GiB margin")
        asked = dataclasses.replace(asked, **{option: "false"})
        roomy = next((p for p in _levers_tried(shape, box, w, asked, levers, why) if p.roomy), None)
    return [roomy or tried[-1]] if tried else []


def _levers_tried(shape: Shape, box: Box, w: Workload, asked: Asked, levers: Levers | None,
                  turned_off: str = "") -> list[Plan]:
    """`w` with the fast paths its run gets on `box` for `asked`, under each long-row lever in turn (the user's
    alone where given); `turned_off`: why the planner set a fast path of `asked` to false, for the plan's notes."""
    fast = fast_paths(box.described(), w.strategy, w.world, w.setup.method, asked,
                      "fp8" if w.resident else "none")
    if turned_off:  # the run's own note for a path set to false is the option; the plan says why
        planned = [name for option, name in (("compile_layers", "compiled layers"), ("fp8", "FP8"))
                   if getattr(asked, option) == "false"]
        said = tuple(f"{name} off ({turned_off})" for name in planned)
        fast = dataclasses.replace(fast, notes=(*(n for n in fast.notes if not n.startswith(tuple(planned))), *said),
                                   planned_off=said)
    w = dataclasses.replace(w, fp8=fast.fp8, compiled=fast.compiled)
    return [judged_plan(shape, box, dataclasses.replace(w, mlp_tile_tokens=lv.mlp_tile_tokens,
                                                        offload_activations=lv.offload_activations), fast, asked)
            for lv in ([levers] if levers else ladder(shape, w.seq_len, w.checkpointing))
            if w.checkpointing or not lv.offload_activations]  # offloading moves the checkpoints


def judged_plan(shape: Shape, box: Box, w: Workload, fast: FastPaths, asked: Asked) -> Plan:
    """`w` predicted on `box`, and whether it fits there (why not)."""
    p = predict(shape, w)
    tok_s, source = tokens_per_second(shape, w, box.peak_flops)
    why = []
    if p.need_gib > box.card_gib:
        why.append(f"needs {p.need_gib:.1f} GiB per card > {box.card_gib:.1f}")
    if box.host_ram_gib is not None and p.host_gib > box.host_ram_gib:
        have = f"{box.host_ram_gib:.1f}".removesuffix(".0")  # this machine's, read to the byte: 23.5, not 23.5403
        why.append(f"needs {p.host_gib:.0f} GiB host RAM > {have}")
    if w.strategy == "tp" and w.setup.method != "full":
        why.append("TP takes no LoRA")
    if fast.refused:  # a --fp8/--compile_layers true this strategy refuses: the run stops there
        why.append(fast.refused.split(". ")[0])
    return Plan(p, tok_s, source, not why, "; ".join(why), shape, box.card_gib, box.host_ram_gib, fast, asked,
                refused_today(box.described(), w.strategy, w.world, w.setup.method))


def with_loss(plan: Plan, box: Box, fused_loss: bool | None = None, chunked_loss: bool | None = None) -> Plan:
    """`plan` with the loss the user typed (None: as planned): Liger's fused loss or not (--use_liger_kernel), the
    loss in chunks or not (--chunked_loss true/false; a typed true runs without Liger, which the run refuses beside
    it; where not typed, the run's --chunked_loss auto rule for that Liger). Without either the logits are whole,
    which the memory model counts: a plan sized for Liger's loss may not fit without it. An SP plan's loss is in
    chunks whatever is typed (sequence_parallel.KERNELS)."""
    w = plan.w
    if w.sequence_parallel > 1 or (fused_loss is None and chunked_loss is None):
        return plan
    fused = fused_loss if fused_loss is not None else w.fused_loss and not chunked_loss
    loss = dataclasses.replace(w, fused_loss=fused)
    if chunked_loss is not None:
        loss = dataclasses.replace(loss, chunked_loss=chunked_loss)
    elif w.resident:  # a resident plan's own rule
        loss = _resident(loss)
    else:  # the run's --chunked_loss auto
        loss = dataclasses.replace(loss, chunked_loss=loss_in_chunks_by_default(w.strategy, w.world, w.setup.method,
                                                                                fused))
    return plan if loss == w else judged_plan(plan.shape, box, loss, plan.fast, plan.asked)


def best_plan(plans: list[Plan]) -> Plan | None:
    """The first of the ranked plans that fits with its margin (nvidia-smi at most the card less MARGIN_GIB) under a
    recommended strategy, its speed measured; where none is, the first SP plan that fits so (Plan.last_resort: its
    speed is not measured, and the planner says so); None when there is none: a plan at the card's edge is never
    recommended (what it leaves is less than the prediction's own error, and the allocator's cache grows into it)."""
    return next((p for p in ranked(plans) if p.ready or p.last_resort), None)


def split_plan(plans: list[Plan]) -> Plan | None:
    """The first SP plan that fits with its margin (Plan.last_resort), its speed measured or not: beside another
    plan that best_plan recommends, the planner prints it as the other way to run the rows; None when there is
    none."""
    return next((p for p in ranked(plans) if p.last_resort), None)


def awaiting_plan(plans: list[Plan]) -> Plan | None:
    """When no plan is ready (best_plan): the first that fits with its margin under a recommended strategy but that
    the run refuses until a GPU check passes (Plan.awaits); None when there is none."""
    return next((p for p in ranked(plans) if p.roomy and recommended(p) and p.awaits), None)


def recommended(plan: Plan) -> bool:
    """Its strategy is one we recommend, and its speed stands on rows of its own kind: an AutoEP plan before its
    bench row (sft/plan/expert_parallel.py) is a guess from DDP's rows, never put before a measured plan."""
    return STRATEGIES[plan.w.strategy].recommended and not plan.speed_unmeasured


def closest_plan(plans: list[Plan]) -> Plan | None:
    """When nothing fits with its margin: a tight plan (it may run, at the card's edge), else the plan that misses
    by the least (GPU memory and host RAM, each against what the box has)."""
    tight = [p for p in ranked(plans) if p.fits]
    if tight:
        return tight[0]

    def miss(p: Plan) -> float:
        return max(p.prediction.need_gib / p.machine_card, p.prediction.host_gib / (p.host_ram_gib or math.inf))

    return min(plans, key=miss, default=None)


def shown_gib(plan: Plan) -> float:
    """nvidia-smi's figure: the allocator caches up to the card's memory, never beyond."""
    return min(plan.prediction.smi_gib, plan.machine_card)


def cards(m) -> tuple[int, float]:
    """The GPUs a plan is for (the launch's processes, else the machine's) and the smallest one's GiB."""
    return max(1, m.launch.world_size if m.launch.launched else m.gpus), min(m.gpu_memory_gib or (24.0,))


def launched_strategy(m) -> str | None:
    """The strategy this machine's launch runs (`m`: a sft.machine.Machine), or None where nothing was launched."""
    launch = m.launch
    if not launch.launched:
        return None
    if launch.fsdp:
        return "fsdp"
    if launch.zero_stage:
        # ZeRO-0: the shipped DeepSpeed config of that stage is AutoEP's (accelerate_configs/autoep.yaml)
        return {"0": expert_parallel.STRATEGY, "2": "zero2",
                "3": "zero3_offload" if launch.offload else "zero3"}.get(str(launch.zero_stage))
    return "ddp" if launch.world_size > 1 else "single_gpu"
