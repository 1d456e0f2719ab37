"""Batches: (packed) token rows -> padded tensors, plugged into the Trainer as its data collator.

Packing puts several documents in one row of at most `max_length` tokens (best-fit decreasing). Documents are
kept apart by `position_ids` that restart at 0 for each one, with no attention_mask: transformers then builds a
block-diagonal causal mask (eager/sdpa/flex) or runs varlen kernels (flash attention), so no token attends
across documents. Under eager/sdpa/flex SFTTrainer builds that mask itself from the collator's DOCUMENT_IDS
(sft/speed/packed_mask.py: the same mask, without transformers' wait for the GPU to find the documents). That
only holds when the forward pass creates no KV cache: every batch carries `use_cache=False` (the model's config
keeps the base's value, which a saved model should have), and any forward of our own must pass it too. Each
document's first label is already -100 (sft/data/tokenization.py), so no target crosses a document boundary either.
"""

from __future__ import annotations

import bisect
import itertools
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


def rows_with_several_documents(rows) -> int:
    """How many packed rows (a datasets.Dataset or dict with `seq_lengths`) hold two documents or more: the rows
    that need a block-diagonal mask, where a row of one document needs only the causal order."""
    return sum(sum(1 for length in lengths if length) > 1 for lengths in rows["seq_lengths"])


def longest_document(rows) -> int:
    """The longest document of the training rows (a datasets.Dataset), in tokens: its last position is the farthest
    the model reads, since a packed row's positions restart at each document (`seq_lengths`)."""
    import pyarrow.compute as pc

    if not len(rows):
        return 0
    if "seq_lengths" in rows.column_names:
        return int(pc.max(pc.list_flatten(rows.data.column("seq_lengths"))).as_py() or 0)
    return int(pc.max(pc.list_value_length(rows.data.column("input_ids"))).as_py() or 0)


def position_ids_for(seq_lengths: list[int]) -> torch.Tensor:
    import torch

    return torch.cat([torch.arange(n) for n in seq_lengths]) if seq_lengths else torch.zeros(0, dtype=torch.long)


# The batch's keys that SFTTrainer takes out before the forward (the model does not take them), each made here on
# the host so that the step never waits for the GPU to learn it:
# its non-padding token count, a Python int
NUM_INPUT_TOKENS = "num_input_tokens"
# the labelled tokens' places in the shifted (rows x length) layout: flat int64 indices p = row * length + t of
# the positions t whose next token has a label (the loss picks them with index_select: its size is known on the host)
LABELLED_POSITIONS = "labelled_positions"
# each token's document in its row (rows x length; the padding is one more document): the block-diagonal causal
# mask is built from them (sft/speed/packed_mask.py) instead of transformers finding the documents from
# position_ids, which reads a GPU tensor on the host at every forward
DOCUMENT_IDS = "document_ids"
# the MoE balance loss's token groups (sft/model/moe.py), where it would find them with a boolean mask and
# torch.unique (two waits) and pick each MoE layer's router outputs with that mask (one more per layer): the real
# (not padding) tokens' flat int64 indices p = row * length + t, in order; each one's sequence number 0..S-1 (a
# padded batch's rows, a packed batch's documents, numbered over the batch in order); and S, a Python int
REAL_TOKENS = "real_tokens"
TOKEN_SEQUENCES = "token_sequences"
SEQUENCE_COUNT = "sequence_count"
# each token's sequence length (rows x length): its document's in a packed row, the row's real length in a padded
# one (padding: the padding's own length); --neftune_noise_alpha scales its noise by it (sft/model/neftune.py)
NOISE_LENGTHS = "noise_lengths"
# packed rows' documents for --attn_implementation varlen (sft/speed/varlen_attention.py): their start offsets over
# the batch's flattened tokens and the end, [0, l0, l0+l1, ...] (int32; a row's padding counted in its last document)
CU_SEQ_LENS = "cu_seq_lens"
COLLATOR_KEYS = (NUM_INPUT_TOKENS, LABELLED_POSITIONS, DOCUMENT_IDS, REAL_TOKENS, TOKEN_SEQUENCES, SEQUENCE_COUNT,
                 NOISE_LENGTHS, CU_SEQ_LENS)


def labelled_positions(labels: torch.Tensor) -> torch.Tensor:
    """LABELLED_POSITIONS of a batch's labels (rows x length): the flat places whose next token has a label."""
    import torch

    targets = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[:, 1:].reshape(-1)
    return (targets != IGNORE).nonzero().squeeze(1)


