"""The strategy for a box of 3 x 24 GB GPUs, the planner's choice for a model (docs/strategies.md; bench/RESULTS.md).

Not beside the families' presets (sft/model/families.py): it asks the planner and the strategy table, which read
the model's side, so sft/model/ would import them back (tests/test_structure.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from sft.parallel.strategies import STRATEGIES
from sft.plan.plans import Box, best_plan, closest_plan, enumerate_plans, shown_gib
from sft.plan.shapes import Shape, resolve_shape, shape_from_config

GPUS, GPU_GB = 3, 24  # cards as sold: the planner counts what nvidia-smi shows of them (context and NCCL included)


@dataclass(frozen=True)
class BoxRecommendation:
    """The accelerate config recommended for the 3 x 24 GB box, and why (sft.parallel.strategies.Strategy is the
    strategy itself: its configs and memory model)."""
    config: str | None  # accelerate_configs/<name>.yaml; None: it does not fit this box
    why: str


def strategy(model, lora: bool, host_ram_gib: float | None = None) -> BoxRecommendation:
    """The accelerate config to use on 3 x 24 GB for `model` (a sft.plan.shapes.Shape, or what
    `python -m sft.plan.planner --model` takes: a family name, hub id or local directory): the planner's fastest
    recommended plan that fits (sft/plan/plans.py; the one memory model, sft/plan/memory.py: GPU memory per card as
    nvidia-smi counts it, and host RAM), for 2048-token packed rows. Plans whose host RAM exceeds `host_ram_gib`
    (default 512) do not fit; none fits: config None."""
    shape = model if isinstance(model, Shape) else resolve_shape(model)
    ram = host_ram_gib or 512.0
    method = "lora" if lora else "full"
    # a config only: not the resident plan, whose --quantize_experts changes the model (the user opts in)
    plans = [p for p in enumerate_plans(shape, Box(GPUS, GPU_GB, ram), method) if not p.w.resident]
    best = best_plan(plans)
    what = f"{'LoRA' if lora else 'full fine-tuning'} of {shape.name} ({shape.params() / 1e9:.1f}B parameters)"
    if best is None:
        closest = closest_plan(plans)
        near = f"{closest.w.strategy} {closest.mark()}" if closest else "no strategy applies"
        return BoxRecommendation(None, f"{what} fits no plan on {GPUS} x {GPU_GB} GB with {ram:g} GiB of host RAM "
                                       f"(closest: {near})")
    w = best.w
    precision = "" if lora or w.setup.precision == "fp32_master" else f", {w.setup.precision} optimizer"
    return BoxRecommendation(STRATEGIES[w.strategy].accelerate_config,
                             f"{what}: {w.strategy}{precision}, micro-batch {w.micro_batch}, checkpointing "
                             f"{'on' if w.checkpointing else 'off'}, {best.fast.name} (on RTX 4090s): "
                             f"{shown_gib(best):.1f} GiB per card, "
                             f"{best.prediction.host_gib:.0f} GiB host RAM (predicted by sft/plan/planner.py)")


def recommended_strategy(config, lora: bool, host_ram_gib: float | None = None) -> BoxRecommendation:
    """strategy() for the model this config describes."""
    return strategy(shape_from_config(config, getattr(config, "name_or_path", "") or config.model_type), lora,
                    host_ram_gib)
