"""What the planner knows of DeepSpeed AutoEP (sft/parallel/expert_parallel.py): the expert-parallel plan.

A LoRA of a DeepSeek-V2 model under accelerate_configs/autoep.yaml: every card holds the base in bf16 as under DDP,
except the routed experts, of which it holds 1/EP_SIZE (ds_configs/autoep.json's autoep_size); the adapter as
DeepSpeed holds it (16-bit, with an fp32 master and Adam's moments: the zero2 row of the strategy table, unsharded
at ZeRO stage 0). The memory is predicted from that alone, first principles, with one thing of its own: each MoE
layer sends every token's top-k rows to their experts' card and takes them back (all-to-all), the rows and their
expert outputs in bf16, sent and received, alive while the layer (or its recomputation) runs backward.

Its speed is not measured: no bench row of strategy autoep exists yet (moe-lora-autoep-ddp, bench/throughput.py
group issue30). Until one does, its estimate is the resident plan's MFU (sft/plan/resident.py: the same model's
measured LoRA step with checkpointing and the chunked loss, on GPUs holding all the experts; it pays a dequantization
where AutoEP pays two all-to-alls per layer over PCIe, whose cost nobody has measured here) and says so; such a plan
is listed beside the others and never recommended, so an unmeasured guess never wins over a measured plan
(plans.recommended). Once rows of strategy autoep are in
bench/results.jsonl, their MFU is the plan's (the strategy family `autoep`) and the plan competes as any other.

Without torch: the planner's command line reads no GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sft.parallel.expert_parallel import AUTOEP_MODEL_TYPES
from sft.plan import resident

if TYPE_CHECKING:
    from sft.plan.shapes import Shape

STRATEGY = "autoep"
EP_SIZE = 2  # ds_configs/autoep.json's autoep_size: the plan is for that file as shipped
MEASURING_ROW = "moe-lora-autoep-ddp"
UNMEASURED = (f"; AutoEP's speed is not measured yet (bench row {MEASURING_ROW}, group issue30): the resident "
              f"plan's MFU, its dequantization in place of AutoEP's all-to-alls")


def offered(shape: "Shape", method: str) -> bool:
    """A LoRA (not QLoRA: DeepSpeed takes no 4-bit base) of a model AutoEP runs here, its routed experts divisible
    among EP_SIZE cards."""
    return (method == "lora" and shape.model_type in AUTOEP_MODEL_TYPES and shape.routed_experts > 0
            and shape.routed_experts % EP_SIZE == 0)


def experts_elsewhere(shape: "Shape") -> float:
    """The bf16 bytes of routed experts that one card does not hold: all but its 1/EP_SIZE share."""
    return 2.0 * resident.expert_params(shape) * (1 - 1 / EP_SIZE)


def dispatch_bytes(shape: "Shape", tokens: int) -> float:
    """One MoE layer's all-to-all buffers: each token's top-k rows (hidden wide, bf16) sent and received, and their
    expert outputs sent back and received (4 buffers), kept for that layer's backward."""
    return 4 * 2.0 * tokens * shape.experts_per_token * shape.hidden