def token_sequences(documents: list[list[int]], length: int) -> dict[str, torch.Tensor | int]:
    """REAL_TOKENS, TOKEN_SEQUENCES and SEQUENCE_COUNT of a batch whose row i (`length` wide) starts with the real
    documents of lengths `documents[i]` (no empty one), its padding after them."""
    import torch

    rows = [torch.arange(i * length, i * length + sum(docs)) for i, docs in enumerate(documents)]
    lengths = torch.tensor([n for docs in documents for n in docs], dtype=torch.long)
    return {REAL_TOKENS: torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long),
            TOKEN_SEQUENCES: torch.repeat_interleave(torch.arange(len(lengths)), lengths),
            SEQUENCE_COUNT: len(lengths)}


@dataclass
class Collator:
    """Pad a list of rows into a batch. Packed rows (with `seq_lengths`) get position_ids and no attention_mask;
    their padding continues their last document (it follows every real token, so under causal attention none of
    them reads it), and its labels are all ignored. `positions`: rows of one
    conversation get them too, as a pack of one (sequence parallelism: DeepSpeed slices each row and gathers the
    positions back, and drops any attention mask). `counts_tokens`: the batch also holds its non-padding token
    count as a Python int under NUM_INPUT_TOKENS, for SFTTrainer (a plain Trainer would hand it to the model).
    `labelled_positions`: the labelled tokens' places under LABELLED_POSITIONS (SFTTrainer's labelled-token loss).
    `document_ids`: packed rows' documents under DOCUMENT_IDS (SFTTrainer builds their mask); where every row is
    one document (with or without padding) there is nothing to mask but the causal order, and the batch holds
    neither them nor position_ids (the model's own positions are the same 0..length-1). `token_sequences`: the real
    tokens and their sequences (a padded row, a packed document) under REAL_TOKENS, TOKEN_SEQUENCES and
    SEQUENCE_COUNT (the MoE balance loss, sft/model/moe.py). `noise_lengths`: each token's sequence length under
    NOISE_LENGTHS (NEFTune's scale, sft/model/neftune.py). `document_starts`: packed rows' documents' start offsets
    under CU_SEQ_LENS (--attn_implementation varlen), where a row holds two documents or more."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    positions: bool = False
    counts_tokens: bool = False
    labelled_positions: bool = False
    document_ids: bool = False
    token_sequences: bool = False
    noise_lengths: bool = False
    document_starts: bool = False

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
        documents = [] if packed and self.document_ids else None
        starts = [0] if packed and self.document_starts else None  # CU_SEQ_LENS
        real_documents = [] if self.token_sequences else None  # each row's real documents' lengths (padded: one)
        if self.noise_lengths:
            batch[NOISE_LENGTHS] = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            batch["input_ids"][i, :n] = torch.as_tensor(row["input_ids"])
            batch["labels"][i, :n] = torch.as_tensor(row["labels"])
            real = [length for length in (row.get("seq_lengths", [n]) if packed else [n]) if length]  # documents
            if self.noise_lengths:  # each real document's tokens its length, the padding the padding's
                spans = real + ([longest - n] if longest > n else [])
                batch[NOISE_LENGTHS][i] = torch.repeat_interleave(torch.tensor(spans), torch.tensor(spans))
            if real_documents is not None:
                real_documents.append(real)
            if packed:  # the padding continues the last document: causal attention keeps every real token from
                # reading it (it follows them all), and its own outputs train nothing. So a row of one document and
                # padding needs no mask but the causal order, and sdpa keeps its fused causal kernel.
                lengths = [length for length in row.get("seq_lengths", [n]) if length] or [0]
                lengths[-1] += longest - n
                batch["position_ids"][i] = position_ids_for(lengths)
                if documents is not None:
                    documents.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
                if starts is not None:
                    starts += [starts[-1] + end for end in itertools.accumulate(lengths)]  # built, then added
            else:
                batch["attention_mask"][i, :n] = 1
        if documents is not None:
            if any(int(row[-1]) for row in documents):  # a row of two documents or more
                batch[DOCUMENT_IDS] = torch.stack(documents)
            else:
                del batch["position_ids"]
        if starts is not None and len(starts) > len(rows) + 1:  # a row of two documents or more: the kernel's
            # offsets. Rows of one document each need only the causal order (the attention's sdpa path).
            batch[CU_SEQ_LENS] = torch.tensor(starts, dtype=torch.int32)
        if self.labelled_positions:
            batch[LABELLED_POSITIONS] = labelled_positions(batch["labels"])
        if real_documents is not None:
            batch.update(token_sequences(real_documents, longest))
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
