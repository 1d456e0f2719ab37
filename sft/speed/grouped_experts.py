"""transformers' grouped_mm experts forward (transformers/integrations/moe.py), written out once with its projections
left to the caller: transformers gives no hook for the matmul alone. Its users: the routed experts' FP8 grouped
matmuls on e4m3 weights as held (sft/speed/fp8_experts.py) and their LoRA beside the bf16 grouped matmul
(sft/speed/expert_lora.py).

The (token, expert) pairs are sorted by expert, so that each expert's tokens are one block of rows (`offsets`, the
blocks' ends); each block goes through its expert's gate/up projection, the gate, and its down projection; the
rows are weighted by the router and summed back per token, in transformers' order (no atomic adds).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

# project(weight name, rows sorted by expert, their expert ids, offsets) -> the rows through each expert's weight
Projection = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def routed_experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, project: Projection) -> torch.Tensor:
    tokens, top_k = top_k_index.shape
    expert_ids, order = torch.sort(top_k_index.reshape(-1))
    x = hidden_states[order // top_k]
    # histc, not bincount (no host sync); CPU histc wants floats, CUDA's deterministic one integers
    ids = expert_ids.float() if expert_ids.device.type == "cpu" else expert_ids.int()
    counts = torch.histc(ids, bins=experts.num_experts, min=0, max=experts.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    if experts.has_gate:
        h = experts._apply_gate(project("gate_up_proj", x, expert_ids, offsets))
    else:
        h = experts.act_fn(project("up_proj", x, expert_ids, offsets))
    out = project("down_proj", h, expert_ids, offsets)
    if experts.has_post_expert_norm:
        out = experts.post_expert_norm(out)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return out[back].view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)
