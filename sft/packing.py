"""Batches: (packed) token rows -> padded tensors, plugged into the Trainer as its data collator.

Packing puts several documents in one row of at most `max_length` tokens (best-fit decreasing). Documents are
kept apart by `position_ids` that restart at 0 for each one, with no attention_mask: transformers then builds a
block-diagonal causal mask (eager/sdpa/flex) or runs varlen kernels (flash attention), so no token attends
across documents. That only holds when the forward pass creates no KV cache: the Trainer sets
`use_cache=False`, and any forward of our own must too. Each document's first label is already -100
(sft/tokenization.py), so no target crosses a document boundary either.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

IGNORE = -100


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of indices whose lengths sum to at most `capacity`; longest first, each into the fullest bin it fits."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, bin index), sorted
    for i in order:
        size = lengths[i]
        slot = bisect.bisect_left(free, (size, -1))
        if slot < len(free):
            space, b = free.pop(slot)
        else:
            space, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if space - size > 0:
            bisect.insort(free, (space - size, b))
    return bins


def pack_rows(input_ids: list[list[int]], labels: list[list[int]], max_length: int) -> dict[str, list]:
    """Concatenate documents into packed rows; `seq_lengths` records each row's document lengths."""
    bins = best_fit_decreasing([len(x) for x in input_ids], max_length)
    rows: dict[str, list] = {"input_ids": [], "labels": [], "seq_lengths": []}
    for members in bins:
        rows["input_ids"].append([t for i in members for t in input_ids[i]])
        rows["labels"].append([t for i in members for t in labels[i]])
        rows["seq_lengths"].append([len(input_ids[i]) for i in members])
    return rows


def position_ids_for(seq_lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in seq_lengths]) if seq_lengths else torch.zeros(0, dtype=torch.long)


@dataclass
class Collator:
    """Pad a list of rows into a batch. Packed rows (with `seq_lengths`) get position_ids and no attention_mask;
    their padding forms one more document of its own, whose labels are all ignored."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        packed = "seq_lengths" in rows[0]
        batch = {
            "input_ids": torch.full((len(rows), longest), self.pad_token_id, dtype=torch.long),
            "labels": torch.full((len(rows), longest), IGNORE, dtype=torch.long),
        }
        if packed:
            batch["position_ids"] = torch.zeros((len(rows), longest), dtype=torch.long)
        else:
            batch["attention_mask"] = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            batch["input_ids"][i, :n] = torch.as_tensor(row["input_ids"])
            batch["labels"][i, :n] = torch.as_tensor(row["labels"])
            if packed:
                batch["position_ids"][i] = position_ids_for(list(row["seq_lengths"]) + [longest - n])
            else:
                batch["attention_mask"][i, :n] = 1
        return batch
