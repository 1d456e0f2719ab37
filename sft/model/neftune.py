"""`--neftune_noise_alpha A` (NEFTune, Jain et al. 2023; TRL, Axolotl and LLaMA-Factory take the same option):
uniform noise in [-1, 1] x A / sqrt(L x d) added to the input embeddings of every training forward, where d is the
hidden size and L the length of the sequence a token belongs to.

transformers' own hook (`Trainer(neftune_noise_alpha=...)`) takes L from the batch's shape: the whole packed row,
so the ~15 Alpaca conversations of a 2,048-token row each get 1/sqrt(15) of the noise the paper gives a sequence
(and the same conversation gets another noise at another --max_length). Here L is each token's own conversation:
its document in a packed row, its real length in a padded one (NOISE_LENGTHS, counted by the collator on the host),
so the noise is the paper's whatever the packing. SFTTrainer runs this hook in place of the Trainer's, attached for
the length of `train()` as the Trainer attaches its own; evaluation, generation and the saved model see no noise.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class NoisyEmbeddings:
    """The forward hook: `lengths` (rows x length, each token's sequence length) is the batch's, set by the trainer
    before each training forward; None: the row's whole length (transformers' rule)."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.lengths: torch.Tensor | None = None

    def __call__(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        hidden = output.shape[-1]
        if self.lengths is None:
            scale = self.alpha / (output.shape[-2] * hidden) ** 0.5
        else:  # [rows, length, 1]: each token's alpha / sqrt(L x d)
            lengths = self.lengths.to(output.device, torch.float32)
            scale = (self.alpha / (lengths * hidden).sqrt()).unsqueeze(-1).to(output.dtype)
        return output + torch.empty_like(output).uniform_(-1.0, 1.0) * scale

    @contextlib.contextmanager
    def attached(self, embeddings: nn.Module):
        """The hook on `embeddings` within the block (a training), none after it."""
        handle = embeddings.register_forward_hook(self)
        try:
            yield
        finally:
            handle.remove()
            self.lengths = None


def noise_line(alpha: float, packing: bool) -> str:
    """The first screen's line for a NEFTune run."""
    of = "its own conversation's length, in a packed row too" if packing else "its row's real length"
    return (f"NEFTune: noise of alpha {alpha:g} / sqrt(L x hidden size) on the input embeddings of each training "
            f"forward (L: {of})")
