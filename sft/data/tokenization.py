"""Tokens: conversations -> `input_ids` and `labels` in one pass, vectorised over a batch.

The template's segments are joined and tokenized as one text (so ids equal the tokenizer's own encoding of the
rendered text, byte for byte; for DeepSeek LLM/Coder tokenizers, in pieces cut only where the tokenizer itself
always cuts, each distinct piece of a batch once); where each token starts in the text says which segment it
belongs to, and so whether it is trained. For byte-level BPE tokenizers (every DeepSeek one) a token's start is
the running sum of its byte length, read from a table with numpy: asking the tokenizer for offsets costs more
than the tokenization itself. A record whose byte lengths do not add up to its text (a normalizer or an added
token that strips spaces) falls back to the tokenizer's character offsets, so the result is exact either way.
Over-long conversations are cut after the last assistant turn that fits, or dropped, and counted.
A conversation is one row, except where its template shows a turn in later turns' context otherwise than the model
wrote it (R1 deletes earlier reasoning): then each of its examples (sft/data/templates.py `Template.examples`) is a row,
each reply trained in exactly one, so the loss still weighs every reply token once.
(Named `tokenization` rather than `tokenize`, which would shadow the standard library module when
`python sft/train.py` puts `sft/` first on the path.)
"""

from __future__ import annotations

import re
import weakref
from itertools import chain, repeat
from typing import Any

import numpy as np

from sft.errors import DataError
from sft.data.formats import gc_paused
from sft.data.templates import Segment, Template

IGNORE = -100  # the label of a token that is not a target (the loss's ignore_index); every module imports it from here
NOTHING_TRAINED = "no trained tokens"
STATUSES = ("ok", "truncated at a turn boundary", "cut at --max_length", "too long (dropped)", NOTHING_TRAINED)
# Facts about a tokenizer, computed once: {tokenizer: {"size": len(tokenizer), name: value}} (rebuilt if tokens
# are added). Weak keys: a tokenizer that is gone takes its entries with it.
_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fact(tokenizer, name: str, compute):
    facts = _FACTS.get(tokenizer)
    if facts is None or facts["size"] != len(tokenizer):
        facts = _FACTS[tokenizer] = {"size": len(tokenizer)}
    if name not in facts:
        facts[name] = compute(tokenizer)
    return facts[name]


def byte_lengths(tokenizer) -> np.ndarray | None:
    """UTF-8 length of every token id's text, for byte-level BPE tokenizers; None for any other kind."""
    return _fact(tokenizer, "byte_lengths", _byte_lengths)


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


def splits_after_newline(tokenizer) -> bool:
    """Whether the pre-tokenizer cuts the text at every newline before anything else (DeepSeek LLM/Coder do), with
    no normalizer and no added token containing a newline: then text ending in a newline tokenizes the same alone
    as in front of any continuation."""
    return _fact(tokenizer, "splits_after_newline", _splits_after_newline)


def _splits_after_newline(tokenizer) -> bool:
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    spec = json.loads(backend.to_str())
    pre = spec.get("pre_tokenizer") or {}
    first = ((pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]) or [{}])[0] or {}
    normalizer = spec.get("normalizer") or {}
    return bool(first.get("type") == "Split" and first.get("behavior") == "Isolated"
                and (first.get("pattern") or {}).get("Regex") in ("[\r\n]", "[\n\r]")
                # no normalizer that could join across the cut, no added token that spans it
                and not (normalizer.get("normalizers", [normalizer]) if normalizer else [])
                and not any("\n" in t.content or "\r" in t.content for t in tokenizer.added_tokens_decoder.values()))


def splits_at_words(tokenizer) -> bool:
    """Whether, besides newlines, the pre-tokenizer always cuts before a space followed by an ASCII letter and
    between an ASCII letter and punctuation (_PUNCTUATION) after it: its first splits isolate newlines and then
    `\\s?\\p{L}+` (DeepSeek LLM/Coder). A match of that pattern holds a space only as its first character, so a
    space before a letter always starts one; and it takes every letter up to the first non-letter, so punctuation
    after a letter always starts a new piece. Later steps (splits, digits, byte-level without a prefix space) only
    cut pieces further. No added token may contain a space or a letter followed by that punctuation, or strip the
    whitespace around it (it would then match across, or eat, a cut)."""
    return _fact(tokenizer, "splits_at_words", _splits_at_words)


