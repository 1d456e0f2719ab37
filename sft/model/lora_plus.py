"""--loraplus_lr_ratio R: LoRA+ (Hayou et al., 2024), the adapter's B matrices learning at R times the learning rate
of its A matrices, as LLaMA-Factory's and Axolotl's option of the same name (peft's create_loraplus_optimizer).

The Trainer builds its optimizer (ours, torchao's or transformers') with two groups, with and without weight
decay; before its first step, each group's B matrices move to a group of their own at R times its learning rate,
with the rest of its settings. The learning-rate schedule then scales every group alike (from each group's own
rate), and the logged learning rate stays the A matrices' (the first group's).
"""

from __future__ import annotations

import torch

# peft's names of the matrices that LoRA+ speeds up: LoRA's B (lora_B), and B of LoRA on embeddings
B_MATRICES = ("lora_B", "lora_embedding_B")


def is_b_matrix(name: str) -> bool:
    return any(f".{b}." in f".{name}." for b in B_MATRICES)


def split_b_matrices(optimizer: torch.optim.Optimizer, model: torch.nn.Module, ratio: float) -> int:
    """Move the B matrices of each of `optimizer`'s groups to a new group at `ratio` times its learning rate; ->
    how many moved. Only before the first step: the optimizer holds no state yet."""
    if any(optimizer.state.values()):
        raise RuntimeError("LoRA+ groups are made before the first step; this optimizer has stepped already")
    b_ids = {id(p) for name, p in model.named_parameters() if p.requires_grad and is_b_matrix(name)}
    moved = 0
    for group in list(optimizer.param_groups):
        b = [p for p in group["params"] if id(p) in b_ids]
        if not b:
            continue
        group["params"] = [p for p in group["params"] if id(p) not in b_ids]
        optimizer.add_param_group({**{k: v for k, v in group.items() if k != "params"}, "params": b,
                                   "lr": group["lr"] * ratio})
        moved += len(b)
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]  # a group left empty goes
    return moved
