"""`--neftune_noise_alpha A` (NEFTune, Jain et al. 2023; TRL, Axolotl and LLaMA-Factory take the same option):
uniform noise in [-1, 1] x A / sqrt(L x d) added to the input embeddings of every training forward, where d is the
hidden size and L the length of the sequence a token belongs to.

transformers' own hook (`Trainer(neftune_noise_alpha=...)`) takes L from the batch's shape: the whole packed row,
so the ~15 Alpaca conversations of a 2,048-token row each get 1/sqrt(15) of the noise the paper gives a sequence
(and the same conversation gets another noise at another --max_length). Here L is each token's own conversation:
its document in a packed row, its real length in a padded one (NOISE_LENGTHS, counted by the collator on the host),
so the noise is the paper's whatever the packing. SFTTrainer runs this hook in place of the Trainer's; evaluation,
generation and the saved model never see noise.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


@contextlib.contextmanager
def noisy_embeddings(embeddings: nn.Module, alpha: float, lengths: torch.Tensor | None):
    """Within the block, `embeddings`' output gets NEFTune's noise; `lengths` (rows x length, each token's sequence
    length) sets each token's scale, or the row's whole length where it is None (transformers' rule)."""

    def add_noise(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        hidden = output.shape[-1]
        if lengths is None:
            scale = alpha / (output.shape[-2] * hidden) ** 0.5
        else:  # [rows, length, 1]: each token's alpha / sqrt(L x d)
            scale = (alpha / (lengths.to(output.device, torch.float32) * hidden).sqrt()).unsqueeze(-1).to(output.dtype)
        return output + torch.empty_like(output).uniform_(-1.0, 1.0) * scale

    handle = embeddings.register_forward_hook(add_noise)
    try:
        yield
    finally:
        handle.remove()


def noise_line(alpha: float, packing: bool) -> str:
    """The first screen's line for a NEFTune run."""
    of = "its own conversation's length, in a packed row too" if packing else "its row's real length"
    return (f"NEFTune: noise of alpha {alpha:g} / sqrt(L x hidden size) on the input embeddings of each training "
            f"forward (L: {of})")
