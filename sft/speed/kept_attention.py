"""--activation_checkpointing_keep_attention: under activation checkpointing, each layer's attention output is kept
for the backward instead of recomputed with the rest of the layer (torch's selective activation checkpointing).

A checkpointed layer runs its forward twice: once in the forward, once in the backward's recompute. At long rows the
attention is the costly part of that recompute (at 32k tokens of R1-Distill-Qwen-7B its forward is ~6.6 of the ~71
GFLOP a token costs), and what it makes is small next to what it costs: its output and log-sum-exp, about one
hidden vector a token, as much as the layer's input the checkpoint keeps anyway. So the policy saves the outputs of
sdpa's attention ops and recomputes everything else (torchtitan's and torchtune's `selective` mode, narrowed to
attention). The backward then recomputes the projections, norms and MLP, and runs attention's backward from the
saved output: the same numbers as recomputing it (tests/test_kept_attention.py).

Where the kept outputs live:
- `--compile_layers`: transformers (>= 5.23) checkpoints inside each layer's forward, so the checkpoint is inside the
  compiled region; the compiled layer saves the attention outputs with its inputs, and `--offload_activations` moves
  them to host RAM with the checkpoints (sft/speed/activation_offload.py).
- eager layers: torch keeps them in the checkpoint's own cache, on the GPU, whatever the offload (one layer's
  output per layer: 6.2 GiB at 32k tokens for R1-Distill-Qwen-7B's 28 layers). The planner counts either place
  (sft/plan/long_rows.py kept_attention_bytes).

Only sdpa's kernels are named (flash, memory-efficient, cuDNN, CPU): flex_attention and flash_attention_2 run other
ops, which the policy would not see (sft/options/checks.py refuses them).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from sft.speed.activation_offload import PREFETCH

# sdpa's kernels as the compiled or eager graph runs them (aten.scaled_dot_product_attention dispatches to one).
SDPA_KERNELS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


@functools.cache
def attention_ops() -> frozenset:
    """The overloads of sdpa's kernels this torch has (a build may lack one)."""
    return frozenset(getattr(torch.ops.aten, name).default for name in SDPA_KERNELS if hasattr(torch.ops.aten, name))


def keep_attention_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save what attention computes; recompute everything else (cheap next to it at long rows)."""
    return CheckpointPolicy.MUST_SAVE if op in attention_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def keep_attention_contexts():
    """torch.utils.checkpoint's `context_fn`: a fresh pair of contexts for each checkpointed call."""
    return create_selective_checkpoint_contexts(keep_attention_policy)


def checkpoints_inside_forward(layer_class: type | None = None) -> bool:
    """Whether transformers' checkpointed layers checkpoint their `forward` (>= 5.23) rather than their `__call__`
    (5.17-5.22): only then is a compiled layer's checkpoint inside its compiled region, where the kept outputs are
    saved as the compiled layer's own and --offload_activations can move them."""
    if layer_class is None:
        from transformers.modeling_layers import GradientCheckpointingLayer as layer_class
    return layer_class.__call__ is torch.nn.Module.__call__


# What a compiled layer keeps of its attention beside its checkpoint, as saved tensors: sdpa's output and its
# log-sum-exp (3.7 MB at 32k tokens of 28 heads: over activation_offload.MIN_BYTES, so it goes to host RAM too).
KEPT_PER_LAYER = 2


def offload_prefetch(keep_attention: bool, compiled: bool) -> int:
    """The saved tensors --offload_activations brings back ahead of the backward's asking: PREFETCH layers' worth.
    A compiled layer that keeps its attention saves its checkpoint and KEPT_PER_LAYER more, one after the other, and
    its backward unpacks them together: one layer ahead is then 1 + KEPT_PER_LAYER tensors (with one, the next
    layer's checkpoint would cross PCIe only once its backward asked for it, the GPU waiting)."""
    return PREFETCH * (1 + KEPT_PER_LAYER if keep_attention and compiled else 1)
