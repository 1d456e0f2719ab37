"""The kernel options a plan runs with (attention, Liger), one rule for the plans, their text and the bench rows
that speak for them (sft/plan/speed.py reads a long plan's speed from rows of its own attention)."""

from __future__ import annotations

from sft.plan import sequence_parallel
from sft.plan.shapes import Shape


def kernels(strategy: str, shape: Shape, sequence_parallel_size: int = 1) -> dict:
    """The kernel options of a plan: those of our measured fast plans (flex_attention skips packed rows' masked
    blocks; Liger's fused loss), except under TP (Liger's loss fails on the sharded lm_head) and for MLA models
    (DeepSeek-V2/V3: key and value head sizes differ; no V2 run with flex or Liger yet), which keep sdpa. Without
    the fused loss the logits are materialised: the memory model counts them (fused_loss). An SP plan runs what its
    bench row runs (sequence_parallel.KERNELS: sdpa, its loss in chunks)."""
    if sequence_parallel_size > 1:
        return dict(sequence_parallel.KERNELS)
    if strategy == "tp" or shape.kv_lora_rank:
        return {"attn_implementation": "sdpa", "use_liger_kernel": False}
    return {"attn_implementation": "flex_attention", "use_liger_kernel": True}