def _splits_at_words(tokenizer) -> bool:
    import json

    if not splits_after_newline(tokenizer):
        return False
    pre = json.loads(tokenizer.backend_tokenizer.to_str())["pre_tokenizer"]
    steps = pre.get("pretokenizers") or [] if pre.get("type") == "Sequence" else [pre]
    letters = next((i for i, step in enumerate(steps) if step.get("type") == "Split"
                    and (step.get("pattern") or {}).get("Regex") == "\\s?\\p{L}+"), None)
    if letters is None or steps[letters].get("behavior") != "Isolated" or steps[letters].get("invert"):
        return False
    before_ok = all(step.get("type") == "Split" and step.get("behavior") == "Isolated" and not step.get("invert")
                    and (step.get("pattern") or {}).get("Regex") in ("[\r\n]", "[\n\r]") for step in steps[:letters])
    after_ok = all(step.get("type") in ("Split", "Digits") or (step.get("type") == "ByteLevel"
                                                                and not step.get("add_prefix_space"))
                   for step in steps[letters + 1:])
    added_ok = not any(" " in t.content or _AFTER_LETTERS.search(t.content) or t.lstrip or t.rstrip or t.single_word
                       for t in tokenizer.added_tokens_decoder.values())
    return before_ok and after_ok and added_ok


def tokenizer_facts(tokenizer) -> dict[str, Any]:
    """What tokenize_batch needs to know about a tokenizer. Computed once and handed to `datasets.map` with the
    function, so that each worker process (which unpickles its own copy of the tokenizer) need not recompute it."""
    return {"byte_lengths": byte_lengths(tokenizer), "splits_after_newline": splits_after_newline(tokenizer),
            "splits_at_words": splits_at_words(tokenizer)}


def tokenize_batch(batch: dict[str, list], *, tokenizer, template: Template, max_length: int,
                   train_on_prompt: bool = False, overlong: str = "truncate", facts: dict[str, Any] | None = None,
                   mask_history: bool = False):
    """`datasets.map(batched=True)` function: messages -> input_ids, labels, length, status (an Arrow table), a
row per example (one per conversation but where the template makes several, see the module docstring). A
`source` column, when the batch has one, names the record in a template's error.

    The text is tokenized whole, except where the tokenizer itself always cuts it (for the DeepSeek LLM and Coder
    pre-tokenizers: at each newline, before each space followed by a letter, between a letter and punctuation):
    there it is cut, and each distinct piece of the batch is tokenized once. A template's fixed parts (BOS and the
    default system prompt, a third of the tokens of a short Alpaca record under the DeepSeek-Coder template;
    `### Response:`) and the words that recur across a batch's records (`the`, `of`, ...) then cost nothing per
    use. The ids are the same either way (tested against the tokenizer on real data and on generated text).

    `mask_history` (LLaMA-Factory's option): only each example's last reply is trained (last_reply_only).

    Python's cyclic garbage collector is off meanwhile (sft.data.formats.gc_paused): with it, one batch in three took
    about twice as long.
    """
    with gc_paused():
        return _tokenize_batch(batch, tokenizer, template, max_length, train_on_prompt, overlong, facts,
                               mask_history)


