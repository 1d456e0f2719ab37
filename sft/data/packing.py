"""Batches: (packed) token rows -> padded tensors, plugged into the Trainer as its data collator.

Packing puts several documents in one row of at most `max_length` tokens (best-fit decreasing). Documents are
kept apart by `position_ids` that restart at 0 for each one, with no attention_mask: transformers then builds a
block-diagonal causal mask (eager/sdpa/flex) or runs varlen kernels (flash attention), so no token attends
across documents. That only holds when the forward pass creates no KV cache: every batch carries
`use_cache=False` (the model's config keeps the base's value, which a saved model should have), and any forward of
our own must pass it too. Each document's first label is already -100 (sft/data/tokenization.py), so no target crosses
a document boundary either.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sft.data.formats import gc_paused
from sft.data.tokenization import IGNORE

if TYPE_CHECKING:
    import torch


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of indices whose lengths sum to at most `capacity`; longest first, each into the fullest bin it fits."""
    import numpy as np

    sizes = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-sizes, kind="stable")  # longest first; equal lengths in index order
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, bin index), sorted
    with gc_paused():  # a tuple per document: collections would walk the whole process now and then (4x slower)
        for i, size in zip(order.tolist(), sizes[order].tolist()):
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


def pack_rows(input_ids, labels, max_length: int):
    """Concatenate documents into packed rows (an Arrow table); `seq_lengths` records each row's documents.

    `input_ids`/`labels` are Arrow list arrays (or lists of lists); empty documents are left out. The work is one
    gather over the flat token arrays, so packing 52,000 conversations takes a fraction of a second.
    """
    import numpy as np
    import pyarrow as pa

    ids, labs = _as_list_array(input_ids), _as_list_array(labels)
    offsets = ids.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    offsets -= offsets[0]  # a sliced array's offsets need not start at 0; flatten() starts at its first value
    lengths = np.diff(offsets)
    documents = np.flatnonzero(lengths)
    bins = best_fit_decreasing(lengths[documents].tolist(), max_length)
    order = documents[np.fromiter((i for members in bins for i in members), dtype=np.int64, count=len(documents))]
    doc_lengths = lengths[order]
    # Gather index: for each document in packed order, the positions of its tokens in the flat arrays.
    doc_starts = np.repeat(offsets[:-1][order] - np.concatenate([[0], np.cumsum(doc_lengths)[:-1]]), doc_lengths)
    gather = doc_starts + np.arange(doc_lengths.sum())
    values_ids = ids.flatten().to_numpy(zero_copy_only=False)[gather] if len(gather) else np.zeros(0, np.int32)
    values_labels = labs.flatten().to_numpy(zero_copy_only=False)[gather] if len(gather) else np.zeros(0, np.int32)
    docs_per_row = np.fromiter((len(m) for m in bins), dtype=np.int64, count=len(bins))
    doc_offsets = np.concatenate([[0], np.cumsum(docs_per_row)]).astype(np.int32)
    token_offsets = np.concatenate([[0], np.cumsum(doc_lengths)])[doc_offsets].astype(np.int32)
    return pa.table({
        "input_ids": pa.ListArray.from_arrays(pa.array(token_offsets), pa.array(values_ids)),
        "labels": pa.ListArray.from_arrays(pa.array(token_offsets), pa.array(values_labels)),
        "seq_lengths": pa.ListArray.from_arrays(pa.array(doc_offsets), pa.array(doc_lengths.astype(np.int32))),
    })


def _as_list_array(column):
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not isinstance(column, (pa.ListArray, pa.LargeListArray)):
        column = pa.array(column, type=pa.list_(pa.int32()))
    return column


def position_ids_for(seq_lengths: list[int]) -> torch.Tensor:
    import torch

    return torch.cat([torch.arange(n) for n in seq_lengths]) if seq_lengths else torch.zeros(0, dtype=torch.long)


# A batch's key for its non-padding token count, a Python int (the model's forward does not take it: SFTTrainer
# takes it out before the forward)
NUM_INPUT_TOKENS = "num_input_tokens"


@dataclass
class Collator:
    """Pad a list of rows into a batch. Packed rows (with `seq_lengths`) get position_ids and no attention_mask;
    their padding forms one more document of its own, whose labels are all ignored. `positions`: rows of one
    conversation get them too, as a pack of one (sequence parallelism: DeepSpeed slices each row and gathers the
    positions back, and drops any attention mask). `counts_tokens`: the batch also holds its non-padding token
    count as a Python int under NUM_INPUT_TOKENS, for SFTTrainer (a plain Trainer would hand it to the model)."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    positions: bool = False
    counts_tokens: bool = False

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor | bool | int]:
        import torch

        longest = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        packed = "seq_lengths" in rows[0] or self.positions
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
                batch["position_ids"][i] = position_ids_for(list(row.get("seq_lengths", [n])) + [longest - n])
            else:
                batch["attention_mask"][i, :n] = 1
        # A cache breaks the packed mask (and serves no purpose in training): off in every training and eval forward
        # whatever config.use_cache says (the Trainer hands the batch to model(**batch) as it is).
        batch["use_cache"] = False
        if self.counts_tokens:
            # The Trainer's non-padding count of this batch (its own rule), made here on the host: counted on the
            # GPU, reading it (`.item()`) makes the host wait for the micro-batch's backward.
            counted = batch["attention_mask"].sum() if "attention_mask" in batch else (
                batch["input_ids"] != self.pad_token_id).sum()
            batch[NUM_INPUT_TOKENS] = int(counted)
        return batch
