"""The training loss of a row split over ranks by --sequence_parallel (sft/parallel/sequence_parallel.py): each
rank's summed loss over its slice's labelled tokens, made the row's mean with the gradient one GPU would get."""

from __future__ import annotations

import torch


def sequence_parallel_group():
    """The process group of this rank's sequence-parallel peers (DeepSpeed's, made when the engine starts)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    return parallel_state_sp.get_sequence_parallel_group()


def mean_over_slices(loss_sum: torch.Tensor, labelled: torch.Tensor | int, group, zero_stage: int) -> torch.Tensor:
    """The row's mean loss from each rank's summed loss over its slice's `labelled` tokens (each rank's mean
    weighted by its count, as the Trainer's own SP loss weighs them), with the gradient of that mean as one GPU
    training the whole rows would get it.

    The sum is gathered differentiably, so every rank's backward reaches its own slice's graph, at N times its
    share (the all-reduce's backward sums the N ranks' gradients). How DeepSpeed then reduces them depends on the
    ZeRO stage (deepspeed 0.19.8, measured on 2 CPU ranks against one process, the same losses step by step):
    ZeRO-3 averages over all N ranks, which gives the one-GPU gradient (grad_norm 1.2298 against 1.2298); ZeRO-1/2
    divide by the data-parallel size only, which gives N times it (2.4596: the clipping threshold and the logged
    norm move). There the value stays the mean and its gradient is taken at 1/N."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as distributed

    total = distributed.all_reduce(loss_sum.float(), group=group)
    count = torch.as_tensor(labelled, device=loss_sum.device).float()  # a tensor stays on the GPU: no wait
    dist.all_reduce(count, group=group)
    mean = total / count.clamp(min=1)
    if zero_stage >= 3:
        return mean
    n = dist.get_world_size(group)
    return mean / n + (mean - mean / n).detach()