def _tokenize_batch(batch, tokenizer, template, max_length, train_on_prompt, overlong, facts, mask_history=False):
    import pyarrow as pa

    facts = facts or tokenizer_facts(tokenizer)
    table = facts["byte_lengths"]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cut = table is not None and backend is not None and facts["splits_after_newline"]
    # Every segment of the batch in order: its length (bytes with a byte table, else characters) and whether it
    # is trained; seg_start[i] is record i's first segment.
    texts, record_runs, seg_lengths, seg_flags, seg_start = [], [], [], [], [0]
    records, notes = _examples(batch, template, mask_history)  # from here on a record is one example
    for segments in records:
        text = "".join(t for t, _ in segments)
        texts.append(text)
        if table is not None and not text.isascii():
            seg_lengths += [len(t.encode("utf-8")) for t, _ in segments]
        else:
            seg_lengths += [len(t) for t, _ in segments]
        seg_flags += [trained for _, trained in segments]
        seg_start.append(len(seg_lengths))
        record_runs.append(_runs(segments) if cut else [text])
    bounds = [np.cumsum(seg_lengths[seg_start[i]:seg_start[i + 1]]) for i in range(len(texts))] \
        if table is None else _LazyBounds(seg_lengths, seg_start)
    trained_flags = [seg_flags[seg_start[i]:seg_start[i + 1]] for i in range(len(texts))]
    distinct_runs = list(dict.fromkeys(chain.from_iterable(record_runs)))
    run_index = dict(zip(distinct_runs, range(len(distinct_runs))))
    runs = _encode_runs(distinct_runs, backend, table, cut and facts["splits_at_words"]) \
        if backend is not None else None

    if table is not None and runs is not None:
        ids, labels, lengths, statuses = _mask_batch(runs, run_index, record_runs, seg_lengths, seg_flags,
                                                     seg_start, table, max_length, train_on_prompt)
        special = [i for i, status in enumerate(statuses) if status is None]
    else:
        ids = labels = np.zeros(0, np.int64)
        lengths, statuses, special = [0] * len(texts), [None] * len(texts), list(range(len(texts)))
    # One by one: records the batch path left (byte lengths that do not add up, or no byte table) and the few
    # over --max_length, which need a cut at a turn boundary.
    pieces_ids, pieces_labels, done = [], [], 0
    token_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    for i in special:
        pieces_ids.append(ids[token_offsets[done]:token_offsets[i]])
        pieces_labels.append(labels[token_offsets[done]:token_offsets[i]])
        one_ids, starts = _encode_one(i, texts, record_runs, runs, run_index, bounds, table, tokenizer, records)
        one_ids, one_labels, statuses[i] = _mask(one_ids, starts, bounds[i], trained_flags[i], max_length,
                                                 train_on_prompt, overlong)
        pieces_ids.append(one_ids)
        pieces_labels.append(one_labels)
        lengths[i] = len(one_ids)
        done = i + 1
    pieces_ids.append(ids[token_offsets[done]:])
    pieces_labels.append(labels[token_offsets[done]:])
    # A template's note on an example (a reply it leaves untrained, say) is its status where nothing else is, and
    # where the template itself trains nothing of it (a conversation whose only reply is all reasoning): the note
    # says why, not a --max_length cut. Under --train_on_prompt every token is trained, so such a note is untrue.
    statuses = [note if note and not train_on_prompt
                and (status == "ok" or status == NOTHING_TRAINED and not any(flags)) else status
                for status, note, flags in zip(statuses, notes, trained_flags)]
    offsets = np.zeros(len(texts) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat_ids = np.concatenate(pieces_ids).astype(np.int32)
    flat_labels = np.concatenate(pieces_labels).astype(np.int32)
    return pa.table({
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_ids)),
        "labels": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_labels)),
        "length": pa.array(np.asarray(lengths, dtype=np.int32)),
        "status": pa.array(statuses, type=pa.string()),
    })


class _LazyBounds(dict):
    """Segment ends of record i, made when first asked (only records handled one by one need them)."""

    def __init__(self, seg_lengths: list[int], seg_start: list[int]):
        super().__init__()
        self.seg_lengths, self.seg_start = seg_lengths, seg_start

    def __missing__(self, i: int) -> np.ndarray:
        self[i] = np.cumsum(self.seg_lengths[self.seg_start[i]:self.seg_start[i + 1]], dtype=np.int64)
        return self[i]


# Where a DeepSeek LLM/Coder pre-tokenizer always cuts inside a line: before a space followed by a letter, and
# after a letter followed by punctuation (see splits_at_words).
_WORD = re.compile(r"(?= [A-Za-z])")
_PUNCTUATION = ".,;:!?)'\"/-"
_STARTS_WORD = re.compile(" [A-Za-z]")
_AFTER_LETTERS = re.compile(r"(?<=[A-Za-z])(?=[" + re.escape(_PUNCTUATION) + r"])")
_CHUNK = 1000  # pieces per tokenizer input: fewer inputs cost less per input, a few keep the tokenizer's batching


