"""Tokens: conversations -> `input_ids` and `labels` in one pass.

The template's segments are joined and tokenized once (so ids equal the tokenizer's own encoding of the
rendered text); each token's character offset says which segment it starts in, and so whether it is trained.
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


def tokenize_batch(batch: dict[str, list], *, tokenizer, template: Template, max_length: int,
                   train_on_prompt: bool = False, overlong: str = "truncate") -> dict[str, list[Any]]:
    """`datasets.map(batched=True)` function: messages -> input_ids, labels, length, status."""
    texts, spans = [], []
    for messages in batch["messages"]:
        segments = template.render(messages)
        starts, ends, pos = [], [], 0
        for text, trained in segments:
            if trained and text:
                starts.append(pos)
                ends.append(pos + len(text))
            pos += len(text)
        texts.append("".join(text for text, _ in segments))
        spans.append((np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64)))
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    out: dict[str, list] = {"input_ids": [], "labels": [], "length": [], "status": []}
    for ids, offsets, (starts, ends) in zip(encoded["input_ids"], encoded["offset_mapping"], spans):
        token_starts = np.fromiter((o[0] for o in offsets), dtype=np.int64, count=len(offsets))
        segment = np.searchsorted(starts, token_starts, side="right") - 1
        trained = (segment >= 0) & (token_starts < ends[np.maximum(segment, 0)]) if len(starts) else \
            np.zeros(len(ids), dtype=bool)
        ids = np.asarray(ids, dtype=np.int64)
        labels = np.where(trained, ids, IGNORE) if not train_on_prompt else ids.copy()
        if len(labels):
            labels[0] = IGNORE  # a document's first token is never a target (and never one across documents)
        status = "ok"
        if len(ids) > max_length:
            # Tokens that start before the end of each assistant turn: cut after the last turn that fits.
            fitting = [n for n in np.searchsorted(token_starts, ends, side="left") if n <= max_length]
            if overlong == "truncate" and fitting and fitting[-1] > 0:
                ids, labels, status = ids[: fitting[-1]], labels[: fitting[-1]], "truncated at a turn boundary"
            else:
                ids, labels, status = ids[:0], labels[:0], "too long (dropped)"
        if status != "too long (dropped)" and not (labels != IGNORE).any():
            ids, labels, status = ids[:0], labels[:0], "no trained tokens"
        out["input_ids"].append(ids.tolist())
        out["labels"].append(labels.tolist())
        out["length"].append(len(ids))
        out["status"].append(status)
    return out


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
