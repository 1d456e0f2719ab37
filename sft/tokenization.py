"""Tokens: conversations -> `input_ids` and `labels` in one pass, vectorised over a batch.

The template's segments are joined and tokenized once (so ids equal the tokenizer's own encoding of the rendered
text, byte for byte); where each token starts in the text says which segment it belongs to, and so whether it is
trained. For byte-level BPE tokenizers (every DeepSeek one) a token's start is the running sum of its byte length,
read from a table with numpy: asking the tokenizer for offsets costs more than the tokenization itself. A record
whose byte lengths do not add up to its text (a normalizer or an added token that strips spaces) falls back to
the tokenizer's character offsets, so the result is exact either way.
Over-long conversations are cut after the last assistant turn that fits, or dropped, and counted.
(Named `tokenization` rather than `tokenize`, which would shadow the standard library module when
`python sft/train.py` puts `sft/` first on the path.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sft.templates import Template

IGNORE = -100
STATUSES = ("ok", "truncated at a turn boundary", "too long (dropped)", "no trained tokens")
_BYTE_TABLES: dict[int, np.ndarray | None] = {}


def byte_lengths(tokenizer) -> np.ndarray | None:
    """UTF-8 length of every token id's text, for byte-level BPE tokenizers; None for any other kind."""
    key = id(tokenizer)
    if key not in _BYTE_TABLES:
        _BYTE_TABLES[key] = _byte_lengths(tokenizer)
    return _BYTE_TABLES[key]


def _byte_lengths(tokenizer) -> np.ndarray | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    table = np.zeros(max(len(tokenizer), backend.get_vocab_size(with_added_tokens=True)), dtype=np.int64)
    for text, token_id in backend.get_vocab(with_added_tokens=False).items():
        table[token_id] = len(text)  # byte-level vocabulary: one character per byte
    for token_id, added in tokenizer.added_tokens_decoder.items():  # matched on the raw text
        table[token_id] = len(added.content.encode("utf-8"))
    return table


def tokenize_batch(batch: dict[str, list], *, tokenizer, template: Template, max_length: int,
                   train_on_prompt: bool = False, overlong: str = "truncate"):
    """`datasets.map(batched=True)` function: messages -> input_ids, labels, length, status (an Arrow table)."""
    import pyarrow as pa

    table = byte_lengths(tokenizer)
    texts, bounds, trained_flags = [], [], []
    for messages in batch["messages"]:
        segments = template.render(messages)
        texts.append("".join(text for text, _ in segments))
        if table is not None:  # segment ends in bytes (the text is encoded once below to check the sum)
            bounds.append(np.cumsum([len(text.encode("utf-8")) for text, _ in segments]))
        else:
            bounds.append(np.cumsum([len(text) for text, _ in segments]))
        trained_flags.append([trained for _, trained in segments])
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False) \
        if hasattr(tokenizer, "backend_tokenizer") else None

    out_ids, out_labels, lengths, statuses = [], [], [], []
    for i, text in enumerate(texts):
        if encodings is not None:
            ids = np.asarray(encodings[i].ids, dtype=np.int64)
        else:
            ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
        starts = None
        if table is not None and len(ids):
            sizes = table[ids]
            ends = np.cumsum(sizes)
            if ends[-1] == bounds[i][-1]:
                starts = ends - sizes
        if starts is None:  # character offsets from the tokenizer (slower; exact for any tokenizer)
            if table is not None:
                bounds[i] = np.cumsum([len(t) for t, _ in template.render(batch["messages"][i])])
            offsets = encodings[i].offsets if encodings is not None else tokenizer(
                text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            starts = np.fromiter((o[0] for o in offsets), dtype=np.int64, count=len(offsets))
        ids, labels, status = _mask(ids, starts, bounds[i], trained_flags[i], max_length, train_on_prompt, overlong)
        out_ids.append(ids)
        out_labels.append(labels)
        lengths.append(len(ids))
        statuses.append(status)
    offsets = np.zeros(len(out_ids) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat_ids = np.concatenate(out_ids).astype(np.int32) if out_ids else np.zeros(0, np.int32)
    flat_labels = np.concatenate(out_labels).astype(np.int32) if out_labels else np.zeros(0, np.int32)
    return pa.table({
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_ids)),
        "labels": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_labels)),
        "length": pa.array(np.asarray(lengths, dtype=np.int32)),
        "status": pa.array(statuses, type=pa.string()),
    })


def _mask(ids: np.ndarray, starts: np.ndarray, bounds: np.ndarray, trained: list[bool], max_length: int,
          train_on_prompt: bool, overlong: str) -> tuple[np.ndarray, np.ndarray, str]:
    """Labels from where tokens start; then the length policy. -> (ids, labels, status)."""
    segment = np.searchsorted(bounds, starts, side="right")  # the segment each token starts in
    segment = np.minimum(segment, len(trained) - 1)
    is_trained = np.asarray(trained, dtype=bool)[segment]
    labels = ids.copy() if train_on_prompt else np.where(is_trained, ids, IGNORE)
    if len(labels):
        labels[0] = IGNORE  # a document's first token is never a target (and never one across documents)
    status = "ok"
    if len(ids) > max_length:
        # Cut after the last assistant turn that fits: at the first token that starts at or after its end.
        turn_ends = bounds[np.flatnonzero(np.asarray(trained[:-1]) & ~np.asarray(trained[1:]))] \
            if len(trained) > 1 else np.zeros(0, dtype=np.int64)
        if trained and trained[-1]:
            turn_ends = np.append(turn_ends, bounds[-1])
        cuts = np.searchsorted(starts, turn_ends, side="left")
        fitting = cuts[(cuts <= max_length) & (cuts > 0)]
        if overlong == "truncate" and len(fitting):
            ids, labels, status = ids[: fitting[-1]], labels[: fitting[-1]], "truncated at a turn boundary"
        else:
            ids, labels, status = ids[:0], labels[:0], "too long (dropped)"
    if status != "too long (dropped)" and not (labels != IGNORE).any():
        ids, labels, status = ids[:0], labels[:0], "no trained tokens"
    return ids, labels, status


def render_mask(input_ids: list[int], labels: list[int], tokenizer) -> str:
    """Decoded text with every run of trained tokens between [[ and ]], for auditing masks by eye."""
    pieces, run, trained = [], [], None
    for token, label in zip(input_ids, labels):
        is_trained = label != IGNORE
        if trained is not None and is_trained != trained:
            pieces.append((run, trained))
            run = []
        run.append(token)
        trained = is_trained
    if run:
        pieces.append((run, trained))
    return "".join(f"[[{tokenizer.decode(ids)}]]" if t else tokenizer.decode(ids) for ids, t in pieces)


def tokenize_one(messages: list[dict[str, Any]], *, tokenizer, template: Template, max_length: int,
                 train_on_prompt: bool = False, overlong: str = "truncate") -> dict[str, Any]:
    """One conversation -> {"input_ids", "labels", "length", "status"} as Python values (tests, --show_masks)."""
    row = tokenize_batch({"messages": [messages]}, tokenizer=tokenizer, template=template, max_length=max_length,
                         train_on_prompt=train_on_prompt, overlong=overlong).to_pylist()[0]
    return row
