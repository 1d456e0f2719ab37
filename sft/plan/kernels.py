"""The kernel options a plan runs with (attention, Liger), one rule for the plans, their text and the bench rows
that speak for them (sft/plan/speed.py reads a long plan's speed from rows of its own attention)."""

from __future__ import annotations

from sft.plan import sequence_parallel
from sft.plan.shapes import Shape

VARLEN_MODULE = "torch.nn.attention.varlen"  # torch's varlen FlashAttention (2.9+): where varlen plans can run


def kernels(strategy: str, shape: Shape, sequence_parallel_size: int = 1, long_rows: bool = False) -> dict:
    """The kernel options of a plan: those of our measured fast plans (flex_attention skips packed rows' masked
    blocks; Liger's fused loss), except under TP (Liger's loss fails on the sharded lm_head: sdpa), and for MLA
    models (DeepSeek-V2/V3: key and value head sizes differ, no Liger), which take varlen: each packed document's
    attention alone through torch's FlashAttention-2, 1.20-1.23x sdpa's step on V2-Lite (bench/RESULTS.md, runs
    20261206T0640Z-varlen-h100 and 0903Z-resident-varlen-h100); planned_options falls back to sdpa where this torch
    has no varlen kernel. Long rows (`long_rows`: sft/plan/long_rows.py) take varlen too, as the long recipe does: a
    row of one long conversation runs sdpa's fused causal kernel, and nothing compiles per row length (with FP8 and
    compiled layers at 32k on H100s held to 24 GiB, 0.32-0.33 of the bench's MFU: long-r1-32k-sdpa-default and
    -varlen-default, runs 20261205T1845Z to 20261206T1532Z; flex_attention's long-r1-32k-default 0.25-0.28, runs
    20261205T1120Z to 1535Z). Without the fused loss the logits are materialised: the memory model counts
    them (fused_loss). An SP plan runs what its bench row runs (sequence_parallel.KERNELS: sdpa, its loss in
    chunks)."""
    if sequence_parallel_size > 1:
        return dict(sequence_parallel.KERNELS)
    if strategy == "tp":
        return {"attn_implementation": "sdpa", "use_liger_kernel": False}
    if shape.kv_lora_rank:
        return {"attn_implementation": "varlen", "use_liger_kernel": False}
    if long_rows:
        return {"attn_implementation": "varlen", "use_liger_kernel": True}
    return {"attn_implementation": "flex_attention", "use_liger_kernel": True}
