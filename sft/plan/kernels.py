"""The kernel options a plan runs with (attention, Liger), one rule for the plans, their text and the bench rows
that speak for them (sft/plan/speed.py reads a long plan's speed from rows of its own attention)."""

from __future__ import annotations

from sft.plan import sequence_parallel
from sft.plan.shapes import Shape

VARLEN_MODULE = "torch.nn.attention.varlen"  # torch's varlen FlashAttention (2.9+): where varlen plans can run


def kernels(strategy: str, shape: Shape, sequence_parallel_size: int = 1) -> dict:
    """The kernel options of a plan: those of our measured fast plans (flex_attention skips packed rows' masked
    blocks; Liger's fused loss), except under TP (Liger's loss fails on the sharded lm_head: sdpa), and for MLA
    models (DeepSeek-V2/V3: key and value head sizes differ, no Liger), which take varlen: each packed document's
    attention alone through torch's FlashAttention-2, 1.20-1.23x sdpa's step on V2-Lite (bench/RESULTS.md, runs
    20261206T0640Z-varlen-h100 and 0903Z-resident-varlen-h100); planned_options falls back to sdpa where this torch
    has no varlen kernel. Without the fused loss the logits are materialised: the memory model counts them
    (fused_loss). An SP plan runs what its bench row runs (sequence_parallel.KERNELS: sdpa, its loss in chunks)."""
    if sequence_parallel_size > 1:
        return dict(sequence_parallel.KERNELS)
    if strategy == "tp":
        return {"attn_implementation": "sdpa", "use_liger_kernel": False}
    if shape.kv_lora_rank:
        return {"attn_implementation": "varlen", "use_liger_kernel": False}
    return {"attn_implementation": "flex_attention", "use_liger_kernel": True}