def _encode_runs(runs: list[str], backend, table: np.ndarray | None, by_word: bool) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of each run -> (all ids, run offsets): run j's ids are ids[offsets[j]:offsets[j + 1]].

    by_word (the tokenizer cuts at every newline, before every space + letter and between a letter and the
    punctuation after it): each run is cut into lines and words, each distinct word into its letters and what
    follows them (`sentence.` and `sentence,` share ` sentence`); the batch's distinct pieces are tokenized once
    each, as a few long inputs (_encode_joined), and put back together. If their bytes do not add up (a token
    across a cut, which the tokenizer's structure rules out), the runs are tokenized whole instead."""
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    if by_word and table is not None:
        # Every line of every run, cut into words; each line ends with a newline piece except a run's last line
        # (that newline is the join's, not the run's: it gets no tokens).
        lines = "\n".join(runs).split("\n")
        words_of_lines = list(map(_WORD.split, lines))
        for words in words_of_lines:
            words.append("\n")
        occurrences = list(chain.from_iterable(words_of_lines))
        words = list(dict.fromkeys(occurrences))
        parts_of_words = list(map(_AFTER_LETTERS.split, words))
        part_occurrences = list(chain.from_iterable(parts_of_words))
        parts = list(dict.fromkeys(part_occurrences))
        found = _encode_joined(parts, encode, table)
        if found is not None:
            word_ids, word_offsets = _gather(*found, _lookup(parts, part_occurrences),
                                             np.fromiter(map(len, parts_of_words), dtype=np.int64, count=len(words)))
            line_ends = np.cumsum(np.fromiter(map(len, words_of_lines), dtype=np.int64, count=len(lines))) - 1
            lines_per_run = np.fromiter(map(str.count, runs, repeat("\n")), dtype=np.int64, count=len(runs)) + 1
            run_ends = line_ends[np.cumsum(lines_per_run) - 1]  # the join's newline after each run
            return _gather(word_ids, word_offsets[:-1], np.diff(word_offsets), _lookup(words, occurrences),
                           np.diff(np.concatenate([[-1], run_ends])), skip=run_ends)
    encoded = [e.ids for e in encode(runs, add_special_tokens=False)]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    ids = np.fromiter(chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum()))
    return ids, np.concatenate([[0], np.cumsum(lengths)])


def _encode_joined(pieces: list[str], encode, table: np.ndarray):
    """Tokenize pieces as a few long texts that each tokenize as their pieces would alone: pieces that start with a
    space + letter are simply concatenated (the tokenizer cuts before each), the others joined by newlines (it cuts
    on both sides of one). -> (ids, first token of each piece, token count of each piece), or None when the bytes
    do not add up."""
    n = len(pieces)
    glued = np.fromiter(map(bool, map(_STARTS_WORD.match, pieces)), dtype=bool, count=n)
    order = np.argsort(~glued, kind="stable")  # the pieces that start with a space + letter first
    n_glued = int(glued.sum())
    ordered = [pieces[i] for i in order.tolist()]
    sizes = np.fromiter(map(len, map(str.encode, ordered)), dtype=np.int64, count=n)  # UTF-8 bytes
    steps = sizes + (np.arange(n) >= n_glued)  # a newline after each of the others
    starts = np.cumsum(steps) - steps  # where each piece starts, the texts laid end to end
    heads = sorted(set(range(0, n_glued, _CHUNK)) | set(range(n_glued, n, _CHUNK)))  # each text's first piece
    texts = [("" if a < n_glued else "\n").join(ordered[a:b]) for a, b in zip(heads, heads[1:] + [n])]
    encoded = [np.asarray(e.ids, dtype=np.int64) for e in encode(texts, add_special_tokens=False)]
    ids = np.concatenate(encoded) if encoded else np.zeros(0, np.int64)
    # Token starts: bytes before the token in its text, plus where the text starts (at its first piece).
    per_text = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    token_sizes = table[ids]
    before = np.cumsum(token_sizes) - token_sizes  # bytes before each token, the texts' tokens end to end
    shift = np.zeros(len(heads), np.int64)
    if len(ids):  # (a text without tokens has no first token, and needs no shift)
        shift = starts[heads] - before[np.minimum(np.cumsum(per_text) - per_text, len(ids) - 1)]
    token_starts = before + np.repeat(shift, per_text)
    first = np.searchsorted(token_starts, starts, side="left")
    last = np.searchsorted(token_starts, starts + sizes, side="left")
    count = last - first
    # Every piece's tokens must cover exactly its bytes.
    covered = np.concatenate([[0], np.cumsum(token_sizes)])
    nonempty = count > 0
    if not (np.array_equal(covered[last] - covered[first], sizes)
            and np.array_equal(token_starts[first[nonempty]], starts[nonempty])):
        return None
    piece_first, piece_count = np.empty(n, np.int64), np.empty(n, np.int64)
    piece_first[order], piece_count[order] = first, count
    return ids, piece_first, piece_count


def _lookup(distinct: list[str], occurrences: list[str]) -> np.ndarray:
    """The index in `distinct` of every occurrence."""
    index = dict(zip(distinct, range(len(distinct))))
    return np.fromiter(map(index.__getitem__, occurrences), dtype=np.int64, count=len(occurrences))


def _gather(ids: np.ndarray, first: np.ndarray, count: np.ndarray, pieces: np.ndarray, per_group: np.ndarray,
            skip: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of groups of pieces, where piece k's tokens are ids[first[k]:first[k] + count[k]]: the groups are
    consecutive runs of the occurrences `pieces` (per_group[g] of them); occurrences at positions `skip` count for
    nothing. -> (ids, offsets): group g's tokens are ids[offsets[g]:offsets[g + 1]]."""
    counts = count[pieces]
    if skip is not None:
        counts[skip] = 0
    ends = np.concatenate([[0], np.cumsum(counts)])
    return ids[_ranges(first[pieces], counts)], ends[np.concatenate([[0], np.cumsum(per_group)])]


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated aranges: starts[k] ... starts[k] + counts[k] - 1 for every k."""
    total = int(counts.sum())
    if not total:
        return np.zeros(0, np.int64)
    return np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(total)


def _mask_batch(runs, run_index, record_runs, seg_lengths, seg_flags, seg_start, table, max_length: int,
                train_on_prompt: bool):
    """Labels for a whole batch with a handful of numpy calls: token start = running sum of byte lengths,
    located among all records' segment ends at once. -> (ids, labels, lengths, statuses); a record whose bytes
    do not add up, or that is over max_length, gets status None and no tokens (the caller does it alone)."""
    n = len(record_runs)
    run_ids, run_offsets = runs
    order = np.fromiter(map(run_index.__getitem__, chain.from_iterable(record_runs)), dtype=np.int64)
    run_lengths = np.diff(run_offsets)[order]
    flat = run_ids[_ranges(run_offsets[order], run_lengths)]
    runs_per_record = np.fromiter(map(len, record_runs), dtype=np.int64, count=n)
    token_cum = np.concatenate([[0], np.cumsum(run_lengths)])
    token_offsets = token_cum[np.concatenate([[0], np.cumsum(runs_per_record)])]
    counts = np.diff(token_offsets)
    record = np.repeat(np.arange(n), counts)  # the record of every token

    sizes = table[flat]
    byte_cum = np.concatenate([[0], np.cumsum(sizes)])
    # Segment ends, and token starts, as positions in the concatenation of all the batch's texts.
    segment_ends = np.cumsum(np.asarray(seg_lengths, dtype=np.int64))
    record_bytes = np.concatenate([[0], segment_ends])[np.asarray(seg_start)]
    whole = np.diff(byte_cum[token_offsets]) == np.diff(record_bytes)
    position = byte_cum[:-1] - byte_cum[token_offsets[:-1]][record] + record_bytes[:-1][record]
    flags = np.asarray(seg_flags, dtype=bool)
    segment = np.minimum(np.searchsorted(segment_ends, position, side="right"), len(flags) - 1)
    labels = flat.copy() if train_on_prompt else np.where(flags[segment], flat, IGNORE)
    labels[token_offsets[:-1][counts > 0]] = IGNORE  # a document's first token is never a target
    trained_cum = np.concatenate([[0], np.cumsum(labels != IGNORE)])
    trained_counts = trained_cum[token_offsets[1:]] - trained_cum[token_offsets[:-1]]

    alone = ~whole | (counts > max_length)
    empty = ~alone & (trained_counts == 0)
    keep = ~(alone | empty)
    statuses = np.where(alone, None, np.where(empty, NOTHING_TRAINED, "ok")).tolist()
    lengths = np.where(keep, counts, 0)
    kept_tokens = keep[record]
    return flat[kept_tokens], labels[kept_tokens], lengths.tolist(), statuses


def _examples(batch: dict[str, list], template: Template,
              mask_history: bool = False) -> tuple[list[list[Segment]], list[str | None]]:
    """Every example of the batch's conversations, in order, and the template's note on each (Template.note, said
    in the summary as a status); a template's DataError names the record. `mask_history`: each conversation's last
    example only (a template that makes one per turn, R1's, trains each earlier reply in one of its own), with its
    last reply alone trained."""
    out, notes = [], []
    for k, messages in enumerate(batch["messages"]):
        try:
            examples = template.examples(messages)
            note = template.note(messages)
        except DataError as e:
            where = batch["source"][k] if "source" in batch else f"conversation {k + 1} of a batch"
            raise DataError(f"{where}: {e}") from None
        if mask_history:
            examples = [last_reply_only(segments) for segments in examples[-1:]]
        out += examples
        notes += [note] * len(examples)
    return out, notes


def last_reply_only(segments: list[Segment]) -> list[Segment]:
    """--mask_history: the example with only its last reply trained, the last run of trained segments (the reply,
    its reasoning and end of turn; the tool results before it stay prompt). Earlier replies become context."""
    last = max((k for k, (_, trained) in enumerate(segments) if trained), default=None)
    if last is None:
        return segments
    first = last
    while first > 0 and segments[first - 1][1]:
        first -= 1
    return [(text, trained and first <= k) for k, (text, trained) in enumerate(segments)]


def _encode_one(i: int, texts, record_runs, runs, run_index, bounds, table, tokenizer, records):
    """One record's ids and token starts (in the units of bounds[i]; switched to characters when the byte
    lengths do not add up to its text)."""
    if runs is not None:
        run_ids, run_offsets = runs
        ids = np.concatenate([np.zeros(0, np.int64)] + [
            run_ids[run_offsets[run_index[run]]:run_offsets[run_index[run] + 1]] for run in record_runs[i]])
    else:
        ids = np.asarray(tokenizer(texts[i], add_special_tokens=False)["input_ids"], dtype=np.int64)
    if table is not None and len(ids):
        sizes = table[ids]
        ends = np.cumsum(sizes)
        if ends[-1] == bounds[i][-1]:
            return ids, ends - sizes
    # Character offsets from the tokenizer (slower; exact for any tokenizer).
    bounds[i] = np.cumsum([len(t) for t, _ in records[i]])
    encoded = tokenizer(texts[i], add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], dtype=np.int64)
    return ids, np.fromiter((o[0] for o in encoded["offset_mapping"]), dtype=np.int64, count=len(ids))


def _runs(segments: list[tuple[str, bool]]) -> list[str]:
    """The text cut before and after every newline that ends or starts a segment (a cut the tokenizer makes)."""
    runs, current = [], ""
    for text, _ in segments:
        if current and text and (current[-1] in "\r\n" or text[0] in "\r\n"):
            runs.append(current)
            current = text
        else:
            current += text
    if current or not runs:
        runs.append(current)
    return runs


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
        if overlong in ("truncate", "cut") and len(fitting):
            ids, labels, status = ids[: fitting[-1]], labels[: fitting[-1]], "truncated at a turn boundary"
        elif overlong == "cut":  # no reply fits whole: keep the first max_length tokens (LLaMA-Factory's cutoff_len)
            ids, labels, status = ids[:max_length], labels[:max_length], "cut at --max_length"
        else:
            ids, labels, status = ids[:0], labels[:0], "too long (dropped)"
    if status != "too long (dropped)" and not (labels != IGNORE).any():
        ids, labels, status = ids[:0], labels[:0], NOTHING_TRAINED
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


def tokenize_examples(messages: list[dict[str, Any]], *, tokenizer, template: Template, max_length: int,
                      train_on_prompt: bool = False, overlong: str = "truncate",
                      mask_history: bool = False) -> list[dict[str, Any]]:
    """One conversation -> a {"input_ids", "labels", "length", "status"} row per example, as Python values."""
    return tokenize_batch({"messages": [messages]}, tokenizer=tokenizer, template=template, max_length=max_length,
                          train_on_prompt=train_on_prompt, overlong=overlong, mask_history=mask_history).to_pylist()


def tokenize_one(messages: list[dict[str, Any]], **options) -> dict[str, Any]:
    """One conversation that makes one example -> its row (tests); tokenize_examples' options."""
    rows = tokenize_examples(messages, **options)
    if len(rows) != 1:
        raise ValueError(f"this conversation makes {len(rows)} examples; use tokenize_examples")
    return rows[0]
